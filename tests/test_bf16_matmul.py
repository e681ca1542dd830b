"""Mixed-precision matrix products (`Compiler(matmul="bfloat16")`): float32 MatMuls run
with bf16-rounded inputs and float32 sums, split over threads when large: on AMX tiles, or
where the CPU has AVX512-BF16 and no tiles on the generated GEMM on bf16 pairs (vdpbf16ps;
here always, $RANVIER_GEMM=generated, where it would otherwise take the products it
measured faster than float32)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_within_bound

import ranvier as rv
from ranvier.backends.cpu.backend import bf16_gemm
from ranvier.backends.cpu.kernels.matmul import _Gemm, amx_parts, claimed_pieces, gemm_parts
from ranvier.backends.cpu.parallel import thread_count
from ranvier.backends.cpu.target import host_target

BF16_GEMM = bf16_gemm(host_target())
pytestmark = pytest.mark.skipif(BF16_GEMM is None, reason="this CPU (or OS) offers neither AMX-BF16 nor AVX512-BF16")
TILES = BF16_GEMM == "amx-bf16"
KERNEL = "AmxGemm" if TILES else "GemmDpbf16"
PACKED_KERNEL = "AmxGemm" if TILES else "PackedGemmDpbf16"  # a product by a constant: its pairs packed once
_erf = np.vectorize(math.erf, otypes=[np.float64])


@pytest.fixture(autouse=True)
def generated_gemms(monkeypatch):
    """The bf16 GEMM on pairs takes every product it supports, measured faster or not."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")


def parts_of(step) -> list:
    return amx_parts(step.op) if TILES else gemm_parts(step.op, 16, slices=True)


