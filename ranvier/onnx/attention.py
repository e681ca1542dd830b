"""ONNX's scaled dot-product attention (the Attention operator, opsets 23-25).

Inputs are 4-D [B, heads, T, head size], or 3-D [B, T, heads · head size] with
q_num_heads and kv_num_heads; key/value heads may be fewer than the query heads (grouped
and multi-query attention). A boolean (True: attend) or additive mask is the score bias;
cached keys and values (past_key/past_value) go in front of the new ones and come back as
present_key/present_value.

Which keys query i sees (`_visible_keys`): with `is_causal` those j ≤ i + offset, where the
offset is the cached count (past_key's length, or nonpad_kv_seqlen − T per batch for a
cache kept outside); with left/right_window_size (opset 25) those within the window around
i + offset; with nonpad_kv_seqlen those j below it. A query that sees no key gives 0.

Attention as ONNX computes it most often is ranvier's fused Attention op. A softcap, the
scores output (qk_matmul_output) or values of another head size than the keys' are
computed op by op: the scores, softcap · tanh(scores / softcap), the bias, the softmax,
the values.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from .node import Node, converts, onnx_dtype

# What qk_matmul_output holds, by qk_matmul_output_mode (ONNX's specification).
_SCORES, _SOFTCAPPED, _BIASED, _PROBABILITIES = range(4)


@converts("Attention")
def attention(node: Node):
    q, k, v = (_heads_first(node, i) for i in range(3))
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise node.error(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    softcap = float(node.attr("softcap", 0.0))
    mode = int(node.attr("qk_matmul_output_mode", _SCORES))
    wants_scores = len(node.proto.output) > 3 and bool(node.proto.output[3])
    if wants_scores and mode not in range(4):
        raise node.error(f"qk_matmul_output_mode={mode}: ONNX defines 0 to 3")
    if wants_scores and mode == _SCORES and softcap:
        # ONNX's reference returns the softcapped scores here, its specification the raw ones.
        raise node.error(f"qk_matmul_output_mode=0 with softcap={softcap} is not supported: ONNX's reference "
                         "and its specification disagree on what it holds")
    # ranvier's softmax computes in float32 at least; a wider softmax_precision takes its own.
    precision = node.attr("softmax_precision")
    precision = None if precision is None else onnx_dtype(precision, "softmax_precision")
    if precision is not None and precision not in dtypes.FLOAT_DTYPES:
        raise node.error(f"softmax_precision {precision}: ONNX takes a floating-point type")
    wide = precision if precision is not None and dtypes.itemsize(precision) > 4 else None
    past, nonpad = node.optional(4), node.optional(6)
    if (past is None) != (node.optional(5) is None):
        raise node.error("has only one of past_key and past_value (ONNX needs both)")
    if past is not None and nonpad is not None:
        raise node.error("has both past_key and nonpad_kv_seqlen (ONNX allows one)")
    new_keys = k.shape[2]
    if past is not None:
        k = node.b.concat([node.tensor(4), k], 2)
        v = node.b.concat([node.tensor(5), v], 2)
    queries, keys = q.shape[2], k.shape[2]
    causal = bool(node.attr("is_causal", 0))
    window = int(node.attr("left_window_size", -1)), int(node.attr("right_window_size", -1))
    if min(window) < -1:
        raise node.error(f"window sizes {list(window)}: each must be -1 (unbounded) or at least 0")
    op_by_op = bool(softcap) or wants_scores or k.shape[-1] != v.shape[-1] or wide is not None
    bias = _attention_mask(node, q.dtype, keys) if node.optional(3) is not None else None
    # ranvier's causal flag lets query t see keys s ≤ t + S − T: right where the new keys are the queries.
    causal_flag = causal and not op_by_op and window == (-1, -1) and nonpad is None and new_keys == queries
    if (causal and not causal_flag) or window != (-1, -1) or nonpad is not None:
        lengths = None if nonpad is None else node.tensor(6).reshape([q.shape[0], 1, 1, 1])
        offset = keys - new_keys if lengths is None else lengths - queries
        visible = _visible_keys(node, queries, keys, offset, causal, window, lengths)
        frontier = node.b.cond(visible, node.b.const(0.0, q.dtype), node.b.const(-math.inf, q.dtype))
        bias = frontier if bias is None else bias + frontier
    scale = node.attr("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if op_by_op:
        y, scores = _op_by_op(node, q, k, v, bias, scale, softcap, mode, wide)
    else:
        y, scores = node.b.attention(q, k, v, bias, causal=causal_flag, scale=scale), None
    if node.inputs[0].rank == 3:
        y = y.transpose([0, 2, 1, 3]).reshape([y.shape[0], queries, y.shape[1] * y.shape[3]])
    return [y, k, v] + ([scores] if wants_scores else [])


def _op_by_op(node: Node, q, k, v, bias, scale: float, softcap: float, mode: int, wide: str | None):
    """The output and the scores qk_matmul_output_mode names, op by op, the softmax in
    dtype `wide` where given. The query heads that share a key/value head are stacked
    into one matrix [B, KV, G·T, head size], so each key/value head takes one product."""
    batch, heads, queries, size = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    grouped = [batch, kv_heads, heads // kv_heads * queries]
    raw = q.reshape([*grouped, size]).matmul(k, transpose_b=True).reshape([batch, heads, queries, keys]) * scale
    capped = (raw * (1.0 / softcap)).tanh() * softcap if softcap else raw
    biased = capped if bias is None else capped + bias
    p = biased.softmax() if wide is None else node.b.cast(node.b.cast(biased, wide).softmax(), biased.dtype)
    if bias is not None:  # a query whose every key is masked sees none: its row is 0, not the softmax's 0/0
        p = biased.max(axis=[-1], keepdims=True).not_equal(-math.inf).select(p)
    y = p.reshape([*grouped, keys]).matmul(v).reshape([batch, heads, queries, v.shape[-1]])
    return y, (raw, capped, biased, p)[mode]


def _attention_mask(node: Node, dtype: str, keys: int):
    """Attention's mask as a score bias: a boolean one as 0 (attend) and -inf; one shorter
    than the keys padded with -inf, as ONNX pads it."""
    mask = node.tensor(3)
    if mask.dtype == dtypes.DT_BOOL:
        mask = node.b.cond(mask, node.b.const(0.0, dtype), node.b.const(-math.inf, dtype))
    if mask.shape[-1] < keys:
        mask = node.b.pad(mask, before=[0] * mask.rank, after=[0] * (mask.rank - 1) + [keys - mask.shape[-1]],
                          value=-math.inf)
    return mask


def _visible_keys(node: Node, queries: int, keys: int, offset, causal: bool, window: tuple[int, int], nonpad):
    """Whether query i sees key j, [1 or B, 1, T, S]: the causal frontier j ≤ p, the window
    p − left ≤ j ≤ p + right (p = i + offset, the query's position among the keys), and
    j < nonpad. `offset` and `nonpad` are numbers or [B, 1, 1, 1] int64 tensors."""
    index = node.b.const(np.arange(queries, dtype=np.int64).reshape(1, 1, queries, 1))
    key = node.b.const(np.arange(keys, dtype=np.int64).reshape(1, 1, 1, keys))
    position = index + offset
    left, right = window
    conditions = [key <= position] if causal else []
    if left >= 0:
        conditions.append(key >= position - left)
    if right >= 0:
        conditions.append(key <= position + right)
    if nonpad is not None:
        conditions.append(key < nonpad)
    visible = conditions[0]
    for condition in conditions[1:]:
        visible = visible & condition
    return visible


def _heads_first(node: Node, index: int):
    """Input `index` (Q, K or V) as [B, heads, T, head size]."""
    x = node.tensor(index)
    name = "q_num_heads" if index == 0 else "kv_num_heads"
    heads = node.attr(name)
    if x.rank == 4:
        if heads is not None and int(heads) != x.shape[1]:
            raise node.error(f"{name}={heads} contradicts the {x.shape[1]} heads of its 4-D input {index}")
        return x
    if x.rank != 3:
        raise node.error(f"input {index} has rank {x.rank}; ONNX Attention takes rank 3 or 4")
    if heads is None or x.shape[2] % int(heads):
        raise node.error(f"3-D input {index} needs {name} dividing its last axis")
    heads = int(heads)
    return x.reshape([x.shape[0], x.shape[1], heads, x.shape[2] // heads]).transpose([0, 2, 1, 3])
