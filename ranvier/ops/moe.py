"""Mixture-of-experts ops: top-k selection, routing tokens to experts, grouped matrix
products over the experts' variable-length groups, and the load-balancing loss.

A MoE layer is built from them (see `ranvier.models.moe`):

    probs = softmax(x @ router)                        [T, E]
    weights, experts = TopK(probs)                     [T, k] each
    order, slot, offsets, kept, counts = MoERoute(experts)
    rows = Gather(x, order)                            [R, D]  tokens sorted by expert
    out_rows = GroupedMatMul(rows, W, offsets)         [R, F]  row r through its expert's W
    y = MoECombine(out_rows, slot, weights)            [T, F]  Σ_j weights[:, j] · out_rows[slot[:, j]]

so every token passes through its k experts only, never the others. Rows beyond the last
group (tokens dropped at an expert's capacity) are zero.
"""

from __future__ import annotations

import itertools

import numpy as np

from .. import dtypes
from .index import check_range
from .nn import softmax
from .registry import Attr, TensorType, attrs_of, decomposition, define, zero_gradient
from .rules import FLOATS, INDEX, NUMERIC, PRECISION, same_dtype

# ---- TopK -------------------------------------------------------------------------------------------

TOP_K_ATTRS = [Attr("k", "int", None, "how many to keep")]


def _infer_top_k(ctx):
    (x,) = ctx.inputs
    k = ctx.attrs["k"]
    if x.dtype not in NUMERIC or x.rank < 1:
        raise ctx.fail("a numeric input of rank >= 1")
    if k is None or not 1 <= k <= x.shape[-1]:
        raise ctx.fail(f"attribute k in [1, {x.shape[-1]}] (the last dimension)")
    shape = (*x.shape[:-1], k)
    return [TensorType(x.dtype, shape), TensorType(dtypes.DT_INT32, shape)]


