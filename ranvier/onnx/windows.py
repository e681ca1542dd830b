"""ONNX's window operators over any number of spatial axes: Conv, ConvTranspose,
MaxPool (with its indices), AveragePool, LpPool and the global pools.

Every one reads the windows of its input through one strided view of the padded input
(`[N, C, ...kernel taps, ...output positions]` for products, `[N, C, ...positions,
...taps]` for reductions), whatever the strides, dilations, groups and padding; a
transposed convolution writes its columns back through the same view
(StridedScatterAdd). Convolutions and pools of one or two spatial axes that ranvier's
own Conv2D, MaxPool and AvgPool ops compute (no dilation, one group, padding they take)
go to those ops, whose kernels are tuned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..flow.builder import Tensor
from ..ops.window import strided_view
from .node import Node, converts


@dataclass
class Window:
    """Where each output position of a window op reads, along the spatial axes."""

    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    before: list[int]  # padding before each spatial axis
    after: list[int]  # padding after it: the explicit pads, or what the last window needs past them (ceil_mode)
    pads_after: list[int]  # the explicit pads after each axis (AveragePool counts these, not the ceil_mode ones)
    out: list[int]

    @property
    def extents(self) -> list[int]:
        """How far one window reaches along each axis, dilations included."""
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations)]

    @property
    def plain(self) -> bool:
        """No dilation and padding only as explicit pads: ranvier's 2-D ops can compute it."""
        return all(d == 1 for d in self.dilations) and self.after == self.pads_after


def spatial_attr(node: Node, name: str, rank: int, default: int) -> list[int]:
    """A per-spatial-axis attribute (strides, dilations, output_padding), checked for length."""
    values = [int(v) for v in node.attr(name, [default] * rank)]
    if len(values) != rank:
        raise node.error(f"its {name} {values} do not have one value per spatial axis ({rank})")
    return values


