"""The VJP rules of the op vocabulary. Each builds its input gradients as ordinary ops.

`ctx.inputs` / `ctx.outputs` are the forward op's tensors, `g` the gradients of its
outputs (None where nothing flows back), `ctx.b` the builder receiving backward ops.
"""

from __future__ import annotations

import math

import numpy as np

from .autodiff import vjp
from .ops.elementwise import gelu_gate
from .ops.nn import pool_params


def _bool(ctx, name):
    return ctx.attrs.bool(name)


# ---- elementwise unary ------------------------------------------------------------------

@vjp("Neg")
def _neg(ctx, g):
    return [-g[0]]


@vjp("Identity")
def _identity(ctx, g):
    return [g[0]]


@vjp("Abs")
def _abs(ctx, g):
    return [g[0] * ctx.b.sign(ctx.inputs[0])]


@vjp("Square")
def _square(ctx, g):
    (x,) = ctx.inputs
    return [g[0] * (x * 2.0)]


@vjp("Relu")
def _relu(ctx, g):
    (x,) = ctx.inputs
    return [ctx.b.select(x > 0.0, g[0])]


@vjp("Exp")
def _exp(ctx, g):
    return [g[0] * ctx.outputs[0]]


@vjp("Log")
def _log(ctx, g):
    return [g[0] / ctx.inputs[0]]


@vjp("Sqrt")
def _sqrt(ctx, g):
    return [g[0] * 0.5 / ctx.outputs[0]]


@vjp("Rsqrt")
def _rsqrt(ctx, g):
    y = ctx.outputs[0]
    return [g[0] * (y * y * y) * -0.5]


@vjp("Reciprocal")
def _reciprocal(ctx, g):
    y = ctx.outputs[0]
    return [-(g[0] * (y * y))]


@vjp("Sin")
def _sin(ctx, g):
    return [g[0] * ctx.b.cos(ctx.inputs[0])]


@vjp("Cos")
def _cos(ctx, g):
    return [-(g[0] * ctx.b.sin(ctx.inputs[0]))]


@vjp("Tanh")
def _tanh(ctx, g):
    y = ctx.outputs[0]
    return [g[0] * (1.0 - y * y)]


@vjp("Sigmoid")
def _sigmoid(ctx, g):
    y = ctx.outputs[0]
    return [g[0] * (y * (1.0 - y))]


@vjp("Erf")
def _erf(ctx, g):
    (x,) = ctx.inputs
    return [g[0] * (ctx.b.exp(-(x * x)) * (2.0 / math.sqrt(math.pi)))]


@vjp("Silu")
def _silu(ctx, g):
    (x,) = ctx.inputs
    s = ctx.b.sigmoid(x)
    return [g[0] * (s * (1.0 + x * (1.0 - s)))]


@vjp("Gelu")
def _gelu(ctx, g):
    (x,) = ctx.inputs
    b = ctx.b
    gate, t = gelu_gate(b, x, ctx.attrs.str("approximate", "none"))
    if t is not None:
        dinner = (1.0 + x * x * (3 * 0.044715)) * math.sqrt(2.0 / math.pi)
        return [g[0] * (gate + x * 0.5 * (1.0 - t * t) * dinner)]
    pdf = b.exp(x * x * -0.5) * (1.0 / math.sqrt(2.0 * math.pi))
    return [g[0] * (gate + x * pdf)]


def _zero_gradient(ctx, g):
    """Piecewise-constant ops: the gradient is zero almost everywhere."""
    return [None] * len(ctx.inputs)


for _type in ("Sign", "Floor", "Ceil", "Round", "Not", "Equal", "NotEqual", "Less", "LessEqual",
              "Greater", "GreaterEqual", "And", "Or", "Xor", "ArgMax", "ArgMin", "OneHot", "All", "Any"):
    vjp(_type)(_zero_gradient)


@vjp("Cast")
def _cast(ctx, g):
    (x,) = ctx.inputs
    return [ctx.b.cast(g[0], x.dtype)]


# ---- elementwise binary -------------------------------------------------------------------

@vjp("Add")
def _add(ctx, g):
    a, c = ctx.inputs
    return [ctx.unbroadcast(g[0], a), ctx.unbroadcast(g[0], c)]


@vjp("Sub")
def _sub(ctx, g):
    a, c = ctx.inputs
    return [ctx.unbroadcast(g[0], a), ctx.unbroadcast(-g[0], c)]


