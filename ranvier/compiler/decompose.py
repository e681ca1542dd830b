"""Decomposition: rewrite composite ops a backend has no kernel for into primitives.

Convolution and pooling, forward and backward, become padding, an im2col-style
strided view of the windows, a GEMM or a reduction, and (for gradients) the
strided scatter-add that is the view's transpose. A reduction over axes that are
not adjacent becomes one reduction per block of adjacent axes. Every variable the rest of the
flow sees keeps its name; only the inside of the op changes.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Function, Operation
from ..ops import Attrs
from ..ops.elementwise import gelu_gate
from ..ops.nn import pool_params


def _pair(attrs: Attrs, name: str, default):
    values = attrs.ints(name, default)
    return values * 2 if len(values) == 1 else values


def _padded(b: Builder, x: Tensor, padding, value: float = 0.0) -> Tensor:
    if not any(padding):
        return x
    before = [0, 0, padding[0], padding[1]]
    return b.op("Pad", [x], None, {"before": before, "after": before, "value": value if value else None})


def _window_view(shape, kernel, strides, out_hw, channels_last: bool) -> dict:
    """View attributes reading [N, ...] windows from a padded [N, C, Hp, Wp] tensor:
    [N, Ho, Wo, C, KH, KW] (im2col rows) or [N, C, Ho, Wo, KH, KW] (pooling windows)."""
    n, c, hp, wp = shape
    (kh, kw), (sh, sw), (ho, wo) = kernel, strides, out_hw
    image, row = hp * wp, wp
    if channels_last:
        return {"shape": [n, ho, wo, c, kh, kw], "strides": [c * image, sh * row, sw, image, row, 1]}
    return {"shape": [n, c, ho, wo, kh, kw], "strides": [c * image, image, sh * row, sw, row, 1]}


def _conv_parts(b: Builder, x_shape, filter_shape, attrs: Attrs, out_hw):
    strides, padding = _pair(attrs, "strides", [1, 1]), _pair(attrs, "padding", [0, 0])
    n, c, h, w = x_shape
    padded = [n, c, h + 2 * padding[0], w + 2 * padding[1]]
    view = _window_view(padded, filter_shape[2:], strides, out_hw, channels_last=True)
    return strides, padding, padded, view


def conv2d(b: Builder, op: Operation) -> Tensor:
    x, w = (b._wrap(v) for v in op.inputs)
    n, o, ho, wo = op.outputs[0].shape
    _, padding, _, view = _conv_parts(b, x.shape, w.shape, Attrs(op.attrs), (ho, wo))
    taps = math.prod(w.shape[1:])
    cols = b.op("StridedView", [_padded(b, x, padding)], None, view).reshape([n * ho * wo, taps])
    y = b.matmul(cols, w.reshape([o, taps]), transpose_b=True)
    return y.reshape([n, ho, wo, o]).transpose([0, 3, 1, 2])


def _rows_of(b: Builder, dy: Tensor) -> Tensor:
    n, o, ho, wo = dy.shape
    return dy.transpose([0, 2, 3, 1]).reshape([n * ho * wo, o])


def conv2d_filter_grad(b: Builder, op: Operation) -> Tensor:
    x, dy = (b._wrap(v) for v in op.inputs)
    filters = op.outputs[0].shape
    n, o, ho, wo = dy.shape
    _, padding, _, view = _conv_parts(b, x.shape, filters, Attrs(op.attrs), (ho, wo))
    taps = math.prod(filters[1:])
    cols = b.op("StridedView", [_padded(b, x, padding)], None, view).reshape([n * ho * wo, taps])
    return b.matmul(_rows_of(b, dy), cols, transpose_a=True).reshape(filters)


def conv2d_input_grad(b: Builder, op: Operation) -> Tensor:
    dy, w = (b._wrap(v) for v in op.inputs)
    x_shape = op.outputs[0].shape
    n, o, ho, wo = dy.shape
    _, padding, padded, view = _conv_parts(b, x_shape, w.shape, Attrs(op.attrs), (ho, wo))
    columns = b.matmul(_rows_of(b, dy), w.reshape([o, math.prod(w.shape[1:])])).reshape(view["shape"])
    grad = b.op("StridedScatterAdd", [columns], None, {**view, "target_shape": padded})
    return _unpadded(b, grad, padding, x_shape)


def _unpadded(b: Builder, t: Tensor, padding, shape) -> Tensor:
    return b.slice(t, [0, 0, padding[0], padding[1]], shape) if any(padding) else t


def _pool_windows(b: Builder, x: Tensor, attrs: Attrs, out_hw, fill: float) -> tuple[Tensor, dict, list, list]:
    kernel, strides, padding = pool_params(attrs)
    n, c, h, w = x.shape
    padded = [n, c, h + 2 * padding[0], w + 2 * padding[1]]
    view = _window_view(padded, kernel, strides, out_hw, channels_last=False)
    return b.op("StridedView", [_padded(b, x, padding, fill)], None, view), view, padded, padding


def max_pool(b: Builder, op: Operation) -> Tensor:
    windows, *_ = _pool_windows(b, b._wrap(op.inputs[0]), Attrs(op.attrs), op.outputs[0].shape[2:], -math.inf)
    return b.max(windows, axis=[4, 5])


def avg_pool(b: Builder, op: Operation) -> Tensor:
    windows, *_ = _pool_windows(b, b._wrap(op.inputs[0]), Attrs(op.attrs), op.outputs[0].shape[2:], 0.0)
    return b.mean(windows, axis=[4, 5])


def max_pool_grad(b: Builder, op: Operation) -> Tensor:
    """Each window's gradient goes to its first maximum, as the reference does."""
    x, dy = (b._wrap(v) for v in op.inputs)
    windows, view, padded, padding = _pool_windows(b, x, Attrs(op.attrs), dy.shape[2:], -math.inf)
    n, c, ho, wo, kh, kw = view["shape"]
    first_max = b.argmax(windows.reshape([n, c, ho, wo, kh * kw]), axis=-1)
    routed = b.one_hot(first_max, kh * kw, dy.dtype) * b.expand_dims(dy, -1)
    grad = b.op("StridedScatterAdd", [routed.reshape(view["shape"])], None, {**view, "target_shape": padded})
    return _unpadded(b, grad, padding, x.shape)


