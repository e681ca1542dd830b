"""One element of an elementwise op with a formula, of a fused Calculate program, or of a
copy through a view (`kernels.py` runs one thread per element); a concatenation or split is
a copy per part, each its own launch. The element's index is split into the
iteration dimensions (merged where every operand walks them as one), and each operand is
read through its strided view, so a broadcast costs no copy. The arithmetic is the CPU
backend's, from the same formulas on the same IR values (`ranvier.backends.llvm.formulas`),
one lane wide: the same code generator's results, bit for bit."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llvmlite import ir

from ...flow.graph import Operation, Variable
from ...ops import op_def
from ...ops.expression import parse
from ..llvm.context import EmitContext
from ..llvm.convert import narrow, widen
from ..llvm.formulas import apply, program_body
from ..llvm.irutil import i64, load, storage_type, store
from ..llvm.strided import (
    SOURCE_VIEWS,
    Body,
    View,
    broadcast_view,
    collapse,
    contiguous_strides,
    dense_view,
    part_views,
)
from ..llvm.values import Value


@dataclass(frozen=True)
class _Map:
    shape: list[int]
    inputs: list[View]
    outputs: list[View]
    body: Body


def _same_elements(op: Operation) -> View:
    return View(op.inputs[0], 0, contiguous_strides(op.outputs[0].shape))


# Data movement as a map of one input read through a view: the output's element is the
# input's element the view reaches (the views the CPU's copy kernels read too).
COPIES = {"Identity": _same_elements, "Reshape": _same_elements, "ExpandDims": _same_elements, "Squeeze": _same_elements,
          **SOURCE_VIEWS}


def _identity(values, lanes):
    return values


def is_copy(op: Operation) -> bool:
    """Data movement only: a view's copy, a concatenation or a split."""
    return op.type in COPIES or op.type in ("Concat", "Split")


def _parts(op: Operation) -> list[_Map]:
    """Concat and Split as one copy per part: a part read densely and written through a
    view of the whole at its place along the axis (or the other way round)."""
    if op.type == "Concat":
        return [_Map(list(part.shape), [dense_view(part)], [place], _identity) for part, place in part_views(op)]
    return [_Map(list(part.shape), [place], [dense_view(part)], _identity) for part, place in part_views(op)]


def supports(op: Operation) -> bool:
    """An elementwise op with a formula, a Calculate whose outputs share one shape, a copy
    through a view (a reshape, broadcast, transpose, slice or any strided view), or a
    concatenation or split (a copy per part)."""
    if op.type == "Calculate":
        return len({tuple(v.shape) for v in op.outputs}) <= 1
    definition = op_def(op.type)
    return is_copy(op) or (definition.family == "elementwise" and definition.formula is not None)


def _describe(op: Operation) -> list[_Map]:
    """The op's maps, one per launch."""
    if op.type in ("Concat", "Split"):
        return _parts(op)
    if op.type in COPIES:
        return [_Map(list(op.outputs[0].shape), [COPIES[op.type](op)], [dense_view(op.outputs[0])], _identity)]
    if op.type != "Calculate":
        shape = list(op.outputs[0].shape)
        return [_Map(shape, [broadcast_view(v, shape) for v in op.inputs], [dense_view(op.outputs[0])],
                     lambda values, lanes: [apply(op.type, op.attrs, values)])]
    program = parse(op.attrs["expr"])
    written = [t.index for t, _ in program.statements if t.kind == "%"]
    shape = list(op.outputs[0].shape) if op.outputs else list(op.inputs[written[0]].shape)
    outputs = [dense_view(v) for v in op.outputs] + [dense_view(op.inputs[i]) for i in written]
    return [_Map(shape, [broadcast_view(v, shape) for v in op.inputs], outputs, program_body(program, len(op.outputs)))]


def operands(op: Operation) -> tuple[Variable, ...]:
    views = [view for description in _describe(op) for view in description.inputs + description.outputs]
    return tuple({id(v.var): v.var for v in views}.values())


def launches(op: Operation) -> list:
    """(elements, emit) per map: one for most ops, one per part of a Concat or Split."""
    return [(math.prod(description.shape), lambda ctx, index, description=description: _emit(ctx, description, index))
            for description in _describe(op)]


def _emit(ctx: EmitContext, description: _Map, index: ir.Value) -> None:
    b = ctx.b
    views = description.inputs + description.outputs
    dims, strides = collapse(description.shape, views)
    coordinates, rest = [], index
    for d in reversed(range(len(dims))):  # the outermost coordinate needs no division
        coordinates.insert(0, b.srem(rest, i64(dims[d])) if d else rest)
        if d:
            rest = b.sdiv(rest, i64(dims[d]))

    def offset(number: int) -> ir.Value:
        total = i64(views[number].offset)
        for coordinate, stride in zip(coordinates, strides[number]):
            if stride:
                total = b.add(total, b.mul(coordinate, i64(stride)))
        return total

    values = []
    for k, view in enumerate(description.inputs):
        raw = load(b, ctx.pointer(view.var), offset(k), storage_type(view.var.dtype))
        values.append(Value(b, widen(b, raw, view.var.dtype, 1), view.var.dtype))
    first_output = len(description.inputs)
    for k, (view, value) in enumerate(zip(description.outputs, description.body(values, 1))):
        narrowed = narrow(b, value.ir, view.var.dtype, 1)
        store(b, narrowed, ctx.pointer(view.var), offset(first_output + k), storage_type(view.var.dtype))
