"""One row of a row op (softmax, norms, cross-entropy and its gradient) per GPU thread:
the CPU backend's row passes (`ranvier.backends.llvm.rows`), run in a thread's context, one
element at a time. Correct at any row length; a long row (a 32,000-word vocabulary) is one
thread's loop, so splitting rows over a block's threads is the GPU speed issue's work."""

from __future__ import annotations

from llvmlite import ir

from ...flow.graph import Operation
from ..llvm.context import EmitContext
from ..llvm.rows import ROW_OPS, row_shape
from ..llvm.values import index_value


def supports(op: Operation) -> bool:
    return op.type in ROW_OPS and ROW_OPS[op.type][1](op)


def elements(op: Operation) -> int:
    return row_shape(op)[0]


def emit(ctx: EmitContext, op: Operation, index: ir.Value) -> None:
    ROW_OPS[op.type][0](op)(ctx, index_value(ctx.b, index))
