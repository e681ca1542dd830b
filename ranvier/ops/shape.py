"""Shape ops: Reshape Transpose Concat Split Slice BroadcastTo ExpandDims Squeeze, and Myelin's
Shape Size Rank (int32 facts about a tensor, known when the cell is compiled).

Myelin passes shape arguments as constant inputs (Reshape's target shape,
Concat's and Split's axis, Split's count); the others take attributes.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import Attr, TensorType, define, zero_gradient
from .rules import normalize_axis


def _infer_reshape(ctx):
    x = ctx.inputs[0]
    target = [int(d) for d in ctx.constant(1, "the target shape").reshape(-1)]
    unknown = [i for i, d in enumerate(target) if d == -1]
    if len(unknown) > 1 or any(d < -1 for d in target):
        raise ctx.fail(f"a target shape with at most one -1 (got {target})")
    known = math.prod(d for d in target if d != -1)
    if unknown:
        if known == 0 or x.size % known:
            raise ctx.fail(f"a target shape {target} whose known dimensions divide {x.size} elements")
        target[unknown[0]] = x.size // known
    if math.prod(target) != x.size:
        raise ctx.fail(f"a target shape with {x.size} elements (got {target})")
    return [TensorType(x.dtype, target)]


define(
    "Reshape",
    _infer_reshape,
    lambda attrs, args, outs: [args[0].reshape(outs[0].shape)],
    2,
    "shape",
    "Reshape(x, shape): shape is a constant int vector, one entry may be -1",
    vjp=lambda ctx, g: [g[0].reshape(ctx.inputs[0].shape), None],
    view=True,
    method="reshape",
    build=lambda b, x, shape, name=None: b.op("Reshape", [x, b.const(np.asarray(list(shape), np.int32))], name),
)


def _perm(attrs, rank):
    perm = attrs["perm"]
    return list(reversed(range(rank))) if perm is None else perm


def _infer_transpose(ctx):
    x = ctx.inputs[0]
    perm = _perm(ctx.attrs, x.rank)
    if sorted(perm) != list(range(x.rank)):
        raise ctx.fail(f"attribute perm to be a permutation of 0..{x.rank - 1} (got {perm})")
    return [TensorType(x.dtype, [x.shape[p] for p in perm])]


def _transpose_vjp(ctx, g):
    inverse = list(np.argsort(_perm(ctx.attrs, ctx.inputs[0].rank)))
    return [g[0].transpose(inverse)]


define(
    "Transpose",
    _infer_transpose,
    lambda attrs, args, outs: [np.transpose(args[0], _perm(attrs, args[0].ndim))],
    1,
    "shape",
    "x with its axes permuted by attribute perm (default: reversed)",
    attrs=[Attr("perm", "ints", None, "the permutation (default: reversed axes)")],
    vjp=_transpose_vjp,
    method=("transpose", "t"),
)


def _infer_concat(ctx):
    parts = ctx.inputs[:-1]
    axis_value = ctx.constant(len(ctx.inputs) - 1, "the axis")
    if not parts or axis_value.size != 1:
        raise ctx.fail("one or more tensors followed by a constant scalar axis")
    first = parts[0]
    if first.rank == 0:
        raise ctx.fail("parts of rank >= 1 (scalars have no axis to concatenate on)")
    axis = normalize_axis(ctx, int(axis_value.reshape(-1)[0]), first.rank)
    for p in parts:
        if p.dtype != first.dtype or p.rank != first.rank:
            raise ctx.fail("parts of one dtype and rank")
        if any(p.shape[i] != first.shape[i] for i in range(first.rank) if i != axis):
            raise ctx.fail(f"parts whose shapes agree except on axis {axis}")
    shape = list(first.shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    return [TensorType(first.dtype, shape)]


def _concat(attrs, args, outs):
    axis = int(np.asarray(args[-1]).reshape(-1)[0])
    return [np.concatenate(args[:-1], axis=axis)]


def _axis_of(var, rank: int) -> int:
    """The axis held by a constant input (Concat's and Split's last)."""
    return int(np.asarray(var.data).reshape(-1)[0]) % rank


def _concat_vjp(ctx, g):
    parts = ctx.inputs[:-1]
    axis = _axis_of(ctx.inputs[-1].var, parts[0].rank)
    pieces = g[0].split([p.shape[axis] for p in parts], axis=axis)
    return [*pieces, None]


define(
    "Concat", _infer_concat, _concat, (2, None), "shape", "Concat(x1, ..., xn, axis)",
    attrs=[Attr("N", "int", None, "the number of parts (Myelin writes it)")],
    vjp=_concat_vjp,
    method="concat",
    # Axis 1 by default, as Myelin's builder (which always concatenates rows' features).
    build=lambda b, parts, axis=1, name=None: b.op("Concat", [*parts, b.const(int(axis))], name, {"N": len(parts)}),
)


def split_sizes(splits: np.ndarray, dim: int, fail) -> list[int]:
    """Split's second input is a part count (scalar) or a list of part sizes."""
    flat = [int(s) for s in np.asarray(splits).reshape(-1)]
    if np.asarray(splits).ndim == 0:
        count = flat[0]
        if count <= 0 or dim % count:
            raise fail(f"a part count that divides dimension {dim} (got {count})")
        return [dim // count] * count
    if any(s < 0 for s in flat) or sum(flat) != dim:
        raise fail(f"part sizes that add up to dimension {dim} (got {flat})")
    return flat


def _infer_split(ctx):
    x = ctx.inputs[0]
    axis = normalize_axis(ctx, int(ctx.constant(2, "the axis").reshape(-1)[0]), x.rank)
    sizes = split_sizes(ctx.constant(1, "the part count or sizes"), x.shape[axis], ctx.fail)
    results = []
    for size in sizes:
        shape = list(x.shape)
        shape[axis] = size
        results.append(TensorType(x.dtype, shape))
    return results


def _split(attrs, args, outs):
    x, _, axis_value = args
    axis = int(np.asarray(axis_value).reshape(-1)[0]) % x.ndim
    bounds = np.cumsum([o.shape[axis] for o in outs])[:-1]
    return list(np.split(x, bounds, axis=axis))


def _split_vjp(ctx, g):
    x, _, axis_var = ctx.inputs
    axis = _axis_of(axis_var.var, x.rank)
    pieces = [gi if gi is not None else zeros(ctx.b, out.shape, out.dtype) for gi, out in zip(g, ctx.outputs)]
    return [ctx.b.concat(pieces, axis=axis) if len(pieces) > 1 else pieces[0], None, None]


def zeros(b, shape, dtype):
    """A tensor of zeros built from one scalar constant."""
    zero = b.const(0.0, dtype)
    return zero.broadcast_to(shape) if shape else zero.identity()


def _build_split(b, x, splits, axis=0, name=None):
    """Split into `splits` equal parts, or into parts of the listed sizes."""
    outputs = b.op("Split", [x, b.const(np.asarray(splits, np.int32)), b.const(int(axis))], name)
    return outputs if isinstance(outputs, tuple) else (outputs,)


define(
    "Split", _infer_split, _split, 3, "shape", "Split(x, count or sizes, axis)",
    vjp=_split_vjp, method="split", build=_build_split,
)


def slice_bounds(attrs, shape, fail):
    begin = attrs["begin"]
    size = attrs["size"]
    if begin is None or size is None or len(begin) != len(shape) or len(size) != len(shape):
        raise fail(f"attributes begin and size with one entry per dimension ({len(shape)})")
    bounds = []
    for axis, (b, s, d) in enumerate(zip(begin, size, shape)):
        end = d if s == -1 else b + s
        if b < 0 or b > d or s < -1 or end > d:
            raise fail(f"slice [{b}:{end}] inside dimension {axis} of size {d}")
        bounds.append((b, end))
    return bounds


def _infer_slice(ctx):
    x = ctx.inputs[0]
    bounds = slice_bounds(ctx.attrs, x.shape, ctx.fail)
    return [TensorType(x.dtype, [e - b for b, e in bounds])]


def _slice(attrs, args, outs):
    bounds = slice_bounds(attrs, args[0].shape, ValueError)
    return [args[0][tuple(slice(b, e) for b, e in bounds)]]


def _slice_vjp(ctx, g):
    """Pad the gradient with zeros back to the input's shape, one axis at a time."""
    x = ctx.inputs[0]
    grad = g[0]
    for axis, (start, full) in enumerate(zip(ctx.attrs["begin"], x.shape)):
        size = grad.shape[axis]
        if size == full:
            continue
        pieces = []
        if start > 0:
            pieces.append(zeros(ctx.b, [*grad.shape[:axis], start, *grad.shape[axis + 1:]], grad.dtype))
        pieces.append(grad)
        rest = full - start - size
        if rest > 0:
            pieces.append(zeros(ctx.b, [*grad.shape[:axis], rest, *grad.shape[axis + 1:]], grad.dtype))
        grad = ctx.b.concat(pieces, axis=axis)
    return [grad]


define(
    "Slice", _infer_slice, _slice, 1, "shape", "Slice(x); attributes begin and size (-1: to the end)",
    attrs=[Attr("begin", "ints", None, "first index per dimension"), Attr("size", "ints", None, "extent per dimension (-1: to the end)")],
    vjp=_slice_vjp, method="slice",
)


def _infer_broadcast(ctx):
    x = ctx.inputs[0]
    target = ctx.attrs["shape"]
    if target is None:
        raise ctx.fail("attribute shape")
    offset = len(target) - x.rank
    if (
        any(d < 0 for d in target)
        or offset < 0
        or any(d != 1 and d != target[offset + i] for i, d in enumerate(x.shape))
    ):
        raise ctx.fail(f"a shape that broadcasts to {target} (numpy rules)")
    return [TensorType(x.dtype, target)]


define(
    "BroadcastTo",
    _infer_broadcast,
    lambda attrs, args, outs: [np.broadcast_to(args[0], outs[0].shape)],
    1,
    "shape",
    "x broadcast to attribute shape (numpy rules)",
    attrs=[Attr("shape", "ints", None, "the target shape")],
    vjp=lambda ctx, g: [ctx.unbroadcast(g[0], ctx.inputs[0])],
    method="broadcast_to",
)


def _infer_expand(ctx):
    x = ctx.inputs[0]
    axis = ctx.attrs["axis"]
    if not -(x.rank + 1) <= axis <= x.rank:
        raise ctx.fail(f"an axis in [{-(x.rank + 1)}, {x.rank}] (got {axis})")
    axis %= x.rank + 1
    return [TensorType(x.dtype, [*x.shape[:axis], 1, *x.shape[axis:]])]


def _infer_squeeze(ctx):
    x = ctx.inputs[0]
    axes = ctx.attrs["axis"]
    if axes is None or axes == []:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = [normalize_axis(ctx, a, x.rank) for a in axes]
    if any(x.shape[a] != 1 for a in axes):
        raise ctx.fail(f"squeezed axes {axes} to have size 1")
    return [TensorType(x.dtype, [d for i, d in enumerate(x.shape) if i not in axes])]


def _reshape_to_output(attrs, args, outs):
    return [args[0].reshape(outs[0].shape)]


def _reshape_back(ctx, g):
    return [g[0].reshape(ctx.inputs[0].shape)]


define(
    "ExpandDims", _infer_expand, _reshape_to_output, 1, "shape", "x with a size-1 axis inserted at attribute axis",
    attrs=[Attr("axis", "int", 0, "where the new axis goes")], vjp=_reshape_back, view=True, method="expand_dims",
)
define(
    "Squeeze", _infer_squeeze, _reshape_to_output, 1, "shape", "x without the size-1 axes of attribute axis",
    attrs=[Attr("axis", "ints", None, "the axes removed (default or empty: every size-1 axis)")],
    vjp=_reshape_back, view=True, method="squeeze",
)


# ---- Shape, Size, Rank: the input's static shape as int32 values ---------------------------------

SHAPE_FACTS = {
    "Shape": (list, lambda shape: (len(shape),), "the input's dimensions, an int32 vector"),
    "Size": (math.prod, lambda shape: (), "the input's element count, an int32 scalar"),
    "Rank": (len, lambda shape: (), "the input's number of dimensions, an int32 scalar"),
}


def shape_fact(op_type: str, shape) -> np.ndarray:
    """The value op `op_type` (Shape, Size or Rank) has for an input of `shape`."""
    value, _, _ = SHAPE_FACTS[op_type]
    return np.asarray(value(shape), dtype=np.int32)


def _shape_fact_op(op_type: str):
    _, out_shape, doc = SHAPE_FACTS[op_type]
    define(
        op_type,
        lambda ctx: [TensorType("int32", out_shape(ctx.inputs[0].shape))],
        lambda attrs, args, outs: [shape_fact(op_type, args[0].shape)],
        1,
        "shape",
        doc,
        vjp=zero_gradient,
        method=op_type.lower(),
    )


for _type in SHAPE_FACTS:
    _shape_fact_op(_type)
