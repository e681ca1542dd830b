"""Products by an int8 matrix in llama.cpp's q8_0 form, generated as LLVM IR for the target.

    void ranvier_q8_gemm(i64 m, i64 n, i64 k, float* A, i64 lda, i8* panels, float* C, i64 ldc,
                         i8* workspace)

computes C[m×n] = A[m×k] · W[k×n], overwriting C, on the calling thread, for a constant W packed
ahead of time (`pack_panels`) in q8_0: each column's k steps in blocks of 32, a block's int8
values q = round(w / d) with d = the block's largest magnitude / 127, d kept in float16
(llama.cpp's `quantize_row_q8_0_ref`, so a GGUF file's q8_0 blocks are these). The call
first quantizes A's rows the same way, along k, into the workspace (`workspace_bytes`;
their scales stay float32): the product of two blocks is then exact in int32, and the float32
sums add each block's, times its two scales. These are llama.cpp's numerics for a q8_0 matrix
(it quantizes the activations to q8_0 too, their scales rounded to float16).

The panels hold NR = 4 vectors of 32-bit lanes of columns (64 with AVX-512, 32 with AVX2),
zeros past n; per block of 32 steps of k, the NR columns' float16 scales, then 8 groups of 4
steps, each NR columns × 4 bytes (a column's 4 steps side by side: one 32-bit lane, as
`vpdpbusd` takes them). That instruction multiplies unsigned bytes by signed ones, four pairs
summed into each lane, so the panels hold q + 128 and the activations their signed q: the
offset adds 128 × the activations' block sum to every lane, which the lane's int32 sum
starts from, negated. A tile of C (`tile_shape`: MR rows × NR columns) keeps its float32
sums and a block's int32 sums in registers, each step of a group a panel row of 4 vectors
times MR broadcast 4-byte groups of the activations. Without VNNI (AVX2 on Zen 3, SSE) the
same products come from `vpmaddwd` on the even and odd bytes widened to 16 bits: exact too.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
from llvmlite import ir

from ...dtypes import DT_FLOAT16, DT_FLOAT32, DT_INT8, DT_INT16, DT_INT32, DT_UINT16
from ..llvm.irutil import (
    BYTE_PTR,
    CACHE_LINE,
    F32,
    I32,
    I64,
    VOID,
    by_strips,
    cache_line_aligned,
    constant,
    declared,
    intrinsic,
    use_features,
)
from ..llvm.pointers import Pointer, padded_run, parameters, stack
from ..llvm.values import Value, call, index_value, lane_numbers, local, loop
from . import jit
from .target import CPUTarget

SYMBOL = "ranvier_q8_gemm"
BLOCK = 32  # steps of k a scale covers: llama.cpp's QK8_0
GROUP = 4  # steps of k one 32-bit lane sums
_OFFSET = 128  # added to the weights' int8 values, so vpdpbusd reads them unsigned
_ROW_ALIGNMENT = CACHE_LINE  # the quantized rows' start and stride
_FLOAT_PTR = F32.as_pointer()
_FUNCTION = ir.FunctionType(VOID, [I64, I64, I64, _FLOAT_PTR, I64, BYTE_PTR, _FLOAT_PTR, I64, BYTE_PTR])
GEMM_CTYPE = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
# blocks, the strip's first quantized row, rows' stride, its scales, its int32 sums' starts,
# panel, C, ldc, columns of C to write
_TILE = ir.FunctionType(VOID, [I64, BYTE_PTR, I64, BYTE_PTR, BYTE_PTR, BYTE_PTR, _FLOAT_PTR, I64, I64])
_VECTORS = 4  # of a panel row


def panel_width(target: CPUTarget) -> int:
    """NR: a panel's columns, 4 vectors of 32-bit lanes."""
    return _VECTORS * target.lanes(4)


def tile_rows(target: CPUTarget) -> int:
    """MR: rows of a tile. Each row keeps 4 vectors of a block's int32 sums in registers
    beside the panel row and a broadcast; its float32 sums, touched once a block, may
    live in L1. One Zen 5 core, 128 rows by 768 × 2048 and 2048 × 768 (CPU time, medians of
    7): with AVX-512's 32 registers 4 rows ran 570-670 GFLOP/s against 380-470 with 2, 550-610
    with 3, 540-580 with 6; AVX-VNNI's 8 lanes (16 registers) 340-350 with 2 rows against
    255-285 with 1 and 235-290 with 3; the emulation (no VNNI), whose products take more
    registers, 110-120 with 1 against 100 with 2 or 3."""
    vnni = vnni_lanes(target)
    return 4 if vnni == 16 else 2 if vnni == 8 else 1


