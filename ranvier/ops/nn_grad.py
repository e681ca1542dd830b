"""Backward ops of the nn composites (their VJPs build them): the input and filter
gradients of Conv2D, the input gradients of MaxPool and AvgPool, and the fused
gradients of SoftmaxCrossEntropy and RMSNorm. Each decomposes, like its forward op, into
window primitives, GEMMs or elementwise ops and reductions where a backend has no kernel
for it whole."""

from __future__ import annotations

import math

import numpy as np

from .nn import (
    EPS,
    KSIZE,
    LABEL_SMOOTHING,
    PADDING,
    POOL_STRIDES,
    STRIDES,
    _f64,
    conv_flops,
    im2col,
    out_size,
    pool_params,
    pool_windows,
    softmax,
    softmax_cross_entropy,
    target_distribution,
    window_params,
    windows,
)
from .registry import Attr, TensorType, decomposition, define, op_def
from .rules import FLOATS, same_dtype
from .window import padded_shape, unpadded, window_view


def _shape_attr(ctx, name):
    shape = ctx.attrs[name]
    if shape is None or len(shape) != 4 or min(shape) < 1:
        raise ctx.fail(f"attribute {name} with four positive dimensions")
    return shape


def _check_dy(ctx, dy, input_shape, kernel, params, forward):
    """dy must have the shape the forward op gives for this input, window and attributes."""
    strides, padding = params
    expected = [
        input_shape[0],
        dy.shape[1],
        out_size(ctx, input_shape[2], kernel[0], strides[0], padding[0]),
        out_size(ctx, input_shape[3], kernel[1], strides[1], padding[1]),
    ]
    if list(dy.shape) != expected:
        raise ctx.fail(
            f"dy of shape [{'x'.join(map(str, expected))}] (the {forward} output for an input "
            f"[{'x'.join(map(str, input_shape))}], window {list(kernel)}, strides {strides}, padding {padding})"
        )


def _scatter_windows(dy_windows, input_shape, kernel, strides, padding):
    """Add a [N, C, Ho, Wo, KH, KW] array back onto the (padded) input it was windowed from."""
    (sh, sw), (ph, pw) = strides, padding
    n, c, h, w = input_shape
    _, _, ho, wo, kh, kw = dy_windows.shape
    padded_x = np.zeros((n, c, h + 2 * ph, w + 2 * pw))
    for i in range(kh):
        for j in range(kw):
            padded_x[:, :, i : i + sh * ho : sh, j : j + sw * wo : sw] += dy_windows[..., i, j]
    return padded_x[:, :, ph : ph + h, pw : pw + w]


def _rows_of(dy):
    """dy [N, O, Ho, Wo] as GEMM rows [N·Ho·Wo, O]."""
    n, o, ho, wo = dy.shape
    return dy.transpose([0, 2, 3, 1]).reshape([n * ho * wo, o])


# ---- Conv2D's input gradient ---------------------------------------------------------------------------

def _infer_conv_input_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    dy, w = ctx.inputs
    shape = _shape_attr(ctx, "input_shape")
    if dy.rank != 4 or w.rank != 4 or dy.shape[1] != w.shape[0] or shape[1] != w.shape[1]:
        raise ctx.fail("dy [N, O, Ho, Wo] and weights [O, C, KH, KW] matching attribute input_shape [N, C, H, W]")
    _check_dy(ctx, dy, shape, w.shape[2:], window_params(ctx, None), "Conv2D")
    return [TensorType(dtype, shape)]


def conv2d_input_grad(dy, w, input_shape, strides, padding):
    """dx of y = conv2d(x, w): every output gradient spread back over its input window."""
    contrib = np.einsum("nohw,ocij->nchwij", _f64(dy), _f64(w), optimize=True)
    return _scatter_windows(contrib, input_shape, w.shape[2:], strides, padding)


define(
    "Conv2DBackpropInput",
    _infer_conv_input_grad,
    lambda a, args, o: [conv2d_input_grad(*args, o[0].shape, a["strides"], a["padding"])],
    2,
    "nn",
    "dx of Conv2D: (dy, w)",
    attrs=[Attr("input_shape", "ints", None, "x's shape [N, C, H, W]"), STRIDES, PADDING],
    flops=lambda op: conv_flops(op.inputs[0], op.inputs[1]),
)


