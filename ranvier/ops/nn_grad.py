"""Backward ops of the windowed nn ops (the VJPs of Conv2D, MaxPool and AvgPool use them)."""

from __future__ import annotations

import numpy as np

from .nn import _f64, _out_size, _pair, _window_params, pool_params, softmax, target_distribution, windows
from .registry import TensorType, define, op_def
from .rules import FLOATS, same_dtype


def _shape_attr(ctx, name):
    shape = ctx.attrs.ints(name)
    if shape is None or len(shape) != 4 or min(shape) < 1:
        raise ctx.fail(f"attribute {name} with four positive dimensions")
    return shape


def _infer_conv_input_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    dy, w = ctx.inputs
    shape = _shape_attr(ctx, "input_shape")
    if dy.rank != 4 or w.rank != 4 or dy.shape[1] != w.shape[0] or shape[1] != w.shape[1]:
        raise ctx.fail("dy [N, O, Ho, Wo] and weights [O, C, KH, KW] matching attribute input_shape [N, C, H, W]")
    _check_dy(ctx, dy, shape, w.shape[2:], _window_params(ctx, None), "Conv2D")
    return [TensorType(dtype, shape)]


def _check_dy(ctx, dy, input_shape, kernel, params, forward):
    """dy must have the shape the forward op gives for this input, window and attributes."""
    strides, padding = params
    expected = [
        input_shape[0],
        dy.shape[1],
        _out_size(ctx, input_shape[2], kernel[0], strides[0], padding[0]),
        _out_size(ctx, input_shape[3], kernel[1], strides[1], padding[1]),
    ]
    if list(dy.shape) != expected:
        raise ctx.fail(
            f"dy of shape [{'x'.join(map(str, expected))}] (the {forward} output for an input "
            f"[{'x'.join(map(str, input_shape))}], window {list(kernel)}, strides {strides}, padding {padding})"
        )


def conv2d_input_grad(dy, w, input_shape, strides, padding):
    """dx of y = conv2d(x, w): every output gradient spread back over its input window."""
    contrib = np.einsum("nohw,ocij->nchwij", _f64(dy), _f64(w), optimize=True)
    return _scatter_windows(contrib, input_shape, w.shape[2:], strides, padding)


define(
    "Conv2DBackpropInput",
    _infer_conv_input_grad,
    lambda a, args, o: [conv2d_input_grad(*args, o[0].shape, _pair(a, "strides", [1, 1]), _pair(a, "padding", [0, 0]))],
    2,
    "nn",
    "dx of Conv2D: (dy, w); attributes input_shape, strides, padding",
)


def _infer_conv_filter_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x, dy = ctx.inputs
    shape = _shape_attr(ctx, "filter_shape")
    if x.rank != 4 or dy.rank != 4 or x.shape[0] != dy.shape[0] or shape[0] != dy.shape[1] or shape[1] != x.shape[1]:
        raise ctx.fail("x [N, C, H, W] and dy [N, O, Ho, Wo] matching attribute filter_shape [O, C, KH, KW]")
    _check_dy(ctx, dy, x.shape, shape[2:], _window_params(ctx, None), "Conv2D")
    return [TensorType(dtype, shape)]


def conv2d_filter_grad(x, dy, filter_shape, strides, padding):
    patches = windows(x, filter_shape[2:], strides, padding)
    return np.einsum("nchwij,nohw->ocij", patches, _f64(dy), optimize=True)


define(
    "Conv2DBackpropFilter",
    _infer_conv_filter_grad,
    lambda a, args, o: [conv2d_filter_grad(*args, o[0].shape, _pair(a, "strides", [1, 1]), _pair(a, "padding", [0, 0]))],
    2,
    "nn",
    "dw of Conv2D: (x, dy); attributes filter_shape, strides, padding",
)