def vnni_lanes(target: CPUTarget) -> int:
    """The 32-bit lanes of the target's vpdpbusd (AVX512-VNNI: 16, AVX-VNNI: 8), 0 without."""
    features = target.feature_set
    if target.variant == "avx512" and "avx512vnni" in features:
        return 16
    if target.variant == "avx2" and ("avxvnni" in features or {"avx512vnni", "avx512vl"} <= features):
        return 8
    return 0


def blocks_of(k: int) -> int:
    return -(-k // BLOCK)


def quantized_row_bytes(k: int) -> int:
    """A row of A quantized in the workspace: its int8 blocks, their float32 scales and the
    int32 sums its products start from, padded to a cache line."""
    blocks = blocks_of(k)
    return -(-blocks * (BLOCK + 8) // _ROW_ALIGNMENT) * _ROW_ALIGNMENT


def workspace_bytes(m: int, k: int) -> int:
    """Scratch `ranvier_q8_gemm` needs for m rows of k: the quantized rows, and a line to
    align their start."""
    return _ROW_ALIGNMENT + m * quantized_row_bytes(k)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), exactly, in x's float type."""
    magnitude = np.abs(x)
    floored = np.floor(magnitude)
    return np.copysign(floored + (magnitude - floored >= 0.5), x)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of x (float32 [rows, k]) in q8_0 along k, as llama.cpp's
    `quantize_row_q8_0_ref`: per block of 32 (zeros past k), d = its largest magnitude / 127
    and q = round(x · (1 / d)), halves away from zero (0 where d is 0). (d float32
    [rows, blocks], q int8 [rows, blocks · 32]); a file keeps d in float16."""
    x = np.asarray(x, np.float32)
    rows, k = x.shape
    blocks = blocks_of(k)
    padded = np.zeros((rows, blocks * BLOCK), np.float32)
    padded[:, :k] = x
    grouped = padded.reshape(rows, blocks, BLOCK)
    d = np.abs(grouped).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = _round_half_away(grouped * inverse[..., None]).astype(np.int8)
    return d.astype(np.float32), q.reshape(rows, blocks * BLOCK)


def panels_bytes(columns: int, k: int, target: CPUTarget) -> int:
    """Bytes the panels of `columns` columns of k steps take: whole panels of NR."""
    nr = panel_width(target)
    return -(-columns // nr) * blocks_of(k) * (BLOCK + 2) * nr


_PANEL_ALIGNMENT = 64


def pack_panels(b: np.ndarray, transposed: bool, target: CPUTarget, ranges: list[tuple[int, int]] | None = None) -> np.ndarray:
    """op(B) (B float32 [k, n], or [n, k] when `transposed`) quantized to q8_0 along k and
    packed as `ranvier_q8_gemm` reads it (uint8, 64-byte aligned). With `ranges` (column
    ranges, each a call's), each range's panels follow the previous range's,
    `panels_bytes` each; else one range of all n."""
    columns = np.asarray(b, np.float32) if transposed else np.asarray(b, np.float32).T  # [n, k]: a column per row
    n, k = columns.shape
    nr, blocks = panel_width(target), blocks_of(k)
    ranges = ranges or [(0, n)]
    total = sum(panels_bytes(last - first, k, target) for first, last in ranges)
    storage = np.empty(total + _PANEL_ALIGNMENT, np.uint8)
    start = -storage.ctypes.data % _PANEL_ALIGNMENT
    packed = storage[start : start + total]
    at = 0
    for first, last in ranges:
        count = -(-(last - first) // nr)
        d, q = quantize_q8_0(columns[first:last])
        scales = np.zeros((count * nr, blocks), np.float16)
        scales[: last - first] = d
        values = np.zeros((count * nr, blocks * BLOCK), np.uint8)
        values[: last - first] = q.view(np.uint8) ^ np.uint8(_OFFSET)  # q + 128, as unsigned bytes
        values[last - first :] = _OFFSET  # zeros past n
        block = np.empty((count, blocks, (BLOCK + 2) * nr), np.uint8)
        block[..., : 2 * nr] = scales.reshape(count, nr, blocks).transpose(0, 2, 1).copy().view(np.uint8)
        groups = values.reshape(count, nr, blocks, BLOCK // GROUP, GROUP).transpose(0, 2, 3, 1, 4)
        block[..., 2 * nr :] = groups.reshape(count, blocks, BLOCK * nr)
        size = count * blocks * (BLOCK + 2) * nr
        packed[at : at + size] = block.reshape(-1)
        at += size
    return packed


@functools.cache
def gemm_code(target: CPUTarget) -> jit.LoadedCode:
    """`ranvier_q8_gemm` compiled for `target` and loaded for the life of the process."""
    return jit.generated_function(SYMBOL, Path(__file__), target, build_module)


def gemm_address(target: CPUTarget) -> int:
    return gemm_code(target).address


class _Emitter:
    """IR for one target: its vectors, and how it sums products of bytes."""

    def __init__(self, module: ir.Module, target: CPUTarget):
        self.module = module
        self.lanes = target.lanes(4)
        self.nr = panel_width(target)
        self.floats = ir.VectorType(F32, self.lanes)
        ints = ir.VectorType(I32, self.lanes)
        self.dpbusd = None
        if vnni_lanes(target) == self.lanes:
            self.dpbusd = declared(module, f"llvm.x86.avx512.vpdpbusd.{32 * self.lanes}", ir.FunctionType(ints, [ints] * 3))

    def dot_groups(self, sums: Value, weights: Value, activations: Value) -> Value:
        """sums + in each lane, the 4 unsigned bytes of `weights` times the 4 signed bytes of
        `activations` there (vectors of 32-bit lanes): vpdpbusd, or its exact emulation."""
        if self.dpbusd is not None:
            return call(sums.b, self.dpbusd, sums, weights, activations, dtype=DT_INT32)
        w, x = weights.bitcast(DT_UINT16), activations.bitcast(DT_INT16)
        evens, odds = list(range(0, 2 * self.lanes, 2)), list(range(1, 2 * self.lanes, 2))
        # the even and odd bytes of each 16-bit half, widened: unsigned weights, signed activations
        for wh, xh in ((w & 0xFF, x.shift_left(8).shift_right(8)), (w.shift_right(8), x.shift_right(8))):
            products = wh.cast(DT_INT32) * xh.cast(DT_INT32)  # vpmaddwd: each lane's two 16-bit products, added
            sums = sums + (products.shuffle(evens, products) + products.shuffle(odds, products))
        return sums

    # ---- quantizing A ----------------------------------------------------------------------

    def quantize_rows(self, m: Value, k: Value, a: Pointer, lda: Value, rows: Pointer, row_bytes: Value) -> None:
        """A's m rows into q8_0 rows at `rows`: each its int8 blocks, then their float32
        scales, then −128 × each block's sum (where its int32 products start)."""
        b, lanes, per_block = m.b, self.lanes, BLOCK // self.lanes
        blocks, whole = (k + (BLOCK - 1)) // BLOCK, k // BLOCK
        buffer = stack(b, DT_FLOAT32, BLOCK)  # a last block of fewer than 32 steps, zeros after them
        largest_lane = declared(self.module, f"llvm.vector.reduce.fmax.v{lanes}f32", ir.FunctionType(F32, [self.floats]))
        lane_sum = declared(self.module, f"llvm.vector.reduce.add.v{lanes}i32",
                            ir.FunctionType(I32, [ir.VectorType(I32, lanes)]))
        round_half_away = intrinsic(self.module, "round", self.floats)  # C's roundf, as llama.cpp rounds
        with loop(b, 0, m, name="qr") as r:
            source, row = a + r * lda, rows + r * row_bytes
            scales, starts = (row + blocks * BLOCK).view(DT_FLOAT32), (row + blocks * (BLOCK + 4)).view(DT_INT32)
            with loop(b, 0, blocks, name="qb") as block:
                first = block * BLOCK
                start = padded_run(source, first, k, BLOCK, buffer, block >= whole)
                values = [(start + v * lanes).load(lanes, align=4) for v in range(per_block)]
                largest = values[0].abs()
                for value in values[1:]:
                    magnitude = value.abs()
                    largest = (magnitude > largest).where(magnitude, largest)
                d = call(b, largest_lane, largest, dtype=DT_FLOAT32) / 127.0
                inverse = (d > 0.0).where(1.0 / d, 0.0)  # d: 0 for a block of zeros, else positive
                total = Value(b, ir.Constant(I32, 0), DT_INT32)
                for v, value in enumerate(values):
                    rounded = call(b, round_half_away, value * inverse.splat(lanes), dtype=DT_FLOAT32)
                    # |q| <= 127: fptosi straight to int32 (`cast` goes through int64, numpy's way
                    # for any float, which without AVX-512 converts lane by lane)
                    q = Value(b, b.fptosi(rounded.ir, ir.VectorType(I32, lanes)), DT_INT32)
                    total = total + call(b, lane_sum, q, dtype=DT_INT32)
                    (row + (first + v * lanes)).view(DT_INT8).store(q.cast(DT_INT8), align=1)
                scales[block] = d
                starts[block] = total * -_OFFSET

    # ---- the tile --------------------------------------------------------------------------

    def tile(self, rows: int) -> ir.Function:
        """C[rows × columns] = the strip's quantized rows · the panel: per block, each row's
        int32 sums start from its offset term, take 8 steps of 4 vectors (`dot_groups`), then
        join its float32 sums times the block's scales (the panel's per column, the row's one)."""
        function = ir.Function(self.module, _TILE, name=f"{SYMBOL}_tile{rows}")
        function.linkage = "internal"
        b = ir.IRBuilder(function.append_basic_block("entry"))
        blocks, strip, row_bytes, strip_scales, strip_starts, panel, c, ldc, columns = parameters(b, function)
        lanes, nr = self.lanes, self.nr
        zeros = Value(b, constant(self.floats, 0.0), DT_FLOAT32)
        sums = [[local(b, DT_FLOAT32, lanes, zeros) for _ in range(_VECTORS)] for _ in range(rows)]
        row_starts = [strip + r * row_bytes for r in range(rows)]
        scale_rows = [(strip_scales + r * row_bytes).view(DT_FLOAT32) for r in range(rows)]
        start_rows = [(strip_starts + r * row_bytes).view(DT_INT32) for r in range(rows)]
        with loop(b, 0, blocks, name="kb") as block:
            at = panel + block * ((BLOCK + 2) * nr)
            totals = [[start_rows[r][block].splat(lanes)] * _VECTORS for r in range(rows)]
            for group in range(BLOCK // GROUP):
                weights = [(at + (2 * nr + group * GROUP * nr + v * GROUP * lanes)).view(DT_INT32).load(lanes, align=1)
                           for v in range(_VECTORS)]
                for r in range(rows):
                    four = (row_starts[r] + (block * BLOCK + group * GROUP)).view(DT_INT32).load(align=1)
                    activations = four.splat(lanes)
                    totals[r] = [self.dot_groups(totals[r][v], weights[v], activations) for v in range(_VECTORS)]
            scales = [(at + 2 * v * lanes).view(DT_FLOAT16).load(lanes, align=1) for v in range(_VECTORS)]
            for r in range(rows):
                row_scale = scale_rows[r][block].splat(lanes)
                for v in range(_VECTORS):
                    sums[r][v].set(totals[r][v].cast(DT_FLOAT32).mul_add(scales[v] * row_scale, sums[r][v].value))
        lane = lane_numbers(b, lanes)
        for v in range(_VECTORS):
            mask = lane + v * lanes < columns.splat(lanes)
            for r in range(rows):
                (c + (r * ldc + v * lanes)).masked_store(sums[r][v].value, mask)
        b.ret_void()
        return function


def build_module(target: CPUTarget) -> ir.Module:
    module = ir.Module(SYMBOL)
    module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    use_features(module, target.feature_set)
    emit = _Emitter(module, target)
    mr, nr = tile_rows(target), panel_width(target)
    tiles = {rows: emit.tile(rows) for rows in range(1, mr + 1)}
    function = ir.Function(module, _FUNCTION, name=SYMBOL)
    b = ir.IRBuilder(function.append_basic_block("entry"))
    m, n, k, a, lda, panels, c, ldc, workspace = parameters(b, function)
    blocks = (k + (BLOCK - 1)) // BLOCK
    row_bytes = (blocks * (BLOCK + 8) + (_ROW_ALIGNMENT - 1)) // _ROW_ALIGNMENT * _ROW_ALIGNMENT
    rows = Pointer(b, cache_line_aligned(b, workspace.ir, BYTE_PTR), workspace.dtype)
    emit.quantize_rows(m, k, a, lda, rows, row_bytes)
    scales, starts = rows + blocks * BLOCK, rows + blocks * (BLOCK + 4)
    with loop(b, 0, n, step=nr, name="jr") as j:
        panel = panels + j // nr * (blocks * ((BLOCK + 2) * nr))
        columns = (n - j).minimum(nr)

        def strip(first_row: ir.Value, count: int) -> None:
            i0 = index_value(b, first_row)
            at = i0 * row_bytes
            call(b, tiles[count], blocks, rows + at, row_bytes, scales + at, starts + at, panel, c + (i0 * ldc + j), ldc,
                 columns)

        by_strips(b, m.ir, mr, strip)
    b.ret_void()
    return module
