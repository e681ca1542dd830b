"""Window primitives on the strided loop engine: Pad, StridedView, StridedScatterAdd."""

from __future__ import annotations

from ....ops import attrs_of
from ..convert import narrow
from ..irutil import compute_type, constant, i64, storage_type, store, vector_of
from ..views import View, contiguous_strides, dense_view, emit_map, for_vectors


def _identity(b, values, lanes):
    return values


def _fill(ctx, var, value: float) -> None:
    b = ctx.b
    pointer, element = ctx.pointer(var), storage_type(var.dtype)
    lanes = ctx.lanes_for([var.dtype])

    def put(index, width):
        store(b, narrow(b, constant(vector_of(compute_type(var.dtype), width), value), var.dtype, width), pointer, index, element, width)

    for_vectors(b, i64(0), var.size, lanes, put)


def pad(ctx, op) -> None:
    x, out = op.inputs[0], op.outputs[0]
    attrs = attrs_of(op)
    _fill(ctx, out, attrs["value"])
    strides = contiguous_strides(out.shape)
    offset = sum(p * s for p, s in zip(attrs["before"], strides))
    emit_map(ctx, x.shape, [dense_view(x)], [View(out, offset, strides)], _identity)


def _view(op, var) -> View:
    attrs = attrs_of(op)
    return View(var, attrs["offset"], attrs["strides"])


def strided_view(ctx, op) -> None:
    out = op.outputs[0]
    emit_map(ctx, out.shape, [_view(op, op.inputs[0])], [dense_view(out)], _identity)


def strided_scatter_add(ctx, op) -> None:
    d, out = op.inputs[0], op.outputs[0]
    _fill(ctx, out, 0.0)
    emit_map(ctx, d.shape, [dense_view(d)], [_view(op, out)], _identity, accumulate=True)


def choose(op):
    return {"Pad": ("Pad", pad), "StridedView": ("StridedView", strided_view), "StridedScatterAdd": ("StridedScatterAdd", strided_scatter_add)}.get(op.type)
