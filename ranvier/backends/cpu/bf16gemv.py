"""A row times a constant matrix in bfloat16 pairs on AVX512-BF16 (a decode step's products),
generated as LLVM IR.

    void ranvier_gemv_dpbf16(i64 n, i64 k, float* x, i32* panels, float* y, i8* workspace)

computes y[n] = x[k] · W[k×n], overwriting y, on the calling thread, for a W packed ahead of time
in the panels the GEMM on bf16 pairs reads (`sgemm.pack_panels(..., pairs=True)`): NR columns a
panel (48, `sgemm.panel_width`),
each k/2 rows of NR 32-bit slots, a slot two steps of k of one column (k, then k + 1 in its upper
half; a zero past an odd k), the weights rounded to the nearest bf16. The call first rounds x the
same way into pairs in the workspace (`workspace_bytes`); then per panel, `vdpbf16ps` takes a
pair of x, broadcast, against each vector of a panel row: two products a lane, float32 sums.

Such a product only streams its matrix, once: what bounds it is how many of the matrix's cache
lines are in flight, which is how far ahead of its loads the core's out-of-order window reaches.
A panel row of pairs is 3 vectors and 3 instructions, where widening bf16 to float32 (`sgemm`'s
bf16 panels) takes 2 of each per vector; 8 rows a loop step and no prefetch instructions keep
the loop's instructions per byte low. On one Zen 5 core (a 32 MB L3) streaming 76 MB of
stories110M-shaped panels from memory (12 layers' 768 × 2048 and 2048 × 768, CPU time, three
alternated rounds of medians of 9, the machine shared): 36-37.5 GB/s against a plain AVX-512 read's
38-38.6, where the widening kernel read 24-24.4 (its prefetches 1,024 elements ahead: without them 19).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from llvmlite import ir

from ...dtypes import DT_BFLOAT16
from ..llvm.convert import narrow
from ..llvm.irutil import (
    BF16,
    BYTE_PTR,
    F32,
    I1,
    I32,
    I64,
    VOID,
    cache_line_aligned,
    constant,
    declared,
    for_range,
    i64,
    padded_run,
    splat,
)
from . import jit
from .sgemm import panel_width
from .target import CPUTarget

SYMBOL = "ranvier_gemv_dpbf16"
_LANES = 16  # AVX-512's float lanes: the instruction is AVX-512's
_ROWS_A_STEP = 8  # panel rows (pairs of k) a loop step takes
_FLOAT_PTR = F32.as_pointer()
_FUNCTION = ir.FunctionType(VOID, [I64, I64, _FLOAT_PTR, I32.as_pointer(), _FLOAT_PTR, BYTE_PTR])
GEMV_CTYPE = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p)


def workspace_bytes(k: int) -> int:
    """Scratch `ranvier_gemv_dpbf16` needs for x of k: its pairs, whole vectors of them, and
    a line to align their start."""
    return 64 + -(-k // (2 * _LANES)) * _LANES * 4


@functools.cache
def gemv_code(target: CPUTarget) -> jit.LoadedCode:
    """`ranvier_gemv_dpbf16` compiled for `target` (a `sgemm.pairs_supported` one) and loaded for the life of the process."""
    return jit.generated_function(SYMBOL, Path(__file__), target, build_module)


def gemv_address(target: CPUTarget) -> int:
    return gemv_code(target).address


def build_module(target: CPUTarget) -> ir.Module:
    module = ir.Module(SYMBOL)
    module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    floats, slots = ir.VectorType(F32, _LANES), ir.VectorType(I32, _LANES)
    pairs_type = ir.VectorType(BF16, 2 * _LANES)
    dot = declared(module, "llvm.x86.avx512bf16.dpbf16ps.512", ir.FunctionType(floats, [floats, pairs_type, pairs_type]))
    store = declared(module, f"llvm.masked.store.v{_LANES}f32.p0v{_LANES}f32",
                     ir.FunctionType(VOID, [floats, floats.as_pointer(), I32, ir.VectorType(I1, _LANES)]))
    nr = panel_width(target)
    vectors = nr // _LANES
    function = ir.Function(module, _FUNCTION, name=SYMBOL)
    n, k, x, panels, y, workspace = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))

    # x's pairs: each vector of 16 floats rounded to bf16 is 8 pairs; the last, partial one
    # from a buffer of zeros past k
    pairs = cache_line_aligned(b, workspace, I32.as_pointer())
    buffer = b.alloca(F32, i64(_LANES))
    half = ir.VectorType(I32, _LANES // 2)
    chunks = b.sdiv(b.add(k, i64(_LANES - 1)), i64(_LANES))
    whole = b.sdiv(k, i64(_LANES))
    with for_range(b, i64(0), chunks, name="xc") as chunk:
        first = b.mul(chunk, i64(_LANES))
        source = padded_run(b, x, first, k, _LANES, buffer, b.icmp_signed(">=", chunk, whole))
        values = b.load(b.bitcast(source, floats.as_pointer()), align=4)
        target_slots = b.bitcast(b.gep(pairs, [b.mul(chunk, i64(_LANES // 2))]), half.as_pointer())
        b.store(b.bitcast(narrow(b, values, DT_BFLOAT16, _LANES), half), target_slots, align=4)

    rows = b.sdiv(b.add(k, i64(1)), i64(2))  # panel rows: pairs of k
    whole_rows = b.mul(b.sdiv(rows, i64(_ROWS_A_STEP)), i64(_ROWS_A_STEP))
    lane = ir.Constant(ir.VectorType(I64, _LANES), list(range(_LANES)))
    # two sets of sums, even and odd rows: half the chains' length for data from the caches
    sums = [[b.alloca(floats) for _ in range(vectors)] for _ in range(2)]
    with for_range(b, i64(0), n, step=nr, name="jp") as j:
        panel = b.gep(panels, [b.mul(j, rows)])  # the panel of columns j..: rows × NR slots
        for slot in (s for chain in sums for s in chain):
            b.store(constant(floats, 0.0), slot)

        def row(p: ir.Value, chain: list[ir.Value]) -> None:
            broadcast = b.bitcast(splat(b, b.load(b.gep(pairs, [p])), _LANES), pairs_type)
            for v in range(vectors):
                at = b.gep(panel, [b.add(b.mul(p, i64(nr)), i64(v * _LANES))])
                weights = b.bitcast(b.load(b.bitcast(at, slots.as_pointer()), align=64), pairs_type)
                b.store(b.call(dot, [b.load(chain[v]), weights, broadcast]), chain[v])

        with for_range(b, i64(0), whole_rows, step=_ROWS_A_STEP, name="pr") as p:
            for u in range(_ROWS_A_STEP):
                row(b.add(p, i64(u)), sums[u % 2])
        with for_range(b, whole_rows, rows, name="pt") as p:
            row(p, sums[0])
        columns = b.sub(n, j)
        for v in range(vectors):
            mask = b.icmp_signed("<", b.add(lane, splat(b, i64(v * _LANES), _LANES)), splat(b, columns, _LANES))
            total = b.fadd(b.load(sums[0][v]), b.load(sums[1][v]))
            b.call(store, [total, b.bitcast(b.gep(y, [b.add(j, i64(v * _LANES))]), floats.as_pointer()), ir.Constant(I32, 4), mask])
    b.ret_void()
    return module
