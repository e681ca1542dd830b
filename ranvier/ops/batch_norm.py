"""Batch norm in training mode as two ops, the forward and its gradient.

    BatchNormTrain(x, gamma, beta)              y, mean, var: each channel (axis 1 of
                                                [N, C, ...]) normalised by the batch's own
                                                mean and biased variance over every other
                                                axis, then scaled and shifted
    BatchNormTrainGrad(x, dy, gamma, mean, var) dx, dgamma, dbeta

Written as elementwise ops and reductions, the gradient takes about twenty passes over
the activations (each product stored to be summed apart, the per-channel terms broadcast
to full size and read back); as one op a kernel takes two (the channel's sums of dy and
dy·x̂, then dx), and the forward two (the statistics, then y). Each decomposes into those
elementwise ops and reductions where a backend has no kernel for it.
"""

from __future__ import annotations

import numpy as np

from .nn import EPS, _f64
from .registry import TensorType, decomposition, define, op_def
from .rules import FLOATS, same_dtype


def _axes(rank: int) -> list[int]:
    """Every axis but the channels'."""
    return [0, *range(2, rank)]


def _per_channel(rank: int, channels: int) -> list[int]:
    """The shape a channel's value broadcasts from, [1, C, 1, ...]."""
    return [1, channels] + [1] * (rank - 2)


def _check(ctx, x, *per_channel) -> None:
    if x.rank < 2:
        raise ctx.fail(f"x [N, C, ...] of rank 2 or more (got rank {x.rank})")
    for v in per_channel:
        if tuple(v.shape) != (x.shape[1],):
            raise ctx.fail(f"per-channel inputs of shape [{x.shape[1]}] (x's axis 1), not {list(v.shape)}")
    if not ctx.attrs["eps"] >= 0.0:
        raise ctx.fail(f"attribute eps >= 0 (got {ctx.attrs['eps']})")


def _infer(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x, gamma, beta = ctx.inputs
    _check(ctx, x, gamma, beta)
    return [TensorType(dtype, x.shape), TensorType(dtype, gamma.shape), TensorType(dtype, gamma.shape)]


def batch_norm_train(x, gamma, beta, eps: float = EPS.default) -> list[np.ndarray]:
    x = _f64(x)
    axes, shape = tuple(_axes(x.ndim)), _per_channel(x.ndim, x.shape[1])
    mean = x.mean(axis=axes)
    centred = x - mean.reshape(shape)
    var = (centred * centred).mean(axis=axes)
    y = centred / np.sqrt(var.reshape(shape) + eps) * _f64(gamma).reshape(shape) + _f64(beta).reshape(shape)
    return [y, mean, var]


def _vjp(ctx, g):
    """The gradient op for y's gradient; gradients of the statistics themselves (none where
    they only move the running averages) add their terms elementwise."""
    x, gamma, _ = ctx.inputs
    _, mean, var = ctx.outputs
    dy, dmean, dvar = g
    b, shape, count = ctx.b, _per_channel(x.rank, x.shape[1]), x.size // x.shape[1]
    dx = dgamma = dbeta = None
    if dy is not None:
        dx, dgamma, dbeta = b.op("BatchNormTrainGrad", [x, dy, gamma, mean, var], None, {"eps": ctx.attrs["eps"]})
    if dmean is not None:
        term = (dmean * (1.0 / count)).reshape(shape).broadcast_to(x.shape)
        dx = term if dx is None else dx + term
    if dvar is not None:
        term = (x - mean.reshape(shape)) * (dvar * (2.0 / count)).reshape(shape)
        dx = term if dx is None else dx + term
    return [dx, dgamma, dbeta]


define(
    "BatchNormTrain", _infer, lambda a, args, o: batch_norm_train(*args, eps=a["eps"]), 3, "nn",
    "BatchNormTrain(x, gamma, beta): y, and the batch's mean and biased variance per channel (axis 1)",
    attrs=[EPS], vjp=_vjp, flops=lambda op: 7 * op.inputs[0].size,
)


@decomposition("BatchNormTrain")
def _batch_norm_by_ops(b, op):
    x, gamma, beta = (b.wrap(v) for v in op.inputs)
    axes, shape = _axes(x.rank), _per_channel(x.rank, x.shape[1])
    mean = x.mean(axis=axes, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=axes, keepdims=True)
    y = centred * (var + op_def(op.type).attrs_of(op)["eps"]).rsqrt() * gamma.reshape(shape) + beta.reshape(shape)
    return [y, mean.reshape(gamma.shape), var.reshape(gamma.shape)]


def _infer_grad(ctx):
    dtype = same_dtype(ctx, FLOATS, "floating-point inputs of one dtype")
    x, dy, gamma, mean, var = ctx.inputs
    _check(ctx, x, gamma, mean, var)
    if tuple(dy.shape) != tuple(x.shape):
        raise ctx.fail(f"a gradient dy of x's shape {list(x.shape)}")
    return [TensorType(dtype, x.shape), TensorType(dtype, gamma.shape), TensorType(dtype, gamma.shape)]


def batch_norm_train_grad(x, dy, gamma, mean, var, eps: float = EPS.default) -> list[np.ndarray]:
    """dx = gamma · rstd · (dy − mean(dy) − x̂ · mean(dy · x̂)) with x̂ = (x − mean) · rstd;
    dgamma = Σ dy · x̂ and dbeta = Σ dy over every axis but the channels'."""
    x, dy = _f64(x), _f64(dy)
    axes, shape = tuple(_axes(x.ndim)), _per_channel(x.ndim, x.shape[1])
    count = x.size // x.shape[1]
    rstd = 1.0 / np.sqrt(_f64(var) + eps)
    xhat = (x - _f64(mean).reshape(shape)) * rstd.reshape(shape)
    dbeta, dgamma = dy.sum(axis=axes), (dy * xhat).sum(axis=axes)
    dx = (_f64(gamma) * rstd).reshape(shape) * (dy - (dbeta / count).reshape(shape) - xhat * (dgamma / count).reshape(shape))
    return [dx, dgamma, dbeta]


define(
    "BatchNormTrainGrad", _infer_grad, lambda a, args, o: batch_norm_train_grad(*args, eps=a["eps"]), 5, "nn",
    "dx, dgamma, dbeta of BatchNormTrain: (x, dy, gamma, mean, var) in two passes over each channel",
    attrs=[EPS], flops=lambda op: 8 * op.inputs[0].size,
)


@decomposition("BatchNormTrainGrad")
def _batch_norm_grad_by_ops(b, op):
    x, dy, gamma, mean, var = (b.wrap(v) for v in op.inputs)
    axes, shape = _axes(x.rank), _per_channel(x.rank, x.shape[1])
    count = x.size // x.shape[1]
    rstd = (var + op_def(op.type).attrs_of(op)["eps"]).rsqrt().reshape(shape)
    xhat = (x - mean.reshape(shape)) * rstd
    dbeta, dgamma = dy.sum(axis=axes, keepdims=True), (dy * xhat).sum(axis=axes, keepdims=True)
    dx = gamma.reshape(shape) * rstd * (dy - dbeta * (1.0 / count) - xhat * (dgamma * (1.0 / count)))
    return [dx, dgamma.reshape(gamma.shape), dbeta.reshape(gamma.shape)]
