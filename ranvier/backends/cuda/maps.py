"""Elements of an elementwise op with a formula, of a fused Calculate program, or of a
copy through a view (`kernels.py` runs one thread per launch element: here one element of a
small map, four of a large one, loaded together, or a vector of a map whose operands allow
it); a concatenation or split is a copy per part, each its own launch. The element's index
is split into the iteration dimensions (merged where every operand walks them as one), and
each operand is read through its strided view, so a broadcast costs no copy. The
arithmetic is the CPU backend's, from the same formulas on the same IR values
(`ranvier.backends.llvm.formulas`): the same code generator's results, bit for bit.

A map whose every operand holds a thread's run of elements contiguous and 16 bytes
aligned (or one broadcast element) takes them as a vector (`vector_lanes`: 8 bfloat16 or
4 float32), each operand one 16-byte load or store (`ld.global.v4`), the GPU's widest: a
2-byte load per thread leaves an H100's memory system waiting on instructions. The
elements past the last whole vector (a size not a multiple of the lanes) are a thread's
each. The arena's offsets and the driver's allocations are 64-byte aligned, so a variable's
element k·lanes is 16-byte aligned; a view starting elsewhere (a slice at an odd column)
is read element by element. Between its loads and its stores a vector's program runs lane
by lane, so that a thread's registers hold the loaded vectors and one lane's temporaries
(`_emit_run`): few enough for the warps that cover memory's latency."""

from __future__ import annotations

import math
from collections.abc import Hashable
from contextlib import nullcontext
from dataclasses import dataclass

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import op_def
from ...ops.expression import program_of
from ...ops.foreach import Member
from ..llvm.context import EmitContext
from ..llvm.convert import narrow, widen
from ..llvm.formulas import apply, program_body
from ..llvm.irutil import I32, i64, load, storage_type, store, typed_pointer
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
from . import fastmath
from .library import LIBRARY, Generator


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


def is_copy(op: Operation | Member) -> bool:
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
        sfu = fastmath.formula(op.type, [op.outputs[0].dtype])

        def body(values: list[Value], lanes: int) -> list[Value]:
            return [sfu(values, dict(op.attrs)) if sfu is not None else apply(op.type, op.attrs, values)]

        return [_Map(shape, [broadcast_view(v, shape) for v in op.inputs], [dense_view(op.outputs[0])], body)]
    program = program_of(op)
    written = program.writes
    shape = list(op.outputs[0].shape) if op.outputs else list(op.inputs[written[0]].shape)
    outputs = [dense_view(v) for v in op.outputs] + [dense_view(op.inputs[i]) for i in written]
    formulas = fastmath.program_formulas(program, len(op.outputs), [view.var.dtype for view in outputs])
    return [_Map(shape, [broadcast_view(v, shape) for v in op.inputs], outputs, program_body(program, len(op.outputs), formulas))]


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


VECTOR_BYTES = 16  # a thread's widest load or store: ld.global.v4.b32
MAX_LANES = 8  # bfloat16's lanes in those bytes (narrower types take 8 too: fewer registers)


