"""ONNX's GridSample: the input read at the points a grid of normalized coordinates names,
by nearest, (bi/tri)linear or bicubic interpolation, over any number of spatial axes.

Along each spatial axis the grid's coordinate becomes a position in pixels, then the taps
the mode reads around it (1, 2 or 4), each an index (moved inside by the padding mode) and
a weight. Every combination of the axes' taps is one row gather from the input laid out
as [batch · pixels, channels], weighted and summed: as ONNX's reference computes it, the
positions, borders and reflections included.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .. import dtypes
from .node import Node, converts

_CUBIC_A = -0.75  # Keys' cubic convolution, as PyTorch and ONNX take it


def _reflect(node: Node, u, low: float, high: float):
    """u folded back between low and high by its nearer border, as often as it takes."""
    span = high - low
    below, above = u < low, u > high
    distance = node.b.cond(below, low - u, u - high)
    turns = (distance / span).floor()
    rest = distance - turns * span
    even = node.b.mod(turns, node.b.const(2.0, u.dtype)).equal(0.0)
    from_low = node.b.cond(even, rest + low, high - rest)
    from_high = node.b.cond(even, high - rest, rest + low)
    return node.b.cond(below, from_low, node.b.cond(above, from_high, u))


def _cubic_weights(t) -> list:
    """Keys' weights of the taps at −1, 0, 1, 2 for a point t ∈ [0, 1) past tap 0."""
    a = _CUBIC_A

    def near(x):  # |x| <= 1
        return ((x * (a + 2) - (a + 3)) * x * x) + 1.0

    def far(x):  # 1 < |x| < 2
        return ((x * a - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]


@converts("GridSample")
def grid_sample(node: Node):
    x, grid = node.tensor(0), node.tensor(1)
    mode = node.attr("mode", "linear" if node.opset >= 20 else "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = node.attr("padding_mode", "zeros")
    corners = bool(node.attr("align_corners", 0))
    spatial = x.shape[2:]
    k = len(spatial)
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise node.error(f"mode {mode!r} with padding_mode {padding!r} is not one ONNX defines")
    if grid.rank != k + 2 or grid.shape[0] != x.shape[0] or grid.shape[-1] != k:
        raise node.error(f"grid of shape {grid.shape} does not hold {k} coordinates per point for input {x.shape}")
    taps_per_axis = []
    for axis, size in enumerate(spatial):
        coordinate = node.b.slice(grid, [0] * (grid.rank - 1) + [k - 1 - axis], [*grid.shape[:-1], 1])
        coordinate = coordinate.reshape(grid.shape[:-1])  # the grid names the last axis first
        u = (coordinate + 1.0) * (0.5 * (size - 1)) if corners else ((coordinate + 1.0) * size - 1.0) * 0.5
        if mode == "nearest":
            u = u.round()
        low, high = (0.0, size - 1.0) if corners else (-0.5, size - 0.5)
        if padding == "border" and mode != "cubic":
            # Bicubic keeps the point where it is and clamps its taps, as PyTorch and ONNX
            # Runtime do (ONNX's reference clamps the point too; ONNX's cases do not tell).
            u = node.b.cond((u < low) | (u > high), u.maximum(0.0).minimum(size - 1.0), u)
        elif padding == "reflection":
            u = _reflect(node, u, low, high)
        taps_per_axis.append(_taps(node, u, mode, padding, size, low, high))
    pixels = math.prod(spatial)
    rows = x.reshape([x.shape[0], x.shape[1], pixels]).transpose([0, 2, 1]).reshape([x.shape[0] * pixels, x.shape[1]])
    batch_start = node.b.const((np.arange(x.shape[0], dtype=np.int64) * pixels).reshape([-1] + [1] * (grid.rank - 2)))
    strides = [math.prod(spatial[axis + 1:]) for axis in range(k)]
    total = None
    for combination in itertools.product(*taps_per_axis):
        index, weight, inside = batch_start, None, None
        for axis, (tap_index, tap_weight, tap_inside) in enumerate(combination):
            index = index + tap_index * node.b.const(np.int64(strides[axis]))
            if tap_weight is not None:
                weight = tap_weight if weight is None else weight * tap_weight
            if tap_inside is not None:
                inside = tap_inside if inside is None else inside & tap_inside
        value = node.b.gather(rows, index)  # [N, *points, C]
        if weight is not None:
            value = value * weight.reshape([*weight.shape, 1])
        if inside is not None:
            value = node.b.select(inside.reshape([*inside.shape, 1]), value)
        total = value if total is None else total + value
    order = [0, grid.rank - 1, *range(1, grid.rank - 1)]
    return total.transpose(order)


def _taps(node: Node, u, mode: str, padding: str, size: int, low: float, high: float):
    """[(index, weight or None, inside or None)] of the taps around position u along one
    axis: the index int64 and inside [0, size) (zeros padding: `inside` says whether it
    reads the input), clamped (border) or reflected (reflection) there otherwise."""
    if mode == "nearest":
        starts, weights = [u], [None]
    else:
        first = u.floor()
        t = u - first
        if mode == "linear":
            starts, weights = [first, first + 1.0], [1.0 - t, t]
        else:
            starts, weights = [first + float(d) for d in (-1, 0, 1, 2)], _cubic_weights(t)
    taps = []
    for start, weight in zip(starts, weights):
        if padding == "reflection":
            start = _reflect(node, start, low, high)
        index = node.b.cast(start, dtypes.DT_INT64)  # toward zero, as the reference's int()
        inside = None
        if padding == "zeros":
            inside = (index >= node.b.const(np.int64(0))) & (index < node.b.const(np.int64(size)))
        index = index.maximum(node.b.const(np.int64(0))).minimum(node.b.const(np.int64(size - 1)))
        taps.append((index, weight, inside))
    return taps
