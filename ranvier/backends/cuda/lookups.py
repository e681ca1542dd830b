"""Lookups (Gather's row, OneHot's row) by index: the CPU backend's bodies
(`ranvier.backends.llvm.lookups`), a block per index whose threads split the row (an
embedding's: neighbouring threads copy neighbouring elements), or a thread per index where
rows are narrower than a warp. An index outside the table sets the kernel's status word,
as on the CPU."""

from __future__ import annotations

import math

from llvmlite import ir

from ...flow.graph import Operation
from ..llvm.lookups import LOOKUP_OPS
from ..llvm.values import index_value
from .rows import threads_per_row

WARP = 32


def supports(op: Operation) -> bool:
    return op.type in LOOKUP_OPS


def launches(op: Operation) -> list[tuple]:
    indices = op.inputs[1] if op.type == "Gather" else op.inputs[0]
    width = math.prod(op.inputs[0].shape[1:]) if op.type == "Gather" else op.outputs[0].shape[-1]
    body = LOOKUP_OPS[op.type](op)
    if width < WARP:
        return [(indices.size, lambda ctx, index: body(ctx, index_value(ctx.b, index)))]
    threads = threads_per_row(width)

    def emit(ctx, index: ir.Value) -> None:
        ctx.row_threads = threads
        body(ctx, index_value(ctx.b, index))

    return [(indices.size, emit, threads)]
