"""Fused attention kernels: one query row at a time, the T×S probabilities never stored.

Forward, per (batch, head, query): scores against every visible key into a row buffer
on the stack, their maximum, exponentials and sum, then the weighted sum of values.
Backward recomputes the same row of probabilities, then
    dp_j = d out · v_j,  ds_j = p_j (dp_j − Σ p·dp),
    dq += scale · ds_j k_j,  dk_j += scale · ds_j q,  dv_j += p_j · d out.

Below a memory budget the decomposed form (batched GEMMs and a row softmax) is faster,
so these kernels claim only attention whose score matrices are too big to store.
"""

from __future__ import annotations

import math

from .... import dtypes
from ....ops import attrs_of
from ....ops.attention import bias_dims, bias_of, bias_offset, scale_of
from ...llvm.loops import fill
from ...llvm.rows import Row
from ...llvm.values import Value
from .library import kernel

# Attention whose score matrices (batch × heads × queries × keys) take more bytes than
# this runs fused; smaller ones decompose into GEMMs and a softmax, which beat the fused
# kernel wherever measured (a stories15M training step, batch 4 × 256: float32 758 ms
# fused, 560 ms decomposed; bf16 741 and 448; decoding about even).
SCORES_BUDGET = 1 << 25


def _too_big_to_decompose(op) -> bool:
    q, k = op.inputs[0], op.inputs[1]
    batch, heads, queries, _ = q.shape
    fits = q.dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64)
    return fits and batch * heads * queries * k.shape[2] * 4 > SCORES_BUDGET


class _Heads:
    """Offsets of a (batch·head, query) pair's rows in q/out and its key/value head."""

    def __init__(self, ctx, q, k, op):
        attrs = attrs_of(op)
        self.ctx = ctx
        self.batch, self.heads, self.queries, self.size = q.shape
        self.kv_heads, self.keys = k.shape[1], k.shape[2]
        self.groups = self.heads // self.kv_heads
        self.causal = attrs["causal"]
        self.scale = scale_of(attrs, self.size)
        self.dtype = q.dtype
        self.bias = bias_of(op)
        self.bias_dims = bias_dims(self.bias.shape) if self.bias is not None else None

    def kv_base(self, bh: Value) -> Value:
        batch, head = bh // self.heads, bh % self.heads
        return (batch * self.kv_heads + head // self.groups) * (self.keys * self.size)

    def bias_start(self, bh: Value, t: Value) -> Value | int:
        """Where the bias row of (batch·head, query) starts; a broadcast axis stays put."""
        if self.bias is None:
            return 0
        return bias_offset(self.bias_dims, bh // self.heads, bh % self.heads, t, 0)

    def visible(self, t: Value) -> Value | int:
        """How many keys query t sees."""
        return t + (self.keys - self.queries + 1) if self.causal else self.keys

    def dot(self, x, x_start: Value, y, y_start: Value) -> Value:
        row = Row(self.ctx, x_start, self.size, x.dtype)
        return row.sum(lambda i, w: self.ctx.load(x, i, w) * self.ctx.load(y, i - x_start + y_start, w))

    def axpy(self, alpha: Value, x, x_start: Value, y, y_start: Value) -> None:
        """y[y_start:+size] += alpha · x[x_start:+size]."""
        ctx = self.ctx
        row = Row(ctx, y_start, self.size, y.dtype)
        row.each(lambda i, w: ctx.store(y, i, ctx.load(y, i, w) + alpha.splat(w) * ctx.load(x, i - y_start + x_start, w)))

    def probabilities(self, q, q_start: Value, k, kv: Value, count, p, bias_start: Value | int) -> None:
        """Fill p[j] with the probability of each visible key j."""
        ctx = self.ctx
        peak = ctx.local(self.dtype, 1, -math.inf)
        with ctx.loop(0, count, name="j") as j:
            score = self.dot(q, q_start, k, kv + j * self.size) * self.scale
            if self.bias is not None:
                score = score + ctx.load(self.bias, bias_start + (j if self.bias_dims[3] > 1 else 0))
            p.store(j, score)
            peak.set((score > peak.value).where(score, peak.value))
        total = ctx.local(self.dtype, 1, 0.0)
        with ctx.loop(0, count, name="j") as j:
            e = (p.load(j) - peak.value).exp()
            p.store(j, e)
            total.set(total.value + e)
        inverse = 1.0 / total.value
        with ctx.loop(0, count, name="j") as j:
            p.store(j, p.load(j) * inverse)

    def each_query(self, q, k, p, body) -> None:
        """For every (batch·head, query): fill the probabilities p, then call
        body(key/value base, query row offset, visible key count)."""
        ctx = self.ctx
        with ctx.loop(0, self.batch * self.heads, name="bh") as bh:
            kv = self.kv_base(bh)
            with ctx.loop(0, self.queries, name="t") as t:
                row = (bh * self.queries + t) * self.size
                count = self.visible(t)
                self.probabilities(q, row, k, kv, count, p, self.bias_start(bh, t))
                body(kv, row, count)

    def buffer(self):
        return self.ctx.array(self.dtype, self.keys)


@kernel("AttentionRow", {"Attention"}, supports=_too_big_to_decompose)
def attention(ctx, op) -> None:
    q, k, v = op.inputs[:3]
    out = op.outputs[0]
    heads = _Heads(ctx, q, k, op)
    p = heads.buffer()
    fill(ctx, out, 0.0)

    def weighted_values(kv, row, count):
        with ctx.loop(0, count, name="j") as j:
            heads.axpy(p.load(j), v, kv + j * heads.size, out, row)

    heads.each_query(q, k, p, weighted_values)


@kernel("AttentionGradRow", {"AttentionGrad"}, supports=_too_big_to_decompose)
def attention_grad(ctx, op) -> None:
    q, k, v, dout = op.inputs[:4]
    dq, dk, dv = op.outputs
    heads = _Heads(ctx, q, k, op)
    p, dp = heads.buffer(), heads.buffer()
    for var in (dq, dk, dv):
        fill(ctx, var, 0.0)
    total = ctx.local(heads.dtype)

    def gradients(kv, row, count):
        total.set(ctx.constant(heads.dtype, 0.0))
        with ctx.loop(0, count, name="j") as j:
            d = heads.dot(dout, row, v, kv + j * heads.size)
            dp.store(j, d)
            total.set(total.value + p.load(j) * d)
        with ctx.loop(0, count, name="j") as j:
            pj = p.load(j)
            ds = pj * (dp.load(j) - total.value)
            key_row = kv + j * heads.size
            heads.axpy(ds * heads.scale, k, key_row, dq, row)
            heads.axpy(ds * heads.scale, q, row, dk, key_row)
            heads.axpy(pj, dout, row, dv, key_row)

    heads.each_query(q, k, p, gradients)
