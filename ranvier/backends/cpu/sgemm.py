"""A float32 GEMM generated as LLVM IR for the target's vector width (AVX-512, AVX2/FMA, SSE).

    void ranvier_sgemm(i64 transpose_a, i64 transpose_b, i64 m, i64 n, i64 k,
                       float* A, i64 lda, float* B, i64 ldb, float* C, i64 ldc,
                       i8* workspace)

computes row-major C[m×n] = op(A)[m×k] · op(B)[k×n] (op(X) is X or Xᵀ; leading
dimensions count elements), overwriting C, on the calling thread: a parallel MatMul
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
under that tap, zero in the padding. `geometry` holds H, W, KH, KW, SH, SW, PH, PW and
the output width. `ranvier_sgemm_windows_dpbf16` (same arguments) packs the windows as
bf16 pairs of taps and multiplies them on `vdpbf16ps`, as `ranvier_sgemm_dpbf16` does a matrix.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import ml_dtypes
import numpy as np
from llvmlite import ir

from ...dtypes import DT_BFLOAT16
from ..llvm.convert import bf16_pairs, widen
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
    constant,
    declared,
    for_range,
    i64,
    intrinsic,
    splat,
    transpose_square,
)
from . import jit
from .target import CPUTarget

SYMBOL = "ranvier_sgemm"
PACKED_SYMBOL = "ranvier_sgemm_packed"
BF16_PACKED_SYMBOL = "ranvier_sgemm_packed_bf16"
WINDOWS_SYMBOL = "ranvier_sgemm_windows"
PAIRS_SYMBOL = "ranvier_sgemm_dpbf16"
PAIRS_PACKED_SYMBOL = "ranvier_sgemm_packed_dpbf16"
WINDOWS_PAIRS_SYMBOL = "ranvier_sgemm_windows_dpbf16"
GEOMETRY = ("height", "width", "kernel_height", "kernel_width", "stride_height", "stride_width", "pad_height",
            "pad_width", "out_width")

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
_PACKED_FUNCTIONS = {"panels": (_PACKED_FUNCTION, PACKED_SYMBOL), "bf16 panels": (_BF16_PACKED_FUNCTION, BF16_PACKED_SYMBOL),
                     "pair panels": (_BF16_PACKED_FUNCTION, PAIRS_PACKED_SYMBOL)}
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
# A block's last panel this narrow is computed as dot products along k (`dot_kernel`): a
# vector-wide tile would do a whole vector of multiply-adds per row and step of k for it
# (a 7×7 convolution's 49 positions are two panels of 24 and one of 1). Up to this many
# columns the dot products cost less.
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


def packed_gemm_address(target: CPUTarget, narrow: bool = False, pairs: bool = False) -> int:
    """`ranvier_sgemm_packed`, or with `narrow` its twin on bf16 panels, with `pairs` the
    one on bf16 pairs (`pairs_supported` targets)."""
    return gemm_code(target).address_of(PAIRS_PACKED_SYMBOL if pairs else BF16_PACKED_SYMBOL if narrow else PACKED_SYMBOL)


def pairs_gemm_address(target: CPUTarget) -> int:
    """`ranvier_sgemm_dpbf16`, on a `pairs_supported` target: ranvier_sgemm's arguments."""
    return gemm_code(target).address_of(PAIRS_SYMBOL)


def windows_gemm_address(target: CPUTarget, pairs: bool = False) -> int:
    """`ranvier_sgemm_windows`, or with `pairs` its twin on bf16 pairs (`pairs_supported` targets)."""
    return gemm_code(target).address_of(WINDOWS_PAIRS_SYMBOL if pairs else WINDOWS_SYMBOL)


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
    emit.pack(b, i64(int(transposed)), source, i64(ldb), i64(0), i64(0), k, n, b.bitcast(panels, _PAIRS_PTR) if pairs else panels,
              pairs)


