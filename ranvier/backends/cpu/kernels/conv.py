"""Conv2D as an implicit GEMM: y[image] [O, Ho·Wo] = W [O, C·KH·KW] · windows [C·KH·KW, Ho·Wo],
where the generated GEMM packs each block of the windows straight from the image
(`ranvier_sgemm_windows`, sgemm.py) instead of reading an im2col copy of it: the
decomposition's Pad, StridedView and their memory traffic (for ResNet-18 at batch 1,
60 MB written and read again) are gone. The output comes out NCHW, as the GEMM writes it;
a Conv2DCalculate's program (bias, activation, residual) runs over each block after its call.
A convolution marked for bf16 products (`matmul="bfloat16"`) packs its windows as bf16 pairs
and multiplies them on AVX512-BF16's `vdpbf16ps` (`ConvGemmDpbf16`) where that measured faster.

A convolution of few filters (`ConvTiles`) and a filter gradient (`ConvFilterGemm`) instead
multiply one image at a time in register tiles, reading its windows from its padded planes
(stride 1: `_Planes`) or from a copy of them in scratch.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from .... import dtypes
from ....flow.graph import Variable
from ....ops import attrs_of, unchanging_constant
from ....ops.fused import CONV_POOL
from ...kernels import Prepared
from ...llvm.irutil import F32, I32, I64, i64, load, storage_type, whole_lines
from ...llvm.loops import copy_run, fold_lanes, for_vectors, pairwise
from ...llvm.values import Value
from .. import sgemm
from ..codegen import SGEMM_ADD, SGEMM_WINDOWS, SGEMM_WINDOWS_DPBF16, SGEMM_WINDOWS_DPBF16_PAIRED
from ..gemm_choice import windows_pairs_are_faster
from ..parallel import run_parts, shares, thread_count, worth_splitting
from .library import kernel
from .matmul import Blas, GeneratedGemm, gemm_grid, single_threaded_blas
from .program import epilogue

CONV_KERNEL = "ConvGemm"
_UNIT = 16  # edges of the blocks of an image's output a part computes
# A whole image is multiplied in the fewest calls that write at most this much output each
# (ResNet-18's first convolution writes 3.2 MB an image: at batch 32 its bias and ReLU then
# read it back from memory), in columns a multiple of the GEMM's blocks of B (384 on every
# target). Each call takes the filters afresh (on pairs, rounding them) and ends in a part-filled panel:
# its 64 -> 128 convolutions of stride 2 (401 KB an image) in three calls of 262 columns took
# 1.12-1.3 times one of 784 at batch 32 (bf16, Zen 5, two cores, shared), and two of 392 as
# long as one. Conv2DCalculateMaxPool's bands (conv_pool.py) compute as many new rows.
CALL_BYTES = 256 << 10
_CALL_UNIT = 384
_MAX_LANES = 16  # float32 lanes of the widest vectors (AVX-512): scratch is sized for them
# The register tiles of the kernels for few filters: TILE_FILTERS filters by TILE_TAPS taps of
# a filter gradient (each element's partial sums a vector), or by `_TILE_VECTORS` vectors of
# a convolution's positions. Each step loads TILE_FILTERS + 3 vectors (or broadcasts) for 12
# multiply-adds into 12 of AVX2's 16 registers; the other shapes tried were up to 1.9 times slower.
TILE_FILTERS, TILE_TAPS = 4, 3
# AVX-512's 32 registers hold a filter gradient's tile of 5 filters by 4 taps (20 sums, 9
# loads): ResNet-18's 64 × 64 × 3 × 3 filter gradient at batch 32 ran 8% faster than in
# 4 × 3 tiles, 6 × 3 2% (Zen 5, two cores).
WIDE_TILE_FILTERS, WIDE_TILE_TAPS = 5, 4


def _dot_tile_shape(lanes: int) -> tuple[int, int]:
    """(filters, taps) of a filter gradient's dot tiles on vectors of `lanes` floats."""
    return (WIDE_TILE_FILTERS, WIDE_TILE_TAPS) if lanes >= _MAX_LANES else (TILE_FILTERS, TILE_TAPS)


def _sizes(op) -> tuple[int, int, int, int]:
    """(images, output channels, output positions per image, taps)."""
    x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
    return x.shape[0], w.shape[0], y.shape[2] * y.shape[3], math.prod(w.shape[1:])


def fits_windows_gemm(op) -> bool:
    """Whether convolution `op` fits the windows GEMM's geometry (which ConvTiles, ConvStackedGemm
    and Conv2DCalculateMaxPool share): float32 x and w, every offset in an image within the
    GEMM's 32-bit lane arithmetic, an output of at least one element."""
    x, w = op.inputs[0], op.inputs[1]
    return x.dtype == w.dtype == dtypes.DT_FLOAT32 and math.prod(x.shape[1:]) < 1 << 30 and op.outputs[0].size > 0


