"""Conv2DCalculateMaxPool: a convolution on the windows GEMM (conv.py's ConvGemm), its
epilogue and the max pooling after it, computed in bands of the convolution's output rows
that stay in cache: each band is multiplied into a part's scratch, its program (a folded
batch norm, a ReLU) run over it there, and its rows pooled into the output, so the whole
convolution output is never stored (ResNet-18's stem: 3.2 MB an image, 4 times its pooled
output). A band's first rows (those the previous band's last windows share with it: one for
a 3 × 3 pool of stride 2) are copied down from the previous band rather than computed again.

Parts take whole images when there are at least as many as cores, else bands of each
image's pooled rows (the first band of each part computes its shared rows afresh). A
convolution of one stride s in both directions (the stem's 7 × 7 of stride 2) reads each
image's s × s phase planes, copied once a part (conv.image_reader), as ConvGemm does: each
tap's vector of positions one load, where packed straight from the image it took two loads
and a shuffle, and over the stem's 147 taps of 3 channels the packing weighs as much as the
multiply-adds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .... import dtypes
from ....ops import attrs_of
from ....ops.expression import program_of
from ....ops.fused import CONV_POOL, EPILOGUE_PRODUCTS, conv_pool_parts, epilogue_input_strides
from ....ops.nn import pool_params
from ....ops.registry import Attrs, op_def
from ...kernels import planned
from ...llvm.formulas import program_body
from ...llvm.irutil import I64, i64, whole_lines
from ...llvm.loops import copy_run
from ...llvm.strided import View
from .. import sgemm
from ..codegen import SGEMM_WINDOWS, SGEMM_WINDOWS_DPBF16
from ..gemm_choice import windows_pairs_are_faster
from ..parallel import run_parts, shares, thread_count, worth_splitting
from ..views import emit_map
from .conv import (
    CALL_BYTES,
    WINDOWS_PAIRS_CALLS,
    copy_bytes,
    fits_windows_gemm,
    geometry_constant,
    geometry_values,
    image_reader,
    paired_filters,
    windows_filters,
)
from .library import kernel
from .window import PoolRows, emit_max_pool


@dataclass(frozen=True)
class _Band:
    """Pooled rows [first, last) of a plane, from the convolution's rows [top, bottom),
    of which the first `carried` are the previous band's last, copied down."""

    first: int
    last: int
    top: int
    bottom: int
    carried: int


@dataclass(frozen=True)
class _Plan:
    filters: int
    taps: int
    conv_height: int
    conv_width: int
    pooling: tuple
    geometry: tuple[int, ...]
    copy_bytes: int  # an image's copy the GEMM reads (conv.copy_bytes: its phase planes), else 0
    parts: tuple[tuple[int, int, tuple[_Band, ...]], ...]  # (first image, last image, bands)

    @property
    def band_rows(self) -> int:
        return max(band.bottom - band.top for _, _, bands in self.parts for band in bands)

    @property
    def widest_call(self) -> int:
        return max((band.bottom - band.top - band.carried) * self.conv_width for _, _, bands in self.parts for band in bands)

    def rows_bytes(self) -> int:
        """A part's bands' rows of every filter, in whole cache lines."""
        return whole_lines(4 * self.filters * self.band_rows * self.conv_width)

    def share_bytes(self) -> int:
        """A part's scratch: its image's copy, its bands' rows, then the GEMM's packing."""
        return self.copy_bytes + self.rows_bytes() + sgemm.workspace_bytes(self.widest_call, self.taps)


def _bands(first: int, last: int, band: int, conv_height: int, pooling: tuple) -> tuple[_Band, ...]:
    (kh, _), (sh, _), (ph, _) = pooling
    bands: list[_Band] = []
    for start in range(first, last, band):
        stop = min(last, start + band)
        top, bottom = max(0, start * sh - ph), min(conv_height, (stop - 1) * sh - ph + kh)
        previous = bands[-1].bottom if bands else top
        bands.append(_Band(start, stop, top, bottom, max(0, min(previous, bottom) - top)))
    return tuple(bands)


