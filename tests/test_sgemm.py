"""ranvier's generated float32 GEMM (backends/cpu/sgemm.py) against float64 numpy, for each
vector variant, every shape class (edges of the tile, of k's slices and of B's blocks,
transposes, leading dimensions wider than the matrix, empty sums), and nothing outside C
written (and the adding GEMM's C += op(A)·op(B)); the per-shape choice between it and BLAS, measured once and kept; the GEMM on B packed
ahead of time (a constant's panels); the GEMMs on bf16 pairs (AVX512-BF16's vdpbf16ps), against
float64 on the bf16-rounded operands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_within_bound

from ranvier.backends.cpu import sgemm
from ranvier.backends.cpu.target import host_target

ROOT = Path(__file__).resolve().parent.parent
MASKS = ["", "-avx512", "-avx512,-avx2"]

SHAPES = [
    (1, 1, 1), (5, 3, 2),  # smaller than one tile
    (6, 16, 7), (12, 32, 256), (6, 8, 256),  # whole tiles (of AVX2; of SSE; a whole slice of k)
    (13, 33, 300),  # a row strip and a panel left over, two slices of k
    (37, 70, 513),  # three slices of k, the last of one step
    (9, 800, 40),  # columns over several packed blocks of B
    (21, 290, 600),  # several blocks and slices: the next block's lines asked for across both
    (64, 20, 1),
    (13, 40, 1021),  # A's rows 4 KiB apart (lda 1024): its strips are copied, as transposed ones are
    (7, 9, 0),  # an empty sum: C is zeros
    (11, 49, 530),  # a last panel of one column (of 24, 12): dot products along k, with a tail of k
    (10, 52, 200),  # a last panel of four columns (of 24, 12)
]


def _operands(m, n, k, ta, tb, pad, rng):
    """A, B with leading dimensions `pad` wider than their rows; C inside a NaN frame."""
    a_rows, a_cols = (k, m) if ta else (m, k)
    b_rows, b_cols = (n, k) if tb else (k, n)
    a = rng.standard_normal((a_rows, a_cols + pad)).astype(np.float32)
    b = rng.standard_normal((b_rows, b_cols + pad)).astype(np.float32)
    c = np.full((m + 1, n + pad + 1), np.nan, np.float32)
    return a, b, c


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_generated_gemm_matches_float64_numpy_and_writes_only_c(shape, ta, tb, mask):
    m, n, k = shape
    target = host_target(mask)
    gemm = sgemm.GEMM_CTYPE(sgemm.gemm_address(target))
    rng = np.random.default_rng(m * 10_000 + n * 100 + k)
    pad = 3
    a, b, c = _operands(m, n, k, ta, tb, pad, rng)
    workspace = np.empty(sgemm.workspace_bytes(n, k), np.uint8)
    gemm(int(ta), int(tb), m, n, k, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], c.ctypes.data, c.shape[1],
         workspace.ctypes.data)
    op_a = a[:, : a.shape[1] - pad].astype(np.float64)
    op_b = b[:, : b.shape[1] - pad].astype(np.float64)
    want = (op_a.T if ta else op_a) @ (op_b.T if tb else op_b)
    got = c[:m, :n]
    assert np.isfinite(got).all(), "every element of C written"
    assert_within_bound(got, want, np.abs(op_a.T if ta else op_a) @ np.abs(op_b.T if tb else op_b), 1e-6)
    frame = c.copy()
    frame[:m, :n] = 0
    assert np.isnan(frame[m:]).all() and np.isnan(frame[:, n:]).all(), "nothing outside C written"


@pytest.mark.parametrize("mask", [*MASKS, "-avx512bf16"])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_adding_gemm_adds_to_c_and_writes_nothing_else(shape, ta, tb, mask):
    """ranvier_sgemm_add: C += op(A)·op(B), each slice of k and block of B added to what C
    held (an empty sum leaves it as it was); outside C the NaN frame stays."""
    m, n, k = shape
    gemm = sgemm.GEMM_CTYPE(sgemm.add_gemm_address(host_target(mask)))
    rng = np.random.default_rng(m * 10_000 + n * 100 + k + 1)
    pad = 3
    a, b, c = _operands(m, n, k, ta, tb, pad, rng)
    before = rng.standard_normal((m, n)).astype(np.float32)
    c[:m, :n] = before
    workspace = np.empty(sgemm.workspace_bytes(n, k), np.uint8)
    gemm(int(ta), int(tb), m, n, k, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], c.ctypes.data, c.shape[1],
         workspace.ctypes.data)
    op_a = a[:, : a.shape[1] - pad].astype(np.float64)
    op_b = (b[:, : b.shape[1] - pad].astype(np.float64).T if tb else b[:, : b.shape[1] - pad].astype(np.float64))
    want = before + op_a @ op_b
    bound = np.abs(before) + np.abs(op_a) @ np.abs(op_b)
    got = c[:m, :n]
    assert_within_bound(got, want, bound, 1e-6)
    frame = c.copy()
    frame[:m, :n] = 0
    assert np.isnan(frame[m:]).all() and np.isnan(frame[:, n:]).all(), "nothing outside C written"


@pytest.mark.parametrize("narrow", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("shape", [*SHAPES, (1, 70, 1100), (1, 800, 40), (2, 11, 530)])  # a decode step's one row
def test_the_gemm_on_packed_panels_matches_float64_numpy_and_writes_only_c(shape, ta, tb, mask, narrow):
    """ranvier_sgemm_packed, B packed ahead of time (a constant's weights), from its first
    panel and from a later one (a worker-pool part's columns); `narrow`: its bf16 twin,
    against B rounded to bf16 (A and the sums stay float32)."""
    m, n, k = shape
    target = host_target(mask)
    gemm = sgemm.PACKED_CTYPE(sgemm.packed_gemm_address(target, narrow))
    rng = np.random.default_rng(m * 10_000 + n * 100 + k + 1)
    pad = 3
    a, b, c = _operands(m, n, k, ta, tb, pad, rng)
    op_b = b[:, : b.shape[1] - pad]
    panels = sgemm.pack_panels(op_b, tb, target, narrow=narrow)
    assert panels.size == 0 or panels.ctypes.data % sgemm.PANEL_ALIGNMENT == 0
    nr = sgemm.panel_width(target)
    first = nr if n > nr else 0
    gemm(int(ta), m, n - first, k, a.ctypes.data, a.shape[1], panels.ctypes.data + first * k * panels.itemsize, c.ctypes.data,
         c.shape[1])
    op_a = a[:, : a.shape[1] - pad].astype(np.float64)
    wide = (op_b.astype(ml_dtypes.bfloat16) if narrow else op_b).astype(np.float64)
    want = ((op_a.T if ta else op_a) @ (wide.T if tb else wide))[:, first:]
    got = c[:m, : n - first]
    assert np.isfinite(got).all(), "every element of C written"
    assert_within_bound(got, want, np.abs(op_a.T if ta else op_a) @ np.abs(wide.T if tb else wide)[:, first:], 1e-6)
    frame = c.copy()
    frame[:m, : n - first] = 0
    assert np.isnan(frame[m:]).all() and np.isnan(frame[:, n - first :]).all(), "nothing outside C written"


needs_pairs = pytest.mark.skipif(not sgemm.pairs_supported(host_target()), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")
PAIR_SHAPES = [*SHAPES, (8, 48, 2), (3, 50, 3),  # a whole tile of one pair; an odd k: its last pair padded
               (20, 100, 1100), (17, 1000, 515),  # three slices of k (even ones, then one of 76); blocks of columns
               (9, 97, 75)]  # a last panel of one column after two (dot products of pairs), an odd k


@needs_pairs
@pytest.mark.parametrize("packed", [False, True, "paired"], ids=["matrix", "panels", "panels-paired-a"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("shape", PAIR_SHAPES)
def test_the_gemm_on_bf16_pairs_matches_float64_on_the_rounded_operands_and_writes_only_c(shape, ta, tb, packed):
    """ranvier_sgemm_dpbf16 (B packed into pairs a block at a time) and
    ranvier_sgemm_packed_dpbf16 (B's pairs packed ahead of time, called from its first panel
    and from a later one), and ranvier_sgemm_packed_dpbf16_paired (A's pairs too, rounded
    ahead of time by `sgemm.paired_rows`): both operands rounded to bf16 to nearest even,
    float32 sums."""
    m, n, k = shape
    if packed == "paired" and ta:
        pytest.skip("paired rows of A are never transposed")
    target = host_target()
    rng = np.random.default_rng(m * 10_000 + n * 100 + k + 2)
    pad = 3
    a, b, c = _operands(m, n, k, ta, tb, pad, rng)
    op_b = b[:, : b.shape[1] - pad]
    nr = sgemm.panel_width(target)
    first = nr if packed and n > nr else 0
    if packed:
        panels = sgemm.pack_panels(op_b, tb, target, pairs=True)
        assert panels.size == 0 or panels.ctypes.data % sgemm.PANEL_ALIGNMENT == 0
        paired = packed == "paired"
        gemm = sgemm.PACKED_CTYPE(sgemm.packed_gemm_address(target, pairs=True, paired_a=paired))
        rows, lda = (sgemm.paired_rows(a[:, : a.shape[1] - pad]), sgemm.paired_row_slots(k)) if paired else (a, a.shape[1])
        gemm(int(ta), m, n - first, k, rows.ctypes.data, lda, panels.ctypes.data + first * (k + k % 2) * panels.itemsize,
             c.ctypes.data, c.shape[1])
    else:
        gemm = sgemm.GEMM_CTYPE(sgemm.pairs_gemm_address(target))
        workspace = np.empty(sgemm.workspace_bytes(n, k), np.uint8)
        gemm(int(ta), int(tb), m, n, k, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], c.ctypes.data, c.shape[1],
             workspace.ctypes.data)
    op_a = a[:, : a.shape[1] - pad].astype(ml_dtypes.bfloat16).astype(np.float64)
    op_a = op_a.T if ta else op_a
    wide = op_b.astype(ml_dtypes.bfloat16).astype(np.float64)
    wide = (wide.T if tb else wide)[:, first:]
    got = c[:m, : n - first]
    assert np.isfinite(got).all(), "every element of C written"
    assert_within_bound(got, op_a @ wide, np.abs(op_a) @ np.abs(wide), 1e-5)  # float32 sums of exact products of bf16
    frame = c.copy()
    frame[:m, : n - first] = 0
    assert np.isnan(frame[m:]).all() and np.isnan(frame[:, n - first :]).all(), "nothing outside C written"


def test_packed_panels_hold_op_b_by_columns_of_nr_zeros_past_each_range():
    target = host_target()
    nr = sgemm.panel_width(target)
    b = np.random.default_rng(0).standard_normal((7, 2 * nr + 3)).astype(np.float32)
    for transposed, source in [(False, b), (True, np.ascontiguousarray(b.T))]:
        whole = sgemm.pack_panels(source, transposed, target).reshape(-1, 7, nr)
        assert whole.shape == (3, 7, nr)
        np.testing.assert_array_equal(whole[1], b[:, nr : 2 * nr])
        np.testing.assert_array_equal(whole[2, :, :3], b[:, 2 * nr :])
        assert not whole[2, :, 3:].any()
        # two calls' columns, the first ending inside a panel: each range starts a panel
        ranges = [(0, nr + 1), (nr + 1, 2 * nr + 3)]
        split = sgemm.pack_panels(source, transposed, target, ranges)
        assert split.size == sum(sgemm.panels_size(last - first, 7, target) for first, last in ranges)
        first, second = split[: 2 * nr * 7].reshape(2, 7, nr), split[2 * nr * 7 :].reshape(-1, 7, nr)
        np.testing.assert_array_equal(first[1, :, :1], b[:, nr : nr + 1])
        np.testing.assert_array_equal(second[0], b[:, nr + 1 : 2 * nr + 1])
        assert split.ctypes.data % sgemm.PANEL_ALIGNMENT == 0
        narrow = sgemm.pack_panels(source, transposed, target, ranges, narrow=True)
        assert narrow.dtype == ml_dtypes.bfloat16 and narrow.ctypes.data % sgemm.PANEL_ALIGNMENT == 0
        np.testing.assert_array_equal(narrow, split.astype(ml_dtypes.bfloat16))  # rounded to nearest, ties to even


def test_the_workspace_fits_every_variant():
    """workspace_bytes is sized for the widest panel: every variant's block fits."""
    for mask in MASKS:
        nr = sgemm.panel_width(host_target(mask))
        for n, k in [(1, 1), (33, 300), (800, 40), (5000, 5000)]:
            block = min(-(-n // nr) * nr, sgemm.block_columns(host_target(mask))) * min(k, sgemm.KC) * 4
            assert block + 64 <= sgemm.workspace_bytes(n, k)


# the machine taken as quiet as each choice is measured, so that it is kept (`_quiet`)
_AS_QUIET = "import ranvier.backends.cpu.gemm_choice as choice; choice._quiet = lambda: True\n"
_CHOICE_SCRIPT = _AS_QUIET + """
from ranvier.backends.cpu.gemm_choice import generated_is_faster
print(generated_is_faster(False, True, 128, 96, 200, 200, 200), generated_is_faster(False, False, 48, 64, 80, 80, 64),
      generated_is_faster(False, False, 4096, 4096, 4096, 4096, 4096), generated_is_faster(True, True, 40, 50, 60, 40, 60, True),
      generated_is_faster(False, True, 128, 50000, 768, 768, 768, True),
      generated_is_faster(False, False, 1, 96, 300, 300, 96, True, True))
"""


@pytest.mark.slow
def test_the_choice_is_measured_once_and_kept(tmp_path):
    env = dict(os.environ, RANVIER_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("RANVIER_GEMM", None)
    first = subprocess.run([sys.executable, "-c", _CHOICE_SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    (kept,) = tmp_path.glob("gemm-*.json")
    # a product too large to time quickly is timed on its first columns (an LM head's
    # blocks of B) or, where that would leave too few of them, on a corner of at least four
    # blocks of columns, its first blocks of k and its first rows
    block = sgemm.block_columns(host_target(), packed=True)
    columns = (1 << 29) // (2 * 128 * 768) // block * block
    square_columns = 4 * sgemm.block_columns(host_target())
    square_depth = (1 << 32) // (2 * 4096 * square_columns) // sgemm.KC * sgemm.KC
    assert set(json.loads(kept.read_text())) == {"NT 128x96x200 lda 200 ldb 200", "NN 48x64x80 lda 80 ldb 64",
                                                 f"NN 4096x{square_columns}x{square_depth} lda 4096 ldb 4096",
                                                 "packed TT 40x50x60 lda 40 ldb 60", f"packed NT 128x{columns}x768 lda 768 ldb 768",
                                                 "bf16 packed NN 1x96x300 lda 300 ldb 96"}
    again = subprocess.run([sys.executable, "-c", _CHOICE_SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    assert again == first
    forced = subprocess.run([sys.executable, "-c", _CHOICE_SCRIPT], env=dict(env, RANVIER_GEMM="blas"), capture_output=True,
                            text=True, check=True).stdout
    assert forced.split() == ["False"] * 6


_PAIRS_CHOICE_SCRIPT = _AS_QUIET + """
from ranvier.backends.cpu.gemm_choice import packed_pairs_are_faster, pairs_are_faster, windows_pairs_are_faster
print(pairs_are_faster(False, False, 64, 96, 128, 128, 96), pairs_are_faster(False, True, 2048, 32000, 288, 288, 288, True),
      pairs_are_faster(False, False, 2048, 288, 32000, 32000, 288), windows_pairs_are_faster(64, 400, 576, (20, 20, 3, 3, 1, 1, 1, 1, 20, 1)),
      packed_pairs_are_faster(128, 196, 128))
"""


@needs_pairs
@pytest.mark.slow
def test_the_choice_of_pairs_is_measured_against_the_float32_choice_and_kept(tmp_path):
    """Each product's pairs against the float32 GEMM it would take (its own choice, measured
    first), kept; a large one (an LM head's, and its gradient's) timed on a corner of at
    least four blocks of columns and within the budget along k and rows; a convolution's
    windows on pairs against its float32 windows, and Winograd's pair panels against float32
    panels, kept too."""
    env = dict(os.environ, RANVIER_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("RANVIER_GEMM", None)
    first = subprocess.run([sys.executable, "-c", _PAIRS_CHOICE_SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    (kept,) = tmp_path.glob("gemm-*.json")
    keys = [key for key in json.loads(kept.read_text()) if key.startswith("pair")]
    block = sgemm.block_columns(host_target(), packed=True)
    depth = (1 << 32) // (2 * 2048 * 288) // sgemm.PAIRS_KC * sgemm.PAIRS_KC
    assert len(keys) == 5
    assert "pair windows against windows 64x400x576 geometry 20 20 3 3 1 1 1 1 20 1" in keys
    assert "pair panels against panels NN 128x196x128 lda 128" in keys
    assert any(re.fullmatch(r"pairs against (generated|blas) NN 64x96x128 lda 128 ldb 96", key) for key in keys), keys
    assert any(re.fullmatch(rf"pairs against (generated|blas) NN 2048x288x{depth} lda 32000 ldb 288", key) for key in keys), keys
    assert any(re.fullmatch(rf"pairs packed against (packed|blas) NT 2048x{4 * block}x288 lda 288 ldb 288", key) for key in keys)
    again = subprocess.run([sys.executable, "-c", _PAIRS_CHOICE_SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    assert again == first
    forced = subprocess.run([sys.executable, "-c", _PAIRS_CHOICE_SCRIPT], env=dict(env, RANVIER_GEMM="blas"), capture_output=True,
                            text=True, check=True).stdout
    assert forced.split() == ["False"] * 5


def test_a_choice_measured_under_load_is_used_but_not_kept(tmp_path, monkeypatch):
    """A choice measured while the load average reached the cores is returned, not kept: the
    next process measures it again; measured quiet, it is kept and read back unmeasured."""
    from ranvier.backends.cpu import gemm_choice

    monkeypatch.setenv("RANVIER_CACHE", str(tmp_path))
    measured = []

    def measure() -> bool:
        measured.append(True)
        return True

    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 0.5, cores, cores))
    assert gemm_choice._kept_or_measured("NN 8x8x8 lda 8 ldb 8", measure) is True
    assert not any(json.loads(path.read_text()) for path in tmp_path.glob("gemm-*.json"))
    monkeypatch.setattr(os, "getloadavg", lambda: (cores - 0.5, cores, cores))
    assert gemm_choice._kept_or_measured("NN 8x8x8 lda 8 ldb 8", measure) is True
    assert gemm_choice._kept_or_measured("NN 8x8x8 lda 8 ldb 8", measure) is True
    assert len(measured) == 2
    (kept,) = tmp_path.glob("gemm-*.json")
    assert json.loads(kept.read_text()) == {"NN 8x8x8 lda 8 ldb 8": True}


def test_a_wrong_gemm_setting_is_named(monkeypatch):
    from ranvier.backends.cpu.gemm_choice import generated_is_faster
    from ranvier.errors import RanvierError

    monkeypatch.setenv("RANVIER_GEMM", "fastest")
    with pytest.raises(RanvierError, match="RANVIER_GEMM='fastest': expected 'generated' or 'blas'"):
        generated_is_faster(False, False, 8, 8, 8, 8, 8)


def test_every_variant_compiles_whatever_the_host():
    """The AVX-512 variant is generated and compiled even where it cannot run (an AVX2
    host), so CI on either kind of machine checks all three generators."""
    from ranvier.backends.cpu import jit
    from ranvier.backends.cpu.target import CPUTarget

    pairs = (sgemm.PAIRS_SYMBOL, sgemm.PAIRS_PACKED_SYMBOL, sgemm.WINDOWS_PAIRS_SYMBOL)
    for name, features in [("znver4", "+avx512f,+avx512bw,+avx512vl,+avx512bf16,+avx2,+fma,+avx"),
                           ("skylake-avx512", "+avx512f,+avx512vl,+avx2,+fma,+avx"), ("haswell", "+avx2,+fma,+avx"),
                           ("x86-64", "+sse4.2")]:
        target = CPUTarget(name, features)
        assembly = jit.assembly(sgemm.build_module(target), target)
        register = {"znver4": "%zmm", "skylake-avx512": "%zmm", "haswell": "%ymm", "x86-64": "%xmm"}[name]
        symbols = (sgemm.SYMBOL, sgemm.ADD_SYMBOL, sgemm.PACKED_SYMBOL, sgemm.BF16_PACKED_SYMBOL, sgemm.WINDOWS_SYMBOL)
        assert all(f"{symbol}:" in assembly for symbol in symbols)
        assert register in assembly
        # the GEMMs on bf16 pairs only where the target has AVX512-BF16
        assert all((f"{symbol}:" in assembly) == (name == "znver4") for symbol in pairs)
        assert ("vdpbf16ps" in assembly) == (name == "znver4")
    masked = host_target("-avx512bf16")
    assert not sgemm.pairs_supported(masked) and not {"avx512bf16", "amx-bf16"} & masked.feature_set
    assert masked.variant == host_target().variant  # the rest of AVX-512 stays


def _products_by_constants(rows: int, mask: str, rng: np.random.Generator):
    """A cell of x [2, rows, 70] times constants w [70, 45] and wtᵀ (wt [33, 70]): the
    cell, x, both products, w and wt."""
    import ranvier as rv

    w, wt = rng.standard_normal((70, 45)).astype(np.float32), rng.standard_normal((33, 70)).astype(np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [2, rows, 70])
    y, z = f.matmul(x, f.const(w)), f.matmul(x, f.const(wt), transpose_b=True)
    y.var.out = z.var.out = True
    return rv.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f"), x, y, z, w, wt


@pytest.mark.parametrize("gemm,kernel", [("generated", "PackedGemm"), ("blas", "BlasGemm")])
def test_a_product_by_a_constant_reads_panels_packed_once_per_network(gemm, kernel, monkeypatch):
    """A constant B (an imported model's weights) is packed when the first instance is
    made and shared by every instance; it becomes read-only, since the kernels read the
    packed copy. Unpacked, the generated GEMM never takes such a product."""
    monkeypatch.setenv("RANVIER_GEMM", gemm)
    rng = np.random.default_rng(5)
    cell, x, y, z, w, wt = _products_by_constants(19, "", rng)
    assert [s.kernel for s in cell.steps] == [kernel, kernel]
    first, second = cell.instance(), cell.instance()
    for data in (first, second):
        value = rng.standard_normal((2, 19, 70)).astype(np.float32)
        data[x] = value
        data[y], data[z] = np.full((2, 19, 45), np.nan, np.float32), np.full((2, 19, 33), np.nan, np.float32)
        data.compute()
        np.testing.assert_allclose(data[y], value @ w, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(data[z], value @ wt.T, rtol=1e-5, atol=1e-4)
    packed = cell.network._prepared
    assert len(packed) == (2 if gemm == "generated" else 0)
    if gemm == "generated":
        constant = cell.network.globals[cell.steps[0].op.inputs[1].name]
        with pytest.raises(ValueError, match="read-only"):
            constant[...] = 0


@pytest.mark.parametrize("split", [False, True], ids=["one thread", "all threads"])
@pytest.mark.parametrize("mask", MASKS)
def test_a_vector_times_a_constant_reads_bf16_panels_where_the_precision_allows(mask, split, monkeypatch):
    """matmul="bfloat16" on any CPU: a decode step's vector-matrix products by constants
    (plain, transposed, an epilogue after) and one with rows run on bf16 panels, each part a
    share of the columns, against float64 with the matrices rounded to bf16 (the vector's
    on AVX512-BF16's pairs where the CPU has those, the vector rounded too (Bf16Gemv); the one
    with rows on AMX-BF16 tiles where the CPU has them, else on AVX512-BF16's pairs, its rows
    rounded too); a product by a parameter stays float32 (the streamed GEMV).
    Every element of the outputs is written."""
    import ranvier as rv
    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.kernels import matmul
    from ranvier.backends.cpu.parallel import thread_count

    monkeypatch.setenv("RANVIER_GEMM", "generated")
    monkeypatch.setattr(matmul, "worth_splitting", lambda flops=0, nbytes=0: split and thread_count() > 1)
    rng = np.random.default_rng(6)
    w, wt, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((300, 131), (77, 300), (300, 20)))
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, rows = f.var("x", "float32", [1, 1, 300]), f.var("rows", "float32", [3, 300])
    outputs = [f.matmul(x, f.const(w)), f.matmul(x, f.const(wt), transpose_b=True).tanh(), f.matmul(rows, f.const(w)),
               f.matmul(x, f.parameter("v", v))]
    for t in outputs:
        t.var.out = True
    cell = rv.Compiler("cpu", cpu=mask, matmul="bfloat16", cache=False).compile(flow).cell("f")
    kernel_of = {out.name: s.kernel for s in cell.steps for out in s.op.outputs}
    rows_in_bf16 = bf16_gemm(host_target(mask))
    rows_kernel = {"amx-bf16": "AmxGemm", "avx512bf16": "PackedGemmDpbf16"}.get(rows_in_bf16, "PackedGemmBf16")
    vector_in_bf16 = sgemm.pairs_supported(host_target(mask))
    vector_kernel = "Bf16Gemv" if vector_in_bf16 else "PackedGemmBf16"
    assert [kernel_of[t.var.name] for t in outputs] == [vector_kernel, vector_kernel, rows_kernel, "Gemv"]
    assert bool(re.search(r"^step\d+_part\d*:", cell.asm(), re.MULTILINE)) == (split and thread_count() > 1)
    data = cell.instance()
    vector, matrix = rng.standard_normal((1, 1, 300)).astype(np.float32), rng.standard_normal((3, 300)).astype(np.float32)
    data[x], data[rows] = vector, matrix
    for t in outputs:
        data[t] = np.full(t.shape, np.nan, np.float32)
    data.compute()

    def rounded(m: np.ndarray) -> np.ndarray:
        return m.astype(ml_dtypes.bfloat16).astype(np.float64)

    wide = rounded(vector) if vector_in_bf16 else vector.astype(np.float64)
    # A float32 sum of 300 products errs by up to ~1e-5 of the sum of their magnitudes, in
    # whatever order a CPU adds them (a sum that cancels to near zero is not known to 1e-5 of
    # itself); tanh, 1-Lipschitz, passes that error on and adds a few ulps of its own.
    for got, want, bound, slack in [
        (data[outputs[0]], wide @ rounded(w), np.abs(wide) @ np.abs(w), 1e-30),
        (data[outputs[1]], np.tanh(wide @ rounded(wt).T), np.abs(wide) @ np.abs(wt).T, 1e-6),
        (data[outputs[2]], (rounded(matrix) if rows_in_bf16 else matrix.astype(np.float64)) @ rounded(w),
         np.abs(matrix) @ np.abs(w), 1e-30),
        (data[outputs[3]], vector.astype(np.float64) @ v, np.abs(vector) @ np.abs(v), 1e-30),
    ]:
        assert np.isfinite(got).all(), "every element written"
        assert_within_bound(got, want, bound, 1e-5, slack=slack)


def test_a_constant_some_op_writes_is_never_packed(monkeypatch):
    """A key/value cache starts as data, like a constant, and an AssignSlice writes it:
    its products read it as it is now, not a copy packed when the instance was made."""
    import ranvier as rv

    monkeypatch.setenv("RANVIER_GEMM", "generated")
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    cache = flow.add_var("cache", "float32", [6, 8])
    cache.set_data(np.zeros((6, 8), np.float32))
    row, start, q = f.var("row", "float32", [1, 8]), f.var("start", "int32", []), f.var("q", "float32", [5, 8])
    f.op("AssignSlice", [f.wrap(cache), row, start], None, {"axis": 0})
    scores = f.matmul(q, f.wrap(cache), transpose_b=True)
    scores.var.out = True
    cell = rv.Compiler("cpu", cache=False).compile(flow).cell("f")
    assert "PackedGemm" not in [s.kernel for s in cell.steps]
    data = cell.instance()
    value, queries = np.arange(8, dtype=np.float32).reshape(1, 8), np.ones((5, 8), np.float32)
    data[row], data[start], data[q] = value, np.int32(2), queries
    data.compute()
    data.compute()  # the product reads the cache this step wrote, whatever their order in the step
    assert np.array_equal(data[scores][:, 2], np.full(5, value.sum(), np.float32))


@pytest.mark.parametrize("mask", MASKS)
def test_a_large_product_by_a_constant_is_claimed_in_pieces(mask, monkeypatch):
    """2,100 rows (a batch of two 1,050-row inputs, one GEMM) by constants, plain and
    transposed: on several cores each core's rows are cut in pieces (`claimed_pieces`);
    every element written, each equal to float64's product."""
    from ranvier.backends.cpu.kernels.matmul import claimed_pieces, gemm_parts

    monkeypatch.setenv("RANVIER_GEMM", "generated")
    rng = np.random.default_rng(7)
    cell, x, y, z, w, wt = _products_by_constants(1050, mask, rng)
    assert [s.kernel.split("[")[0] for s in cell.steps] == ["PackedGemm", "PackedGemm"]
    parts = gemm_parts(cell.steps[0].op, 16)
    assert len(claimed_pieces(parts, False, 70, 45, 16)) == (4 if len(parts) == 2 else len(parts))
    data = cell.instance()
    value = rng.standard_normal((2, 1050, 70)).astype(np.float32)
    data[x] = value
    data[y], data[z] = np.full((2, 1050, 45), np.nan, np.float32), np.full((2, 1050, 33), np.nan, np.float32)
    data.compute()
    np.testing.assert_allclose(data[y], value.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(data[z], value.astype(np.float64) @ wt.T, rtol=1e-5, atol=1e-4)
