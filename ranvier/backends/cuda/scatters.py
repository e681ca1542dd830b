"""Accumulations on the GPU: ScatterAdd (rows of updates added at their indices: an
embedding's gradient) and StridedScatterAdd (d added through a strided view: a
convolution's or a pooling's input gradient). Two launches each: the output zeroed, one
thread per element; then one thread per update element adds it where it lands, with an
atomic add, since several land on one element (a repeated token, overlapping windows).
The order of those adds is the threads' and may vary in the last bits from run to run;
the host check, adding in index order, matches the CPU. An index outside the table sets
the status word."""

from __future__ import annotations

import math

from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ..llvm.context import EmitContext, check_range, load_index
from ..llvm.values import Value, index_value

ATOMIC_DTYPES = ("float32", "float64")  # what the GPU's atomic add takes for floats


def supports(op: Operation) -> bool:
    return op.type in ("ScatterAdd", "StridedScatterAdd") and op.outputs[0].dtype in ATOMIC_DTYPES


def _added(op: Operation) -> Variable:
    return op.inputs[1] if op.type == "ScatterAdd" else op.inputs[0]


def launches(op: Operation) -> list:
    out = op.outputs[0]
    return [(out.size, lambda ctx, index: ctx.store(out, index_value(ctx.b, index), 0)),
            (_added(op).size, lambda ctx, index: _add(ctx, op, index_value(ctx.b, index)))]


def _atomic_add(ctx: EmitContext, var: Variable, at: Value, value: Value) -> None:
    """var[at] += value, as one atomic add (float32 and float64 compute as they are stored)."""
    ctx.b.atomic_rmw("fadd", ctx.element_pointer(var, at), value.ir, "monotonic")


def _add(ctx: EmitContext, op: Operation, index: Value) -> None:
    out, added = op.outputs[0], _added(op)
    value = ctx.load(added, index)
    if op.type == "ScatterAdd":
        width = math.prod(out.shape[1:])
        row = load_index(ctx, op.inputs[0], index // width)
        with ctx.when(check_range(ctx, row, out.shape[0])):
            _atomic_add(ctx, out, row * width + index % width, value)
        return
    attrs = attrs_of(op)
    target, rest = ctx.index(attrs["offset"]), index
    for d in reversed(range(added.rank)):
        coordinate = rest % added.shape[d] if d else rest
        rest = rest // added.shape[d]
        target = target + coordinate * attrs["strides"][d]
    _atomic_add(ctx, out, target, value)

