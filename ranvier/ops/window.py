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

from .registry import Attr, TensorType, define


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
    ctx.attrs["value"]
    return [TensorType(x.dtype, [d + p + q for d, p, q in zip(x.shape, before, after)])]


def _pad(attrs, args, outs):
    widths = list(zip(attrs["before"], attrs["after"]))
    return [np.pad(args[0], widths, constant_values=attrs["value"])]


define(
    "Pad", _infer_pad, _pad, 1, "window", "Pad(x); attributes before, after (per dimension) and value",
    attrs=[
        Attr("before", "ints", None, "elements added before each dimension"),
        Attr("after", "ints", None, "elements added after each dimension"),
        Attr("value", "float", 0.0, "the padding value"),
    ],
    vjp=lambda ctx, g: [g[0].slice(ctx.attrs["before"], ctx.inputs[0].shape)],
    method="pad",
)


def view_bounds_ok(size: int, offset: int, shape, strides) -> bool:
    """Every element the view reads lies inside a buffer of `size` elements."""
    if any(d == 0 for d in shape):
        return True
    low = offset + sum(s * (d - 1) for s, d in zip(strides, shape) if s < 0)
    high = offset + sum(s * (d - 1) for s, d in zip(strides, shape) if s > 0)
    return low >= 0 and high < size


def _view_attrs(ctx, size: int):
    shape = _ints(ctx, "shape", minimum=0)
    strides = _ints(ctx, "strides", len(shape))
    offset = ctx.attrs["offset"]
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
    return [strided_view(args[0], attrs["offset"], attrs["shape"], attrs["strides"]).copy()]


VIEW_ATTRS = [
    Attr("offset", "int", 0, "the first element read"),
    Attr("shape", "ints", None, "the view's shape"),
    Attr("strides", "ints", None, "per dimension, elements between neighbours"),
]


def _view_attrs_of(ctx) -> dict:
    return {"offset": ctx.attrs["offset"], "shape": ctx.attrs["shape"], "strides": ctx.attrs["strides"]}


define(
    "StridedView", _infer_view, _view, 1, "window", "StridedView(x); attributes offset, shape, strides (elements)",
    attrs=VIEW_ATTRS,
    vjp=lambda ctx, g: [ctx.b.strided_scatter_add(g[0], **_view_attrs_of(ctx), target_shape=ctx.inputs[0].shape)],
    method="strided_view",
)


def _infer_scatter(ctx):
    (d,) = ctx.inputs
    target = _ints(ctx, "target_shape", minimum=0)
    shape, _, _ = _view_attrs(ctx, math.prod(target))
    if list(d.shape) != shape:
        raise ctx.fail(f"updates of the view's shape {shape}")
    return [TensorType(d.dtype, target)]


def _scatter(attrs, args, outs):
    target = attrs["target_shape"]
    result = np.zeros(math.prod(target), dtype=np.float64 if args[0].dtype.kind == "f" else args[0].dtype)
    index = strided_view(np.arange(result.size), attrs["offset"], attrs["shape"], attrs["strides"])
    np.add.at(result, index.reshape(-1), np.asarray(args[0]).reshape(-1))
    return [result.reshape(target)]


define(
    "StridedScatterAdd",
    _infer_scatter,
    _scatter,
    1,
    "window",
    "StridedScatterAdd(d): zeros[target_shape] with d added through the view (offset, shape, strides)",
    attrs=[*VIEW_ATTRS, Attr("target_shape", "ints", None, "the output's shape")],
    vjp=lambda ctx, g: [ctx.b.strided_view(g[0], **_view_attrs_of(ctx))],
    flops=lambda op: op.inputs[0].size,
    method="strided_scatter_add",
)


# ---- the windows of convolution and pooling, for their decompositions ----------------------------------

def padded(b, x, padding, value: float = 0.0):
    """x [N, C, H, W] with `padding` (rows, columns) of `value` around each image."""
    if not any(padding):
        return x
    before = [0, 0, padding[0], padding[1]]
    return b.pad(x, before=before, after=before, value=value)


def unpadded(t, padding, shape):
    """The inverse of `padded` (for gradients): the inside `shape` of t."""
    return t.slice([0, 0, padding[0], padding[1]], shape) if any(padding) else t


def window_view(shape, kernel, strides, out_hw, channels_last: bool) -> dict:
    """View attributes reading [N, ...] windows from a padded [N, C, Hp, Wp] tensor:
    [N, Ho, Wo, C, KH, KW] (im2col rows) or [N, C, Ho, Wo, KH, KW] (pooling windows)."""
    n, c, hp, wp = shape
    (kh, kw), (sh, sw), (ho, wo) = kernel, strides, out_hw
    image, row = hp * wp, wp
    if channels_last:
        return {"shape": [n, ho, wo, c, kh, kw], "strides": [c * image, sh * row, sw, image, row, 1]}
    return {"shape": [n, c, ho, wo, kh, kw], "strides": [c * image, image, sh * row, sw, row, 1]}


def padded_shape(shape, padding) -> list[int]:
    n, c, h, w = shape
    return [n, c, h + 2 * padding[0], w + 2 * padding[1]]
