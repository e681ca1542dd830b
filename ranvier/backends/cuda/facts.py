"""Shape, Size and Rank: the input's static shape, known when the cell is compiled, stored
into the output by one thread per element (the input itself is never read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from ...flow.graph import Operation, Variable
from ...ops.shape import SHAPE_FACTS, shape_fact
from ..llvm.values import index_value
from .library import LIBRARY, Generator, one_launch

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)


def supports(op: Operation) -> bool:
    return op.type in SHAPE_FACTS


def operands(op: Operation) -> tuple[Variable, ...]:
    return (op.outputs[0],)


def elements(op: Operation) -> int:
    return op.outputs[0].size


def emit(ctx: ThreadContext, op: Operation, index: ir.Value) -> None:
    at = index_value(ctx.b, index)
    for position, value in enumerate(shape_fact(op.type, op.inputs[0].shape).reshape(-1).tolist()):
        with ctx.when(at.equal(position)):
            ctx.store(op.outputs[0], position, value)


LIBRARY.register(Generator("ShapeFact", None, one_launch(elements, emit), supports=supports, rank=140, operands=operands))