class _Emitter:
    """IR for one target: its vector type and the operations the kernels are made of."""

    def __init__(self, module: ir.Module, target: CPUTarget):
        self.module = module
        self.lanes = target.lanes(4)
        self.mr, self.vectors = tile_shape(target)
        self.nr = self.vectors * self.lanes
        self.vector = ir.VectorType(F32, self.lanes)  # SSE's 4 lanes at the least
        self.zeros = ir.Constant(self.vector, [ir.Constant(F32, 0.0)] * self.lanes)
        # fmuladd: one fused instruction where the target has FMA; without it (SSE) a
        # multiply and an add, where llvm.fma would call the C library per lane
        self.fma = intrinsic(module, "fmuladd", self.vector)
        # (address, read, keep in L2, data)
        self.prefetch_function = declared(module, "llvm.prefetch.p0i8", ir.FunctionType(VOID, [BYTE_PTR, I32, I32, I32]))
        # (address, alignment, lanes to load, value of the others): masked-off lanes are not read
        self.masked_load = declared(
            module, f"llvm.masked.load.v{self.lanes}f32.p0v{self.lanes}f32",
            ir.FunctionType(self.vector, [self.vector.as_pointer(), I32, ir.VectorType(I1, self.lanes), self.vector]))
        # the same from one address per lane
        pointers = ir.VectorType(_FLOAT_PTR, self.lanes)
        self.gather = declared(module, f"llvm.masked.gather.v{self.lanes}f32.v{self.lanes}p0f32",
                               ir.FunctionType(self.vector, [pointers, I32, ir.VectorType(I1, self.lanes), self.vector]))
        # the largest lane of an i32 vector
        self.highest = declared(module, f"llvm.vector.reduce.smax.v{self.lanes}i32",
                                ir.FunctionType(I32, [ir.VectorType(I32, self.lanes)]))

    def load_vector(self, b: ir.IRBuilder, pointer: ir.Value, aligned: bool = False) -> ir.Value:
        return b.load(b.bitcast(pointer, self.vector.as_pointer()), align=self.lanes * 4 if aligned else 4)

    def load_panel_vector(self, b: ir.IRBuilder, pointer: ir.Value) -> ir.Value:
        """A vector of a panel's row, from an aligned float or bf16 pointer, as floats."""
        if pointer.type.pointee != I16:
            return self.load_vector(b, pointer, aligned=True)
        narrow = ir.VectorType(I16, self.lanes)
        return widen(b, b.load(b.bitcast(pointer, narrow.as_pointer()), align=self.lanes * 2), DT_BFLOAT16, self.lanes)

    def load_pairs(self, b: ir.IRBuilder, pointer: ir.Value) -> ir.Value:
        """A vector of a panel's row of bf16 pairs, from an aligned pointer to its slots."""
        slots = ir.VectorType(I32, self.lanes)
        return b.bitcast(b.load(b.bitcast(pointer, slots.as_pointer()), align=self.lanes * 4), ir.VectorType(BF16, 2 * self.lanes))

    def pair_dot(self) -> ir.Function:
        """vdpbf16ps: (sums, pairs, pairs) → sums + each lane's two products."""
        pairs = ir.VectorType(BF16, 2 * self.lanes)
        return declared(self.module, "llvm.x86.avx512bf16.dpbf16ps.512", ir.FunctionType(self.vector, [self.vector, pairs, pairs]))

    def store_vector(self, b: ir.IRBuilder, value: ir.Value, pointer: ir.Value, aligned: bool = False) -> None:
        b.store(value, b.bitcast(pointer, self.vector.as_pointer()), align=self.lanes * 4 if aligned else 4)

    def prefetch(self, b: ir.IRBuilder, start: ir.Value, first: ir.Value, last: ir.Value) -> None:
        """Ask for the cache lines [first, last) from float `start` on into L2."""
        with for_range(b, first, last, name="line") as line:
            self.prefetch_line(b, b.gep(start, [b.mul(line, i64(_LINE_FLOATS))]))

    def prefetch_line(self, b: ir.IRBuilder, address: ir.Value) -> None:
        """Ask for the cache line at `address` (a float*) into L2."""
        b.call(self.prefetch_function, [b.bitcast(address, BYTE_PTR), ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])

    # ---- the micro-kernel -----------------------------------------------------------------

    def micro_kernel(self, rows: int, vectors: int, narrow: bool = False, pairs: bool = False) -> ir.Function:
        """C[rows × vectors·L] (=|+=) A-strip[rows × kc] · the panel's first vectors·L
        columns [kc × NR]: a panel over C's edge computes only the vectors it needs.
        `narrow`: the panel holds bf16. `pairs`: the strip and the panel hold bf16 pairs,
        kc of them, each step one `vdpbf16ps` per vector."""
        signature, suffix = (_MICRO_PAIRS, "_pairs") if pairs else (_MICRO_BF16, "_bf16") if narrow else (_MICRO, "")
        function = ir.Function(self.module, signature, name=f"{SYMBOL}_tile{rows}x{vectors}{suffix}")
        function.linkage = "internal"
        kc, a, sa, sk, panel, c, ldc, columns, accumulate, ahead, run, stride, lines = function.args
        b = ir.IRBuilder(function.append_basic_block("entry"))
        # A tile of fewer rows than MR has registers to spare: it spreads k's steps over
        # `chains` sets of sums, each its own chain of multiply-adds, added up at the end.
        # With one set a row waited on the multiply-add's latency at every step (a decode
        # step's one row of bf16 panels, 256 × 480 from L2: 7.8 cycles a step, 5.4 with four sets).
        chains = self.mr // rows if narrow or pairs else 1
        sets = [[[b.alloca(self.vector) for _ in range(vectors)] for _ in range(rows)] for _ in range(chains)]
        for row in (row for chain in sets for row in chain):
            for slot in row:
                b.store(self.zeros, slot)
        row_starts = [b.gep(a, [b.mul(i64(r), sa)]) for r in range(rows)]
        run_start, in_run = b.alloca(_FLOAT_PTR), b.alloca(I64)
        b.store(ahead, run_start)
        b.store(i64(0), in_run)

        def step_of_k(p: ir.Value, sums: list[list[ir.Value]]) -> None:
            # one line asked for per step, spread among the multiply-adds (a burst of them
            # before the loop would fill the core's miss buffers and stall it)
            with b.if_then(b.icmp_signed("<", p, lines)):
                self.prefetch_line(b, b.gep(b.load(run_start), [b.mul(b.load(in_run), i64(_LINE_FLOATS))]))
                following = b.add(b.load(in_run), i64(1))
                wraps = b.icmp_signed("==", following, run)
                b.store(b.select(wraps, i64(0), following), in_run)
                b.store(b.select(wraps, b.gep(b.load(run_start), [stride]), b.load(run_start)), run_start)
            step = b.gep(panel, [b.mul(p, i64(self.nr))])
            if narrow and rows == 1:
                self.prefetch_line(b, b.bitcast(b.gep(step, [i64(ROW_AHEAD)]), _FLOAT_PTR))
            along = b.mul(p, sk)
            if pairs:
                parts = [self.load_pairs(b, b.gep(step, [i64(v * self.lanes)])) for v in range(vectors)]
                for r in range(rows):
                    pair = b.bitcast(splat(b, b.load(b.gep(row_starts[r], [along])), self.lanes), parts[0].type)
                    for h in range(vectors):
                        b.store(b.call(self.pair_dot(), [b.load(sums[r][h]), pair, parts[h]]), sums[r][h])
                return
            parts = [self.load_panel_vector(b, b.gep(step, [i64(v * self.lanes)])) for v in range(vectors)]
            for r in range(rows):
                value = splat(b, b.load(b.gep(row_starts[r], [along])), self.lanes)
                for h in range(vectors):
                    b.store(b.call(self.fma, [value, parts[h], b.load(sums[r][h])]), sums[r][h])

        whole_steps = b.mul(b.sdiv(kc, i64(chains)), i64(chains))
        with for_range(b, i64(0), whole_steps, step=chains, name="p") as p:
            for number, chain in enumerate(sets):
                step_of_k(b.add(p, i64(number)), chain)
        with for_range(b, whole_steps, kc, name="pk") as p:
            step_of_k(p, sets[0])
        sums = sets[0]
        for chain in sets[1:]:
            for r in range(rows):
                for h in range(vectors):
                    b.store(b.fadd(b.load(sums[r][h]), b.load(chain[r][h])), sums[r][h])
        whole = b.icmp_signed("==", columns, i64(vectors * self.lanes))
        with b.if_else(whole) as (full, edge):
            with full:
                for r in range(rows):
                    for h in range(vectors):
                        target = b.gep(c, [b.add(b.mul(i64(r), ldc), i64(h * self.lanes))])
                        total = b.load(sums[r][h])
                        added = b.fadd(total, self.load_vector(b, target))
                        self.store_vector(b, b.select(accumulate, added, total), target)
            with edge:
                tile = b.alloca(F32, i64(rows * self.nr))
                for r in range(rows):
                    for h in range(vectors):
                        self.store_vector(b, b.load(sums[r][h]), b.gep(tile, [i64(r * self.nr + h * self.lanes)]))
                    with for_range(b, i64(0), columns, name="j") as j:
                        target = b.gep(c, [b.add(b.mul(i64(r), ldc), j)])
                        value = b.load(b.gep(tile, [b.add(i64(r * self.nr), j)]))
                        b.store(b.select(accumulate, b.fadd(value, b.load(target)), value), target)
        b.ret_void()
        return function

    def dot_kernel(self, rows: int) -> ir.Function:
        """C[rows × columns] (=|+=) A-strip[rows × kc] · the edge's columns, each a dot
        product along k: A's rows read in place (k contiguous), each edge column kc
        contiguous floats (`ROW_KC` apart). Two vectors of k per row in flight, so the rows'
        sums are eight independent chains of multiply-adds."""
        function = ir.Function(self.module, _DOT, name=f"{SYMBOL}_dot{rows}")
        function.linkage = "internal"
        kc, a, sa, edge, c, ldc, columns, accumulate = function.args
        b = ir.IRBuilder(function.append_basic_block("entry"))
        lanes, double = self.lanes, 2 * self.lanes
        sums = [[b.alloca(self.vector) for _ in range(2)] for _ in range(rows)]
        totals = [b.alloca(F32) for _ in range(rows)]
        row_starts = [b.gep(a, [b.mul(i64(r), sa)]) for r in range(rows)]
        whole = b.mul(b.sdiv(kc, i64(double)), i64(double))
        with for_range(b, i64(0), columns, name="dj") as j:
            column = b.gep(edge, [b.mul(j, i64(ROW_KC))])
            for pair in sums:
                for slot in pair:
                    b.store(self.zeros, slot)
            with for_range(b, i64(0), whole, step=double, name="dp") as p:
                halves = [self.load_vector(b, b.gep(column, [b.add(p, i64(h * lanes))])) for h in range(2)]
                for r in range(rows):
                    for h in range(2):
                        value = self.load_vector(b, b.gep(row_starts[r], [b.add(p, i64(h * lanes))]))
                        b.store(b.call(self.fma, [value, halves[h], b.load(sums[r][h])]), sums[r][h])
            for r in range(rows):
                vector = b.fadd(b.load(sums[r][0]), b.load(sums[r][1]))
                total = b.extract_element(vector, ir.Constant(I32, 0))
                for e in range(1, lanes):
                    total = b.fadd(total, b.extract_element(vector, ir.Constant(I32, e)))
                b.store(total, totals[r])
            with for_range(b, whole, kc, name="dt") as p:
                step = b.load(b.gep(column, [p]))
                for r in range(rows):
                    product = b.fmul(b.load(b.gep(row_starts[r], [p])), step)
                    b.store(b.fadd(b.load(totals[r]), product), totals[r])
            for r in range(rows):
                target = b.gep(c, [b.add(b.mul(i64(r), ldc), j)])
                total = b.load(totals[r])
                b.store(b.select(accumulate, b.fadd(b.load(target), total), total), target)
        b.ret_void()
        return function

    # ---- copying a strip of A ---------------------------------------------------------------

    def copy_strip(self, b: ir.IRBuilder, transposed: ir.Value, strip: ir.Value, sa: ir.Value, sk: ir.Value, kc: ir.Value,
                   rows: int, copy: ir.Value) -> None:
        """A's strip (`rows` rows, kc steps of k) k-major into `copy`: a step's values
        adjacent, as the micro-kernel then reads them (row stride 1, k stride `rows`)."""
        run = ir.VectorType(F32, rows)
        with b.if_else(transposed) as (side_by_side, apart):
            with side_by_side, for_range(b, i64(0), kc, name="ka") as p:
                source = b.bitcast(b.gep(strip, [b.mul(p, sk)]), run.as_pointer())
                b.store(b.load(source, align=4), b.bitcast(b.gep(copy, [b.mul(p, i64(rows))]), run.as_pointer()), align=4)
            with apart, for_range(b, i64(0), kc, name="kb") as p:
                for r in range(rows):
                    value = b.load(b.gep(strip, [b.add(b.mul(i64(r), sa), p)]))
                    b.store(value, b.gep(copy, [b.add(b.mul(p, i64(rows)), i64(r))]))

    def copy_pairs(self, b: ir.IRBuilder, transposed: ir.Value, strip: ir.Value, sa: ir.Value, sk: ir.Value, kc: ir.Value,
                   rows: int, copy: ir.Value) -> tuple[ir.Value, ir.Value]:
        """A's strip (`rows` rows, kc steps of k) as bf16 pairs into `copy` (64-byte
        aligned), a zero after an odd kc; returns the copy's (row stride, pair stride) in
        slots. A's rows along k (not `transposed`) convert 32 steps at a time into a row of
        the copy each, whole vectors; a transposed strip's rows of k, `rows` values side by
        side, interleave two at a time into the pairs of one step."""
        lanes = self.lanes
        row_slots = b.mul(b.sdiv(b.add(kc, i64(2 * lanes - 1)), i64(2 * lanes)), i64(lanes))
        pair_steps = b.sdiv(b.add(kc, i64(1)), i64(2))
        run, halves = ir.VectorType(F32, rows), ir.VectorType(I16, rows)
        with b.if_else(transposed) as (side_by_side, apart):
            with side_by_side, for_range(b, i64(0), pair_steps, name="cp") as p:
                second_inside = b.icmp_signed("<", b.add(b.mul(p, i64(2)), i64(1)), kc)
                values = []
                for step, inside in ((b.mul(p, i64(2)), None), (b.add(b.mul(p, i64(2)), i64(1)), second_inside)):
                    at = step if inside is None else b.select(inside, step, i64(0))
                    value = b.load(b.bitcast(b.gep(strip, [b.mul(at, sk)]), run.as_pointer()), align=4)
                    if inside is not None:
                        value = b.select(inside, value, ir.Constant(run, [ir.Constant(F32, 0.0)] * rows))
                    values.append(b.bitcast(b.fptrunc(value, ir.VectorType(BF16, rows)), halves))
                order = [half for r in range(rows) for half in (r, rows + r)]
                pairs = b.shuffle_vector(*values, ir.Constant(ir.VectorType(I32, 2 * rows), order))
                b.store(b.bitcast(pairs, ir.VectorType(I32, rows)),
                        b.bitcast(b.gep(copy, [b.mul(p, i64(rows))]), ir.VectorType(I32, rows).as_pointer()), align=4)
            with apart, for_range(b, i64(0), row_slots, step=lanes, name="cq") as q:
                steps = b.mul(q, i64(2))
                masks = self._lane_masks(b, steps, kc, 2)
                for r in range(rows):
                    start = b.gep(strip, [b.add(b.mul(i64(r), sa), steps)])
                    first, second = (self.masked_read(b, b.gep(start, [i64(h * lanes)]), masks[h]) for h in range(2))
                    target = b.gep(copy, [b.add(b.mul(i64(r), row_slots), q)])
                    b.store(bf16_pairs(b, first, second, interleave=False),
                            b.bitcast(target, ir.VectorType(I32, lanes).as_pointer()), align=4 * lanes)
        return b.select(transposed, i64(1), row_slots), b.select(transposed, i64(rows), i64(1))

    # ---- packing B ------------------------------------------------------------------------

    def pack(self, b: ir.IRBuilder, tb: ir.Value, source: ir.Value, ldb: ir.Value, pc: ir.Value, jc: ir.Value,
             kc: ir.Value, nc: ir.Value, packed: ir.Value, pairs: bool = False) -> None:
        """op(B)[pc:pc+kc, jc:jc+nc] into panels of NR columns, zeros past nc; `pairs`: of
        bf16 pairs (`packed` slots), a panel's row p holding op(B)[pc+2p, j] and
        op(B)[pc+2p+1, j] (zero past kc) for each of its columns."""
        nr = i64(self.nr)
        depth = b.sdiv(b.add(kc, i64(1)), i64(2)) if pairs else kc  # a panel's rows
        panels = b.sdiv(b.add(nc, i64(self.nr - 1)), nr)
        with for_range(b, i64(0), panels, name="q") as q:
            first = b.mul(q, nr)
            columns = b.select(b.icmp_signed("<", b.sub(nc, first), nr), b.sub(nc, first), nr)
            panel = b.gep(packed, [b.mul(q, b.mul(depth, nr))])
            column = b.add(jc, first)
            with b.if_else(b.icmp_signed("!=", tb, i64(0))) as (transposed, plain):
                with transposed:
                    if pairs:
                        self._pack_pair_columns(b, source, ldb, pc, column, kc, depth, columns, panel)
                    else:
                        self._pack_columns(b, source, ldb, pc, column, kc, columns, panel)
                with plain:
                    if pairs:
                        self._pack_pair_rows(b, source, ldb, pc, column, kc, depth, columns, panel)
                    else:
                        self._pack_rows(b, source, ldb, pc, column, kc, columns, panel)

    def _pack_columns(self, b, source, ldb, pc, column, kc, columns, panel) -> None:
        """op(B)[p, j] = B[j, p]: each column of the panel is a run of one of B's rows.
        The panel goes in square blocks, L rows of B by L steps of k (L the vector lanes):
        L vector loads (zeros for a column past B's edge), a transpose in registers, L
        vector stores; the steps of k left over go element by element."""
        nr, lanes = i64(self.nr), self.lanes
        whole_steps = b.mul(b.sdiv(kc, i64(lanes)), i64(lanes))
        with for_range(b, i64(0), whole_steps, step=lanes, name="pb") as p:
            for part in range(self.vectors):
                rows = []
                for j in range(lanes):
                    inside = b.icmp_signed("<", i64(part * lanes + j), columns)
                    row = b.add(column, b.select(inside, i64(part * lanes + j), i64(0)))
                    value = self.load_vector(b, b.gep(source, [b.add(b.mul(row, ldb), b.add(pc, p))]))
                    rows.append(b.select(inside, value, self.zeros))
                for t, vector in enumerate(transpose_square(b, rows)):
                    self.store_vector(b, vector, b.gep(panel, [b.add(b.mul(b.add(p, i64(t)), nr), i64(part * lanes))]), aligned=True)
        with for_range(b, i64(0), nr, name="jt") as j:
            inside = b.icmp_signed("<", j, columns)
            row = b.gep(source, [b.add(b.mul(b.add(column, j), ldb), pc)])
            with for_range(b, whole_steps, kc, name="pt") as p:
                value = b.select(inside, b.load(b.gep(row, [b.select(inside, p, i64(0))])), ir.Constant(F32, 0.0))
                b.store(value, b.gep(panel, [b.add(b.mul(p, nr), j)]))

    def _pack_rows(self, b, source, ldb, pc, column, kc, columns, panel) -> None:
        """op(B)[p, j] = B[p, j]: each row of the panel is a run of one of B's rows, copied
        as V vectors; over B's edge as masked loads, zeros past `columns` (element by
        element, a 16-column edge of a 48-column panel cost as much to pack and compute as
        a whole panel)."""
        nr = i64(self.nr)
        lane = ir.Constant(ir.VectorType(I64, self.lanes), list(range(self.lanes)))
        masks = [b.icmp_signed("<", b.add(lane, splat(b, i64(h * self.lanes), self.lanes)), splat(b, columns, self.lanes))
                 for h in range(self.vectors)]
        whole = b.icmp_signed("==", columns, nr)
        with for_range(b, i64(0), kc, name="pr") as p:
            row = b.gep(source, [b.add(b.mul(b.add(pc, p), ldb), column)])
            for h, mask in enumerate(masks):
                start = b.gep(row, [i64(h * self.lanes)])
                with b.if_else(whole) as (plain, edge):
                    with plain:
                        value = self.load_vector(b, start)
                        plain_block = b.block
                    with edge:
                        masked = self.masked_read(b, start, mask)
                        edge_block = b.block
                merged = b.phi(self.vector)
                merged.add_incoming(value, plain_block)
                merged.add_incoming(masked, edge_block)
                self.store_vector(b, merged, b.gep(panel, [b.add(b.mul(p, nr), i64(h * self.lanes))]), aligned=True)

    def _lane_masks(self, b: ir.IRBuilder, start: ir.Value, limit: ir.Value, count: int) -> list[ir.Value]:
        """`count` vectors' lanes i, from `start` on, where start + i < limit."""
        lane = ir.Constant(ir.VectorType(I64, self.lanes), list(range(self.lanes)))
        return [b.icmp_signed("<", b.add(lane, splat(b, b.add(start, i64(h * self.lanes)), self.lanes)), splat(b, limit, self.lanes))
                for h in range(count)]

    def _pack_pair_rows(self, b, source, ldb, pc, column, kc, pair_steps, columns, panel) -> None:
        """op(B)[p, j] = B[p, j]: two of B's rows, a vector of columns at a time (masked
        over B's edge), interleave into a row of pairs."""
        masks = self._lane_masks(b, i64(0), columns, self.vectors)
        none = ir.Constant(masks[0].type, [ir.Constant(I1, 0)] * self.lanes)
        with for_range(b, i64(0), pair_steps, name="pp") as p:
            step = b.add(pc, b.mul(p, i64(2)))
            second_inside = b.icmp_signed("<", b.add(b.mul(p, i64(2)), i64(1)), kc)
            first_row = b.gep(source, [b.add(b.mul(step, ldb), column)])
            second_row = b.gep(first_row, [b.select(second_inside, ldb, i64(0))])
            for h, mask in enumerate(masks):
                first = self.masked_read(b, b.gep(first_row, [i64(h * self.lanes)]), mask)
                second = self.masked_read(b, b.gep(second_row, [i64(h * self.lanes)]), b.select(second_inside, mask, none))
                target = b.gep(panel, [b.add(b.mul(p, i64(self.nr)), i64(h * self.lanes))])
                b.store(bf16_pairs(b, first, second, interleave=True),
                        b.bitcast(target, ir.VectorType(I32, self.lanes).as_pointer()), align=4 * self.lanes)

    def _pack_pair_columns(self, b, source, ldb, pc, column, kc, pair_steps, columns, panel) -> None:
        """op(B)[p, j] = B[j, p]: each of L of B's rows gives L pairs of k (2L floats,
        masked past kc), and the L × L block of pairs, transposed in registers, is L rows of
        the panel's L columns; rows past the last pair are not stored."""
        lanes = self.lanes
        none = ir.Constant(ir.VectorType(I1, lanes), [ir.Constant(I1, 0)] * lanes)
        with for_range(b, i64(0), pair_steps, step=lanes, name="pt") as p:
            steps = b.mul(p, i64(2))
            masks = self._lane_masks(b, steps, kc, 2)
            for part in range(self.vectors):
                rows = []
                for j in range(lanes):
                    inside = b.icmp_signed("<", i64(part * lanes + j), columns)
                    row = b.add(column, b.select(inside, i64(part * lanes + j), i64(0)))
                    start = b.gep(source, [b.add(b.mul(row, ldb), b.add(pc, steps))])
                    first, second = (self.masked_read(b, b.gep(start, [i64(h * lanes)]), b.select(inside, masks[h], none))
                                     for h in range(2))
                    rows.append(bf16_pairs(b, first, second, interleave=False))
                for t, vector in enumerate(transpose_square(b, rows)):
                    with b.if_then(b.icmp_signed("<", b.add(p, i64(t)), pair_steps)):
                        target = b.gep(panel, [b.add(b.mul(b.add(p, i64(t)), i64(self.nr)), i64(part * lanes))])
                        b.store(vector, b.bitcast(target, vector.type.as_pointer()), align=4 * lanes)

    # ---- packing a convolution's windows ---------------------------------------------------

    def pack_windows(self, b: ir.IRBuilder, image: ir.Value, geometry: dict[str, ir.Value], first_column: ir.Value,
                     pc: ir.Value, jc: ir.Value, kc: ir.Value, nc: ir.Value, packed: ir.Value, taps: ir.Value,
                     positions: ir.Value, pairs: bool = False) -> None:
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
        lanes, nr = self.lanes, self.nr
        depth = window_taps(pairs)
        ints = ir.VectorType(I32, lanes)

        def i32(value: ir.Value) -> ir.Value:
            return b.trunc(value, I32)

        def table(array: ir.Value, field: int, size: int, at: ir.Value) -> ir.Value:
            return b.gep(array, [b.add(i64(field * size), at)])

        per_tap = b.mul(g["kernel_height"], g["kernel_width"])
        plane = b.mul(g["height"], g["width"])
        with for_range(b, i64(0), kc, name="tap") as p:
            tap = b.add(pc, p)
            channel, within = b.sdiv(tap, per_tap), b.srem(tap, per_tap)
            row, column = b.sdiv(within, g["kernel_width"]), b.srem(within, g["kernel_width"])
            offset = b.add(b.mul(channel, plane), b.add(b.mul(row, g["width"]), column))
            for field, value in enumerate((offset, row, column)):
                b.store(i32(value), table(taps, field, depth, p))

        height, width = (splat(b, i32(g[name]), lanes) for name in ("height", "width"))
        row_step = i32(g["stride_height"])  # input rows from one output row to the next
        outside = ir.Constant(I32, -(1 << 30))  # a first input row no kernel row brings inside
        panels = b.sdiv(b.add(nc, i64(nr - 1)), i64(nr))
        with for_range(b, i64(0), panels, name="wq") as q:
            first = b.mul(q, i64(nr))
            columns = b.sub(nc, first)
            start = b.add(first_column, b.add(jc, first))
            y, x = b.sdiv(start, g["out_width"]), b.srem(start, g["out_width"])
            for j in range(nr):  # the output position of each column, stepping along the rows
                if j:
                    x = b.add(x, i64(1))
                    wrapped = b.icmp_signed("==", x, g["out_width"])
                    y, x = b.select(wrapped, b.add(y, i64(1)), y), b.select(wrapped, i64(0), x)
                inside = b.icmp_signed("<", i64(j), columns)
                top = i32(b.sub(b.mul(y, g["stride_height"]), g["pad_height"]))
                left = i32(b.sub(b.mul(x, g["stride_width"]), g["pad_width"]))
                # a column past nc reads nothing, from an address inside the image: a masked
                # load from an unmapped page takes a microcode assist even with no lane on
                offset = b.select(inside, b.add(b.mul(top, i32(g["width"])), left), ir.Constant(I32, 0))
                for field, value in enumerate((offset, b.select(inside, top, outside), left)):
                    b.store(value, table(positions, field, nr, i64(j)))
            panel_rows = b.sdiv(b.add(kc, i64(1)), i64(2)) if pairs else kc
            panel = b.gep(packed, [b.mul(q, b.mul(panel_rows, i64(nr)))])
            for h in range(self.vectors):
                offsets, tops, lefts = (b.load(b.bitcast(table(positions, field, nr, i64(h * lanes)), ints.as_pointer()), align=4)
                                        for field in range(3))
                first_top, last_top = (b.load(table(positions, 1, nr, i64(h * lanes + e))) for e in (0, lanes - 1))
                first_offset = b.load(table(positions, 0, nr, i64(h * lanes)))
                one_row = b.icmp_signed("==", first_top, last_top)
                # a vector over a few output rows (a small image's): a masked load per row (lanes
                # past nc have the lowest first row, so the highest is the last column's)
                highest_top = b.call(self.highest, [tops])
                few_rows = b.icmp_signed("<=", b.sub(highest_top, first_top), b.mul(row_step, ir.Constant(I32, _MAX_SEGMENTS - 1)))
                first_left, last_left = (b.load(table(positions, 2, nr, i64(h * lanes + e))) for e in (0, lanes - 1))
                # every tap of every lane inside the image: loads need no mask
                inside = b.and_(
                    b.and_(b.icmp_signed(">=", first_top, ir.Constant(I32, 0)),
                           b.icmp_signed("<=", b.add(last_top, i32(g["kernel_height"])), i32(g["height"]))),
                    b.and_(b.icmp_signed(">=", first_left, ir.Constant(I32, 0)),
                           b.icmp_signed("<=", b.add(last_left, i32(g["kernel_width"])), i32(g["width"]))))
                columns_of_vector = (offsets, tops, lefts, first_offset)
                target = b.gep(panel, [i64(h * lanes)])
                stride = g["stride_width"]

                def pack(way: str, masked: bool, columns_of_vector=columns_of_vector, target=target) -> None:
                    self._pack_window_vector(b, way, masked, image, (taps, depth), kc, columns_of_vector, (height, width),
                                             row_step, target, pairs)

                with b.if_else(b.and_(one_row, b.icmp_signed("==", stride, i64(1)))) as (run, other):
                    with run, b.if_else(inside) as (clear, edge):
                        with clear:
                            pack("run", masked=False)
                        with edge:
                            pack("run", masked=True)
                    with other, b.if_else(b.and_(one_row, b.icmp_signed("==", stride, i64(2)))) as (halves, scattered):
                        with halves, b.if_else(inside) as (clear, edge):
                            with clear:
                                pack("every other", masked=False)
                            with edge:
                                pack("every other", masked=True)
                        with scattered, b.if_else(few_rows) as (by_rows, by_lanes):
                            with by_rows, b.if_else(b.icmp_signed("==", stride, i64(1))) as (whole, halves):
                                with whole:
                                    pack("segments", masked=True)
                                with halves, b.if_else(b.icmp_signed("==", stride, i64(2))) as (every_other, scattered_rows):
                                    with every_other:
                                        pack("segments of every other", masked=True)
                                    with scattered_rows:
                                        pack("lanes", masked=True)
                            with by_lanes:
                                pack("lanes", masked=True)

    def _pack_window_vector(self, b: ir.IRBuilder, way: str, masked: bool, image: ir.Value, taps: tuple[ir.Value, int],
                            kc: ir.Value, columns: tuple[ir.Value, ...], bounds: tuple[ir.Value, ir.Value], row_step: ir.Value,
                            target: ir.Value, pairs: bool) -> None:
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
        lanes = self.lanes
        ints = ir.VectorType(I32, lanes)
        offsets, tops, lefts, first_offset = columns
        step = 2 if way == "segments of every other" else 1  # image columns from one lane to the next
        if way.startswith("segments"):  # each output row's lanes, and where lane 0 would read for that row's run
            segments = []
            first_top = b.extract_element(tops, ir.Constant(I32, 0))
            mask_bits = ir.IntType(lanes)
            popcount = intrinsic(self.module, "ctpop", mask_bits)
            for row in range(_MAX_SEGMENTS):
                top = b.add(first_top, b.mul(row_step, ir.Constant(I32, row)))
                # lanes of the rows above (columns past nc, with the lowest first row, are not)
                before = b.and_(b.icmp_signed("<", tops, splat(b, top, lanes)), b.icmp_signed(">=", tops, splat(b, first_top, lanes)))
                first_lane = b.zext(b.call(popcount, [b.bitcast(before, mask_bits)]), I32)
                last = ir.Constant(I32, lanes - 1)
                lane = b.select(b.icmp_signed("<", first_lane, last), first_lane, last)
                row_start = b.sub(b.extract_element(offsets, lane), b.mul(first_lane, ir.Constant(I32, step)))
                segments.append((b.icmp_signed("==", tops, splat(b, top, lanes)), row_start))
        table, depth = taps

        def row_of_b(p: ir.Value) -> ir.Value:
            """The vector's columns of B's row p: the image under tap p."""
            tap_offset, tap_row, tap_column = (b.load(b.gep(table, [b.add(i64(field * depth), p)])) for field in range(3))
            if masked:
                rows = b.icmp_unsigned("<", b.add(tops, splat(b, tap_row, lanes)), bounds[0])
                mask = b.and_(rows, b.icmp_unsigned("<", b.add(lefts, splat(b, tap_column, lanes)), bounds[1]))
            else:
                mask = ir.Constant(ir.VectorType(I1, lanes), [ir.Constant(I1, 1)] * lanes)
            start = b.gep(image, [b.sext(b.add(tap_offset, first_offset), I64)])
            if way == "run":
                value = self.masked_read(b, start, mask)
            elif way == "segments":
                value = self.zeros
                for lanes_of_row, row_start in segments:
                    at = b.gep(image, [b.sext(b.add(tap_offset, row_start), I64)])
                    value = self.masked_read(b, at, b.and_(mask, lanes_of_row), value)
            elif way == "segments of every other":
                value = self.zeros
                for lanes_of_row, row_start in segments:
                    at = b.gep(image, [b.sext(b.add(tap_offset, row_start), I64)])
                    value = b.select(lanes_of_row, self._every_other(b, at, b.and_(mask, lanes_of_row)), value)
            elif way == "every other":
                value = self._every_other(b, start, mask)
            else:  # one gather: the lanes' addresses from their offsets in the image
                safe = b.select(mask, b.add(offsets, splat(b, tap_offset, lanes)), ir.Constant(ints, [ir.Constant(I32, 0)] * lanes))
                wide = ir.VectorType(I64, lanes)
                addresses = b.add(splat(b, b.ptrtoint(image, I64), lanes), b.mul(b.sext(safe, wide), constant(wide, 4)))
                pointers = b.inttoptr(addresses, self.gather.args[0].type)
                value = b.call(self.gather, [pointers, ir.Constant(I32, 4), mask, self.zeros])
            return value

        if not pairs:
            with for_range(b, i64(0), kc, name="wp") as p:
                self.store_vector(b, row_of_b(p), b.gep(target, [b.mul(p, i64(self.nr))]), aligned=True)
            return
        with for_range(b, i64(0), b.sdiv(b.add(kc, i64(1)), i64(2)), name="wq") as q:
            first = b.mul(q, i64(2))
            inside = b.icmp_signed("<", b.add(first, i64(1)), kc)
            second = b.select(inside, row_of_b(b.select(inside, b.add(first, i64(1)), first)), self.zeros)
            b.store(bf16_pairs(b, row_of_b(first), second, interleave=True),
                    b.bitcast(b.gep(target, [b.mul(q, i64(self.nr))]), ir.VectorType(I32, self.lanes).as_pointer()),
                    align=4 * self.lanes)

    def _every_other(self, b: ir.IRBuilder, start: ir.Value, mask: ir.Value) -> ir.Value:
        """Lane e: element 2e from `start` where `mask` leaves lane e on, else zero (not read)."""
        lanes = self.lanes
        ints = ir.VectorType(I32, lanes)
        no_lanes = ir.Constant(ir.VectorType(I1, lanes), [ir.Constant(I1, 0)] * lanes)
        halves = []
        for half in (0, 1):  # element 2e of the 2L read is lane e's
            evens = ir.Constant(ints, [(half * lanes + e) // 2 if e % 2 == 0 else lanes for e in range(lanes)])
            halves.append(self.masked_read(b, b.gep(start, [i64(half * lanes)]), b.shuffle_vector(mask, no_lanes, evens)))
        return b.shuffle_vector(*halves, ir.Constant(ints, [2 * e for e in range(lanes)]))

    def masked_read(self, b: ir.IRBuilder, start: ir.Value, mask: ir.Value, others: ir.Value | None = None) -> ir.Value:
        """The vector at `start` in the lanes `mask` leaves on, `others`' (zeros) in the rest (not read)."""
        return b.call(self.masked_load, [b.bitcast(start, self.vector.as_pointer()), ir.Constant(I32, 4), mask,
                                         self.zeros if others is None else others])


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
    _gemm(emit, tiles, block_columns(target), "matrix")
    _gemm(emit, tiles, block_columns(target, packed=True), "panels")
    _gemm(emit, narrow_tiles, block_columns(target, packed=True), "bf16 panels")
    _gemm(emit, tiles, block_columns(target), "windows")
    if pairs_supported(target):
        pair_tiles: dict[tuple[int, int | str], ir.Function] = {
            (rows, vectors): emit.micro_kernel(rows, vectors, pairs=True) for rows in range(1, emit.mr + 1)
            for vectors in range(1, emit.vectors + 1)}
        _gemm(emit, pair_tiles, block_columns(target), "pairs")
        _gemm(emit, pair_tiles, block_columns(target, packed=True), "pair panels")
        _gemm(emit, pair_tiles, block_columns(target), "pair windows")
    return module


def _gemm(emit: _Emitter, tiles: dict[tuple[int, int | str], ir.Function], block: int, source: str) -> None:
    """The GEMM whose B is `source`: a "matrix" packed a block at a time (`ranvier_sgemm`),
    "panels" packed ahead of time (`ranvier_sgemm_packed`: the same loops, less the
    packing), "bf16 panels" (`ranvier_sgemm_packed_bf16`), or a convolution's "windows"
    (`ranvier_sgemm_windows`); on bf16 pairs, a "pairs" matrix (`ranvier_sgemm_dpbf16`),
    "pair panels" (`ranvier_sgemm_packed_dpbf16`) or "pair windows" (`ranvier_sgemm_windows_dpbf16`)."""
    packed = source.endswith("panels")
    narrow = source == "bf16 panels"
    pairs = source.startswith("pair")
    windows = source.endswith("windows")
    if packed:
        signature, name = _PACKED_FUNCTIONS[source]
        function = ir.Function(emit.module, signature, name=name)
        ta, m, n, k, a, lda, panels_of_b, c, ldc = function.args
    elif windows:
        function = ir.Function(emit.module, WINDOWS_FUNCTION, name=WINDOWS_PAIRS_SYMBOL if pairs else WINDOWS_SYMBOL)
        m, n, k, a, lda, image, geometry_of_b, first_column, c, ldc, workspace = function.args
        ta = i64(0)
    else:
        function = ir.Function(emit.module, _FUNCTION, name=PAIRS_SYMBOL if pairs else SYMBOL)
        ta, tb, m, n, k, a, lda, matrix, ldb, c, ldc, workspace = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))
    if packed and pairs:
        panels_of_b = b.bitcast(panels_of_b, _PAIRS_PTR)
    if not packed:
        block_of_b = cache_line_aligned(b, workspace, _PAIRS_PTR if pairs else _FLOAT_PTR)
    if windows:
        geometry = {name: b.load(b.gep(geometry_of_b, [i64(index)])) for index, name in enumerate(GEOMETRY)}
        taps, positions = b.alloca(I32, i64(3 * window_taps(pairs))), b.alloca(I32, i64(3 * emit.nr))
    transposed = b.icmp_signed("!=", ta, i64(0))
    sa, sk = b.select(transposed, i64(1), lda), b.select(transposed, lda, i64(1))
    # A strip read in place touches a cache line per step of k when A is transposed (MR
    # values side by side, rows lda apart), or MR lines of one L1 set when rows are a
    # multiple of 4 KiB apart: the panels would evict it. Such a strip is copied first.
    # A strip on pairs is always copied: into pairs.
    copy_a = ir.Constant(I1, 1) if pairs else b.or_(transposed, b.icmp_signed("==", b.and_(lda, i64(1023)), i64(0)))
    if pairs:
        strip_copy = b.alloca(I32, i64(emit.mr * PAIRS_KC // 2))
        strip_copy.align = 64  # its rows are stored as aligned vectors
    else:
        strip_copy = b.alloca(F32, i64(max(emit.mr * KC, ROW_KC)))
    edge = b.alloca(F32, i64(DOT_COLUMNS * ROW_KC))

    def panel_rows(steps: ir.Value) -> ir.Value:
        """The rows of a panel `steps` steps of k take: pairs of them, on pairs."""
        return b.sdiv(b.add(steps, i64(1)), i64(2)) if pairs else steps
    nr, nc_max = i64(emit.nr), i64(block)

    empty = b.icmp_signed("==", k, i64(0))  # an empty sum: C is zeros
    with b.if_then(empty), for_range(b, i64(0), m, name="zi") as i, for_range(b, i64(0), n, name="zj") as j:
        b.store(ir.Constant(F32, 0.0), b.gep(c, [b.add(b.mul(i, ldc), j)]))

    def smaller(x: ir.Value, y: ir.Value) -> ir.Value:
        return b.select(b.icmp_signed("<", x, y), x, y)

    mr = emit.mr
    # k in slices of at most KC steps, as even as can be (784 is 4 × 196, not 3 × 256 + 16)
    depth = b.select(b.icmp_signed("==", m, i64(1)), i64(ROW_KC), i64(KC)) if narrow else i64(PAIRS_KC if pairs else KC)
    slices = b.sdiv(b.add(k, b.sub(depth, i64(1))), depth)
    slice_steps = b.sdiv(b.add(k, b.sub(slices, i64(1))), b.select(b.icmp_signed(">", slices, i64(0)), slices, i64(1)))
    if pairs:  # even, so that no pair straddles two slices
        slice_steps = b.and_(b.add(slice_steps, i64(1)), i64(-2))
    with for_range(b, i64(0), n, step=block, name="jc") as jc:
        nc = smaller(nc_max, b.sub(n, jc))
        panels = b.sdiv(b.add(nc, i64(emit.nr - 1)), nr)
        with for_range(b, i64(0), slices, name="slice") as number:
            pc = b.mul(number, slice_steps)
            kc = smaller(slice_steps, b.sub(k, pc))
            if packed:  # a panel is NR columns by all k; this slice of it starts pc rows in

                def panel(first: ir.Value) -> ir.Value:
                    return b.gep(panels_of_b, [b.add(b.mul(b.add(jc, first), panel_rows(k)), b.mul(panel_rows(pc), nr))])
            else:
                if windows:
                    emit.pack_windows(b, image, geometry, first_column, pc, jc, kc, nc, block_of_b, taps, positions, pairs)
                else:
                    emit.pack(b, tb, matrix, ldb, pc, jc, kc, nc, block_of_b, pairs)

                def panel(first: ir.Value) -> ir.Value:
                    return b.gep(block_of_b, [b.mul(first, panel_rows(kc))])

            accumulate = b.icmp_signed(">", pc, i64(0))
            # a narrow last panel as dot products, where A's rows are read in place (k contiguous)
            last_first = b.mul(b.sub(panels, i64(1)), nr)
            edge_columns = b.sub(nc, last_first)
            # (not on pairs: A's strip is copied)
            dots = ir.Constant(I1, 0) if pairs else b.and_(b.not_(copy_a), b.icmp_signed("<=", edge_columns, i64(DOT_COLUMNS)))
            if not pairs:
                with b.if_then(dots):
                    last = panel(last_first)
                    with for_range(b, i64(0), edge_columns, name="ej") as j, for_range(b, i64(0), kc, name="ep") as p:
                        value = b.load(b.gep(last, [b.add(b.mul(p, nr), j)]))
                        b.store(widen(b, value, DT_BFLOAT16, 1) if narrow else value, b.gep(edge, [b.add(b.mul(j, i64(ROW_KC)), p)]))
            tiled_panels = b.sub(panels, b.zext(dots, I64))

            # the next block: these columns' next slice of k, else the next columns' first slice
            next_pc = b.add(pc, kc)
            same_columns = b.icmp_signed("<", next_pc, k)
            upcoming_pc = b.select(same_columns, next_pc, i64(0))
            upcoming_kc = smaller(slice_steps, b.sub(k, upcoming_pc))

            if packed:  # the next block's slice of each panel, read from memory while this one computes

                def upcoming(first: ir.Value) -> tuple[ir.Value, ir.Value]:
                    """Where panel `first`'s next slice starts and its lines (0: none): the
                    next slice of k of this panel, else the first of the next block's."""
                    next_column = b.add(b.add(jc, nc), first)
                    later = b.gep(panels_of_b, [b.mul(next_column, panel_rows(k))])
                    # one row asks for its lines ahead of where it reads instead (`ROW_AHEAD`)
                    exists = b.and_(b.or_(same_columns, b.icmp_signed("<", next_column, n)),
                                    b.icmp_signed(">", m, i64(1)) if narrow else ir.Constant(I1, 1))
                    per_line = _LINE_FLOATS * (2 if narrow else 1)  # panel elements in a cache line
                    lines = b.select(exists, b.sdiv(b.mul(panel_rows(upcoming_kc), nr), i64(per_line)), i64(0))
                    start = b.select(same_columns, b.gep(panel(first), [b.mul(panel_rows(kc), nr)]), later)
                    return b.bitcast(start, _FLOAT_PTR), lines  # the tiles step through lines as floats

            strips = b.sdiv(b.add(m, i64(mr - 1)), i64(mr))

            if source in ("matrix", "pairs"):  # the next block's source in B, read from memory while this one computes
                next_jc = b.select(same_columns, jc, b.add(jc, nc))
                upcoming_nc = smaller(nc_max, b.sub(n, next_jc))
                exists = b.icmp_signed("<", next_jc, n)
                by_rows = b.icmp_signed("==", tb, i64(0))  # op(B)'s rows are B's: a run of columns per step of k
                source_rows = b.select(exists, b.select(by_rows, upcoming_kc, upcoming_nc), i64(0))
                run = b.add(b.sdiv(b.select(by_rows, upcoming_nc, upcoming_kc), i64(_LINE_FLOATS)), i64(1))
                first_source_row = b.select(by_rows, upcoming_pc, next_jc)
                along = b.select(by_rows, next_jc, upcoming_pc)
                # each strip takes an even share of the rows, each of its tiles but the first
                # (which brings in the next strip's rows of A) a share of those
                strip_rows = b.sdiv(b.add(source_rows, b.sub(strips, i64(1))), strips)
                b_tiles = b.sub(tiled_panels, b.zext(b.not_(copy_a), I64))
                tile_rows = b.sdiv(b.add(strip_rows, b.sub(b_tiles, i64(1))), b.select(b.icmp_signed(">", b_tiles, i64(0)), b_tiles, i64(1)))

                def upcoming_rows(i0: ir.Value, q: ir.Value) -> list[ir.Value]:
                    """(ahead, run, stride, lines) of tile q of the strip at row i0."""
                    strip_first = smaller(b.mul(b.sdiv(i0, i64(mr)), strip_rows), source_rows)
                    strip_last = smaller(b.add(strip_first, strip_rows), source_rows)
                    order = b.sub(q, b.sub(tiled_panels, b_tiles))  # this tile's place among those that fetch B
                    first = smaller(b.add(strip_first, b.mul(order, tile_rows)), strip_last)
                    count = b.sub(smaller(b.add(first, tile_rows), strip_last), first)
                    lines = b.select(b.icmp_signed(">=", order, i64(0)), b.mul(count, run), i64(0))
                    start = b.gep(matrix, [b.add(b.mul(b.add(first_source_row, first), ldb), along)])
                    return [start, run, ldb, lines]

            def next_strip_of_a(i0: ir.Value) -> list[ir.Value]:
                """The lines of the next strip's rows of A (this slice of k; after the last
                strip, the first strip's next slice), for the strip's first tile to bring into L2
                as it computes: a strip reads a few short runs, too short for the hardware's
                prefetchers to follow from memory. (ahead, run, stride, lines) as a tile takes them."""
                following = b.add(i0, i64(mr))
                wraps = b.icmp_signed(">=", following, m)
                row = b.select(wraps, i64(0), following)
                steps_in = b.select(wraps, b.add(pc, kc), pc)
                run = b.add(b.sdiv(kc, i64(_LINE_FLOATS)), i64(1))
                rows_left = smaller(i64(mr), b.sub(m, row))
                wanted = b.and_(b.not_(transposed), b.icmp_signed("<", steps_in, k))
                lines = b.select(wanted, b.mul(rows_left, run), i64(0))
                return [b.gep(a, [b.add(b.mul(row, lda), steps_in)]), run, lda, lines]

            def strip(i0: ir.Value, rows: int) -> None:
                strip_a = b.gep(a, [b.add(b.mul(i0, sa), b.mul(pc, sk))])
                if pairs:
                    row_step, k_step = emit.copy_pairs(b, transposed, strip_a, sa, sk, kc, rows, strip_copy)
                    read_a = strip_copy
                else:
                    with b.if_then(copy_a):
                        emit.copy_strip(b, transposed, strip_a, sa, sk, kc, rows, strip_copy)
                    read_a = b.select(copy_a, strip_copy, strip_a)
                    row_step, k_step = b.select(copy_a, i64(1), sa), b.select(copy_a, i64(rows), sk)
                a_ahead = next_strip_of_a(i0)
                with for_range(b, i64(0), tiled_panels, name="jr") as q:
                    first = b.mul(q, nr)
                    columns = smaller(nr, b.sub(nc, first))
                    arguments = [panel_rows(kc), read_a, row_step, k_step, panel(first), b.gep(c, [b.add(b.mul(i0, ldc), b.add(jc, first))]),
                                 ldc, columns, accumulate]
                    if packed:  # each strip asks for its share of the lines, a tile's steps' worth as it computes
                        start, lines = upcoming(first)
                        share = b.sdiv(b.add(lines, b.sub(strips, i64(1))), strips)
                        low = smaller(b.mul(b.sdiv(i0, i64(mr)), share), lines)
                        high = smaller(b.add(low, share), lines)
                        spread = smaller(b.sub(high, low), panel_rows(kc))
                        emit.prefetch(b, start, b.add(low, spread), high)
                        ahead = [b.gep(start, [b.mul(low, i64(_LINE_FLOATS))]), spread, i64(0), spread]
                        # With none of B's lines for this strip to ask for (the last block and slice of
                        # k), its first tile asks for the next strip's rows of A: Winograd's A is the
                        # transformed filters, from the last-level cache (ResNet-18's 256-channel
                        # 14 × 14 convolutions at batch 1 in-model 0.84 → 0.68 ms), its B the tiles
                        # just transformed.
                        a_first = b.and_(b.icmp_signed("==", q, i64(0)), b.icmp_signed("==", spread, i64(0)))
                        ahead = [b.select(a_first, x, y) for x, y in zip(a_ahead, ahead)]
                    else:  # the next strip's rows of A by the strip's first tile (read in place), B's by the others
                        ahead = [*a_ahead[:3], b.select(b.icmp_signed("==", q, i64(0)), a_ahead[3], i64(0))]
                        if source in ("matrix", "pairs"):
                            b_ahead = upcoming_rows(i0, q)
                            takes_b = b.icmp_signed(">", b_ahead[3], i64(0))
                            ahead = [b.select(takes_b, x, y) for x, y in zip(b_ahead, ahead)]
                    arguments += ahead
                    # the last panel of a block may need fewer vectors (128 columns are 5 panels of 24 and 8)
                    needed = b.sdiv(b.add(columns, i64(emit.lanes - 1)), i64(emit.lanes))
                    for vectors in range(1, emit.vectors + 1):
                        with b.if_then(b.icmp_signed("==", needed, i64(vectors))):
                            b.call(tiles[rows, vectors], arguments)
                if not pairs:
                    with b.if_then(dots):
                        b.call(tiles[rows, "dot"], [kc, read_a, row_step, edge, b.gep(c, [b.add(b.mul(i0, ldc), b.add(jc, last_first))]),
                                                    ldc, edge_columns, accumulate])

            by_strips(b, m, mr, strip)
    b.ret_void()
