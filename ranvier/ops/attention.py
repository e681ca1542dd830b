"""Attention as one composite op, forward and backward, so a backend can fuse it whole.

Attention(q [B, H, T, hd], k [B, KV, S, hd], v [B, KV, S, hd]) → [B, H, T, hd]: head h
reads key/value head h // (H / KV) (grouped- and multi-query attention). With `causal`
query t sees keys s ≤ t + S − T (queries are the last T positions). `scale` defaults
to 1/√hd. AttentionGrad(q, k, v, d out) → (dq, dk, dv) recomputes the probabilities
row by row instead of keeping the T×S matrix from the forward pass.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import TensorType, define
from .rules import FLOATS, same_dtype


def _check(ctx, q, k, v):
    if q.rank != 4 or k.rank != 4 or list(k.shape) != list(v.shape):
        raise ctx.fail("q [B, H, T, hd] and k, v of one shape [B, KV, S, hd]")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ctx.fail("the same batch and head size, and heads H a multiple of key/value heads KV")
    if ctx.attrs.bool("causal", True) and q.shape[2] > k.shape[2]:
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
    return attrs.float("scale", 1.0 / math.sqrt(head_size))


def probabilities(q, k, causal: bool, scale: float) -> np.ndarray:
    """softmax(scale · q kᵀ) per head [B, H, T, S], float64, with the causal mask."""
    b, h, t, _ = q.shape
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


define(
    "Attention",
    _infer_attention,
    lambda a, args, o: [attention(*args, a.bool("causal", True), scale_of(a, args[0].shape[-1]))],
    3,
    "nn",
    "Attention(q, k, v); attributes causal (default 1), scale (default 1/√head size)",
)
define(
    "AttentionGrad",
    _infer_attention_grad,
    lambda a, args, o: attention_grad(*args, a.bool("causal", True), scale_of(a, args[0].shape[-1])),
    4,
    "nn",
    "(dq, dk, dv) of Attention from (q, k, v, d out), recomputing the probabilities",
)