@vjp("Mul")
def _mul(ctx, g):
    a, c = ctx.inputs
    return [ctx.unbroadcast(g[0] * c, a), ctx.unbroadcast(g[0] * a, c)]


@vjp("Div")
def _div(ctx, g):
    a, c = ctx.inputs
    y = ctx.outputs[0]
    ga = g[0] / c
    return [ctx.unbroadcast(ga, a), ctx.unbroadcast(-(ga * y), c)]


@vjp("Pow")
def _pow(ctx, g):
    a, c = ctx.inputs
    y = ctx.outputs[0]
    b = ctx.b
    ga = g[0] * c * b.pow(a, c - 1.0)
    gc = g[0] * y * b.log(a)
    return [ctx.unbroadcast(ga, a), ctx.unbroadcast(gc, c)]


def _min_max(ctx, g, first_wins):
    a, c = ctx.inputs
    b = ctx.b
    take_a = first_wins(a, c)
    return [ctx.unbroadcast(b.select(take_a, g[0]), a), ctx.unbroadcast(b.select(~take_a, g[0]), c)]


@vjp("Maximum")
def _maximum(ctx, g):
    return _min_max(ctx, g, lambda a, c: a >= c)


@vjp("Minimum")
def _minimum(ctx, g):
    return _min_max(ctx, g, lambda a, c: a <= c)


@vjp("Cond")
def _cond(ctx, g):
    c, x, y = ctx.inputs
    b = ctx.b
    return [None, ctx.unbroadcast(b.select(c, g[0]), x), ctx.unbroadcast(b.select(~c, g[0]), y)]


@vjp("Select")
def _select(ctx, g):
    c, x = ctx.inputs
    return [None, ctx.unbroadcast(ctx.b.select(c, g[0]), x)]


# ---- reductions ---------------------------------------------------------------------------------

def _reduced_axes(ctx):
    x = ctx.inputs[0]
    axes = ctx.attrs.ints("axis")
    return list(range(x.rank)) if axes is None else sorted(a % x.rank for a in axes)


def _expand_back(ctx, t):
    """A reduced tensor reshaped with the reduced axes kept as size 1, broadcast to the input."""
    x = ctx.inputs[0]
    kept = [1 if i in _reduced_axes(ctx) else d for i, d in enumerate(x.shape)]
    b = ctx.b
    t = b.reshape(t, kept) if t.shape != kept else t
    return b.broadcast_to(t, x.shape) if kept != x.shape else t


@vjp("Sum")
def _sum(ctx, g):
    return [_expand_back(ctx, g[0])]


@vjp("Mean")
def _mean(ctx, g):
    x = ctx.inputs[0]
    count = int(np.prod([x.shape[a] for a in _reduced_axes(ctx)]))
    return [_expand_back(ctx, g[0] * (1.0 / count))]


def _extreme(ctx, g):
    """The gradient is shared equally by the elements equal to the extreme (as torch.amax)."""
    x = ctx.inputs[0]
    b = ctx.b
    hit = b.cast(b.equal(x, _expand_back(ctx, ctx.outputs[0])), x.dtype)
    count = b.sum(hit, axis=_reduced_axes(ctx), keepdims=True)
    return [hit * _expand_back(ctx, g[0]) / count]


vjp("Max")(_extreme)
vjp("Min")(_extreme)


@vjp("Product")
def _product(ctx, g):
    x = ctx.inputs[0]
    return [_expand_back(ctx, g[0] * ctx.outputs[0]) / x]


# ---- matmul ---------------------------------------------------------------------------------------

@vjp("MatMul")
def _matmul(ctx, g):
    a, c = ctx.inputs
    dy = g[0]
    b = ctx.b
    ta, tb = _bool(ctx, "transpose_a"), _bool(ctx, "transpose_b")
    if a.rank > 2 and c.rank == 2 and not ta:
        # A shared matrix under a batch of rows (x[B, T, K] @ W): its gradient is one
        # GEMM over all B·T rows, not B products summed afterwards.
        rows_a, rows_dy = a.reshape([-1, a.shape[-1]]), dy.reshape([-1, dy.shape[-1]])
        da = b.matmul(dy, c, transpose_b=not tb)
        dc = b.matmul(rows_dy, rows_a, transpose_a=True) if tb else b.matmul(rows_a, rows_dy, transpose_a=True)
        return [da, dc]
    if not ta and not tb:
        da, dc = b.matmul(dy, c, transpose_b=True), b.matmul(a, dy, transpose_a=True)
    elif not ta and tb:
        da, dc = b.matmul(dy, c), b.matmul(dy, a, transpose_a=True)
    elif ta and not tb:
        da, dc = b.matmul(c, dy, transpose_b=True), b.matmul(a, dy)
    else:
        da, dc = b.matmul(c, dy, transpose_a=True, transpose_b=True), b.matmul(dy, a, transpose_a=True, transpose_b=True)
    return [ctx.unbroadcast(da, a), ctx.unbroadcast(dc, c)]


