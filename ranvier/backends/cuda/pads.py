"""One element of a Pad per GPU thread: the input's element where the output position lies
inside it, the padding value elsewhere. (The CPU fills the border, then copies the inside:
two maps; a thread computes its element either way at once.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ..llvm.strided import contiguous_strides
from ..llvm.values import index_value
from .library import LIBRARY, Generator, one_launch

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)


def supports(op: Operation) -> bool:
    return op.type == "Pad"


def operands(op: Operation) -> tuple[Variable, ...]:
    return op.inputs[0], op.outputs[0]


def elements(op: Operation) -> int:
    return op.outputs[0].size


def emit(ctx: ThreadContext, op: Operation, index: ir.Value) -> None:
    x, out = op.inputs[0], op.outputs[0]
    attrs = attrs_of(op)
    rest, inside, source = index_value(ctx.b, index), None, ctx.index(0)
    for d, (size, before, stride) in reversed(list(enumerate(zip(x.shape, attrs["before"], contiguous_strides(x.shape))))):
        coordinate = rest % out.shape[d] - before if d else rest - before
        rest = rest // out.shape[d]
        within = (coordinate >= 0) & (coordinate < size)
        inside = within if inside is None else inside & within
        source = source + within.where(coordinate, 0) * stride
    value = ctx.load(x, source)
    padding = ctx.constant(out.dtype, attrs["value"])
    ctx.store(out, index_value(ctx.b, index), inside.where(value, padding) if inside is not None else value)


LIBRARY.register(Generator("Pad", None, one_launch(elements, emit), supports=supports, rank=30, operands=operands,
                           foreach=True))
