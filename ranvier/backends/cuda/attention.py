"""Attention and its gradient as GPU kernels that never form the T × S score matrix: one
thread per query row (or key row), each score computed where it is used.

Attention: a query row's thread runs over its visible keys once with an online softmax
(the running maximum m, the running sum l, and the output row rescaled when m grows).

AttentionGrad, three launches in order:
1. per query row: m and l over the visible keys, then D = Σₛ pₛ (dout · vₛ); the three
   are parked in the first elements of the row's dq (a head has at least three), which
   the third launch overwrites;
2. per key row: dk and dv summed over the queries that see the key, in every head of its
   group, each pₛ recomputed from the parked m and l;
3. per query row: dq = scale · Σₛ pₛ (dout · vₛ − D) kₛ.
Head sizes under three, and half-precision gradients (m, l, D would be rounded), are
decomposed into products and a softmax instead. Correct at any size; tiles on tensor
cores are the GPU speed issue's work.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ...ops.attention import scale_of
from ..llvm.context import EmitContext
from ..llvm.values import Value, index_value

_PARKED = 3  # m, l and D, in a dq row between launches


def supports(op: Operation) -> bool:
    if op.type == "Attention":
        return True
    return (op.type == "AttentionGrad" and op.inputs[0].shape[-1] >= _PARKED
            and op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64))


class _Shape:
    """An attention op's sizes and the element offsets of its rows."""

    def __init__(self, op: Operation):
        q, k = op.inputs[0], op.inputs[1]
        self.batch, self.heads, self.queries, self.size = q.shape
        self.kv_heads, self.keys = k.shape[1], k.shape[2]
        self.group = self.heads // self.kv_heads
        attrs = attrs_of(op)
        self.causal, self.scale = attrs["causal"], scale_of(attrs, self.size)

    def query_row(self, b: Value, h: Value, t: Value) -> Value:
        return ((b * self.heads + h) * self.queries + t) * self.size

    def key_row(self, b: Value, kv: Value, s: Value) -> Value:
        return ((b * self.kv_heads + kv) * self.keys + s) * self.size

    def visible_keys(self, ctx: EmitContext, t: Value) -> Value:
        """One past the last key query t sees."""
        return t + (self.keys - self.queries + 1) if self.causal else ctx.index(self.keys)


def _dot(ctx: EmitContext, a: Variable, a_row: Value, b: Variable, b_row: Value, size: int, dtype: str) -> Value:
    total = ctx.local(dtype, initial=0.0)
    with ctx.loop(0, size, name="d") as i:
        total.set(total.value + ctx.load(a, a_row + i) * ctx.load(b, b_row + i))
    return total.value


def _score(ctx: EmitContext, op: Operation, shape: _Shape, query: Value, key: Value, dtype: str) -> Value:
    """scale · q[query row] · k[key row]."""
    return _dot(ctx, op.inputs[0], query, op.inputs[1], key, shape.size, dtype) * shape.scale


def _probability(ctx: EmitContext, op: Operation, shape: _Shape, query: Value, key: Value, dtype: str, peak: Value,
                 total: Value) -> Value:
    """The softmax probability of a (query, key) pair, from its row's maximum and sum."""
    return (_score(ctx, op, shape, query, key, dtype) - peak).exp() / total


def launches(op: Operation) -> list[tuple[int, Callable[[EmitContext, ir.Value], None]]]:
    shape = _Shape(op)
    query_rows = shape.batch * shape.heads * shape.queries
    if op.type == "Attention":
        return [(query_rows, lambda ctx, index: _forward(ctx, op, shape, index_value(ctx.b, index)))]
    return [(query_rows, lambda ctx, index: _statistics(ctx, op, shape, index_value(ctx.b, index))),
            (shape.batch * shape.kv_heads * shape.keys, lambda ctx, index: _key_gradients(ctx, op, shape, index_value(ctx.b, index))),
            (query_rows, lambda ctx, index: _query_gradient(ctx, op, shape, index_value(ctx.b, index)))]


def _query(shape: _Shape, row: Value) -> tuple[Value, Value, Value]:
    """(batch, head, query) of a query row's index."""
    return row // (shape.heads * shape.queries), (row // shape.queries) % shape.heads, row % shape.queries


def _forward(ctx: EmitContext, op: Operation, shape: _Shape, row: Value) -> None:
    v = op.inputs[2]
    out = op.outputs[0]
    b, h, t = _query(shape, row)
    kv, at = h // shape.group, shape.query_row(b, h, t)
    peak, total = ctx.local(out.dtype, initial=-float("inf")), ctx.local(out.dtype, initial=0.0)
    acc = ctx.array(out.dtype, shape.size)
    with ctx.loop(0, shape.size, name="z") as i:
        acc.store(i, ctx.constant(out.dtype, 0.0))
    with ctx.loop(0, shape.visible_keys(ctx, t), name="s") as s:
        key = shape.key_row(b, kv, s)
        score = _score(ctx, op, shape, at, key, out.dtype)
        grown = peak.value.maximum(score)
        correction, weight = (peak.value - grown).exp(), (score - grown).exp()
        total.set(total.value * correction + weight)
        with ctx.loop(0, shape.size, name="i") as i:
            acc.store(i, acc.load(i) * correction + weight * ctx.load(v, key + i))
        peak.set(grown)
    with ctx.loop(0, shape.size, name="o") as i:
        ctx.store(out, at + i, acc.load(i) / total.value)


