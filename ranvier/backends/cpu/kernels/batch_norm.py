"""Batch norm in training mode (`ranvier.ops.batch_norm`): a channel of x [N, C, ...] is
N planes of S contiguous elements; channels are shared out over the cores, and each
takes two passes over its planes from memory.

The forward's first pass takes each plane's mean and sum of squared deviations (a second
look at the plane while it is in cache), the planes merged in float64 as Chan et al.'s
parallel variance merges them, so a channel whose mean is large beside its spread loses
nothing to Σx² − n·mean²; the second writes y = (x − mean)·a + b, or hands it to an
epilogue's program as it is computed (BatchNormTrainCalculate: a CNN's ReLU). The
gradient's first pass sums dy and dy·(x − mean), the second writes dx = dy·k +
(x − mean)·l + m: the mean taken off in x's dtype, as its rounding leaves it, and the
rest of it in float64."""

from __future__ import annotations

from collections.abc import Callable

from .... import dtypes
from ....ops import attrs_of
from ....ops.expression import program_of
from ....ops.fused import fused_type, row_split
from ...llvm.formulas import program_body
from ...llvm.loops import fold, for_vectors
from ...llvm.store_epilogue import StoreEpilogue, Unstored
from ...llvm.values import Value
from ..parallel import share_out, thread_count, worth_splitting
from .library import kernel

F64 = dtypes.DT_FLOAT64


def _supported(op) -> bool:
    return op.inputs[0].dtype in (dtypes.DT_FLOAT32, F64)


def _forward(op) -> tuple:
    """(x, gamma, beta, mean and var outputs, and where y goes: the op's own output, or
    with an epilogue (BatchNormTrainCalculate: a CNN's ReLU) an Unstored y whose stores run
    the program, with the program's further inputs, outputs and body)."""
    if op.type == "BatchNormTrain":
        y, mean, var = op.outputs
        return *op.inputs, mean, var, y, [], [], None
    _, (x, gamma, beta), further, outputs, (mean, var) = row_split(op.type, op.attrs, op.inputs, op.outputs)
    y = Unstored(f"{op.name}:y", x.dtype, tuple(x.shape))
    return x, gamma, beta, mean, var, y, further, outputs, program_body(program_of(op), len(outputs))


def _planes(op) -> tuple[int, int, int]:
    """(N, C, S): images, channels and the elements of a channel's plane in an image."""
    x = op.inputs[0]
    n, c = x.shape[0], x.shape[1]
    return n, c, x.size // (n * c) if n * c else 0


def _each_channel(ctx, op, body: Callable[[object, Value], None]) -> None:
    """`body(ctx, channel)` for every channel, shared out over the cores when large."""
    n, c, s = _planes(op)
    if not n * c * s:
        return
    threads = thread_count() if worth_splitting(nbytes=sum(v.nbytes for v in (*op.inputs, *op.outputs))) else 1

    def share(ctx, first: int | Value, last: int | Value) -> None:
        with ctx.loop(first, last, name="channel") as channel:
            body(ctx, channel)

    share_out(ctx, c, threads, share)


def _plane_sum(ctx, start: Value, count: int, dtype: str, term: Callable[[Value, int], Value]) -> Value:
    """Σ term(i, w) over one plane, in vectors of its dtype, as a float64 scalar."""
    total = fold(ctx, start, count, ctx.lanes_for([dtype]), dtype, 0.0, lambda a, b: a + b, term)
    return total.cast(F64)


def _square(v: Value) -> Value:
    return v * v


def _map_planes(ctx, op, out, channel: Value, value: Callable[[Value, int], Value]) -> None:
    """out[i] = value(i, w) over the channel's planes."""
    n, c, s = _planes(op)
    lanes = ctx.lanes_for([out.dtype])
    with ctx.loop(0, n, name="image") as image:
        for_vectors(ctx, (image * c + channel) * s, s, lanes, lambda i, w: ctx.store(out, i, value(i, w)))


def _scalar(ctx, var, channel: Value) -> Value:
    """A per-channel input's value, in float64."""
    return ctx.load(var, channel).cast(F64)