def _parts(op) -> list[list[tuple[int, int, int, int, int]]]:
    """The calls per worker-pool part, each (image, first row, rows, first column, columns)
    of the output: whole images shared out when there are at least as many as cores (each
    in the fewest calls of at most `CALL_BYTES` of output, so a Conv2DCalculate's program
    finds what it reads in the cache), else each image's output cut into a grid of blocks."""
    images, rows, columns, taps = _sizes(op)
    threads = thread_count() if worth_splitting(2 * op.outputs[0].size * taps, op.inputs[0].nbytes) else 1
    if images >= threads:
        calls = -(-4 * rows * columns // CALL_BYTES)
        return [[(i, 0, rows, c0, c1 - c0) for i in range(first, last) for c0, c1 in shares(columns, calls, _CALL_UNIT)]
                for first, last in shares(images, threads)]
    return [[(i, r0, r1 - r0, c0, c1 - c0)] for i in range(images)
            for (r0, r1), (c0, c1) in gemm_grid(rows, columns, taps, threads // images, _UNIT)]


def _share(op) -> int:
    """A part's scratch: an image's copy the GEMM reads (`copy_bytes`), then packing
    enough for its widest call."""
    taps = _sizes(op)[3]
    return copy_bytes(op) + max(sgemm.workspace_bytes(call[4], taps) for part in _parts(op) for call in part)


def _subsampled(op) -> bool:
    """A 1 × 1 convolution of a stride above 1 and no padding (ResNet's downsamplings): its
    windows are the pixels the stride reads, copied image by image into a plane of them
    (`_copy_subsampled`) that the GEMM reads as one row of positions. Packed straight from
    the image, each vector of them took loads from every other element of a row (or of
    two), and the image's channels went by one row each per block of columns."""
    attrs = attrs_of(op)
    return tuple(op.inputs[1].shape[2:]) == (1, 1) and tuple(attrs["strides"]) != (1, 1) and not any(attrs["padding"])


def phase_planes(op) -> tuple[int, int, int] | None:
    """(s, height, width) of the phase planes a convolution of stride s in both directions
    and a filter larger than 1 × 1 reads (sgemm.GEOMETRY's phases): each image's padded
    channels split once (`copy_phases`) into s × s planes of its rows and columns of each
    remainder mod s, as many as the output's plus the filter's reach over them, so that each
    tap's vector of a row of outputs is one load, where packed straight from the image (stride
    2) it took two loads of every other element and a shuffle: ResNet-18's 64 -> 128 3 × 3
    stride-2 convolution at batch 32 in 0.76 of the time on bf16 pairs, 0.90 in float32
    (batch 1: 0.90). None for other convolutions."""
    stride_height, stride_width = attrs_of(op)["strides"]
    if stride_height != stride_width or stride_height == 1 or _subsampled(op):
        return None
    kernel_height, kernel_width, out_height, out_width = _window_shape(op)
    s = stride_height
    return s, out_height + (kernel_height - 1) // s, out_width + (kernel_width - 1) // s


def copy_bytes(op) -> int:
    """An image's subsampled plane [channels, output positions] or its phase planes, in whole
    cache lines; 0 where the convolution reads its image in place."""
    channels, phases = op.inputs[0].shape[1], phase_planes(op)
    if phases is not None:
        s, height, width = phases
        return whole_lines(4 * channels * s * s * height * width)
    if not _subsampled(op):
        return 0
    out_height, out_width = _window_shape(op)[2:]
    return whole_lines(4 * channels * out_height * out_width)


def _workspace_bytes(op) -> int:
    return len(_parts(op)) * _share(op)


def geometry_values(op) -> list[int]:
    """The GEMM's `geometry`: sgemm.GEOMETRY's values (a `_subsampled` convolution's plane: one
    row of its output positions, read with stride 1; `phase_planes`: read with stride 1,
    their padding in them)."""
    if _subsampled(op):
        out_height, out_width = _window_shape(op)[2:]
        positions = out_height * out_width
        return [1, positions, 1, 1, 1, 1, 0, 0, positions, 1]
    attrs = attrs_of(op)
    (_, _, height, width), (kernel_height, kernel_width) = op.inputs[0].shape, op.inputs[1].shape[2:]
    phases = phase_planes(op)
    if phases is not None:
        s, plane_height, plane_width = phases
        return [plane_height, plane_width, kernel_height, kernel_width, 1, 1, 0, 0, _window_shape(op)[3], s]
    return [height, width, kernel_height, kernel_width, *attrs["strides"], *attrs["padding"], _window_shape(op)[3], 1]


def geometry_constant(ctx, values: list[int]) -> ir.GlobalVariable:
    """The windows GEMM's `geometry` (sgemm.GEOMETRY's `values`) as a constant of the module."""
    array = ir.ArrayType(I64, len(values))
    constant = ir.GlobalVariable(ctx.module, array, name=ctx.module.get_unique_name("conv_geometry"))
    constant.global_constant, constant.linkage = True, "internal"
    constant.initializer = ir.Constant(array, [i64(v) for v in values])
    return constant


TILES_KERNEL = "ConvTiles"
# A convolution with at most this many filters is computed by `conv_tiles`: the GEMM's packed
# panels of the windows serve each of its few filters' rows, so packing them costs as much
# as the multiply-adds (the MNIST CNN's 8 and 16 filters: 46-66 GFLOP/s). Copying each
# image's windows costs as much too, past 16 filters; a stride-1 convolution copies none
# (`_Planes`), and its tiles measured 0.72-0.97 of the GEMM's time up to 64 filters (5 × 5,
# 7 × 7 and 1 × 1 filters, 3 to 256 channels, 14 × 14 to 112 × 112 images; AVX2 EPYC, two
# cores), 1.07 at 128 filters of 128 channels.
FEW_FILTERS = 16
PLANE_FILTERS = 64
# The tiles are tried before Winograd's kernel (registered `first`), which multiplies a 3 × 3
# stride-1 convolution's transformed tiles in a quarter of the multiply-adds but transforms
# every tile of the input and the output: with at most this many pairs of channels and
# filters the tiles measured 0.5-0.9 of its time (3 to 32 channels, 8 to 32 filters, 14 ×
# 14 to 32 × 32 images), with 1,024 0.9-1.2, with 4,096 1.6-2.2 (AVX2 EPYC, two cores).
WINOGRAD_PAIRS = 512
_TILE_VECTORS = 3


def _tiled(op) -> bool:
    """float32, few filters, and at least an image for each of the pool's parts (fewer,
    and the GEMM shares out the blocks of an image); a 3 × 3 stride-1 convolution of
    many channels and filters is Winograd's."""
    images, filters = _sizes(op)[:2]
    planes = _planes(op)
    most = FEW_FILTERS if planes is None else PLANE_FILTERS
    winograds = (planes is not None and (planes.kernel_height, planes.kernel_width) == (3, 3)
                 and planes.channels * filters > WINOGRAD_PAIRS)
    return fits_windows_gemm(op) and filters <= most and not winograds and images >= _tile_threads(op)


def _tile_threads(op) -> int:
    taps = _sizes(op)[3]
    return thread_count() if worth_splitting(2 * op.outputs[0].size * taps, op.inputs[0].nbytes) else 1


def _tile_parts(op) -> list[tuple[int, int]]:
    """The images each worker-pool part takes."""
    return shares(_sizes(op)[0], _tile_threads(op))


def _windows_stride(positions: int, lanes: int) -> int:
    """Elements between the windows' rows: the positions rounded up to whole vectors."""
    return -(-positions // lanes) * lanes


@dataclass(frozen=True)
class _Planes:
    """A stride-1 convolution's image padded once into planes (channels × height × width,
    the padding included), where tap (c, i, j)'s windows for output row y are the run of the
    planes from c·plane + (i + y)·width + j: a row of the output read as whole vectors (its
    last one past the row's end, which is computed and dropped, or masked) is contiguous
    there. No windows are copied: the image and its padding are."""

    channels: int
    height: int
    width: int
    kernel_height: int
    kernel_width: int
    out_height: int
    out_width: int

    @property
    def plane(self) -> int:
        return self.height * self.width

    def length(self, lanes: int) -> int:
        """Elements of the padded image, and past it as far as the last tap's last vector of
        the last output row reads."""
        reach = (self.kernel_height - 1) * self.width + self.kernel_width - 1
        return (self.channels - 1) * self.plane + reach + (self.out_height - 1) * self.width + _windows_stride(self.out_width, lanes)

    def tap_start(self, c: Value | int, i: Value | int, j: Value | int) -> Value | int:
        """Where tap (c, i, j)'s row of windows starts in the planes."""
        return c * self.plane + i * self.width + j

    def tap_row(self, t: Value | int) -> Value | int:
        """Where tap t's row of windows starts in the planes."""
        area = self.kernel_height * self.kernel_width
        return self.tap_start(t // area, t % area // self.kernel_width, t % self.kernel_width)

    def scratch_elements(self, filters: int) -> int:
        """A part's scratch (`_planes_scratch`) on any target: the planes, then `filters`
        planes of output rows each rounded up to whole vectors."""
        rows = self.out_height * _windows_stride(self.out_width, _MAX_LANES)
        return _windows_stride(self.length(_MAX_LANES), _MAX_LANES) + filters * rows


def _window_shape(op) -> tuple[int, int, int, int]:
    """(kernel height, kernel width, output height, output width) of a convolution (x, w → y),
    its filter gradient (x, dy → dw) or a convolution and its max pool (CONV_POOL: the
    convolution's output, which the pool reads)."""
    if op.type == "Conv2DBackpropFilter":
        return (*attrs_of(op)["filter_shape"][2:], *op.inputs[1].shape[2:])
    if op.type == CONV_POOL:
        attrs = attrs_of(op)
        sizes = zip(op.inputs[0].shape[2:], op.inputs[1].shape[2:], attrs["strides"], attrs["padding"])
        return (*op.inputs[1].shape[2:], *((size + 2 * pad - extent) // stride + 1 for size, extent, stride, pad in sizes))
    return (*op.inputs[1].shape[2:], *op.outputs[0].shape[2:])


def _planes(op) -> _Planes | None:
    """The padded planes of a stride-1 convolution (or of its filter gradient's input); None
    for another stride (its windows are copied instead)."""
    attrs = attrs_of(op)
    if tuple(attrs["strides"]) != (1, 1):
        return None
    (_, channels, height, width), (pad_height, pad_width) = op.inputs[0].shape, attrs["padding"]
    return _Planes(channels, height + 2 * pad_height, width + 2 * pad_width, *_window_shape(op))


def _planes_scratch(ctx, name: str, dtype: str, planes: _Planes, filters: int, lanes: int,
                    at: ir.Value) -> tuple[Variable, Variable, int]:
    """A part's padded planes, their padding zeroed once (each image writes only the inside),
    and after them `filters` planes of output rows each `row` elements long, from `at`:
    (planes, rows, row)."""
    length, row = _windows_stride(planes.length(lanes), lanes), _windows_stride(planes.out_width, lanes)
    padded = ctx.scratch(f"{name}/planes", dtype, length, at)
    rows = ctx.scratch(f"{name}/rows", dtype, filters * planes.out_height * row, ctx.b.gep(at, [i64(length)]))
    for_vectors(ctx, 0, length, lanes, lambda i, n: ctx.store(padded, i, ctx.constant(dtype, 0.0, n)))
    return padded, rows, row


def _copy_planes(ctx, op, image: Value, planes: _Planes, padded) -> None:
    """The inside of image `image` of `op`'s input into its padded planes `padded` (whose
    padding is zero already)."""
    x = op.inputs[0]
    (_, channels, height, width), (pad_height, pad_width) = x.shape, attrs_of(op)["padding"]
    with ctx.loop(0, channels * height, name="row") as row:
        c, r = row // height, row % height
        copy_run(ctx, x, (image * channels + c) * (height * width) + r * width, padded,
                 c * planes.plane + (r + pad_height) * planes.width + pad_width, width, ctx.lanes_for([x.dtype]))


def _tiles_share(op) -> int:
    """A part's scratch in elements: one image's padded planes and its output with rows whole
    vectors long, or one image's windows, rows whole vectors apart."""
    _, filters, positions, taps = _sizes(op)
    planes = _planes(op)
    if planes is None:
        return taps * _windows_stride(positions, _MAX_LANES)
    return planes.scratch_elements(filters)


@kernel(TILES_KERNEL, {"Conv2D", "Conv2DCalculate"}, supports=_tiled, rank=10,
        workspace=lambda op: len(_tile_parts(op)) * _tiles_share(op) * 4)
def conv_tiles(ctx, op) -> None:
    """y[image] [O, Ho·Wo] = W · windows, a part's images one at a time, multiplied in
    register tiles (`_tile_products`), then the Conv2DCalculate's program over the image's
    output while it is in cache. With stride 1 the tiles read the image's padded planes
    (`_Planes`: each output row rounded up to whole vectors, the extra columns computed and
    dropped as the output is gathered), else each image's windows are copied into scratch
    (`_copy_windows`) and read there."""
    w, y = op.inputs[1], op.outputs[0]
    _, filters, positions, taps = _sizes(op)
    f32 = dtypes.DT_FLOAT32
    lanes = ctx.lanes_for([f32])
    planes, share = _planes(op), _tiles_share(op)

    def part(number: int, first: int, last: int):
        def emit(ctx) -> None:
            base = ctx.b.bitcast(ctx.address(ctx.workspace), storage_type(f32).as_pointer())
            scratch = ctx.b.gep(base, [i64(number * share)])
            if planes is None:
                windowed(ctx, scratch, first, last)
            else:
                padded(ctx, scratch, first, last, planes)

        return emit

    def windowed(ctx, scratch: ir.Value, first: int, last: int) -> None:
        stride = _windows_stride(positions, lanes)
        rows = ctx.scratch(f"{op.name}/windows", f32, taps * stride, scratch)
        if stride > positions:  # the rows' ends, read by the last tiles but never stored from
            with ctx.loop(0, taps, name="tap") as t:
                for_vectors(ctx, t * stride + positions, stride - positions, lanes, lambda at, n: ctx.store(rows, at, 0.0))

        def each_tap(body) -> None:
            with ctx.loop(0, taps, name="tap") as t:
                body(t, t * stride)

        with ctx.loop(first, last, name="image") as image:
            _copy_windows(ctx, op, image, rows, stride)
            at = image * (filters * positions)
            _tile_products(ctx, w, rows, each_tap, y, at, filters, taps, positions, lanes)
            epilogue(ctx, op, at, filters, positions)

    def padded(ctx, scratch: ir.Value, first: int, last: int, planes: _Planes) -> None:
        # the output's rows rounded up to whole vectors: position p is row p // row, column p % row
        image_planes, computed, row = _planes_scratch(ctx, op.name, f32, planes, filters, lanes, scratch)
        rows = planes.out_height * row
        kernel_height, kernel_width = planes.kernel_height, planes.kernel_width

        def each_tap(body) -> None:
            with ctx.loop(0, planes.channels, name="channel") as c, ctx.loop(0, kernel_height, name="ki") as i:
                for j in range(kernel_width):
                    body((c * kernel_height + i) * kernel_width + j, planes.tap_start(c, i, j))

        def in_planes(p: Value | int) -> Value | int:
            return p // row * planes.width + p % row

        with ctx.loop(first, last, name="image") as image:
            _copy_planes(ctx, op, image, planes, image_planes)
            _tile_products(ctx, w, image_planes, each_tap, computed, 0, filters, taps, rows, lanes, in_planes)
            at = image * (filters * positions)
            with ctx.loop(0, filters * planes.out_height, name="out_row") as r:
                copy_run(ctx, computed, r * row, y, at + r * planes.out_width, planes.out_width, lanes)
            epilogue(ctx, op, at, filters, positions)

    run_parts(ctx, [part(number, first, last) for number, (first, last) in enumerate(_tile_parts(op))])


def _copy_even(ctx, source, source_at: Value, target, target_at: Value, count: int, lanes: int) -> None:
    """Every other element of `source` from `source_at`, `count` of them, to contiguous ones
    of `target` (a stride-2 convolution's windows): vectors as wide as fit, each picked from
    two loads whose second ends at the vector's last element (so nothing past it is read),
    the last one overlapping the one before as `copy_run`'s does."""
    w = 1 << (min(lanes, count).bit_length() - 1)
    picks = [2 * k if 2 * k < w else 2 * k + 1 for k in range(w)]

    def vector(at: Value | int) -> None:
        low, high = ctx.load(source, source_at + 2 * at, w), ctx.load(source, source_at + 2 * at + (w - 1), w)
        ctx.store(target, target_at + at, low.shuffle(picks, high))

    with ctx.loop(0, count - w + 1, step=w, name="even") as at:
        vector(at)
    if count % w:
        vector(count - w)


def _tile_products(ctx, w, windows, each_tap, y, at: Value | int, filters: int, taps: int, positions: int,
                   lanes: int, in_windows=lambda p: p) -> None:
    """y[f, p] = Σ_t w[f, t] · windows[t, p] for y's rows from element `at`: tiles of
    `TILE_FILTERS` filters by `_TILE_VECTORS` vectors of positions, each output vector a
    register along the taps, which read a row of windows per step (`each_tap(body)` calls
    `body(t, where tap t's row starts)`, and position p of it is `in_windows(p)` further, a
    vector's positions contiguous); a column of tiles reads the same stretch of windows, so
    it stays in L1 while the column's filters go by. The last tiles may be narrower or lower;
    their vectors past the positions are not stored."""
    f32 = dtypes.DT_FLOAT32

    def tile(f0: Value | int, p0: Value | int, height: int, vectors: int) -> None:
        sums = [[ctx.local(f32, lanes, 0.0) for _ in range(vectors)] for _ in range(height)]
        offsets = [in_windows(p0 + v * lanes) for v in range(vectors)]

        def step(t, start) -> None:
            row = [ctx.load(windows, start + offset, lanes) for offset in offsets]
            for f in range(height):
                factor = ctx.load(w, (f0 + f) * taps + t).splat(lanes)
                for v, total in enumerate(sums[f]):
                    total.set(factor.mul_add(row[v], total.value))

        each_tap(step)
        for f in range(height):
            for v, total in enumerate(sums[f]):
                start = p0 + v * lanes
                target = at + (f0 + f) * positions + start
                valid = lanes if isinstance(p0, Value) else min(lanes, positions - start)
                if valid == lanes:
                    ctx.store(y, target, total.value)
                else:
                    value = total.value
                    for r in range(valid):
                        ctx.store(y, target + r, value.lane(r))

    def column(p0: Value | int, width: int) -> None:
        _by_tiles(ctx, filters, TILE_FILTERS, "f0", lambda f0, height: tile(f0, p0, height, -(-width // lanes)))

    _by_tiles(ctx, positions, _TILE_VECTORS * lanes, "p0", column)


def _by_tiles(ctx, count: int, size: int, name: str, emit) -> None:
    """`emit(first, width)` over [0, count): tiles of `size` in a run-time loop, then the
    narrower one left at the end."""
    whole = count - count % size
    if whole:
        with ctx.loop(0, whole, step=size, name=name) as first:
            emit(first, size)
    if whole < count:
        emit(whole, count - whole)


PAIRS_KERNEL = "ConvGemmDpbf16"


def _on_pairs(op) -> bool:
    """A convolution marked for bf16 products."""
    return fits_windows_gemm(op) and attrs_of(op)["precision"] == "bfloat16"


def _pairs_faster(op) -> bool:
    """Whether the GEMM on its windows in bf16 pairs measured faster than the float32 one,
    on the largest call a part makes."""
    _, _, count, _, width = max((call for part in _parts(op) for call in part), key=lambda call: call[2] * call[4])
    return windows_pairs_are_faster(count, width, _sizes(op)[3], tuple(geometry_values(op)))


PAIRED_FILTERS = "filters' rows in bf16 pairs (sgemm.paired_rows)"
WINDOWS_PAIRS_CALLS = frozenset({SGEMM_WINDOWS_DPBF16, SGEMM_WINDOWS_DPBF16_PAIRED})


def paired_filters(op) -> list[Prepared]:
    """Constant filters [O, C, KH, KW] rounded into bf16 pairs once, with the network, as rows of
    their C·KH·KW taps (`sgemm.paired_rows`): the windows GEMM on pairs reads them in place,
    half the bytes of the float32 filters it would round call by call. None for filters
    that change (a training step's)."""
    w = op.inputs[1]
    if not unchanging_constant(w):
        return []
    return [Prepared(w, PAIRED_FILTERS, lambda value, target: sgemm.paired_rows(value.reshape(value.shape[0], -1)))]


def windows_filters(ctx, op, slot: int) -> tuple[int, Callable[[Value | int], ir.Value], int]:
    """The windows GEMM a call of `op` makes and the filters it reads: (its pointer-table slot,
    the address of filter row r, the rows' stride). On pairs (`slot` SGEMM_WINDOWS_DPBF16),
    constant filters are `paired_filters`' rows, read by the `_paired` entry; else the
    float32 filters."""
    w = op.inputs[1]
    taps = math.prod(w.shape[1:])
    if slot != SGEMM_WINDOWS_DPBF16 or not unchanging_constant(w):
        return slot, lambda row: ctx.element_pointer(w, row * taps), taps
    slots = sgemm.paired_row_slots(taps)
    rows = ctx.prepared(w, PAIRED_FILTERS, I32)

    def row_address(row: Value | int) -> ir.Value:
        at = (row * slots).ir if isinstance(row, Value) else i64(row * slots)
        return ctx.b.bitcast(ctx.b.gep(rows, [at]), F32.as_pointer())

    return SGEMM_WINDOWS_DPBF16_PAIRED, row_address, slots


@kernel(PAIRS_KERNEL, {"Conv2D", "Conv2DCalculate"}, supports=_on_pairs, rank=40, prefer=_pairs_faster,
        workspace=_workspace_bytes, prepares=paired_filters, calls=WINDOWS_PAIRS_CALLS)
def conv_gemm_pairs(ctx, op) -> None:
    """ConvGemm's calls on `ranvier_sgemm_windows_dpbf16`: filters and windows rounded to bf16
    pairs, float32 sums; constant filters rounded once (`paired_filters`)."""
    _call_windows(ctx, op, SGEMM_WINDOWS_DPBF16)


@kernel(CONV_KERNEL, {"Conv2D", "Conv2DCalculate"}, supports=fits_windows_gemm, rank=50, workspace=_workspace_bytes,
        calls=frozenset({SGEMM_WINDOWS}))
def conv_gemm(ctx, op) -> None:
    _call_windows(ctx, op, SGEMM_WINDOWS)


def _call_windows(ctx, op, slot: int) -> None:
    """Each part's calls of the windows GEMM in pointer-table `slot`, each followed by the
    op's epilogue over the block it wrote; a `_subsampled` or `phase_planes` convolution's calls
    read the plane(s) its part copied of their image, once for all of the image's calls."""
    y = op.outputs[0]
    _, rows, columns, taps = _sizes(op)
    share = _share(op)
    geometry = geometry_constant(ctx, geometry_values(op))

    def part(calls, number: int):
        def emit(ctx) -> None:
            b = ctx.b
            entry, filters, lda = windows_filters(ctx, op, slot)
            gemm = b.bitcast(ctx.table_entry(entry), sgemm.WINDOWS_FUNCTION.as_pointer())
            base = b.gep(ctx.address(ctx.workspace), [i64(number * share)])
            scratch = b.gep(base, [i64(copy_bytes(op))])
            bring, source = image_reader(ctx, op, base)
            copied = None  # the image whose copy the scratch holds
            for image, r0, count, c0, width in calls:
                if image != copied:
                    bring(image)
                    copied = image
                b.call(gemm, [i64(count), i64(width), i64(taps), filters(r0), i64(lda),
                              source(image), b.bitcast(geometry, I64.as_pointer()), i64(c0),
                              ctx.element_pointer(y, (image * rows + r0) * columns + c0), i64(columns), scratch])
                epilogue(ctx, op, (image * rows + r0) * columns + c0, count, width)

        return emit

    run_parts(ctx, [part(calls, number) for number, calls in enumerate(_parts(op))])


def image_reader(ctx, op, at: ir.Value) -> tuple[Callable[[Value | int], None], Callable[[Value | int], ir.Value]]:
    """How a part's windows GEMM reads the images of `op` (a convolution, or one with its
    max pool): (bring(image), which copies the image into the part's scratch at `at` where
    the GEMM reads a copy (`copy_bytes` of it: a `_subsampled` plane or `phase_planes`, whose
    padding is zeroed here, once, as no image's copy writes it), and source(image), the
    address the GEMM's `image` argument takes)."""
    x = op.inputs[0]
    plane_bytes, image_size = copy_bytes(op), math.prod(x.shape[1:])
    if not plane_bytes:
        return (lambda image: None), (lambda image: ctx.element_pointer(x, image * image_size))
    plane = ctx.scratch(f"{op.name}/copy", dtypes.DT_FLOAT32, plane_bytes // 4, at)
    copy = _copy_subsampled if phase_planes(op) is None else copy_phases
    if copy is copy_phases:
        for_vectors(ctx, 0, plane_bytes // 4, ctx.lanes_for([x.dtype]),
                    lambda at, n: ctx.store(plane, at, ctx.constant(x.dtype, 0.0, n)))
    return (lambda image: copy(ctx, op, image, plane)), (lambda image: ctx.element_pointer(plane, 0))


def _copy_subsampled(ctx, op, image: Value | int, plane: Variable) -> None:
    """The pixels of image `image` a `_subsampled` convolution reads, [channels, output
    positions] into `plane`: a stride-2 row in vectors picked from pairs of loads."""
    x = op.inputs[0]
    (_, channels, height, width), (out_height, out_width) = x.shape, _window_shape(op)[2:]
    stride_height, stride_width = attrs_of(op)["strides"]
    lanes = ctx.lanes_for([x.dtype])
    with ctx.loop(0, channels * out_height, name="subsampled_row") as row:
        source = (image * channels + row // out_height) * (height * width) + row % out_height * (stride_height * width)
        if stride_width == 2 and out_width > 1:
            _copy_even(ctx, x, source, plane, row * out_width, out_width, lanes)
        else:
            with ctx.loop(0, out_width, name="subsampled_column") as xo:
                ctx.store(plane, row * out_width + xo, ctx.load(x, source + xo * stride_width))


def copy_phases(ctx, op, image: Value | int, planes: Variable, plane_rows: int | None = None,
                from_row: Value | int = 0) -> None:
    """The inside of image `image` into its `phase_planes` (their padding is zero already),
    each `plane_rows` rows (else the phases' height) with the image's from `from_row`: for
    each remainder a of the padded rows and b of the columns, the image's rows and columns
    there, as far as the planes reach; with stride 2 a row's run in vectors picked from pairs
    of loads."""
    x = op.inputs[0]
    (_, channels, height, width), (pad_height, pad_width) = x.shape, attrs_of(op)["padding"]
    phases = phase_planes(op)
    assert phases is not None
    s, plane_height, plane_width = phases
    plane_rows = plane_height if plane_rows is None else plane_rows
    lanes = ctx.lanes_for([x.dtype])

    def inside(pad: int, size: int, reach: int, a: int) -> tuple[int, int, int]:
        """(first input index, first plane index, count) of remainder a's indices in the image."""
        first = (a - pad) % s
        count = max(0, min(-(-(size - first) // s), reach - (first + pad) // s))
        return first, (first + pad) // s, count

    for a in range(s):
        first_row, plane_row, rows = inside(pad_height, height, plane_height, a)
        for b in range(s):
            first_column, plane_column, count = inside(pad_width, width, plane_width, b)
            if not rows or not count:
                continue
            with ctx.loop(0, channels * rows, name="phase_row") as row:
                c, r = row // rows, row % rows
                source = ((image * channels + c) * height + first_row + r * s) * width + first_column
                target = (((c * s + a) * s + b) * plane_rows + from_row + plane_row + r) * plane_width + plane_column
                if s == 2 and count > 1:
                    _copy_even(ctx, x, source, planes, target, count, lanes)
                else:
                    with ctx.loop(0, count, name="phase_column") as q:
                        ctx.store(planes, target + q, ctx.load(x, source + q * s))


def _copy_windows(ctx, op, image: Value, windows: Variable, row_stride: int, column: Value | int = 0,
                  out_rows: tuple[Value | int, int] | None = None) -> None:
    """An image's windows (its im2col matrix) into `windows`: row (c, i, j), `row_stride`
    elements apart, holds from `column` on the image's element under tap (i, j) of each
    output position (of `out_rows`, (first, count), where given: else all), zero in the
    padding. A channel's taps are unrolled, so each one's run of output columns inside the
    image is known here, its copy planned in vectors, and only a row's top and bottom edges
    are checked as it runs. `op` is the convolution (x, w → y) or its filter gradient
    (x, dy → dw)."""
    x = op.inputs[0]
    (_, channels, height, width) = x.shape
    attrs = attrs_of(op)
    kernel_height, kernel_width, out_height, out_width = _window_shape(op)
    (stride_height, stride_width), (pad_height, pad_width) = attrs["strides"], attrs["padding"]
    first_row, row_count = out_rows or (0, out_height)
    b = ctx.b
    lanes = ctx.lanes_for([x.dtype])

    def zeros(row: Value, start: int, stop: int) -> None:
        for_vectors(ctx, row + start, stop - start, lanes, lambda at, w: ctx.store(windows, at, ctx.constant(x.dtype, 0.0, w)))

    def run(row: Value, source: Value, first: int, last: int) -> None:
        """Output columns [first, last) of a row from the image's row at `source`."""
        if stride_width == 2 and last - first > 1:
            _copy_even(ctx, x, source + 2 * first, windows, row + first, last - first, lanes)
        elif stride_width != 1:
            with ctx.loop(first, last, name="inside") as xo:
                ctx.store(windows, row + xo, ctx.load(x, source + xo * stride_width))
        elif last > first:
            copy_run(ctx, x, source + first, windows, row + first, last - first, lanes)

    with ctx.loop(0, channels, name="channel") as c:
        for i in range(kernel_height):
            for j in range(kernel_width):
                # the output columns whose input column xo·s - p + j lies in the image
                first = min(out_width, max(0, -(-(pad_width - j) // stride_width)))
                last = max(first, min(out_width, (width - 1 + pad_width - j) // stride_width + 1))
                tap = (c * kernel_height + i) * kernel_width + j
                with ctx.loop(first_row, first_row + row_count, name="yo") as yo:
                    y = yo * stride_height - pad_height + i
                    row = tap * row_stride + column + (yo - first_row) * out_width
                    source = ((image * channels + c) * height + y) * width + j - pad_width
                    with b.if_else(((y >= 0) & (y < height)).ir) as (inside, padding):
                        with inside:
                            zeros(row, 0, first)
                            run(row, source, first, last)
                            zeros(row, last, out_width)
                        with padding:
                            zeros(row, 0, out_width)


FILTER_GRADIENT_KERNEL = "ConvFilterGemm"
# A float32 filter gradient of at least this many filters is a GEMM on the generated
# `ranvier_sgemm_add`, slab by slab of positions (`_filter_gradient_way`); fewer, and the dot tiles'
# are faster (no packing: the MNIST CNN's 8 and 16 filters). With stride 1 the tiles read
# the padded planes and copy no windows: they ran 1.2-1.9 times as fast as the slabs up to
# 32 filters (1 to 32 channels, 3 × 3 and 5 × 5, 14 × 14 to 32 × 32 images), 1.3 at 64
# filters of 32 channels, as fast at 64 of 64 (ResNet-18's 56 × 56); with stride 2 the
# slabs 2.7 times as fast at 32 filters (Zen 5, two cores, batch 32). Only on AVX-512: the
# generated GEMM's AVX2 variant (4 × 3 tiles of 8 lanes) ran these products at 60 GFLOP/s a
# core, half the AVX2 dot tiles' rate (Zen 5 masked to AVX2), so there the tiles and BLAS
# stay (`_filter_gradient_way`).
SLAB_FILTERS = 32
PLANE_SLAB_FILTERS = 128
# A slab takes at least this many positions (output rows of an image, or whole images):
# the GEMM's depth, deep enough that reading and writing the sums of dw once a slab costs
# little beside its multiply-adds, shallow enough that the slab's copied windows stay in L2.
_SLAB_POSITIONS = 512


def _filter_gradient_parts(op) -> list[tuple[int, int]]:
    """The images each worker-pool part takes."""
    x, dy = op.inputs
    flops = 2 * dy.size * math.prod(op.outputs[0].shape[1:])
    threads = thread_count() if worth_splitting(flops, x.nbytes + dy.nbytes) else 1
    return shares(x.shape[0], threads)


def _slab_shape(op) -> tuple[int, int]:
    """(images, output rows of each) a slab takes: whole rows of one image where an image has
    `_SLAB_POSITIONS`, else whole images, as many as a part has at most."""
    out_height, out_width = op.inputs[1].shape[2:]
    positions = out_height * out_width
    if positions >= _SLAB_POSITIONS:
        return 1, -(-_SLAB_POSITIONS // out_width)
    most = max(last - first for first, last in _filter_gradient_parts(op))
    return min(most, -(-_SLAB_POSITIONS // positions)), out_height


def _gemm_bytes(op, wide: bool) -> int:
    """The generated GEMM's workspace at the start of a part's scratch (none off slabs), in
    whole cache lines."""
    if _filter_gradient_way(op, wide) != "slabs":
        return 0
    images, rows = _slab_shape(op)
    depth = images * rows * op.inputs[1].shape[3]
    return whole_lines(sgemm.workspace_bytes(math.prod(op.outputs[0].shape[1:]), depth))


def _filter_gradient_share(op, wide: bool) -> int:
    """A part's scratch in bytes, whole cache lines: on slabs the GEMM's workspace, its own sum
    of dw, a slab's windows [taps, positions] and (a slab of several images) its dy rows
    [filters, positions]; else its own sum of dw (in float32 a vector of partial sums per
    element, `_MAX_LANES` wide), then one image's windows [taps, positions] or, with padded
    planes, the image's planes and its dy with rows whole vectors long."""
    dy, dw = op.inputs[1], op.outputs[0]
    taps = math.prod(dw.shape[1:])
    way = _filter_gradient_way(op, wide)
    if way == "slabs":
        images, rows = _slab_shape(op)
        depth = images * rows * dy.shape[3]
        elements = dw.size + taps * depth + (dy.shape[1] * depth if images > 1 else 0)
    else:
        sums = dw.size * (_MAX_LANES if way == "tiles" else 1)
        planes = _gradient_planes(op, wide)
        rest = taps * (dy.shape[2] * dy.shape[3]) if planes is None else planes.scratch_elements(dy.shape[1])
        elements = sums + rest
    return _gemm_bytes(op, wide) + whole_lines(elements * dtypes.itemsize(dw.dtype))


def _gradient_planes(op, wide: bool) -> _Planes | None:
    """The padded planes a float32 filter gradient of stride 1 reads its windows from."""
    return _planes(op) if _filter_gradient_way(op, wide) == "tiles" else None


# The dot tiles keep a vector of partial sums per element of dw, read and written once an
# image: past the L2 cache, with fewer positions an image than a vector's bytes (ResNet-18's
# last stage: 7 × 7), that traffic outweighs the multiply-adds (a 512 × 512 × 3 × 3 filter
# gradient at batch 32: 986 ms, BLAS's GEMM an image 425 ms, PyTorch's 420 ms).
_SUMS_IN_CACHE_BYTES = 1 << 20
_FEWEST_POSITIONS_PAST_CACHE = 64


def _filter_gradient_way(op, wide: bool) -> str:
    """How the filter gradient's products are computed, on AVX-512 (`wide`) or narrower
    vectors: "slabs" (the generated GEMM, float32 on AVX-512: many filters, more where the
    tiles would read padded planes, or partial sums of the dot tiles that would leave the
    cache), "tiles" (`_add_dot_tiles`, float32) or "blas" (a BLAS call an image: float64, and
    float32 off AVX-512 where the tiles' sums would leave the cache)."""
    dy, dw = op.inputs[1], op.outputs[0]
    if dw.dtype != dtypes.DT_FLOAT32:
        return "blas"
    sums_bytes = dw.size * _MAX_LANES * dtypes.itemsize(dw.dtype)
    past_cache = sums_bytes > _SUMS_IN_CACHE_BYTES and dy.shape[2] * dy.shape[3] < _FEWEST_POSITIONS_PAST_CACHE
    fewest = SLAB_FILTERS if _planes(op) is None else PLANE_SLAB_FILTERS
    if wide and (dy.shape[1] >= fewest or past_cache):
        return "slabs"
    return "blas" if past_cache else "tiles"


def _wide(target) -> bool:
    """Whether the target's vectors are AVX-512's."""
    return target.lanes(4) >= _MAX_LANES


def _filter_gradient_workspace(op) -> int:
    """Enough for either vector width's way."""
    return len(_filter_gradient_parts(op)) * max(_filter_gradient_share(op, wide) for wide in (False, True))


def _float32_or_64(op) -> bool:
    return op.outputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64) and op.outputs[0].size > 0


@kernel(FILTER_GRADIENT_KERNEL, {"Conv2DBackpropFilter"}, supports=_float32_or_64, workspace=_filter_gradient_workspace,
        calls=frozenset({SGEMM_ADD}))
def conv_filter_gradient(ctx, op) -> None:
    """dw [O, C·KH·KW] = Σ over images of dy[n] [O, Ho·Wo] · windows[n]ᵀ, each part's images
    added into the part's own sum, the parts' sums then added into dw. The decomposition's
    im2col of the whole batch (the MNIST CNN's 20 MB) is never written.

    In float32 with many filters, on AVX-512 (`_filter_gradient_way`), the positions go by in
    slabs (`_slab_shape`):
    a slab's windows are copied into the part's scratch, where L2 holds them, and the
    generated GEMM adds dy's slab times their transpose into the part's sum (`ranvier_sgemm_add`:
    its micro-kernel's register tiles, the windows packed into its panels as it goes). A
    slab of part of an image reads dy in place; one of several images (few positions each)
    copies their rows of dy side by side first, so the GEMM's depth and not the image's
    bounds how often the sums are read and written.

    Both factors run along the positions, so each element of dw is a dot product of two
    contiguous rows. With few filters (any filters off AVX-512), in float32, these are
    computed in tiles (`_add_dot_tiles`): no packing, and every lane of every multiply-add is
    dw's, where a GEMM per image spent as long packing its few rows (8 filters of 25 taps:
    31 GFLOP/s) as multiplying. In float64 each image is one BLAS call, as in float32 off
    AVX-512 where the tiles' partial sums would stream from memory for few positions.

    With stride 1, the float32 tiles read the windows from the image's padded planes instead
    (`_Planes`, as ConvTiles does), output row by output row, and dy from a copy whose rows
    are whole vectors: the planes and dy stay in L1, where the copied windows (the MNIST CNN's
    second: 156 KiB an image) streamed from L2."""
    dy, dw = op.inputs[1], op.outputs[0]
    (_, filters, out_height, out_width) = dy.shape
    taps, positions = math.prod(dw.shape[1:]), out_height * out_width
    element = storage_type(dw.dtype)
    wide = _wide(ctx.target)
    way = _filter_gradient_way(op, wide)
    share, parts, gemm_bytes = _filter_gradient_share(op, wide), _filter_gradient_parts(op), _gemm_bytes(op, wide)
    single_threaded_blas(ctx)
    lanes = ctx.lanes_for([dw.dtype])
    sum_lanes = lanes if way == "tiles" else 1
    planes = _gradient_planes(op, wide)

    def scratch(ctx, number: int) -> tuple[ir.Value, ir.Value]:
        """A part's sum of dw, and the rest of its scratch."""
        start = ctx.b.gep(ctx.address(ctx.workspace), [i64(number * share + gemm_bytes)])
        total = ctx.b.bitcast(start, element.as_pointer())
        return total, ctx.b.gep(total, [i64(dw.size * sum_lanes)])

    def part(number: int, first: int, last: int):
        def emit(ctx) -> None:
            total, rest = scratch(ctx, number)
            sums = ctx.scratch(f"{op.name}/sums", dw.dtype, dw.size * sum_lanes, total)
            for_vectors(ctx, 0, dw.size * sum_lanes, lanes, lambda i, w: ctx.store(sums, i, ctx.constant(dw.dtype, 0.0, w)))
            if way == "slabs":
                on_slabs(ctx, number, first, last, total, rest)
                return
            if planes is not None:
                on_planes(ctx, first, last, sums, rest, planes)
                return
            blas = None if way == "tiles" else Blas(ctx, dw.dtype)
            rows = ctx.scratch(f"{op.name}/windows", dw.dtype, taps * positions, rest)
            with ctx.loop(first, last, name="image") as image:
                _copy_windows(ctx, op, image, rows, positions)
                if blas is None:
                    walk = _flat_positions(ctx, dy, rows, image * (filters * positions), taps, positions, lanes)
                    _add_dot_tiles(ctx, sums, filters, taps, lanes, walk)
                else:
                    gradient = ctx.b.gep(ctx.pointer(dy), [(image * (filters * positions)).ir])
                    blas.gemm(False, True, filters, taps, positions, gradient, positions, rest, positions, total, taps,
                              add=True)

        return emit

    def on_slabs(ctx, number: int, first: int, last: int, total: ir.Value, rest: ir.Value) -> None:
        """The part's positions slab by slab into its sum `total`."""
        images, rows = _slab_shape(op)
        depth = images * rows * out_width
        windows = ctx.scratch(f"{op.name}/windows", dw.dtype, taps * depth, rest)
        gemm = GeneratedGemm(ctx, SGEMM_ADD, number, share)

        def add_product(steps: int, gradient: ir.Value, gradient_stride: int) -> None:
            """total += dy's slab [filters, steps] · the slab's windows [taps, steps]ᵀ."""
            gemm.gemm(False, True, filters, taps, steps, gradient, gradient_stride, ctx.pointer(windows), steps, total, taps)

        def rows_slab(image: Value, first_row: Value | int, count: int) -> None:
            _copy_windows(ctx, op, image, windows, count * out_width, out_rows=(first_row, count))
            add_product(count * out_width, ctx.element_pointer(dy, image * (filters * positions) + first_row * out_width),
                        positions)

        def images_slab(first_image: Value | int, count: int) -> None:
            steps = count * positions
            with ctx.loop(0, count, name="in_slab") as g:
                _copy_windows(ctx, op, first_image + g, windows, steps, column=g * positions)
                with ctx.loop(0, filters, name="filter") as f:
                    copy_run(ctx, dy, ((first_image + g) * filters + f) * positions, gradient_rows, f * steps + g * positions,
                             positions, lanes)
            add_product(steps, ctx.pointer(gradient_rows), steps)

        if images == 1:
            whole = out_height - out_height % rows
            with ctx.loop(first, last, name="image") as image:
                if whole:
                    with ctx.loop(0, whole, step=rows, name="slab") as first_row:
                        rows_slab(image, first_row, rows)
                if whole < out_height:
                    rows_slab(image, whole, out_height - whole)
            return
        gradient_rows = ctx.scratch(f"{op.name}/dy_rows", dw.dtype, filters * depth, ctx.element_pointer(windows, taps * depth))
        count = last - first
        whole = count - count % images
        if whole:
            with ctx.loop(first, first + whole, step=images, name="slab") as first_image:
                images_slab(first_image, images)
        if whole < count:
            images_slab(first + whole, count - whole)

    def on_planes(ctx, first: int, last: int, sums, rest: ir.Value, planes: _Planes) -> None:
        """The part's images from their padded planes, each dy row copied to a whole number of
        vectors (zeros past its end, so the last vector of a row adds nothing there)."""
        padded, rows, row = _planes_scratch(ctx, op.name, dw.dtype, planes, filters, lanes, rest)
        for_vectors(ctx, 0, filters * out_height * row, lanes, lambda at, n: ctx.store(rows, at, ctx.constant(dw.dtype, 0.0, n)))
        with ctx.loop(first, last, name="image") as image:
            _copy_planes(ctx, op, image, planes, padded)
            with ctx.loop(0, filters * out_height, name="dy_row") as r:
                copy_run(ctx, dy, image * (filters * positions) + r * out_width, rows, r * row, out_width, lanes)
            _add_dot_tiles(ctx, sums, filters, taps, lanes, _plane_positions(ctx, rows, padded, planes, lanes))

    run_parts(ctx, [part(number, first, last) for number, (first, last) in enumerate(parts)])
    sums = [scratch(ctx, number)[0] for number in range(len(parts))]

    def add_parts(i, w):
        total = Value(ctx.b, load(ctx.b, sums[0], i.ir, element, w), dw.dtype)
        for partial in sums[1:]:
            total = total + Value(ctx.b, load(ctx.b, partial, i.ir, element, w), dw.dtype)
        ctx.store(dw, i, total)

    if sum_lanes == 1:
        for_vectors(ctx, 0, dw.size, lanes, add_parts)
        return
    with ctx.loop(0, dw.size, name="element") as i:
        total = pairwise(operator.add, [Value(ctx.b, load(ctx.b, partial, (i * lanes).ir, element, lanes), dw.dtype)
                                        for partial in sums])
        ctx.store(dw, i, fold_lanes(total, operator.add))


def _add_dot_tiles(ctx, sums, filters: int, taps: int, lanes: int, walk) -> None:
    """sums[f, t] += dy[f, :] · windows[t, :] as vectors of partial sums (lane l holds the
    terms of positions ≡ l modulo the lanes; a short last stretch goes to lane 0), in tiles of
    `_dot_tile_shape` and narrower ones at the edges, each tile's sums held in
    registers along the positions. `walk(f0, t0, height, width, step, vectors, scalars)` runs
    over the positions (`_flat_positions`, `_plane_positions`), calling `step(loads of dy's
    rows, loads of the taps' rows, sums)` at each."""
    f32 = dtypes.DT_FLOAT32

    def tile(f0: Value | int, t0: Value | int, height: int, width: int) -> None:
        def at_sum(f: int, t: int) -> Value | int:
            return ((f0 + f) * taps + t0 + t) * lanes

        vectors = [[ctx.local(f32, lanes, ctx.load(sums, at_sum(f, t), lanes)) for t in range(width)] for f in range(height)]
        scalars = [[ctx.local(f32, 1, 0.0) for _ in range(width)] for _ in range(height)]

        def step(factors: list[Value], taps_now: list[Value], into) -> None:
            for f, factor in enumerate(factors):
                for t, total in enumerate(into[f]):
                    total.set(factor.mul_add(taps_now[t], total.value))

        tails = walk(f0, t0, height, width, step, vectors, scalars)
        for f in range(height):
            for t in range(width):
                ctx.store(sums, at_sum(f, t), vectors[f][t].value)
                if tails:
                    ctx.store(sums, at_sum(f, t), ctx.load(sums, at_sum(f, t)) + scalars[f][t].value)

    tile_filters, tile_taps = _dot_tile_shape(lanes)
    _by_tiles(ctx, filters, tile_filters, "f0",
              lambda f0, height: _by_tiles(ctx, taps, tile_taps, "t0", lambda t0, width: tile(f0, t0, height, width)))


def _flat_positions(ctx, dy, windows, at: Value, taps: int, positions: int, lanes: int):
    """The walk of `_add_dot_tiles` over an image's copied windows [taps, positions] and its dy
    rows from element `at`: whole vectors of positions, then one at a time into the scalar
    sums. Returns whether there were any."""
    whole = positions - positions % lanes

    def walk(f0, t0, height: int, width: int, step, vectors, scalars) -> bool:
        def loads(p, w: int):
            return ([ctx.load(dy, at + (f0 + f) * positions + p, w) for f in range(height)],
                    [ctx.load(windows, (t0 + t) * positions + p, w) for t in range(width)])

        if whole:
            with ctx.loop(0, whole, step=lanes, name="p") as p:
                step(*loads(p, lanes), vectors)
        if whole < positions:
            with ctx.loop(whole, positions, name="pt") as p:
                step(*loads(p, 1), scalars)
        return whole < positions

    return walk


def _plane_positions(ctx, rows, padded, planes: _Planes, lanes: int):
    """The walk of `_add_dot_tiles` over an image's padded planes and its dy `rows` (each a
    whole number of vectors, zeros past the output's width): row by row of the output, its
    vectors unrolled; a row's last vector reads the planes past the row, which count nothing,
    masked to zero (the zeros of dy would turn an infinity there into a NaN)."""
    row = _windows_stride(planes.out_width, lanes)
    valid = planes.out_width - (row - lanes)
    mask = ctx.lane_numbers(lanes) < valid if valid < lanes else None

    def walk(f0, t0, height: int, width: int, step, vectors, scalars) -> bool:
        starts = [planes.tap_row(t0 + t) for t in range(width)]
        with ctx.loop(0, planes.out_height, name="yo") as y:
            for v in range(0, row, lanes):
                factors = [ctx.load(rows, ((f0 + f) * planes.out_height + y) * row + v, lanes) for f in range(height)]
                taps_now = [ctx.load(padded, start + y * planes.width + v, lanes) for start in starts]
                if mask is not None and v == row - lanes:
                    taps_now = [mask.where(value, 0.0) for value in taps_now]
                step(factors, taps_now, vectors)
        return False

    return walk