def avg_pool_grad(b: Builder, op: Operation) -> Tensor:
    dy = b._wrap(op.inputs[0])
    x_shape = op.outputs[0].shape
    kernel, strides, padding = pool_params(Attrs(op.attrs))
    n, c, h, w = x_shape
    padded = [n, c, h + 2 * padding[0], w + 2 * padding[1]]
    view = _window_view(padded, kernel, strides, dy.shape[2:], channels_last=False)
    share = (dy * (1.0 / (kernel[0] * kernel[1]))).reshape([*dy.shape, 1, 1])
    grad = b.op("StridedScatterAdd", [b.broadcast_to(share, view["shape"])], None, {**view, "target_shape": padded})
    return _unpadded(b, grad, padding, x_shape)


def split_reduction(b: Builder, op: Operation) -> Tensor | None:
    """A reduction over axes that are not adjacent, as one reduction per adjacent block
    (kept as size-1 dimensions), then a reshape: sums of sums, maxima of maxima, and
    means of equal-sized means are the whole reduction."""
    x = b._wrap(op.inputs[0])
    attrs = Attrs(op.attrs)
    given = attrs.ints("axis")
    if given is None:
        return None
    axes = sorted({a % x.rank for a in given})
    blocks = []
    for axis in axes:
        if blocks and blocks[-1][-1] == axis - 1:
            blocks[-1].append(axis)
        else:
            blocks.append([axis])
    if len(blocks) < 2:
        return None
    reduce = {"Sum": b.sum, "Mean": b.mean, "Max": b.max, "Min": b.min, "Product": b.product, "All": b.all, "Any": b.any}[op.type]
    for block in reversed(blocks):
        x = reduce(x, axis=block, keepdims=True)
    return x.reshape(op.outputs[0].shape)


def _attention_parts(b: Builder, op: Operation):
    """Grouped views of q, k, v and the probabilities softmax(scale·q kᵀ + causal mask)."""
    from ..ops.attention import scale_of

    q, k, v = (b._wrap(x) for x in op.inputs[:3])
    batch, heads, queries, size = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    attrs = Attrs(op.attrs)
    q5 = q.reshape([batch, kv_heads, groups, queries, size])
    k5, v5 = (t.reshape([batch, kv_heads, 1, keys, size]) for t in (k, v))
    scale = scale_of(attrs, size)
    scores = b.matmul(q5, k5, transpose_b=True) * scale
    if attrs.bool("causal", True):
        scores = scores + _causal_mask(b, queries, keys, q.dtype)
    return q5, k5, v5, b.softmax(scores), scale