@kernel("BatchNormChannels", {"BatchNormTrain", fused_type("BatchNormTrain")}, supports=_supported)
def batch_norm_train(ctx, op) -> None:
    x, gamma, beta, mean_out, var_out, y, further, outputs, program = _forward(op)
    n, c, s = _planes(op)
    eps = attrs_of(op)["eps"]

    def channel_body(ctx, channel: Value) -> None:
        mean, deviations = ctx.local(F64, initial=0.0), ctx.local(F64, initial=0.0)
        with ctx.loop(0, n, name="image") as image:
            start = (image * c + channel) * s
            plane_mean = _plane_sum(ctx, start, s, x.dtype, lambda i, w: ctx.load(x, i, w)) * (1.0 / s)
            # the deviations from the plane's mean as x's dtype holds it, then moved to its exact mean
            centre = plane_mean.cast(x.dtype)
            off = plane_mean - centre.cast(F64)
            squares = _plane_sum(ctx, start, s, x.dtype, lambda i, w: _square(ctx.load(x, i, w) - centre.splat(w)))
            before = image.cast(F64) * s  # the elements merged so far
            delta = plane_mean - mean.value
            mean.set(mean.value + delta * s / (before + s))
            deviations.set(deviations.value + (squares - off * off * s) + delta * delta * before * s / (before + s))
        var = deviations.value * (1.0 / (n * s))
        ctx.store(mean_out, channel, mean.value.cast(mean_out.dtype))
        ctx.store(var_out, channel, var.cast(var_out.dtype))
        # y = (x − centre)·a + b, centre the mean as x's dtype holds it: x·a − mean·a would
        # cancel where the mean is large beside the spread
        centre = mean.value.cast(x.dtype)
        scale = _scalar(ctx, gamma, channel) / (var + eps).sqrt()
        a, b = scale.cast(x.dtype), (_scalar(ctx, beta, channel) - (mean.value - centre.cast(F64)) * scale).cast(x.dtype)
        storing = StoreEpilogue(ctx, y, further, outputs, program) if program else ctx
        _map_planes(storing, op, y, channel, lambda i, w: (ctx.load(x, i, w) - centre.splat(w)).mul_add(a.splat(w), b.splat(w)))

    _each_channel(ctx, op, channel_body)


@kernel("BatchNormChannelsGrad", {"BatchNormTrainGrad"}, supports=_supported)
def batch_norm_train_grad(ctx, op) -> None:
    """dx = gamma·rstd·(dy − Σdy/M − (x − mean)·rstd²·Σdy(x − mean)/M) over a channel's M
    elements; dgamma = rstd·Σdy(x − mean), dbeta = Σdy."""
    x, dy, gamma, mean_in, var_in = op.inputs
    _, dgamma, dbeta = op.outputs
    n, c, s = _planes(op)
    eps, count = attrs_of(op)["eps"], n * s

    def channel_body(ctx, channel: Value) -> None:
        mean = _scalar(ctx, mean_in, channel)
        centre = mean.cast(x.dtype)
        sum_dy, sum_dy_x = ctx.local(F64, initial=0.0), ctx.local(F64, initial=0.0)
        with ctx.loop(0, n, name="image") as image:
            start = (image * c + channel) * s
            sum_dy.set(sum_dy.value + _plane_sum(ctx, start, s, x.dtype, lambda i, w: ctx.load(dy, i, w)))
            centred = _plane_sum(ctx, start, s, x.dtype, lambda i, w: ctx.load(dy, i, w) * (ctx.load(x, i, w) - centre.splat(w)))
            sum_dy_x.set(sum_dy_x.value + centred)
        # x's mean as its dtype holds it was taken off: Σdy·(x − mean) needs Σdy times the rest
        centred_sum = sum_dy_x.value - sum_dy.value * (mean - centre.cast(F64))
        rstd = 1.0 / (_scalar(ctx, var_in, channel) + eps).sqrt()
        ctx.store(dgamma, channel, (centred_sum * rstd).cast(dgamma.dtype))
        ctx.store(dbeta, channel, sum_dy.value.cast(dbeta.dtype))
        # dx = dy·k + (x − centre)·l + m
        k = _scalar(ctx, gamma, channel) * rstd
        slope = k * rstd * rstd * centred_sum * (-1.0 / count)
        dy_scale, x_scale = k.cast(x.dtype), slope.cast(x.dtype)
        shift = (k * sum_dy.value * (-1.0 / count) + slope * (centre.cast(F64) - mean)).cast(x.dtype)

        def dx(i: Value, w: int) -> Value:
            centred = ctx.load(x, i, w) - centre.splat(w)
            return ctx.load(dy, i, w).mul_add(dy_scale.splat(w), centred.mul_add(x_scale.splat(w), shift.splat(w)))

        _map_planes(ctx, op, op.outputs[0], channel, dx)

    _each_channel(ctx, op, channel_body)