@decomposition("Conv2DBackpropInput")
def _conv_input_grad_as_convolution(b, op):
    """With stride 1, dx is dy convolved with the filters turned around (each flipped in
    both spatial axes, input and output channels swapped), dy padded by each kernel's
    reach less the forward padding: a convolution the backend may run whole, where the
    form below writes every window's gradient and adds them back (StridedScatterAdd)."""
    attrs = op_def(op.type).attrs_of(op)
    o, c, kh, kw = op.inputs[1].shape
    (ph, pw) = attrs["padding"]
    if list(attrs["strides"]) != [1, 1] or ph > kh - 1 or pw > kw - 1:
        return None
    dy, w = (b.wrap(v) for v in op.inputs)
    turned = w.strided_view(offset=kh * kw - 1, shape=[c, o, kh, kw], strides=[kh * kw, c * kh * kw, -kw, -1])
    return b.conv2d(dy, turned, strides=[1, 1], padding=[kh - 1 - ph, kw - 1 - pw])


# The planes' form below needs each image's product wide enough to run at the GEMM's rate (a
# 7 × 7 image's 49 columns took twice the one product's time) and pays where windows overlap.
PLANE_PRODUCT_COLUMNS = 256


@decomposition("Conv2DBackpropInput")
def _conv_input_grad_by_planes(b, op):
    """The filters times each image's dy [O, Ho·Wo] give every tap's gradient over the
    image's windows, [C·KH·KW, Ho·Wo] (dy read as it lies, no transpose); the view's
    transpose (StridedScatterAdd) adds each back onto the padded input, a channel's taps
    one after another onto its plane, which stays in cache while they add up (where the
    rows form below adds each window's taps across all of an image's planes)."""
    dy, w = (b.wrap(v) for v in op.inputs)
    n, o, ho, wo = dy.shape
    _, c, kh, kw = w.shape
    if kh * kw == 1 or ho * wo < PLANE_PRODUCT_COLUMNS:
        return None
    attrs = op_def(op.type).attrs_of(op)
    x_shape, padding = op.outputs[0].shape, attrs["padding"]
    _, _, hp, wp = padded = padded_shape(x_shape, padding)
    sh, sw = attrs["strides"]
    view = {"shape": [n, c, kh, kw, ho, wo], "strides": [c * hp * wp, hp * wp, wp, 1, sh * wp, sw]}
    columns = w.reshape([o, c * kh * kw]).matmul(dy.reshape([n, o, ho * wo]), transpose_a=True).reshape(view["shape"])
    return unpadded(columns.strided_scatter_add(**view, target_shape=padded), padding, x_shape)


@decomposition("Conv2DBackpropInput")
def _conv_input_grad_as_gemm(b, op):
    """dy's rows times the filters give each window's gradient; the view's transpose
    (StridedScatterAdd) adds them back onto the padded input."""
    dy, w = (b.wrap(v) for v in op.inputs)
    attrs = op_def(op.type).attrs_of(op)
    x_shape, padding = op.outputs[0].shape, attrs["padding"]
    _n, o, ho, wo = dy.shape
    padded = padded_shape(x_shape, padding)
    view = window_view(padded, w.shape[2:], attrs["strides"], (ho, wo), channels_last=True)
    columns = _rows_of(dy).matmul(w.reshape([o, math.prod(w.shape[1:])])).reshape(view["shape"])
    return unpadded(columns.strided_scatter_add(**view, target_shape=padded), padding, x_shape)


# ---- Conv2D's filter gradient --------------------------------------------------------------------------

def _infer_conv_filter_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x, dy = ctx.inputs
    shape = _shape_attr(ctx, "filter_shape")
    if x.rank != 4 or dy.rank != 4 or x.shape[0] != dy.shape[0] or shape[0] != dy.shape[1] or shape[1] != x.shape[1]:
        raise ctx.fail("x [N, C, H, W] and dy [N, O, Ho, Wo] matching attribute filter_shape [O, C, KH, KW]")
    _check_dy(ctx, dy, x.shape, shape[2:], window_params(ctx, None), "Conv2D")
    return [TensorType(dtype, shape)]


