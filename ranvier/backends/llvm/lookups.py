"""Table lookups by index, one index at a time, for every LLVM backend: Gather's row and
OneHot's row as `body(ctx, n)` for index n. The CPU loops over the indices and copies a row
in vectors; a GPU thread takes one index (its context's vectors are one lane wide)."""

from __future__ import annotations

import math
from collections.abc import Callable

from .context import EmitContext, check_range, load_index
from .loops import for_vectors
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
            for_vectors(ctx, 0, width, lanes, lambda i, w: ctx.copy(params, source + i, out, target + i, w))
        if oov:
            with ctx.when(~inside):
                for_vectors(ctx, 0, width, lanes, lambda i, w: ctx.copy(oov[0], i, out, target + i, w))

    return body


def one_hot_row(op) -> IndexBody:
    """Output row n: zeros with a one at `indices[n]`; an index out of range leaves it zero."""
    out = op.outputs[0]
    depth = out.shape[-1]

    def body(ctx: EmitContext, n: Value) -> None:
        lanes = ctx.lanes_for([out.dtype])
        for_vectors(ctx, n * depth, depth, lanes, lambda i, w: ctx.store(out, i, ctx.constant(out.dtype, 0, w)))
        hot = load_index(ctx, op.inputs[0], n)
        with ctx.when((hot >= 0) & (hot < depth)):
            ctx.store(out, n * depth + hot, 1)

    return body


# Each lookup op's body, one index at a time.
LOOKUP_OPS: dict[str, Callable[..., IndexBody]] = {"Gather": gather_row, "OneHot": one_hot_row}
