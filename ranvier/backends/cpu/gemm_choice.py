"""Which float32 GEMM computes a product of a given shape: the generated one (sgemm.py)
or the vendor BLAS, whichever measured faster here for that shape and those leading
dimensions on one thread, the way a worker-pool part runs it; and, for a product whose
precision lets its inputs be rounded to bfloat16, whether the generated GEMM on bf16 pairs
beats that float32 choice (a convolution's too: its windows or Winograd's transformed tiles
on pairs against them in float32). Each is measured once per machine and the choice kept
(measured.py) where the machine was quiet as it was measured (`_quiet`); a product too large
to time quickly is timed on a corner of it (`_corner`);
`RANVIER_GEMM=generated` or `=blas` fixes the choice instead."""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import time

import numpy as np

from ...errors import RanvierError
from ..measured import kept, kept_path
from . import sgemm
from .blas import blas_pointers, blas_thread_setter
from .target import host_target

GEMM_ENVIRONMENT = "RANVIER_GEMM"
_MEASURED_FLOPS = 1 << 29  # a larger product is timed on a corner of it (this takes ~7 ms)
_CORNER_FLOPS = 1 << 32  # the most a corner is timed on (~25 ms a run on bf16 pairs)
_FEWEST_BLOCKS = 4  # of B's columns, for a product timed on its first columns
# The two run in pairs, each going first in every other pair; the median of the pairs'
# time ratios decides. Each one's fastest run of 15 kept a choice that later measured 10%
# the wrong way (an MoE's expert weight gradients on BLAS, its step 3% slower): a pair
# shares the host's passing state, two fastest runs need not.
_ROUNDS = 15
# A choice measured while other processes wanted the cores is this process's but is not
# kept: their load lands on one GEMM's runs more than the other's (GPT-2's 3072 -> 768
# products kept BLAS measured on a shared machine, and ran 1.25 times as long as the
# generated GEMM's there once quiet). A later process measures it again, and keeps a quiet
# measurement; choices kept before this rule are measured anew (the method is in their key).
_METHOD = "median of paired ratios, kept where measured with a load below the cores"

_INT, _FLOAT = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
_FORTRAN_SGEMM = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, _INT, _INT, _INT, _FLOAT, ctypes.c_void_p, _INT,
                                  ctypes.c_void_p, _INT, _FLOAT, ctypes.c_void_p, _INT)


def generated_is_faster(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, packed: bool = False,
                        narrow: bool = False) -> bool:
    """Whether the generated GEMM beats BLAS for op(A)[m×k] · op(B)[k×n] (leading
    dimensions lda, ldb) on this machine; with `packed`, the generated GEMM on a B packed
    ahead of time (`sgemm.pack_panels`: a constant's) against BLAS on the plain B; with
    `narrow` as well, on that B's panels in bf16 against BLAS on the float32 B. A product
    over the measuring budget is timed on a corner of it (`_corner`)."""
    fixed = _fixed_choice()
    if fixed is not None:
        return fixed
    return _decide(bool(ta), bool(tb), *_corner(m, n, k, packed, sgemm.KC), lda, ldb, packed, narrow)