# ---- shapes ------------------------------------------------------------------------------------------

@vjp("Reshape")
def _reshape(ctx, g):
    return [ctx.b.reshape(g[0], ctx.inputs[0].shape), None]


vjp("ExpandDims")(lambda ctx, g: [ctx.b.reshape(g[0], ctx.inputs[0].shape)])
vjp("Squeeze")(lambda ctx, g: [ctx.b.reshape(g[0], ctx.inputs[0].shape)])
vjp("BroadcastTo")(lambda ctx, g: [ctx.unbroadcast(g[0], ctx.inputs[0])])


@vjp("Transpose")
def _transpose(ctx, g):
    x = ctx.inputs[0]
    perm = ctx.attrs.ints("perm") or list(reversed(range(x.rank)))
    inverse = list(np.argsort(perm))
    return [ctx.b.transpose(g[0], inverse)]


@vjp("Concat")
def _concat(ctx, g):
    parts = ctx.inputs[:-1]
    axis = int(np.asarray(ctx.inputs[-1].var.data).reshape(-1)[0]) % parts[0].rank
    sizes = [p.shape[axis] for p in parts]
    pieces = ctx.b.split(g[0], sizes, axis=axis)
    return [*pieces, None]


def _zeros(b, shape, dtype):
    zero = b.const(0.0, dtype)
    return b.broadcast_to(zero, shape) if shape else b.identity(zero)


@vjp("Split")
def _split(ctx, g):
    x, _, axis_var = ctx.inputs
    axis = int(np.asarray(axis_var.var.data).reshape(-1)[0]) % x.rank
    b = ctx.b
    pieces = [gi if gi is not None else _zeros(b, out.shape, out.dtype) for gi, out in zip(g, ctx.outputs)]
    return [b.concat(pieces, axis=axis) if len(pieces) > 1 else pieces[0], None, None]


@vjp("Slice")
def _slice(ctx, g):
    """Pad the gradient with zeros back to the input's shape, one axis at a time."""
    x = ctx.inputs[0]
    b = ctx.b
    begin = ctx.attrs.ints("begin")
    grad = g[0]
    for axis, (start, full) in enumerate(zip(begin, x.shape)):
        size = grad.shape[axis]
        if size == full:
            continue
        pieces = []
        if start > 0:
            pieces.append(_zeros(b, [*grad.shape[:axis], start, *grad.shape[axis + 1:]], grad.dtype))
        pieces.append(grad)
        rest = full - start - size
        if rest > 0:
            pieces.append(_zeros(b, [*grad.shape[:axis], rest, *grad.shape[axis + 1:]], grad.dtype))
        grad = b.concat(pieces, axis=axis)
    return [grad]


# ---- indexing ------------------------------------------------------------------------------------------

@vjp("Gather")
def _gather(ctx, g):
    params, indices = ctx.inputs
    return [ctx.b.scatter_add(indices, g[0], rows=params.shape[0]), None]


@vjp("ScatterAdd")
def _scatter_add(ctx, g):
    indices, _ = ctx.inputs
    return [None, ctx.b.gather(g[0], indices)]


# ---- nn composites ------------------------------------------------------------------------------------------

@vjp("Softmax")
def _softmax(ctx, g):
    y = ctx.outputs[0]
    axis = ctx.attrs.int("axis", -1)
    gy = g[0] * y
    return [gy - y * ctx.b.sum(gy, axis=axis, keepdims=True)]


@vjp("LogSoftmax")
def _log_softmax(ctx, g):
    y = ctx.outputs[0]
    axis = ctx.attrs.int("axis", -1)
    b = ctx.b
    return [g[0] - b.exp(y) * b.sum(g[0], axis=axis, keepdims=True)]


def _leading_sum(b, t):
    """Sum over every axis but the last (the gradient of a per-feature scale or shift)."""
    return b.sum(t, axis=list(range(t.rank - 1))) if t.rank > 1 else t


