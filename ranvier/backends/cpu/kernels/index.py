"""Indexing kernels: Gather (embedding rows), ScatterAdd (its transpose) and OneHot.

An index outside the table is not read or written; the step records itself in the
status word and the runtime raises an error naming the op, as the reference does.
"""

from __future__ import annotations

import math

from .... import dtypes
from ...llvm.values import Value
from ..views import fill, for_vectors
from .library import kernel


def load_index(ctx, var, position: Value | int) -> Value:
    """Element `position` of an integer variable, as int64."""
    return ctx.load(var, position).cast(dtypes.DT_INT64)


def check_range(ctx, index: Value, rows: int) -> Value:
    """Whether 0 <= index < rows; when not, the step marks itself failed (the runtime raises)."""
    bad = (index < 0) | (index >= rows)
    ctx.fail(bad)
    return ~bad


@kernel("Gather", {"Gather"})
def gather(ctx, op) -> None:
    params, indices = op.inputs
    out = op.outputs[0]
    width = math.prod(params.shape[1:])
    lanes = ctx.lanes_for([params.dtype])
    with ctx.loop(0, indices.size, name="n") as n:
        row = load_index(ctx, indices, n)
        with ctx.when(check_range(ctx, row, params.shape[0])):
            source, target = row * width, n * width
            for_vectors(ctx, 0, width, lanes, lambda i, w: ctx.copy(params, source + i, out, target + i, w))


def _sums_in_its_own_dtype(op) -> bool:
    """Sums of half precision must build up in float32 and round once, as the reference
    does: rounding after every add loses most of a long sum (bfloat16 stops growing at
    256 when adding values below 1). Without a float32 buffer the size of the output,
    the Python fallback is the accurate kernel there."""
    return op.outputs[0].dtype not in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16)


@kernel("ScatterAdd", {"ScatterAdd"}, supports=_sums_in_its_own_dtype)
def scatter_add(ctx, op) -> None:
    indices, updates = op.inputs
    out = op.outputs[0]
    width = math.prod(out.shape[1:])
    lanes = ctx.lanes_for([out.dtype])
    fill(ctx, out, 0)
    with ctx.loop(0, indices.size, name="n") as n:
        row = load_index(ctx, indices, n)
        with ctx.when(check_range(ctx, row, out.shape[0])):
            source, target = n * width, row * width

            def add(i, w):
                ctx.store(out, target + i, ctx.load(out, target + i, w) + ctx.load(updates, source + i, w))

            for_vectors(ctx, 0, width, lanes, add)


@kernel("OneHot", {"OneHot"})
def one_hot(ctx, op) -> None:
    """Rows of zeros with a one at the index; an out-of-range index leaves its row zero."""
    (indices,) = op.inputs
    out = op.outputs[0]
    depth = out.shape[-1]
    fill(ctx, out, 0)
    with ctx.loop(0, indices.size, name="n") as n:
        hot = load_index(ctx, indices, n)
        with ctx.when((hot >= 0) & (hot < depth)):
            ctx.store(out, n * depth + hot, 1)
