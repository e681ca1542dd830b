"""Writes into a variable in place, one GPU thread per element written: Assign (target =
value) and AssignSlice (target[..., start:start+n, ...] = value along an axis, from a
run-time start: a KV cache's new rows; rows past the target's end are dropped, and a
start outside it sets the status word, as on the CPU)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from llvmlite import ir

from ...flow.graph import Operation
from ...ops import attrs_of
from ..llvm.context import check_range, load_index
from ..llvm.values import index_value
from .library import LIBRARY, Generator, one_launch

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

OPS = ("Assign", "AssignSlice")


def supports(op: Operation) -> bool:
    return op.type in OPS


def elements(op: Operation) -> int:
    return op.inputs[1].size


def emit(ctx: ThreadContext, op: Operation, index: ir.Value) -> None:
    target, value = op.inputs[:2]
    e = index_value(ctx.b, index)
    if op.type == "Assign":
        ctx.copy(value, e, target, e)
        return
    axis = attrs_of(op)["axis"] % target.rank
    inner = math.prod(target.shape[axis + 1 :])
    rows, capacity = value.shape[axis], target.shape[axis]
    begin = load_index(ctx, op.inputs[2], 0)
    inside = check_range(ctx, begin, capacity)
    outer, row, column = e // (rows * inner), (e // inner) % rows, e % inner
    with ctx.when(inside & (row < capacity - begin)):
        ctx.copy(value, e, target, (outer * capacity + begin + row) * inner + column)


LIBRARY.register(Generator("Assign", None, one_launch(elements, emit), supports=supports, rank=110))
