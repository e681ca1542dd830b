"""Lookups (Gather's row, OneHot's row) by index: the CPU backend's bodies
(`ranvier.backends.llvm.lookups`), a block per index whose threads split the row (an
embedding's: neighbouring threads copy neighbouring elements), or a thread per index where
rows are narrower than a warp. Pooled lookups (GatherSum, GatherMax, GatherAvg: Myelin's
bags of embeddings) a thread per output column, combining the rows the CPU's reading of
the indices picks (in the compute type, so half-precision tables sum in float32). An index
outside the table sets the kernel's status word, as on the CPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...flow.graph import Operation
from ..llvm.context import check_range
from ..llvm.lookups import LOOKUP_OPS, pooled_rows
from ..llvm.values import Value, index_value
from .library import LIBRARY, Generator
from .rows import row_launch
from .warps import WARP

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)



POOLED = {"GatherSum", "GatherMax", "GatherAvg"}


def supports(op: Operation) -> bool:
    return op.type in LOOKUP_OPS or op.type in POOLED


def launches(op: Operation) -> list[tuple]:
    if op.type in POOLED:
        return [(op.outputs[0].size, lambda ctx, index: _pooled_column(ctx, op, index_value(ctx.b, index)))]
    indices = op.inputs[1] if op.type == "Gather" else op.inputs[0]
    width = math.prod(op.inputs[0].shape[1:]) if op.type == "Gather" else op.outputs[0].shape[-1]
    body = LOOKUP_OPS[op.type](op)
    if width < WARP:
        return [(indices.size, lambda ctx, index: body(ctx, index_value(ctx.b, index)))]
    return [row_launch(indices.size, width, body)]


def _pooled_column(ctx: ThreadContext, op: Operation, column: Value) -> None:
    table, indices = op.inputs
    out = op.outputs[0]
    width = table.shape[1]
    total = ctx.local(out.dtype, initial=0)

    def visit(row: Value, first: Value) -> None:
        with ctx.when(check_range(ctx, row, table.shape[0])):
            value = ctx.load(table, row * width + column)
            total.set(first.where(value, total.value.maximum(value)) if op.type == "GatherMax" else total.value + value)

    count = pooled_rows(ctx, indices, visit)
    if op.type == "GatherAvg":
        total.set(count.equal(0).where(total.value, total.value / count.cast(out.dtype)))
    ctx.store(out, column, total.value)


LIBRARY.register(Generator("Lookup", None, launches, supports=supports, rank=60))
