"""One output element of a reduction over contiguous axes (`kernels.py` runs one thread per
element): the input seen as [outer, reduced, inner], element (o, i) combines x[o, r, i]
down r — the CPU backend's own column reduction (`ranvier.backends.llvm.reductions`), one
lane wide; ArgMax and ArgMin run the CPU's own scan. Each thread sums in order, so a long
row is one thread's loop: correct everywhere, fast where outputs are many (a bias
gradient's column sums); a row split over a block's threads is the GPU speed issue's."""

from __future__ import annotations

from llvmlite import ir

from ...flow.graph import Operation, Variable
from ..llvm.context import EmitContext
from ..llvm.reductions import REDUCTIONS, arg_reduction_element, blocks, column_reduction
from ..llvm.values import index_value

ARG_REDUCTIONS = {"ArgMax", "ArgMin"}


def supports(op: Operation) -> bool:
    return op.type in ARG_REDUCTIONS or (op.type in REDUCTIONS and blocks(op) is not None)


def operands(op: Operation) -> tuple[Variable, ...]:
    return op.inputs[0], op.outputs[0]


def elements(op: Operation) -> int:
    return op.outputs[0].size


def emit(ctx: EmitContext, op: Operation, index: ir.Value) -> None:
    inner = blocks(op)[2]
    at = index_value(ctx.b, index)
    if op.type in ARG_REDUCTIONS:
        arg_reduction_element(op)(ctx, at // inner, at % inner)
    else:
        column_reduction(op)(ctx, at // inner, at % inner, 1)
