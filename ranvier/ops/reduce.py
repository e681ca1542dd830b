"""Reductions over any set of axes, with keepdims: Sum Mean Max Min Product All Any Count ArgMax ArgMin,
and SumSquares (Σ x², ONNX's ReduceSumSquare: a gradient norm reads each gradient once).

A reduction over axes that are not adjacent decomposes into one reduction per block of
adjacent axes, for backends whose kernels reduce one contiguous block.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .registry import Attr, TensorType, decomposition, define, op_def, vjp, zero_gradient
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


def _sum_squares(x, axis, keepdims):
    wide = np.asarray(x, np.float64)
    return np.sum(wide * wide, axis=axis, keepdims=keepdims)


REDUCTIONS = {
    "Sum": (_wide(np.sum), NUMERIC),
    "SumSquares": (_sum_squares, FLOATS),
    "Mean": (_mean, FLOATS),
    "Max": (np.max, NUMERIC),
    "Min": (np.min, NUMERIC),
    "Product": (_wide(np.prod), NUMERIC),
    "All": (np.all, (dtypes.DT_BOOL,)),
    "Any": (np.any, (dtypes.DT_BOOL,)),
}

AXIS = Attr("axis", "ints", None, "the reduced axes (default: all)")
KEEPDIMS = Attr("keepdims", "bool", False, "keep reduced axes as size 1")

# the builder's method for each: b.sum(x), b.sum_squares(x), ...
METHODS = {_type: "sum_squares" if _type == "SumSquares" else _type.lower() for _type in REDUCTIONS}

for _type, (_fn, _allowed) in REDUCTIONS.items():
    define(_type, _infer_reduce(_allowed), _reduce(_fn), 1, "reduce", attrs=[AXIS, KEEPDIMS], method=METHODS[_type])


def _reduced_axes(ctx):
    x = ctx.inputs[0]
    axes = ctx.attrs["axis"]
    return list(range(x.rank)) if axes is None else sorted(a % x.rank for a in axes)


def _expand_back(ctx, t):
    """A reduced tensor reshaped with the reduced axes kept as size 1, broadcast to the input."""
    x = ctx.inputs[0]
    kept = [1 if i in _reduced_axes(ctx) else d for i, d in enumerate(x.shape)]
    t = t.reshape(kept) if t.shape != kept else t
    return t.broadcast_to(x.shape) if kept != x.shape else t


@vjp("Sum")
def _sum_vjp(ctx, g):
    return [_expand_back(ctx, g[0])]


@vjp("SumSquares")
def _sum_squares_vjp(ctx, g):
    x = ctx.inputs[0]
    return [_expand_back(ctx, g[0]) * (x * 2.0)]


@vjp("Mean")
def _mean_vjp(ctx, g):
    x = ctx.inputs[0]
    count = int(np.prod([x.shape[a] for a in _reduced_axes(ctx)]))
    return [_expand_back(ctx, g[0] * (1.0 / count))]


def _extreme_vjp(ctx, g):
    """The gradient is shared equally by the elements equal to the extreme (as torch.amax)."""
    x = ctx.inputs[0]
    hit = x.equal(_expand_back(ctx, ctx.outputs[0])).cast(x.dtype)
    count = hit.sum(axis=_reduced_axes(ctx), keepdims=True)
    return [hit * _expand_back(ctx, g[0]) / count]


vjp("Max")(_extreme_vjp)
vjp("Min")(_extreme_vjp)


@vjp("Product")
def _product_vjp(ctx, g):
    x = ctx.inputs[0]
    return [_expand_back(ctx, g[0] * ctx.outputs[0]) / x]


for _type in ("All", "Any"):
    vjp(_type)(zero_gradient)


def _op_axes(op) -> list[int]:
    """A reduction op's reduced axes, sorted, each once (every axis where none is given)."""
    rank = op.inputs[0].rank
    given = op_def(op.type).attrs_of(op)["axis"]
    return list(range(rank)) if given is None else sorted({a % rank for a in given})


def _later_stage(op_type: str) -> str:
    """What a reduction done in stages runs after its first: a sum of squares then sums."""
    return "Sum" if op_type == "SumSquares" else op_type


def _split_reduction(b, op):
    """A reduction over axes that are not adjacent, as one reduction per adjacent block
    (kept as size-1 dimensions), then a reshape: sums of sums, maxima of maxima, and
    means of equal-sized means are the whole reduction; a sum of squares squares only in
    its first block and sums the rest."""
    x = b.wrap(op.inputs[0])
    axes = _op_axes(op)
    blocks = []
    for axis in axes:
        if blocks and blocks[-1][-1] == axis - 1:
            blocks[-1].append(axis)
        else:
            blocks.append([axis])
    if len(blocks) < 2:
        return None
    for number, block in enumerate(reversed(blocks)):
        kind = _later_stage(op.type) if number else op.type
        x = getattr(b, METHODS[kind])(x, axis=block, keepdims=True)
    return x.reshape(op.outputs[0].shape)


for _type in REDUCTIONS:
    decomposition(_type)(_split_reduction)

STAGE_CHUNKS = (16384, 8192, 4096, 2048, 1024)  # the pieces' lengths a staged reduction may take
STAGE_PIECES = 256  # pieces enough to spread over a few hundred processors
COLUMN_CHUNKS = range(32, 7, -1)  # rows a piece of a column reduction may take, the most first