def _causal_mask(b: Builder, queries: int, keys: int, dtype: str) -> Tensor:
    """The additive causal mask, one constant per function and shape: the backward's
    recomputed probabilities are then the forward's op for op, and CSE keeps one."""
    name = f"causal_mask_{queries}x{keys}_{dtype}"
    existing = b.flow.vars.get(f"{b.func.name}/{name}")
    if existing is not None:
        return b._wrap(existing)
    hidden = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
    return b.array(name, np.where(hidden, -np.inf, 0.0).astype(np.float32 if dtype == "float32" else np.float64))


def attention(b: Builder, op: Operation) -> Tensor:
    _, _, v5, p, _ = _attention_parts(b, op)
    return (p @ v5).reshape(op.outputs[0].shape)


def attention_grad(b: Builder, op: Operation) -> list[Tensor]:
    q5, k5, v5, p, scale = _attention_parts(b, op)
    dout = b._wrap(op.inputs[3]).reshape(q5.shape)
    dp = b.matmul(dout, v5, transpose_b=True)
    ds = p * (dp - b.sum(p * dp, axis=-1, keepdims=True))
    dq = (b.matmul(ds, k5) * scale).reshape(op.outputs[0].shape)
    dk = b.sum(b.matmul(ds, q5, transpose_a=True) * scale, axis=2).reshape(op.outputs[1].shape)
    dv = b.sum(b.matmul(p, dout, transpose_a=True), axis=2).reshape(op.outputs[2].shape)
    return [dq, dk, dv]


def gelu(b: Builder, op: Operation) -> Tensor | None:
    """In a training step, x·Φ(x) from the primitives the gradient builds Φ from, so
    the erf (or tanh) is computed once for both passes. Inference keeps the native
    kernel, whose negative tail keeps its relative accuracy (1 + erf cancels there)."""
    if not b.func.training:
        return None
    x = b._wrap(op.inputs[0])
    gate, _ = gelu_gate(b, x, Attrs(op.attrs).str("approximate", "none"))
    return x * gate


def softmax_over_axis(b: Builder, op: Operation) -> Tensor | None:
    """A softmax over any axis but the last runs as the row kernel between two transposes."""
    x = b._wrap(op.inputs[0])
    axis = Attrs(op.attrs).int("axis", -1) % x.rank
    if axis == x.rank - 1:
        return None
    perm = [d for d in range(x.rank) if d != axis] + [axis]
    inverse = [perm.index(d) for d in range(x.rank)]
    rows = b.transpose(x, perm)
    normalized = b.softmax(rows) if op.type == "Softmax" else b.log_softmax(rows)
    return b.transpose(normalized, inverse)


RULES: dict[str, Callable[[Builder, Operation], Tensor | list[Tensor] | None]] = {
    "Gelu": gelu,
    "Softmax": softmax_over_axis,
    "LogSoftmax": softmax_over_axis,
    "Conv2D": conv2d,
    "Conv2DBackpropFilter": conv2d_filter_grad,
    "Conv2DBackpropInput": conv2d_input_grad,
    "MaxPool": max_pool,
    "AvgPool": avg_pool,
    "MaxPoolGrad": max_pool_grad,
    "AvgPoolGrad": avg_pool_grad,
    **{kind: split_reduction for kind in ("Sum", "Mean", "Max", "Min", "Product", "All", "Any")},
    "Attention": attention,
    "AttentionGrad": attention_grad,
}


def decompose(flow: Flow, func: Function, keep: Callable[[Operation], bool] = lambda op: False) -> None:
    """Replace each op of `func` that has a decomposition rule by primitives, except the
    ops `keep` picks: those the backend runs faster as one kernel."""
    for op in list(func.ops):
        rule = RULES.get(op.type)
        if rule is None or keep(op):
            continue
        b = Builder(flow, func)
        result = rule(b, op)
        if result is None:
            continue
        results = result if isinstance(result, list) else [result]
        originals = list(op.outputs)
        flow.remove_op(op)
        # The last new op of each result writes the original variable, so names seen outside stay.
        for original, new in zip(originals, results):
            last = new.var.producer
            last.outputs[last.outputs.index(new.var)] = original
            original.producer = last
            flow.remove_var(new.var)
