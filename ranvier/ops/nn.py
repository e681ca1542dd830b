"""Composite neural-network ops that backends may fuse or lower whole.

Softmax, LogSoftmax, LayerNorm, RMSNorm, SoftmaxCrossEntropy, Conv2D, MaxPool and
AvgPool. Their references compute in float64 so they are an oracle for any kernel.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .registry import TensorType, define
from .rules import FLOATS, INDEX, normalize_axis, same_dtype


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


def _infer_softmax(ctx):
    dtype = same_dtype(ctx, FLOATS, "a floating-point input")
    x = ctx.inputs[0]
    if x.rank == 0:
        raise ctx.fail("an input of rank >= 1")
    normalize_axis(ctx, ctx.attrs.int("axis", -1), x.rank)
    return [TensorType(dtype, x.shape)]


define("Softmax", _infer_softmax, lambda a, args, o: [softmax(args[0], a.int("axis", -1))], 1, "nn", "attribute axis (default -1)")
define("LogSoftmax", _infer_softmax, lambda a, args, o: [log_softmax(args[0], a.int("axis", -1))], 1, "nn")


def _infer_norm(ctx):
    """LayerNorm(x[, gamma[, beta]]) and RMSNorm(x[, gamma]) normalize over the last axis."""
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x = ctx.inputs[0]
    if x.rank == 0:
        raise ctx.fail("an input of rank >= 1")
    for affine in ctx.inputs[1:]:
        if tuple(affine.shape) != (x.shape[-1],):
            raise ctx.fail(f"scale/shift vectors of shape [{x.shape[-1]}] (the last dimension of x)")
    eps = ctx.attrs.float("eps", 1e-5)
    if not eps >= 0.0:
        raise ctx.fail(f"attribute eps >= 0 (got {eps})")
    return [TensorType(dtype, x.shape)]


def layer_norm(x, gamma=None, beta=None, eps=1e-5):
    x = _f64(x)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if gamma is not None:
        y = y * _f64(gamma)
    if beta is not None:
        y = y + _f64(beta)
    return y


def rms_norm(x, gamma=None, eps=1e-5):
    x = _f64(x)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y if gamma is None else y * _f64(gamma)


define(
    "LayerNorm",
    _infer_norm,
    lambda a, args, o: [layer_norm(*args, eps=a.float("eps", 1e-5))],
    (1, 3),
    "nn",
    "LayerNorm(x[, gamma[, beta]]) over the last axis; attribute eps (default 1e-5)",
)
define(
    "RMSNorm",
    _infer_norm,
    lambda a, args, o: [rms_norm(*args, eps=a.float("eps", 1e-5))],
    (1, 2),
    "nn",
    "RMSNorm(x[, gamma]) over the last axis; attribute eps (default 1e-5)",
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
    smoothing = ctx.attrs.float("label_smoothing", 0.0)
    if not 0.0 <= smoothing < 1.0:
        raise ctx.fail(f"label_smoothing in [0, 1) (got {smoothing})")
    return [TensorType(logits.dtype, logits.shape[:-1])]


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


def softmax_cross_entropy(logits, target, label_smoothing=0.0):
    probs = target_distribution(target, logits.shape[-1], label_smoothing)
    return -(probs * log_softmax(logits)).sum(axis=-1)


define(
    "SoftmaxCrossEntropy",
    _infer_cross_entropy,
    lambda a, args, o: [softmax_cross_entropy(*args, a.float("label_smoothing", 0.0))],
    2,
    "nn",
    "per-example loss of SoftmaxCrossEntropy(logits, targets); attribute label_smoothing",
)


def _pair(attrs, name, default):
    values = attrs.ints(name, default)
    if len(values) == 1:
        values = values * 2
    return values


def _window_params(ctx, kernel):
    strides = _pair(ctx.attrs, "strides", [1, 1] if kernel is None else kernel)
    padding = _pair(ctx.attrs, "padding", [0, 0])
    if len(strides) != 2 or len(padding) != 2 or min(strides) < 1 or min(padding) < 0:
        raise ctx.fail("attributes strides (>= 1) and padding (>= 0) with one or two entries")
    return strides, padding


def _out_size(ctx, size, k, stride, pad):
    out = (size + 2 * pad - k) // stride + 1
    if out < 1:
        raise ctx.fail(f"a window of {k} to fit in {size} + 2*{pad} padding")
    return out


def _infer_conv(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x, w = ctx.inputs
    if x.rank != 4 or w.rank != 4 or x.shape[1] != w.shape[1]:
        raise ctx.fail("x [N, C, H, W] and weights [O, C, KH, KW] with matching C")
    strides, padding = _window_params(ctx, None)
    ho = _out_size(ctx, x.shape[2], w.shape[2], strides[0], padding[0])
    wo = _out_size(ctx, x.shape[3], w.shape[3], strides[1], padding[1])
    return [TensorType(dtype, (x.shape[0], w.shape[0], ho, wo))]


def windows(x, kernel, strides, padding, fill=0.0):
    """[N, C, Ho, Wo, KH, KW] view of the padded input's sliding windows."""
    (ph, pw), (sh, sw) = padding, strides
    padded = np.pad(_f64(x), ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    return sliding_window_view(padded, tuple(kernel), axis=(2, 3))[:, :, ::sh, ::sw]


def conv2d(x, w, strides=(1, 1), padding=(0, 0)):
    patches = windows(x, w.shape[2:], strides, padding)
    return np.einsum("nchwij,ocij->nohw", patches, _f64(w), optimize=True)


define(
    "Conv2D",
    _infer_conv,
    lambda a, args, o: [conv2d(*args, _pair(a, "strides", [1, 1]), _pair(a, "padding", [0, 0]))],
    2,
    "nn",
    "Conv2D(x NCHW, w OIHW); attributes strides, padding",
)


def _infer_pool(ctx):
    dtype = same_dtype(ctx, FLOATS, "a floating-point input")
    (x,) = ctx.inputs
    kernel = _pair(ctx.attrs, "ksize", [2, 2])
    if x.rank != 4 or len(kernel) != 2 or min(kernel) < 1:
        raise ctx.fail("x [N, C, H, W] and attribute ksize with one or two positive entries")
    strides, padding = _window_params(ctx, kernel)
    if padding[0] * 2 > kernel[0] or padding[1] * 2 > kernel[1]:
        raise ctx.fail("padding at most half the window")
    ho = _out_size(ctx, x.shape[2], kernel[0], strides[0], padding[0])
    wo = _out_size(ctx, x.shape[3], kernel[1], strides[1], padding[1])
    return [TensorType(dtype, (x.shape[0], x.shape[1], ho, wo))]


def pool_params(attrs):
    kernel = _pair(attrs, "ksize", [2, 2])
    return kernel, _pair(attrs, "strides", kernel), _pair(attrs, "padding", [0, 0])


def max_pool(x, kernel, strides, padding):
    return windows(x, kernel, strides, padding, fill=-np.inf).max(axis=(-2, -1))


def avg_pool(x, kernel, strides, padding):
    """Average over the window, padding counted as zeros (PyTorch's count_include_pad=True)."""
    return windows(x, kernel, strides, padding).mean(axis=(-2, -1))


define("MaxPool", _infer_pool, lambda a, args, o: [max_pool(args[0], *pool_params(a))], 1, "nn", "attributes ksize, strides (default ksize), padding")
define("AvgPool", _infer_pool, lambda a, args, o: [avg_pool(args[0], *pool_params(a))], 1, "nn", "attributes ksize, strides (default ksize), padding")