def conv2d_filter_grad(x, dy, filter_shape, strides, padding):
    patches = windows(x, filter_shape[2:], strides, padding)
    return np.einsum("nchwij,nohw->ocij", patches, _f64(dy), optimize=True)


define(
    "Conv2DBackpropFilter",
    _infer_conv_filter_grad,
    lambda a, args, o: [conv2d_filter_grad(*args, o[0].shape, a["strides"], a["padding"])],
    2,
    "nn",
    "dw of Conv2D: (x, dy)",
    attrs=[Attr("filter_shape", "ints", None, "w's shape [O, C, KH, KW]"), STRIDES, PADDING],
    flops=lambda op: conv_flops(op.inputs[1], op.outputs[0]),
)


@decomposition("Conv2DBackpropFilter")
def _conv_filter_grad_as_gemm(b, op):
    x, dy = (b.wrap(v) for v in op.inputs)
    filters = op.outputs[0].shape
    cols, _ = im2col(b, x, filters, op_def(op.type).attrs_of(op), dy.shape[2:])
    return _rows_of(dy).matmul(cols, transpose_a=True).reshape(filters)


# ---- pooling gradients ---------------------------------------------------------------------------------

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
    kernel = ctx.attrs["ksize"]
    if len(kernel) != 2 or min(kernel) < 1:
        raise ctx.fail("attribute ksize with one or two positive entries")
    _check_dy(ctx, dy, shape, kernel, window_params(ctx, kernel), ctx.op_type[: -len("Grad")])
    return [TensorType(dtype, shape)]


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
    attrs=[KSIZE, POOL_STRIDES, PADDING],
    flops=lambda op: op.inputs[0].size,
)
define(
    "AvgPoolGrad",
    _infer_pool_grad,
    lambda a, args, o: [avg_pool_grad(args[0], o[0].shape, *pool_params(a))],
    1,
    "nn",
    "dx of AvgPool: (dy); the pooling attributes",
    attrs=[Attr("input_shape", "ints", None, "x's shape [N, C, H, W]"), KSIZE, POOL_STRIDES, PADDING],
    flops=lambda op: op.outputs[0].size,
)


@decomposition("MaxPoolGrad")
def _max_pool_grad_by_routing(b, op):
    """Each window's gradient goes to its first maximum, as the reference does."""
    x, dy = (b.wrap(v) for v in op.inputs)
    windows_, view, padded, padding = pool_windows(b, x, op_def(op.type).attrs_of(op), dy.shape[2:], -math.inf)
    n, c, ho, wo, kh, kw = view["shape"]
    first_max = windows_.reshape([n, c, ho, wo, kh * kw]).argmax(axis=-1)
    routed = first_max.one_hot(kh * kw, dy.dtype) * dy.expand_dims(-1)
    return unpadded(routed.reshape(view["shape"]).strided_scatter_add(**view, target_shape=padded), padding, x.shape)


@decomposition("AvgPoolGrad")
def _avg_pool_grad_by_spreading(b, op):
    dy = b.wrap(op.inputs[0])
    x_shape = op.outputs[0].shape
    kernel, strides, padding = pool_params(op_def(op.type).attrs_of(op))
    padded = padded_shape(x_shape, padding)
    view = window_view(padded, kernel, strides, dy.shape[2:], channels_last=False)
    share = (dy * (1.0 / (kernel[0] * kernel[1]))).reshape([*dy.shape, 1, 1])
    return unpadded(share.broadcast_to(view["shape"]).strided_scatter_add(**view, target_shape=padded), padding, x_shape)


# ---- SoftmaxCrossEntropy's gradient --------------------------------------------------------------------

def _infer_cross_entropy_grad(ctx):
    logits, target, dloss = ctx.inputs
    (loss_type,) = op_def("SoftmaxCrossEntropy").infer_types(ctx.op_name, [logits, target], ctx.attrs.raw)
    # the loss's dtype, or the logits' (an upstream gradient kept in half precision, read widened)
    if dloss.dtype not in (loss_type.dtype, logits.dtype) or tuple(dloss.shape) != loss_type.shape:
        raise ctx.fail(f"a loss gradient of the per-example loss's type {loss_type.dtype}{list(loss_type.shape)}")
    types = [TensorType(logits.dtype, logits.shape)]
    return [*types, loss_type] if ctx.attrs["with_loss"] else types