def vector_lanes(description: _Map) -> int:
    """Elements of the map a thread takes as one vector (module docstring), or 1: each
    view's run of them one element (a broadcast) or contiguous, starting at a multiple of
    the lanes; runs within the innermost dimension (a single dimension may end in a partial
    run, which the scalar tail takes)."""
    views = description.inputs + description.outputs
    lanes = min(MAX_LANES, VECTOR_BYTES // min(dtypes.itemsize(v.var.dtype) for v in views))
    dims, strides = collapse(description.shape, views)
    if lanes < 2 or math.prod(description.shape) < lanes or (len(dims) > 1 and dims[-1] % lanes):
        return 1
    for view, steps in zip(views, strides):
        if steps[-1] == 1 and (view.offset % lanes or any(step % lanes for step in steps[:-1])):
            return 1
        if steps[-1] not in (0, 1):
            return 1
    return lanes


def launches(op: Operation) -> list:
    """(elements, emit) per map: one for most ops, one per part of a Concat or Split. An
    element of the launch is a vector of the map's elements and then one of its tail
    (`vector_lanes`), or `unroll` elements of the map, a launch's length apart (so a warp's
    loads of each stay one run of memory)."""
    made = []
    for description in _describe(op):
        size, lanes = math.prod(description.shape), vector_lanes(description)
        if lanes > 1:
            vectors, tail = divmod(size, lanes)
            made.append((vectors + tail, lambda ctx, index, d=description, n=lanes: _emit_vectors(ctx, d, index, n)))
            continue
        count = unroll(description)
        made.append((-(-size // count), lambda ctx, index, d=description, c=count: _emit(ctx, d, index, c)))
    return made


def _emit_vectors(ctx: EmitContext, description: _Map, index: ir.Value, lanes: int) -> None:
    """Launch element `index`: the map's elements index·lanes, ... as one vector, or past
    the last whole vector, one element of the tail."""
    b = ctx.b
    size = math.prod(description.shape)
    vectors = size // lanes
    if size == vectors * lanes:
        _emit_run(ctx, description, b.mul(index, i64(lanes)), lanes)
        return
    with b.if_else(b.icmp_unsigned("<", index, i64(vectors))) as (body, tail):
        with body:
            _emit_run(ctx, description, b.mul(index, i64(lanes)), lanes)
        with tail:
            _emit_run(ctx, description, b.add(index, i64(vectors * (lanes - 1))), 1)


def _emit_run(ctx: EmitContext, description: _Map, first: ir.Value, lanes: int) -> None:
    """The map's elements first, ..., first + lanes − 1 (a run within the innermost dimension),
    each view's as one access: a vector of its contiguous elements, or its one broadcast
    element repeated. Between the loads and the stores the program runs lane by lane, as
    the unrolled map (`_emit`) runs its elements: a thread holds its operands' vectors and
    one lane's temporaries. Run on whole vectors, the program's every step was eight lanes
    wide and every lane's temporaries were live at once: a bfloat16 SwiGLU gradient took 109
    registers (two blocks of 256 threads a multiprocessor, too few warps to cover memory's
    latency), lane by lane 45; ptxas, capped instead, spills."""
    b = ctx.b
    views = description.inputs + description.outputs
    dims, strides = collapse(description.shape, views)
    offsets = _offsets(b, first, dims, strides, views)
    loaded: list[ir.Value] = []
    for view, at, steps in zip(description.inputs, offsets, strides):
        width = lanes if steps[-1] else 1
        pointer, align = _access(b, ctx.pointer(view.var), at, view.var.dtype, width)
        loaded.append(b.load(pointer, align=align))
    results: list[list[ir.Value]] = [[] for _ in description.outputs]
    for lane in range(lanes):
        values = [Value(b, widen(b, _lane(b, raw, lane), view.var.dtype, 1), view.var.dtype)
                  for view, raw in zip(description.inputs, loaded)]
        for found, view, value in zip(results, description.outputs, description.body(values, 1)):
            found.append(narrow(b, value.ir, view.var.dtype, 1))
    first_output = len(description.inputs)
    for view, at, found in zip(description.outputs, offsets[first_output:], results):
        pointer, align = _access(b, ctx.pointer(view.var), at, view.var.dtype, lanes)
        b.store(_vector(b, found), pointer, align=align)


def _lane(b: ir.IRBuilder, raw: ir.Value, lane: int) -> ir.Value:
    """Lane `lane` of a loaded vector; a loaded scalar (a broadcast element) as it is."""
    return b.extract_element(raw, ir.Constant(I32, lane)) if isinstance(raw.type, ir.VectorType) else raw


def _vector(b: ir.IRBuilder, lanes: list[ir.Value]) -> ir.Value:
    """The lanes' scalars as one vector; one lane as the scalar it is."""
    if len(lanes) == 1:
        return lanes[0]
    vector = ir.Constant(ir.VectorType(lanes[0].type, len(lanes)), ir.Undefined)
    for index, value in enumerate(lanes):
        vector = b.insert_element(vector, value, ir.Constant(I32, index))
    return vector


def _access(b: ir.IRBuilder, base: ir.Value, at: ir.Value, dtype: str, lanes: int) -> tuple[ir.Value, int | None]:
    """A pointer to `lanes` elements of a variable from element `at` (a multiple of the
    lanes: 16-byte aligned, or the run's bytes where fewer), and that alignment."""
    pointer = typed_pointer(b, base, at, storage_type(dtype), lanes)
    return pointer, (min(VECTOR_BYTES, lanes * dtypes.itemsize(dtype)) if lanes > 1 else None)


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
    coordinates: list[ir.Value] = []
    rest = index
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


@dataclass(frozen=True)
class FlatMap:
    """A map over one run of elements, each view either walking it from its variable's first
    element (stride 1) or one element broadcast (stride 0): an optimizer's update of a
    parameter, a weight's cast. Its code does not depend on its size, so one body serves
    every flat map of one `key`, the size given at run time (`emit_flat`: a table-driven
    ForEach's members)."""

    key: Hashable  # what the code is made of: the op's type and attributes; each view's dtype, stride and variable; the lanes
    description: _Map
    size: int
    lanes: int  # `vector_lanes`

    @property
    def elements(self) -> int:
        """Launch elements: one per vector, then one per element of the tail."""
        return self.size - self.size // self.lanes * (self.lanes - 1)


def flat_map(op: Operation) -> FlatMap | None:
    """The op's one map as a `FlatMap`, or None where it is not one (several launches, a
    view starting elsewhere or striding otherwise)."""
    if is_copy(op) or not supports(op):
        return None
    described = _describe(op)
    if len(described) != 1:
        return None
    description = described[0]
    views = description.inputs + description.outputs
    dims, strides = collapse(description.shape, views)
    if len(dims) != 1 or any(view.offset or steps[-1] not in (0, 1) for view, steps in zip(views, strides)):
        return None
    first: dict[int, int] = {}  # which view's variable each view's is: a variable's pointer serves all its views
    lanes = vector_lanes(description)
    key = (op.type, tuple(sorted(op.attrs.items())), len(description.inputs),
           tuple((view.var.dtype, steps[-1], first.setdefault(id(view.var), k))
                 for k, (view, steps) in enumerate(zip(views, strides))), lanes)
    return FlatMap(key, description, math.prod(description.shape), lanes)


def emit_flat(ctx: EmitContext, flat: FlatMap, size: ir.Value, index: ir.Value) -> None:
    """Launch element `index` (one of `FlatMap.elements`) of the map of `flat`'s key over
    `size` elements: the arithmetic of the map's own kernel (`launches`), bit for bit."""
    b, lanes = ctx.b, flat.lanes
    if lanes == 1:
        _emit_run(ctx, flat.description, index, 1)
        return
    vectors = b.udiv(size, i64(lanes))
    with b.if_else(b.icmp_unsigned("<", index, vectors)) as (body, tail):
        with body:
            _emit_run(ctx, flat.description, b.mul(index, i64(lanes)), lanes)
        with tail:
            _emit_run(ctx, flat.description, b.add(index, b.mul(vectors, i64(lanes - 1))), 1)


def _same_type(op: Operation, source: Variable, target: Variable) -> bool:
    """A thread reads its element's inputs before it writes: an elementwise op may write
    over an input of its output's exact type and shape."""
    return source.dtype == target.dtype and list(source.shape) == list(target.shape)


LIBRARY.register(Generator("Copy", None, launches, supports=lambda op: supports(op) and is_copy(op), rank=10,
                           operands=operands))
LIBRARY.register(Generator("Map", None, launches, supports=supports, rank=20, in_place=_same_type, operands=operands,
                           foreach=True))