def _statistics(ctx: EmitContext, op: Operation, shape: _Shape, row: Value) -> None:
    """Launch 1: m, l and D of a query row, parked in its dq row."""
    v, dout = op.inputs[2:]
    dq = op.outputs[0]
    b, h, t = _query(shape, row)
    kv, at, visible = h // shape.group, shape.query_row(b, h, t), shape.visible_keys(ctx, t)
    peak, total, d = (ctx.local(dq.dtype, initial=value) for value in (-float("inf"), 0.0, 0.0))
    with ctx.loop(0, visible, name="s") as s:
        score = _score(ctx, op, shape, at, shape.key_row(b, kv, s), dq.dtype)
        grown = peak.value.maximum(score)
        total.set(total.value * (peak.value - grown).exp() + (score - grown).exp())
        peak.set(grown)
    with ctx.loop(0, visible, name="s") as s:
        key = shape.key_row(b, kv, s)
        p = _probability(ctx, op, shape, at, key, dq.dtype, peak.value, total.value)
        d.set(d.value + p * _dot(ctx, dout, at, v, key, shape.size, dq.dtype))
    for offset, value in enumerate((peak, total, d)):
        ctx.store(dq, at + offset, value.value)


def _key_gradients(ctx: EmitContext, op: Operation, shape: _Shape, row: Value) -> None:
    """Launch 2: a key row's dk and dv, over every query of its group's heads that sees it."""
    q, _, v, dout = op.inputs
    dq, dk, dv = op.outputs
    b, kv, s = row // (shape.kv_heads * shape.keys), (row // shape.keys) % shape.kv_heads, row % shape.keys
    key = shape.key_row(b, kv, s)
    dk_acc, dv_acc = ctx.array(dk.dtype, shape.size), ctx.array(dv.dtype, shape.size)
    with ctx.loop(0, shape.size, name="z") as i:
        dk_acc.store(i, ctx.constant(dk.dtype, 0.0))
        dv_acc.store(i, ctx.constant(dv.dtype, 0.0))
    first = (s - (shape.keys - shape.queries)).maximum(0) if shape.causal else ctx.index(0)
    with ctx.loop(0, shape.group, name="g") as g, ctx.loop(first, shape.queries, name="t") as t:
        at = shape.query_row(b, kv * shape.group + g, t)
        peak, total, d = (ctx.load(dq, at + offset) for offset in range(_PARKED))
        p = _probability(ctx, op, shape, at, key, dk.dtype, peak, total)
        ds = p * (_dot(ctx, dout, at, v, key, shape.size, dk.dtype) - d) * shape.scale
        with ctx.loop(0, shape.size, name="i") as i:
            dk_acc.store(i, dk_acc.load(i) + ds * ctx.load(q, at + i))
            dv_acc.store(i, dv_acc.load(i) + p * ctx.load(dout, at + i))
    with ctx.loop(0, shape.size, name="o") as i:
        ctx.store(dk, key + i, dk_acc.load(i))
        ctx.store(dv, key + i, dv_acc.load(i))


def _query_gradient(ctx: EmitContext, op: Operation, shape: _Shape, row: Value) -> None:
    """Launch 3: a query row's dq, from its parked m, l and D (read before the row is written)."""
    _, k, v, dout = op.inputs
    dq = op.outputs[0]
    b, h, t = _query(shape, row)
    kv, at = h // shape.group, shape.query_row(b, h, t)
    peak, total, d = (ctx.load(dq, at + offset) for offset in range(_PARKED))
    acc = ctx.array(dq.dtype, shape.size)
    with ctx.loop(0, shape.size, name="z") as i:
        acc.store(i, ctx.constant(dq.dtype, 0.0))
    with ctx.loop(0, shape.visible_keys(ctx, t), name="s") as s:
        key = shape.key_row(b, kv, s)
        p = _probability(ctx, op, shape, at, key, dq.dtype, peak, total)
        ds = p * (_dot(ctx, dout, at, v, key, shape.size, dq.dtype) - d)
        with ctx.loop(0, shape.size, name="i") as i:
            acc.store(i, acc.load(i) + ds * ctx.load(k, key + i))
    with ctx.loop(0, shape.size, name="o") as i:
        ctx.store(dq, at + i, acc.load(i) * shape.scale)
