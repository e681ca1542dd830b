"""Fused attention kernels: one query row at a time, the T×S probabilities never stored.

Forward, per (batch, head, query): scores against every visible key into a row buffer
on the stack, their maximum, exponentials and sum, then the weighted sum of values.
Backward recomputes the same row of probabilities, then
    dp_j = d out · v_j,  ds_j = p_j (dp_j − Σ p·dp),
    dq += scale · ds_j k_j,  dk_j += scale · ds_j q,  dv_j += p_j · d out.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ....ops import attrs_of
from ....ops.attention import scale_of
from .. import mathlib
from ..irutil import compute_type, constant, for_range, i64, vector_of
from ..views import for_vectors
from .rows import Row


class _Heads:
    """Offsets of a (batch·head, query) pair's rows in q/out and its key/value head."""

    def __init__(self, ctx, q, k, attrs):
        self.ctx, self.b = ctx, ctx.b
        self.batch, self.heads, self.queries, self.size = q.shape
        self.kv_heads, self.keys = k.shape[1], k.shape[2]
        self.groups = self.heads // self.kv_heads
        self.causal = attrs["causal"]
        self.scale = scale_of(attrs, self.size)
        self.t = compute_type(q.dtype)

    def kv_base(self, bh: ir.Value) -> ir.Value:
        b = self.b
        batch, head = b.udiv(bh, i64(self.heads)), b.urem(bh, i64(self.heads))
        return b.mul(b.add(b.mul(batch, i64(self.kv_heads)), b.udiv(head, i64(self.groups))), i64(self.keys * self.size))

    def visible(self, t: ir.Value) -> ir.Value:
        """How many keys query t sees."""
        return self.b.add(t, i64(self.keys - self.queries + 1)) if self.causal else i64(self.keys)

    def dot(self, x, x_start, y, y_start) -> ir.Value:
        b = self.b
        row = Row(self.ctx, x_start, self.size, x.dtype)
        return row.fold(0.0, lambda acc, v: b.fadd(acc, v), lambda i, w: b.fmul(row.read(x, i, w), row.read(y, b.add(b.sub(i, x_start), y_start), w)))

    def axpy(self, alpha: ir.Value, x, x_start, y, y_start) -> None:
        """y[y_start:+size] += alpha · x[x_start:+size]."""
        b = self.b
        row = Row(self.ctx, y_start, self.size, y.dtype)

        def step(i, w):
            source = row.read(x, b.add(b.sub(i, y_start), x_start), w)
            row.write(y, b.fadd(row.read(y, i, w), b.fmul(row.splat(alpha, w), source)), i, w)

        row.each(step)

    def probabilities(self, q, q_start, k, kv, count, buffer) -> None:
        """Fill buffer[j] with the probability p_j of each visible key j."""
        b = self.b
        with b.goto_entry_block():
            peak_slot, sum_slot = b.alloca(self.t), b.alloca(self.t)
        b.store(constant(self.t, -math.inf), peak_slot)
        with for_range(b, i64(0), count, name="j") as j:
            score = b.fmul(self.dot(q, q_start, k, b.add(kv, b.mul(j, i64(self.size)))), constant(self.t, self.scale))
            b.store(score, b.gep(buffer, [j]))
            peak = b.load(peak_slot)
            b.store(b.select(b.fcmp_ordered(">", score, peak), score, peak), peak_slot)
        b.store(constant(self.t, 0.0), sum_slot)
        peak = b.load(peak_slot)
        with for_range(b, i64(0), count, name="j") as j:
            e = mathlib.emit("exp", b, b.fsub(b.load(b.gep(buffer, [j])), peak))
            b.store(e, b.gep(buffer, [j]))
            b.store(b.fadd(b.load(sum_slot), e), sum_slot)
        inverse = b.fdiv(constant(self.t, 1.0), b.load(sum_slot))
        with for_range(b, i64(0), count, name="j") as j:
            slot = b.gep(buffer, [j])
            b.store(b.fmul(b.load(slot), inverse), slot)

    def each_query(self, q, k, probabilities, body) -> None:
        """For every (batch·head, query): fill `probabilities`, then call
        body(key/value base, query row offset, visible key count)."""
        b = self.b
        with for_range(b, i64(0), i64(self.batch * self.heads), name="bh") as bh:
            kv = self.kv_base(bh)
            with for_range(b, i64(0), i64(self.queries), name="t") as t:
                row = b.mul(b.add(b.mul(bh, i64(self.queries)), t), i64(self.size))
                count = self.visible(t)
                self.probabilities(q, row, k, kv, count, probabilities)
                body(kv, row, count)

    def buffer(self) -> ir.Value:
        with self.b.goto_entry_block():
            return self.b.alloca(self.t, size=i64(self.keys))


def _zero(ctx, var) -> None:
    b = ctx.b
    row = Row(ctx, i64(0), var.size, var.dtype)
    for_vectors(b, i64(0), var.size, row.lanes, lambda i, w: row.write(var, constant(vector_of(row.ctype, w), 0.0), i, w))


def attention(ctx, op) -> None:
    q, k, v = op.inputs
    out = op.outputs[0]
    heads = _Heads(ctx, q, k, attrs_of(op))
    b = ctx.b
    p = heads.buffer()
    _zero(ctx, out)

    def weighted_values(kv, row, count):
        with for_range(b, i64(0), count, name="j") as j:
            heads.axpy(b.load(b.gep(p, [j])), v, b.add(kv, b.mul(j, i64(heads.size))), out, row)

    heads.each_query(q, k, p, weighted_values)


def attention_grad(ctx, op) -> None:
    q, k, v, dout = op.inputs
    dq, dk, dv = op.outputs
    heads = _Heads(ctx, q, k, attrs_of(op))
    b = ctx.b
    p, dp = heads.buffer(), heads.buffer()
    for var in (dq, dk, dv):
        _zero(ctx, var)
    with b.goto_entry_block():
        total_slot = b.alloca(heads.t)
    scale = constant(heads.t, heads.scale)

    def gradients(kv, row, count):
        b.store(constant(heads.t, 0.0), total_slot)
        with for_range(b, i64(0), count, name="j") as j:
            d = heads.dot(dout, row, v, b.add(kv, b.mul(j, i64(heads.size))))
            b.store(d, b.gep(dp, [j]))
            b.store(b.fadd(b.load(total_slot), b.fmul(b.load(b.gep(p, [j])), d)), total_slot)
        total = b.load(total_slot)
        with for_range(b, i64(0), count, name="j") as j:
            pj = b.load(b.gep(p, [j]))
            ds = b.fmul(pj, b.fsub(b.load(b.gep(dp, [j])), total))
            key_row = b.add(kv, b.mul(j, i64(heads.size)))
            heads.axpy(b.fmul(ds, scale), k, key_row, dq, row)
            heads.axpy(b.fmul(ds, scale), q, row, dk, key_row)
            heads.axpy(pj, dout, row, dv, key_row)

    heads.each_query(q, k, p, gradients)

def choose(op):
    if op.inputs and op.inputs[0].dtype in ("float32", "float64"):
        return {"Attention": ("AttentionRow", attention), "AttentionGrad": ("AttentionGradRow", attention_grad)}.get(op.type)
    return None
