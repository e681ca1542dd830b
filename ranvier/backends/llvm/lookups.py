"""Table lookups by index, one index at a time, for every LLVM backend: Gather's row and
OneHot's row as `body(ctx, n)` for index n, each row written as a row kernel's last pass
(`EmitContext.row_each`). The CPU loops over the indices and writes a row in vectors; on
a GPU a block takes an index and its threads split the row. And the rows a pooled lookup
(GatherSum, GatherMax, GatherAvg) combines, as Myelin's kernel reads its indices."""

from __future__ import annotations

import math
from collections.abc import Callable

from ... import dtypes
from .context import EmitContext, check_range, load_index
from .values import Value

IndexBody = Callable[[EmitContext, Value], None]


def gather_row(op) -> IndexBody:
    """Table row `indices[n]` into output row n; with an out-of-vocabulary row (Myelin's
    third input) an index outside the table reads that row instead of failing."""
    params, indices, *oov = op.inputs
    out = op.outputs[0]
    width = math.prod(params.shape[1:])

    def body(ctx: EmitContext, n: Value) -> None:
        lanes = ctx.lanes_for([params.dtype])
        row = load_index(ctx, indices, n)
        target = n * width
        inside = (row >= 0) & (row < params.shape[0]) if oov else check_range(ctx, row, params.shape[0])
        with ctx.when(inside):
            source = row * width
            ctx.row_each(target, width, lanes, lambda i, w: ctx.copy(params, source + i - target, out, i, w))
        if oov:
            with ctx.when(~inside):
                ctx.row_each(target, width, lanes, lambda i, w: ctx.copy(oov[0], i - target, out, i, w))

    return body


def one_hot_row(op) -> IndexBody:
    """Output row n: zeros with a one at `indices[n]`; an index out of range leaves it zero.
    One pass writes each element once (a GPU block's threads split the row)."""
    out = op.outputs[0]
    depth = out.shape[-1]

    def body(ctx: EmitContext, n: Value) -> None:
        lanes = ctx.lanes_for([out.dtype])
        start, hot = n * depth, load_index(ctx, op.inputs[0], n)

        def element(i, w):
            hit = ((i - start).splat(w) + ctx.lane_numbers(w)).equal(hot.splat(w))
            ctx.store(out, i, hit.where(ctx.constant(out.dtype, 1, w), ctx.constant(out.dtype, 0, w)))

        ctx.row_each(start, depth, lanes, element)

    return body


def pooled_rows(ctx: EmitContext, indices, visit) -> Value:
    """Call `visit(row, first)` for each row a pooled lookup combines: negative indices are
    padding, leading ones skipped and the next one after a row ending the list (Myelin's
    kernel). Returns how many rows were visited (int64)."""
    count = ctx.local(dtypes.DT_INT64, initial=0)
    ended = ctx.local(dtypes.DT_INT64, initial=0)
    with ctx.loop(0, indices.size, name="n") as n:
        row = load_index(ctx, indices, n)
        negative = row < 0
        ended.set((negative & (count.value > 0)).where(1, ended.value))
        with ctx.when(~negative & ended.value.equal(0)):
            visit(row, count.value.equal(0))
            count.set(count.value + 1)
    return count.value


# Each lookup op's body, one index at a time.
LOOKUP_OPS: dict[str, Callable[..., IndexBody]] = {"Gather": gather_row, "OneHot": one_hot_row}