@vjp("LayerNorm")
def _layer_norm(ctx, g):
    b = ctx.b
    x = ctx.inputs[0]
    eps = ctx.attrs.float("eps", 1e-5)
    centered = x - b.mean(x, axis=-1, keepdims=True)
    rstd = b.rsqrt(b.mean(centered * centered, axis=-1, keepdims=True) + eps)
    xhat = centered * rstd
    dxhat = g[0] * ctx.inputs[1] if len(ctx.inputs) > 1 else g[0]
    dx = rstd * (dxhat - b.mean(dxhat, axis=-1, keepdims=True) - xhat * b.mean(dxhat * xhat, axis=-1, keepdims=True))
    grads = [dx]
    if len(ctx.inputs) > 1:
        grads.append(_leading_sum(b, g[0] * xhat))
    if len(ctx.inputs) > 2:
        grads.append(_leading_sum(b, g[0]))
    return grads


@vjp("RMSNorm")
def _rms_norm(ctx, g):
    b = ctx.b
    x = ctx.inputs[0]
    eps = ctx.attrs.float("eps", 1e-5)
    rstd = b.rsqrt(b.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    dxhat = g[0] * ctx.inputs[1] if len(ctx.inputs) > 1 else g[0]
    dx = rstd * (dxhat - xhat * b.mean(dxhat * xhat, axis=-1, keepdims=True))
    return [dx, _leading_sum(b, g[0] * xhat)] if len(ctx.inputs) > 1 else [dx]


@vjp("SoftmaxCrossEntropy")
def _cross_entropy(ctx, g):
    """d logits = g · (softmax(logits) · Σ target − target): the analytic form, with no log
    (fp16-safe). Class targets (one-hot, smoothed or not) sum to 1; probability targets
    are taken as given, so a target row that does not sum to 1 still gets its exact
    gradient."""
    b = ctx.b
    logits, target = ctx.inputs
    smoothing = ctx.attrs.float("label_smoothing", 0.0)
    dlogits = b.op("SoftmaxCrossEntropyGrad", [logits, target, g[0]], None, {"label_smoothing": smoothing or None})
    if target.dtype in ("int32", "int64"):
        return [dlogits, None]
    return [dlogits, -(b.expand_dims(g[0], -1) * b.log_softmax(logits)) * (1.0 - smoothing)]


@vjp("Conv2D")
def _conv2d(ctx, g):
    x, w = ctx.inputs
    attrs = {"strides": ctx.attrs.ints("strides", [1, 1]), "padding": ctx.attrs.ints("padding", [0, 0])}
    dx = ctx.b.op("Conv2DBackpropInput", [g[0], w], None, {**attrs, "input_shape": x.shape})
    dw = ctx.b.op("Conv2DBackpropFilter", [x, g[0]], None, {**attrs, "filter_shape": w.shape})
    return [dx, dw]


def _pool_attrs(ctx):
    kernel, strides, padding = pool_params(ctx.attrs)
    return {"ksize": kernel, "strides": strides, "padding": padding}


@vjp("MaxPool")
def _max_pool(ctx, g):
    return [ctx.b.op("MaxPoolGrad", [ctx.inputs[0], g[0]], None, _pool_attrs(ctx))]


@vjp("AvgPool")
def _avg_pool(ctx, g):
    return [ctx.b.op("AvgPoolGrad", [g[0]], None, {**_pool_attrs(ctx), "input_shape": ctx.inputs[0].shape})]


# ---- window primitives ------------------------------------------------------------------------------------

def _view_attrs(ctx):
    return {"offset": ctx.attrs.int("offset", 0), "shape": ctx.attrs.ints("shape"), "strides": ctx.attrs.ints("strides")}


@vjp("Pad")
def _pad(ctx, g):
    x = ctx.inputs[0]
    return [ctx.b.slice(g[0], ctx.attrs.ints("before"), x.shape)]


@vjp("StridedView")
def _strided_view(ctx, g):
    x = ctx.inputs[0]
    return [ctx.b.op("StridedScatterAdd", [g[0]], None, {**_view_attrs(ctx), "target_shape": x.shape})]


@vjp("StridedScatterAdd")
def _strided_scatter_add(ctx, g):
    return [ctx.b.op("StridedView", [g[0]], None, _view_attrs(ctx))]


@vjp("Attention")
def _attention(ctx, g):
    dq, dk, dv = ctx.b.op("AttentionGrad", [*ctx.inputs, g[0]], None, dict(ctx.op.attrs))
    return [dq, dk, dv]
