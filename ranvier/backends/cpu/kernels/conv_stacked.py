"""Conv2D over a batch of small images as one implicit GEMM per group of images: the group's
images stacked, each with its padding rows, into one tall image in scratch, so a call of the
windows GEMM (`ranvier_sgemm_windows`, or on bf16 pairs its twin) multiplies the filters by the
windows of every image of the group at once.

ConvGemm calls the GEMM once per image, whose output positions are its columns: a 7 × 7
output is 49 columns, one panel of 48 and one of 16 (a vector) for the last column, 14 × 14
ones 196, four panels and a vector. Stacked, a group's columns run on through its images,
the few rows between them (where a window straddles two images) computed and dropped:
ResNet-18's stride-2 3 × 3 convolutions to 14 × 14 and 7 × 7 at batch 32 on bf16 pairs took
0.66-0.95 of ConvGemmDpbf16's time (two runs; Zen 5, two cores, shared, load 3-6). Its 512-channel 7 × 7 ones
stacked took 1.19 times WinogradConvDpbf16's, and its 1 × 1 downsamplings (stacked with
only the pixels the stride reads) 0.78-1.6 times ConvGemmDpbf16's: what Winograd's kernel
takes, and 1 × 1 filters, are left to those.

The tall image is [channels, images × rows, width], image g's padded rows at g × rows, its
rows rounded up to the stride, so that output row g × rows / stride + r of the tall image
is output row r of image g; its padding rows are zeroed once a part and each group writes
the inside. With a stride s in both directions it is instead each channel's s × s phase
planes (`conv.phase_planes`), image g's rows in each from row g × rows / s: the GEMM reads
each tap's vector of positions as one load (ResNet-18's 128- and 256-channel ones at batch 32
in bf16 took 0.92 and 0.97 of the time of packing every other element of the tall image).
The GEMM writes [filters, the group's positions] into scratch, whose rows of each image are
then copied into its NCHW output, and a Conv2DCalculate's program runs over the image's
output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .... import dtypes
from ....ops import attrs_of
from ...llvm.irutil import BYTE_PTR, I64, cache_line_aligned, i64
from ...llvm.loops import copy_run, for_vectors
from .. import sgemm
from ..codegen import SGEMM_WINDOWS, SGEMM_WINDOWS_DPBF16
from ..gemm_choice import windows_pairs_are_faster
from ..parallel import run_parts, shares, thread_count
from .conv import (
    WINDOWS_PAIRS_CALLS,
    copy_phases,
    fits_windows_gemm,
    geometry_constant,
    paired_filters,
    phase_planes,
    windows_filters,
)
from .library import kernel
from .program import epilogue

KERNEL = "ConvStackedGemm"
PAIRS_KERNEL = "ConvStackedGemmDpbf16"
# An image of at most this many output positions is stacked: a call per image of more has
# enough panels that its last one's padding matters little (ResNet-18's 28 × 28 outputs:
# 784 columns, sixteen panels of 48 and a vector).
MOST_POSITIONS = 256
_GROUP_COLUMNS = 384  # a group's images take at least this many of the GEMM's columns
_ALIGN = 16  # floats: each scratch region starts on a cache line


@dataclass(frozen=True)
class _Stack:
    """A convolution's sizes, and those of the tall image its groups of images make."""

    images: int
    channels: int
    height: int
    width: int
    filters: int
    taps: int
    out_height: int
    out_width: int
    rows: int  # tall image rows an image takes: its padded rows, rounded up to the stride
    out_rows: int  # tall output rows an image takes (`rows` / stride): its output's, then dropped ones
    group: int  # images a call stacks
    split: int  # the tall image's phase planes a side (conv.phase_planes' s), else 1
    tall_rows: int  # rows of a channel's tall image, or of each of its phase planes
    tall_width: int

    @property
    def positions(self) -> int:
        return self.out_height * self.out_width

    def columns(self, images: int) -> int:
        """The GEMM's columns for `images` stacked: up to the last one's last output row."""
        return ((images - 1) * self.out_rows + self.out_height) * self.out_width

    @property
    def tall_floats(self) -> int:
        return _aligned(self.channels * self.split * self.split * self.tall_rows * self.tall_width)

    @property
    def out_floats(self) -> int:
        return _aligned(self.filters * self.columns(self.group))

    @property
    def share_bytes(self) -> int:
        """A part's scratch: the tall image, the GEMM's output, and its packing workspace."""
        return 4 * (self.tall_floats + self.out_floats) + _aligned(sgemm.workspace_bytes(self.columns(self.group), self.taps))

    def geometry(self, pad_width: int, strides: tuple[int, int], kernel: tuple[int, int]) -> list[int]:
        """The windows GEMM's geometry (sgemm.GEOMETRY) of a group's tall image: no padding rows
        (the tall image holds them); of its phase planes, read with stride 1 (they hold all of
        it)."""
        if self.split > 1:
            return [self.tall_rows, self.tall_width, *kernel, 1, 1, 0, 0, self.out_width, self.split]
        return [self.tall_rows, self.width, *kernel, *strides, 0, pad_width, self.out_width, 1]


