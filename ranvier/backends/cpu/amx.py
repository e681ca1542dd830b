"""A bfloat16 GEMM on Intel AMX tiles, generated as LLVM IR.

    void ranvier_bf16_gemm(i64 transpose_a, i64 transpose_b, i64 m, i64 n, i64 k,
                           float* A, i64 lda, float* B, i64 ldb, float* C, i64 ldc,
                           i8* workspace)

computes row-major C[m×n] = op(A)[m×k] · op(B)[k×n] (op(X) is X or Xᵀ; the leading
dimensions count elements), overwriting C. Inputs are rounded to bfloat16 (to nearest
even) and products accumulate in float32, as AMX's TDPBF16PS does.

The algorithm:

1. Packing. The operands are converted to bfloat16 into the workspace (at least
   `workspace_bytes(m, n, k)` bytes, any alignment), zero-padded to whole tiles: m and n
   to multiples of 16, k to a multiple of 32. Each is cut into panels of 16 rows of
   op(A) or 16 columns of op(B), and a panel into 1 KiB blocks, one per 32 values of k,
   each exactly the 16 rows × 64 bytes one tile load reads. An A block is row-major
   (16 rows × 32 k); a B block is in the VNNI order TDPBF16PS wants, 16 rows of k-pairs
   × 16 columns × 2 (op(B)[2p, j] next to op(B)[2p+1, j]). Panels are stored in pairs,
   the pair's two blocks for each step of k side by side, so that the four tiles one
   step of the kernel loads are two runs of 2 KiB, whatever k is.

   Thinking of a block as 16 × 16 32-bit pairs of bfloat16, a source matrix delivers
   it in one of two ways. If k runs along its rows (A, or a transposed B) a row's 32
   floats are 16 pairs; if k runs down its columns (B, or a transposed A) two rows
   interleaved give 16 pairs. A and B want opposite orientations, so the transposed
   cases also transpose the 16 × 16 block of pairs in registers. Conversion is
   VCVTNEPS2BF16 (LLVM's fptrunc to bfloat), edges are masked loads that read zeros.

2. Multiplication. C is computed in 32 × 32 blocks: tiles tmm0-3 accumulate the four
   16 × 16 float32 quarters, and each step of 32 in k loads two A tiles (tmm4-5) and two
   B tiles (tmm6-7) for four TDPBF16PS: four tile loads feed 4 × 16K multiply-adds.
   An odd last panel of A or B gets a 16-wide variant. A pair of A panels stays in L1
   while B's panels stream past it from L2, along a row of blocks of C.

   Blocking for the caches: k is cut into slices of at most `_K_SLICE` steps, so that
   the resident pair of A panels fits in L1 (the slices after the first load C into
   the accumulators and add to it); B is packed a chunk of at most `_STREAM_BYTES` at a
   time, just before its sweeps, so that it is still in L2 for them. The workspace holds
   one slice of A and one chunk of B.

3. Storing. A whole 16 × 16 tile is stored straight into C; a tile over C's edge goes to
   a scratch tile on the stack and only its valid rows and columns (masked stores) are
   copied, so nothing outside the m × n region is written.

The process must have asked Linux for the AMX state first (`amx_permitted`): without
that grant the first tile instruction raises SIGILL. VCVTNEPS2BF16 and TDPBF16PS treat
subnormal inputs as zero, which only matters for values below 1.2e-38.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llvmlite import ir

from ...dtypes import DT_FLOAT32, DT_INT32, DT_UINT8
from ...errors import RanvierError
from ..llvm.convert import bf16_pairs
from ..llvm.irutil import (
    BYTE_PTR,
    F32,
    I1,
    I8,
    I64,
    VOID,
    cache_line_aligned,
    declared,
)
from ..llvm.pointers import Pointer, parameters, stack
from ..llvm.values import Value, call, index_value, lane_numbers, loop
from . import jit
from .target import CPUTarget

SYMBOL = "ranvier_bf16_gemm"

# The function's C signature, for calling it through ctypes.
GEMM_CTYPE = ctypes.CFUNCTYPE(
    None, *[ctypes.c_int64] * 5,
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
    ctypes.c_void_p,
)

REQUIRED_FEATURES = frozenset({"amx-tile", "amx-bf16", "avx512f", "avx512bw", "avx512bf16"})

TILE = 16  # rows of a tile; also its width in float32 or in bfloat16 pairs
K_STEP = 32  # bfloat16 values of k that one tile row holds
BLOCK_BYTES = TILE * 64  # one tile: 16 rows of 64 bytes
_STREAM_BYTES = 1 << 20  # packed panels streamed past a resident pair: half of a 2 MiB L2
_K_SLICE = 16  # steps of k per slice: the resident pair of A panels then takes at most 32 KiB of L1

_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18

# Accumulators, A tiles and B tiles: a 2 × 2 block of C needs all eight tile registers.
_ACC = ((0, 1), (2, 3))
_A_TILES = (4, 5)
_B_TILES = (6, 7)


@functools.cache
def amx_permitted() -> bool:
    """Whether this process may run AMX instructions: Linux grants the tile data state on
    request (arch_prctl ARCH_REQ_XCOMP_PERM), once for the whole process."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None)
    args = (_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    return libc.syscall(*map(ctypes.c_long, args)) == 0


def amx_usable(target: CPUTarget) -> bool:
    """Whether code for `target` may use the AMX GEMM here: the target has the tile and
    bfloat16 features the kernel and its packing use, and the OS lets this process use tiles."""
    return target.feature_set >= REQUIRED_FEATURES and amx_permitted()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def workspace_bytes(m: int, n: int, k: int) -> int:
    """Scratch bytes `ranvier_bf16_gemm` needs: one slice of k of A and one chunk of B's
    panels, packed as bfloat16 tiles, plus 64 for aligning the start."""
    steps = _cdiv(k, K_STEP)
    slice_steps = _cdiv(steps, max(1, _cdiv(steps, _K_SLICE)))
    chunk = max(2, _STREAM_BYTES // (max(1, slice_steps) * BLOCK_BYTES) & -2)
    return 64 + (_cdiv(m, TILE) + min(_cdiv(n, TILE), chunk)) * slice_steps * BLOCK_BYTES


def gemm_address(target: CPUTarget) -> int:
    """Address of `ranvier_bf16_gemm` for `target` (see gemm_code)."""
    return gemm_code(target).address


@functools.cache
def gemm_code(target: CPUTarget) -> jit.LoadedCode:
    """`ranvier_bf16_gemm` compiled for `target` and loaded for the life of the process
    (object code cached in memory and on disk like cell code). Asking for it also obtains
    the OS's permission to run it."""
    if not amx_usable(target):
        raise RanvierError(f"AMX bfloat16 GEMM unavailable: the CPU target needs {sorted(REQUIRED_FEATURES)} "
                           "and Linux must grant this process the AMX tile state")
    return jit.generated_function(SYMBOL, Path(__file__), target, build_module)


# ---------------------------------------------------------------------------------------
# IR building blocks


_FLOAT_PTR = F32.as_pointer()


def _intrinsic(b: ir.IRBuilder, name: str, *args: ir.Value) -> None:
    """Call the tile intrinsic `name` (no result), declared on first use from the arguments' types."""
    call(b, declared(b.module, name, ir.FunctionType(VOID, [a.type for a in args])), *args)


def _tile(tile: int) -> ir.Constant:
    return ir.Constant(I8, tile)


def _tile_load(tile: int, base: Pointer, stride: Value, streaming: bool = False) -> None:
    name = "llvm.x86.tileloaddt164" if streaming else "llvm.x86.tileloadd64"
    _intrinsic(base.b, name, _tile(tile), base.view(DT_UINT8).ir, stride.ir)


def _tile_store(tile: int, base: Pointer, stride: Value) -> None:
    _intrinsic(base.b, "llvm.x86.tilestored64", _tile(tile), base.view(DT_UINT8).ir, stride.ir)


def _lane_mask(start: Value, limit: Value) -> Value:
    """Lanes i of 16 where start + i < limit."""
    lanes = start.splat(16) + lane_numbers(start.b, 16)
    return lanes < limit.splat(16)


def _when(valid: Value, mask: Value) -> Value:
    """`mask` where the scalar `valid` holds, else no lanes: a whole row outside the matrix."""
    return valid.where(mask, mask.zeros())


def _transpose(rows: list[Value]) -> list[Value]:
    """Transpose a 16 × 16 block of 32-bit lanes held in 16 vectors.

    A transpose swaps the four bits of the row index with those of the column index;
    each stage swaps one pair of bits with 16 two-vector shuffles."""
    rows = list(rows)
    for bit in (1, 2, 4, 8):
        low = [c if not c & bit else 16 + (c & ~bit) for c in range(16)]
        high = [c | bit if not c & bit else 16 + c for c in range(16)]
        for r in range(16):
            if r & bit:
                continue
            upper, lower = rows[r], rows[r | bit]
            rows[r] = upper.shuffle(low, lower)
            rows[r | bit] = upper.shuffle(high, lower)
    return rows


def _internal_function(module: ir.Module, name: str, args: list[ir.Type]) -> tuple[ir.IRBuilder, list[Any]]:
    """An internal function of `args`, its builder at its start and its arguments as Values and pointers."""
    function = ir.Function(module, ir.FunctionType(VOID, args), name=name)
    function.linkage = "internal"
    b = ir.IRBuilder(function.append_basic_block("entry"))
    return b, parameters(b, function)


def _pairs(first: Value, second: Value, interleave: bool) -> Value:
    return Value(first.b, bf16_pairs(first.b, first.ir, second.ir, interleave), DT_INT32)


# ---------------------------------------------------------------------------------------
# Packing


def _block_offset(panel: Value, step: Value, panels: Value, steps: Value) -> Value:
    """Where block `step` of `panel` goes: panels are packed in pairs, the pair's two blocks
    for each step side by side (an odd last panel alone), so that the tiles a kernel loads
    for one step are 2 KiB in a row and a sweep over panels reads one sequential stream."""
    pair_start = (panel & -2) * (steps * BLOCK_BYTES)
    width = ((panel | 1) < panels).where(2, index_value(panel.b, 1))
    within = step * width + (panel & 1)
    return pair_start + within * BLOCK_BYTES


def _emit_pack(module: ir.Module, k_along_rows: bool, transpose: bool) -> ir.Function:
    """`pack(float* source, i64 ld, i64 outer, i64 k, i8* packed, i64 first_step, i64 steps,
    i64 start, i64 stop)`: the source matrix holds `outer` rows by k columns (k_along_rows)
    or k rows by `outer` columns. Write its panels start to stop (of 16 `outer` values)
    over the slice of k from 32·first_step, `steps` blocks long, as if panel `start` were
    the first: 1 KiB blocks of 16 × 16 bfloat16 pairs, indexed [outer][pair] for k along
    rows and [pair][outer] otherwise, transposed on request."""
    name = f"pack_{'rows' if k_along_rows else 'columns'}{'_transposed' if transpose else ''}"
    b, (source, ld, outer, k, packed, first_step, steps, start, stop) = _internal_function(
        module, name, [_FLOAT_PTR, I64, I64, I64, BYTE_PTR, I64, I64, I64, I64])

    def block(panel: Value, step: Value) -> None:
        first, k0 = panel * TILE, (first_step + step) * K_STEP
        if k_along_rows:
            # Row r: 32 floats of k, i.e. 16 pairs, from source row first + r.
            low, high = _lane_mask(k0, k), _lane_mask(k0 + 16, k)
            vectors = []
            for r in range(TILE):
                row = first + r
                valid = row < outer
                origin = source + (row * ld + k0)
                halves = [(origin + 16 * h).masked_load(_when(valid, mask)) for h, mask in enumerate((low, high))]
                vectors.append(_pairs(halves[0], halves[1], interleave=False))
        else:
            # Pair p: source rows k0 + 2p and k0 + 2p + 1, interleaved, 16 columns wide.
            columns = _lane_mask(first, outer)
            vectors = []
            for p in range(TILE):
                rows = []
                for j in range(2):
                    row = k0 + (2 * p + j)
                    rows.append((source + (row * ld + first)).masked_load(_when(row < k, columns)))
                vectors.append(_pairs(rows[0], rows[1], interleave=True))
        if transpose:
            vectors = _transpose(vectors)
        out = packed + _block_offset(panel - start, step, stop - start, steps)
        for r, vector in enumerate(vectors):
            (out + 64 * r).view(DT_INT32).store(vector, align=64)

    # Walk the source in memory order: along its rows, then down.
    if k_along_rows:
        with loop(b, start, stop, name="panel") as panel, loop(b, 0, steps, name="step") as step:
            block(panel, step)
    else:
        with loop(b, 0, steps, name="step") as step, loop(b, start, stop, name="panel") as panel:
            block(panel, step)
    b.ret_void()
    return b.function


# ---------------------------------------------------------------------------------------
# Multiplication


def _emit_kernel(module: ir.Module, a_panels: int, b_panels: int) -> ir.Function:
    """`kernel(i8* a, i8* b, i64 steps, float* c, i64 ldc, i64 rows, i64 columns, i1 accumulate)`:
    C[16·a_panels × 16·b_panels] (+)= (a_panels panels of A at a) · (b_panels panels of B
    at b) over `steps` blocks of k, touching only the first `rows` × `columns` (which may
    exceed the block) of C."""
    name = f"kernel_{a_panels}x{b_panels}"
    b, (a, bp, steps, c, ldc, rows, columns, accumulate) = _internal_function(
        module, name, [BYTE_PTR, BYTE_PTR, I64, _FLOAT_PTR, I64, I64, I64, I1])
    with b.goto_entry_block():
        scratch = stack(b, DT_FLOAT32, TILE * TILE, align=64)
    stride = index_value(b, 64)
    tiles = [(i, j) for i in range(a_panels) for j in range(b_panels)]
    # Where each accumulator's 16 × 16 goes in C, and how many of its rows and columns are in C.
    places = {(i, j): (c + (16 * i * ldc + 16 * j), rows - 16 * i, columns - 16 * j) for i, j in tiles}
    with b.if_else(accumulate.ir) as (add, overwrite):
        with add:
            for i, j in tiles:
                _load_accumulator(_ACC[i][j], *places[i, j], ldc, scratch)
        with overwrite:
            for i, j in tiles:
                _intrinsic(b, "llvm.x86.tilezero", _tile(_ACC[i][j]))
    with loop(b, 0, steps, name="step") as step:
        a_step = a + step * (a_panels * BLOCK_BYTES)
        b_step = bp + step * (b_panels * BLOCK_BYTES)
        # Each load just before the first product that reads it: a tile register is free
        # only once the previous step's products are done with it. B's blocks stream past
        # (one use per pair of A panels) and load with the T1 hint, which keeps them from
        # pushing A's resident panels out of L1 (measured 2-7% faster).
        for i in range(a_panels):
            _tile_load(_A_TILES[i], a_step + i * BLOCK_BYTES, stride)
            for j in range(b_panels):
                if i == 0:
                    _tile_load(_B_TILES[j], b_step + j * BLOCK_BYTES, stride, streaming=True)
                _intrinsic(b, "llvm.x86.tdpbf16ps", _tile(_ACC[i][j]), _tile(_A_TILES[i]), _tile(_B_TILES[j]))
    for i, j in tiles:
        _store_accumulator(_ACC[i][j], *places[i, j], ldc, scratch)
    b.ret_void()
    return b.function


def _at_least(low: int, x: Value) -> Value:
    """max(low, x) as `x < low ? low : x`, the form this GEMM was timed with on AMX:
    `Value.maximum`'s `x > low ? x : low` (the same values) leads LLVM to other code for
    the whole function, untimed where no AMX machine is at hand."""
    return (x < low).where(low, x)


def _whole(rows: Value, columns: Value) -> Value:
    return (rows >= 16) & (columns >= 16)


def _load_accumulator(tile: int, corner: Pointer, rows: Value, columns: Value, ldc: Value, scratch: Pointer) -> None:
    """Load accumulator `tile` from the 16 × 16 of C at `corner`, of which `rows` × `columns`
    lie inside C; the lanes outside are never stored, so they may hold anything."""
    b = corner.b
    with b.if_else(_whole(rows, columns).ir) as (full, edge):
        with full:
            _tile_load(tile, corner, ldc * 4)
        with edge:
            mask = _lane_mask(index_value(b, 0), columns)
            with loop(b, 0, rows.minimum(16), name="row") as row:
                (scratch + row * 16).store((corner + row * ldc).masked_load(mask), align=64)
            _tile_load(tile, scratch, index_value(b, 64))


def _store_accumulator(tile: int, corner: Pointer, rows: Value, columns: Value, ldc: Value, scratch: Pointer) -> None:
    """Store accumulator `tile` into the 16 × 16 of C at `corner`, of which `rows` × `columns`
    (possibly none, possibly more than 16) lie inside C."""
    b = corner.b
    with b.if_else(_whole(rows, columns).ir) as (full, edge):
        with full:
            _tile_store(tile, corner, ldc * 4)
        with edge:
            _tile_store(tile, scratch, index_value(b, 64))
            mask = _lane_mask(index_value(b, 0), columns)
            with loop(b, 0, rows.minimum(16), name="row") as row:
                (corner + row * ldc).masked_store((scratch + row * 16).load(16, align=64), mask)


def _emit_products(kernels: dict[tuple[int, int], ir.Function], steps: Value, chunk: Value, m: Value, n: Value,
                   c: Pointer, ldc: Value, accumulate: Value, a_packed: Pointer, b_packed: Pointer,
                   pack_b: Callable[[Value, Value], None]) -> None:
    """C (+)= A · B over one slice of k (`steps` blocks), A packed, in 32 × 32 blocks.

    A pair of A panels stays in L1 (outer loop) while B's panels stream past it from L2
    (inner loop), along C's rows. B is packed a chunk of `chunk` panels at a time, just
    before the chunk's sweeps, so that it is still in L2 for them."""
    b = c.b
    panel_bytes = steps * BLOCK_BYTES
    a_count = (m + (TILE - 1)) // TILE
    b_count = (n + (TILE - 1)) // TILE

    def product(ai: Value, bj: Value, start: Value, a_panels: int, b_panels: int) -> None:
        row, column = ai * TILE, bj * TILE
        call(b, kernels[a_panels, b_panels], a_packed + ai * panel_bytes, b_packed + (bj - start) * panel_bytes, steps,
             c + (row * ldc + column), ldc, m - row, n - column, accumulate)

    def sweep(start: Value, stop: Value, ai: Value, a_panels: int) -> None:
        with loop(b, start, stop - 1, step=2, name="column") as bj:
            product(ai, bj, start, a_panels, 2)
        with b.if_then(((stop - start) & 1).not_equal(0).ir):
            product(ai, stop - 1, start, a_panels, 1)

    chunks = (b_count + (chunk - 1)) // chunk
    with loop(b, 0, chunks, name="chunk") as index:
        start = index * chunk
        stop = (start + chunk).minimum(b_count)
        pack_b(start, stop)
        with loop(b, 0, a_count - 1, step=2, name="row") as ai:
            sweep(start, stop, ai, 2)
        with b.if_then((a_count & 1).not_equal(0).ir):
            sweep(start, stop, a_count - 1, 1)


# ---------------------------------------------------------------------------------------
# The module


def _tile_config(module: ir.Module) -> ir.GlobalVariable:
    """LDTILECFG's 64 bytes: palette 1, then tmm0-7 all 16 rows × 64 bytes."""
    config = [0] * 64
    config[0] = 1
    for tile in range(8):
        config[16 + 2 * tile] = 64  # bytes per row, little-endian uint16
        config[48 + tile] = TILE  # rows
    array = ir.ArrayType(I8, 64)
    variable = ir.GlobalVariable(module, array, name="tile_config")
    variable.global_constant = True
    variable.linkage = "private"
    variable.align = 64
    variable.initializer = ir.Constant(array, config)
    return variable


def build_module(target: CPUTarget) -> ir.Module:
    """The LLVM module defining `ranvier_bf16_gemm` for `target`."""
    module = ir.Module(name="amx_gemm")
    module.triple = target.machine.triple
    pack_rows, pack_rows_t = _emit_pack(module, True, False), _emit_pack(module, True, True)
    pack_columns, pack_columns_t = _emit_pack(module, False, False), _emit_pack(module, False, True)
    kernels = {(ra, rb): _emit_kernel(module, ra, rb) for ra in (1, 2) for rb in (1, 2)}
    config = _tile_config(module)

    signature = ir.FunctionType(VOID, [I64] * 5 + [_FLOAT_PTR, I64, _FLOAT_PTR, I64, _FLOAT_PTR, I64, BYTE_PTR])
    function = ir.Function(module, signature, name=SYMBOL)
    b = ir.IRBuilder(function.append_basic_block("entry"))
    ta, tb, m, n, k, a, lda, bm, ldb, c, ldc, workspace = parameters(b, function)
    # The workspace holds a slice of A and a chunk of B; workspace_bytes mirrors these sizes.
    steps = (k + (K_STEP - 1)) // K_STEP
    slices = _at_least(1, (steps + (_K_SLICE - 1)) // _K_SLICE)  # k = 0 still clears C
    slice_steps = (steps + (slices - 1)) // slices
    panel_bytes = _at_least(1, slice_steps) * BLOCK_BYTES
    chunk = _at_least(2, index_value(b, _STREAM_BYTES) // panel_bytes & -2)
    a_count = (m + (TILE - 1)) // TILE
    a_packed = Pointer(b, cache_line_aligned(b, workspace.ir, BYTE_PTR), DT_UINT8)
    b_packed = a_packed + a_count * slice_steps * BLOCK_BYTES
    # op(A) is m × k: A itself has k along its rows unless transposed; op(B) is k × n.
    pack_a = b.select(ta.not_equal(0).ir, pack_columns_t, pack_rows)
    pack_b = b.select(tb.not_equal(0).ir, pack_rows_t, pack_columns)
    _intrinsic(b, "llvm.x86.ldtilecfg", b.bitcast(config, BYTE_PTR))
    # k in slices of at most _K_SLICE steps, as equal as can be; every slice after the
    # first adds its products to C.
    with loop(b, 0, slices, name="slice") as index:
        first = index * slice_steps
        here = (steps - first).minimum(slice_steps)
        call(b, pack_a, a, lda, m, k, a_packed, first, here, 0, a_count)
        _emit_products(kernels, here, chunk, m, n, c, ldc, index > 0, a_packed, b_packed,
                       lambda start, stop: call(b, pack_b, bm, ldb, n, k, b_packed, first, here, start, stop))
    _intrinsic(b, "llvm.x86.tilerelease")
    b.ret_void()
    return module
