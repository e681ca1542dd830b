"""Window primitives on the strided loop engine: Pad, StridedView, StridedScatterAdd."""

from __future__ import annotations

from ....ops import attrs_of
from ..views import View, contiguous_strides, dense_view, emit_map, fill
from .library import kernel


def _identity(values, lanes):
    return values


@kernel("Pad", {"Pad"})
def pad(ctx, op) -> None:
    """The border's value everywhere, then x over the inside: both maps, so a large pad
    is shared out over the cores."""
    x, out = op.inputs[0], op.outputs[0]
    attrs = attrs_of(op)
    emit_map(ctx, out.shape, [], [dense_view(out)], lambda values, lanes: [ctx.constant(out.dtype, attrs["value"], lanes)])
    strides = contiguous_strides(out.shape)
    offset = sum(p * s for p, s in zip(attrs["before"], strides))
    emit_map(ctx, x.shape, [dense_view(x)], [View(out, offset, strides)], _identity)


def _view(op, var) -> View:
    attrs = attrs_of(op)
    return View(var, attrs["offset"], attrs["strides"])


@kernel("StridedView", {"StridedView"})
def strided_view(ctx, op) -> None:
    out = op.outputs[0]
    emit_map(ctx, out.shape, [_view(op, op.inputs[0])], [dense_view(out)], _identity)


@kernel("StridedScatterAdd", {"StridedScatterAdd"})
def strided_scatter_add(ctx, op) -> None:
    d, out = op.inputs[0], op.outputs[0]
    fill(ctx, out, 0.0)
    emit_map(ctx, d.shape, [dense_view(d)], [_view(op, out)], _identity, accumulate=True)
