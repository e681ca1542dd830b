"""ONNX's GridSample, DeformConv and RoiAlign: the input read at the positions a grid holds (normalized to [-1, 1]),
by nearest, linear or cubic interpolation over 2 or 3 spatial axes, with zeros, border
or reflection padding.

The positions are computed, so the taps are too: along each axis the flow computes each
output's source coordinate, the input positions its taps read and their weights, as
ONNX's reference does element by element; every combination of one tap per axis is one
Gather from the input laid out [N·positions, C], weighted and summed. DeformConv reads
its taps so, bilinearly at their offset places, before its filters' product; RoiAlign
its samples within each region's bins.
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


def _axis_taps(node: Node, x: Tensor, size: int, mode: str, padding: str,
               align_corners: bool) -> list[tuple[Tensor, Tensor | None]]:
    """(input position, weight) of each tap along one axis of `size`, for source
    coordinates x; the positions are whole numbers inside the axis, held in floating point."""
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
            mask = inside.cast(x.dtype)
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
    sources = [(g + 1.0) * ((size - 1) / 2) if align_corners else ((g + 1.0) * size - 1.0) / 2
               for g, size in zip(coordinates, sizes)]
    per_axis = [_axis_taps(node, s, size, mode, padding, align_corners) for s, size in zip(sources, sizes)]
    table = x.transpose([0, *range(2, x.rank), 1]).reshape([n * math.prod(sizes), channels])
    first_rows = (np.arange(n) * math.prod(sizes)).reshape([n, *[1] * rank])
    y = _sum_of_taps(node, table, first_rows, per_axis, sizes, [n, *out])
    return y.transpose([0, grid.rank - 1, *range(1, grid.rank - 1)])


def _sum_of_taps(node: Node, table: Tensor, first_rows: np.ndarray, per_axis: list, sizes: list[int],
                 shape: list[int]) -> Tensor:
    """The rows of `table` [images·positions, C] each combination of one tap per axis
    reads (from the image's first row), weighted and summed: [*shape, C]."""
    strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
    y = None
    for combination in itertools.product(*per_axis):
        row, weight = node.importer.as_tensor(first_rows.astype(dtypes.to_numpy(table.dtype)), ""), None
        for (place, tap_weight), stride in zip(combination, strides):
            row = row + place * float(stride)
            if tap_weight is not None:
                weight = tap_weight if weight is None else weight * tap_weight
        read = node.b.gather(table, row.cast(dtypes.DT_INT64))
        term = read if weight is None else read * weight.reshape([*shape, 1])
        y = term if y is None else y + term
    return y


@converts("DeformConv")
def deform_conv(node: Node):
    """A 2-D convolution whose every tap reads its input at a learned offset from where a
    Conv would, bilinearly (zeros outside, as GridSample with align_corners), optionally
    scaled by a mask; then the filters times those columns, per group."""
    x, w, offset = node.tensor(0), node.tensor(1), node.tensor(2)
    if x.rank != 4 or w.rank != 4 or x.dtype not in dtypes.FLOAT_DTYPES:
        raise node.error(f"its input {x.dtype}{x.shape} and weight {w.shape} are not a floating-point [N, C, H, W] "
                         "and [M, C/group, kH, kW] (2-D deformable convolution)")
    n, channels, height, width = x.shape
    filters, per_group, kh, kw = w.shape
    groups, offset_groups = int(node.attr("group", 1)), int(node.attr("offset_group", 1))
    if groups < 1 or channels != per_group * groups or filters % groups or offset_groups < 1 or channels % offset_groups:
        raise node.error(f"group {groups} and offset_group {offset_groups} do not split its {channels} channels and "
                         f"{filters} filters (weight {w.shape})")
    kernel = node.attr("kernel_shape")
    if kernel is not None and list(kernel) != [kh, kw]:
        raise node.error(f"kernel_shape {list(kernel)} contradicts its weight's window {[kh, kw]}")
    strides, dilations = [int(s) for s in node.attr("strides", [1, 1])], [int(d) for d in node.attr("dilations", [1, 1])]
    pads = [int(p) for p in node.attr("pads", [0, 0, 0, 0])]
    oh, ow = offset.shape[2:] if offset.rank == 4 else (0, 0)
    if offset.shape != [n, offset_groups * kh * kw * 2, oh, ow] or \
            oh != (height + pads[0] + pads[2] - (kh - 1) * dilations[0] - 1) // strides[0] + 1 or \
            ow != (width + pads[1] + pads[3] - (kw - 1) * dilations[1] - 1) // strides[1] + 1:
        raise node.error(f"its offset of shape {offset.shape} is not [N, offset_group·kH·kW·2, out H, out W] of the "
                         "windows its strides, pads and dilations make")
    shape = [n, offset_groups, kh, kw, oh, ow]
    offsets = offset.reshape([n, offset_groups, kh, kw, 2, oh, ow])
    sources = []
    for axis, (taps, outs) in enumerate(((kh, oh), (kw, ow))):
        along = [axis == 0, axis == 1]
        start = (np.arange(outs) * strides[axis] - pads[axis])[None, :] + (np.arange(taps) * dilations[axis])[:, None]
        start = start.reshape([1, 1, taps if along[0] else 1, taps if along[1] else 1,
                               outs if along[0] else 1, outs if along[1] else 1])
        moved = node.b.slice(offsets, [0, 0, 0, 0, axis, 0, 0], [n, offset_groups, kh, kw, 1, oh, ow]).reshape(shape)
        sources.append(moved + node.importer.as_tensor(start.astype(dtypes.to_numpy(x.dtype)), ""))
    per_axis = [_axis_taps(node, s, size, "linear", "zeros", True) for s, size in zip(sources, (height, width))]
    per_offset_group = channels // offset_groups
    table = x.reshape([n, offset_groups, per_offset_group, height * width]).transpose([0, 1, 3, 2])
    table = table.reshape([n * offset_groups * height * width, per_offset_group])
    first_rows = (np.arange(n * offset_groups) * height * width).reshape([n, offset_groups, 1, 1, 1, 1])
    sampled = _sum_of_taps(node, table, first_rows, per_axis, [height, width], shape)  # [N, G, kH, kW, oH, oW, C/G]
    if node.optional(4) is not None:
        sampled = sampled * node.tensor(4).reshape([*shape, 1])
    columns = sampled.transpose([0, 1, 6, 2, 3, 4, 5]).reshape([n, groups, per_group * kh * kw, oh * ow])
    y = node.b.matmul(w.reshape([groups, filters // groups, per_group * kh * kw]), columns).reshape([n, filters, oh, ow])
    if node.optional(3) is not None:
        y = y + node.tensor(3).reshape([1, filters, 1, 1])
    return y


def _roi_axis(node: Node, start: Tensor, end: Tensor, size: int, pooled: int, samples: int, half_pixel: bool):
    """Along one axis of `size`, for each roi's [R] start and end: the taps (low, high
    place) and weights (of low, of high) of its samples [R, pooled, samples] as RoiAlign
    reads them (Caffe2's bilinear rule: clamped at the last position), and which samples
    lie outside the input."""
    length = end - start
    if not half_pixel:
        length = node.b.maximum(length, 1.0)
    step = (length / float(pooled)).reshape([start.shape[0], 1, 1])
    within = (np.arange(pooled)[:, None] + (np.arange(samples)[None, :] + 0.5) / samples).astype(np.float64)
    s = start.reshape([start.shape[0], 1, 1]) + step * node.importer.as_tensor(within.astype(dtypes.to_numpy(start.dtype)), "")
    outside = node.b.logical_or(node.b.less(s, -1.0), node.b.greater(s, float(size)))
    s = node.b.maximum(s, 0.0)
    low = node.b.floor(s)
    edge = node.b.greater_equal(low, size - 1.0)
    low = node.b.cond(edge, node.b.minimum(low, size - 1.0), low)
    s = node.b.cond(edge, low, s)
    high = node.b.cond(edge, low, low + 1.0)
    fraction = s - low
    return (low, high), (1.0 - fraction, fraction), outside


@converts("RoiAlign")
def roi_align(node: Node):
    """Each region of interest pooled to output_height × output_width bins, each bin the
    average (or max) of sampling_ratio² bilinear samples, as ONNX's reference computes it."""
    x, rois, batch_indices = node.tensor(0), node.tensor(1), node.tensor(2)
    if x.rank != 4 or rois.rank != 2 or rois.shape[1] != 4 or batch_indices.shape != [rois.shape[0]]:
        raise node.error(f"its input {x.shape}, rois {rois.shape} and batch_indices {batch_indices.shape} are not "
                         "[N, C, H, W], [R, 4] and [R]")
    mode = node.attr("mode", "avg")
    coordinates = node.attr("coordinate_transformation_mode", "half_pixel" if node.opset >= 16 else "output_half_pixel")
    samples = int(node.attr("sampling_ratio", 0))
    if mode not in ("avg", "max") or coordinates not in ("half_pixel", "output_half_pixel"):
        raise node.error(f"mode {mode!r} with coordinate_transformation_mode {coordinates!r}: the modes are avg and max, "
                         "the coordinate modes half_pixel and output_half_pixel")
    if samples < 1:
        raise node.error(f"sampling_ratio {samples}: an adaptive count of samples (0), which differs roi by roi, "
                         "is not supported; give a positive sampling_ratio")
    out_h, out_w = int(node.attr("output_height", 1)), int(node.attr("output_width", 1))
    n, channels, height, width = x.shape
    count = rois.shape[0]
    half_pixel = coordinates == "half_pixel"
    corners = (node.b.cast(rois, x.dtype) if rois.dtype != x.dtype else rois) * float(node.attr("spatial_scale", 1.0))
    if half_pixel:
        corners = corners - 0.5
    x1, y1, x2, y2 = (c.reshape([count]) for c in corners.split(4, axis=1))
    places_y, weights_y, outside_y = _roi_axis(node, y1, y2, height, out_h, samples, half_pixel)
    places_x, weights_x, outside_x = _roi_axis(node, x1, x2, width, out_w, samples, half_pixel)
    shape = [count, out_h, samples, out_w, samples]
    along_y, along_x = [count, out_h, samples, 1, 1], [count, 1, 1, out_w, samples]
    inside = node.b.logical_not(node.b.logical_or(outside_y.reshape(along_y), outside_x.reshape(along_x))).cast(x.dtype)
    table = x.transpose([0, 2, 3, 1]).reshape([n * height * width, channels])
    first_rows = batch_indices.cast(x.dtype).reshape([count, 1, 1, 1, 1]) * float(height * width)
    terms = []
    for place_y, weight_y in zip(places_y, weights_y):
        for place_x, weight_x in zip(places_x, weights_x):
            row = first_rows + place_y.reshape(along_y) * float(width) + place_x.reshape(along_x)
            weight = weight_y.reshape(along_y) * weight_x.reshape(along_x) * inside
            read = node.b.gather(table, node.b.cast(row, dtypes.DT_INT64))
            terms.append(read * weight.reshape([*shape, 1]))
    if mode == "avg":
        total = terms[0] + terms[1] + terms[2] + terms[3]
        pooled = node.b.sum(total, axis=[2, 4]) / float(samples * samples)
    else:
        biggest = node.b.maximum(node.b.maximum(terms[0], terms[1]), node.b.maximum(terms[2], terms[3]))
        pooled = node.b.max(biggest, axis=[2, 4])
    return pooled.transpose([0, 3, 1, 2])
