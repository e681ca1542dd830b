"""ONNX's GridSample: the input read at the positions a grid holds (normalized to [-1, 1]),
by nearest, linear or cubic interpolation over 2 or 3 spatial axes, with zeros, border
or reflection padding.

The positions are computed, so the taps are too: along each axis the flow computes each
output's source coordinate, the input positions its taps read and their weights, as
ONNX's reference does element by element; every combination of one tap per axis is one
Gather from the input laid out [N·positions, C], weighted and summed.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .. import dtypes
from ..flow.builder import Tensor
from .node import Node, converts

MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic", "nearest": "nearest"}
PADDINGS = ("zeros", "border", "reflection")
CUBIC_A = -0.75  # the Keys kernel's a, as ONNX fixes it for GridSample


def _reflect(node: Node, x: Tensor, low: float, high: float) -> Tensor:
    """x mirrored at low and high until it lies between them."""
    span = high - low
    u = x - low
    u = u - node.b.floor(u / (2 * span)) * (2 * span)  # into [0, 2·span)
    return node.b.cond(node.b.greater(u, span), 2 * span - u, u) + low


def _clamp(node: Node, x: Tensor, low: float, high: float) -> Tensor:
    return node.b.maximum(node.b.minimum(x, high), low)


def _cubic_weights(node: Node, t: Tensor) -> list[Tensor]:
    """The Keys kernel's weights of the taps at −1, 0, 1, 2 from a source t past the first."""
    a = CUBIC_A
    s = 1.0 - t
    return [((a * (t + 1.0) - 5 * a) * (t + 1.0) + 8 * a) * (t + 1.0) - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1.0,
            ((a + 2) * s - (a + 3)) * s * s + 1.0,
            ((a * (s + 1.0) - 5 * a) * (s + 1.0) + 8 * a) * (s + 1.0) - 4 * a]


def _axis_taps(node: Node, g: Tensor, size: int, mode: str, padding: str,
               align_corners: bool) -> list[tuple[Tensor, Tensor | None]]:
    """(input position, weight) of each tap along one axis, for grid coordinates g; the
    positions are whole numbers inside the axis, held in floating point."""
    x = (g + 1.0) * ((size - 1) / 2) if align_corners else ((g + 1.0) * size - 1.0) / 2
    low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
    if mode == "nearest":
        x = node.b.round(x)  # half to even, as the reference's rint
    outside = node.b.logical_or(node.b.less(x, low), node.b.greater(x, high))
    if padding == "border":
        x = node.b.cond(outside, _clamp(node, x, 0.0, size - 1.0), x)
    elif padding == "reflection":
        x = node.b.cond(outside, _reflect(node, x, low, high), x)
    if mode == "nearest":
        places, weights = [x], [None]
    else:
        first = node.b.floor(x)
        t = x - first
        offsets = (0, 1) if mode == "linear" else (-1, 0, 1, 2)
        places = [first + float(o) for o in offsets]
        weights = [1.0 - t, t] if mode == "linear" else _cubic_weights(node, t)
    taps = []
    for place, weight in zip(places, weights):
        if padding == "zeros":
            inside = node.b.logical_and(node.b.greater_equal(place, 0.0), node.b.less_equal(place, size - 1.0))
            mask = inside.cast(g.dtype)
            weight = mask if weight is None else weight * mask
        elif padding == "reflection":
            place = _reflect(node, place, low, high)
        taps.append((node.b.trunc(_clamp(node, place, 0.0, size - 1.0)), weight))
    return taps


@converts("GridSample")
def grid_sample(node: Node):
    x, grid = node.tensor(0), node.tensor(1)
    rank = x.rank - 2
    if rank not in (2, 3) or grid.rank != x.rank or grid.shape[0] != x.shape[0] or grid.shape[-1] != rank:
        raise node.error(f"its input of shape {x.shape} and grid of shape {grid.shape} are not [N, C, ...spatial] "
                         "and [N, ...output, spatial rank] over 2 or 3 spatial axes")
    if x.dtype not in dtypes.FLOAT_DTYPES or grid.dtype != x.dtype:
        raise node.error(f"its input {x.dtype} and grid {grid.dtype} are not of one floating-point dtype")
    mode = MODES.get(node.attr("mode", "linear" if node.opset >= 20 else "bilinear"))
    padding = node.attr("padding_mode", "zeros")
    if mode is None or padding not in PADDINGS:
        raise node.error(f"mode {node.attr('mode')!r} with padding_mode {padding!r}: the modes are nearest, linear "
                         f"(bilinear) and cubic (bicubic), the paddings {', '.join(PADDINGS)}")
    align_corners = bool(node.attr("align_corners", 0))
    n, channels, sizes = x.shape[0], x.shape[1], x.shape[2:]
    out = grid.shape[1:-1]
    # The grid's last axis lists coordinates fastest axis first: (x, y[, z]) for axes (..., H, W).
    coordinates = [node.b.slice(grid, [0] * (grid.rank - 1) + [rank - 1 - k], [n, *out, 1]).reshape([n, *out])
                   for k in range(rank)]
    per_axis = [_axis_taps(node, g, size, mode, padding, align_corners) for g, size in zip(coordinates, sizes)]
    table = x.transpose([0, *range(2, x.rank), 1]).reshape([n * math.prod(sizes), channels])
    strides = [math.prod(sizes[k + 1:]) for k in range(rank)]
    first_row = node.importer.as_tensor(
        (np.arange(n) * math.prod(sizes)).reshape([n, *[1] * rank]).astype(dtypes.to_numpy(x.dtype)), "")
    y = None
    for combination in itertools.product(*per_axis):
        row, weight = first_row, None
        for (place, tap_weight), stride in zip(combination, strides):
            row = row + place * float(stride)
            if tap_weight is not None:
                weight = tap_weight if weight is None else weight * tap_weight
        read = node.b.gather(table, row.cast(dtypes.DT_INT64))
        term = read if weight is None else read * weight.reshape([n, *out, 1])
        y = term if y is None else y + term
    return y.transpose([0, grid.rank - 1, *range(1, grid.rank - 1)])
