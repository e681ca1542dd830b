"""Attention as one composite op, forward and backward, so a backend can fuse it whole.

Attention(q [B, H, T, hd], k [B, KV, S, hd], v [B, KV, S, hd][, bias]) → [B, H, T, hd]:
head h reads key/value head h // (H / KV) (grouped- and multi-query attention). With
`causal` query t sees keys s ≤ t + S − T (queries are the last T positions). `scale`
defaults to 1/√hd. The optional bias is added to the scaled scores before the softmax,
broadcast to [B, H, T, S] (a padding mask [B, 1, 1, S] of 0 and −∞, a position bias
[1, H, T, S]). A query whose every key is masked (−∞ throughout its row: left padding
under a causal mask) attends to nothing: its output row and its gradients are 0, as in
ONNX's Attention and PyTorch's scaled_dot_product_attention, where a plain softmax would
give 0/0. AttentionGrad(q, k, v, d out[, bias]) → (dq, dk, dv) recomputes the
probabilities row by row instead of keeping the T×S matrix from the forward pass; a
bias's own gradient, wanted only when it is learned, comes from the decomposed form.

With `heads_first` false, q, k, v, the output and the gradients are [B, T, heads, hd]
instead, as a model's projections give them: a kernel reads and writes the heads in
place, with no transposes on either side (a decomposition makes the transposes).

Both decompose into batched GEMMs and a row softmax (with one additive causal-mask
constant per function, so the backward's recomputed probabilities are the forward's,
op for op, and CSE keeps one); a backend with a fused kernel may claim them whole.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .registry import Attr, TensorType, decomposition, define, op_def
from .rules import FLOATS, PRECISION, same_dtype

if TYPE_CHECKING:
    from ..flow.graph import Variable


def heads_first_shape(shape, heads_first: bool) -> list[int]:
    """A q, k, v or output shape as [B, heads, T, hd], whichever layout it is in."""
    shape = list(shape)
    return shape if heads_first or len(shape) != 4 else [shape[0], shape[2], shape[1], shape[3]]


def _check(ctx, q, k, v, bias=None):
    first = ctx.attrs["heads_first"]
    layout = "[B, H, T, hd] and k, v of one shape [B, KV, S, hd]" if first else "[B, T, H, hd] and k, v of one shape [B, S, KV, hd]"
    qs, ks = heads_first_shape(q.shape, first), heads_first_shape(k.shape, first)
    if bias is not None:
        full = [qs[0], qs[1], qs[2], ks[2]] if q.rank == 4 and k.rank == 4 else []
        if bias.rank > 4 or not full or any(d not in (1, n) for d, n in zip(bias_dims(bias.shape), full)):
            raise ctx.fail(f"a bias that broadcasts to the scores' shape [B, H, T, S] = {full}")
    if q.rank != 4 or k.rank != 4 or list(k.shape) != list(v.shape):
        raise ctx.fail(f"q {layout}")
    if qs[0] != ks[0] or qs[3] != ks[3] or ks[1] == 0 or qs[1] % ks[1]:
        raise ctx.fail("the same batch and head size, and heads H a multiple of key/value heads KV")
    if ctx.attrs["causal"] and qs[2] > ks[2]:
        raise ctx.fail("no more queries than keys for causal attention")


def _infer_attention(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point q, k, v of one dtype")
    _check(ctx, *ctx.inputs)
    return [TensorType(dtype, ctx.inputs[0].shape)]


def _infer_attention_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point q, k, v, d out of one dtype")
    q, k, v, dout = ctx.inputs[:4]
    _check(ctx, q, k, v, *ctx.inputs[4:])
    if list(dout.shape) != list(q.shape):
        raise ctx.fail(f"d out of the output's shape {list(q.shape)}")
    return [TensorType(dtype, q.shape), TensorType(dtype, k.shape), TensorType(dtype, v.shape)]


def scale_of(attrs, head_size: int) -> float:
    """The score scale: attribute scale, by default 1/√head size."""
    scale = attrs["scale"]
    return 1.0 / math.sqrt(head_size) if scale is None else scale


def bias_of(op) -> Variable | None:
    """An Attention or AttentionGrad op's score bias, or None."""
    first = 4 if op.type == "AttentionGrad" else 3
    return op.inputs[first] if len(op.inputs) > first else None


def bias_dims(shape) -> list[int]:
    """A bias's shape as rank 4, ones in front (it broadcasts to [B, H, T, S])."""
    return [1] * (4 - len(shape)) + list(shape)


def bias_offset(dims, batch, head, query, key):
    """The element of a bias of rank-4 `dims` that the score (batch, head, query, key)
    adds (indices or IR values): a broadcast axis is read at 0."""
    index = 0
    for size, at in zip(dims, (batch, head, query, key)):
        index = index * size + (at if size > 1 else 0)
    return index