def cross_entropy_grad(logits, target, dloss, label_smoothing=LABEL_SMOOTHING.default):
    """d logits = d loss · (softmax(logits) · Σ target − target), target smoothed."""
    probs = target_distribution(target, logits.shape[-1], label_smoothing)
    return _f64(dloss)[..., None] * (softmax(logits) * probs.sum(axis=-1, keepdims=True) - probs)


def _cross_entropy_grad(attrs, args, outs):
    smoothing = attrs["label_smoothing"]
    grad = [cross_entropy_grad(*args, smoothing)]
    if attrs["with_loss"]:
        grad.append(softmax_cross_entropy(args[0], args[1], smoothing))
    return grad


define(
    "SoftmaxCrossEntropyGrad",
    _infer_cross_entropy_grad,
    _cross_entropy_grad,
    3,
    "nn",
    "d logits of SoftmaxCrossEntropy: (logits, targets, d loss) in one fused step; with attribute "
    "with_loss, also the per-example loss (one read of the logits for both)",
    attrs=[LABEL_SMOOTHING, Attr("with_loss", "bool", False, "a second output: the per-example loss")],
    flops=lambda op: 5 * op.inputs[0].size,
)


# ---- RMSNorm's gradient ----------------------------------------------------------------------------


def _infer_rms_norm_grad(ctx):
    """(x, dy[, gamma]): dx, and with a gain dy·x̂ too (the rows its gradient sums). dy and
    gamma may be of another float dtype than x (a half-precision gradient meeting a
    float32 residual stream): they are read widened, and both outputs take x's dtype (a
    gain's gradient summed from float32 terms, as autocast's is)."""
    x, dy, *gain = ctx.inputs
    if any(v.dtype not in FLOATS for v in ctx.inputs):
        raise ctx.fail("floating-point inputs")
    if x.rank == 0 or tuple(dy.shape) != tuple(x.shape):
        raise ctx.fail("x of rank >= 1 and a gradient dy of x's shape")
    if gain and tuple(gain[0].shape) != (x.shape[-1],):
        raise ctx.fail(f"a gain of shape [{x.shape[-1]}] (the last dimension of x)")
    if not ctx.attrs["eps"] >= 0.0:
        raise ctx.fail(f"attribute eps >= 0 (got {ctx.attrs['eps']})")
    return [TensorType(x.dtype, x.shape)] * (2 if gain else 1)


def rms_norm_grad(x, dy, gamma=None, eps=EPS.default) -> list[np.ndarray]:
    """dx of RMSNorm = rstd · (dx̂ − x̂ · mean(dx̂ · x̂)) with dx̂ = dy · gamma, x̂ = x · rstd;
    with gamma, also dy · x̂."""
    x, dy = _f64(x), _f64(dy)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    dxhat = dy if gamma is None else dy * _f64(gamma)
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return [dx] if gamma is None else [dx, dy * xhat]


define(
    "RMSNormGrad",
    _infer_rms_norm_grad,
    lambda attrs, args, outs: rms_norm_grad(*args, eps=attrs["eps"]),
    (2, 3),
    "nn",
    "d x of RMSNorm (x, d y[, gamma]) in one fused step over each row; with gamma also d y · x̂, whose "
    "sum over rows is gamma's gradient",
    attrs=[EPS],
    flops=lambda op: 8 * op.inputs[0].size,
)


@decomposition("RMSNormGrad")
def _rms_norm_grad_by_ops(b, op):
    """The gradient's formula as elementwise ops and row means."""
    x, *rest = (b.wrap(v) for v in op.inputs)
    dy, *gain = (t if t.dtype == x.dtype else t.cast(x.dtype) for t in rest)
    rstd = ((x * x).mean(axis=-1, keepdims=True) + op_def(op.type).attrs_of(op)["eps"]).rsqrt()
    xhat = x * rstd
    dxhat = dy * gain[0] if gain else dy
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return [dx, dy * xhat] if gain else dx