def _corner(m: int, n: int, k: int, packed: bool, depth: int) -> tuple[int, int, int]:
    """The corner of op(A)[m×k] · op(B)[k×n] a product over `_MEASURED_FLOPS` is timed on:
    its first columns, as many as that budget gives with every row and all of k but at
    least `_FEWEST_BLOCKS` blocks of B (both GEMMs go through B a block of columns at a
    time, so the rest repeats what was timed; fewer columns would not show how the whole
    streams C and A through memory: a 2048 × 16000 LM-head block timed as 1213 × 384 chose
    wrongly); then, where that is still over `_CORNER_FLOPS`, its first blocks of k
    (`depth` steps each) and its first rows. A large product (a batch's, an LM head's) is
    where the choice matters most, and its blocks repeat what was timed."""
    if 2 * m * n * k <= _MEASURED_FLOPS:
        return m, n, k
    block = sgemm.block_columns(host_target(), packed)
    n = min(n, max(_MEASURED_FLOPS // (2 * m * k) // block, _FEWEST_BLOCKS) * block)
    k = min(k, max(1, _CORNER_FLOPS // (2 * m * n) // depth) * depth)
    m = min(m, max(sgemm.tile_shape(host_target())[0], _CORNER_FLOPS // (2 * n * k)))
    return m, n, k


def _fixed_choice() -> bool | None:
    """Whether $RANVIER_GEMM fixes the generated GEMM (True) or BLAS (False); None: measure."""
    fixed = os.environ.get(GEMM_ENVIRONMENT, "")
    if fixed in ("generated", "blas"):
        return fixed == "generated"
    if fixed:
        raise RanvierError(f"${GEMM_ENVIRONMENT}={fixed!r}: expected 'generated' or 'blas' (or unset, to measure)")
    return None


@functools.cache
def _decide(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, packed: bool, narrow: bool) -> bool:
    form = "bf16 packed " if narrow else "packed " if packed else ""
    ours = "bf16 packed" if narrow else "packed" if packed else "generated"
    return _kept_or_measured(f"{form}{'T' if ta else 'N'}{'T' if tb else 'N'} {m}x{n}x{k} lda {lda} ldb {ldb}",
                             lambda: _first_is_faster(*_runners(ta, tb, m, n, k, lda, ldb, [ours, "blas"])))


def _kept_or_measured(key: str, measure) -> bool:
    """The choice kept under `key`, else `measure()`'s, then kept: per machine, per generated
    GEMM and per way of measuring (a change to either measures anew)."""
    identity = f"{host_target().key()}\n{sgemm.gemm_code(host_target()).digest}\n{_METHOD}"
    with kept(kept_path("gemm", identity)) as choices:
        if choices is not None and isinstance(choices.get(key), bool):
            return choices[key]
        faster = measure()
        if choices is not None and _quiet():
            choices[key] = faster
        return faster


def _quiet() -> bool:
    """Whether the machine's load (runnable threads, averaged over the last minute, this
    measurement's included) stayed below its cores: no other process competed for them."""
    return os.getloadavg()[0] < (os.cpu_count() or 1)


def pairs_are_faster(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, packed: bool = False) -> bool:
    """Whether the GEMM on bf16 pairs (`vdpbf16ps`, on `sgemm.pairs_supported` targets) beats
    the float32 GEMM the product takes otherwise (the generated one or BLAS, as
    `generated_is_faster` chooses) for op(A)[m×k] · op(B)[k×n]; with `packed`, B packed
    ahead of time (a constant's) for both generated GEMMs. A product over the measuring
    budget is timed on a corner of it (`_corner`), the float32 choice on the same corner.
    $RANVIER_GEMM=generated takes the pairs, =blas stays on float32 BLAS."""
    fixed = _fixed_choice()
    if fixed is not None:
        return fixed
    return _decide_pairs(bool(ta), bool(tb), *_corner(m, n, k, packed, sgemm.PAIRS_KC), lda, ldb, packed)


@functools.cache
def _decide_pairs(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, packed: bool) -> bool:
    float32 = ("packed" if packed else "generated") if generated_is_faster(ta, tb, m, n, k, lda, ldb, packed) else "blas"
    key = f"pairs{' packed' if packed else ''} against {float32} {'T' if ta else 'N'}{'T' if tb else 'N'} {m}x{n}x{k} lda {lda} ldb {ldb}"
    return _kept_or_measured(key, lambda: _first_is_faster(
        *_runners(ta, tb, m, n, k, lda, ldb, ["pair panels" if packed else "pairs", float32])))


def packed_pairs_are_faster(m: int, n: int, k: int) -> bool:
    """Whether the GEMM on B's panels in bf16 pairs beats the one on its float32 panels for
    A[m×k] (rows k apart) · B[k×n], B packed as it is made (Winograd's transformed tiles: its
    products take the GEMM on panels either way); $RANVIER_GEMM=generated takes the pairs,
    =blas stays on float32."""
    fixed = _fixed_choice()
    if fixed is not None:
        return fixed
    return _decide_packed_pairs(*_corner(m, n, k, True, sgemm.PAIRS_KC))


@functools.cache
def _decide_packed_pairs(m: int, n: int, k: int) -> bool:
    return _kept_or_measured(f"pair panels against panels NN {m}x{n}x{k} lda {k}",
                             lambda: _first_is_faster(*_runners(False, False, m, n, k, k, n, ["pair panels", "packed"])))


def windows_pairs_are_faster(m: int, n: int, k: int, geometry: tuple[int, ...]) -> bool:
    """Whether a convolution's GEMM on its windows in bf16 pairs (`ranvier_sgemm_windows_dpbf16`,
    on `sgemm.pairs_supported` targets) beats the one in float32 for a call of m filters by n
    output positions over k taps, its image's `geometry` (`sgemm.GEOMETRY`'s values);
    $RANVIER_GEMM=generated takes the pairs, =blas stays on float32."""
    fixed = _fixed_choice()
    if fixed is not None:
        return fixed
    return _decide_windows_pairs(m, n, k, tuple(geometry))


@functools.cache
def _decide_windows_pairs(m: int, n: int, k: int, geometry: tuple[int, ...]) -> bool:
    key = f"pair windows against windows {m}x{n}x{k} geometry {' '.join(map(str, geometry))}"
    return _kept_or_measured(key, lambda: _first_is_faster(*_windows_runners(m, n, k, geometry)))


def _windows_runners(m: int, n: int, k: int, geometry: tuple[int, ...]) -> list:
    """A call of the windows GEMM on bf16 pairs and one in float32 on the same random filters
    and image, from its first output position, on this thread."""
    target = host_target()
    size = dict(zip(sgemm.GEOMETRY, geometry))
    rng = np.random.default_rng(0)
    channels = k // (size["kernel_height"] * size["kernel_width"]) * size["phases"] ** 2  # phase planes
    image = rng.standard_normal((channels, size["height"], size["width"]), dtype=np.float32)
    filters = rng.standard_normal((m, k), dtype=np.float32)
    shape = np.array(geometry, np.int64)
    c = np.empty((m, n), np.float32)
    workspace = np.empty(sgemm.workspace_bytes(n, k), np.uint8)

    def runner(pairs: bool):
        gemm = sgemm.WINDOWS_CTYPE(sgemm.windows_gemm_address(target, pairs))
        return lambda: gemm(m, n, k, filters.ctypes.data, k, image.ctypes.data, shape.ctypes.data, 0, c.ctypes.data, n,
                            workspace.ctypes.data)

    return [runner(True), runner(False)]


def _runners(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, kinds: list[str]) -> list:
    """A call of each of `kinds` of GEMM on the same random operands, on this thread:
    "blas", "generated", "packed" (on B packed ahead of time), "bf16 packed" (on its bf16
    panels), "pairs" (on bf16 pairs, B packed as it goes) or "pair panels" (on B's bf16
    pairs packed ahead of time)."""
    target = host_target()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, lda) if ta else (m, lda), dtype=np.float32)
    b = rng.standard_normal((n, ldb) if tb else (k, ldb), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    workspace = np.empty(sgemm.workspace_bytes(n, k), np.uint8)
    op_b = b[:, :k] if tb else b[:, :n]

    def on_matrix(address: int):
        gemm = sgemm.GEMM_CTYPE(address)
        return lambda: gemm(int(ta), int(tb), m, n, k, a.ctypes.data, lda, b.ctypes.data, ldb, c.ctypes.data, n,
                            workspace.ctypes.data)

    def on_panels(narrow: bool = False, pairs: bool = False):
        panels = sgemm.pack_panels(op_b, tb, target, narrow=narrow, pairs=pairs)
        gemm = sgemm.PACKED_CTYPE(sgemm.packed_gemm_address(target, narrow, pairs))
        return lambda: gemm(int(ta), m, n, k, a.ctypes.data, lda, panels.ctypes.data, c.ctypes.data, n)

    def on_blas():
        blas = _FORTRAN_SGEMM(blas_pointers()[0])
        ctypes.CFUNCTYPE(None, ctypes.c_int)(blas_thread_setter())(1)
        refs = [ctypes.byref(ctypes.c_int(v)) for v in (n, m, k, ldb, lda, n)]
        one, zero = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))
        flags = (b"T" if tb else b"N", b"T" if ta else b"N")  # row-major C = column-major Cᵀ = op(B)ᵀ·op(A)ᵀ
        return lambda: blas(*flags, *refs[:3], one, b.ctypes.data, refs[3], a.ctypes.data, refs[4], zero, c.ctypes.data,
                            refs[5])

    makers = {"blas": on_blas, "generated": lambda: on_matrix(sgemm.gemm_address(target)), "packed": on_panels,
              "bf16 packed": lambda: on_panels(narrow=True), "pairs": lambda: on_matrix(sgemm.pairs_gemm_address(target)),
              "pair panels": lambda: on_panels(pairs=True)}
    return [makers[kind]() for kind in kinds]


def _first_is_faster(ours, theirs) -> bool:
    """Whether `ours` takes less time than `theirs`: the median of `_ROUNDS` paired ratios."""

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
