"""Which float32 GEMM computes a product of a given shape: the generated one (sgemm.py)
or the vendor BLAS, whichever measured faster here for that shape on one thread, the
way a worker-pool part runs it. Each shape is measured once per machine and the choice
kept (measured.py); `RANVIER_GEMM=generated` or `=blas` fixes it instead."""

from __future__ import annotations

import ctypes
import functools
import os
import time

import numpy as np

from ...errors import RanvierError
from . import sgemm
from .blas import blas_pointers, blas_thread_setter
from .measured import kept, kept_path
from .target import host_target

GEMM_ENVIRONMENT = "RANVIER_GEMM"
_MEASURED_FLOPS = 1 << 28  # a larger product is measured on part of it (~5 ms)
_ROUNDS = 5  # the two alternate; each one's fastest run counts

_INT, _FLOAT = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
_FORTRAN_SGEMM = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, _INT, _INT, _INT, _FLOAT, ctypes.c_void_p, _INT,
                                  ctypes.c_void_p, _INT, _FLOAT, ctypes.c_void_p, _INT)


def generated_is_faster(ta: bool, tb: bool, m: int, n: int, k: int) -> bool:
    """Whether the generated GEMM beats BLAS for op(A)[m×k] · op(B)[k×n] on this machine."""
    fixed = os.environ.get(GEMM_ENVIRONMENT, "")
    if fixed in ("generated", "blas"):
        return fixed == "generated"
    if fixed:
        raise RanvierError(f"${GEMM_ENVIRONMENT}={fixed!r}: expected 'generated' or 'blas' (or unset, to measure)")
    return _decide(bool(ta), bool(tb), m, n, k)


@functools.cache
def _decide(ta: bool, tb: bool, m: int, n: int, k: int) -> bool:
    key = f"{'T' if ta else 'N'}{'T' if tb else 'N'} {m}x{n}x{k}"
    with kept(kept_path("gemm", host_target().key())) as choices:
        if choices is not None and isinstance(choices.get(key), bool):
            return choices[key]
        faster = _measure(ta, tb, m, n, k)
        if choices is not None:
            choices[key] = faster
        return faster


def _measure(ta: bool, tb: bool, m: int, n: int, k: int) -> bool:
    target = host_target()
    # A large product is measured on fewer of its columns (down to one packed block of B),
    # then of its rows: a row strip's work, which depends on m, is what differs most.
    columns = min(n, max(sgemm.block_columns(target), _MEASURED_FLOPS // max(1, 2 * m * k)))
    rows = min(m, max(4 * sgemm.MR, _MEASURED_FLOPS // max(1, 2 * columns * k)))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, rows) if ta else (rows, k), dtype=np.float32)
    b = rng.standard_normal((columns, k) if tb else (k, columns), dtype=np.float32)
    c = np.empty((rows, columns), np.float32)
    workspace = np.empty(sgemm.workspace_bytes(columns, k), np.uint8)
    lda, ldb = a.shape[1], b.shape[1]
    generated = sgemm.GEMM_CTYPE(sgemm.gemm_address(target))
    blas = _FORTRAN_SGEMM(blas_pointers()[0])
    ctypes.CFUNCTYPE(None, ctypes.c_int)(blas_thread_setter())(1)
    refs = [ctypes.byref(ctypes.c_int(v)) for v in (columns, rows, k, ldb, lda, columns)]
    one, zero = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))
    flags = (b"T" if tb else b"N", b"T" if ta else b"N")  # row-major C = column-major Cᵀ = op(B)ᵀ·op(A)ᵀ

    def ours() -> None:
        generated(int(ta), int(tb), rows, columns, k, a.ctypes.data, lda, b.ctypes.data, ldb, c.ctypes.data, columns,
                  workspace.ctypes.data)

    def theirs() -> None:
        blas(*flags, *refs[:3], one, b.ctypes.data, refs[3], a.ctypes.data, refs[4], zero, c.ctypes.data, refs[5])

    def seconds(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    times = [(seconds(ours), seconds(theirs)) for _ in range(_ROUNDS)]
    return min(t for t, _ in times) < min(t for _, t in times)
