"""ONNX's Resize (and the older Upsample): nearest, linear and cubic interpolation with
every coordinate transformation mode, antialiasing, exclude_outside, axes,
keep_aspect_ratio_policy and tf_crop_and_resize's region and extrapolation value.

The interpolation is separable: each resized axis in turn, as ONNX's reference computes
it. Which input positions each output position reads, and with which weights, depends
only on the sizes, known at load; so it is worked out there in float64 (`_taps`, after
the reference's vectorized form), and the flow reads the taps with one Gather along the
axis and sums them weighted. Nearest reads one tap; where that repeats each input a
whole number of times, a broadcast does it without a Gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..flow.builder import Tensor
from .node import Node, converts

MODES = ("nearest", "linear", "cubic")
COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_half_pixel_for_nn", "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")


@dataclass
class Taps:
    """What each output position along one axis reads: input indices [out, n] and their
    weights [out, n]; `outside` marks positions tf_crop_and_resize extrapolates."""

    indices: np.ndarray
    weights: np.ndarray
    outside: np.ndarray | None


@dataclass
class Settings:
    mode: str
    coordinates: str
    nearest: str
    cubic_a: float
    exclude_outside: bool
    antialias: bool


def _source_positions(coordinates: str, out: np.ndarray, scale: float, size: int, out_size: int,
                      roi: tuple[float, float] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Where in the input each output index `out` samples (ONNX's coordinate transformation),
    and for tf_crop_and_resize which of them fall outside it."""
    scaled = scale * size  # the output's length before rounding to out_size
    if coordinates == "align_corners":
        return (np.zeros(out_size) if scaled == 1 else out * (size - 1) / (scaled - 1)), None
    if coordinates == "asymmetric":
        return out / scale, None
    if coordinates == "tf_half_pixel_for_nn":
        return (out + 0.5) / scale, None
    if coordinates == "pytorch_half_pixel":
        return (np.full(out_size, -0.5) if scaled == 1 else (out + 0.5) / scale - 0.5), None
    if coordinates == "half_pixel":
        return (out + 0.5) / scale - 0.5, None
    if coordinates == "half_pixel_symmetric":
        offset = size / 2 * (1 - out_size / scaled)
        return offset + (out + 0.5) / scale - 0.5, None
    start, end = roi  # tf_crop_and_resize
    if scaled == 1:
        source = np.full(out_size, (end - start) * (size - 1) / 2)
    else:
        source = out * (end - start) * (size - 1) / (scaled - 1)
    source = source + start * (size - 1)
    return source, (source < 0) | (source > size - 1)


def _coefficients(settings: Settings, ratio: float, scale: float) -> np.ndarray:
    """The weights of the taps around a source position `ratio` past its floor."""
    if settings.mode == "nearest":
        if ratio == 1:
            return np.array([0.0, 1.0])
        later = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5, "floor": False,
                 "ceil": True}[settings.nearest]
        return np.array([0.0, 1.0]) if later else np.array([1.0, 0.0])
    if settings.mode == "linear":
        if not settings.antialias:
            return np.array([1 - ratio, ratio])
        scale = min(scale, 1.0)
        start = math.floor(-1 / scale) + 1
        weights = np.clip(1 - np.abs((np.arange(start, 2 - start) - ratio) * scale), 0, 1)
        return weights / weights.sum()
    a = settings.cubic_a
    if not settings.antialias:
        return np.array([
            ((a * (ratio + 1) - 5 * a) * (ratio + 1) + 8 * a) * (ratio + 1) - 4 * a,
            ((a + 2) * ratio - (a + 3)) * ratio * ratio + 1,
            ((a + 2) * (1 - ratio) - (a + 3)) * (1 - ratio) * (1 - ratio) + 1,
            ((a * (2 - ratio) - 5 * a) * (2 - ratio) + 8 * a) * (2 - ratio) - 4 * a,
        ])
    scale = min(scale, 1.0)
    start = math.floor(-2 / scale) + 1
    distance = np.abs(scale * (np.arange(start, 2 - start) - ratio))
    weights = np.where(distance <= 1, (a + 2) * distance ** 3 - (a + 3) * distance ** 2 + 1,
                       np.where(distance < 2, a * distance ** 3 - 5 * a * distance ** 2 + 8 * a * distance - 4 * a, 0.0))
    return weights / weights.sum()