def _plan(op) -> _Plan | None:
    """The bands of `op`, or None where the windows GEMM cannot take its convolution
    (float32 inputs, offsets in 32 bits, a pooled output)."""
    x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
    if not fits_windows_gemm(op) or y.dtype != dtypes.DT_FLOAT32:
        return None
    conv, pool = conv_pool_parts(op.attrs)
    conv_attrs = Attrs(conv, op.name, "Conv2D", op_def("Conv2D").attrs)
    (_, _, height, width), (filters, _, kernel_height, kernel_width) = x.shape, w.shape
    (stride_height, stride_width), (pad_height, pad_width) = conv_attrs["strides"], conv_attrs["padding"]
    conv_height = (height + 2 * pad_height - kernel_height) // stride_height + 1
    conv_width = (width + 2 * pad_width - kernel_width) // stride_width + 1
    pooling = pool_params(Attrs(pool, op.name, "MaxPool", op_def("MaxPool").attrs))
    images, pooled_rows = x.shape[0], y.shape[2]
    # bands of at most CALL_BYTES of new rows, as ConvGemm's calls
    band = max(1, CALL_BYTES // (4 * filters * conv_width * pooling[1][0]))
    taps = math.prod(w.shape[1:])
    flops = 2 * images * filters * conv_height * conv_width * taps
    threads = thread_count() if worth_splitting(flops, x.nbytes) else 1
    if images >= threads:
        bands = _bands(0, pooled_rows, band, conv_height, pooling)
        parts = tuple((first, last, bands) for first, last in shares(images, threads))
    else:
        parts = tuple((image, image + 1, _bands(start, stop, band, conv_height, pooling))
                      for image in range(images) for start, stop in shares(pooled_rows, threads // images))
    return _Plan(filters, taps, conv_height, conv_width, pooling, tuple(geometry_values(op)), copy_bytes(op), parts)


def _on_pairs(op) -> bool:
    return _plan(op) is not None and attrs_of(op)["precision"] == "bfloat16"


def _pairs_faster(op) -> bool:
    """Whether the windows GEMM on bf16 pairs measured faster than the float32 one on the
    widest band's call."""
    plan = planned(_plan(op), op)
    return windows_pairs_are_faster(plan.filters, plan.widest_call, plan.taps, plan.geometry)


def _workspace_bytes(op) -> int:
    plan = planned(_plan(op), op)
    return len(plan.parts) * plan.share_bytes()


@kernel("ConvPoolDpbf16", {CONV_POOL}, supports=_on_pairs, rank=40, prefer=_pairs_faster, workspace=_workspace_bytes,
        prepares=paired_filters, calls=WINDOWS_PAIRS_CALLS)
def conv_pool_pairs(ctx, op) -> None:
    """ConvPool's bands multiplied on `ranvier_sgemm_windows_dpbf16` (filters and windows
    rounded to bf16 pairs, float32 sums; constant filters rounded once)."""
    _pool_bands(ctx, op, SGEMM_WINDOWS_DPBF16)


@kernel("ConvPool", {CONV_POOL}, supports=lambda op: _plan(op) is not None, rank=50, workspace=_workspace_bytes,
        calls=frozenset({SGEMM_WINDOWS}))
def conv_pool(ctx, op) -> None:
    _pool_bands(ctx, op, SGEMM_WINDOWS)


def _pool_bands(ctx, op, slot: int) -> None:
    """Each part's images, band by band: the carried rows copied down, the new rows
    multiplied (GEMM in pointer-table `slot`) and their program run, the band pooled."""
    y = op.outputs[0]
    plan = planned(_plan(op), op)
    conv_width = plan.conv_width
    ldc = plan.band_rows * conv_width  # elements between the scratch's filters
    pooled_plane = y.shape[2] * y.shape[3]
    share = plan.share_bytes()
    geometry = geometry_constant(ctx, list(plan.geometry))
    lanes = ctx.lanes_for([dtypes.DT_FLOAT32])
    program = program_body(program_of(op), 1)
    others = op.inputs[2:]
    product_shape = [y.shape[0], plan.filters, plan.conv_height, conv_width]
    (kh, kw), (sh, sw), (ph, pw) = plan.pooling

    def part(first: int, last: int, bands: tuple[_Band, ...], number: int):
        def emit(ctx) -> None:
            b = ctx.b
            entry, filters, lda = windows_filters(ctx, op, slot)
            gemm = b.bitcast(ctx.table_entry(entry), sgemm.WINDOWS_FUNCTION.as_pointer())
            base = b.gep(ctx.address(ctx.workspace), [i64(number * share)])
            bring, source = image_reader(ctx, op, base)
            rows = ctx.scratch(f"{op.name}/band{number}", dtypes.DT_FLOAT32, plan.filters * ldc,
                               b.gep(base, [i64(plan.copy_bytes)]))
            packing = b.gep(base, [i64(plan.copy_bytes + plan.rows_bytes())])
            with ctx.loop(first, last, name="image") as image:
                bring(image)
                previous: _Band | None = None
                for band in bands:
                    if band.carried and previous is not None:  # a part's first band computes all its rows
                        shift = (band.top - previous.top) * conv_width
                        # row by row, first to last: where more rows are carried than the band moved down,
                        # a row's source is a later row, not yet overwritten
                        with ctx.loop(0, plan.filters * band.carried, name="carried") as r:
                            row_at = (r // band.carried) * ldc + (r % band.carried) * conv_width
                            copy_run(ctx, rows, row_at + shift, rows, row_at, conv_width, lanes)
                    new_top = band.top + band.carried
                    width = (band.bottom - new_top) * conv_width
                    if width:
                        b.call(gemm, [i64(plan.filters), i64(width), i64(plan.taps), filters(0),
                                      i64(lda), source(image),
                                      b.bitcast(geometry, I64.as_pointer()), i64(new_top * conv_width),
                                      ctx.element_pointer(rows, band.carried * conv_width), i64(ldc), packing])
                        landing = View(rows, band.carried * conv_width, [ldc, 1])
                        inputs = [landing]
                        for v in others:
                            over, down, across = planned(epilogue_input_strides(v.shape, product_shape, EPILOGUE_PRODUCTS["Conv2D"]), op)
                            inputs.append(View(v, image * over + new_top * conv_width * across, [down, across]))
                        emit_map(ctx, [plan.filters, width], inputs, [landing], program, split=False)
                    # the band's windows counted from its top row, as if padded above by what they overhang it
                    at = PoolRows(band.bottom - band.top, conv_width, ldc, band.last - band.first, y.shape[3], pooled_plane,
                                  0, image * (plan.filters * pooled_plane) + band.first * y.shape[3])
                    emit_max_pool(ctx, rows, y, ((kh, kw), (sh, sw), (ph + band.top - band.first * sh, pw)), at,
                                  plan.filters)
                    previous = band

        return emit

    run_parts(ctx, [part(first, last, bands, number) for number, (first, last, bands) in enumerate(plan.parts)])
