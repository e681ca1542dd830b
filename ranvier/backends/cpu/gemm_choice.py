"""Which float32 GEMM computes a product of a given shape: the generated one (sgemm.py)
or the vendor BLAS, whichever measured faster here for that shape and those leading
dimensions on one thread, the way a worker-pool part runs it. Each is measured once per
machine and the choice kept (measured.py); products too large to time quickly stay on
BLAS; `RANVIER_GEMM=generated` or `=blas` fixes the choice instead."""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import time

import numpy as np

from ...errors import RanvierError
from . import sgemm
from .blas import blas_pointers, blas_thread_setter
from .measured import kept, kept_path
from .target import host_target

GEMM_ENVIRONMENT = "RANVIER_GEMM"
_MEASURED_FLOPS = 1 << 29  # a larger product is timed on some of its columns (this takes ~7 ms)
_FEWEST_BLOCKS = 4  # of B's columns, for a product timed on its first columns
# The two run in pairs, each going first in every other pair; the median of the pairs'
# time ratios decides. Each one's fastest run of 15 kept a choice that later measured 10%
# the wrong way (an MoE's expert weight gradients on BLAS, its step 3% slower): a pair
# shares the host's passing state, two fastest runs need not.
_ROUNDS = 15
_METHOD = "median of paired ratios"

_INT, _FLOAT = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
_FORTRAN_SGEMM = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, _INT, _INT, _INT, _FLOAT, ctypes.c_void_p, _INT,
                                  ctypes.c_void_p, _INT, _FLOAT, ctypes.c_void_p, _INT)


def generated_is_faster(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, packed: bool = False,
                        narrow: bool = False) -> bool:
    """Whether the generated GEMM beats BLAS for op(A)[m×k] · op(B)[k×n] (leading
    dimensions lda, ldb) on this machine; with `packed`, the generated GEMM on a B packed
    ahead of time (`sgemm.pack_panels`: a constant's) against BLAS on the plain B; with
    `narrow` as well, on that B's panels in bf16 against BLAS on the float32 B.

    A product over the measuring budget is timed on its first columns, at least
    `_FEWEST_BLOCKS` blocks of B, with every row and all of k (both GEMMs
    go through B a block of columns at a time, so the rest repeats what was timed).
    Fewer columns would not show how the whole streams C and A through memory (a 2048 ×
    16000 LM-head block timed as 1213 × 384 chose wrongly): such a product stays on BLAS."""
    fixed = os.environ.get(GEMM_ENVIRONMENT, "")
    if fixed in ("generated", "blas"):
        return fixed == "generated"
    if fixed:
        raise RanvierError(f"${GEMM_ENVIRONMENT}={fixed!r}: expected 'generated' or 'blas' (or unset, to measure)")
    if 2 * m * n * k > _MEASURED_FLOPS:
        block = sgemm.block_columns(host_target(), packed)
        columns = _MEASURED_FLOPS // (2 * m * k) // block * block
        if columns < _FEWEST_BLOCKS * block:
            return False
        n, ldb = columns, (ldb if tb else columns)
    return _decide(bool(ta), bool(tb), m, n, k, lda, ldb, packed, narrow)


@functools.cache
def _decide(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, packed: bool, narrow: bool) -> bool:
    form = "bf16 packed " if narrow else "packed " if packed else ""
    key = f"{form}{'T' if ta else 'N'}{'T' if tb else 'N'} {m}x{n}x{k} lda {lda} ldb {ldb}"
    # kept per machine, per generated GEMM and per way of measuring: a change to either measures anew
    identity = f"{host_target().key()}\n{sgemm.gemm_code(host_target()).digest}\n{_METHOD}"
    with kept(kept_path("gemm", identity)) as choices:
        if choices is not None and isinstance(choices.get(key), bool):
            return choices[key]
        faster = _measure(ta, tb, m, n, k, lda, ldb, packed, narrow)
        if choices is not None:
            choices[key] = faster
        return faster


def _measure(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, packed: bool, narrow: bool = False) -> bool:
    target = host_target()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, lda) if ta else (m, lda), dtype=np.float32)
    b = rng.standard_normal((n, ldb) if tb else (k, ldb), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    workspace = np.empty(sgemm.workspace_bytes(n, k), np.uint8)
    generated = sgemm.GEMM_CTYPE(sgemm.gemm_address(target))
    blas = _FORTRAN_SGEMM(blas_pointers()[0])
    ctypes.CFUNCTYPE(None, ctypes.c_int)(blas_thread_setter())(1)
    refs = [ctypes.byref(ctypes.c_int(v)) for v in (n, m, k, ldb, lda, n)]
    one, zero = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))
    flags = (b"T" if tb else b"N", b"T" if ta else b"N")  # row-major C = column-major Cᵀ = op(B)ᵀ·op(A)ᵀ

    if packed:
        panels = sgemm.pack_panels(b[:, :k] if tb else b[:, :n], tb, target, narrow=narrow)
        on_panels = sgemm.PACKED_CTYPE(sgemm.packed_gemm_address(target, narrow))

        def ours() -> None:
            on_panels(int(ta), m, n, k, a.ctypes.data, lda, panels.ctypes.data, c.ctypes.data, n)
    else:

        def ours() -> None:
            generated(int(ta), int(tb), m, n, k, a.ctypes.data, lda, b.ctypes.data, ldb, c.ctypes.data, n, workspace.ctypes.data)

    def theirs() -> None:
        blas(*flags, *refs[:3], one, b.ctypes.data, refs[3], a.ctypes.data, refs[4], zero, c.ctypes.data, refs[5])

    def seconds(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    ours(), theirs()  # first touches of C and the workspace, outside the timing
    ratios = []
    for round_ in range(_ROUNDS):
        if round_ % 2:
            theirs_seconds, ours_seconds = seconds(theirs), seconds(ours)
        else:
            ours_seconds, theirs_seconds = seconds(ours), seconds(theirs)
        ratios.append(ours_seconds / theirs_seconds)
    return statistics.median(ratios) < 1.0
