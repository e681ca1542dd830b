"""Kernels built on the strided loop engine: elementwise ops, fused Calculate programs,
and every data movement that is a view (copies, broadcasts, transposes, slices,
concatenation, splits, in-place assignment).

An elementwise op is generated from its definition's formula (`ranvier.ops`), evaluated
on IR values, so defining an elementwise op with a formula gives it a native kernel.
"""

from __future__ import annotations

import math

from ....ops import attrs_of, op_def
from ....ops.expression import program_of
from ....ops.shape import shape_fact
from ...kernels import GENERAL
from ...llvm.context import check_range, load_index
from ...llvm.formulas import apply, program_body
from ...llvm.strided import SOURCE_VIEWS, View, broadcast_view, dense_view, part_views
from ..views import emit_map
from .library import kernel


def _identity(values, lanes):
    return values


def _same_type(op, source, target) -> bool:
    """A loop kernel reads and writes element i together: an input of the output's exact
    type and shape may be overwritten."""
    return source.dtype == target.dtype and list(source.shape) == list(target.shape)


def _same_bytes(op, source, target) -> bool:
    """A copy of an input that dies at it takes over the input's bytes: then there is
    nothing to copy (the copy kernel skips a copy onto itself)."""
    return source.dtype == target.dtype and source.size == target.size


def has_formula(op) -> bool:
    definition = op_def(op.type)
    return definition.family == "elementwise" and definition.formula is not None and op.type != "Identity"


@kernel("Elementwise", supports=has_formula, rank=GENERAL, in_place=_same_type)
def elementwise(ctx, op) -> None:
    out = op.outputs[0]
    inputs = [broadcast_view(v, out.shape) for v in op.inputs]
    emit_map(ctx, out.shape, inputs, [dense_view(out)], lambda values, lanes: [apply(op.type, op.attrs, values)])


def _uniform_outputs(op) -> bool:
    return len({tuple(v.shape) for v in op.outputs}) <= 1


@kernel("Calculate", {"Calculate"}, supports=_uniform_outputs, in_place=_same_type)
def calculate(ctx, op) -> None:
    """A fused program: every statement is evaluated per element of the common output shape."""
    program = program_of(op)
    shape = _iteration_shape(op)
    inputs = [broadcast_view(v, shape) for v in op.inputs]
    outputs = [dense_view(v) for v in op.outputs] + [dense_view(op.inputs[i]) for i in program.writes]
    emit_map(ctx, shape, inputs, outputs, program_body(program, len(op.outputs)))


def _iteration_shape(op):
    if op.outputs:
        return list(op.outputs[0].shape)
    return list(op.inputs[program_of(op).writes[0]].shape)


@kernel("Copy", {"Identity", "Reshape", "ExpandDims", "Squeeze"}, in_place=_same_bytes)
def copy_elements(ctx, op) -> None:
    """The same elements in the same order. When the output shares the input's memory
    (planned in place, or a view of a global), there is nothing to do."""
    src, dst = op.inputs[0], op.outputs[0]
    offsets = ctx.layout.offsets
    if src.name == dst.name or dst.name in ctx.layout.aliases or (src.name in offsets and offsets.get(dst.name) == offsets[src.name]):
        return
    emit_map(ctx, [dst.size], [View(src, 0, [1])], [View(dst, 0, [1])], _identity)


@kernel("ShapeFact", {"Shape", "Size", "Rank"})
def shape_fact_(ctx, op) -> None:
    """Known when the cell is compiled: the values are stored as constants."""
    for i, value in enumerate(shape_fact(op.type, op.inputs[0].shape).reshape(-1).tolist()):
        ctx.store(op.outputs[0], i, value)


@kernel("Broadcast", {"BroadcastTo"})
@kernel("Transpose", {"Transpose"}, rank=20)
@kernel("Slice", {"Slice"})
def view_copy(ctx, op) -> None:
    """The input read through the op's view (`SOURCE_VIEWS`)."""
    out = op.outputs[0]
    emit_map(ctx, out.shape, [SOURCE_VIEWS[op.type](op)], [dense_view(out)], _identity)


@kernel("Assign", {"Assign"})
def assign(ctx, op) -> None:
    target, value = op.inputs
    emit_map(ctx, [target.size], [View(value, 0, [1])], [View(target, 0, [1])], _identity)


@kernel("Concat", {"Concat"})
def concat(ctx, op) -> None:
    for part, place in part_views(op):
        emit_map(ctx, part.shape, [dense_view(part)], [place], _identity)


@kernel("Split", {"Split"})
def split(ctx, op) -> None:
    for part, place in part_views(op):
        emit_map(ctx, part.shape, [place], [dense_view(part)], _identity)


@kernel("AssignSlice", {"AssignSlice"})
def assign_slice(ctx, op) -> None:
    """target[..., start:start+n, ...] = value: only the n rows move, whatever the target's
    size. A start outside the target fails the step and moves nothing."""
    target, value, start = op.inputs
    axis = attrs_of(op)["axis"] % target.rank
    outer = math.prod(target.shape[:axis])
    inner = math.prod(target.shape[axis + 1 :])
    rows, capacity = value.shape[axis], target.shape[axis]
    begin = load_index(ctx, start, 0)
    count = (capacity - begin).minimum(rows)
    with ctx.when(check_range(ctx, begin, capacity)), ctx.loop(0, outer, name="o") as o:
        from_row = o * (rows * inner)
        to_row = o * (capacity * inner) + begin * inner
        with ctx.loop(0, count * inner, name="e") as e:
            ctx.copy(value, from_row + e, target, to_row + e)
