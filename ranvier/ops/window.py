"""Window primitives: the pieces convolution and pooling decompose into.

    Pad(x)                  x surrounded by a constant, per dimension before/after
    StridedView(x)          a copy of x read through (offset, shape, strides): im2col
                            windows, diagonals, any affine view
    StridedScatterAdd(d)    the transpose of StridedView: zeros of a shape, with d added
                            through the view (overlapping windows accumulate)

With MatMul, Transpose and reductions these express Conv2D, pooling and all their
gradients, so a backend that has loops and a GEMM runs them natively.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .registry import TensorType, define


def _ints(ctx, name, length=None, minimum=None):
    values = ctx.attrs.ints(name)
    if values is None or (length is not None and len(values) != length) or (minimum is not None and any(v < minimum for v in values)):
        count = f"{length} " if length is not None else ""
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ctx.fail(f"attribute {name} with {count}integers{bound}")
    return values


def _infer_pad(ctx):
    (x,) = ctx.inputs
    before = _ints(ctx, "before", x.rank, 0)
    after = _ints(ctx, "after", x.rank, 0)
    ctx.attrs.float("value", 0.0)
    return [TensorType(x.dtype, [d + p + q for d, p, q in zip(x.shape, before, after)])]


def _pad(attrs, args, outs):
    widths = list(zip(attrs.ints("before"), attrs.ints("after")))
    return [np.pad(args[0], widths, constant_values=attrs.float("value", 0.0))]


define("Pad", _infer_pad, _pad, 1, "window", "Pad(x); attributes before, after (per dimension) and value")


def view_bounds_ok(size: int, offset: int, shape, strides) -> bool:
    """Every element the view reads lies inside a buffer of `size` elements."""
    if any(d == 0 for d in shape):
        return True
    low = offset + sum(s * (d - 1) for s, d in zip(strides, shape) if s < 0)
    high = offset + sum(s * (d - 1) for s, d in zip(strides, shape) if s > 0)
    return 0 <= low and high < size


def _view_attrs(ctx, size: int):
    shape = _ints(ctx, "shape", minimum=0)
    strides = _ints(ctx, "strides", len(shape))
    offset = ctx.attrs.int("offset", 0)
    if not view_bounds_ok(size, offset, shape, strides):
        raise ctx.fail(f"a view (offset {offset}, shape {shape}, strides {strides}) inside the {size} elements of the input")
    return shape, strides, offset


def _infer_view(ctx):
    (x,) = ctx.inputs
    shape, _, _ = _view_attrs(ctx, x.size)
    return [TensorType(x.dtype, shape)]


def strided_view(x: np.ndarray, offset: int, shape, strides) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    item = flat.itemsize
    return as_strided(flat[offset:], shape=shape, strides=[s * item for s in strides], writeable=False)


def _view(attrs, args, outs):
    return [strided_view(args[0], attrs.int("offset", 0), attrs.ints("shape"), attrs.ints("strides")).copy()]


define("StridedView", _infer_view, _view, 1, "window", "StridedView(x); attributes offset, shape, strides (elements)")


def _infer_scatter(ctx):
    (d,) = ctx.inputs
    target = _ints(ctx, "target_shape", minimum=0)
    shape, _, _ = _view_attrs(ctx, math.prod(target))
    if list(d.shape) != shape:
        raise ctx.fail(f"updates of the view's shape {shape}")
    return [TensorType(d.dtype, target)]


def _scatter(attrs, args, outs):
    target = attrs.ints("target_shape")
    result = np.zeros(math.prod(target), dtype=np.float64 if args[0].dtype.kind == "f" else args[0].dtype)
    index = strided_view(np.arange(result.size), attrs.int("offset", 0), attrs.ints("shape"), attrs.ints("strides"))
    np.add.at(result, index.reshape(-1), np.asarray(args[0]).reshape(-1))
    return [result.reshape(target)]


define(
    "StridedScatterAdd",
    _infer_scatter,
    _scatter,
    1,
    "window",
    "StridedScatterAdd(d): zeros[target_shape] with d added through the view (offset, shape, strides)",
)
