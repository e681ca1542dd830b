"""Op definitions, one place per op. Importing this package registers every op family."""

from . import (  # noqa: F401  (registration)
    attention,
    batch_norm,
    cached_attention,
    elementwise,
    foreach,
    fused,
    index,
    matmul,
    moe,
    nn,
    nn_grad,
    random,
    reduce,
    rotary,
    sampling,
    shape,
    state,
    window,
)
from .registry import (
    Attr,
    Attrs,
    Decomposition,
    InferContext,
    OpDef,
    TensorType,
    all_ops,
    attrs_of,
    decomposition,
    define,
    has_op,
    is_view,
    op_def,
    op_method,
    unchanging_constant,
    vjp,
    written_inputs,
    zero_gradient,
)

__all__ = [
    "Attr", "Attrs", "Decomposition", "InferContext", "OpDef", "TensorType", "all_ops", "attrs_of", "decomposition",
    "define", "has_op", "is_view", "op_def", "op_method", "unchanging_constant", "vjp", "written_inputs",
    "zero_gradient",
]
