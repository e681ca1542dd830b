"""What ONNX's own shape inference says a node computes, asked before the importer folds
or converts it: the node's input types checked against its operator's schema (as ONNX
Runtime checks them: a Softmax of integers is refused, folded or not), and its outputs'
types and shapes, so a value folded at load is sized before it is allocated.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .. import dtypes
from ..errors import RanvierError
from ..flow.builder import Tensor
from ..limits import check_allocation
from .node import Node, OnnxError

# Inputs known at load with at most this many elements are given to the inference by
# value: shapes, sizes, repeats and scales, which size the outputs of ConstantOfShape,
# Expand, Tile, Range, Resize and the like. Larger ones (weights) only by type.
_BY_VALUE = 4096


def infer_outputs(node: Node) -> dict[str, onnx.TypeProto]:
    """The node's outputs' types by name, as ONNX infers them from its inputs; an error
    naming the node where ONNX finds it invalid. Empty where ONNX has no schema for it."""
    proto = node.proto
    try:
        schema = onnx.defs.get_schema(proto.op_type, node.opset, proto.domain or "")
    except onnx.defs.SchemaError:  # an operator of another domain (ONNX Runtime's), or none: the converters decide
        return {}
    types, values = {}, {}
    for name, value in zip(proto.input, node.inputs.untracked):
        if not name or value is None:
            continue
        type_proto = _type_of(value)
        if type_proto is None:  # an element type numpy has none for
            return {}
        types[name] = type_proto
        if isinstance(value, np.ndarray) and value.size <= _BY_VALUE:
            values[name] = numpy_helper.from_array(value, name)
    try:
        return onnx.shape_inference.infer_node_outputs(schema, proto, types, values,
                                                       opset_imports=list(node.importer.model.opset_import),
                                                       ir_version=node.importer.model.ir_version)
    except Exception as error:  # noqa: BLE001  (ONNX raises validation, inference and type errors)
        raise node.error(f"is invalid: {type(error).__name__}: {str(error).strip()[:300]}") from None


def check_fold_sizes(node: Node, outputs: dict[str, onnx.TypeProto]) -> None:
    """Refuse to fold a node whose outputs, as inferred, are past ranvier's memory limit."""
    for name, type_proto in outputs.items():
        size = _nbytes(type_proto)
        if size is not None:
            check_allocation(size, f"{node.label}: its output {name!r}, {_typestr(type_proto)} computed at load", OnnxError)


def check_results(node: Node, outputs: dict[str, onnx.TypeProto], results: list) -> None:
    """A node's values must have the element types and shapes ONNX infers for them (where
    it knows them): a converter's mistake becomes an error naming the node, not a wrong answer."""
    for name, value in zip(node.proto.output, results):
        inferred = outputs.get(name)
        actual = None if value is None else _type_of(value)
        if inferred is None or actual is None or not actual.HasField("tensor_type"):  # a sequence: its elements vary
            continue
        expected, got = inferred.tensor_type, actual.tensor_type
        same_type = not expected.elem_type or expected.elem_type == got.elem_type
        same_shape = not expected.HasField("shape") or (len(expected.shape.dim) == len(got.shape.dim) and all(
            not e.HasField("dim_value") or e.dim_value == g.dim_value for e, g in zip(expected.shape.dim, got.shape.dim)))
        if not (same_type and same_shape):
            raise node.error(f"its output {name!r} came out {_typestr(actual)} where ONNX infers {_typestr(inferred)}")


def _type_of(value: np.ndarray | Tensor | list) -> onnx.TypeProto | None:
    if isinstance(value, list):  # a sequence (SplitToSequence's): its elements' type, their shapes left open
        element = _type_of(value[0]) if value else None
        return None if element is None else helper.make_sequence_type_proto(
            helper.make_tensor_type_proto(element.tensor_type.elem_type, None))
    dtype = value.dtype if isinstance(value, np.ndarray) else np.dtype(dtypes.to_numpy(value.dtype))
    try:
        element = helper.np_dtype_to_tensor_dtype(dtype)
    except (KeyError, TypeError, ValueError):
        return None
    return helper.make_tensor_type_proto(element, list(value.shape))


def _nbytes(type_proto: onnx.TypeProto) -> int | None:
    """Bytes of a tensor type whose every dimension is known, else None."""
    tensor = type_proto.tensor_type
    if not type_proto.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    if not all(d.HasField("dim_value") for d in tensor.shape.dim):
        return None
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return math.prod(d.dim_value for d in tensor.shape.dim) * max(itemsize, 1)


def _typestr(type_proto: onnx.TypeProto) -> str:
    """float32[2x3], as ranvier names types; ONNX's name for one ranvier has not."""
    tensor = type_proto.tensor_type
    try:
        element = dtypes.from_numpy(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    except (KeyError, TypeError, ValueError, RanvierError):
        known = tensor.elem_type in onnx.TensorProto.DataType.values()
        element = onnx.TensorProto.DataType.Name(tensor.elem_type) if known else "?"
    return f"{element}[{'x'.join(str(d.dim_value) if d.HasField('dim_value') else '?' for d in tensor.shape.dim)}]"
