"""Attention over a key/value cache, as a decoder steps through a sequence.

CachedAttention(q [B, H, T, hd], k [B, KV, T, hd], v [B, KV, T, hd],
                k_cache [B, KV, S, hd], v_cache [B, KV, S, hd], length) → [B, H, T, hd]:

the T new positions' queries attend to the first `length` rows of the caches (the
positions before them) and, causally, to the new keys: query t sees every cached row
and new rows j ≤ t. Head h reads key/value head h // (H / KV). `length` is an int32 or
int64 scalar read at run time, 0 ≤ length ≤ S: outside that the compute fails, on every
backend and in the decomposed form below too (a lookup of the length refuses it there).
`scale` defaults to 1/√hd.

A decoder holding a cache of S rows reads only its `length` live rows this way, not all
S behind a mask: a stories110M decode step read its 1,024-row caches whole, 75 MB a
token. The op decomposes into the masked form (both sets of scores, one softmax over
their concatenation) for a backend with no kernel for it. Inference only: it has no
gradient (training attends with Attention).
"""

from __future__ import annotations

import math

import numpy as np

from .attention import attention, scale_of
from .registry import Attr, TensorType, decomposition, define, op_def
from .rules import FLOATS


def _infer(ctx):
    q, k, v, k_cache, v_cache, length = ctx.inputs
    if length.dtype not in ("int32", "int64") or length.shape:
        raise ctx.fail("a scalar int32/int64 length (the cache rows in use)")
    if len({x.dtype for x in (q, k, v, k_cache, v_cache)}) != 1 or q.dtype not in FLOATS:
        raise ctx.fail("floating-point q, k, v and caches of one dtype")
    if q.rank != 4 or list(k.shape) != list(v.shape) or list(k_cache.shape) != list(v_cache.shape) or k.rank != 4 \
            or k_cache.rank != 4:
        raise ctx.fail("q [B, H, T, hd], k and v of one shape [B, KV, T, hd], caches of one shape [B, KV, S, hd]")
    batch, heads, queries, size = q.shape
    if list(k.shape) != [batch, k.shape[1], queries, size] or k.shape[1] == 0 or heads % k.shape[1]:
        raise ctx.fail("k and v [B, KV, T, hd] with q's B, T and hd, and heads H a multiple of key/value heads KV")
    if [k_cache.shape[i] for i in (0, 1, 3)] != [batch, k.shape[1], size]:
        raise ctx.fail("caches [B, KV, S, hd] with k's B, KV and hd")
    return [TensorType(q.dtype, q.shape)]


def cached_attention(q, k, v, k_cache, v_cache, length, scale=None):
    """Attention over cache rows [0, length) followed by the new rows, causal: with
    S' = length + T keys, query t sees s ≤ t + S' − T, every cached row and new rows j ≤ t."""
    length = int(length)
    rows = k_cache.shape[2]
    if not 0 <= length <= rows:
        raise IndexError(f"cache length {length} is outside [0, {rows}]")
    keys, values = (np.concatenate([cache[:, :, :length], new], axis=2) for cache, new in ((k_cache, k), (v_cache, v)))
    return attention(q, keys, values, causal=True, scale=scale)


def _flops(op) -> int:
    """Scores and weighted values over the whole cache and the new rows (at most)."""
    batch, heads, queries, size = op.inputs[0].shape
    return 2 * 2 * batch * heads * queries * (op.inputs[3].shape[2] + queries) * size


define(
    "CachedAttention",
    _infer,
    lambda a, args, o: [cached_attention(*args, scale=scale_of(a, args[0].shape[-1]))],
    6,
    "nn",
    "CachedAttention(q, k, v, k_cache, v_cache, length): the new positions over the cache's first length rows and themselves",
    attrs=[Attr("scale", "float", None, "score scale (default 1/√head size)")],
    flops=_flops,
    method="cached_attention",
)


@decomposition("CachedAttention")
def _masked(b, op):
    """Scores against every cache row, those from `length` on masked with −∞, beside the
    new rows' causally masked scores; one softmax over both, then both weighted sums.
    The query heads of a key/value head are stacked into G·T rows, one product each."""
    q, k, v, k_cache, v_cache, length = (b.wrap(x) for x in op.inputs)
    batch, heads, queries, size = q.shape
    kv_heads, rows = k.shape[1], k_cache.shape[2]
    groups = heads // kv_heads
    scale = scale_of(op_def(op.type).attrs_of(op), size)
    stacked = q.reshape([batch, kv_heads, groups * queries, size])
    # The length looked up in [0, 1, ..., S]: the lookup refuses a length outside the cache
    # on every backend, as the op does, and gives it as int32 exactly (a cast would read
    # 2³² + 1 as 1, and a comparison takes any length as a mask).
    live = b.gather(b.const(np.arange(rows + 1, dtype=np.int32)), length)
    past = b.const(np.arange(rows, dtype=np.int32)) >= live
    # Rows from `length` on are selected away, not masked by adding −∞ or weighted by 0:
    # they may hold anything (a stale step's, NaN), and NaN − ∞ or 0 · NaN is NaN.
    cached_scores = b.cond(past.reshape([1, 1, 1, rows]), b.const(np.array(-math.inf, q.dtype)),
                           stacked.matmul(k_cache, transpose_b=True) * scale)
    live_values = b.cond(past.reshape([1, 1, rows, 1]), b.const(np.array(0, q.dtype)), v_cache)
    causal = np.triu(np.full((queries, queries), -np.inf, np.float32), k=1)
    new_mask = b.const(np.tile(causal, (groups, 1)))
    if q.dtype != "float32":
        new_mask = b.cast(new_mask, q.dtype)
    scores = b.concat([cached_scores, stacked.matmul(k, transpose_b=True) * scale + new_mask], axis=3)
    cached, new = b.split(b.softmax(scores), [rows, queries], axis=3)
    return (cached @ live_values + new @ v).reshape(op.outputs[0].shape)
