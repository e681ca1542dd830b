"""Kernels built on the strided loop engine: elementwise ops, fused Calculate programs,
and every data movement that is a view (copies, broadcasts, transposes, slices,
concatenation, splits, in-place assignment)."""

from __future__ import annotations

import math

import numpy as np

from ....ops import attrs_of
from ....ops.expression import Ref, parse
from ....ops.fused import program_types
from .. import elementwise
from ..irutil import for_range, i64, load, storage_type, store
from ..views import View, broadcast_view, contiguous_strides, dense_view, emit_map
from .index import check_range, load_index


def _identity(b, values, lanes):
    return values


def elementwise_op(ctx, op) -> None:
    out = op.outputs[0]
    inputs = [broadcast_view(v, out.shape) for v in op.inputs]
    dtypes_ = [v.dtype for v in op.inputs]

    def body(b, values, lanes):
        return [elementwise.emit(b, op.type, op.attrs, values, dtypes_, out.dtype)]

    emit_map(ctx, out.shape, inputs, [dense_view(out)], body)


def calculate(ctx, op) -> None:
    """A fused program: every statement is evaluated per element of the common output shape."""
    program = parse(op.attrs["expr"])
    types = program_types(program, op.inputs, op.name)
    shape = _iteration_shape(op)
    inputs = [broadcast_view(v, shape) for v in op.inputs]
    written = [t.index for t, _ in program.statements if t.kind == "%"]
    outputs = [dense_view(v) for v in op.outputs] + [dense_view(op.inputs[i]) for i in written]

    def body(b, values, lanes):
        env = {f"%{i}": value for i, value in enumerate(values)}

        def evaluate(node):
            if isinstance(node, Ref):
                return env[str(node)], types[str(node)].dtype
            args = [evaluate(a) for a in node.args]
            out_dtype = types[str(node)].dtype
            return elementwise.emit(b, node.op_type, dict(node.attrs), [a for a, _ in args], [d for _, d in args], out_dtype), out_dtype

        writes = []
        for target, call in program.statements:
            value, _ = evaluate(call)
            if target.kind == "%":
                writes.append(value)
            else:
                env[str(target)] = value
        return [env[f"@{j}"] for j in range(len(op.outputs))] + writes

    emit_map(ctx, shape, inputs, outputs, body)


def _iteration_shape(op):
    if op.outputs:
        return list(op.outputs[0].shape)
    program = parse(op.attrs["expr"])
    first_write = next(t.index for t, _ in program.statements if t.kind == "%")
    return list(op.inputs[first_write].shape)


def copy_elements(ctx, op) -> None:
    """Reshape, ExpandDims, Squeeze, Identity: the same elements in the same order. When
    the output shares the input's memory (planned in place, or a view of a global),
    there is nothing to do."""
    src, dst = op.inputs[0], op.outputs[0]
    offsets = ctx.layout.offsets
    if src.name == dst.name or dst.name in ctx.layout.aliases or (src.name in offsets and offsets.get(dst.name) == offsets[src.name]):
        return
    emit_map(ctx, [dst.size], [View(src, 0, [1])], [View(dst, 0, [1])], _identity)


def broadcast_to(ctx, op) -> None:
    out = op.outputs[0]
    emit_map(ctx, out.shape, [broadcast_view(op.inputs[0], out.shape)], [dense_view(out)], _identity)


def assign(ctx, op) -> None:
    target, value = op.inputs
    emit_map(ctx, [target.size], [View(value, 0, [1])], [View(target, 0, [1])], _identity)


def transpose(ctx, op) -> None:
    x, out = op.inputs[0], op.outputs[0]
    perm = attrs_of(op)["perm"] or list(reversed(range(x.rank)))
    own = contiguous_strides(x.shape)
    emit_map(ctx, out.shape, [View(x, 0, [own[p] for p in perm])], [dense_view(out)], _identity)


def slice_(ctx, op) -> None:
    x, out = op.inputs[0], op.outputs[0]
    begin = attrs_of(op)["begin"]
    own = contiguous_strides(x.shape)
    offset = sum(b * s for b, s in zip(begin, own))
    emit_map(ctx, out.shape, [View(x, offset, own)], [dense_view(out)], _identity)


def _axis(value_var, rank):
    return int(np.asarray(value_var.data).reshape(-1)[0]) % rank


def concat(ctx, op) -> None:
    out = op.outputs[0]
    axis = _axis(op.inputs[-1], out.rank)
    out_strides = contiguous_strides(out.shape)
    position = 0
    for part in op.inputs[:-1]:
        emit_map(ctx, part.shape, [dense_view(part)], [View(out, position * out_strides[axis], out_strides)], _identity)
        position += part.shape[axis]


def split(ctx, op) -> None:
    x = op.inputs[0]
    axis = _axis(op.inputs[2], x.rank)
    own = contiguous_strides(x.shape)
    position = 0
    for part in op.outputs:
        emit_map(ctx, part.shape, [View(x, position * own[axis], own)], [dense_view(part)], _identity)
        position += part.shape[axis]


def assign_slice(ctx, op) -> None:
    """target[..., start:start+n, ...] = value: only the n rows move, whatever the target's size."""
    target, value, start = op.inputs
    b = ctx.b
    axis = attrs_of(op)["axis"] % target.rank
    outer = math.prod(target.shape[:axis])
    inner = math.prod(target.shape[axis + 1 :])
    rows, capacity = value.shape[axis], target.shape[axis]
    begin = load_index(ctx, start, i64(0))
    check_range(ctx, begin, capacity)
    room = b.sub(i64(capacity), begin)
    count = b.select(b.icmp_signed("<", room, i64(rows)), room, i64(rows))
    count = b.select(b.icmp_signed("<", count, i64(0)), i64(0), count)
    element = storage_type(target.dtype)
    source, destination = ctx.pointer(value), ctx.pointer(target)
    with for_range(b, i64(0), i64(outer), name="o") as o:
        from_row = b.mul(o, i64(rows * inner))
        to_row = b.add(b.mul(o, i64(capacity * inner)), b.mul(begin, i64(inner)))
        with for_range(b, i64(0), b.mul(count, i64(inner)), name="e") as e:
            store(b, load(b, source, b.add(from_row, e), element), destination, b.add(to_row, e), element)


KERNELS = {
    **{t: ("Elementwise", elementwise_op) for t in elementwise.SUPPORTED if t not in ("Identity",)},
    "Calculate": ("Calculate", calculate),
    "Identity": ("Copy", copy_elements),
    "Reshape": ("Copy", copy_elements),
    "ExpandDims": ("Copy", copy_elements),
    "Squeeze": ("Copy", copy_elements),
    "BroadcastTo": ("Broadcast", broadcast_to),
    "Assign": ("Assign", assign),
    "AssignSlice": ("AssignSlice", assign_slice),
    "Transpose": ("Transpose", transpose),
    "Slice": ("Slice", slice_),
    "Concat": ("Concat", concat),
    "Split": ("Split", split),
}