def window(node: Node, x: Tensor, kernel: list[int], ceil_mode: bool = False) -> Window:
    """The geometry of a Conv's or a pool's windows over x [N, C, ...spatial], as ONNX
    defines it: explicit pads or auto_pad, and ceil_mode (a last, partial window that
    starts inside the input or its leading padding)."""
    rank = x.rank - 2
    if rank < 1 or len(kernel) != rank or min(kernel) < 1:
        raise node.error(f"its kernel {kernel} does not fit its input of shape {x.shape} ([N, C, ...spatial axes])")
    strides, dilations = spatial_attr(node, "strides", rank, 1), spatial_attr(node, "dilations", rank, 1)
    if min(strides) < 1 or min(dilations) < 1:
        raise node.error(f"strides {strides} and dilations {dilations} must be positive")
    sizes = x.shape[2:]
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad != "NOTSET" and "pads" in node.attrs:
        raise node.error(f"has both pads and auto_pad {auto_pad}; ONNX allows one")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-size // s) for size, s in zip(sizes, strides)]
        totals = [max((o - 1) * s + e - size, 0) for o, s, e, size in zip(out, strides, extents, sizes)]
        small = [t // 2 for t in totals]
        large = [t - t // 2 for t in totals]
        before, after = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad in ("NOTSET", "VALID"):
        pads = [int(p) for p in node.attr("pads", [0] * 2 * rank)] if auto_pad == "NOTSET" else [0] * 2 * rank
        if len(pads) != 2 * rank or min(pads) < 0:
            raise node.error(f"its pads {pads} are not {2 * rank} values >= 0 (begin and end of each spatial axis)")
        before, after = pads[:rank], pads[rank:]
    else:
        raise node.error(f"auto_pad {auto_pad!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    out, needed = [], []
    for size, s, e, b, a in zip(sizes, strides, extents, before, after):
        span = size + b + a - e
        if span < 0:
            raise node.error(f"its window of extent {e} does not fit an axis of {size} padded by {b} and {a}")
        count = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (count - 1) * s >= size + b:  # the last window must start inside the input or its leading pad
            count -= 1
        out.append(count)
        needed.append(max((count - 1) * s + e - size - b, a))
    return Window(list(kernel), strides, dilations, before, needed, after, out)


def padded(node: Node, x: Tensor, win: Window, value: float) -> Tensor:
    if not any(win.before) and not any(win.after):
        return x
    return node.b.pad(x, before=[0, 0, *win.before], after=[0, 0, *win.after], value=value)


def view(shape: list[int], win: Window, taps_first: bool, offset: list[int] | None = None) -> dict:
    """StridedView attributes over a [N, C, ...spatial] tensor of `shape`: its windows as
    [N, C, ...taps, ...positions] (taps_first) or [N, C, ...positions, ...taps];
    `offset` moves the first window along the spatial axes."""
    element = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    spatial = element[2:]
    taps = [d * e for d, e in zip(win.dilations, spatial)]
    steps = [s * e for s, e in zip(win.strides, spatial)]
    first = sum(o * e for o, e in zip(offset or [], spatial))
    if taps_first:
        return {"offset": first, "shape": [*shape[:2], *win.kernel, *win.out], "strides": [*element[:2], *taps, *steps]}
    return {"offset": first, "shape": [*shape[:2], *win.out, *win.kernel], "strides": [*element[:2], *steps, *taps]}


def constant(node: Node, array: np.ndarray, like: Tensor) -> Tensor:
    return node.importer.as_tensor(np.asarray(array, dtypes.to_numpy(like.dtype)), "")


def group_count(node: Node, channels: int, filters: int, per_group: int) -> int:
    groups = int(node.attr("group", 1))
    if groups < 1 or channels % groups or filters % groups or channels // groups != per_group:
        raise node.error(f"group={groups} does not split its {channels} input channels into groups of {per_group} "
                         f"(the weight's second axis) and its {filters} filters evenly")
    return groups


# ---- convolution ---------------------------------------------------------------------------------------------


@converts("Conv")
def conv(node: Node):
    x, w = node.tensor(0), node.tensor(1)
    if w.rank != x.rank:
        raise node.error(f"its weight of shape {w.shape} does not match its input of shape {x.shape}")
    kernel = node.attr("kernel_shape")
    if kernel is not None and list(kernel) != list(w.shape[2:]):
        raise node.error(f"kernel_shape {list(kernel)} contradicts its weight's window {list(w.shape[2:])}")
    groups = group_count(node, x.shape[1], w.shape[0], w.shape[1])
    win = window(node, x, list(w.shape[2:]))
    if groups == 1 and win.plain and x.rank in (3, 4) and x.dtype in dtypes.FLOAT_DTYPES:
        y = _conv2d(node, x, w, win)
    else:
        y = _conv_as_products(node, x, w, win, groups)
    if node.optional(2) is not None:
        bias = node.tensor(2)
        if bias.shape != [w.shape[0]]:
            raise node.error(f"its bias of shape {bias.shape} is not one value per output channel, [{w.shape[0]}]")
        y = y + bias.reshape([1, w.shape[0], *[1] * (x.rank - 2)])
    return y


def _conv2d(node: Node, x: Tensor, w: Tensor, win: Window) -> Tensor:
    """ranvier's Conv2D (a 1-D convolution as 2-D over rows of one): the pads both sides
    share go to its padding, the rest to a Pad before it."""
    if x.rank == 3:
        flat = Window([1, *win.kernel], [1, *win.strides], [1, 1], [0, *win.before], [0, *win.after],
                      [0, *win.pads_after], [1, *win.out])
        y = _conv2d(node, x.reshape([*x.shape[:2], 1, x.shape[2]]), w.reshape([*w.shape[:2], 1, w.shape[2]]), flat)
        return y.reshape([*y.shape[:2], y.shape[3]])
    shared = [min(b, a) for b, a in zip(win.before, win.after)]
    extra = Window(win.kernel, win.strides, win.dilations, [b - s for b, s in zip(win.before, shared)],
                   [a - s for a, s in zip(win.after, shared)], win.pads_after, win.out)
    return node.b.conv2d(padded(node, x, extra, 0.0), w, strides=win.strides, padding=shared)


def _conv_as_products(node: Node, x: Tensor, w: Tensor, win: Window, groups: int) -> Tensor:
    """Each group's filters [M/G, C/G·taps] times its windows [C/G·taps, positions]."""
    n, channels = x.shape[:2]
    filters, taps, positions = w.shape[0], math.prod(win.kernel), math.prod(win.out)
    source = padded(node, x, win, 0.0)
    windows = source.strided_view(**view(source.shape, win, taps_first=True))
    columns = windows.reshape([n, groups, channels // groups * taps, positions])
    y = node.b.matmul(w.reshape([groups, filters // groups, channels // groups * taps]), columns)
    return y.reshape([n, filters, *win.out])


@converts("ConvTranspose")
def conv_transpose(node: Node):
    """The transpose of a convolution: each input position's columns (the filters times
    its channels) added onto the output through the windows' view, then the pads cut off."""
    x, w = node.tensor(0), node.tensor(1)
    rank = x.rank - 2
    if rank < 1 or w.rank != x.rank or w.shape[0] != x.shape[1]:
        raise node.error(f"its weight of shape {w.shape} does not match its input of shape {x.shape} "
                         "([C, M/group, ...kernel] for [N, C, ...spatial])")
    kernel = node.attr("kernel_shape")
    if kernel is not None and list(kernel) != list(w.shape[2:]):
        raise node.error(f"kernel_shape {list(kernel)} contradicts its weight's window {list(w.shape[2:])}")
    groups = int(node.attr("group", 1))
    if groups < 1 or x.shape[1] % groups:
        raise node.error(f"group={groups} does not divide its {x.shape[1]} input channels")
    strides, dilations = spatial_attr(node, "strides", rank, 1), spatial_attr(node, "dilations", rank, 1)
    output_padding = spatial_attr(node, "output_padding", rank, 0)
    if min(strides) < 1 or min(dilations) < 1 or min(output_padding) < 0:
        raise node.error(f"strides {strides}, dilations {dilations} and output_padding {output_padding} must be positive")
    sizes = x.shape[2:]
    kernel = list(w.shape[2:])
    full = [(i - 1) * s + (k - 1) * d + 1 + p for i, s, k, d, p in zip(sizes, strides, kernel, dilations, output_padding)]
    before, out = _transposed_placement(node, rank, sizes, strides, full)
    # The columns land on a buffer reaching from min(0, before) to max(full, before + out).
    shift = [max(-b, 0) for b in before]
    target = [max(f, b + o) + s for f, b, o, s in zip(full, before, out, shift)]
    n, filters, per_group = x.shape[0], w.shape[1] * groups, x.shape[1] // groups
    columns = node.b.matmul(w.reshape([groups, per_group, w.shape[1] * math.prod(kernel)]),
                            x.reshape([n, groups, per_group, math.prod(sizes)]), transpose_a=True)
    win = Window(kernel, strides, dilations, [0] * rank, [0] * rank, [0] * rank, list(sizes))
    placed = view([n, filters, *target], win, taps_first=True, offset=shift)
    y = columns.reshape(placed["shape"]).strided_scatter_add(**placed, target_shape=[n, filters, *target])
    start = [b + s for b, s in zip(before, shift)]
    if start != [0] * rank or out != target:
        y = node.b.slice(y, [0, 0, *start], [n, filters, *out])
    if node.optional(2) is not None:
        bias = node.tensor(2)
        if bias.shape != [filters]:
            raise node.error(f"its bias of shape {bias.shape} is not one value per output channel, [{filters}]")
        y = y + bias.reshape([1, filters, *[1] * rank])
    return y


def _transposed_placement(node: Node, rank: int, sizes: list[int], strides: list[int],
                          full: list[int]) -> tuple[list[int], list[int]]:
    """(padding cut before each axis, output size) of a ConvTranspose: from output_shape
    (or auto_pad SAME, which asks for input size × stride), the padding that leaves it
    split as ONNX Runtime splits it; else the explicit pads."""
    auto_pad = node.attr("auto_pad", "NOTSET")
    output_shape = node.attr("output_shape")
    if output_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [i * s for i, s in zip(sizes, strides)]
    if output_shape is not None:
        node.attr("pads")  # output_shape decides them
        output_shape = [int(o) for o in output_shape][-rank:]
        if len(output_shape) != rank or min(output_shape) < 1:
            raise node.error(f"its output_shape {list(node.attr('output_shape'))} is not one size per spatial axis")
        totals = [f - o for f, o in zip(full, output_shape)]
        before = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
        return before, output_shape
    if auto_pad not in ("NOTSET", "VALID"):
        raise node.error(f"auto_pad {auto_pad!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    pads = [int(p) for p in node.attr("pads", [0] * 2 * rank)] if auto_pad == "NOTSET" else [0] * 2 * rank
    if len(pads) != 2 * rank or min(pads) < 0:
        raise node.error(f"its pads {pads} are not {2 * rank} values >= 0 (begin and end of each spatial axis)")
    out = [f - b - a for f, b, a in zip(full, pads[:rank], pads[rank:])]
    if min(out) < 1:
        raise node.error(f"its pads {pads} leave no output of the {full} positions its windows cover")
    return pads[:rank], out


# ---- pooling -------------------------------------------------------------------------------------------------


def _pool_window(node: Node, x: Tensor) -> Window:
    kernel = node.attr("kernel_shape")
    if kernel is None:
        raise node.error("needs kernel_shape")
    return window(node, x, [int(k) for k in kernel], ceil_mode=bool(node.attr("ceil_mode", 0)))


def _lowest(dtype: str) -> float:
    """The padding a maximum never picks: -inf, or the integer dtype's least value."""
    numpy_type = np.dtype(dtypes.to_numpy(dtype))
    return -math.inf if numpy_type.kind == "f" else float(np.iinfo(numpy_type).min)


def _pool_windows(node: Node, x: Tensor, win: Window, fill: float) -> Tensor:
    """x's windows as [N, C, ...positions, taps]."""
    source = padded(node, x, win, fill)
    windows = source.strided_view(**view(source.shape, win, taps_first=False))
    return windows.reshape([*x.shape[:2], *win.out, math.prod(win.kernel)])


def _fits_pool_op(x: Tensor, win: Window) -> bool:
    """ranvier's MaxPool and AvgPool take a 2-D window padded alike on both sides, by at
    most half the window, in floating point."""
    return (x.rank == 4 and win.plain and win.before == win.after and x.dtype in dtypes.FLOAT_DTYPES
            and all(2 * p <= k for p, k in zip(win.before, win.kernel)))


@converts("MaxPool")
def max_pool(node: Node):
    x = node.tensor(0)
    win = _pool_window(node, x)
    wants_indices = len(node.proto.output) > 1 and bool(node.proto.output[1])
    node.attr("storage_order")  # orders the indices only (read there)
    if _fits_pool_op(x, win) and not wants_indices:
        return node.b.max_pool(x, ksize=win.kernel, strides=win.strides, padding=win.before)
    windows = _pool_windows(node, x, win, _lowest(x.dtype))
    y = windows.max(axis=[windows.rank - 1])
    if not wants_indices:
        return y
    return [y, _argmax_indices(node, x, win, windows)]


def _argmax_indices(node: Node, x: Tensor, win: Window, windows: Tensor) -> Tensor:
    """MaxPool's Indices: where in x (flattened, the spatial axes in row-major order, or
    column-major with storage_order 1) each maximum was, from which tap of its window
    held it and a table of every tap's place."""
    spatial = x.shape[2:]
    order = int(node.attr("storage_order", 0))
    if order not in (0, 1):
        raise node.error(f"storage_order {order} is not 0 (row-major) or 1 (column-major)")
    places = np.arange(math.prod(spatial), dtype=np.int64).reshape(spatial)
    if order == 1:
        places = places.reshape(spatial[::-1]).T
    # Each window's taps' places (a padded place is never a maximum but for all-padding
    # windows, which ceil_mode and pads never leave).
    table = np.pad(places, [(b, a) for b, a in zip(win.before, win.after)], constant_values=-1)
    spec = view([1, 1, *table.shape], win, taps_first=False)
    taps = strided_view(table, spec["offset"], spec["shape"], spec["strides"]).reshape(-1)
    tap = windows.argmax(axis=windows.rank - 1, output_type="int64")
    per_image = math.prod(win.out) * math.prod(win.kernel)
    position = np.arange(math.prod(win.out), dtype=np.int64).reshape(win.out) * math.prod(win.kernel)
    index = tap + node.importer.as_tensor(position, "")
    found = node.b.gather(node.importer.as_tensor(taps.reshape(per_image), ""), index)
    images = np.arange(x.shape[0] * x.shape[1], dtype=np.int64).reshape(x.shape[0], x.shape[1], *[1] * len(win.out))
    return found + node.importer.as_tensor(images * math.prod(spatial), "")


@converts("AveragePool")
def average_pool(node: Node):
    """The mean of each window: over its elements inside the input (count_include_pad=0,
    the default) or inside the input and its explicit pads, never the positions ceil_mode
    adds past them."""
    x = node.tensor(0)
    win = _pool_window(node, x)
    include_pads = bool(node.attr("count_include_pad", 0))
    if _fits_pool_op(x, win) and (include_pads or not any(win.before)):
        return node.b.avg_pool(x, ksize=win.kernel, strides=win.strides, padding=win.before)
    windows = _pool_windows(node, x, win, 0.0)
    counts = _window_counts(x.shape[2:], win, include_pads)
    total = windows.sum(axis=[windows.rank - 1])
    if np.all(counts == math.prod(win.kernel)):
        return total / float(math.prod(win.kernel))
    return total / constant(node, counts, x)


def _window_counts(sizes: list[int], win: Window, include_pads: bool) -> np.ndarray:
    """How many counted positions each window holds (ONNX divides by that)."""
    counted = np.pad(np.ones(sizes), [(b, a) for b, a in zip(win.before, win.pads_after)],
                     constant_values=1.0 if include_pads else 0.0)
    extra = [(0, a - p) for a, p in zip(win.after, win.pads_after)]
    counted = np.pad(counted, extra)
    spec = view([1, 1, *counted.shape], win, taps_first=False)
    return strided_view(counted, spec["offset"], spec["shape"], spec["strides"]).sum(axis=tuple(range(-len(sizes), 0)))[0, 0]


@converts("LpPool")
def lp_pool(node: Node):
    x = node.tensor(0)
    p = float(node.attr("p", 2))
    if p <= 0:
        raise node.error(f"p={p} must be positive")
    windows = _pool_windows(node, x, _pool_window(node, x), 0.0)
    powered = windows * windows if p == 2 else abs(windows) ** p
    total = powered.sum(axis=[windows.rank - 1])
    return total.sqrt() if p == 2 else total ** (1.0 / p)


@converts("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def global_pool(node: Node):
    x = node.tensor(0)
    axes = list(range(2, x.rank))
    if node.proto.op_type == "GlobalAveragePool":
        return node.b.mean(x, axis=axes, keepdims=True)
    if node.proto.op_type == "GlobalMaxPool":
        return node.b.max(x, axis=axes, keepdims=True)
    p = float(node.attr("p", 2))
    powered = x * x if p == 2 else abs(x) ** p
    total = node.b.sum(powered, axis=axes, keepdims=True)
    return total.sqrt() if p == 2 else total ** (1.0 / p)


# ---- the inverses of windows: Col2Im, MaxUnpool ----------------------------------------------------------------


@converts("Col2Im")
def col2im(node: Node):
    """Columns [N, C·taps, positions] added back onto the image [N, C, ...image_shape]
    through the windows' view of the padded image (the transpose of Conv's im2col)."""
    x = node.tensor(0)
    image, block = node.ints(1, "image_shape"), node.ints(2, "block_shape")
    rank, taps = len(image), math.prod(block)
    if x.rank != 3 or len(block) != rank or min(block + image, default=0) < 1 or x.shape[1] % taps:
        raise node.error(f"its input of shape {x.shape} with image_shape {image} and block_shape {block} is not "
                         "[N, C·prod(block_shape), positions]")
    n, channels = x.shape[0], x.shape[1] // taps
    shape = [n, channels, *image]
    win = window(node, _Shaped(shape), block)
    if math.prod(win.out) != x.shape[2]:
        raise node.error(f"its {x.shape[2]} positions are not the {math.prod(win.out)} ({win.out}) its windows take")
    target = [n, channels, *[s + b + a for s, b, a in zip(image, win.before, win.after)]]
    placed = view(target, win, taps_first=True)
    y = x.reshape(placed["shape"]).strided_scatter_add(**placed, target_shape=target)
    if any(win.before) or any(win.after):
        y = node.b.slice(y, [0, 0, *win.before], shape)
    return y


@dataclass
class _Shaped:
    """A stand-in with the shape `window` reads (Col2Im's image is not a tensor yet)."""

    shape: list[int]

    @property
    def rank(self) -> int:
        return len(self.shape)


@converts("MaxUnpool")
def max_unpool(node: Node):
    """Each value put back where MaxPool's indices say it came from, zeros elsewhere. The
    indices count places in the pool's input (the default output shape); a larger
    output_shape holds those at the same coordinates, zeros after them. Overlapping
    windows can name one place twice, with the same value: the sums there are divided by
    the count."""
    x, indices = node.tensor(0), node.tensor(1)
    if x.rank < 3 or indices.shape != x.shape:
        raise node.error(f"its indices of shape {indices.shape} are not those of its input of shape {x.shape}")
    kernel = [int(k) for k in node.attr("kernel_shape")]
    rank = x.rank - 2
    strides = spatial_attr(node, "strides", rank, 1)
    pads = [int(p) for p in node.attr("pads", [0] * 2 * rank)]
    if len(kernel) != rank or len(pads) != 2 * rank:
        raise node.error(f"kernel_shape {kernel} and pads {pads} do not fit its {rank} spatial axes")
    out = [(i - 1) * s + k - b - a for i, s, k, b, a in zip(x.shape[2:], strides, kernel, pads[:rank], pads[rank:])]
    wanted = node.ints(2, "output_shape")[-rank:] if node.optional(2) is not None else out
    if len(wanted) != rank or any(w < o for w, o in zip(wanted, out)):
        raise node.error(f"its output_shape {wanted} is smaller than the {out} its windows cover")
    shape = [*x.shape[:2], *out]
    rows = math.prod(shape)
    flat = indices.reshape([math.prod(x.shape)])
    if flat.dtype != dtypes.DT_INT64:
        flat = flat.cast(dtypes.DT_INT64)
    total = node.b.scatter_add(flat, x.reshape([math.prod(x.shape)]), rows=rows)
    counts = node.b.scatter_add(flat, node.b.broadcast_to(node.b.const(np.asarray(1.0, dtypes.to_numpy(x.dtype))),
                                                          [math.prod(x.shape)]), rows=rows)
    y = (total / node.b.maximum(counts, 1.0)).reshape(shape)
    if wanted == out:
        return y
    return node.b.pad(y, before=[0] * x.rank, after=[0, 0, *[w - o for w, o in zip(wanted, out)]], value=0.0)
