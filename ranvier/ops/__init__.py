"""Op definitions. Importing this package registers every op family."""

from . import attention, elementwise, fused, index, matmul, nn, nn_grad, reduce, shape, state, window  # noqa: F401  (registration)
from .registry import Attrs, InferContext, OpDef, TensorType, all_ops, define, has_op, op_def

__all__ = ["Attrs", "InferContext", "OpDef", "TensorType", "all_ops", "define", "has_op", "op_def"]
