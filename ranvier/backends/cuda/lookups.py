"""One index of a lookup (Gather's row, OneHot's row) per GPU thread: the CPU backend's
bodies (`ranvier.backends.llvm.lookups`), one lane wide. An index outside the table sets
the kernel's status word, as on the CPU."""

from __future__ import annotations

from llvmlite import ir

from ...flow.graph import Operation
from ..llvm.context import EmitContext
from ..llvm.lookups import LOOKUP_OPS
from ..llvm.values import index_value


def supports(op: Operation) -> bool:
    return op.type in LOOKUP_OPS


def elements(op: Operation) -> int:
    return op.inputs[1].size if op.type == "Gather" else op.inputs[0].size


def emit(ctx: EmitContext, op: Operation, index: ir.Value) -> None:
    LOOKUP_OPS[op.type](op)(ctx, index_value(ctx.b, index))