def _infer_pool_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    if ctx.op_type == "MaxPoolGrad":
        x, dy = ctx.inputs
        shape = list(x.shape)
    else:
        (dy,) = ctx.inputs
        shape = _shape_attr(ctx, "input_shape")
    if dy.rank != 4 or len(shape) != 4 or list(dy.shape[:2]) != list(shape[:2]):
        raise ctx.fail("dy [N, C, Ho, Wo] with the input's N and C")
    kernel = _pair(ctx.attrs, "ksize", [2, 2])
    if len(kernel) != 2 or min(kernel) < 1:
        raise ctx.fail("attribute ksize with one or two positive entries")
    _check_dy(ctx, dy, shape, kernel, _window_params(ctx, kernel), ctx.op_type[: -len("Grad")])
    return [TensorType(dtype, shape)]


def _scatter_windows(dy_windows, input_shape, kernel, strides, padding):
    """Add a [N, C, Ho, Wo, KH, KW] array back onto the (padded) input it was windowed from."""
    (sh, sw), (ph, pw) = strides, padding
    n, c, h, w = input_shape
    _, _, ho, wo, kh, kw = dy_windows.shape
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw))
    for i in range(kh):
        for j in range(kw):
            padded[:, :, i : i + sh * ho : sh, j : j + sw * wo : sw] += dy_windows[..., i, j]
    return padded[:, :, ph : ph + h, pw : pw + w]


def max_pool_grad(x, dy, kernel, strides, padding):
    """Each window's gradient goes to its first maximum (PyTorch's choice on ties)."""
    win = windows(x, kernel, strides, padding, fill=-np.inf)
    flat = win.reshape(*win.shape[:4], -1)
    mask = np.zeros_like(flat)
    np.put_along_axis(mask, flat.argmax(axis=-1)[..., None], 1.0, axis=-1)
    contrib = mask.reshape(win.shape) * _f64(dy)[..., None, None]
    return _scatter_windows(contrib, x.shape, kernel, strides, padding)


def avg_pool_grad(dy, input_shape, kernel, strides, padding):
    contrib = np.broadcast_to(_f64(dy)[..., None, None] / (kernel[0] * kernel[1]), (*dy.shape, *kernel))
    return _scatter_windows(contrib, input_shape, kernel, strides, padding)


define(
    "MaxPoolGrad",
    _infer_pool_grad,
    lambda a, args, o: [max_pool_grad(*args, *pool_params(a))],
    2,
    "nn",
    "dx of MaxPool: (x, dy); the pooling attributes",
)
define(
    "AvgPoolGrad",
    _infer_pool_grad,
    lambda a, args, o: [avg_pool_grad(args[0], o[0].shape, *pool_params(a))],
    1,
    "nn",
    "dx of AvgPool: (dy); attribute input_shape and the pooling attributes",
)


def _infer_cross_entropy_grad(ctx):
    logits, target, dloss = ctx.inputs
    (loss_type,) = op_def("SoftmaxCrossEntropy").infer_types(ctx.op_name, [logits, target], ctx.attrs.raw)
    if dloss.dtype != loss_type.dtype or tuple(dloss.shape) != loss_type.shape:
        raise ctx.fail(f"a loss gradient of the per-example loss's type {loss_type.dtype}{list(loss_type.shape)}")
    return [TensorType(logits.dtype, logits.shape)]


def cross_entropy_grad(logits, target, dloss, label_smoothing=0.0):
    """d logits = dloss · (softmax(logits) · Σ target − target), target smoothed."""
    probs = target_distribution(target, logits.shape[-1], label_smoothing)
    return _f64(dloss)[..., None] * (softmax(logits) * probs.sum(axis=-1, keepdims=True) - probs)


define(
    "SoftmaxCrossEntropyGrad",
    _infer_cross_entropy_grad,
    lambda a, args, o: [cross_entropy_grad(*args, a.float("label_smoothing", 0.0))],
    3,
    "nn",
    "d logits of SoftmaxCrossEntropy: (logits, targets, d loss) in one fused step; attribute label_smoothing",
)
