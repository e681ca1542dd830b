"""Indexing kernels: Gather (embedding rows), ScatterAdd (its transpose), OneHot, Myelin's
pooled lookups (GatherSum, GatherMax, GatherAvg) and AssignAddScatter.

An index outside the table is not read or written; the step records itself in the
status word and the runtime raises an error naming the op, as the reference does.
"""

from __future__ import annotations

import math

from .... import dtypes
from ...llvm.context import check_range, load_index
from ...llvm.lookups import gather_row, one_hot_row, pooled_rows
from ...llvm.loops import fill, for_vectors
from ...llvm.values import Value
from ..parallel import share_out, thread_count, worth_splitting
from .library import kernel


@kernel("Gather", {"Gather"})
def gather(ctx, op) -> None:
    """Rows shared out over the pool: each part copies its share of the output rows (the
    MoE layers' token gathers took half the time on two cores)."""
    threads = thread_count() if worth_splitting(nbytes=2 * op.outputs[0].nbytes) else 1

    def share(ctx, first: int | Value, last: int | Value) -> None:
        with ctx.loop(first, last, name="n") as n:
            gather_row(op)(ctx, n)

    share_out(ctx, op.inputs[1].size, threads, share)


def _sums_in_its_own_dtype(op) -> bool:
    """Sums of half precision must build up in float32 and round once, as the reference
    does: rounding after every add loses most of a long sum (bfloat16 stops growing at
    256 when adding values below 1). Without a float32 buffer the size of the output,
    the Python fallback is the accurate kernel there."""
    return op.outputs[0].dtype not in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16)


@kernel("ScatterAdd", {"ScatterAdd"}, supports=_sums_in_its_own_dtype)
def scatter_add(ctx, op) -> None:
    """On one thread: its passes run at the memory's speed (columns shared out over two
    cores measured no faster on a MoE step's combine gradients)."""
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
    with ctx.loop(0, op.inputs[0].size, name="n") as n:
        one_hot_row(op)(ctx, n)


def _not_half(op) -> bool:
    """Rows are combined in the output's dtype: half precision goes to the accurate reference."""
    return op.outputs[0].dtype not in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16)


@kernel("PoolingGather", {"GatherSum", "GatherMax", "GatherAvg"}, supports=_not_half)
def pooling_gather(ctx, op) -> None:
    table, indices = op.inputs
    out = op.outputs[0]
    width = table.shape[1]
    lanes = ctx.lanes_for([out.dtype])
    fill(ctx, out, 0)

    def visit(row, first):
        with ctx.when(check_range(ctx, row, table.shape[0])):

            def combine(i, w):
                value = ctx.load(table, row * width + i, w)
                if op.type == "GatherMax":
                    value = first.where(value, ctx.load(out, i, w).maximum(value))
                else:
                    value = ctx.load(out, i, w) + value
                ctx.store(out, i, value)

            for_vectors(ctx, 0, width, lanes, combine)

    count = pooled_rows(ctx, indices, visit)
    if op.type == "GatherAvg":
        with ctx.when(count > 0):
            divisor = count.cast(out.dtype)
            for_vectors(ctx, 0, width, lanes, lambda i, w: ctx.store(out, i, ctx.load(out, i, w) / divisor.splat(w)))


@kernel("AssignAddScatter", {"AssignAddScatter"}, supports=lambda op: op.inputs[0].dtype not in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16))
def assign_add_scatter(ctx, op) -> None:
    """target[index] += value row by row; a negative index adds to the oov row, or without
    one ends the list (Myelin's kernel)."""
    target, indices, value, *oov = op.inputs
    width = target.shape[1]
    lanes = ctx.lanes_for([target.dtype])
    ended = ctx.local(dtypes.DT_INT64, initial=0)
    with ctx.loop(0, indices.size, name="n") as n:
        row = load_index(ctx, indices, n)
        source = n * width if value.shape[0] > 1 else 0
        negative = row < 0
        if not oov:
            ended.set(negative.where(1, ended.value))

        def add(into, at):
            def add_vector(i, w):
                ctx.store(into, at + i, ctx.load(into, at + i, w) + ctx.load(value, source + i, w))

            for_vectors(ctx, 0, width, lanes, add_vector)

        with ctx.when(~negative & ended.value.equal(0)), ctx.when(check_range(ctx, row, target.shape[0])):
            add(target, row * width)
        if oov:
            with ctx.when(negative):
                add(oov[0], 0)