def top_k_order(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest elements of each row, largest first; NaN counts as the
    largest, and ties keep the lower index first."""
    key = np.asarray(x, np.float64)
    key = np.where(np.isnan(key), np.inf, key)
    return np.argsort(-key, axis=-1, kind="stable")[..., :k]


def _top_k(attrs, args, outs):
    x = args[0]
    indices = top_k_order(x, attrs["k"])
    return [np.take_along_axis(x, indices, axis=-1), indices.astype(np.int32)]


def _top_k_vjp(ctx, grads):
    """The gradient of each selected value goes back to the element it came from."""
    x, (dvalues, _) = ctx.inputs[0], grads
    if dvalues is None:
        return [None]
    spread = ctx.outputs[1].one_hot(x.shape[-1], x.dtype) * dvalues.expand_dims(-1)  # [..., k, N]
    return [spread.sum(axis=-2)]


define(
    "TopK", _infer_top_k, _top_k, 1, "moe",
    "(values, indices) of the k largest elements along the last axis, largest first",
    attrs=TOP_K_ATTRS,
    vjp=_top_k_vjp,
    flops=lambda op: op.inputs[0].size * attrs_of(op)["k"],
    method="top_k",
)


# ---- SoftmaxTopK: the router's softmax and top-k in one pass over each row ---------------------------


def _infer_softmax_top_k(ctx):
    (x,) = ctx.inputs
    same_dtype(ctx, FLOATS, "floating-point logits")
    values, indices = _infer_top_k(ctx)
    return [TensorType(x.dtype, x.shape), values, indices]


def _softmax_top_k(attrs, args, outs):
    probs = softmax(args[0])
    values, indices = _top_k(attrs, [probs], outs)
    return [probs, values, indices]


define(
    "SoftmaxTopK", _infer_softmax_top_k, _softmax_top_k, 1, "moe",
    "(softmax(x), its top-k values, their indices) along the last axis; the compiler fuses a "
    "softmax read by a TopK into it",
    attrs=TOP_K_ATTRS,
    flops=lambda op: op.inputs[0].size * (5 + attrs_of(op)["k"]),
)


# ---- MoERoute: tokens sorted by expert ----------------------------------------------------------------


def _infer_route(ctx):
    (experts,) = ctx.inputs
    count = ctx.attrs["experts"]
    capacity = ctx.attrs["capacity"]
    if experts.dtype not in INDEX or experts.rank != 2:
        raise ctx.fail("int32/int64 expert choices [tokens, k]")
    if count is None or count < 1 or capacity < 0:
        raise ctx.fail("attribute experts >= 1 and capacity >= 0 (0: no limit)")
    tokens, k = experts.shape
    rows = route_rows(tokens, k, count, capacity)
    int32 = dtypes.DT_INT32
    return [
        TensorType(int32, [rows]), TensorType(int32, [tokens, k]), TensorType(int32, [count + 1]),
        TensorType(dtypes.DT_BOOL, [tokens, k]), TensorType(int32, [count]),
    ]


def route_rows(tokens: int, k: int, experts: int, capacity: int) -> int:
    """Rows of the sorted token buffer: every choice, or at most `capacity` per expert."""
    return tokens * k if capacity == 0 else min(tokens * k, experts * capacity)


def route(choices: np.ndarray, experts: int, capacity: int):
    """(order, slot, offsets, kept, counts) of expert choices [T, k]: a counting sort of the
    choices by expert, in token order within each expert.

    order[r]    the token whose row r is (rows of expert e: offsets[e] to offsets[e+1])
    slot[t, j]  the row of token t's j-th choice (row 0 where the choice was dropped)
    kept[t, j]  whether that choice found room below the expert's capacity
    counts[e]   how many choices named expert e, dropped ones included
    """
    tokens, k = choices.shape
    if choices.size and (choices.min() < 0 or choices.max() >= experts):
        bad = choices[(choices < 0) | (choices >= experts)].reshape(-1)[0]
        raise IndexError(f"expert {int(bad)} is outside [0, {experts})")
    flat = choices.reshape(-1).astype(np.int64)
    counts = np.bincount(flat, minlength=experts)
    room = counts if capacity == 0 else np.minimum(counts, capacity)
    offsets = np.concatenate([[0], np.cumsum(room)])
    order = np.zeros(route_rows(tokens, k, experts, capacity), np.int32)
    slot = np.zeros(tokens * k, np.int32)
    kept = np.zeros(tokens * k, bool)
    filled = np.zeros(experts, np.int64)
    for choice, expert in enumerate(flat):
        if filled[expert] < room[expert]:
            row = offsets[expert] + filled[expert]
            order[row], slot[choice], kept[choice] = choice // k, row, True
            filled[expert] += 1
    return order, slot.reshape(tokens, k), offsets.astype(np.int32), kept.reshape(tokens, k), counts.astype(np.int32)


define(
    "MoERoute", _infer_route, lambda a, args, o: list(route(np.asarray(args[0]), a["experts"], a["capacity"])), 1, "moe",
    "(order, slot, offsets, kept, counts): expert choices [T, k] as rows sorted by expert",
    attrs=[
        Attr("experts", "int", None, "the number of experts"),
        Attr("capacity", "int", 0, "rows per expert at most (0: no limit); choices beyond are dropped"),
    ],
    vjp=zero_gradient,
    method="moe_route",
)


# ---- GroupedMatMul: each group of rows times its own matrix ------------------------------------------------


def _infer_grouped(ctx):
    x, w, offsets = ctx.inputs
    if x.dtype not in FLOATS or w.dtype != x.dtype:
        raise ctx.fail("floating-point rows and matrices of one dtype")
    if x.rank != 2 or w.rank != 3 or offsets.dtype != dtypes.DT_INT32 or list(offsets.shape) != [w.shape[0] + 1]:
        raise ctx.fail("rows [R, K], matrices [E, K, N] and int32 group offsets [E + 1]")
    k, n = (w.shape[2], w.shape[1]) if ctx.attrs["transpose_b"] else (w.shape[1], w.shape[2])
    if x.shape[1] != k:
        raise ctx.fail(f"rows of {k} values (the matrices' inner dimension), got {x.shape[1]}")
    return [TensorType(x.dtype, [x.shape[0], n])]


def _groups(offsets: np.ndarray, rows: int):
    """(expert, start, stop) of every group; a bad offset raises, naming it."""
    bounds = [int(o) for o in offsets]
    if bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds)) or bounds[-1] > rows:
        raise ValueError(f"group offsets {bounds[:8]}... must rise from 0 to at most {rows}")
    return [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)]


def grouped_matmul(x, w, offsets, transpose_b=False):
    y = np.zeros((x.shape[0], w.shape[1] if transpose_b else w.shape[2]))
    for e, start, stop in _groups(offsets, x.shape[0]):
        matrix = np.asarray(w[e], np.float64)
        y[start:stop] = np.asarray(x[start:stop], np.float64) @ (matrix.T if transpose_b else matrix)
    return y


def _grouped_vjp(ctx, grads):
    x, w, offsets = ctx.inputs
    dy = grads[0]
    tb = ctx.attrs["transpose_b"]
    dx = ctx.b.grouped_matmul(dy, w, offsets, transpose_b=not tb)
    dw = ctx.b.grouped_matmul_weight_grad(x, dy, offsets, w.shape[0], transpose=tb)
    return [dx, dw, None]


def _grouped_flops(op) -> int:
    """Two per multiply-add of the rows that belong to a group (all of them, at most)."""
    x, w = op.inputs[0], op.inputs[1]
    return 2 * x.size * (w.shape[1] if attrs_of(op)["transpose_b"] else w.shape[2])


define(
    "GroupedMatMul", _infer_grouped, lambda a, args, o: [grouped_matmul(*args, a["transpose_b"])], 3, "moe",
    "GroupedMatMul(x [R, K], w [E, K, N], offsets [E+1]): rows offsets[e]..offsets[e+1] of x times w[e]; "
    "rows past the last group are zero",
    attrs=[Attr("transpose_b", "bool", False, "the matrices are [E, N, K]: use each one's transpose"), PRECISION],
    vjp=_grouped_vjp,
    flops=_grouped_flops,
    method="grouped_matmul",
)


def _infer_grouped_weight_grad(ctx):
    x, dy, offsets = ctx.inputs
    experts = ctx.attrs["experts"]
    if x.dtype not in FLOATS or dy.dtype != x.dtype or x.rank != 2 or dy.rank != 2 or x.shape[0] != dy.shape[0]:
        raise ctx.fail("floating-point rows x [R, K] and dy [R, N] of one dtype")
    if experts is None or offsets.dtype != dtypes.DT_INT32 or list(offsets.shape) != [experts + 1]:
        raise ctx.fail("attribute experts and int32 group offsets [experts + 1]")
    k, n = x.shape[1], dy.shape[1]
    return [TensorType(x.dtype, [experts, n, k] if ctx.attrs["transpose"] else [experts, k, n])]


def grouped_matmul_weight_grad(x, dy, offsets, experts, transpose=False):
    """dw[e] = x_eᵀ · dy_e over group e's rows ([E, K, N]; transposed: [E, N, K])."""
    k, n = x.shape[1], dy.shape[1]
    dw = np.zeros((experts, n, k) if transpose else (experts, k, n))
    for e, start, stop in _groups(offsets, x.shape[0]):
        product = np.asarray(x[start:stop], np.float64).T @ np.asarray(dy[start:stop], np.float64)
        dw[e] = product.T if transpose else product
    return dw


define(
    "GroupedMatMulWeightGrad", _infer_grouped_weight_grad,
    lambda a, args, o: [grouped_matmul_weight_grad(*args, a["experts"], a["transpose"])], 3, "moe",
    "the matrices' gradient of GroupedMatMul: (x, dy, offsets) → dw[e] = x_eᵀ dy_e",
    attrs=[
        Attr("experts", "int", None, "the number of matrices"),
        Attr("transpose", "bool", False, "give each gradient transposed, [E, N, K]"),
        PRECISION,
    ],
    flops=lambda op: 2 * op.inputs[0].size * op.inputs[1].shape[1],
    method="grouped_matmul_weight_grad",
)


# ---- MoECombine: each token's expert outputs, weighted and summed ------------------------------------------


def _combined_type(ctx, rows, slot, weights) -> TensorType:
    """MoECombine's output type, after checking its inputs (MoECombineGrad's too)."""
    if rows.dtype not in FLOATS or rows.rank != 2 or weights.dtype != rows.dtype or weights.rank != 2:
        raise ctx.fail("floating-point expert output rows [R, D] and weights [T, k] of one dtype")
    if slot.dtype != dtypes.DT_INT32 or list(slot.shape) != list(weights.shape):
        raise ctx.fail(f"int32 slots of the weights' shape {list(weights.shape)}")
    return TensorType(rows.dtype, [weights.shape[0], rows.shape[1]])


def _infer_combine(ctx):
    return [_combined_type(ctx, *ctx.inputs)]


def moe_combine(rows, slot, weights):
    """y[t] = Σ_j weights[t, j] · rows[slot[t, j]] (float64); a slot outside the rows raises."""
    check_range(slot, rows.shape[0])
    return np.einsum("tj,tjd->td", np.asarray(weights, np.float64), np.asarray(rows, np.float64)[slot])


def _combine_vjp(ctx, grads):
    rows, slot, weights = ctx.inputs
    d_rows, d_weights = ctx.b.moe_combine_grad(grads[0], rows, slot, weights)
    return [d_rows, None, d_weights]


define(
    "MoECombine", _infer_combine, lambda a, args, o: [moe_combine(*args)], 3, "moe",
    "MoECombine(rows [R, D], slot [T, k], weights [T, k]): y[t] = Σ_j weights[t, j] · rows[slot[t, j]], "
    "each token's expert outputs combined without the [T, k, D] rows they are gathered into",
    vjp=_combine_vjp,
    flops=lambda op: 2 * op.inputs[2].size * op.inputs[0].shape[1],
    method="moe_combine",
)


@decomposition("MoECombine")
def _combine_by_gathering(b, op):
    rows, slot, weights = (b.wrap(v) for v in op.inputs)
    return (rows.gather(slot) * weights.expand_dims(-1)).sum(axis=1)


def _infer_combine_grad(ctx):
    dy, rows, slot, weights = ctx.inputs
    y = _combined_type(ctx, rows, slot, weights)
    if dy.dtype != rows.dtype or list(dy.shape) != list(y.shape):
        raise ctx.fail(f"d y of MoECombine's output type {y.dtype}{list(y.shape)}")
    return [TensorType(rows.dtype, rows.shape), TensorType(weights.dtype, weights.shape)]


def moe_combine_grad(dy, rows, slot, weights):
    """(d rows, d weights) of MoECombine: d rows[r] = Σ over the (t, j) whose slot is r of
    weights[t, j] · dy[t], d weights[t, j] = dy[t] · rows[slot[t, j]] (float64)."""
    check_range(slot, rows.shape[0])
    dy, rows, weights = (np.asarray(a, np.float64) for a in (dy, rows, weights))
    d_rows = np.zeros(rows.shape)
    np.add.at(d_rows, slot.reshape(-1), (weights[..., None] * dy[:, None, :]).reshape(-1, rows.shape[1]))
    return d_rows, np.einsum("td,tjd->tj", dy, rows[slot])


define(
    "MoECombineGrad", _infer_combine_grad, lambda a, args, o: list(moe_combine_grad(*args)), 4, "moe",
    "the gradients of MoECombine: (dy, rows, slot, weights) → (d rows, d weights)",
    flops=lambda op: 4 * op.inputs[3].size * op.inputs[1].shape[1],
    method="moe_combine_grad",
)


@decomposition("MoECombineGrad")
def _combine_grad_by_gathering(b, op):
    dy, rows, slot, weights = (b.wrap(v) for v in op.inputs)
    spread = dy.expand_dims(1)  # [T, 1, D]
    d_rows = b.scatter_add(slot, weights.expand_dims(-1) * spread, rows=rows.shape[0])
    return [d_rows, (rows.gather(slot) * spread).sum(axis=-1)]


# ---- the load-balancing loss ------------------------------------------------------------------------------


def _infer_aux(ctx):
    probs, counts = ctx.inputs
    if probs.dtype not in FLOATS or probs.rank != 2 or counts.dtype not in INDEX or list(counts.shape) != [probs.shape[1]]:
        raise ctx.fail("floating-point router probabilities [T, E] and integer expert counts [E]")
    return [TensorType(probs.dtype, [])]


def load_balancing_loss(probs, counts):
    """E · Σᵢ fᵢ·Pᵢ: fᵢ the fraction of tokens routed to expert i (counts / T), Pᵢ the mean
    router probability of expert i. k when the top-k routing is uniform; E when one expert
    takes every token (top-1)."""
    tokens, experts = probs.shape
    fraction = np.asarray(counts, np.float64) / tokens
    return experts * float(np.sum(fraction * np.asarray(probs, np.float64).mean(axis=0)))


def _aux_vjp(ctx, grads):
    """Through the probabilities only (the counts are a step function of them)."""
    probs, counts = ctx.inputs
    tokens, experts = probs.shape
    share = counts.cast(probs.dtype) * (experts / (tokens * tokens))
    return [share.expand_dims(0).broadcast_to(probs.shape) * grads[0], None]


define(
    "MoEAuxLoss", _infer_aux, lambda a, args, o: [np.asarray(load_balancing_loss(*args))], 2, "moe",
    "the load-balancing loss E · Σᵢ fᵢ·Pᵢ of router probabilities [T, E] and expert counts [E]",
    vjp=_aux_vjp,
    flops=lambda op: 2 * op.inputs[0].size,
    method="load_balancing_loss",
)


@decomposition("MoEAuxLoss")
def _aux_from_sums(b, op):
    probs, counts = (b.wrap(v) for v in op.inputs)
    tokens, experts = probs.shape
    return (probs.mean(axis=0) * counts.cast(probs.dtype)).sum() * (experts / tokens)
