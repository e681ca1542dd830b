"""Composite neural-network ops that backends may fuse or lower whole.

Softmax, LogSoftmax, LayerNorm, RMSNorm, SoftmaxCrossEntropy, Conv2D, MaxPool and
AvgPool. Their references compute in float64 so they are an oracle for any kernel.
Convolution and pooling decompose into the window primitives (padding, a strided view
of the windows, a GEMM or a reduction) where a backend has no kernel for them whole.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .. import dtypes
from ..errors import RanvierError
from .registry import Attr, TensorType, decomposition, define, op_def
from .rules import FLOATS, INDEX, PRECISION, normalize_axis, same_dtype
from .window import padded, padded_shape, window_view


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def softmax(x, axis=-1):
    x = _f64(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    x = _f64(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


AXIS = Attr("axis", "int", -1, "the axis normalized over")
EPS = Attr("eps", "float", 1e-5, "added to the variance")
LABEL_SMOOTHING = Attr("label_smoothing", "float", 0.0, "the share of each target spread evenly over the classes")


def _infer_softmax(ctx):
    dtype = same_dtype(ctx, FLOATS, "a floating-point input")
    x = ctx.inputs[0]
    if x.rank == 0:
        raise ctx.fail("an input of rank >= 1")
    normalize_axis(ctx, ctx.attrs["axis"], x.rank)
    return [TensorType(dtype, x.shape)]


def _row_flops(op) -> int:
    """About five operations per element: a maximum, a subtraction, an exp, a sum, a scale."""
    return 5 * op.inputs[0].size


def _softmax_vjp(ctx, g):
    y = ctx.outputs[0]
    gy = g[0] * y
    return [gy - y * gy.sum(axis=ctx.attrs["axis"], keepdims=True)]


def _log_softmax_vjp(ctx, g):
    y = ctx.outputs[0]
    return [g[0] - y.exp() * g[0].sum(axis=ctx.attrs["axis"], keepdims=True)]


define(
    "Softmax", _infer_softmax, lambda a, args, o: [softmax(args[0], a["axis"])], 1, "nn", "softmax over attribute axis",
    attrs=[AXIS], vjp=_softmax_vjp, flops=_row_flops, method="softmax",
)
define(
    "LogSoftmax", _infer_softmax, lambda a, args, o: [log_softmax(args[0], a["axis"])], 1, "nn",
    "log of the softmax over attribute axis",
    attrs=[AXIS], vjp=_log_softmax_vjp, flops=_row_flops, method="log_softmax",
)


def _softmax_over_axis(b, op):
    """A softmax over any axis but the last: the last-axis softmax between two transposes."""
    x = b.wrap(op.inputs[0])
    axis = op_def(op.type).attrs_of(op)["axis"] % x.rank
    if axis == x.rank - 1:
        return None
    perm = [d for d in range(x.rank) if d != axis] + [axis]
    inverse = [perm.index(d) for d in range(x.rank)]
    rows = x.transpose(perm)
    normalized = rows.softmax() if op.type == "Softmax" else rows.log_softmax()
    return normalized.transpose(inverse)


decomposition("Softmax")(_softmax_over_axis)
decomposition("LogSoftmax")(_softmax_over_axis)


def _infer_norm(ctx):
    """LayerNorm(x[, gamma[, beta]]) and RMSNorm(x[, gamma]) normalize over the last axis."""
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x = ctx.inputs[0]
    if x.rank == 0:
        raise ctx.fail("an input of rank >= 1")
    for affine in ctx.inputs[1:]:
        if tuple(affine.shape) != (x.shape[-1],):
            raise ctx.fail(f"scale/shift vectors of shape [{x.shape[-1]}] (the last dimension of x)")
    eps = ctx.attrs["eps"]
    if not eps >= 0.0:
        raise ctx.fail(f"attribute eps >= 0 (got {eps})")
    return [TensorType(dtype, x.shape)]


def layer_norm(x, gamma=None, beta=None, eps=EPS.default):
    x = _f64(x)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if gamma is not None:
        y = y * _f64(gamma)
    if beta is not None:
        y = y + _f64(beta)
    return y


def rms_norm(x, gamma=None, eps=EPS.default):
    x = _f64(x)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y if gamma is None else y * _f64(gamma)


def _leading_sum(t):
    """Sum over every axis but the last (the gradient of a per-feature scale or shift)."""
    return t.sum(axis=list(range(t.rank - 1))) if t.rank > 1 else t


def _layer_norm_vjp(ctx, g):
    x = ctx.inputs[0]
    centered = x - x.mean(axis=-1, keepdims=True)
    rstd = ((centered * centered).mean(axis=-1, keepdims=True) + ctx.attrs["eps"]).rsqrt()
    xhat = centered * rstd
    dxhat = g[0] * ctx.inputs[1] if len(ctx.inputs) > 1 else g[0]
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    grads = [dx]
    if len(ctx.inputs) > 1:
        grads.append(_leading_sum(g[0] * xhat))
    if len(ctx.inputs) > 2:
        grads.append(_leading_sum(g[0]))
    return grads


def _rms_norm_vjp(ctx, g):
    """One fused op (RMSNormGrad: a row pass, as the forward's); a gain's gradient sums
    its second output over the rows."""
    x, *gain = ctx.inputs
    made = ctx.b.op("RMSNormGrad", [x, g[0], *gain], None, {"eps": ctx.attrs["eps"]})
    if not gain:
        return [made]
    dx, scaled = made
    return [dx, _leading_sum(scaled)]


def _build_layer_norm(b, x, gamma=None, beta=None, eps=None, name=None):
    if beta is not None and gamma is None:
        raise RanvierError("layer_norm: a shift (beta) needs a scale (gamma)")
    args = [x] + [t for t in (gamma, beta) if t is not None]
    return b.op("LayerNorm", args, name, {"eps": eps})


def _build_rms_norm(b, x, gamma=None, eps=None, name=None):
    return b.op("RMSNorm", [x] + ([gamma] if gamma is not None else []), name, {"eps": eps})


define(
    "LayerNorm", _infer_norm, lambda a, args, o: [layer_norm(*args, eps=a["eps"])], (1, 3), "nn",
    "LayerNorm(x[, gamma[, beta]]) over the last axis",
    attrs=[EPS], vjp=_layer_norm_vjp, flops=_row_flops, method="layer_norm", build=_build_layer_norm,
)
define(
    "RMSNorm", _infer_norm, lambda a, args, o: [rms_norm(*args, eps=a["eps"])], (1, 2), "nn",
    "RMSNorm(x[, gamma]) over the last axis",
    attrs=[EPS], vjp=_rms_norm_vjp, flops=_row_flops, method="rms_norm", build=_build_rms_norm,
)


def _infer_cross_entropy(ctx):
    logits, target = ctx.inputs
    if logits.dtype not in FLOATS or logits.rank < 1:
        raise ctx.fail("floating-point logits [..., classes]")
    if target.dtype in INDEX:
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ctx.fail(f"integer targets of shape {list(logits.shape[:-1])} (the logits without the class axis)")
    elif target.dtype == logits.dtype:
        if tuple(target.shape) != tuple(logits.shape):
            raise ctx.fail(f"probability targets of the logits' shape {list(logits.shape)}")
    else:
        raise ctx.fail("int32/int64 class targets or probability targets of the logits' dtype")
    smoothing = ctx.attrs["label_smoothing"]
    if not 0.0 <= smoothing < 1.0:
        raise ctx.fail(f"label_smoothing in [0, 1) (got {smoothing})")
    return [TensorType(loss_dtype(logits.dtype), logits.shape[:-1])]


def loss_dtype(logits_dtype: str) -> str:
    """A per-example loss is float32 for half-precision logits, as autocast computes it: a
    loss near 10 rounded to bfloat16 moves in steps of 0.06, and a logged loss with it."""
    return dtypes.DT_FLOAT32 if logits_dtype in (dtypes.DT_BFLOAT16, dtypes.DT_FLOAT16) else logits_dtype


def target_distribution(target, classes: int, smoothing: float) -> np.ndarray:
    """Integer or one-hot targets as (smoothed) probabilities over the classes."""
    if np.issubdtype(target.dtype, np.integer):
        if target.size and (target.min() < 0 or target.max() >= classes):
            # A class outside the logits would silently give a loss of zero.
            bad = target[(target < 0) | (target >= classes)].reshape(-1)[0]
            raise IndexError(f"target class {int(bad)} is outside [0, {classes})")
        probs = (target[..., None] == np.arange(classes)).astype(np.float64)
    else:
        probs = _f64(target)
    if smoothing:
        probs = probs * (1.0 - smoothing) + smoothing / classes
    return probs


def softmax_cross_entropy(logits, target, label_smoothing=LABEL_SMOOTHING.default):
    probs = target_distribution(target, logits.shape[-1], label_smoothing)
    return -(probs * log_softmax(logits)).sum(axis=-1)


def _cross_entropy_vjp(ctx, g):
    """d logits = g · (softmax(logits) · Σ target − target): the analytic form, with no log
    (fp16-safe), in one fused op. Class targets (one-hot, smoothed or not) sum to 1;
    probability targets are taken as given, so a target row that does not sum to 1
    still gets its exact gradient."""
    logits, target = ctx.inputs
    smoothing = ctx.attrs["label_smoothing"]
    dlogits = ctx.b.op("SoftmaxCrossEntropyGrad", [logits, target, g[0]], None, {"label_smoothing": smoothing})
    if target.dtype in INDEX:
        return [dlogits, None]
    return [dlogits, -(g[0].expand_dims(-1) * logits.log_softmax()) * (1.0 - smoothing)]


define(
    "SoftmaxCrossEntropy",
    _infer_cross_entropy,
    lambda a, args, o: [softmax_cross_entropy(*args, a["label_smoothing"])],
    2,
    "nn",
    "per-example loss of SoftmaxCrossEntropy(logits, targets): integer classes or probability targets",
    attrs=[LABEL_SMOOTHING],
    vjp=_cross_entropy_vjp,
    flops=_row_flops,
    method="softmax_cross_entropy",
)


# ---- convolution and pooling -------------------------------------------------------------------------

STRIDES = Attr("strides", "pair", [1, 1], "window step (rows, columns)")
PADDING = Attr("padding", "pair", [0, 0], "zeros around each image (rows, columns)")
KSIZE = Attr("ksize", "pair", [2, 2], "window size (rows, columns)")
POOL_STRIDES = Attr("strides", "pair", None, "window step (rows, columns; default ksize)")


def window_params(ctx, kernel):
    strides = ctx.attrs["strides"] or kernel
    padding = ctx.attrs["padding"]
    if len(strides) != 2 or len(padding) != 2 or min(strides) < 1 or min(padding) < 0:
        raise ctx.fail("attributes strides (>= 1) and padding (>= 0) with one or two entries")
    return strides, padding


def out_size(ctx, size, k, stride, pad):
    out = (size + 2 * pad - k) // stride + 1
    if out < 1:
        raise ctx.fail(f"a window of {k} to fit in {size} + 2*{pad} padding")
    return out


def _infer_conv(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x, w = ctx.inputs
    if x.rank != 4 or w.rank != 4 or x.shape[1] != w.shape[1]:
        raise ctx.fail("x [N, C, H, W] and weights [O, C, KH, KW] with matching C")
    strides, padding = window_params(ctx, None)
    ho = out_size(ctx, x.shape[2], w.shape[2], strides[0], padding[0])
    wo = out_size(ctx, x.shape[3], w.shape[3], strides[1], padding[1])
    return [TensorType(dtype, (x.shape[0], w.shape[0], ho, wo))]


def windows(x, kernel, strides, padding, fill=0.0):
    """[N, C, Ho, Wo, KH, KW] view of the padded input's sliding windows."""
    (ph, pw), (sh, sw) = padding, strides
    padded_x = np.pad(_f64(x), ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    return sliding_window_view(padded_x, tuple(kernel), axis=(2, 3))[:, :, ::sh, ::sw]


def conv2d(x, w, strides=STRIDES.default, padding=PADDING.default):
    patches = windows(x, w.shape[2:], strides, padding)
    return np.einsum("nchwij,ocij->nohw", patches, _f64(w), optimize=True)


def conv_flops(positions, filters) -> int:
    """One multiply-add per (output position, filter tap) of the forward convolution."""
    return 2 * positions.size * math.prod(filters.shape[1:])


def _conv_vjp(ctx, g):
    x, w = ctx.inputs
    attrs = {"strides": ctx.attrs["strides"], "padding": ctx.attrs["padding"]}
    dx = ctx.b.op("Conv2DBackpropInput", [g[0], w], None, {**attrs, "input_shape": x.shape})
    dw = ctx.b.op("Conv2DBackpropFilter", [x, g[0]], None, {**attrs, "filter_shape": w.shape})
    return [dx, dw]


define(
    "Conv2D",
    _infer_conv,
    lambda a, args, o: [conv2d(*args, a["strides"], a["padding"])],
    2,
    "nn",
    "Conv2D(x NCHW, w OIHW)",
    attrs=[STRIDES, PADDING, PRECISION],
    vjp=_conv_vjp,
    flops=lambda op: conv_flops(op.outputs[0], op.inputs[1]),
    method="conv2d",
)


def im2col(b, x, filter_shape, attrs, out_hw):
    """x's windows as GEMM rows [N·Ho·Wo, C·KH·KW], and the view reading them."""
    n = x.shape[0]
    padding = attrs["padding"]
    view = window_view(padded_shape(x.shape, padding), filter_shape[2:], attrs["strides"], out_hw, channels_last=True)
    taps = math.prod(filter_shape[1:])
    return padded(b, x, padding).strided_view(**view).reshape([n * out_hw[0] * out_hw[1], taps]), view


@decomposition("Conv2D")
def _conv_as_gemm(b, op):
    """y[n] = W [O, C·KH·KW] · windows[n] [C·KH·KW, Ho·Wo]: the product is NCHW as it
    comes out, and the windows' rows run along the image (long contiguous copies)."""
    x, w = (b.wrap(v) for v in op.inputs)
    n, o, ho, wo = op.outputs[0].shape
    attrs = op_def("Conv2D").attrs_of(op)
    padding, taps = attrs["padding"], math.prod(w.shape[1:])
    (c, kh, kw), (sh, sw) = w.shape[1:], attrs["strides"]
    _, _, hp, wp = padded_shape(x.shape, padding)
    windows = padded(b, x, padding).strided_view(
        shape=[n, c, kh, kw, ho, wo], strides=[c * hp * wp, hp * wp, wp, 1, sh * wp, sw],
    )
    return w.reshape([o, taps]).matmul(windows.reshape([n, taps, ho * wo])).reshape([n, o, ho, wo])


def _infer_pool(ctx):
    dtype = same_dtype(ctx, FLOATS, "a floating-point input")
    (x,) = ctx.inputs
    kernel = ctx.attrs["ksize"]
    if x.rank != 4 or len(kernel) != 2 or min(kernel) < 1:
        raise ctx.fail("x [N, C, H, W] and attribute ksize with one or two positive entries")
    strides, padding = window_params(ctx, kernel)
    if padding[0] * 2 > kernel[0] or padding[1] * 2 > kernel[1]:
        raise ctx.fail("padding at most half the window")
    ho = out_size(ctx, x.shape[2], kernel[0], strides[0], padding[0])
    wo = out_size(ctx, x.shape[3], kernel[1], strides[1], padding[1])
    return [TensorType(dtype, (x.shape[0], x.shape[1], ho, wo))]


def pool_params(attrs):
    """(ksize, strides, padding) of a pooling op; strides default to the window size."""
    kernel = attrs["ksize"]
    return kernel, attrs["strides"] or kernel, attrs["padding"]


def max_pool(x, kernel, strides, padding):
    return windows(x, kernel, strides, padding, fill=-np.inf).max(axis=(-2, -1))


def avg_pool(x, kernel, strides, padding):
    """Average over the window, padding counted as zeros (PyTorch's count_include_pad=True)."""
    return windows(x, kernel, strides, padding).mean(axis=(-2, -1))


def pool_attrs(attrs) -> dict:
    kernel, strides, padding = pool_params(attrs)
    return {"ksize": kernel, "strides": strides, "padding": padding}


define(
    "MaxPool", _infer_pool, lambda a, args, o: [max_pool(args[0], *pool_params(a))], 1, "nn",
    "the maximum of each window",
    attrs=[KSIZE, POOL_STRIDES, PADDING],
    vjp=lambda ctx, g: [ctx.b.op("MaxPoolGrad", [ctx.inputs[0], g[0]], None, pool_attrs(ctx.attrs))],
    flops=lambda op: op.outputs[0].size * math.prod(op_def("MaxPool").attrs_of(op)["ksize"]),
    method="max_pool",
)
define(
    "AvgPool", _infer_pool, lambda a, args, o: [avg_pool(args[0], *pool_params(a))], 1, "nn",
    "the mean of each window, padding counted as zeros",
    attrs=[KSIZE, POOL_STRIDES, PADDING],
    vjp=lambda ctx, g: [ctx.b.op("AvgPoolGrad", [g[0]], None, {**pool_attrs(ctx.attrs), "input_shape": ctx.inputs[0].shape})],
    flops=lambda op: op.outputs[0].size * math.prod(op_def("AvgPool").attrs_of(op)["ksize"]),
    method="avg_pool",
)


def pool_windows(b, x, attrs, out_hw, fill: float):
    """The [N, C, Ho, Wo, KH, KW] windows of a pooling op's input, the view reading them,
    the padded shape and the padding."""
    kernel, strides, padding = pool_params(attrs)
    shape = padded_shape(x.shape, padding)
    view = window_view(shape, kernel, strides, out_hw, channels_last=False)
    return padded(b, x, padding, fill).strided_view(**view), view, shape, padding


@decomposition("MaxPool")
def _max_pool_as_reduction(b, op):
    windows_, *_ = pool_windows(b, b.wrap(op.inputs[0]), op_def("MaxPool").attrs_of(op), op.outputs[0].shape[2:], -math.inf)
    return windows_.max(axis=[4, 5])


@decomposition("AvgPool")
def _avg_pool_as_reduction(b, op):
    windows_, *_ = pool_windows(b, b.wrap(op.inputs[0]), op_def("AvgPool").attrs_of(op), op.outputs[0].shape[2:], 0.0)
    return windows_.mean(axis=[4, 5])