def _aligned(count: int) -> int:
    return -(-count // _ALIGN) * _ALIGN


def _stack(op) -> _Stack:
    x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
    (images, channels, height, width), (filters, *_), (_, _, out_height, out_width) = x.shape, w.shape, y.shape
    stride, pad = attrs_of(op)["strides"][0], attrs_of(op)["padding"][0]
    rows = -(-(height + 2 * pad) // stride) * stride
    out_rows = rows // stride
    per_part = -(-images // thread_count())
    group = min(per_part, -(-_GROUP_COLUMNS // (out_rows * out_width)))
    split, tall_rows, tall_width = 1, group * rows, width
    phases = phase_planes(op)
    if phases is not None:  # each image's rows from out_rows × its place in the group, as far as they reach
        split, plane_height, tall_width = phases
        tall_rows = (group - 1) * out_rows + plane_height
    return _Stack(images, channels, height, width, filters, math.prod(w.shape[1:]), out_height, out_width, rows, out_rows,
                  group, split, tall_rows, tall_width)


def _geometry_values(op) -> list[int]:
    attrs = attrs_of(op)
    return _stack(op).geometry(attrs["padding"][1], tuple(attrs["strides"]), tuple(op.inputs[1].shape[2:]))


def _stacked(op) -> bool:
    """float32, small images, at least two for each core, filters larger than 1 × 1; the tall
    image's offsets fit the GEMM's 32-bit lane arithmetic. (Ranked after ConvTiles' few
    filters and Winograd's kernels, which take theirs first.)"""
    if not fits_windows_gemm(op) or tuple(op.inputs[1].shape[2:]) == (1, 1):
        return False
    s = _stack(op)
    return s.positions <= MOST_POSITIONS and s.group >= 2 and s.images >= 2 * thread_count() \
        and s.channels * s.group * s.rows * s.width < 1 << 30


def _on_pairs(op) -> bool:
    return _stacked(op) and attrs_of(op)["precision"] == "bfloat16"


def _pairs_faster(op) -> bool:
    """Whether the windows GEMM on pairs measured faster than the float32 one on a group's call."""
    s = _stack(op)
    return windows_pairs_are_faster(s.filters, s.columns(s.group), s.taps, tuple(_geometry_values(op)))


def _parts(op) -> list[tuple[int, int]]:
    return shares(_stack(op).images, thread_count())


def _workspace_bytes(op) -> int:
    return len(_parts(op)) * _stack(op).share_bytes + 64


# after ConvTiles (10) and Winograd's kernels (20, 30), before ConvGemm's (40, 50)
@kernel(PAIRS_KERNEL, {"Conv2D", "Conv2DCalculate"}, supports=_on_pairs, rank=34, prefer=_pairs_faster,
        workspace=_workspace_bytes, prepares=paired_filters, calls=WINDOWS_PAIRS_CALLS)
def conv_stacked_pairs(ctx, op) -> None:
    """ConvStackedGemm's calls on `ranvier_sgemm_windows_dpbf16`."""
    _stacked_calls(ctx, op, SGEMM_WINDOWS_DPBF16)


@kernel(KERNEL, {"Conv2D", "Conv2DCalculate"}, supports=_stacked, rank=36, workspace=_workspace_bytes,
        calls=frozenset({SGEMM_WINDOWS}))
def conv_stacked(ctx, op) -> None:
    _stacked_calls(ctx, op, SGEMM_WINDOWS)


def _stacked_calls(ctx, op, slot: int) -> None:
    """Each part's images, a group at a time: stacked into the tall image, multiplied by one
    call of the windows GEMM in pointer-table `slot`, copied out image by image, each then
    through the op's epilogue."""
    x, y = op.inputs[0], op.outputs[0]
    s = _stack(op)
    f32 = dtypes.DT_FLOAT32
    pad = attrs_of(op)["padding"][0]
    lanes = ctx.lanes_for([f32])
    geometry = geometry_constant(ctx, _geometry_values(op))
    image_size, plane = s.channels * s.height * s.width, s.height * s.width
    out_size = s.filters * s.positions

    def part(number: int, first: int, last: int):
        def emit(ctx) -> None:
            b = ctx.b
            base = b.gep(cache_line_aligned(b, ctx.address(ctx.workspace), BYTE_PTR), [i64(number * s.share_bytes)])
            tall = ctx.scratch(f"{op.name}/tall", f32, s.tall_floats, base)
            out = ctx.scratch(f"{op.name}/stacked", f32, s.out_floats, b.gep(base, [i64(4 * s.tall_floats)]))
            packing = b.gep(base, [i64(4 * (s.tall_floats + s.out_floats))])
            for_vectors(ctx, 0, s.tall_floats, lanes, lambda at, n: ctx.store(tall, at, ctx.constant(f32, 0.0, n)))
            entry, filters, lda = windows_filters(ctx, op, slot)
            gemm = b.bitcast(ctx.table_entry(entry), sgemm.WINDOWS_FUNCTION.as_pointer())
            multiply = (gemm, filters(0), lda)
            whole = (last - first) // s.group * s.group
            if whole:
                with ctx.loop(first, first + whole, step=s.group, name="group") as start:
                    group(ctx, multiply, tall, out, packing, start, s.group)
            if first + whole < last:
                group(ctx, multiply, tall, out, packing, first + whole, last - first - whole)

        return emit

    def group(ctx, multiply, tall, out, packing, start, count: int) -> None:
        b = ctx.b
        gemm, filters, lda = multiply
        columns = s.columns(count)
        if s.split > 1:
            with ctx.loop(0, count, name="stack_image") as g:
                copy_phases(ctx, op, start + g, tall, s.tall_rows, g * s.out_rows)
        else:
            with ctx.loop(0, s.channels * count, name="stack_plane") as plane_index:
                c, g = plane_index // count, plane_index % count
                copy_run(ctx, x, (start + g) * image_size + c * plane, tall,
                         (c * s.group + g) * (s.rows * s.width) + pad * s.width, plane, lanes)
        b.call(gemm, [i64(s.filters), i64(columns), i64(s.taps), filters, i64(lda),
                      ctx.element_pointer(tall, 0), b.bitcast(geometry, I64.as_pointer()), i64(0),
                      ctx.element_pointer(out, 0), i64(columns), packing])
        with ctx.loop(0, count, name="unstack") as g:
            at = (start + g) * out_size
            with ctx.loop(0, s.filters, name="filter") as f:
                copy_run(ctx, out, f * columns + g * (s.out_rows * s.out_width), y, at + f * s.positions, s.positions, lanes)
            epilogue(ctx, op, at, s.filters, s.positions)

    run_parts(ctx, [part(number, first, last) for number, (first, last) in enumerate(_parts(op))])
