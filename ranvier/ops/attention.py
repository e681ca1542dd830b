"""Attention as one composite op, forward and backward, so a backend can fuse it whole.

Attention(q [B, H, T, hd], k [B, KV, S, hd], v [B, KV, S, hd]) → [B, H, T, hd]: head h
reads key/value head h // (H / KV) (grouped- and multi-query attention). With `causal`
query t sees keys s ≤ t + S − T (queries are the last T positions). `scale` defaults
to 1/√hd. AttentionGrad(q, k, v, d out) → (dq, dk, dv) recomputes the probabilities
row by row instead of keeping the T×S matrix from the forward pass.

Both decompose into batched GEMMs and a row softmax (with one additive causal-mask
constant per function, so the backward's recomputed probabilities are the forward's,
op for op, and CSE keeps one); a backend with a fused kernel may claim them whole.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import Attr, TensorType, decomposition, define, op_def
from .rules import FLOATS, same_dtype


def _check(ctx, q, k, v):
    if q.rank != 4 or k.rank != 4 or list(k.shape) != list(v.shape):
        raise ctx.fail("q [B, H, T, hd] and k, v of one shape [B, KV, S, hd]")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ctx.fail("the same batch and head size, and heads H a multiple of key/value heads KV")
    if ctx.attrs["causal"] and q.shape[2] > k.shape[2]:
        raise ctx.fail("no more queries than keys for causal attention")


def _infer_attention(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point q, k, v of one dtype")
    q, k, v = ctx.inputs
    _check(ctx, q, k, v)
    return [TensorType(dtype, q.shape)]


def _infer_attention_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point q, k, v, d out of one dtype")
    q, k, v, dout = ctx.inputs
    _check(ctx, q, k, v)
    if list(dout.shape) != list(q.shape):
        raise ctx.fail(f"d out of the output's shape {list(q.shape)}")
    return [TensorType(dtype, q.shape), TensorType(dtype, k.shape), TensorType(dtype, v.shape)]


def scale_of(attrs, head_size: int) -> float:
    """The score scale: attribute scale, by default 1/√head size."""
    scale = attrs["scale"]
    return 1.0 / math.sqrt(head_size) if scale is None else scale


def probabilities(q, k, causal: bool, scale: float) -> np.ndarray:
    """softmax(scale · q kᵀ) per head [B, H, T, S], float64, with the causal mask."""
    _b, h, t, _ = q.shape
    groups = h // k.shape[1]
    keys = np.repeat(np.asarray(k, np.float64), groups, axis=1)
    scores = np.einsum("bhtd,bhsd->bhts", np.asarray(q, np.float64), keys) * scale
    if causal:
        s = k.shape[2]
        hidden = np.arange(s)[None, :] > np.arange(t)[:, None] + (s - t)
        scores = np.where(hidden, -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(axis=-1, keepdims=True)


def attention(q, k, v, causal=True, scale=None):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    p = probabilities(q, k, causal, scale)
    values = np.repeat(np.asarray(v, np.float64), q.shape[1] // k.shape[1], axis=1)
    return np.einsum("bhts,bhsd->bhtd", p, values)


def attention_grad(q, k, v, dout, causal=True, scale=None):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    p = probabilities(q, k, causal, scale)
    keys = np.repeat(np.asarray(k, np.float64), groups, axis=1)
    values = np.repeat(np.asarray(v, np.float64), groups, axis=1)
    dout = np.asarray(dout, np.float64)
    dp = np.einsum("bhtd,bhsd->bhts", dout, values)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhts,bhsd->bhtd", ds, keys)
    dk = scale * np.einsum("bhts,bhtd->bhsd", ds, np.asarray(q, np.float64))
    dv = np.einsum("bhts,bhtd->bhsd", p, dout)

    def fold(x):  # sum the heads of each group back onto their key/value head
        return x.reshape(x.shape[0], k.shape[1], groups, *x.shape[2:]).sum(axis=2)

    return [dq, fold(dk), fold(dv)]


ATTRS = [
    Attr("causal", "bool", True, "query t sees keys s ≤ t + S − T"),
    Attr("scale", "float", None, "score scale (default 1/√head size)"),
]


def _attention_vjp(ctx, g):
    dq, dk, dv = ctx.b.op("AttentionGrad", [*ctx.inputs, g[0]], None, dict(ctx.op.attrs))
    return [dq, dk, dv]


def _flops(op) -> int:
    """Two GEMMs of the scores forward (q kᵀ, p v), four backward; causal halves them."""
    q, k = op.inputs[0], op.inputs[1]
    batch, heads, queries, size = q.shape
    products = 2 if op.type == "Attention" else 4
    visible = 0.5 if op_def(op.type).attrs_of(op)["causal"] else 1.0
    return int(products * 2 * batch * heads * queries * k.shape[2] * size * visible)


define(
    "Attention",
    _infer_attention,
    lambda a, args, o: [attention(*args, a["causal"], scale_of(a, args[0].shape[-1]))],
    3,
    "nn",
    "Attention(q, k, v)",
    attrs=ATTRS,
    vjp=_attention_vjp,
    flops=_flops,
    method="attention",
)
define(
    "AttentionGrad",
    _infer_attention_grad,
    lambda a, args, o: attention_grad(*args, a["causal"], scale_of(a, args[0].shape[-1])),
    4,
    "nn",
    "(dq, dk, dv) of Attention from (q, k, v, d out), recomputing the probabilities",
    attrs=ATTRS,
    flops=_flops,
)


def _grouped_probabilities(b, op):
    """Grouped views of q, k, v and the probabilities softmax(scale·q kᵀ + causal mask).

    The query heads sharing a key/value head are stacked into one matrix of G·T rows
    [B, KV, G·T, hd], so each key/value head takes one GEMM of G·T rows rather than G
    GEMMs of T; the probabilities come out [B, KV, G·T, S] in the same row order."""
    q, k, v = (b.wrap(x) for x in op.inputs[:3])
    batch, heads, queries, size = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    attrs = op_def(op.type).attrs_of(op)
    stacked = q.reshape([batch, kv_heads, groups * queries, size])
    scale = scale_of(attrs, size)
    scores = stacked.matmul(k, transpose_b=True) * scale
    if attrs["causal"]:
        scores = scores.reshape([batch, kv_heads, groups, queries, keys]) + _causal_mask(b, queries, keys, q.dtype)
        scores = scores.reshape([batch, kv_heads, groups * queries, keys])
    return stacked, k, v, scores.softmax(), scale


def _causal_mask(b, queries: int, keys: int, dtype: str):
    """The additive causal mask, one constant per function and shape: the backward's
    recomputed probabilities are then the forward's op for op, and CSE keeps one."""
    name = f"causal_mask_{queries}x{keys}_{dtype}"
    existing = b.flow.vars.get(f"{b.func.name}/{name}")
    if existing is not None:
        return b.wrap(existing)
    hidden = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
    return b.array(name, np.where(hidden, -np.inf, 0.0).astype(np.float32 if dtype == "float32" else np.float64))


@decomposition("Attention")
def _attention_as_gemms(b, op):
    _, _, v, p, _ = _grouped_probabilities(b, op)
    return (p @ v).reshape(op.outputs[0].shape)


@decomposition("AttentionGrad")
def _attention_grad_as_gemms(b, op):
    """With the group's heads stacked along the rows, the products over rows (d k, d v)
    sum the group's heads onto their key/value head in the GEMM itself."""
    q, k, v, p, scale = _grouped_probabilities(b, op)
    dout = b.wrap(op.inputs[3]).reshape(q.shape)
    dp = dout.matmul(v, transpose_b=True)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = (ds.matmul(k) * scale).reshape(op.outputs[0].shape)
    dk = ds.matmul(q, transpose_a=True) * scale
    dv = p.matmul(dout, transpose_a=True)
    return [dq, dk, dv]
