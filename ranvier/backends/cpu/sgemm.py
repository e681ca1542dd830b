"""A float32 GEMM generated as LLVM IR for the target's vector width (AVX-512, AVX2/FMA, SSE).

    void ranvier_sgemm(i64 transpose_a, i64 transpose_b, i64 m, i64 n, i64 k,
                       float* A, i64 lda, float* B, i64 ldb, float* C, i64 ldc,
                       i8* workspace)

computes row-major C[m×n] = op(A)[m×k] · op(B)[k×n] (op(X) is X or Xᵀ; leading
dimensions count elements), overwriting C (`ranvier_sgemm_add`, same arguments: adding to
C), on the calling thread: a parallel MatMul
gives each worker-pool part its own blocks of C, or its own slice of k and a partial
product of all of C (kernels/matmul.py, `gemm_parts`).

The algorithm is BLIS's, less the packing of A:

1. B is packed a block at a time, at most `KC` steps of k (k cut into even slices) by
   `block_columns` columns, into the workspace (`workspace_bytes`): panels of NR = V
   vectors of columns, each k-major (its row p is NR contiguous floats), zeros past n.
   A transposed B is packed in L × L blocks (L the lanes) transposed in registers.
   While a block computes, its tiles bring the next block's rows of B into L2, so its
   packing reads them from there rather than from memory.
2. For each strip of MR rows of op(A) and each panel, a micro-kernel keeps the MR × NR
   tile of C in MR·V vector registers (`tile_shape`: 4 × 3 vectors with 16 registers,
   8 × 3 with 32); per step of k it loads the panel's row (V vectors), broadcasts MR
   values of A and does MR·V fused multiply-adds. A is read in
   place: a step's MR values lie a row apart (or side by side when A is transposed), and
   the strip's slice of A stays in L1 while the panels stream past it from L2.
3. The first slice of k stores the tile into C, later ones add to it. A tile over C's
   right edge goes through a buffer on the stack, so nothing outside C is written; the
   last strip of fewer than MR rows has a micro-kernel of its own size.

A B that never changes (an inference model's weights) is packed once instead, ahead of
time, by `pack_panels`, and multiplied by

    void ranvier_sgemm_packed(i64 transpose_a, i64 m, i64 n, i64 k, float* A, i64 lda,
                              float* panels, float* C, i64 ldc)

the same loops less the packing: `panels` holds op(B)'s n columns (a call's) in panels
of NR, each k-major over all of k, so any slice of k of a panel is contiguous where the
loops read it. Those panels come from memory, not from a packing pass that just wrote
them: while a block's strips compute, each strip asks for its share of the next block's
cache lines (a prefetch into L2), so the next block is there when its turn comes. The
micro-kernel asks for them itself, one line per step of k among its multiply-adds (as it
does for the next strip's rows of A read in place): asked for in a burst before each
tile, they filled the core's line-fill buffers and stalled it. Past the last block, the
strips ask for A's next rows instead: Winograd's A is its transformed filters, constant and
as far from the core as any panels.

Such a B may also be packed in bfloat16 (`pack_panels(..., narrow=True)`: for a product
whose precision lets its inputs be rounded to bf16), half the bytes, for

    void ranvier_sgemm_packed_bf16(i64 transpose_a, i64 m, i64 n, i64 k, float* A, i64 lda,
                                   u16* panels, float* C, i64 ldc)

the same loops again, each panel row widened to float32 as it is loaded (a bf16 is a
float32's upper half), the sums float32. A product of one row (a decode step's) only
streams its matrix, so it takes slices of k four times as deep (`ROW_KC`: each panel read
in long runs) and asks for the lines a fixed distance ahead of where it reads.

Where the CPU has AVX512-BF16 (Zen 4 and 5, Cooper Lake; Sapphire Rapids without its AMX
tiles), a product whose precision lets both inputs be rounded to bfloat16 runs on
`vdpbf16ps` instead, a dot product of bf16 pairs into float32 sums: twice the multiply-adds
of an FMA per instruction.

    void ranvier_sgemm_dpbf16(... the arguments of ranvier_sgemm ...)
    void ranvier_sgemm_packed_dpbf16(i64 transpose_a, i64 m, i64 n, i64 k, float* A, i64 lda,
                                     u16* panels, float* C, i64 ldc)

are the same loops and tiles on pairs: each step of k the micro-kernel takes is two, k and
k + 1, held as two bf16 in one 32-bit slot. B's panels (`pack(..., pairs=True)`, or ahead of time
`pack_panels(..., pairs=True)`) hold in their row p, for each of the NR columns, op(B)[2p, j]
and op(B)[2p + 1, j] side by side; a strip of A is copied as pairs too (`copy_pairs`), and
a step broadcasts one pair of a row (a 32-bit element) against the panel's row of V
vectors. An odd k ends in a pair with a zero. Both are rounded to the nearest bfloat16
(ties to even, as ml_dtypes rounds; subnormal floats read as zero), the sums stay float32.

A convolution's B is the im2col matrix of its input, never written out:

    void ranvier_sgemm_windows(i64 m, i64 n, i64 k, float* A, i64 lda, float* image,
                               i64* geometry, i64 first_column, float* C, i64 ldc,
                               i8* workspace)

packs B's blocks straight from one image [channels, H, W] (`pack_windows`): row p of B
is a filter tap (channel, kernel row, kernel column), column j an output position
(first_column + j as row y, column x of the output), and B[p, j] the image's element
under that tap, zero in the padding. `geometry` holds H, W, KH, KW, SH, SW, PH, PW, the
output width and the phases s: 1 for an image as it is; above 1 for one split by a stride
of s into phase planes (each channel s × s planes of H × W, plane (a, b) its padded rows
a, a + s, ... and columns b, b + s, ...), where tap (i, j) reads plane (i mod s, j mod s)
from row i // s, column j // s, and the output's positions step by 1 (SH = SW = 1, no
padding): each tap's vector of a stride-s row is one load. `ranvier_sgemm_windows_dpbf16` (same arguments) packs the windows as
bf16 pairs of taps and multiplies them on `vdpbf16ps`, as `ranvier_sgemm_dpbf16` does a matrix.

On pairs, A's strips are rounded into pairs as the loops reach them, every block of B's
columns and every call again. Where A is a constant (an inference model's filters, or
Winograd's transformed filters), `paired_rows` rounds it once, ahead of time, and

    void ranvier_sgemm_windows_dpbf16_paired(... the arguments of ranvier_sgemm_windows ...)
    void ranvier_sgemm_packed_dpbf16_paired(... the arguments of ranvier_sgemm_packed_dpbf16 ...)

read its strips in place: A is then `paired_rows`' bf16 pairs (lda in 32-bit slots; A not
transposed), half the bytes of the float32 filters, which at batch 1 stream from memory a
step at a time (ResNet-18's 512-channel 3 × 3 convolutions read 9.4 MB of float32 filters
for 0.23 GFLOP each).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from llvmlite import ir

from ...dtypes import DT_BFLOAT16, DT_BOOL, DT_FLOAT32, DT_INT32, DT_INT64, DT_UINT32
from ..llvm.convert import bf16_pairs
from ..llvm.irutil import (
    BF16,
    BYTE_PTR,
    F32,
    I1,
    I16,
    I32,
    I64,
    VOID,
    by_strips,
    cache_line_aligned,
    declared,
    intrinsic,
    transpose_square,
)
from ..llvm.pointers import Pointer, PointerVariable, parameters, stack
from ..llvm.values import Local, Value, call, choose, index_value, lane_numbers, local, loop
from . import jit
from .target import CPUTarget

SYMBOL = "ranvier_sgemm"
ADD_SYMBOL = "ranvier_sgemm_add"
PACKED_SYMBOL = "ranvier_sgemm_packed"
BF16_PACKED_SYMBOL = "ranvier_sgemm_packed_bf16"
WINDOWS_SYMBOL = "ranvier_sgemm_windows"
PAIRS_SYMBOL = "ranvier_sgemm_dpbf16"
PAIRS_PACKED_SYMBOL = "ranvier_sgemm_packed_dpbf16"
WINDOWS_PAIRS_SYMBOL = "ranvier_sgemm_windows_dpbf16"
PAIRED_A_SUFFIX = "_paired"  # of the entries on pairs that read A as `paired_rows` made it
GEOMETRY = ("height", "width", "kernel_height", "kernel_width", "stride_height", "stride_width", "pad_height",
            "pad_width", "out_width", "phases")

GEMM_CTYPE = ctypes.CFUNCTYPE(
    None, *[ctypes.c_int64] * 5,
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
    ctypes.c_void_p,
)

PACKED_CTYPE = ctypes.CFUNCTYPE(
    None, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
)

WINDOWS_CTYPE = ctypes.CFUNCTYPE(
    None, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
)

KC = 256  # steps of k per packed block: a strip's slice of A, MR × 1 KiB, stays in L1
# A single row times panels packed ahead of time (a decode step's product) takes up to this
# many steps of k a slice: its row's slice, 4 KiB, stays in L1 as well, and each panel is
# read in one run where k fits rather than in pieces a panel's length apart.
ROW_KC = 4 * KC
# ...and asks for its panel's lines this many elements ahead of the step it reads, one per
# step: the hardware's prefetchers alone streamed bf16 panels at 11-12 GB/s on an AVX2
# EPYC core, where OpenBLAS's float32 GEMV streams 19-22; 1,024 ahead reached 15-20.
ROW_AHEAD = 1024
# Steps of k per block on bf16 pairs: a block of B and a strip of A take the bytes KC float32
# steps do, and each panel row carries twice the work.
PAIRS_KC = 2 * KC
_BLOCK_BYTES = 384 << 10  # a block of B packed into the workspace: most of a 512 KiB L2
# A block of B packed ahead of time (a constant's) is smaller, a quarter of the L2: it comes
# from memory, not from a packing pass that just wrote it, and the strips of A and tiles of C
# streaming past must not evict it. Both cores busy on an AVX2 EPYC (512 KiB of L2), 96-160
# KiB ran 4-13% faster than 384 KiB on BERT's and GPT-2's products (paired runs); the
# workspace GEMM's measured the same. Cores with AVX-512 have 1-2 MiB of L2: on an Emerald
# Rapids Xeon 384 KiB ran BERT-base and GPT-2 at batch 1 5-7% faster than 128 (two
# alternated pairs each), the FFN's 3,072-deep products 15% faster on one core.
_PACKED_BLOCK_BYTES = {8: 128 << 10, 16: 384 << 10}  # by float lanes; SSE's 4 as AVX2's
_FLOAT_PTR = F32.as_pointer()
_PAIRS_PTR = I32.as_pointer()  # bf16 pairs, one 32-bit slot each
_LINE_FLOATS = 16  # a 64-byte cache line: also its 32-bit slots of bf16 pairs
_FUNCTION = ir.FunctionType(VOID, [I64] * 5 + [_FLOAT_PTR, I64, _FLOAT_PTR, I64, _FLOAT_PTR, I64, BYTE_PTR])
_PACKED_FUNCTION = ir.FunctionType(VOID, [I64] * 4 + [_FLOAT_PTR, I64, _FLOAT_PTR, _FLOAT_PTR, I64])
_BF16_PACKED_FUNCTION = ir.FunctionType(VOID, [I64] * 4 + [_FLOAT_PTR, I64, I16.as_pointer(), _FLOAT_PTR, I64])
WINDOWS_FUNCTION = ir.FunctionType(VOID, [I64] * 3 + [_FLOAT_PTR, I64, _FLOAT_PTR, I64.as_pointer(), I64, _FLOAT_PTR, I64,
                                                       BYTE_PTR])
# kc, a, a's row stride, a's stride along k, packed panel, c, ldc, columns of C to write, add to C?
# ..., then lines to bring into L2 meanwhile, one per step of k: runs of `run` lines `stride`
# floats apart from `ahead`, `lines` of them in all
_MICRO = ir.FunctionType(VOID, [I64, _FLOAT_PTR, I64, I64, _FLOAT_PTR, _FLOAT_PTR, I64, I64, I1, _FLOAT_PTR, I64, I64, I64])
_MICRO_BF16 = ir.FunctionType(VOID, [I64, _FLOAT_PTR, I64, I64, I16.as_pointer(), _FLOAT_PTR, I64, I64, I1, _FLOAT_PTR, I64,
                                     I64, I64])
# the same on pairs: pairs of k (kc of them), A's strip and the panel in bf16 pairs
_MICRO_PAIRS = ir.FunctionType(VOID, [I64, _PAIRS_PTR, I64, I64, _PAIRS_PTR, _FLOAT_PTR, I64, I64, I1, _FLOAT_PTR, I64, I64,
                                      I64])
# kc, a, a's row stride, the edge's columns (ROW_KC apart), c, ldc, columns, add to C?
_DOT = ir.FunctionType(VOID, [I64, _FLOAT_PTR, I64, _FLOAT_PTR, _FLOAT_PTR, I64, I64, I1])
# the same on pairs: pairs of k (kc of them), A's strip copy and the edge's columns in bf16 pairs
_DOT_PAIRS = ir.FunctionType(VOID, [I64, _PAIRS_PTR, I64, _PAIRS_PTR, _FLOAT_PTR, I64, I64, I1])
# A block's last panel this narrow is computed as dot products along k (`dot_kernel`): a
# vector-wide tile would do a whole vector of multiply-adds per row and step of k for it
# (a 7×7 convolution's 49 positions are two panels of 24 and one of 1). Up to this many
# columns the dot products cost less. On pairs too: 256 filters by 49 positions of a 3 × 3
# convolution of 512 channels took 1.43 times as long as by 48 with a vector-wide tile for the last.
DOT_COLUMNS = 4
_MAX_SEGMENTS = 4  # output rows a vector of a convolution's columns is read from, a masked load each


def tile_shape(target: CPUTarget) -> tuple[int, int]:
    """(MR, vectors): a tile's rows, and its columns in vectors. MR × vectors accumulators,
    the vectors of a panel row and a broadcast must fit the registers: with 16 (AVX2,
    SSE) a 4 × 3-vector tile measured 6-13% faster than 6 × 2 here (paired runs on the
    BERT, MNIST and square shapes; it loads 7 values per 12 multiply-adds instead of 8).
    AVX-512's 32 hold 8 × 3. On an Emerald Rapids Xeon, one thread: the MoE layers'
    products of 144 columns (three panels of 48) ran at 155-165 GFLOP/s against 141 with
    6 × 2, the MNIST ones of 128 and 256 columns about 5% slower than 6 × 2 or 12 × 2
    (120-150); and its 48-column panels fit what convolutions make: a 7 × 7 image is one
    panel and a column of dot products, where 32-column panels compute 64 columns.
    ResNet-18 at batch 1 went from 1.17-1.35 to 1.17-1.21 times ONNX Runtime's time (three
    alternated pairs), batch 32 from 1.20-1.30 to 1.13-1.16; the MNIST step stayed level."""
    return (8, 3) if target.lanes(4) >= 16 else (4, 3)


def panel_width(target: CPUTarget) -> int:
    """NR: the columns of a tile."""
    return tile_shape(target)[1] * target.lanes(4)


def pairs_supported(target: CPUTarget) -> bool:
    """Whether `target` has the GEMMs on bf16 pairs (`vdpbf16ps`, AVX512-BF16)."""
    return target.variant == "avx512" and "avx512bf16" in target.feature_set


def block_columns(target: CPUTarget, packed: bool = False) -> int:
    """NC: the columns of a block of B, whole panels; `packed`: of a B packed ahead of time.
    A block of bf16 pairs (`PAIRS_KC` deep) takes as many bytes a column as a float32 one."""
    nr = panel_width(target)
    packed_bytes = _PACKED_BLOCK_BYTES[max(8, target.lanes(4))]
    return max(nr, (packed_bytes if packed else _BLOCK_BYTES) // (KC * 4) // nr * nr)


PANEL_WIDTHS = (12, 24, 48)  # NR on SSE, AVX2 and AVX-512: the workspace fits any of them


def workspace_bytes(n: int, k: int) -> int:
    """Scratch `ranvier_sgemm` needs for op(B) of k × n on any target: one packed block,
    plus 64 bytes for aligning its start."""
    columns = max(min(-(-n // nr) * nr, max(nr, _BLOCK_BYTES // (KC * 4) // nr * nr)) for nr in PANEL_WIDTHS)
    return 64 + max(1, min(k, KC)) * columns * 4


@functools.cache
def gemm_code(target: CPUTarget) -> jit.LoadedCode:
    """`ranvier_sgemm` compiled for `target` and loaded for the life of the process."""
    return jit.generated_function(SYMBOL, Path(__file__), target, build_module)


def gemm_address(target: CPUTarget) -> int:
    return gemm_code(target).address


def packed_gemm_address(target: CPUTarget, narrow: bool = False, pairs: bool = False, paired_a: bool = False) -> int:
    """`ranvier_sgemm_packed`, or with `narrow` its twin on bf16 panels, with `pairs` the
    one on bf16 pairs (`pairs_supported` targets), with `paired_a` as well the one reading A
    as `paired_rows` made it."""
    if pairs:
        return gemm_code(target).address_of(PAIRS_PACKED_SYMBOL + (PAIRED_A_SUFFIX if paired_a else ""))
    return gemm_code(target).address_of(BF16_PACKED_SYMBOL if narrow else PACKED_SYMBOL)


def add_gemm_address(target: CPUTarget) -> int:
    """`ranvier_sgemm_add`: ranvier_sgemm's arguments, C += op(A)·op(B)."""
    return gemm_code(target).address_of(ADD_SYMBOL)


