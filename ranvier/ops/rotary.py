"""Rotary position embedding as one op, so a backend can turn each pair in one pass.

Rotary(x [..., T, H, D], cos [T, D/2], sin [T, D/2]) → [..., T, H, D]: at position t each
pair of features (2i, 2i + 1) of every head turns by the angle whose cosine and sine are
cos[t, i] and sin[t, i] (llama2.c's interleaved pairs; Hugging Face's halves are turned
into them by permuting the projections' columns on import):

    y[2i]     = x[2i] · cos − x[2i + 1] · sin
    y[2i + 1] = x[2i] · sin + x[2i + 1] · cos

With `inverse` each pair turns back by the same angle (sin negated): the gradient of a
rotation is the rotation back. Built of Split, products and Concat, a model's RoPE took
four ops and three passes over q and k each way; a backend without a kernel for it runs
exactly those (the decomposition below).
"""

from __future__ import annotations

import numpy as np

from .registry import Attr, TensorType, attrs_of, decomposition, define
from .rules import FLOATS


def _infer_rotary(ctx):
    x, cos, sin = ctx.inputs
    if x.dtype not in FLOATS or x.rank < 3 or x.shape[-1] % 2:
        raise ctx.fail("floating-point x [..., T, H, D] of rank >= 3 with an even D (pairs of features)")
    tables = [x.shape[-3], x.shape[-1] // 2]
    for table in (cos, sin):
        if table.dtype != x.dtype or list(table.shape) != tables:
            raise ctx.fail(f"cos and sin tables {x.dtype}{tables} (positions, pairs) for x {x.dtype}{list(x.shape)}")
    return [TensorType(x.dtype, x.shape)]


def rotary(x, cos, sin, inverse: bool = False):
    """Each pair (2i, 2i+1) of x [..., T, H, D] turned by the angle at its position (float64)."""
    x = np.asarray(x, np.float64)
    cos, sin = (np.asarray(t, np.float64)[:, None, :] for t in (cos, sin))  # [T, 1, D/2] against pairs [..., T, H, D/2]
    sin = -sin if inverse else sin
    even, odd = x[..., 0::2], x[..., 1::2]
    y = np.empty_like(x)
    y[..., 0::2] = even * cos - odd * sin
    y[..., 1::2] = even * sin + odd * cos
    return y


def _pairs(t):
    """A [..., T, H, D] tensor's (even, odd) features, each [..., T, H, D/2, 1]."""
    return t.reshape([*t.shape[:-1], t.shape[-1] // 2, 2]).split(2, axis=-1)


def _per_position(t, tables_shape):
    """A [..., T, H, D/2, 1] product summed over everything but positions and pairs."""
    axes = [*range(t.rank - 4), t.rank - 3, t.rank - 1]
    return t.sum(axis=axes).reshape(tables_shape)


def _rotary_vjp(ctx, grads):
    """d x turns back; d cos and d sin (tables are rarely learned, and pruned then) sum the
    pairs' products over batch and heads."""
    x, cos, sin = ctx.inputs
    inverse = ctx.attrs["inverse"]
    (g,) = grads
    (g0, g1), (x0, x1) = _pairs(g), _pairs(x)
    d_sin = _per_position(g1 * x0 - g0 * x1, cos.shape)
    return [ctx.b.rotary(g, cos, sin, inverse=not inverse), _per_position(g0 * x0 + g1 * x1, cos.shape),
            -d_sin if inverse else d_sin]


define(
    "Rotary", _infer_rotary, lambda a, args, o: [rotary(*args, inverse=a["inverse"])], 3, "nn",
    "Rotary(x [..., T, H, D], cos [T, D/2], sin [T, D/2]): each pair (2i, 2i+1) of features turned by its "
    "position's angle (rotary position embedding)",
    attrs=[Attr("inverse", "bool", False, "turn back by the angle (the gradient)")],
    vjp=_rotary_vjp,
    flops=lambda op: 3 * op.inputs[0].size,
    method="rotary",
)


@decomposition("Rotary")
def _rotary_by_pairs(b, op):
    x, cos, sin = (b.wrap(v) for v in op.inputs)
    positions, pairs = cos.shape
    cos, sin = (t.reshape([positions, 1, pairs, 1]) for t in (cos, sin))
    if attrs_of(op)["inverse"]:
        sin = -sin
    even, odd = _pairs(x)
    return b.concat([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)