def _taps(settings: Settings, size: int, out_size: int, scale: float, roi: tuple[float, float] | None) -> Taps:
    """The taps of one axis, as ONNX's reference (`_interpolate_1d_along_axis`) picks them:
    the n nearest input positions (the earlier on a tie), clamped to the input."""
    source, outside = _source_positions(settings.coordinates, np.arange(out_size, dtype=np.float64), scale, size,
                                        out_size, roi)
    ratios = np.where(source == np.floor(source), 1.0, source - np.floor(source))
    weights = np.stack([_coefficients(settings, float(r), scale) for r in ratios]) if out_size else np.zeros((0, 2))
    n = weights.shape[1]
    pad = math.ceil(n / 2)
    floor = np.floor(source + pad)
    fraction = source + pad - floor
    if n % 2 == 0:
        first = np.where(fraction == 0, -(n // 2), -(n // 2) + 1)
    else:
        first = np.where(fraction <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    indices = (floor + first).astype(np.int64)[:, None] + np.arange(n)[None, :] - pad
    if settings.exclude_outside:
        weights = np.where((indices < 0) | (indices >= size), 0.0, weights)
        totals = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(totals == 0, 1.0, totals)
    return Taps(np.clip(indices, 0, size - 1), weights, outside if outside is not None and outside.any() else None)


def _along_axis(x: Tensor, axis: int, compute) -> Tensor:
    """compute(x with `axis` first) with its result's first axis put back at `axis`."""
    if axis == 0:
        return compute(x)
    order = [axis, *[d for d in range(x.rank) if d != axis]]
    y = compute(x.transpose(order))
    return y.transpose([order.index(d) for d in range(x.rank)])


def _repeats(indices: np.ndarray, size: int) -> int | None:
    """The whole factor f if `indices` read input i at outputs i·f ... i·f + f − 1."""
    factor, remainder = divmod(len(indices), size)
    if remainder or not factor or not np.array_equal(indices, np.repeat(np.arange(size), factor)):
        return None
    return factor


def _resize_axis(node: Node, x: Tensor, axis: int, taps: Taps, extrapolation: float) -> Tensor:
    const = node.importer.as_tensor
    size = x.shape[axis]
    if taps.weights.shape[1] == 2 and np.all(taps.weights.max(axis=1) == 1.0) and np.all(taps.weights.min(axis=1) == 0):
        # Nearest: one tap a position.
        picked = taps.indices[np.arange(len(taps.indices)), taps.weights.argmax(axis=1)]
        factor = _repeats(picked, size)
        if factor is not None and taps.outside is None:
            spread = [*x.shape[:axis + 1], factor, *x.shape[axis + 1:]]
            grown = node.b.broadcast_to(x.reshape([*x.shape[:axis + 1], 1, *x.shape[axis + 1:]]), spread)
            return grown.reshape([*x.shape[:axis], size * factor, *x.shape[axis + 1:]])
        y = _along_axis(x, axis, lambda t: node.b.gather(t, const(picked, "")))
    else:
        numpy_type = dtypes.to_numpy(x.dtype)
        weights = taps.weights.astype(numpy_type).reshape([*taps.weights.shape, *[1] * (x.rank - 1)])

        def weighted(t: Tensor) -> Tensor:
            return node.b.sum(node.b.gather(t, const(taps.indices, "")) * const(weights, ""), axis=[1])

        y = _along_axis(x, axis, weighted)
    if taps.outside is not None:
        shape = [1] * x.rank
        shape[axis] = len(taps.outside)
        fill = node.b.const(np.asarray(extrapolation, dtypes.to_numpy(x.dtype)))
        y = node.b.cond(const(taps.outside.reshape(shape), ""), node.b.broadcast_to(fill, y.shape), y)
    return y


def _settings(node: Node, x: Tensor) -> Settings:
    upsample = node.proto.op_type == "Upsample"
    mode = node.attr("mode", "nearest")
    if mode == "bilinear" and upsample:  # Upsample-7's name for it
        mode = "linear"
    old = upsample or node.opset < 11
    settings = Settings(
        mode=mode,
        coordinates="asymmetric" if old else node.attr("coordinate_transformation_mode", "half_pixel"),
        nearest="floor" if old else node.attr("nearest_mode", "round_prefer_floor"),
        cubic_a=float(node.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(node.attr("exclude_outside", 0)),
        antialias=bool(node.attr("antialias", 0)),
    )
    for value, allowed, what in ((mode, MODES, "mode"), (settings.coordinates, COORDINATE_MODES,
                                                          "coordinate_transformation_mode"),
                                 (settings.nearest, NEAREST_MODES, "nearest_mode")):
        if value not in allowed:
            raise node.error(f"{what} {value!r} is not one of {', '.join(allowed)}")
    if mode != "nearest" and x.dtype not in dtypes.FLOAT_DTYPES:
        raise node.error(f"{mode} interpolation of {x.dtype}: ranvier interpolates floating-point tensors "
                         "(nearest takes every dtype)")
    if settings.antialias and mode == "nearest":
        raise node.error("antialias applies to linear and cubic interpolation, not nearest")
    return settings


def _sizes_and_scales(node: Node, x: Tensor, axes: list[int]) -> tuple[list[int], list[float]]:
    """The output size and the scale of each axis of `axes`, from the scales or sizes input."""
    if node.proto.op_type == "Upsample" and node.opset < 9:
        scales = [float(s) for s in node.attr("scales")]
    else:
        index = 1 if node.proto.op_type == "Upsample" or node.opset < 11 else 2
        has_sizes = index == 2 and node.optional(3) is not None and np.size(node.inputs[3])
        if has_sizes:
            if node.optional(2) is not None and np.size(node.constant(2, "scales")):
                raise node.error("has both scales and sizes; ONNX allows one")
            sizes = node.ints(3, "sizes")
            policy = node.attr("keep_aspect_ratio_policy", "stretch")
            if len(sizes) != len(axes) or min(sizes, default=1) < 1:
                raise node.error(f"its sizes {sizes} are not one size >= 1 per resized axis ({len(axes)})")
            scales = [s / x.shape[a] for s, a in zip(sizes, axes)]
            if policy not in ASPECT_POLICIES:
                raise node.error(f"keep_aspect_ratio_policy {policy!r} is not one of {', '.join(ASPECT_POLICIES)}")
            if policy != "stretch":
                scale = min(scales) if policy == "not_larger" else max(scales)
                scales = [scale] * len(axes)
                sizes = [int(scale * x.shape[a] + 0.5) for a in axes]
            return sizes, scales
        node.attr("keep_aspect_ratio_policy")  # applies to sizes only
        scales = [float(s) for s in np.asarray(node.constant(index, "scales")).reshape(-1)]
    if len(scales) != len(axes) or min(scales, default=1) <= 0:
        raise node.error(f"its scales {scales} are not one positive factor per resized axis ({len(axes)})")
    return [int(s * x.shape[a]) for s, a in zip(scales, axes)], scales


def _region(node: Node, settings: Settings, x: Tensor, axes: list[int]) -> list[tuple[float, float] | None]:
    """tf_crop_and_resize's region of interest (start, end, as fractions) of each resized axis."""
    node.attr("extrapolation_value")
    if settings.coordinates != "tf_crop_and_resize":
        if node.proto.op_type == "Resize" and node.opset >= 11:
            node.optional(1)  # the roi matters to tf_crop_and_resize only
        return [None] * len(axes)
    roi = np.asarray(node.constant(1, "roi"), np.float64).reshape(-1)
    if roi.size == 2 * x.rank and len(axes) != x.rank:
        roi = np.concatenate([roi[axes], roi[[a + x.rank for a in axes]]])
    if roi.size != 2 * len(axes):
        raise node.error(f"its roi of {roi.size} values is not a start and an end per resized axis ({len(axes)})")
    return [(float(roi[i]), float(roi[i + len(axes)])) for i in range(len(axes))]


@converts("Resize", "Upsample")
def resize(node: Node):
    x = node.tensor(0)
    settings = _settings(node, x)
    axes = [node.axis(a, x.rank) for a in node.attr("axes", list(range(x.rank)))]
    if len(set(axes)) != len(axes):
        raise node.error(f"its axes {axes} repeat an axis")
    sizes, scales = _sizes_and_scales(node, x, axes)
    regions = _region(node, settings, x, axes)
    extrapolation = float(node.attr("extrapolation_value", 0.0))
    y = x
    for axis, out_size, scale, roi in zip(axes, sizes, scales, regions):
        if out_size == x.shape[axis] and math.isclose(scale, 1.0) and (roi is None or roi == (0.0, 1.0)):
            continue
        taps = _taps(settings, x.shape[axis], out_size, scale, roi)
        y = _resize_axis(node, y, axis, taps, extrapolation)
    return y
