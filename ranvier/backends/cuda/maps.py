"""Elements of an elementwise op with a formula, of a fused Calculate program, or of a
copy through a view (`kernels.py` runs one thread per launch element: here one element of a
small map, four of a large one, loaded together); a concatenation or split is a copy per
part, each its own launch. The element's index is split into the
iteration dimensions (merged where every operand walks them as one), and each operand is
read through its strided view, so a broadcast costs no copy. The arithmetic is the CPU
backend's, from the same formulas on the same IR values (`ranvier.backends.llvm.formulas`),
one lane wide: the same code generator's results, bit for bit."""

from __future__ import annotations

import math
from contextlib import nullcontext
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


def unroll(description: _Map) -> int:
    """Elements a thread takes per trip through its loop: a large map's several, their loads
    all issued before any result is stored, so that each thread has that many loads in flight
    (one 2-byte load a thread leaves an H100 about half its bandwidth); a small map's one (its
    threads are few already), as is a wide program's (its registers would crowd the
    multiprocessor)."""
    views = len(description.inputs) + len(description.outputs)
    return UNROLL if math.prod(description.shape) >= UNROLLED_FROM and views <= UNROLLED_VIEWS else 1


UNROLL = 4
UNROLLED_FROM = 1 << 16  # elements
UNROLLED_VIEWS = 6  # inputs and outputs


def launches(op: Operation) -> list:
    """(elements, emit) per map: one for most ops, one per part of a Concat or Split. An
    element of the launch is `unroll` elements of the map, a launch's length apart (so a
    warp's loads of each stay one run of memory)."""
    made = []
    for description in _describe(op):
        size, count = math.prod(description.shape), unroll(description)
        made.append((-(-size // count), lambda ctx, index, d=description, c=count: _emit(ctx, d, index, c)))
    return made


def _emit(ctx: EmitContext, description: _Map, group: ir.Value, count: int) -> None:
    """Elements group, group + G, ... (`count` of them, G the launch's length) of the map:
    every load first, then the programs, then the stores (an element past the end reads
    the group's first and stores nothing)."""
    b = ctx.b
    size = math.prod(description.shape)
    length = -(-size // count)
    views = description.inputs + description.outputs
    dims, strides = collapse(description.shape, views)
    indices = [group if k == 0 else b.add(group, i64(k * length)) for k in range(count)]
    inside = [None] + [b.icmp_unsigned("<", index, i64(size)) for index in indices[1:]]
    safe = [index if within is None else b.select(within, index, group) for index, within in zip(indices, inside)]
    offsets = [_offsets(b, index, dims, strides, views) for index in safe]
    values = []
    for at in offsets:
        loaded = []
        for k, view in enumerate(description.inputs):
            raw = load(b, ctx.pointer(view.var), at[k], storage_type(view.var.dtype))
            loaded.append(Value(b, widen(b, raw, view.var.dtype, 1), view.var.dtype))
        values.append(loaded)
    results = [description.body(loaded, 1) for loaded in values]
    first_output = len(description.inputs)
    for at, within, computed in zip(offsets, inside, results):
        with b.if_then(within) if within is not None else nullcontext():
            for k, (view, value) in enumerate(zip(description.outputs, computed)):
                narrowed = narrow(b, value.ir, view.var.dtype, 1)
                store(b, narrowed, ctx.pointer(view.var), at[first_output + k], storage_type(view.var.dtype))


def _offsets(b: ir.IRBuilder, index: ir.Value, dims: list, strides: list[list[int]], views: list[View]) -> list[ir.Value]:
    """Each view's element offset for the map's element `index`."""
    coordinates, rest = [], index
    for d in reversed(range(len(dims))):  # the outermost coordinate needs no division
        coordinates.insert(0, b.srem(rest, i64(dims[d])) if d else rest)
        if d:
            rest = b.sdiv(rest, i64(dims[d]))
    found = []
    for number, view in enumerate(views):
        total = i64(view.offset)
        for coordinate, stride in zip(coordinates, strides[number]):
            if stride:
                total = b.add(total, b.mul(coordinate, i64(stride)))
        found.append(total)
    return found