def staged_chunk(reduced: int, inner: int = 1) -> int | None:
    """The length of the pieces a long reduced axis is cut into for a staged reduction:
    the longest of `STAGE_CHUNKS` that divides it into `STAGE_PIECES` or more, else the
    shortest that divides it; None where none does. Columns (`inner` > 1, a gain's
    gradient summed over rows) are cut into pieces of 8 to 32 rows: a piece of a
    column is then one GPU thread's, beside its neighbour columns' threads reading the
    same rows, and the pieces' results reduce again the same way until few are left."""
    if inner > 1:
        return next((chunk for chunk in COLUMN_CHUNKS if reduced % chunk == 0 and reduced > chunk), None)
    dividing = [chunk for chunk in STAGE_CHUNKS if reduced % chunk == 0 and reduced > chunk]
    return next((chunk for chunk in dividing if reduced // chunk >= STAGE_PIECES), dividing[-1] if dividing else None)


def _staged_reduction(b, op):
    """A reduction over one block of adjacent axes, in two stages: each piece of
    `staged_chunk` elements of the reduced axis, then the pieces' results (sums of sums,
    maxima of maxima, means of equal-sized means; a sum of squares squares in the first
    stage only). For a backend that runs a few long reductions better as many short ones
    (a GPU, whose block per output would leave most of it idle)."""
    x = b.wrap(op.inputs[0])
    axes = _op_axes(op)
    if not axes or axes != list(range(axes[0], axes[-1] + 1)):
        return None
    reduced = int(np.prod([x.shape[a] for a in axes]))
    chunk = staged_chunk(reduced, int(np.prod(x.shape[axes[-1] + 1 :])))
    if chunk is None:
        return None
    pieces = _reshaped(x, [*x.shape[: axes[0]], reduced // chunk, chunk, *x.shape[axes[-1] + 1 :]])
    first = getattr(b, METHODS[op.type])(pieces, axis=[axes[0] + 1])
    return _reshaped(getattr(b, METHODS[_later_stage(op.type)])(first, axis=[axes[0]]), op.outputs[0].shape)


def _reshaped(t, shape):
    return t if list(t.shape) == list(shape) else t.reshape(list(shape))


for _type in REDUCTIONS:
    decomposition(_type)(_staged_reduction)


def _infer_arg(ctx):
    same_dtype(ctx, dtypes.NUMERIC_DTYPES, "a numeric input")
    x = ctx.inputs[0]
    output_type = ctx.attrs["output_type"]
    if output_type not in INDEX:
        raise ctx.fail(f"attribute output_type to be int32 or int64 (got {output_type})")
    axis = ctx.attrs["axis"]
    if axis is None:
        if x.size == 0:
            raise ctx.fail("a non-empty input")
        shape = (1,) * x.rank if ctx.attrs["keepdims"] else ()
    else:
        a = normalize_axis(ctx, axis, x.rank)
        if x.shape[a] == 0:
            raise ctx.fail("a non-empty axis")
        shape = reduced_shape(x.shape, (a,), ctx.attrs["keepdims"])
    return [TensorType(output_type, shape)]


def _arg(fn):
    """Index of the first extreme element; with no axis, the index into the flattened tensor."""

    def reference(attrs, args, outs):
        axis = attrs["axis"]
        x = args[0] if axis is not None else args[0].reshape(-1)
        return [np.asarray(fn(x, axis=axis if axis is not None else 0)).reshape(outs[0].shape)]

    return reference


ARG_ATTRS = [
    Attr("axis", "int", None, "the axis searched (default: the flattened input)"),
    KEEPDIMS,
    Attr("output_type", "str", dtypes.DT_INT32, "int32 or int64"),
]
define("ArgMax", _infer_arg, _arg(np.argmax), 1, "reduce", attrs=ARG_ATTRS, vjp=zero_gradient, method="argmax")
define("ArgMin", _infer_arg, _arg(np.argmin), 1, "reduce", attrs=ARG_ATTRS, vjp=zero_gradient, method="argmin")


# ---- Count: Myelin's number of true (non-zero) elements ---------------------------------------------

def _infer_count(ctx):
    x = ctx.inputs[0]
    dtype = ctx.attrs["dtype"]
    if dtype not in NUMERIC:
        raise ctx.fail(f"attribute dtype to be numeric (got {dtype})")
    return [TensorType(dtype, reduced_shape(x.shape, reduction_axes(ctx, x.rank), ctx.attrs["keepdims"]))]


def _count(attrs, args, outs):
    x = args[0]
    axis = attrs["axis"]
    axes = None if axis is None else tuple(sorted({a % x.ndim for a in axis}))
    counted = np.count_nonzero(x, axis=axes, keepdims=attrs["keepdims"])
    return [np.asarray(counted).astype(dtypes.to_numpy(outs[0].dtype)).reshape(outs[0].shape)]


def _build_count(b, p, axis=None, dtype=dtypes.DT_FLOAT32, name=None, keepdims=False):
    """Myelin's count(p, axis=None, dtype=DT_FLOAT32): how many elements of p are true (non-zero)."""
    attrs = {"dtype": dtypes.normalize(dtype), "keepdims": keepdims}
    if axis is not None:
        attrs["axis"] = [axis] if isinstance(axis, int) else list(axis)
    return b.op("Count", [p], name, attrs)


define(
    "Count", _infer_count, _count, 1, "reduce", "the number of true (non-zero) elements, as attribute dtype",
    attrs=[AXIS, KEEPDIMS, Attr("dtype", "str", dtypes.DT_FLOAT32, "the output dtype")],
    vjp=zero_gradient, method="count", build=_build_count,
)


@decomposition("Count")
def _count_as_sum(b, op):
    """A sum of ones where the input is true: native wherever Sum is."""
    x = b.wrap(op.inputs[0])
    attrs = op_def("Count").attrs_of(op)
    hits = x if x.dtype == dtypes.DT_BOOL else x.not_equal(0)
    return hits.cast(attrs["dtype"]).sum(axis=attrs["axis"], keepdims=attrs["keepdims"])
