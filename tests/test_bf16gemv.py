"""A row times a constant in bf16 pairs on AVX512-BF16 (backends/cpu/bf16gemv.py, a decode
step's products): against float64 on the bf16-rounded row and matrix, nothing written past y,
the pairs' layout, and the kernel a bfloat16 compile picks for such a product (and passes over
under a `-avx512bf16` mask)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_within_bound

import ranvier as rv
from ranvier.backends.cpu import bf16gemv, sgemm
from ranvier.backends.cpu.target import host_target

pytestmark = pytest.mark.skipif(not sgemm.pairs_supported(host_target()), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")

SHAPES = [
    (48, 2),  # one panel row of one panel
    (1, 1),  # one column, an odd k: a pair with a zero
    (70, 33),  # a panel and a part of one; 17 pair rows (two loop steps and one left)
    (768, 768),
    (2048, 768),
    (768, 2048),
    (100, 17),  # the last vector of x's pairs from the zero-padded buffer
]


def rounded(values: np.ndarray) -> np.ndarray:
    return values.astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_float64_on_bf16_rounded_operands(n, k):
    target = host_target()
    gemv = bf16gemv.GEMV_CTYPE(bf16gemv.gemv_address(target))
    rng = np.random.default_rng(n * 100 + k)
    x = rng.standard_normal(k, dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    y = np.full(n + 5, np.nan, np.float32)
    workspace = np.zeros(bf16gemv.workspace_bytes(k), np.uint8)
    panels = sgemm.pack_panels(w, False, target, pairs=True)
    gemv(n, k, x.ctypes.data, panels.ctypes.data, y.ctypes.data, workspace.ctypes.data)
    expected = rounded(x) @ rounded(w)
    assert_within_bound(y[:n], expected, np.abs(rounded(x)) @ np.abs(rounded(w)), 1e-5)  # float32 sums of exact products
    assert np.isnan(y[n:]).all()


def test_pairs_hold_two_steps_of_k_per_column():
    """Panel q, row p, column j: (w[2p, j], w[2p + 1, j]) rounded to bf16, zeros past n and k;
    the same from Bᵀ, each range of columns in panels of its own."""
    target = host_target()
    nr = sgemm.panel_width(target)
    k, n = 5, nr + 3
    w = np.random.default_rng(1).standard_normal((k, n), dtype=np.float32)
    packed = sgemm.pack_panels(w, False, target, pairs=True)
    assert packed.ctypes.data % 64 == 0 and packed.size == sgemm.panels_size(n, k, target, pairs=True) == 2 * nr * 6
    panels = packed.reshape(2, 3, nr, 2).astype(np.float32)
    padded = np.zeros((6, 2 * nr), np.float32)
    padded[:k, :n] = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    for q in range(2):
        for p in range(3):
            np.testing.assert_array_equal(panels[q, p], padded[2 * p : 2 * p + 2, q * nr : (q + 1) * nr].T)
    np.testing.assert_array_equal(sgemm.pack_panels(w.T.copy(), True, target, pairs=True), packed)
    ranges = sgemm.pack_panels(w, False, target, [(0, 4), (4, n)], pairs=True)
    assert ranges.size == sgemm.panels_size(4, k, target, pairs=True) + sgemm.panels_size(n - 4, k, target, pairs=True)


def _row_product(k: int, n: int, transposed: bool, mask: str = ""):
    rng = np.random.default_rng(k + n)
    weights = rng.standard_normal((n, k) if transposed else (k, n), dtype=np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT32, [1, k])
    y = f.matmul(x, f.const(weights), transpose_b=transposed)
    y.var.out = True
    cell = rv.Compiler("cpu", matmul="bfloat16", cpu=mask).compile(flow).cell("f")
    data = cell.instance()
    data[x] = rng.standard_normal((1, k), dtype=np.float32)
    data.compute()
    kernel = next(s.kernel for s in cell.steps if s.op.outputs[0].name == y.var.name)
    return kernel, np.array(data[y]), rounded(data[x]) @ rounded(weights.T if transposed else weights)


@pytest.mark.parametrize("k,n,transposed", [(768, 2048, False), (2048, 768, False), (288, 32000, True)])
def test_a_decode_steps_product_runs_on_pairs(k, n, transposed):
    """matmul="bfloat16": a row times a constant is `Bf16Gemv`, split over the cores by columns
    (a shared classifier's Bᵀ too), as float64 on the rounded operands says."""
    kernel, got, expected = _row_product(k, n, transposed)
    assert kernel == "Bf16Gemv"
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_without_avx512bf16_the_widening_panels_take_it():
    kernel, got, expected = _row_product(300, 200, False, mask="-avx512bf16")
    assert kernel != "Bf16Gemv"
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())  # the row stays float32