def probabilities(q, k, causal: bool, scale: float, bias=None) -> np.ndarray:
    """softmax(scale · q kᵀ + bias) per head [B, H, T, S], float64, with the causal mask."""
    _b, h, t, _ = q.shape
    groups = h // k.shape[1]
    keys = np.repeat(np.asarray(k, np.float64), groups, axis=1)
    scores = np.einsum("bhtd,bhsd->bhts", np.asarray(q, np.float64), keys) * scale
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    if causal:
        s = k.shape[2]
        hidden = np.arange(s)[None, :] > np.arange(t)[:, None] + (s - t)
        scores = np.where(hidden, -np.inf, scores)
    peak = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - np.where(peak == -np.inf, 0.0, peak))  # a row of −∞ (no key seen): zeros
    total = e.sum(axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), e)


def _swapped(t, heads_first: bool):
    """Tensor t [B, T, heads, hd] as [B, heads, T, hd], or back; as is where heads come first."""
    return t if heads_first else t.transpose([0, 2, 1, 3])


def attention(q, k, v, bias=None, causal: bool = True, scale: float | None = None, heads_first: bool = True) -> np.ndarray:
    if not heads_first:  # [B, T, heads, hd] arrays: the same, axes 1 and 2 swapped each way
        return np.swapaxes(attention(*(np.swapaxes(x, 1, 2) for x in (q, k, v)), bias, causal, scale), 1, 2)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    p = probabilities(q, k, causal, scale, bias)
    values = np.repeat(np.asarray(v, np.float64), q.shape[1] // k.shape[1], axis=1)
    return np.einsum("bhts,bhsd->bhtd", p, values)


def attention_grad(q, k, v, dout, bias=None, causal: bool = True, scale: float | None = None,
                   heads_first: bool = True) -> list[np.ndarray]:
    if not heads_first:
        grads = attention_grad(*(np.swapaxes(x, 1, 2) for x in (q, k, v, dout)), bias, causal, scale)
        return [np.swapaxes(g, 1, 2) for g in grads]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    p = probabilities(q, k, causal, scale, bias)
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
    Attr("heads_first", "bool", True, "q, k, v and the output [B, heads, T, hd]; false: [B, T, heads, hd]"),
    PRECISION,
]


def _attention_vjp(ctx, g):
    q, k, v, *bias = ctx.inputs
    dq, dk, dv = ctx.b.op("AttentionGrad", [q, k, v, g[0], *bias], None, dict(ctx.op.attrs))
    if not bias:
        return [dq, dk, dv]
    return [dq, dk, dv, ctx.unbroadcast(_score_gradient(ctx.b, ctx.op, g[0]), bias[0])]


def _build_attention(b, q, k, v, bias=None, causal=True, scale=None, heads_first=True, name=None):
    attrs = {"causal": causal} if scale is None else {"causal": causal, "scale": scale}
    if not heads_first:
        attrs["heads_first"] = False
    return b.op("Attention", [q, k, v] if bias is None else [q, k, v, bias], name, attrs)


def _flops(op) -> int:
    """Two GEMMs of the scores forward (q kᵀ, p v), four backward; causal halves them."""
    attrs = op_def(op.type).attrs_of(op)
    batch, heads, queries, size = heads_first_shape(op.inputs[0].shape, attrs["heads_first"])
    keys = heads_first_shape(op.inputs[1].shape, attrs["heads_first"])[2]
    products = 2 if op.type == "Attention" else 4
    visible = 0.5 if attrs["causal"] else 1.0
    return int(products * 2 * batch * heads * queries * keys * size * visible)


define(
    "Attention",
    _infer_attention,
    lambda a, args, o: [attention(*args[:3], *args[3:], causal=a["causal"], scale=scale_of(a, args[0].shape[-1]),
                                  heads_first=a["heads_first"])],
    (3, 4),
    "nn",
    "Attention(q, k, v[, bias])",
    attrs=ATTRS,
    vjp=_attention_vjp,
    flops=_flops,
    method="attention",
    build=_build_attention,
)
define(
    "AttentionGrad",
    _infer_attention_grad,
    lambda a, args, o: attention_grad(*args[:4], *args[4:], causal=a["causal"], scale=scale_of(a, args[0].shape[-1]),
                                      heads_first=a["heads_first"]),
    (4, 5),
    "nn",
    "(dq, dk, dv) of Attention from (q, k, v, d out[, bias]), recomputing the probabilities",
    attrs=ATTRS,
    flops=_flops,
)


