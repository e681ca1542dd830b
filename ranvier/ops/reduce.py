"""Reductions over any set of axes, with keepdims: Sum Mean Max Min Product All Any ArgMax ArgMin."""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .registry import TensorType, define
from .rules import FLOATS, INDEX, NUMERIC, normalize_axis, reduction_axes, same_dtype


def reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _infer_reduce(allowed):
    def infer(ctx):
        dtype = same_dtype(ctx, allowed, f"a dtype in ({', '.join(allowed)})")
        x = ctx.inputs[0]
        axes = reduction_axes(ctx, x.rank)
        if any(x.shape[a] == 0 for a in axes) and ctx.op_type in ("Max", "Min"):
            raise ctx.fail("a non-empty reduction axis")
        return [TensorType(dtype, reduced_shape(x.shape, axes, ctx.attrs.bool("keepdims")))]

    return infer


def _reduce(fn):
    def reference(attrs, args, outs):
        x = args[0]
        axis = attrs.ints("axis")
        # Sorted and without repeats, as the shape rule reads them (axis=[1, -1] is one axis).
        axes = tuple(range(x.ndim)) if axis is None else tuple(sorted({a % x.ndim for a in axis}))
        result = fn(x, axis=axes, keepdims=attrs.bool("keepdims"))
        return [np.asarray(result).reshape(outs[0].shape)]

    return reference


def _mean(x, axis, keepdims):
    return np.mean(np.asarray(x, np.float64), axis=axis, keepdims=keepdims)


def _wide(fn):
    """Accumulate floats in float64 so the oracle is more accurate than any kernel it checks."""
    return lambda x, axis, keepdims: fn(x, axis=axis, keepdims=keepdims, dtype=np.float64 if x.dtype.kind == "f" else None)


REDUCTIONS = {
    "Sum": (_wide(np.sum), NUMERIC),
    "Mean": (_mean, FLOATS),
    "Max": (np.max, NUMERIC),
    "Min": (np.min, NUMERIC),
    "Product": (_wide(np.prod), NUMERIC),
    "All": (np.all, (dtypes.DT_BOOL,)),
    "Any": (np.any, (dtypes.DT_BOOL,)),
}

for _type, (_fn, _allowed) in REDUCTIONS.items():
    define(_type, _infer_reduce(_allowed), _reduce(_fn), 1, "reduce")


def _infer_arg(ctx):
    same_dtype(ctx, dtypes.NUMERIC_DTYPES, "a numeric input")
    x = ctx.inputs[0]
    output_type = ctx.attrs.str("output_type", dtypes.DT_INT32)
    if output_type not in INDEX:
        raise ctx.fail(f"attribute output_type to be int32 or int64 (got {output_type})")
    axis = ctx.attrs.int("axis")
    if axis is None:
        if x.size == 0:
            raise ctx.fail("a non-empty input")
        shape = (1,) * x.rank if ctx.attrs.bool("keepdims") else ()
    else:
        a = normalize_axis(ctx, axis, x.rank)
        if x.shape[a] == 0:
            raise ctx.fail("a non-empty axis")
        shape = reduced_shape(x.shape, (a,), ctx.attrs.bool("keepdims"))
    return [TensorType(output_type, shape)]


def _arg(fn):
    """Index of the first extreme element; with no axis, the index into the flattened tensor."""

    def reference(attrs, args, outs):
        axis = attrs.int("axis")
        x = args[0] if axis is not None else args[0].reshape(-1)
        return [np.asarray(fn(x, axis=axis if axis is not None else 0)).reshape(outs[0].shape)]

    return reference


define("ArgMax", _infer_arg, _arg(np.argmax), 1, "reduce")
define("ArgMin", _infer_arg, _arg(np.argmin), 1, "reduce")
