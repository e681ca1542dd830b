"""Attention as one composite op, forward and backward, so a backend can fuse it whole.

Attention(q [B, H, T, hd], k [B, KV, S, hd], v [B, KV, S, hd][, bias]) → [B, H, T, hd]:
head h reads key/value head h // (H / KV) (grouped- and multi-query attention). With
`causal` query t sees keys s ≤ t + S − T (queries are the last T positions). `scale`
defaults to 1/√hd. The optional bias is added to the scaled scores before the softmax,
broadcast to [B, H, T, S] (a padding mask [B, 1, 1, S] of 0 and −∞, a position bias
[1, H, T, S]). A query whose every key is masked (−∞ throughout its row: left padding
under a causal mask) attends to nothing: its output row and its gradients are 0, as in
ONNX's Attention and PyTorch's scaled_dot_product_attention, where a plain softmax would
give 0/0.

With `statistics`, Attention also gives each query row's softmax statistic, the
log-sum-exp L = log Σₛ exp(scoreₛ) of its scaled, biased, masked scores, [B, H, T] in float32
(float64 for float64 operands, never rounded to half precision), +∞ for a row that sees no
key. AttentionGrad(q, k, v, out, L, d out[, bias]) → (dq, dk, dv) takes the forward's output
and statistics, as FlashAttention-2's backward does: each probability is exp(score − L),
recomputed tile by tile with no maximum or sum to find again, and the softmax gradient's
row term Σₛ pₛ dpₛ is D = Σ d out ∘ out, one pass over two rows. The gradient rule turns
the forward's statistics on; the T×S probabilities are never kept. A bias's own gradient,
wanted only when it is learned, comes from the decomposed form.

With `heads_first` false, q, k, v, the output and the gradients are [B, T, heads, hd]
instead, as a model's projections give them: a kernel reads and writes the heads in
place, with no transposes on either side (a decomposition makes the transposes). The
statistics are [B, H, T] either way.

Both decompose into batched GEMMs and a row softmax (with one additive causal-mask
constant per function, so the backward's recomputed scores are the forward's, op for
op, and CSE keeps one); a backend with a fused kernel may claim them whole.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .. import dtypes
from ..errors import RanvierError
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


def statistics_dtype(dtype: str) -> str:
    """The dtype of an attention's softmax statistics: float64 for float64 operands, else float32."""
    return dtypes.DT_FLOAT64 if dtype == dtypes.DT_FLOAT64 else dtypes.DT_FLOAT32


def statistics_shape(q_shape, heads_first: bool) -> list[int]:
    """The statistics' shape [B, H, T] of queries of shape `q_shape`, in either layout."""
    return heads_first_shape(q_shape, heads_first)[:3]


