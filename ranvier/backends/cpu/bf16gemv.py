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

from ...dtypes import DT_BFLOAT16, DT_FLOAT32, DT_INT16, DT_INT32
from ..llvm.convert import narrow
from ..llvm.irutil import BYTE_PTR, F32, I32, I64, VOID, cache_line_aligned, constant
from ..llvm.pointers import Pointer, padded_run, parameters, stack
from ..llvm.values import Local, Value, lane_numbers, local, loop
from . import jit
from .sgemm import pair_dot, panel_width
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
    nr = panel_width(target)
    vectors = nr // _LANES
    function = ir.Function(module, _FUNCTION, name=SYMBOL)
    b = ir.IRBuilder(function.append_basic_block("entry"))
    n, k, x, panels, y, workspace = parameters(b, function)

    # x's pairs: x[i] rounded to bf16 in the low (even i) or high half of slot i / 2; the
    # last, partial vector of 16 from a buffer of zeros past k
    pairs = Pointer(b, cache_line_aligned(b, workspace.ir, I32.as_pointer()), DT_INT32)
    halves = pairs.view(DT_INT16)
    buffer = stack(b, DT_FLOAT32, _LANES)
    whole = k // _LANES
    with loop(b, 0, (k + (_LANES - 1)) // _LANES, name="xc") as chunk:
        first = chunk * _LANES
        values = padded_run(x, first, k, _LANES, buffer, chunk >= whole).load(_LANES, align=4)
        rounded = Value(b, narrow(b, values.ir, DT_BFLOAT16, _LANES), DT_INT16)  # bf16's bits
        (halves + first).store(rounded, align=4)

    rows = (k + 1) // 2  # panel rows: pairs of k
    whole_rows = rows // _ROWS_A_STEP * _ROWS_A_STEP
    zeros = Value(b, constant(ir.VectorType(F32, _LANES), 0.0), DT_FLOAT32)
    lanes = lane_numbers(b, _LANES)
    # two sets of sums, even and odd rows: half the chains' length for data from the caches
    sums = [[local(b, DT_FLOAT32, _LANES) for _ in range(vectors)] for _ in range(2)]
    with loop(b, 0, n, step=nr, name="jp") as j:
        panel = panels + j * rows  # the panel of columns j..: rows × NR slots
        for slot in (s for chain in sums for s in chain):
            slot.set(zeros)

        def row(p: Value, chain: list[Local]) -> None:
            """chain[v] += the panel's row p · x's pair p, vector v of the row (vdpbf16ps)."""
            pair = pairs[p].splat(_LANES)
            for v in range(vectors):
                weights = (panel + (p * nr + v * _LANES)).load(_LANES, align=64)
                chain[v].set(pair_dot(chain[v].value, weights, pair))

        with loop(b, 0, whole_rows, step=_ROWS_A_STEP, name="pr") as p:
            for u in range(_ROWS_A_STEP):
                row(p + u, sums[u % 2])
        with loop(b, whole_rows, rows, name="pt") as p:
            row(p, sums[0])
        columns = (n - j).splat(_LANES)
        for v in range(vectors):
            (y + (j + v * _LANES)).masked_store(sums[0][v].value + sums[1][v].value, lanes + v * _LANES < columns)
    b.ret_void()
    return module
