"""ONNX's operators that read their input bilinearly at places they compute: DeformConv
(each tap of a convolution at a learned offset) and RoiAlign (samples within each region
of interest's bins).

The places are computed, so the taps are too: the flow computes each sample's place, the
input positions its taps read and their weights, as ONNX's reference does element by
element; every combination of taps is one Gather from the input laid out
[images·positions, channels], weighted and summed.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .. import dtypes
from ..flow.builder import Tensor
from .node import Node, converts


def _linear_taps(node: Node, x: Tensor, size: int) -> list[tuple[Tensor, Tensor]]:
    """(input position, weight) of the two taps around each source place x along an axis
    of `size`, a tap outside the axis weighing 0 (as GridSample with zeros padding and
    align_corners reads); the positions are whole numbers inside the axis, held in
    floating point."""
    first = node.b.floor(x)
    t = x - first
    taps = []
    for place, weight in ((first, 1.0 - t), (first + 1.0, t)):
        inside = node.b.logical_and(node.b.greater_equal(place, 0.0), node.b.less_equal(place, size - 1.0))
        clamped = node.b.maximum(node.b.minimum(place, size - 1.0), 0.0)
        taps.append((clamped, weight * inside.cast(x.dtype)))
    return taps


def _sum_of_taps(node: Node, table: Tensor, first_rows: np.ndarray, per_axis: list, sizes: list[int],
                 shape: list[int]) -> Tensor:
    """The rows of `table` [images·positions, C] each combination of one tap per axis
    reads (from the image's first row), weighted and summed: [*shape, C]."""
    strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
    y = None
    for combination in itertools.product(*per_axis):
        row = node.importer.as_tensor(first_rows.astype(dtypes.to_numpy(table.dtype)), "")
        weight = None
        for (place, tap_weight), stride in zip(combination, strides):
            row = row + place * float(stride)
            weight = tap_weight if weight is None else weight * tap_weight
        term = node.b.gather(table, row.cast(dtypes.DT_INT64)) * weight.reshape([*shape, 1])
        y = term if y is None else y + term
    return y


@converts("DeformConv")
def deform_conv(node: Node):
    """A 2-D convolution whose every tap reads its input at a learned offset from where a
    Conv would, bilinearly (zeros outside), optionally scaled by a mask; then the filters
    times those columns, per group."""
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
    per_axis = [_linear_taps(node, s, size) for s, size in zip(sources, (height, width))]
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