def _infer_attention(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point q, k, v of one dtype")
    _check(ctx, *ctx.inputs)
    q = ctx.inputs[0]
    out = [TensorType(dtype, q.shape)]
    if ctx.attrs["statistics"]:
        out.append(TensorType(statistics_dtype(dtype), statistics_shape(q.shape, ctx.attrs["heads_first"])))
    return out


def _infer_attention_grad(ctx):
    q, k, v, out, lse, dout = ctx.inputs[:6]
    dtype = q.dtype
    if dtype not in FLOATS or any(x.dtype != dtype for x in (k, v, out, dout, *ctx.inputs[6:])):
        raise ctx.fail("floating-point q, k, v, out, d out (and bias) of one dtype")
    _check(ctx, q, k, v, *ctx.inputs[6:])
    for name, x in (("out", out), ("d out", dout)):
        if list(x.shape) != list(q.shape):
            raise ctx.fail(f"{name} of the output's shape {list(q.shape)}")
    wanted = statistics_shape(q.shape, ctx.attrs["heads_first"])
    if lse.dtype != statistics_dtype(dtype) or list(lse.shape) != wanted:
        raise ctx.fail(f"the forward's statistics {statistics_dtype(dtype)}{wanted} (got {lse.dtype}{list(lse.shape)})")
    return [TensorType(dtype, q.shape), TensorType(dtype, k.shape), TensorType(dtype, v.shape)]


def scale_of(attrs, head_size: int) -> float:
    """The score scale: attribute scale, by default 1/√head size."""
    scale = attrs["scale"]
    return 1.0 / math.sqrt(head_size) if scale is None else scale


def bias_of(op) -> Variable | None:
    """An Attention or AttentionGrad op's score bias, or None."""
    first = 6 if op.type == "AttentionGrad" else 3
    return op.inputs[first] if len(op.inputs) > first else None


def statistics_of(op) -> Variable | None:
    """The softmax statistics an Attention op writes (None without them) or an AttentionGrad reads."""
    if op.type == "AttentionGrad":
        return op.inputs[4]
    return op.outputs[1] if len(op.outputs) > 1 else None


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


def scores(q, k, causal: bool, scale: float, bias=None) -> np.ndarray:
    """scale · q kᵀ + bias per head [B, H, T, S], float64, −∞ where the causal mask hides a key."""
    _b, h, t, _ = q.shape
    groups = h // k.shape[1]
    keys = np.repeat(np.asarray(k, np.float64), groups, axis=1)
    result = np.einsum("bhtd,bhsd->bhts", np.asarray(q, np.float64), keys) * scale
    if bias is not None:
        result = result + np.asarray(bias, np.float64)
    if causal:
        s = k.shape[2]
        hidden = np.arange(s)[None, :] > np.arange(t)[:, None] + (s - t)
        result = np.where(hidden, -np.inf, result)
    return result


def log_sum_exp(s: np.ndarray) -> np.ndarray:
    """Each row's log Σ exp of scores `s` [..., S] (last axis dropped), float64; +∞ for a row
    of −∞ (a query that sees no key), whose exp(s − ∞) are then all 0."""
    peak = s.max(axis=-1)
    finite = np.where(peak == -np.inf, 0.0, peak)
    total = np.exp(s - finite[..., None]).sum(axis=-1)
    return np.where(total > 0, finite + np.log(np.where(total > 0, total, 1.0)), np.inf)


def _swapped(t, heads_first: bool):
    """Tensor t [B, T, heads, hd] as [B, heads, T, hd], or back; as is where heads come first."""
    return t if heads_first else t.transpose([0, 2, 1, 3])


def attention(q, k, v, bias=None, causal: bool = True, scale: float | None = None, heads_first: bool = True,
              statistics: bool = False) -> list[np.ndarray]:
    """[out] (and [out, L] with `statistics`) of Attention, float64."""
    if not heads_first:  # [B, T, heads, hd] arrays: the same, axes 1 and 2 swapped each way
        results = attention(*(np.swapaxes(x, 1, 2) for x in (q, k, v)), bias, causal, scale, True, statistics)
        return [np.swapaxes(results[0], 1, 2), *results[1:]]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = scores(q, k, causal, scale, bias)
    lse = log_sum_exp(s)
    p = np.exp(s - lse[..., None])  # the softmax; a row that sees no key: zeros
    values = np.repeat(np.asarray(v, np.float64), q.shape[1] // k.shape[1], axis=1)
    out = np.einsum("bhts,bhsd->bhtd", p, values)
    return [out, lse] if statistics else [out]


def attention_grad(q, k, v, out, lse, dout, bias=None, causal: bool = True, scale: float | None = None,
                   heads_first: bool = True) -> list[np.ndarray]:
    """(dq, dk, dv) from the forward's output and statistics: pₛ = exp(scoreₛ − L) and
    D = Σ d out ∘ out, as a kernel computes them."""
    if not heads_first:
        grads = attention_grad(*(np.swapaxes(x, 1, 2) for x in (q, k, v, out)), lse, np.swapaxes(dout, 1, 2),
                               bias, causal, scale)
        return [np.swapaxes(g, 1, 2) for g in grads]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    p = np.exp(scores(q, k, causal, scale, bias) - np.asarray(lse, np.float64)[..., None])
    keys = np.repeat(np.asarray(k, np.float64), groups, axis=1)
    values = np.repeat(np.asarray(v, np.float64), groups, axis=1)
    dout = np.asarray(dout, np.float64)
    dp = np.einsum("bhtd,bhsd->bhts", dout, values)
    ds = p * (dp - (dout * np.asarray(out, np.float64)).sum(axis=-1)[..., None])
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
STATISTICS = Attr("statistics", "bool", False, "Attention also outputs each query row's log-sum-exp [B, H, T]")


def _attention_vjp(ctx, g):
    if len(g) > 1 and g[1] is not None:
        raise RanvierError(f"Attention {ctx.op.name}: its statistics have no gradient (they are for AttentionGrad)")
    q, k, v, *bias = ctx.inputs
    attrs = {name: value for name, value in ctx.op.attrs.items() if name != "statistics"}
    dq, dk, dv = ctx.b.op("AttentionGrad", [q, k, v, ctx.outputs[0], _forward_statistics(ctx), g[0], *bias], None, attrs)
    if not bias:
        return [dq, dk, dv]
    return [dq, dk, dv, ctx.unbroadcast(_score_gradient(ctx.b, ctx.op, g[0]), bias[0])]


def _forward_statistics(ctx):
    """The statistics output of the Attention op being differentiated, turned on where the
    forward was built without it (the gradient rule is what needs them)."""
    op = ctx.op
    if len(op.outputs) == 1:
        op.set_attr("statistics", True)
        (_, kind) = op_def(op.type).infer_types(op.name, op.inputs, op.attrs)
        op.add_output(ctx.b.flow.add_var(f"{op.name}:1", kind.dtype, kind.shape))
    return ctx.b.wrap(op.outputs[1])


def _build_attention(b, q, k, v, bias=None, causal=True, scale=None, heads_first=True, statistics=False, name=None):
    """The output, or (output, statistics) with `statistics`."""
    attrs = {"causal": causal, "scale": scale, "heads_first": heads_first, "statistics": statistics}
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
    lambda a, args, o: attention(*args[:3], *args[3:], causal=a["causal"], scale=scale_of(a, args[0].shape[-1]),
                                 heads_first=a["heads_first"], statistics=a["statistics"]),
    (3, 4),
    "nn",
    "Attention(q, k, v[, bias]) → out[, statistics]",
    attrs=[*ATTRS, STATISTICS],
    vjp=_attention_vjp,
    flops=_flops,
    method="attention",
    build=_build_attention,
)
define(
    "AttentionGrad",
    _infer_attention_grad,
    lambda a, args, o: attention_grad(*args[:6], *args[6:], causal=a["causal"], scale=scale_of(a, args[0].shape[-1]),
                                      heads_first=a["heads_first"]),
    (6, 7),
    "nn",
    "(dq, dk, dv) of Attention from (q, k, v, out, statistics, d out[, bias])",
    attrs=ATTRS,
    flops=_flops,
)


def _grouped_scores(b, op):
    """Grouped views of q, k, v and the scores scale·q kᵀ + bias + causal mask.

    The query heads sharing a key/value head are stacked into one matrix of G·T rows
    [B, KV, G·T, hd], so each key/value head takes one GEMM of G·T rows rather than G
    GEMMs of T; the scores come out [B, KV, G·T, S] in the same row order."""
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
    return stacked, k, v, scores, scale


def _grouped_probabilities(b, op):
    """`_grouped_scores`, the scores turned into probabilities by the row softmax."""
    q, k, v, scores, scale = _grouped_scores(b, op)
    p = scores.softmax()
    if bias_of(op) is not None:  # a bias may mask a query's every key: its row is 0, not the softmax's 0/0
        p = scores.max(axis=[-1], keepdims=True).not_equal(-math.inf).select(p)
    return q, k, v, p, scores, scale


def _log_sum_exp(scores):
    """Each row's log Σ exp, keeping its last axis (of 1); +∞ for a row of −∞ (no key seen)."""
    peak = scores.max(axis=[-1], keepdims=True)
    seen = peak.not_equal(-math.inf)
    finite = seen.select(peak)
    total = (scores - finite).exp().sum(axis=[-1], keepdims=True)
    return seen.where(finite + total.log(), math.inf)


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
    q, k, v, p, _, _ = _grouped_probabilities(b, op)
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
    return b.array(name, np.where(hidden, -np.inf, 0.0).astype(dtypes.to_numpy(dtype)))


def _transposed_around(b, op):
    """An op taking [B, T, heads, hd] as transposes to and from the same op taking
    [B, heads, T, hd] (which a backend may run whole, or decompose in turn); None where
    the heads come first already. The statistics and a bias are the same in either layout."""
    if op_def(op.type).attrs_of(op)["heads_first"]:
        return None
    turned = (0, 1, 2, 3, 5) if op.type == "AttentionGrad" else (0, 1, 2)  # q, k, v (out, d out)
    inputs = [_swapped(b.wrap(x), False) if i in turned else b.wrap(x) for i, x in enumerate(op.inputs)]
    results = b.op(op.type, inputs, None, {name: value for name, value in op.attrs.items() if name != "heads_first"})
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    count = 3 if op.type == "AttentionGrad" else 1  # the results in the op's layout: not the statistics
    return [_swapped(r, False) if i < count else r for i, r in enumerate(results)]


@decomposition("Attention")
def _attention_as_gemms(b, op):
    turned = _transposed_around(b, op)
    if turned is not None:
        return turned
    _, _, v, p, scores, _ = _grouped_probabilities(b, op)
    out = (p @ v).reshape(op.outputs[0].shape)
    if len(op.outputs) == 1:
        return out
    return [out, _log_sum_exp(_widened(scores, op.outputs[1].dtype)).reshape(op.outputs[1].shape)]


def _widened(t, dtype: str):
    """Tensor t in `dtype` (the statistics' float32 where t is half precision)."""
    return t if t.dtype == dtype else t.cast(dtype)


@decomposition("AttentionGrad")
def _attention_grad_as_gemms(b, op):
    """pₛ = exp(scoreₛ − L) from the forward's statistics L (0 where a key is masked, and
    in a row that sees no key, whose L is +∞); D = Σ d out ∘ out. With the group's heads
    stacked along the rows, the products over rows (d k, d v) sum the group's heads onto
    their key/value head in the GEMM itself."""
    turned = _transposed_around(b, op)
    if turned is not None:
        return turned
    q, k, v, scores, scale = _grouped_scores(b, op)
    rows = [*q.shape[:3], 1]
    statistics = b.wrap(op.inputs[4])
    p = _widened((_widened(scores, statistics.dtype) - statistics.reshape(rows)).exp(), q.dtype)
    out, dout = (b.wrap(op.inputs[i]).reshape(q.shape) for i in (3, 5))
    d = (out * dout).sum(axis=[-1], keepdims=True)
    ds = p * (dout.matmul(v, transpose_b=True) - d)
    dq = (ds.matmul(k) * scale).reshape(op.outputs[0].shape)
    dk = ds.matmul(q, transpose_a=True) * scale
    dv = p.matmul(dout, transpose_a=True)
    return [dq, dk, dv]