def pairs_gemm_address(target: CPUTarget) -> int:
    """`ranvier_sgemm_dpbf16`, on a `pairs_supported` target: ranvier_sgemm's arguments."""
    return gemm_code(target).address_of(PAIRS_SYMBOL)


def windows_gemm_address(target: CPUTarget, pairs: bool = False, paired_a: bool = False) -> int:
    """`ranvier_sgemm_windows`, or with `pairs` its twin on bf16 pairs (`pairs_supported`
    targets), with `paired_a` as well the one reading A as `paired_rows` made it."""
    if pairs:
        return gemm_code(target).address_of(WINDOWS_PAIRS_SYMBOL + (PAIRED_A_SUFFIX if paired_a else ""))
    return gemm_code(target).address_of(WINDOWS_SYMBOL)


def paired_row_slots(k: int) -> int:
    """32-bit slots from one row of `paired_rows` to the next: its pairs of k, in whole cache lines."""
    return -(-((k + 1) // 2) // _LINE_FLOATS) * _LINE_FLOATS


def paired_rows(a: np.ndarray) -> np.ndarray:
    """A float32 [m, k] rounded to bfloat16 (nearest, ties to even) as the `_paired` entries
    read it: row i's steps 2p and 2p + 1 side by side in slot p of its `paired_row_slots(k)`
    (uint32, the first step in the low half), zeros past k; 64-byte aligned, and a cache line
    of zeros after the last row. The dot products of a block's narrow last panel read whole
    vectors of a row from a slice's first pair, so up to 15 slots past the slice: the next
    slice's pairs, the next row's or that last line, each times the edge's zeros."""
    m, k = a.shape
    slots = paired_row_slots(k)
    storage = np.zeros(m * slots + 2 * _LINE_FLOATS, np.uint32)
    start = (-storage.ctypes.data % PANEL_ALIGNMENT) // 4
    rows = storage[start : start + m * slots].reshape(m, slots)
    halves = np.zeros((m, 2 * slots), ml_dtypes.bfloat16)
    halves[:, :k] = a
    steps = halves.view(np.uint16).reshape(m, slots, 2).astype(np.uint32)
    rows[...] = steps[..., 0] | steps[..., 1] << 16
    return storage[start : start + m * slots + _LINE_FLOATS]


def window_taps(pairs: bool) -> int:
    """The most taps (rows of B) a slice of a convolution's windows packs: KC, on pairs PAIRS_KC."""
    return PAIRS_KC if pairs else KC


PANEL_ALIGNMENT = 64  # bytes: the micro-kernel loads a panel's rows as aligned vectors


def panels_size(columns: int, k: int, target: CPUTarget, pairs: bool = False) -> int:
    """Elements (floats, or bf16) the panels of `columns` columns of op(B) take: whole panels
    of NR; `pairs`: of bf16 pairs, k rounded up to even."""
    nr = panel_width(target)
    return -(-columns // nr) * nr * (k + k % 2 if pairs else k)


def pack_panels(b: np.ndarray, transposed: bool, target: CPUTarget, ranges: list[tuple[int, int]] | None = None,
                narrow: bool = False, pairs: bool = False) -> np.ndarray:
    """op(B) (B float32 [k, n], or [n, k] when `transposed`) as `ranvier_sgemm_packed`
    reads it: panels of NR columns, each k rows of NR floats, zeros past the last column;
    64-byte aligned. With `ranges` (column ranges, each a call's), each range's panels
    follow the previous range's, `panels_size` elements each; else one range of all n.
    `narrow`: rounded to the nearest bfloat16 (ties to even), for `ranvier_sgemm_packed_bf16`;
    `pairs`: so rounded, each panel row a pair of k (a zero past an odd k) for each column,
    for `ranvier_sgemm_packed_dpbf16`."""
    dtype = ml_dtypes.bfloat16 if narrow or pairs else np.float32
    itemsize = np.dtype(dtype).itemsize
    columns = b.T if transposed else b
    k, n = columns.shape
    nr = panel_width(target)
    ranges = ranges or [(0, n)]
    total = sum(panels_size(last - first, k, target, pairs) for first, last in ranges)
    storage = np.empty(total + PANEL_ALIGNMENT // itemsize, dtype)
    start = (-storage.ctypes.data % PANEL_ALIGNMENT) // itemsize
    packed = storage[start : start + total]
    at = 0
    depth = k + k % 2 if pairs else k
    for first, last in ranges:
        count = -(-(last - first) // nr)
        padded = np.zeros((depth, count * nr), dtype)
        padded[:k, : last - first] = columns[:, first:last]
        if pairs:  # [pair, its two steps, panel, column] → [panel, pair, column, its two steps]
            panels = padded.reshape(depth // 2, 2, count, nr).transpose(2, 0, 3, 1)
        else:
            panels = padded.reshape(k, count, nr).transpose(1, 0, 2)
        packed[at : at + count * nr * depth] = panels.reshape(-1)
        at += count * nr * depth
    return packed


def pack_at_run_time(module: ir.Module, target: CPUTarget, b: ir.IRBuilder, transposed: bool, source: ir.Value, ldb: int,
                     k: ir.Value, n: ir.Value, panels: ir.Value, pairs: bool = False) -> None:
    """Emit, where `b` is, the packing of op(B) [k × n] (B from float `source`, rows `ldb`
    apart; op(B) its transpose where `transposed`) into `panels` (64-byte aligned) as
    `ranvier_sgemm_packed` reads them (`pairs`: in bf16 pairs, as `ranvier_sgemm_packed_dpbf16`
    does): the run-time twin of `pack_panels`, by the same packing the GEMM does a block at
    a time."""
    emit = _Emitter(module, target)
    into = Pointer(b, panels, DT_FLOAT32)
    emit.pack(index_value(b, int(transposed)), Pointer(b, source, DT_FLOAT32), index_value(b, ldb), index_value(b, 0),
              index_value(b, 0), index_value(b, k), index_value(b, n), into.view(DT_INT32) if pairs else into, pairs)


def pair_dot(sums: Value, first: Value, second: Value) -> Value:
    """vdpbf16ps: sums + each lane's two products of bf16 pairs (int32 slots of `first` and `second`)."""
    b, lanes = sums.b, sums.lanes
    pairs = ir.VectorType(BF16, 2 * lanes)
    function = declared(b.module, "llvm.x86.avx512bf16.dpbf16ps.512", ir.FunctionType(sums.ir.type, [sums.ir.type, pairs, pairs]))
    return call(b, function, sums, b.bitcast(first.ir, pairs), b.bitcast(second.ir, pairs), dtype=DT_FLOAT32)


def _bf16_pairs(first: Value, second: Value, interleave: bool) -> Value:
    """`convert.bf16_pairs` over Values: the int32 slots of bf16 pairs of `first` and `second`."""
    return Value(first.b, bf16_pairs(first.b, first.ir, second.ir, interleave), DT_INT32)


def _transposed(rows: list[Value]) -> list[Value]:
    """An L × L block of L vectors, transposed in registers (`irutil.transpose_square`)."""
    return [rows[0]._new(vector) for vector in transpose_square(rows[0].b, [row.ir for row in rows])]


class _Emitter:
    """IR for one target: its vector type and the operations the kernels are made of."""

    def __init__(self, module: ir.Module, target: CPUTarget):
        self.module = module
        self.lanes = target.lanes(4)
        self.mr, self.vectors = tile_shape(target)
        self.nr = self.vectors * self.lanes
        self.vector = ir.VectorType(F32, self.lanes)  # SSE's 4 lanes at the least
        self.aligned = 4 * self.lanes  # bytes: a whole vector's alignment, where a panel's rows are

    def zeros(self, b: ir.IRBuilder) -> Value:
        return Value(b, ir.Constant(self.vector, [ir.Constant(F32, 0.0)] * self.lanes), DT_FLOAT32)

    def no_lanes(self, b: ir.IRBuilder, on: bool = False) -> Value:
        """A mask of no lanes (`on`: of every lane)."""
        return Value(b, ir.Constant(ir.VectorType(I1, self.lanes), [ir.Constant(I1, int(on))] * self.lanes), DT_BOOL)

    def prefetch(self, start: Pointer, first: Value, last: Value) -> None:
        """Ask for the cache lines [first, last) from float `start` on into L2."""
        with loop(start.b, first, last, name="line") as line:
            (start + line * _LINE_FLOATS).prefetch()

    # ---- the micro-kernel -----------------------------------------------------------------

    def micro_kernel(self, rows: int, vectors: int, narrow: bool = False, pairs: bool = False) -> ir.Function:
        """C[rows × vectors·L] (=|+=) A-strip[rows × kc] · the panel's first vectors·L
        columns [kc × NR]: a panel over C's edge computes only the vectors it needs.
        `narrow`: the panel holds bf16. `pairs`: the strip and the panel hold bf16 pairs,
        kc of them, each step one `vdpbf16ps` per vector."""
        signature, suffix = (_MICRO_PAIRS, "_pairs") if pairs else (_MICRO_BF16, "_bf16") if narrow else (_MICRO, "")
        function = ir.Function(self.module, signature, name=f"{SYMBOL}_tile{rows}x{vectors}{suffix}")
        function.linkage = "internal"
        b = ir.IRBuilder(function.append_basic_block("entry"))
        kc, a, sa, sk, panel, c, ldc, columns, accumulate, ahead, run, stride, lines = parameters(b, function)
        if narrow:
            panel = panel.view(DT_BFLOAT16)
        lanes = self.lanes
        # A tile of fewer rows than MR has registers to spare: it spreads k's steps over
        # `chains` sets of sums, each its own chain of multiply-adds, added up at the end.
        # With one set a row waited on the multiply-add's latency at every step (a decode
        # step's one row of bf16 panels, 256 × 480 from L2: 7.8 cycles a step, 5.4 with four sets).
        chains = self.mr // rows if narrow or pairs else 1
        sets = [[[local(b, DT_FLOAT32, lanes) for _ in range(vectors)] for _ in range(rows)] for _ in range(chains)]
        for row in (row for chain in sets for row in chain):
            for slot in row:
                slot.set(self.zeros(b))
        row_starts = [a + r * sa for r in range(rows)]
        run_start, in_run = PointerVariable.holding(ahead), local(b, DT_INT64, initial=index_value(b, 0))

        def step_of_k(p: Value, sums: list[list[Local]]) -> None:
            # one line asked for per step, spread among the multiply-adds (a burst of them
            # before the loop would fill the core's miss buffers and stall it)
            with b.if_then((p < lines).ir):
                (run_start.value + in_run.value * _LINE_FLOATS).prefetch()
                following = in_run.value + 1
                wraps = following.equal(run)
                in_run.set(wraps.where(0, following))
                run_start.set(wraps.where(run_start.value + stride, run_start.value))
            step = panel + p * self.nr
            if narrow and rows == 1:
                (step + ROW_AHEAD).view(DT_FLOAT32).prefetch()
            along = p * sk
            if pairs:
                parts = [(step + v * lanes).load(lanes, align=self.aligned) for v in range(vectors)]
                for r in range(rows):
                    pair = row_starts[r][along].splat(lanes)
                    for h in range(vectors):
                        sums[r][h].set(pair_dot(sums[r][h].value, pair, parts[h]))
                return
            parts = [(step + v * lanes).load(lanes, align=(2 if narrow else 4) * lanes) for v in range(vectors)]
            for r in range(rows):
                value = row_starts[r][along].splat(lanes)
                for h in range(vectors):
                    sums[r][h].set(value.mul_add(parts[h], sums[r][h].value))

        whole_steps = kc // chains * chains
        with loop(b, 0, whole_steps, step=chains, name="p") as p:
            for number, chain in enumerate(sets):
                step_of_k(p + number, chain)
        with loop(b, whole_steps, kc, name="pk") as p:
            step_of_k(p, sets[0])
        sums = sets[0]
        for chain in sets[1:]:
            for r in range(rows):
                for h in range(vectors):
                    sums[r][h].set(sums[r][h].value + chain[r][h].value)
        whole = columns.equal(vectors * lanes)
        with b.if_else(whole.ir) as (full, edge):
            with full:
                for r in range(rows):
                    for h in range(vectors):
                        target = c + (r * ldc + h * lanes)
                        total = sums[r][h].value
                        added = total + target.load(lanes, align=4)
                        target.store(accumulate.where(added, total), align=4)
            with edge:
                tile = stack(b, DT_FLOAT32, rows * self.nr)
                for r in range(rows):
                    for h in range(vectors):
                        (tile + (r * self.nr + h * lanes)).store(sums[r][h].value, align=4)
                    with loop(b, 0, columns, name="j") as j:
                        target = c + (r * ldc + j)
                        value = tile[r * self.nr + j]
                        target.store(accumulate.where(value + target.load(), value))
        b.ret_void()
        return function

    def dot_kernel(self, rows: int) -> ir.Function:
        """C[rows × columns] (=|+=) A-strip[rows × kc] · the edge's columns, each a dot
        product along k: A's rows read in place (k contiguous), each edge column kc
        contiguous floats (`ROW_KC` apart). Two vectors of k per row in flight, so the rows'
        sums are eight independent chains of multiply-adds."""
        function = ir.Function(self.module, _DOT, name=f"{SYMBOL}_dot{rows}")
        function.linkage = "internal"
        b = ir.IRBuilder(function.append_basic_block("entry"))
        kc, a, sa, edge, c, ldc, columns, accumulate = parameters(b, function)
        lanes, double = self.lanes, 2 * self.lanes
        sums = [[local(b, DT_FLOAT32, lanes) for _ in range(2)] for _ in range(rows)]
        totals = [local(b, DT_FLOAT32) for _ in range(rows)]
        row_starts = [a + r * sa for r in range(rows)]
        whole = kc // double * double
        with loop(b, 0, columns, name="dj") as j:
            column = edge + j * ROW_KC
            for pair in sums:
                for slot in pair:
                    slot.set(self.zeros(b))
            with loop(b, 0, whole, step=double, name="dp") as p:
                halves = [(column + (p + h * lanes)).load(lanes, align=4) for h in range(2)]
                for r in range(rows):
                    for h in range(2):
                        value = (row_starts[r] + (p + h * lanes)).load(lanes, align=4)
                        sums[r][h].set(value.mul_add(halves[h], sums[r][h].value))
            for r in range(rows):
                vector = sums[r][0].value + sums[r][1].value
                total = vector.lane(0)
                for e in range(1, lanes):
                    total = total + vector.lane(e)
                totals[r].set(total)
            with loop(b, whole, kc, name="dt") as p:
                step = column[p]
                for r in range(rows):
                    totals[r].set(totals[r].value + row_starts[r][p] * step)
            for r in range(rows):
                target = c + (r * ldc + j)
                total = totals[r].value
                target.store(accumulate.where(target.load() + total, total))
        b.ret_void()
        return function

    def pairs_dot_kernel(self, rows: int) -> ir.Function:
        """`dot_kernel` on bf16 pairs: A's strip as `copy_pairs` makes it (pairs along k, each
        row zeros to a whole vector) or `paired_rows` in place (a slice's rows start anywhere
        in a line, and a row's last vector reads the next slice's pairs: finite, times the
        edge's zeros) and each edge column's pairs likewise (`ROW_KC` slots apart), a vector
        of pairs of a row and a column per `vdpbf16ps`."""
        function = ir.Function(self.module, _DOT_PAIRS, name=f"{SYMBOL}_dot{rows}_pairs")
        function.linkage = "internal"
        b = ir.IRBuilder(function.append_basic_block("entry"))
        kc, a, sa, edge, c, ldc, columns, accumulate = parameters(b, function)
        lanes = self.lanes
        sums = [local(b, DT_FLOAT32, lanes) for _ in range(rows)]
        row_starts = [a + r * sa for r in range(rows)]
        with loop(b, 0, columns, name="dj") as j:
            column = edge + j * ROW_KC
            for slot in sums:
                slot.set(self.zeros(b))
            with loop(b, 0, kc, step=lanes, name="dp") as p:
                pairs = (column + p).load(lanes, align=4)
                for r in range(rows):
                    sums[r].set(pair_dot(sums[r].value, (row_starts[r] + p).load(lanes, align=4), pairs))
            for r in range(rows):
                vector = sums[r].value
                total = vector.lane(0)
                for e in range(1, lanes):
                    total = total + vector.lane(e)
                target = c + (r * ldc + j)
                target.store(accumulate.where(target.load() + total, total))
        b.ret_void()
        return function

    # ---- copying a strip of A ---------------------------------------------------------------

    def copy_strip(self, transposed: Value, strip: Pointer, sa: Value, sk: Value, kc: Value, rows: int, copy: Pointer) -> None:
        """A's strip (`rows` rows, kc steps of k) k-major into `copy`: a step's values
        adjacent, as the micro-kernel then reads them (row stride 1, k stride `rows`)."""
        b = strip.b
        with b.if_else(transposed.ir) as (side_by_side, apart):
            with side_by_side, loop(b, 0, kc, name="ka") as p:
                (copy + p * rows).store((strip + p * sk).load(rows, align=4, vector=True), align=4)
            with apart, loop(b, 0, kc, name="kb") as p:
                for r in range(rows):
                    copy[p * rows + r] = strip[r * sa + p]

    def copy_pairs(self, transposed: Value, strip: Pointer, sa: Value, sk: Value, kc: Value, rows: int,
                   copy: Pointer) -> tuple[Value, Value]:
        """A's strip (`rows` rows, kc steps of k) as bf16 pairs into `copy` (64-byte
        aligned), a zero after an odd kc; returns the copy's (row stride, pair stride) in
        slots. A's rows along k (not `transposed`) convert 32 steps at a time into a row of
        the copy each, whole vectors; a transposed strip's rows of k, `rows` values side by
        side, interleave two at a time into the pairs of one step."""
        b, lanes = strip.b, self.lanes
        row_slots = (kc + (2 * lanes - 1)) // (2 * lanes) * lanes
        pair_steps = (kc + 1) // 2
        with b.if_else(transposed.ir) as (side_by_side, apart):
            with side_by_side, loop(b, 0, pair_steps, name="cp") as p:
                second_inside = (p * 2 + 1) < kc
                first = (strip + p * 2 * sk).load(rows, align=4, vector=True)
                second = (strip + second_inside.where(p * 2 + 1, 0) * sk).load(rows, align=4, vector=True)
                second = second_inside.where(second, second.zeros())
                (copy + p * rows).store(_bf16_pairs(first, second, interleave=True), align=4)
            with apart, loop(b, 0, row_slots, step=lanes, name="cq") as q:
                steps = q * 2
                masks = self._lane_masks(steps, kc, 2)
                for r in range(rows):
                    start = strip + (r * sa + steps)
                    first, second = ((start + h * lanes).masked_load(masks[h]) for h in range(2))
                    (copy + (r * row_slots + q)).store(_bf16_pairs(first, second, interleave=False), align=4 * lanes)
        return transposed.where(1, row_slots), transposed.where(rows, index_value(b, 1))

    # ---- packing B ------------------------------------------------------------------------

    def pack(self, tb: Value, source: Pointer, ldb: Value, pc: Value, jc: Value, kc: Value, nc: Value, packed: Pointer,
             pairs: bool = False) -> None:
        """op(B)[pc:pc+kc, jc:jc+nc] into panels of NR columns, zeros past nc; `pairs`: of
        bf16 pairs (`packed` slots), a panel's row p holding op(B)[pc+2p, j] and
        op(B)[pc+2p+1, j] (zero past kc) for each of its columns."""
        b, nr = tb.b, self.nr
        depth = (kc + 1) // 2 if pairs else kc  # a panel's rows
        panels = (nc + (nr - 1)) // nr
        with loop(b, 0, panels, name="q") as q:
            first = q * nr
            columns = (nc - first).minimum(nr)
            panel = packed + q * (depth * nr)
            column = jc + first
            with b.if_else(tb.not_equal(0).ir) as (transposed, plain):
                with transposed:
                    if pairs:
                        self._pack_pair_columns(source, ldb, pc, column, kc, depth, columns, panel)
                    else:
                        self._pack_columns(source, ldb, pc, column, kc, columns, panel)
                with plain:
                    if pairs:
                        self._pack_pair_rows(source, ldb, pc, column, kc, depth, columns, panel)
                    else:
                        self._pack_rows(source, ldb, pc, column, kc, columns, panel)

    def _pack_columns(self, source: Pointer, ldb: Value, pc: Value, column: Value, kc: Value, columns: Value,
                      panel: Pointer) -> None:
        """op(B)[p, j] = B[j, p]: each column of the panel is a run of one of B's rows.
        The panel goes in square blocks, L rows of B by L steps of k (L the vector lanes):
        L vector loads (zeros for a column past B's edge), a transpose in registers, L
        vector stores; the steps of k left over go element by element."""
        b, nr, lanes = source.b, self.nr, self.lanes
        whole_steps = kc // lanes * lanes
        with loop(b, 0, whole_steps, step=lanes, name="pb") as p:
            for part in range(self.vectors):
                rows = []
                for e in range(lanes):
                    inside = columns > part * lanes + e
                    row = column + inside.where(index_value(b, part * lanes + e), 0)
                    value = (source + (row * ldb + (pc + p))).load(lanes, align=4)
                    rows.append(inside.where(value, self.zeros(b)))
                for t, vector in enumerate(_transposed(rows)):
                    (panel + ((p + t) * nr + part * lanes)).store(vector, align=self.aligned)
        with loop(b, 0, nr, name="jt") as j:
            inside = j < columns
            row = source + ((column + j) * ldb + pc)
            with loop(b, whole_steps, kc, name="pt") as p:
                panel[p * nr + j] = inside.where(row[inside.where(p, 0)], 0.0)

    def _pack_rows(self, source: Pointer, ldb: Value, pc: Value, column: Value, kc: Value, columns: Value,
                   panel: Pointer) -> None:
        """op(B)[p, j] = B[p, j]: each row of the panel is a run of one of B's rows, copied
        as V vectors; over B's edge as masked loads, zeros past `columns` (element by
        element, a 16-column edge of a 48-column panel cost as much to pack and compute as
        a whole panel)."""
        b, nr, lanes = source.b, self.nr, self.lanes
        masks = self._lane_masks(index_value(b, 0), columns, self.vectors)
        whole = columns.equal(nr)
        with loop(b, 0, kc, name="pr") as p:
            row = source + ((pc + p) * ldb + column)
            for h, mask in enumerate(masks):
                start = row + h * lanes
                value = choose(whole, functools.partial(start.load, lanes, align=4), functools.partial(start.masked_load, mask))
                (panel + (p * nr + h * lanes)).store(value, align=self.aligned)

    def _lane_masks(self, start: Value, limit: Value, count: int) -> list[Value]:
        """`count` vectors' lanes i, from `start` on, where start + i < limit."""
        lane = lane_numbers(start.b, self.lanes)
        return [(lane + (start + h * self.lanes).splat(self.lanes)) < limit.splat(self.lanes) for h in range(count)]

    def _pack_pair_rows(self, source: Pointer, ldb: Value, pc: Value, column: Value, kc: Value, pair_steps: Value,
                        columns: Value, panel: Pointer) -> None:
        """op(B)[p, j] = B[p, j]: two of B's rows, a vector of columns at a time (masked
        over B's edge), interleave into a row of pairs."""
        b, lanes = source.b, self.lanes
        masks = self._lane_masks(index_value(b, 0), columns, self.vectors)
        with loop(b, 0, pair_steps, name="pp") as p:
            step = pc + p * 2
            second_inside = (p * 2 + 1) < kc
            first_row = source + (step * ldb + column)
            second_row = first_row + second_inside.where(ldb, 0)
            for h, mask in enumerate(masks):
                first = (first_row + h * lanes).masked_load(mask)
                second = (second_row + h * lanes).masked_load(second_inside.where(mask, self.no_lanes(b)))
                (panel + (p * self.nr + h * lanes)).store(_bf16_pairs(first, second, interleave=True), align=4 * lanes)

    def _pack_pair_columns(self, source: Pointer, ldb: Value, pc: Value, column: Value, kc: Value, pair_steps: Value,
                           columns: Value, panel: Pointer) -> None:
        """op(B)[p, j] = B[j, p]: each of L of B's rows gives L pairs of k (2L floats,
        masked past kc), and the L × L block of pairs, transposed in registers, is L rows of
        the panel's L columns; rows past the last pair are not stored."""
        b, lanes = source.b, self.lanes
        with loop(b, 0, pair_steps, step=lanes, name="pt") as p:
            steps = p * 2
            masks = self._lane_masks(steps, kc, 2)
            for part in range(self.vectors):
                rows = []
                for j in range(lanes):
                    inside = columns > part * lanes + j
                    row = column + inside.where(index_value(b, part * lanes + j), 0)
                    start = source + (row * ldb + (pc + steps))
                    first, second = ((start + h * lanes).masked_load(inside.where(masks[h], self.no_lanes(b))) for h in range(2))
                    rows.append(_bf16_pairs(first, second, interleave=False))
                for t, vector in enumerate(_transposed(rows)):
                    with b.if_then(((p + t) < pair_steps).ir):
                        (panel + ((p + t) * self.nr + part * lanes)).store(vector, align=4 * lanes)

    # ---- packing a convolution's windows ---------------------------------------------------

    def pack_windows(self, image: Pointer, geometry: dict[str, Value], first_column: Value, pc: Value, jc: Value, kc: Value,
                     nc: Value, packed: Pointer, taps: Pointer, positions: Pointer, pairs: bool = False) -> None:
        """B[pc:pc+kc, jc:jc+nc] of the im2col matrix of `image` (see the module's docstring)
        into panels of NR columns, zeros in the padding and past nc; `pairs`: of bf16 pairs
        (`packed` slots), a panel's row holding two taps of each column, as `pack` makes
        them. `taps` (3 × `window_taps(pairs)` i32) and `positions` (3 × NR i32) are
        scratch: each row's offset in the image, kernel row and kernel column; each column's
        offset, first input row and first input column. A vector of columns in one output
        row is one masked load per row of B (stride 1) or two and a shuffle (stride 2); one
        over a few output rows the same for each row, into its lanes; any other vector is
        one gather."""
        g = geometry
        b, lanes, nr = image.b, self.lanes, self.nr
        depth = window_taps(pairs)

        def table(array: Pointer, field: int, size: int, at: Value | int) -> Pointer:
            return array + (field * size + at)

        per_tap = g["kernel_height"] * g["kernel_width"]
        phases, plane = g["phases"], g["height"] * g["width"]
        with loop(b, 0, kc, name="tap") as p:
            tap = pc + p
            channel, within = tap // per_tap, tap % per_tap
            kernel_row, kernel_column = within // g["kernel_width"], within % g["kernel_width"]
            row, column = kernel_row // phases, kernel_column // phases  # in the tap's phase plane
            phase = (kernel_row % phases) * phases + kernel_column % phases
            offset = (channel * (phases * phases) + phase) * plane + (row * g["width"] + column)
            for field, value in enumerate((offset, row, column)):
                table(taps, field, depth, p).store(value.cast(DT_INT32))
        # rows and columns of a plane the kernel reaches over from a position's first
        reach_height, reach_width = ((g[name] - 1) // phases + 1 for name in ("kernel_height", "kernel_width"))

        height, width = (g[name].cast(DT_INT32).splat(lanes) for name in ("height", "width"))
        row_step = g["stride_height"].cast(DT_INT32)  # input rows from one output row to the next
        outside = Value(b, ir.Constant(I32, -(1 << 30)), DT_INT32)  # a first input row no kernel row brings inside
        panels = (nc + (nr - 1)) // nr
        with loop(b, 0, panels, name="wq") as q:
            first = q * nr
            columns = nc - first
            start = first_column + (jc + first)
            y, x = start // g["out_width"], start % g["out_width"]
            for j in range(nr):  # the output position of each column, stepping along the rows
                if j:
                    x = x + 1
                    wrapped = x.equal(g["out_width"])
                    y, x = wrapped.where(y + 1, y), wrapped.where(0, x)
                inside = columns > j
                top = (y * g["stride_height"] - g["pad_height"]).cast(DT_INT32)
                left = (x * g["stride_width"] - g["pad_width"]).cast(DT_INT32)
                # a column past nc reads nothing, from an address inside the image: a masked
                # load from an unmapped page takes a microcode assist even with no lane on
                offset = inside.where(top * g["width"].cast(DT_INT32) + left, 0)
                for field, value in enumerate((offset, inside.where(top, outside), left)):
                    table(positions, field, nr, j).store(value)
            panel_rows = (kc + 1) // 2 if pairs else kc
            panel = packed + q * (panel_rows * nr)
            for h in range(self.vectors):
                offsets, tops, lefts = (table(positions, field, nr, h * lanes).load(lanes, align=4) for field in range(3))
                first_top, last_top = (table(positions, 1, nr, h * lanes + e).load() for e in (0, lanes - 1))
                first_offset = table(positions, 0, nr, h * lanes).load()
                one_row = first_top.equal(last_top)
                # a vector over a few output rows (a small image's): a masked load per row (lanes
                # past nc have the lowest first row, so the highest is the last column's)
                highest = declared(self.module, f"llvm.vector.reduce.smax.v{lanes}i32",
                                   ir.FunctionType(I32, [ir.VectorType(I32, lanes)]))
                highest_top = call(b, highest, tops, dtype=DT_INT32)
                few_rows = (highest_top - first_top) <= row_step * (_MAX_SEGMENTS - 1)
                first_left, last_left = (table(positions, 2, nr, h * lanes + e).load() for e in (0, lanes - 1))
                # every tap of every lane inside the image: loads need no mask
                inside = (((first_top >= 0) & ((last_top + reach_height.cast(DT_INT32)) <= g["height"].cast(DT_INT32)))
                          & ((first_left >= 0) & ((last_left + reach_width.cast(DT_INT32)) <= g["width"].cast(DT_INT32))))
                columns_of_vector = (offsets, tops, lefts, first_offset)
                target = panel + h * lanes
                stride = g["stride_width"]

                def pack(way: str, masked: bool, columns_of_vector=columns_of_vector, target=target) -> None:
                    self._pack_window_vector(way, masked, image, (taps, depth), kc, columns_of_vector, (height, width),
                                             row_step, target, pairs)

                with b.if_else((one_row & stride.equal(1)).ir) as (run, other):
                    with run, b.if_else(inside.ir) as (clear, edge):
                        with clear:
                            pack("run", masked=False)
                        with edge:
                            pack("run", masked=True)
                    with other, b.if_else((one_row & stride.equal(2)).ir) as (halves, scattered):
                        with halves, b.if_else(inside.ir) as (clear, edge):
                            with clear:
                                pack("every other", masked=False)
                            with edge:
                                pack("every other", masked=True)
                        with scattered, b.if_else(few_rows.ir) as (by_rows, by_lanes):
                            with by_rows, b.if_else(stride.equal(1).ir) as (whole, halves):
                                with whole:
                                    pack("segments", masked=True)
                                with halves, b.if_else(stride.equal(2).ir) as (every_other, scattered_rows):
                                    with every_other:
                                        pack("segments of every other", masked=True)
                                    with scattered_rows:
                                        pack("lanes", masked=True)
                            with by_lanes:
                                pack("lanes", masked=True)

    def _pack_window_vector(self, way: str, masked: bool, image: Pointer, taps: tuple[Pointer, int], kc: Value,
                            columns: tuple[Value, ...], bounds: tuple[Value, Value], row_step: Value, target: Pointer,
                            pairs: bool) -> None:
        """A vector of B's columns for each of the slice's kc rows, stored NR floats apart from
        `target` (`pairs`: two rows' as NR bf16 pairs, a zero after an odd kc), read `way`:
        "run" (one load), "every other" (stride 2: two loads, every other element),
        "segments" (stride 1 over up to `_MAX_SEGMENTS` output rows: a masked load per row,
        each into its lanes), "segments of every other" (stride 2 over as many: two loads
        and a shuffle per row, each into its lanes) or "lanes" (a gather of each lane's
        element); `masked`: lanes
        whose tap falls in the padding are zeros, not read (else every lane is inside).
        `taps` is the taps' table and its fields' length; `columns` holds the vector's
        offsets, first input rows and columns (i32 vectors) and its first offset; `bounds`
        the image's height and width (splatted)."""
        b, lanes = image.b, self.lanes
        offsets, tops, lefts, first_offset = columns
        step = 2 if way == "segments of every other" else 1  # image columns from one lane to the next
        segments = []
        if way.startswith("segments"):  # each output row's lanes, and where lane 0 would read for that row's run
            first_top = tops.lane(0)
            popcount = intrinsic(self.module, "ctpop", ir.IntType(lanes))
            for row in range(_MAX_SEGMENTS):
                top = first_top + row_step * row
                # lanes of the rows above (columns past nc, with the lowest first row, are not)
                before = (tops < top.splat(lanes)) & (tops >= first_top.splat(lanes))
                first_lane = Value(b, b.zext(b.call(popcount, [b.bitcast(before.ir, ir.IntType(lanes))]), I32), DT_INT32)
                row_start = offsets.lane(first_lane.minimum(lanes - 1)) - first_lane * step
                segments.append((tops.equal(top.splat(lanes)), row_start))
        table, depth = taps

        def row_of_b(p: Value) -> Value:
            """The vector's columns of B's row p: the image under tap p."""
            tap_offset, tap_row, tap_column = (table[field * depth + p] for field in range(3))
            if masked:
                rows = (tops + tap_row.splat(lanes)).cast(DT_UINT32) < bounds[0].cast(DT_UINT32)
                mask = rows & ((lefts + tap_column.splat(lanes)).cast(DT_UINT32) < bounds[1].cast(DT_UINT32))
            else:
                mask = self.no_lanes(b, on=True)  # every lane
            start = image + (tap_offset + first_offset).cast(DT_INT64)
            if way == "run":
                return start.masked_load(mask)
            if way == "segments":
                value = self.zeros(b)
                for lanes_of_row, row_start in segments:
                    at = image + (tap_offset + row_start).cast(DT_INT64)
                    value = at.masked_load(mask & lanes_of_row, value)
                return value
            if way == "segments of every other":
                value = self.zeros(b)
                for lanes_of_row, row_start in segments:
                    at = image + (tap_offset + row_start).cast(DT_INT64)
                    value = lanes_of_row.where(self._every_other(at, mask & lanes_of_row), value)
                return value
            if way == "every other":
                return self._every_other(start, mask)
            # one gather: the lanes' addresses from their offsets in the image
            return image.gather(mask.where(offsets + tap_offset.splat(lanes), 0), mask, self.zeros(b))

        if not pairs:
            with loop(b, 0, kc, name="wp") as p:
                (target + p * self.nr).store(row_of_b(p), align=self.aligned)
            return
        with loop(b, 0, (kc + 1) // 2, name="wq") as q:
            first = q * 2
            inside = (first + 1) < kc
            second = inside.where(row_of_b(inside.where(first + 1, first)), self.zeros(b))
            (target + q * self.nr).store(_bf16_pairs(row_of_b(first), second, interleave=True), align=self.aligned)

    def _every_other(self, start: Pointer, mask: Value) -> Value:
        """Lane e: element 2e from `start` where `mask` leaves lane e on, else zero (not read)."""
        lanes = self.lanes
        halves = []
        for half in (0, 1):  # element 2e of the 2L read is lane e's
            evens = [(half * lanes + e) // 2 if e % 2 == 0 else lanes for e in range(lanes)]
            halves.append((start + half * lanes).masked_load(mask.shuffle(evens, self.no_lanes(start.b))))
        return halves[0].shuffle([2 * e for e in range(lanes)], halves[1])


def build_module(target: CPUTarget) -> ir.Module:
    module = ir.Module(SYMBOL)
    module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    emit = _Emitter(module, target)
    tiles: dict[tuple[int, int | str], ir.Function] = {
        (rows, vectors): emit.micro_kernel(rows, vectors) for rows in range(1, emit.mr + 1) for vectors in range(1, emit.vectors + 1)}
    tiles.update({(rows, "dot"): emit.dot_kernel(rows) for rows in range(1, emit.mr + 1)})
    narrow_tiles: dict[tuple[int, int | str], ir.Function] = {
        (rows, vectors): emit.micro_kernel(rows, vectors, narrow=True) for rows in range(1, emit.mr + 1)
        for vectors in range(1, emit.vectors + 1)}
    narrow_tiles.update({(rows, "dot"): tiles[rows, "dot"] for rows in range(1, emit.mr + 1)})
    _MatrixGemm(emit, tiles, block_columns(target)).define()
    _MatrixGemm(emit, tiles, block_columns(target), add=True).define()
    _PanelsGemm(emit, tiles, block_columns(target, packed=True)).define()
    _PanelsGemm(emit, narrow_tiles, block_columns(target, packed=True), narrow=True).define()
    _WindowsGemm(emit, tiles, block_columns(target)).define()
    if pairs_supported(target):
        pair_tiles: dict[tuple[int, int | str], ir.Function] = {
            (rows, vectors): emit.micro_kernel(rows, vectors, pairs=True) for rows in range(1, emit.mr + 1)
            for vectors in range(1, emit.vectors + 1)}
        pair_tiles.update({(rows, "dot"): emit.pairs_dot_kernel(rows) for rows in range(1, emit.mr + 1)})
        _MatrixGemm(emit, pair_tiles, block_columns(target), pairs=True).define()
        for paired_a in (False, True):
            _PanelsGemm(emit, pair_tiles, block_columns(target, packed=True), pairs=True, paired_a=paired_a).define()
            _WindowsGemm(emit, pair_tiles, block_columns(target), pairs=True, paired_a=paired_a).define()
    return module


@dataclasses.dataclass
class _Slice:
    """A block of B's columns and a slice of k, as the loops reach it, and the next one's (the
    block its tiles bring into the caches meanwhile)."""

    jc: Value  # the block's first column
    nc: Value  # its columns
    pc: Value  # the slice's first step of k
    kc: Value  # its steps
    tiled_panels: Value = dataclasses.field(init=False)  # panels the tiles compute (the last may be dot products)
    strips: Value = dataclasses.field(init=False)  # strips of MR rows of A
    same_columns: Value = dataclasses.field(init=False)  # whether the next block is these columns' next slice of k
    upcoming_pc: Value = dataclasses.field(init=False)  # the next block's first step of k
    upcoming_kc: Value = dataclasses.field(init=False)  # and its steps
    accumulate: Value = dataclasses.field(init=False)  # whether C has the earlier slices' sums to add to
    last_first: Value = dataclasses.field(init=False)  # the block's last panel's first column
    edge_columns: Value = dataclasses.field(init=False)  # and its columns
    dots: Value = dataclasses.field(init=False)  # whether that panel is dot products, not tiles


class _Gemm:
    """One GEMM entry point: the loops every source of B shares (k in slices, B's columns in
    blocks, A's rows in strips, each strip's tiles along the block's panels). A subclass
    says where B comes from: its entry's arguments, how a block is packed (if it is), where
    a panel is, and which lines a tile brings into L2 while it computes."""

    def __init__(self, emit: _Emitter, tiles: dict[tuple[int, int | str], ir.Function], block: int, pairs: bool = False,
                 narrow: bool = False, add: bool = False, paired_a: bool = False):
        self.emit, self.tiles, self.block, self.pairs, self.narrow = emit, tiles, block, pairs, narrow
        self.add = add  # C += op(A)·op(B): every slice of k adds to C
        self.paired_a = paired_a  # on pairs: A is `paired_rows`' pairs, its strips read in place

    def symbol(self, name: str) -> str:
        """The entry's name: `name`, with `PAIRED_A_SUFFIX` where A comes paired."""
        return name + PAIRED_A_SUFFIX if self.paired_a else name

    def define(self) -> None:
        raise NotImplementedError

    def _entry(self, signature: ir.FunctionType, name: str) -> list[Any]:
        """The entry point's function, `self.b` at its start; its arguments as Values and pointers."""
        function = ir.Function(self.emit.module, signature, name=name)
        self.b = ir.IRBuilder(function.append_basic_block("entry"))
        return parameters(self.b, function)

    def panel_rows(self, steps: Value) -> Value:
        """The rows of a panel `steps` steps of k take: pairs of them, on pairs."""
        return (steps + 1) // 2 if self.pairs else steps

    # ---- what a source of B says ----------------------------------------------------------

    def pack_block(self, s: _Slice) -> None:
        """Pack the slice's block of B (where B is not packed ahead of time)."""

    def panel(self, s: _Slice, first: Value) -> Pointer:
        """The slice's panel from the block's column `first`."""
        raise NotImplementedError

    def tile_ahead(self, s: _Slice, i0: Value, q: Value, first: Value, a_ahead: list[Any]) -> list[Any]:
        """What tile q of the strip at row i0 brings into L2 as it computes: (ahead, run,
        stride, lines), runs of `run` lines `stride` floats apart from `ahead`. `a_ahead`:
        the next strip's rows of A (read in place), the strip's first tile's to ask for."""
        return [*a_ahead[:3], q.equal(0).where(a_ahead[3], 0)]

    # ---- the loops ------------------------------------------------------------------------

    def loops(self, ta: Value, m: Value, n: Value, k: Value, a: Pointer, lda: Value, c: Pointer, ldc: Value) -> None:
        """C[m × n] = op(A) · op(B), then the entry returns."""
        b, emit, pairs = self.b, self.emit, self.pairs
        self.m, self.n, self.k, self.a, self.lda, self.c, self.ldc = m, n, k, a, lda, c, ldc
        self.transposed = transposed = ta.not_equal(0)
        self.sa, self.sk = transposed.where(1, lda), transposed.where(lda, 1)
        # A strip read in place touches a cache line per step of k when A is transposed (MR
        # values side by side, rows lda apart), or MR lines of one L1 set when rows are a
        # multiple of 4 KiB apart: the panels would evict it. Such a strip is copied first.
        # A strip on pairs is always copied: into pairs.
        self.copy_a = Value(b, ir.Constant(I1, not self.paired_a), DT_BOOL) if pairs else transposed | (lda & 1023).equal(0)
        if pairs:
            self.strip_copy = stack(b, DT_INT32, emit.mr * PAIRS_KC // 2, align=64)  # its rows are stored as aligned vectors
        else:
            self.strip_copy = stack(b, DT_FLOAT32, max(emit.mr * KC, ROW_KC))
        self.edge = stack(b, DT_FLOAT32, DOT_COLUMNS * ROW_KC)
        nr, nc_max = index_value(b, emit.nr), index_value(b, self.block)

        if not self.add:
            with b.if_then(k.equal(0).ir), loop(b, 0, m, name="zi") as i, loop(b, 0, n, name="zj") as j:  # an empty sum: C is zeros
                c[i * ldc + j] = Value(b, ir.Constant(F32, 0.0), DT_FLOAT32)

        # k in slices of at most KC steps, as even as can be (784 is 4 × 196, not 3 × 256 + 16)
        depth = m.equal(1).where(ROW_KC, index_value(b, KC)) if self.narrow else index_value(b, PAIRS_KC if pairs else KC)
        slices = (k + (depth - 1)) // depth
        slice_steps = (k + (slices - 1)) // (slices > 0).where(slices, 1)
        if pairs:  # even, so that no pair straddles two slices
            slice_steps = (slice_steps + 1) & -2
        with loop(b, 0, n, step=self.block, name="jc") as jc:
            nc = nc_max.minimum(n - jc)
            panels = (nc + (emit.nr - 1)) // nr
            with loop(b, 0, slices, name="slice") as number:
                pc = number * slice_steps
                self.block_slice(_Slice(jc, nc, pc, slice_steps.minimum(k - pc)), panels, slice_steps)
        b.ret_void()

    def block_slice(self, s: _Slice, panels: Value, slice_steps: Value) -> None:
        """The slice's block of B times op(A)'s slice of k, strip by strip."""
        b, nr = self.b, index_value(self.b, self.emit.nr)
        self.pack_block(s)
        s.accumulate = Value(b, ir.Constant(I1, 1), DT_BOOL) if self.add else s.pc > 0
        # a narrow last panel as dot products, where A's rows are read in place (k contiguous)
        s.last_first = (panels - 1) * nr
        s.edge_columns = s.nc - s.last_first
        # (on pairs, from A's strip copy, whose rows run along k where A is not transposed)
        narrow = s.edge_columns <= DOT_COLUMNS
        s.dots = ~self.transposed & narrow if self.pairs else ~self.copy_a & narrow
        with b.if_then(s.dots.ir):
            last, depth = self.panel(s, s.last_first), self.panel_rows(s.kc)
            edge = self.edge.view(DT_INT32) if self.pairs else self.edge
            with loop(b, 0, s.edge_columns, name="ej") as j:
                with loop(b, 0, depth, name="ep") as p:
                    edge[j * ROW_KC + p] = last[p * nr + j]
                if self.pairs:  # zeros to a whole vector, as the strip copy's rows have
                    lanes = self.emit.lanes
                    with loop(b, depth, (depth + (lanes - 1)) // lanes * lanes, name="ez") as p:
                        edge[j * ROW_KC + p] = Value(b, ir.Constant(I32, 0), DT_INT32)
        s.tiled_panels = panels - s.dots.cast(DT_INT64)

        # the next block: these columns' next slice of k, else the next columns' first slice
        next_pc = s.pc + s.kc
        s.same_columns = next_pc < self.k
        s.upcoming_pc = s.same_columns.where(next_pc, 0)
        s.upcoming_kc = slice_steps.minimum(self.k - s.upcoming_pc)
        s.strips = (self.m + (self.emit.mr - 1)) // self.emit.mr
        self.prepare_ahead(s, self.copy_a)
        by_strips(b, self.m.ir, self.emit.mr, functools.partial(self.strip, s))

    def next_strip_of_a(self, s: _Slice, i0: Value) -> list[Any]:
        """The lines of the next strip's rows of A (this slice of k; after the last strip, the
        first strip's next slice), for the strip's first tile to bring into L2 as it computes:
        a strip reads a few short runs, too short for the hardware's prefetchers to follow from
        memory. (ahead, run, stride, lines) as a tile takes them."""
        mr, m = self.emit.mr, self.m
        following = i0 + mr
        wraps = following >= m
        row = wraps.where(0, following)
        steps_in = wraps.where(s.pc + s.kc, s.pc)
        per_slot = 2 if self.paired_a else 1  # steps of k in a float's bytes of a row of A
        run = s.kc // (per_slot * _LINE_FLOATS) + 1
        rows_left = index_value(self.b, mr).minimum(m - row)
        wanted = ~self.transposed & (steps_in < self.k)
        lines = wanted.where(rows_left * run, 0)
        return [self.a + (row * self.lda + steps_in // per_slot), run, self.lda, lines]

    def strip(self, s: _Slice, first_row: ir.Value, rows: int) -> None:
        """C's `rows` rows from `first_row` in the block's columns: the strip's tiles along the
        panels (a micro-kernel of as many vectors as each needs), then the dot products."""
        b, emit, c, ldc = self.b, self.emit, self.c, self.ldc
        i0, nr = index_value(b, first_row), index_value(b, emit.nr)
        strip_a = self.a + (i0 * self.sa + s.pc * self.sk)
        if self.paired_a:
            read_a = (self.a + (i0 * self.lda + s.pc // 2)).view(DT_INT32)
            row_step, k_step = self.lda, index_value(b, 1)
        elif self.pairs:
            row_step, k_step = emit.copy_pairs(self.transposed, strip_a, self.sa, self.sk, s.kc, rows, self.strip_copy)
            read_a = self.strip_copy
        else:
            with b.if_then(self.copy_a.ir):
                emit.copy_strip(self.transposed, strip_a, self.sa, self.sk, s.kc, rows, self.strip_copy)
            read_a = self.copy_a.where(self.strip_copy, strip_a)
            row_step, k_step = self.copy_a.where(1, self.sa), self.copy_a.where(rows, self.sk)
        a_ahead = self.next_strip_of_a(s, i0)
        with loop(b, 0, s.tiled_panels, name="jr") as q:
            first = q * nr
            columns = nr.minimum(s.nc - first)
            arguments = [self.panel_rows(s.kc), read_a, row_step, k_step, self.panel(s, first),
                         c + (i0 * ldc + (s.jc + first)), ldc, columns, s.accumulate]
            arguments += self.tile_ahead(s, i0, q, first, a_ahead)
            # the last panel of a block may need fewer vectors (128 columns are 5 panels of 24 and 8)
            needed = (columns + (emit.lanes - 1)) // emit.lanes
            for vectors in range(1, emit.vectors + 1):
                with b.if_then(needed.equal(vectors).ir):
                    call(b, self.tiles[rows, vectors], *arguments)
        with b.if_then(s.dots.ir):
            call(b, self.tiles[rows, "dot"], self.panel_rows(s.kc), read_a, row_step,
                 self.edge.view(DT_INT32) if self.pairs else self.edge, c + (i0 * ldc + (s.jc + s.last_first)), ldc,
                 s.edge_columns, s.accumulate)

    def prepare_ahead(self, s: _Slice, copy_a: Value) -> None:
        """Work out, once a slice, what the tiles will ask for of the next block."""


class _MatrixGemm(_Gemm):
    """`ranvier_sgemm` (`ranvier_sgemm_dpbf16` on pairs): B a matrix, packed a block at a time
    into the workspace; while a block computes, its tiles bring the next block's source rows
    of B into L2, so its packing reads them from there rather than from memory."""

    def define(self) -> None:
        name = PAIRS_SYMBOL if self.pairs else ADD_SYMBOL if self.add else SYMBOL
        ta, tb, m, n, k, a, lda, matrix, ldb, c, ldc, workspace = self._entry(_FUNCTION, name)
        self.tb, self.matrix, self.ldb = tb, matrix, ldb
        self.block_of_b = Pointer(self.b, cache_line_aligned(self.b, workspace.ir, _PAIRS_PTR if self.pairs else _FLOAT_PTR),
                                  DT_INT32 if self.pairs else DT_FLOAT32)
        self.loops(ta, m, n, k, a, lda, c, ldc)

    def pack_block(self, s: _Slice) -> None:
        self.emit.pack(self.tb, self.matrix, self.ldb, s.pc, s.jc, s.kc, s.nc, self.block_of_b, self.pairs)

    def panel(self, s: _Slice, first: Value) -> Pointer:
        return self.block_of_b + first * self.panel_rows(s.kc)

    def prepare_ahead(self, s: _Slice, copy_a: Value) -> None:
        """The next block's rows of B's source, shared out: each strip takes an even share
        of them, each of its tiles but the first (which brings in the next strip's rows of A)
        a share of those."""
        next_jc = s.same_columns.where(s.jc, s.jc + s.nc)
        upcoming_nc = index_value(self.b, self.block).minimum(self.n - next_jc)
        exists = next_jc < self.n
        by_rows = self.tb.equal(0)  # op(B)'s rows are B's: a run of columns per step of k
        self.source_rows = exists.where(by_rows.where(s.upcoming_kc, upcoming_nc), 0)
        self.run = by_rows.where(upcoming_nc, s.upcoming_kc) // _LINE_FLOATS + 1
        self.first_source_row = by_rows.where(s.upcoming_pc, next_jc)
        self.along = by_rows.where(next_jc, s.upcoming_pc)
        self.strip_rows = (self.source_rows + (s.strips - 1)) // s.strips
        self.b_tiles = s.tiled_panels - (~copy_a).cast(DT_INT64)
        self.tile_rows = (self.strip_rows + (self.b_tiles - 1)) // (self.b_tiles > 0).where(self.b_tiles, 1)

    def tile_ahead(self, s: _Slice, i0: Value, q: Value, first: Value, a_ahead: list[Any]) -> list[Any]:
        """The next strip's rows of A by the strip's first tile, B's by the others."""
        ahead = super().tile_ahead(s, i0, q, first, a_ahead)
        strip_first = ((i0 // self.emit.mr) * self.strip_rows).minimum(self.source_rows)
        strip_last = (strip_first + self.strip_rows).minimum(self.source_rows)
        order = q - (s.tiled_panels - self.b_tiles)  # this tile's place among those that fetch B
        rows_first = (strip_first + order * self.tile_rows).minimum(strip_last)
        count = (rows_first + self.tile_rows).minimum(strip_last) - rows_first
        lines = (order >= 0).where(count * self.run, 0)
        start = self.matrix + ((self.first_source_row + rows_first) * self.ldb + self.along)
        b_ahead = [start, self.run, self.ldb, lines]
        takes_b = lines > 0
        return [takes_b.where(x, y) for x, y in zip(b_ahead, ahead)]


class _PanelsGemm(_Gemm):
    """`ranvier_sgemm_packed`, `ranvier_sgemm_packed_bf16` (`narrow`) and
    `ranvier_sgemm_packed_dpbf16` (`pairs`): B's panels packed ahead of time, each NR columns
    by all of k; while a block computes, each strip asks for its share of the next block's
    lines (from memory)."""

    def define(self) -> None:
        signature = _BF16_PACKED_FUNCTION if self.narrow or self.pairs else _PACKED_FUNCTION
        name = self.symbol(PAIRS_PACKED_SYMBOL) if self.pairs else BF16_PACKED_SYMBOL if self.narrow else PACKED_SYMBOL
        ta, m, n, k, a, lda, panels, c, ldc = self._entry(signature, name)
        self.panels = panels.view(DT_INT32 if self.pairs else DT_BFLOAT16 if self.narrow else DT_FLOAT32)
        self.loops(ta, m, n, k, a, lda, c, ldc)

    def panel(self, s: _Slice, first: Value) -> Pointer:
        """A panel is NR columns by all k; this slice of it starts pc rows in."""
        return self.panels + ((s.jc + first) * self.panel_rows(self.k) + self.panel_rows(s.pc) * self.emit.nr)

    def upcoming(self, s: _Slice, first: Value) -> tuple[Pointer, Value]:
        """Where panel `first`'s next slice starts and its lines (0: none): the next slice of
        k of this panel, else the first of the next block's."""
        next_column = (s.jc + s.nc) + first
        later = self.panels + next_column * self.panel_rows(self.k)
        exists = s.same_columns | (next_column < self.n)
        if self.narrow:  # one row asks for its lines ahead of where it reads instead (`ROW_AHEAD`)
            exists = exists & (self.m > 1)
        per_line = _LINE_FLOATS * (2 if self.narrow else 1)  # panel elements in a cache line
        lines = exists.where(self.panel_rows(s.upcoming_kc) * self.emit.nr // per_line, 0)
        start = s.same_columns.where(self.panel(s, first) + self.panel_rows(s.kc) * self.emit.nr, later)
        return start.view(DT_FLOAT32), lines  # the tiles step through lines as floats

    def tile_ahead(self, s: _Slice, i0: Value, q: Value, first: Value, a_ahead: list[Any]) -> list[Any]:
        """Each strip asks for its share of the lines, a tile's steps' worth as it computes.
        With none of B's lines for this strip to ask for (the last block and slice of k), its
        first tile asks for the next strip's rows of A: Winograd's A is the transformed
        filters, from the last-level cache (ResNet-18's 256-channel 14 × 14 convolutions at
        batch 1 in-model 0.84 → 0.68 ms), its B the tiles just transformed."""
        start, lines = self.upcoming(s, first)
        share = (lines + (s.strips - 1)) // s.strips
        low = ((i0 // self.emit.mr) * share).minimum(lines)
        high = (low + share).minimum(lines)
        spread = (high - low).minimum(self.panel_rows(s.kc))
        self.emit.prefetch(start, low + spread, high)
        ahead = [start + low * _LINE_FLOATS, spread, index_value(self.b, 0), spread]
        a_first = q.equal(0) & spread.equal(0)
        return [a_first.where(x, y) for x, y in zip(a_ahead, ahead)]


class _WindowsGemm(_Gemm):
    """`ranvier_sgemm_windows` (`ranvier_sgemm_windows_dpbf16` on pairs): B the im2col matrix
    of a convolution's input, packed a block at a time from the image."""

    def define(self) -> None:
        m, n, k, a, lda, image, geometry, first_column, c, ldc, workspace = self._entry(
            WINDOWS_FUNCTION, self.symbol(WINDOWS_PAIRS_SYMBOL) if self.pairs else WINDOWS_SYMBOL)
        b = self.b
        self.image, self.first_column = image, first_column
        self.block_of_b = Pointer(b, cache_line_aligned(b, workspace.ir, _PAIRS_PTR if self.pairs else _FLOAT_PTR),
                                  DT_INT32 if self.pairs else DT_FLOAT32)
        self.geometry = {name: geometry[index] for index, name in enumerate(GEOMETRY)}
        self.taps = stack(b, DT_INT32, 3 * window_taps(self.pairs))
        self.positions = stack(b, DT_INT32, 3 * self.emit.nr)
        self.loops(index_value(b, 0), m, n, k, a, lda, c, ldc)

    def pack_block(self, s: _Slice) -> None:
        self.emit.pack_windows(self.image, self.geometry, self.first_column, s.pc, s.jc, s.kc, s.nc, self.block_of_b,
                               self.taps, self.positions, self.pairs)

    def panel(self, s: _Slice, first: Value) -> Pointer:
        return self.block_of_b + first * self.panel_rows(s.kc)