def _grouped_probabilities(b, op):
    """Grouped views of q, k, v and the probabilities softmax(scale·q kᵀ + bias + causal mask).

    The query heads sharing a key/value head are stacked into one matrix of G·T rows
    [B, KV, G·T, hd], so each key/value head takes one GEMM of G·T rows rather than G
    GEMMs of T; the probabilities come out [B, KV, G·T, S] in the same row order."""
    q, k, v = _as_heads_first(b, op, op.inputs[:3])
    batch, heads, queries, size = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    attrs = op_def(op.type).attrs_of(op)
    stacked = q.reshape([batch, kv_heads, groups * queries, size])
    scale = scale_of(attrs, size)
    scores = stacked.matmul(k, transpose_b=True) * scale
    bias = bias_of(op)
    if attrs["causal"] or bias is not None:
        scores = scores.reshape([batch, kv_heads, groups, queries, keys])
        if bias is not None:
            scores = scores + _grouped_bias(b.wrap(bias), kv_heads, groups)
        if attrs["causal"]:
            scores = scores + _causal_mask(b, queries, keys, q.dtype)
        scores = scores.reshape([batch, kv_heads, groups * queries, keys])
    p = scores.softmax()
    if bias is not None:  # a bias may mask a query's every key: its row is 0, not the softmax's 0/0
        p = scores.max(axis=[-1], keepdims=True).not_equal(-math.inf).select(p)
    return stacked, k, v, p, scale


def grouped_bias_shape(shape, kv_heads: int, groups: int) -> list[int]:
    """A bias [B|1, H|1, T|1, S|1]'s shape as [B|1, KV|1, G|1, T|1, S|1], to add to scores
    whose query heads are grouped by key/value head."""
    batch, heads, queries, keys = bias_dims(shape)
    return [batch, *([kv_heads, groups] if heads > 1 else [1, 1]), queries, keys]


def _grouped_bias(bias, kv_heads: int, groups: int):
    return bias.reshape(grouped_bias_shape(bias.shape, kv_heads, groups))


def _d_scores(p, dp):
    """The softmax's gradient along each row: d scores (before the scale) from d probabilities."""
    return p * (dp - (p * dp).sum(axis=-1, keepdims=True))


def _as_heads_first(b, op, values) -> list:
    """An attention op's q, k, v (or d out) as [B, heads, T, hd] tensors: transposed where
    the op takes them [B, T, heads, hd]."""
    return [_swapped(b.wrap(x), op_def(op.type).attrs_of(op)["heads_first"]) for x in values]


def _score_gradient(b, op, dout):
    """d scores [B, H, T, S] of Attention `op` for d out: a learned bias's gradient."""
    q, k, v, p, _ = _grouped_probabilities(b, op)
    (dout,) = _as_heads_first(b, op, [dout])
    ds = _d_scores(p, dout.reshape(q.shape).matmul(v, transpose_b=True))
    batch, heads, queries, _ = dout.shape
    return ds.reshape([batch, heads, queries, k.shape[2]])


def _causal_mask(b, queries: int, keys: int, dtype: str):
    """The additive causal mask, one constant per function and shape: the backward's
    recomputed probabilities are then the forward's op for op, and CSE keeps one."""
    name = f"causal_mask_{queries}x{keys}_{dtype}"
    existing = b.flow.vars.get(f"{b.func.name}/{name}")
    if existing is not None:
        return b.wrap(existing)
    hidden = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
    return b.array(name, np.where(hidden, -np.inf, 0.0).astype(np.float32 if dtype == "float32" else np.float64))


def _transposed_around(b, op):
    """An op taking [B, T, heads, hd] as transposes to and from the same op taking
    [B, heads, T, hd] (which a backend may run whole, or decompose in turn); None where
    the heads come first already."""
    if op_def(op.type).attrs_of(op)["heads_first"]:
        return None
    count = 4 if op.type == "AttentionGrad" else 3  # then the bias, the same in either layout
    inputs = [*_as_heads_first(b, op, op.inputs[:count]), *(b.wrap(x) for x in op.inputs[count:])]
    results = b.op(op.type, inputs, None, {name: value for name, value in op.attrs.items() if name != "heads_first"})
    return [_swapped(r, False) for r in results] if isinstance(results, (list, tuple)) else _swapped(results, False)


@decomposition("Attention")
def _attention_as_gemms(b, op):
    turned = _transposed_around(b, op)
    if turned is not None:
        return turned
    _, _, v, p, _ = _grouped_probabilities(b, op)
    return (p @ v).reshape(op.outputs[0].shape)


@decomposition("AttentionGrad")
def _attention_grad_as_gemms(b, op):
    """With the group's heads stacked along the rows, the products over rows (d k, d v)
    sum the group's heads onto their key/value head in the GEMM itself."""
    turned = _transposed_around(b, op)
    if turned is not None:
        return turned
    q, k, v, p, scale = _grouped_probabilities(b, op)
    dout = b.wrap(op.inputs[3]).reshape(q.shape)
    ds = _d_scores(p, dout.matmul(v, transpose_b=True))
    dq = (ds.matmul(k) * scale).reshape(op.outputs[0].shape)
    dk = ds.matmul(q, transpose_a=True) * scale
    dv = p.matmul(dout, transpose_a=True)
    return [dq, dk, dv]