def rounded(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def compiled_matmul(a_shape, b_shape, matmul="bfloat16", cpu="", constant=None, **attrs):
    """A cell of one product; `constant`: B is that constant matrix."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    a = f.var("a", rv.DT_FLOAT, a_shape)
    b = f.var("b", rv.DT_FLOAT, b_shape) if constant is None else f.const(constant)
    c = f.matmul(a, b, **attrs)
    c.var.out = True
    cell = rv.Compiler(cpu=cpu, matmul=matmul).compile(flow).cell("f")
    return cell, a, b, c


CASES = [
    ((16, 32), (32, 16), {}),
    ((17, 33), (33, 65), {}),
    ((3, 40, 50), (3, 50, 30), {}),
    ((4, 37, 50), (50, 33), {}),  # shared matrix under batched rows: one GEMM
    ((50, 37), (50, 33), {"transpose_a": True}),
    ((37, 50), (33, 50), {"transpose_b": True}),
    ((2, 50, 37), (2, 33, 50), {"transpose_a": True, "transpose_b": True}),
    ((640, 288), (288, 700), {}),  # large: rows shared out over threads
    ((96, 2000), (2000, 800), {}),  # large, wide: columns shared out
    ((800, 96), (2000, 96), {"transpose_b": True}),
    ((2000, 640), (2000, 160), {"transpose_a": True}),
    ((8, 256, 256), (8, 256, 256), {}),  # large batch: whole products shared out
    ((2100, 64), (64, 200), {}),  # a constant's: each core's rows cut in pieces the cores claim
    ((64, 2100), (64, 96), {"transpose_a": True}),
]
SPLIT = {7, 8, 9, 10, 11, 12, 13}  # the cases large enough to run on several threads


@pytest.mark.parametrize("constant", [False, True], ids=["matrix", "constant"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_bf16_matmul_matches_the_rounded_product(case, constant):
    a_shape, b_shape, attrs = CASES[case]
    if constant and len(b_shape) > 2:
        pytest.skip("a constant of a batch of matrices is not packed")
    rng = np.random.default_rng(len(a_shape) * 1000 + a_shape[-1])
    x, y = rng.standard_normal(a_shape, np.float32), rng.standard_normal(b_shape, np.float32)
    cell, a, b, c = compiled_matmul(a_shape, b_shape, constant=y if constant else None, **attrs)
    (step,) = [s for s in cell.steps if s.kernel == (PACKED_KERNEL if constant else KERNEL)]
    assert (len(parts_of(step)) > 1) == (case in SPLIT and thread_count() > 1)
    data = cell.instance()
    data[a] = x
    if not constant:
        data[b] = y
    data[c][...] = np.nan  # every element must be written
    data.compute()
    xa, yb = rounded(x), rounded(y)
    if attrs.get("transpose_a"):
        xa = np.swapaxes(xa, -1, -2)
    if attrs.get("transpose_b"):
        yb = np.swapaxes(yb, -1, -2)
    expected = xa @ yb
    bound = np.abs(xa) @ np.abs(yb)  # float32 sums of exact bf16 products
    assert_within_bound(data[c], expected, bound, 1e-5)


def test_the_cell_shows_the_kernel_and_its_workspace():
    cell, *_ = compiled_matmul((64, 64), (64, 64))
    text = str(cell)
    assert f"{KERNEL}[avx512]" in text and "f/MatMul/workspace: uint8" in text


def test_vector_products_and_float32_requests_stay_in_float32():
    cell, *_ = compiled_matmul((1, 64), (64, 64))
    assert [s.kernel for s in cell.steps] == ["Gemv"]
    float32 = (["BlasGemm"], ["Gemm"])  # whichever measured faster for the shape
    cell, *_ = compiled_matmul((64, 64), (64, 64), matmul="float32")
    assert [s.kernel for s in cell.steps] in float32
    cell, *_ = compiled_matmul((64, 64), (64, 64), cpu="-avx512")  # masks AMX with AVX-512
    assert [s.kernel for s in cell.steps] in float32
    cell, *_ = compiled_matmul((64, 64), (64, 64), cpu="-avx512bf16")  # masks the pairs, and the AMX kernel's packing
    assert [s.kernel for s in cell.steps] in float32


@pytest.mark.skipif(TILES, reason="AMX tiles take every product with rows")
def test_thin_products_stay_on_their_float32_kernel():
    """A classifier's 10 columns (and its gradients' 10 steps of k) would fill a fifth of
    a 48-column panel of pairs: ThinGemm keeps them."""
    for a_shape, b_shape in [((64, 300), (300, 10)), ((64, 10), (10, 300))]:
        cell, *_ = compiled_matmul(a_shape, b_shape)
        assert [s.kernel for s in cell.steps] == ["ThinGemm"]


def test_unknown_precision_is_refused():
    with pytest.raises(rv.RanvierError, match="unknown matmul precision 'float8'; available: float32, tfloat32, bfloat16"):
        rv.Compiler(matmul="float8")


def test_mixed_precision_training_follows_float32():
    from ranvier.jobs.mnist import MnistConfig, make_trainer

    losses = {}
    for matmul in ("float32", "bfloat16"):
        trainer, _, _ = make_trainer(MnistConfig(steps=30, matmul=matmul))
        losses[matmul] = [trainer.step() for _ in range(30)]
    assert losses["bfloat16"][-1] < 0.8 * losses["bfloat16"][0]
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.05)


@pytest.mark.parametrize("rows", [70, 2100], ids=["one-part", "pieces"])
@pytest.mark.parametrize("cpu", ["", "-avx512bf16", "-avx512"])
def test_gelu_after_a_bf16_product_is_the_fast_one_within_its_bound(cpu, rows):
    """A product in bfloat16 by a constant and its epilogue's bias and exact Gelu
    (mathlib.gelu_erf_fast: within 2.5e-7 · max(|x|, 1)) against float64 on the inputs the
    product read: both rounded to bf16 on pairs, the constant alone on bf16 panels (where
    AVX512-BF16 is masked); 2,100 rows: each core's cut in pieces (`claimed_pieces`), each
    piece's epilogue over its own rows."""
    rng = np.random.default_rng(5)
    x, w, bias = (rng.standard_normal(shape, np.float32) for shape in ((rows, 96), (96, 130), (130,)))
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    a = f.var("a", rv.DT_FLOAT, x.shape)
    out = f.gelu(f.matmul(a, f.const(w)) + f.const(bias))
    out.var.out = True
    cell = rv.Compiler(cpu=cpu, matmul="bfloat16").compile(flow).cell("f")
    (step,) = cell.steps
    assert step.op.type == "MatMulCalculate" and step.kernel.split("[")[0] == (PACKED_KERNEL if cpu == "" else "PackedGemmBf16")
    data = cell.instance()
    data[a] = x
    data[out][...] = np.nan  # every element must be written
    data.compute()
    xa = rounded(x) if cpu == "" else x.astype(np.float64)
    wb = rounded(w)
    product = xa @ wb + bias
    bound = 1.2e-5 * (np.abs(xa) @ np.abs(wb) + np.abs(bias)) + 2.5e-7 * np.maximum(np.abs(product), 1)
    assert_within_bound(data[out], 0.5 * product * (1 + _erf(product / np.sqrt(2))), bound)


@pytest.mark.parametrize("ta", [False, True], ids=["a", "a-transposed"])
def test_claimed_pieces_cover_each_part_s_rows_once(ta):
    """Parts of 1,056 and 1,044 rows (two calls each, side by side in C's columns) cut into
    pieces of at least 512 rows, 16-row edges: every row of A and C in exactly one piece
    per call, with that call's columns; one part is left whole."""
    lda, ldc = (2100, 200) if ta else (64, 200)
    parts = [[_Gemm(rows, 96, 64, a=first if ta else first * lda, b=column, c=first * ldc + column, column=column)
              for column in (0, 96)] for first, rows in ((0, 1056), (1056, 1044))]
    pieces = claimed_pieces(parts, ta, lda, ldc, 16)
    assert [[g.m for g in piece] for piece in pieces] == [[528, 528], [528, 528], [528, 528], [516, 516]]
    for column in (0, 96):
        calls = [g for piece in pieces for g in piece if g.column == column]
        assert all(g.n == 96 and g.k == 64 and g.b == column for g in calls)
        assert [g.a for g in calls] == [first if ta else first * lda for first in (0, 528, 1056, 1584)]
        assert [g.c for g in calls] == [first * ldc + column for first in (0, 528, 1056, 1584)]
    assert claimed_pieces(parts[:1], ta, lda, ldc, 16) == parts[:1]
