"""ONNX's normalizations: LayerNormalization (with its mean and inverse standard
deviation outputs), RMSNormalization, InstanceNormalization, GroupNormalization,
BatchNormalization (inference and training mode), LpNormalization, LRN and
MeanVarianceNormalization.

Each normalizes rows: the axes it normalizes over flattened into the last one, where
ranvier's LayerNorm and RMSNorm ops compute (their kernels fuse the statistics with the
scaling); the per-channel scale and bias of the instance and group forms follow as
broadcast products. Statistics are computed in float32 at least (ONNX's stash_type 1):
a narrower input is widened first and its results narrowed back.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from ..flow.builder import Tensor
from . import training
from .node import Node, converts

STATISTICS_DTYPE = dtypes.DT_FLOAT32  # ONNX's stash_type 1, the only one ONNX Runtime implements


def _stash(node: Node, x: Tensor) -> Tensor:
    """x in the dtype its statistics are computed in."""
    stash_type = int(node.attr("stash_type", 1))
    if stash_type != 1:
        raise node.error(f"stash_type {stash_type} (statistics in other than float32) is not supported")
    if x.dtype not in dtypes.FLOAT_DTYPES:
        raise node.error(f"its input is {x.dtype}; it normalizes floating-point tensors")
    return x if dtypes.itemsize(x.dtype) >= 4 else x.cast(STATISTICS_DTYPE)


def _rows(x: Tensor, axis: int) -> Tensor:
    """x [..before axis, ..from axis] as [..before axis, product of the rest]."""
    return x.reshape([*x.shape[:axis], math.prod(x.shape[axis:])])


def _per_element(node: Node, index: int, what: str, normalized: list[int], dtype: str) -> Tensor:
    """A scale or bias over the normalized axes (as numpy broadcasts it there), flattened
    to one value per element of a row."""
    value = node.tensor(index)
    offset = len(normalized) - value.rank
    if offset < 0 or any(d not in (1, normalized[offset + i]) for i, d in enumerate(value.shape)):
        raise node.error(f"its {what} of shape {value.shape} does not broadcast to the normalized axes {normalized}")
    whole = value if value.shape == normalized else node.b.broadcast_to(value, normalized)
    whole = whole.reshape([math.prod(normalized)])
    return whole if whole.dtype == dtype else whole.cast(dtype)


@converts("LayerNormalization")
def layer_norm(node: Node):
    x = node.tensor(0)
    axis = node.axis(node.attr("axis", -1), x.rank)
    eps = float(node.attr("epsilon", 1e-5))
    rows = _rows(_stash(node, x), axis)
    normalized = x.shape[axis:]
    gamma = _per_element(node, 1, "scale", normalized, rows.dtype)
    beta = _per_element(node, 2, "bias", normalized, rows.dtype) if node.optional(2) is not None else None
    statistics = [i for i, name in enumerate(node.proto.output) if name and i > 0]
    if not statistics:
        y = node.b.layer_norm(rows, gamma, beta, eps=eps)
        return y.reshape(x.shape).cast(x.dtype) if y.dtype != x.dtype else y.reshape(x.shape)
    # Mean and InvStdDev asked for: the statistics spelled out, as ONNX defines them.
    mean = node.b.mean(rows, axis=[rows.rank - 1], keepdims=True)
    centred = rows - mean
    inv_std = node.b.rsqrt(node.b.mean(centred * centred, axis=[rows.rank - 1], keepdims=True) + eps)
    y = centred * inv_std * gamma
    if beta is not None:
        y = y + beta
    reduced = [*x.shape[:axis], *[1] * (x.rank - axis)]
    return [_narrowed(t.reshape(shape), x.dtype) for t, shape in ((y, x.shape), (mean, reduced), (inv_std, reduced))]


def _narrowed(t: Tensor, dtype: str) -> Tensor:
    return t if t.dtype == dtype else t.cast(dtype)


@converts("RMSNormalization")
def rms_norm(node: Node):
    x = node.tensor(0)
    axis = node.axis(node.attr("axis", -1), x.rank)
    rows = _rows(_stash(node, x), axis)
    gamma = _per_element(node, 1, "scale", x.shape[axis:], rows.dtype)
    y = node.b.rms_norm(rows, gamma, eps=float(node.attr("epsilon", 1e-5)))
    return _narrowed(y.reshape(x.shape), x.dtype)


def _channel_affine(node: Node, y: Tensor, channels: int, what: str) -> Tensor:
    """y [N, C, ...] scaled and shifted per channel by inputs 1 and 2 (each [C])."""
    shape = [1, channels, *[1] * (y.rank - 2)]
    for index, name in ((1, "scale"), (2, "bias")):
        value = node.tensor(index)
        if value.shape != [channels]:
            raise node.error(f"its {name} of shape {value.shape} is not one value per {what}, [{channels}]")
        value = _narrowed(value, y.dtype).reshape(shape)
        y = y * value if index == 1 else y + value
    return y


@converts("InstanceNormalization")
def instance_norm(node: Node):
    """Each channel of each item normalized over its spatial axes."""
    x = node.tensor(0)
    if x.rank < 3:
        raise node.error(f"its input of shape {x.shape} is not [N, C, ...spatial]")
    rows = _rows(_stash(node, x), 2)
    y = node.b.layer_norm(rows, eps=float(node.attr("epsilon", 1e-5))).reshape(x.shape)
    return _narrowed(_channel_affine(node, y, x.shape[1], "channel"), x.dtype)


@converts("GroupNormalization")
def group_norm(node: Node):
    """The channels in num_groups groups, each group of each item normalized over its
    channels and spatial axes; then a scale and bias per channel (opset 21) or per group
    (opset 18, which the group's channels share)."""
    x = node.tensor(0)
    groups = int(node.attr("num_groups"))
    if x.rank < 2 or groups < 1 or x.shape[1] % groups:
        raise node.error(f"num_groups {groups} does not divide the channels of its input of shape {x.shape} "
                         "([N, C, ...spatial])")
    n, channels = x.shape[:2]
    stashed = _stash(node, x)
    y = node.b.layer_norm(stashed.reshape([n, groups, math.prod(x.shape[1:]) // groups]),
                          eps=float(node.attr("epsilon", 1e-5)))
    if node.opset >= 21:
        return _narrowed(_channel_affine(node, y.reshape(x.shape), channels, "channel"), x.dtype)
    y = _channel_affine(node, y.reshape([n, groups, channels // groups, math.prod(x.shape[2:])]), groups, "group")
    return _narrowed(y.reshape(x.shape), x.dtype)


@converts("LpNormalization")
def lp_norm(node: Node):
    """x divided by its L1 or L2 norm along the axis (a zero norm gives zeros, as ONNX
    Runtime gives)."""
    x = node.tensor(0)
    axis = node.axis(node.attr("axis", -1), x.rank)
    p = int(node.attr("p", 2))
    if p not in (1, 2):
        raise node.error(f"p={p}: ONNX defines the L1 and L2 norms (p 1 or 2)")
    norm = node.b.sum(abs(x), axis=[axis], keepdims=True) if p == 1 else \
        node.b.sum(x * x, axis=[axis], keepdims=True).sqrt()
    zero = node.b.const(0.0, x.dtype)
    return node.b.cond(node.b.equal(norm, zero), node.b.broadcast_to(zero, x.shape), x / norm)


@converts("LRN")
def local_response_norm(node: Node):
    """x divided by (bias + alpha/size · the sum of squares of the `size` channels around
    each) ** beta: the squares padded along the channels and summed `size` slices."""
    x = node.tensor(0)
    size = int(node.attr("size"))
    if x.rank < 3 or size < 1:
        raise node.error(f"size {size} over its input of shape {x.shape}: needs size >= 1 and [N, C, ...spatial]")
    alpha, beta, bias = float(node.attr("alpha", 1e-4)), float(node.attr("beta", 0.75)), float(node.attr("bias", 1.0))
    channels = x.shape[1]
    squares = node.b.pad(x * x, before=[0, (size - 1) // 2, *[0] * (x.rank - 2)],
                         after=[0, size // 2, *[0] * (x.rank - 2)], value=0.0)
    window = [node.b.slice(squares, [0, k, *[0] * (x.rank - 2)], [x.shape[0], channels, *x.shape[2:]])
              for k in range(size)]
    total = window[0]
    for part in window[1:]:
        total = total + part
    return x / (total * (alpha / size) + bias) ** beta


@converts("MeanVarianceNormalization")
def mean_variance_norm(node: Node):
    """(x − mean) / sqrt(variance + 1e-9) over the axes (ONNX's function body's epsilon)."""
    x = node.tensor(0)
    axes = sorted({node.axis(a, x.rank) for a in node.attr("axes", [0, 2, 3])})
    mean = node.b.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    return centred / (node.b.mean(centred * centred, axis=axes, keepdims=True) + 1e-9).sqrt()


@converts("BatchNormalization")
def batch_norm(node: Node):
    """Batch norm per channel (axis 1). Inference with its statistics known at load is one
    scale and shift per channel (the compiler fuses them into the elementwise work
    around; PyTorch's exporters fold it into the convolution); computed statistics are
    applied as they come. training_mode (opset 14) normalizes by the batch's own mean and
    (biased) variance, and returns the running statistics moved toward them by momentum.
    A trainable import computes as training does, its running statistics updated in the
    step (`training.batch_norm`)."""
    if node.importer.training:
        return training.batch_norm(node)
    x = node.tensor(0)
    if x.rank < 2 or x.dtype not in dtypes.FLOAT_DTYPES:
        raise node.error(f"its input {x.dtype}{x.shape} is not a floating-point [N, C, ...]")
    eps = float(node.attr("epsilon", 1e-5))
    momentum = float(node.attr("momentum", 0.9))
    training_mode = bool(node.attr("training_mode", 0)) if node.opset >= 14 else False
    if node.opset < 14 and any(node.proto.output[1:]):
        raise node.error(f"its running statistics outputs (training, opset {node.opset} < 14) are not supported")
    channels = x.shape[1]
    shape = [1, channels, *[1] * (x.rank - 2)]
    for index, what in ((1, "scale"), (2, "bias"), (3, "input_mean"), (4, "input_var")):
        if node.shape(index) != [channels]:
            raise node.error(f"its {what} of shape {node.shape(index)} is not one value per channel, [{channels}]")
    if not training_mode:
        known = all(isinstance(node.inputs[i], np.ndarray) for i in range(1, 5))
        if known:
            scale, shift = batch_norm_affine(node)
            return x * node.importer.as_tensor(scale.reshape(shape), "") + node.importer.as_tensor(shift.reshape(shape), "")
        gamma, beta, mean, var = (node.tensor(i).reshape(shape) for i in range(1, 5))
        return (x - mean) * node.b.rsqrt(var + eps) * gamma + beta
    axes = [0, *range(2, x.rank)]
    mean = node.b.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    var = node.b.mean(centred * centred, axis=axes, keepdims=True)
    y = centred * node.b.rsqrt(var + eps) * node.tensor(1).reshape(shape) + node.tensor(2).reshape(shape)
    running_mean = node.tensor(3) * momentum + mean.reshape([channels]) * (1.0 - momentum)
    running_var = node.tensor(4) * momentum + var.reshape([channels]) * (1.0 - momentum)
    return [y, running_mean, running_var]


def batch_norm_affine(node: Node) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) per channel of an inference batch norm whose statistics are known."""
    gamma, beta = node.constant(1, "scale"), node.constant(2, "bias")
    mean, var = node.constant(3, "running mean"), node.constant(4, "running variance")
    scale = gamma / np.sqrt(var.astype(np.float64) + float(node.attr("epsilon", 1e-5)))
    return scale.astype(gamma.dtype), (beta - mean * scale).astype(gamma.dtype)
