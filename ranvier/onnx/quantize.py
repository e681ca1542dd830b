"""Converters of ONNX's linear quantization operators: QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear, MatMulInteger and QLinearMatMul, over ranvier's 8- and 16-bit
integer dtypes (the 2- and 4-bit and float8 types are refused with the dtypes ranvier
lacks). Each is the elementwise formula of its definition around ranvier's ops; the
integer products accumulate exactly, in int32.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from .node import Node, converts, onnx_dtype

_QUANTIZED = (dtypes.DT_UINT8, dtypes.DT_INT8, dtypes.DT_UINT16, dtypes.DT_INT16)


def _along(node: Node, index: int, x, axis: int, block_size: int):
    """Input `index` (a scale or zero point) shaped to broadcast against x: one value for
    the whole tensor, one per index along `axis` (ONNX's, which may count from the end),
    or (block_size > 0) one per block of block_size indices along it, repeated over the
    block."""
    value = node.tensor(index)
    if value.size == 1:  # the axis is not read
        return value.reshape([])
    axis = node.axis(axis, x.rank)
    if not block_size:
        if value.rank != 1 or value.shape[0] != x.shape[axis]:
            raise node.error(f"input {index} of shape {value.shape} is not one value per index along axis {axis} "
                             f"({x.shape[axis]})")
        return value.reshape([x.shape[axis] if i == axis else 1 for i in range(x.rank)])
    blocks = math.ceil(x.shape[axis] / block_size)
    if value.shape != [blocks if i == axis else d for i, d in enumerate(x.shape)]:
        raise node.error(f"input {index} of shape {value.shape} does not hold one value per block of {block_size} "
                         f"along axis {axis} of shape {x.shape}")
    spread = [*value.shape[:axis + 1], block_size, *value.shape[axis + 1:]]
    grown = node.b.broadcast_to(value.reshape([*value.shape[:axis + 1], 1, *value.shape[axis + 1:]]), spread)
    whole = grown.reshape([*x.shape[:axis], blocks * block_size, *x.shape[axis + 1:]])
    return whole if blocks * block_size == x.shape[axis] else node.b.slice(whole, [0] * x.rank, x.shape)


def _layout(node: Node) -> tuple[int, int]:
    """(axis, block_size) of a node quantizing per axis or per block."""
    block_size = int(node.attr("block_size", 0))
    if block_size < 0:
        raise node.error(f"block_size {block_size} is negative")
    return int(node.attr("axis", 1)), block_size


def _saturated(node: Node, rounded, target: str):
    """Whole numbers (float32) clipped to `target`'s range and cast to it."""
    info = np.iinfo(dtypes.to_numpy(target))
    return node.b.cast(rounded.maximum(float(info.min)).minimum(float(info.max)), target)


def _as_float32(node: Node, x):
    return x if x.dtype == dtypes.DT_FLOAT32 else node.b.cast(x, dtypes.DT_FLOAT32)


@converts("DequantizeLinear")
def dequantize_linear(node: Node):
    """(x − zero point) · scale, in float32, as the scale's dtype (or output_dtype)."""
    x = node.tensor(0)
    axis, block_size = _layout(node)
    scale = _along(node, 1, x, axis, block_size)
    value = node.b.cast(x, dtypes.DT_INT32)
    if node.optional(2) is not None:
        value = value - node.b.cast(_along(node, 2, x, axis, block_size), dtypes.DT_INT32)
    target = node.attr("output_dtype")
    target = scale.dtype if not target else onnx_dtype(target, f"{node.label}'s output_dtype")
    y = node.b.cast(value, dtypes.DT_FLOAT32) * _as_float32(node, scale)
    return y if target == dtypes.DT_FLOAT32 else node.b.cast(y, target)


@converts("QuantizeLinear")
def quantize_linear(node: Node):
    """x / scale rounded half to even, plus the zero point, saturated to the zero point's
    dtype (or output_dtype; uint8 without either)."""
    x = node.tensor(0)
    axis, block_size = _layout(node)
    zero_point = node.optional(2)
    target = node.attr("output_dtype")
    if zero_point is not None:
        target = node.tensor(2).dtype
    elif target:
        target = onnx_dtype(target, f"{node.label}'s output_dtype")
    else:
        target = dtypes.DT_UINT8
    if target not in _QUANTIZED:
        raise node.error(f"quantizing to {target}: ranvier quantizes to {', '.join(_QUANTIZED)}")
    if node.attr("precision"):
        raise node.error(f"precision {node.attr('precision')} (the division in another dtype) is not supported")
    node.attr("saturate")  # reads the float8 types only, refused above
    scaled = _as_float32(node, x / _along(node, 1, x, axis, block_size)).round()
    if zero_point is not None:
        scaled = scaled + node.b.cast(_along(node, 2, x, axis, block_size), dtypes.DT_FLOAT32)
    return _saturated(node, scaled, target)


@converts("DynamicQuantizeLinear")
def dynamic_quantize_linear(node: Node):
    """uint8 over the range of x stretched to hold 0: scale = (max − min) / 255 (1 where
    x is all 0), zero point = −min / scale rounded, y = x / scale rounded + zero point."""
    x = node.tensor(0)
    every = list(range(x.rank))
    high = x.max(axis=every).maximum(0.0)
    low = x.min(axis=every).minimum(0.0)
    spread = high - low
    scale = node.b.cond(spread.equal(0.0), node.b.const(1.0, x.dtype), spread) / 255.0
    zero_point = (-low / scale).maximum(0.0).minimum(255.0).round()
    y = _saturated(node, (x / scale).round() + zero_point, dtypes.DT_UINT8)
    return [y, scale, node.b.cast(zero_point, dtypes.DT_UINT8)]


def _centred(node: Node, index: int, zero_point_index: int, along: int):
    """Integer input `index` minus its zero point, as int32: one zero point for all, or one
    per row (a's, along = -2) or per column (b's, along = -1) of the matrices."""
    x = node.b.cast(node.tensor(index), dtypes.DT_INT32)
    if node.optional(zero_point_index) is None:
        return x
    zero_point = node.b.cast(node.tensor(zero_point_index), dtypes.DT_INT32)
    if zero_point.size == 1:
        return x - zero_point.reshape([])
    if zero_point.rank != 1 or zero_point.shape[0] != x.shape[along]:
        raise node.error(f"its zero point (input {zero_point_index}) of shape {zero_point.shape} is not one value "
                         f"per {'row' if along == -2 else 'column'} ({x.shape[along]})")
    return x - zero_point.reshape([x.shape[along], 1] if along == -2 else [x.shape[along]])


@converts("MatMulInteger")
def matmul_integer(node: Node):
    return node.b.matmul(_centred(node, 0, 2, -2), _centred(node, 1, 3, -1))


@converts("QLinearMatMul")
def qlinear_matmul(node: Node):
    """The int32 product of the centred inputs, scaled by a_scale · b_scale / y_scale,
    rounded, plus y's zero point, saturated to its dtype."""
    product = node.b.matmul(_centred(node, 0, 2, -2), _centred(node, 3, 5, -1))
    scale = _as_float32(node, node.tensor(1)) * _as_float32(node, node.tensor(4)) / _as_float32(node, node.tensor(6))
    if scale.size != 1:
        raise node.error("per-row or per-column scales are not supported; ranvier takes one scale per input")
    y = (node.b.cast(product, dtypes.DT_FLOAT32) * scale.reshape([])).round() + \
        node.b.cast(node.tensor(7).reshape([]), dtypes.DT_FLOAT32)
    return _saturated(node, y, node.tensor(7).dtype)
