"""int8 products in llama.cpp's q8_0 form (backends/cpu/q8gemm.py): the generated kernel against
float64 on the dequantized weights and quantized activations, for each way it sums bytes
(AVX512-VNNI, AVX-VNNI, vpmaddwd emulation on AVX-512, AVX2 and SSE); the activations quantized
bit for bit as llama.cpp's reference does; `Compiler(matmul="int8")` on products by constants."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_within_bound

import ranvier as rv
from ranvier.backends.cpu import q8gemm
from ranvier.backends.cpu.target import host_target

# mask → how the kernel sums bytes there (vnni_lanes): each is compiled and run on this CPU
MASKS = ["", "-avx512vnni", "-avx512", "-avx512,-avxvnni", "-avx512,-avx2"]

SHAPES = [
    (1, 64, 32),  # one block, one whole panel (AVX-512's)
    (1, 70, 100),  # a partial last block of k, a panel and a few columns
    (2, 33, 64),  # a whole tile of rows (AVX-VNNI's two)
    (3, 130, 768),  # three rows left over (AVX-512's tile is four); three panels of AVX-512, five of AVX2
    (6, 64, 96),  # a whole tile of AVX-512 and two rows left over
    (5, 17, 33),  # one step past a block: a block of one step
    (16, 200, 288),
    (7, 1, 40),  # one column
]


def _host_has(mask: str) -> None:
    """Skip a mask whose kernel needs what this CPU lacks (the lesser variants compile anywhere)."""
    features = host_target().feature_set
    if mask in ("", "-avx512vnni") and "avx512f" not in features:
        pytest.skip("this CPU has no AVX-512")
    if mask == "-avx512" and not {"avxvnni", "avx2"} & features:
        pytest.skip("this CPU has no AVX2")


def dequantized(d: np.ndarray, q: np.ndarray, k: int, half: bool) -> np.ndarray:
    """Rows of q8_0 blocks back to float64 (scales rounded to float16 where they are kept so)."""
    rows = q.shape[0]
    scales = (d.astype(np.float16) if half else d).astype(np.float64)
    return (scales[:, :, None] * q.reshape(rows, -1, q8gemm.BLOCK)).reshape(rows, -1)[:, :k]


def oracle(a: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a · w in float64 on the quantized activations and dequantized weights, and the sum of
    the products' magnitudes (float32 sums err by up to 1e-5 of it)."""
    k = a.shape[1]
    a_hat = dequantized(*q8gemm.quantize_q8_0(a), k, half=False)
    w_hat = dequantized(*q8gemm.quantize_q8_0(w.T), k, half=True).T
    return a_hat @ w_hat, np.abs(a_hat) @ np.abs(w_hat)


def run_kernel(target, a: np.ndarray, w: np.ndarray, pad: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """C (inside a NaN frame `pad` columns wide) and the workspace after one call."""
    m, k = a.shape
    n = w.shape[1]
    gemm = q8gemm.GEMM_CTYPE(q8gemm.gemm_address(target))
    panels = q8gemm.pack_panels(w, False, target)
    c = np.full((m, n + pad), np.nan, np.float32)
    workspace = np.zeros(q8gemm.workspace_bytes(m, k), np.uint8)
    gemm(m, n, k, a.ctypes.data, k, panels.ctypes.data, c.ctypes.data, n + pad, workspace.ctypes.data)
    return c, workspace


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_q8_gemm_matches_float64_on_the_quantized_operands(shape, mask):
    _host_has(mask)
    m, n, k = shape
    rng = np.random.default_rng(m * 10_000 + n * 100 + k)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.1
    c, _ = run_kernel(host_target(mask), a, w)
    expected, bound = oracle(a, w)
    assert_within_bound(c[:, :n], expected, bound, 1e-5)
    assert np.isnan(c[:, n:]).all()  # nothing written past C's columns


def test_each_mask_sums_bytes_its_own_way():
    """The masks above reach every way of summing: 512- and 256-bit vpdpbusd, and the emulation."""
    features = host_target().feature_set
    if not {"avx512vnni", "avxvnni"} <= features:
        pytest.skip("this CPU has not both AVX512-VNNI and AVX-VNNI")
    assert [q8gemm.vnni_lanes(host_target(mask)) for mask in MASKS] == [16, 0, 8, 0, 0]


def test_activations_are_quantized_as_llama_cpp_does():
    """The workspace holds each row's int8 blocks, float32 scales and −128 × block sums, the
    blocks equal to `quantize_q8_0` (roundf's halves away from zero, zeros past k)."""
    target = host_target()
    k = 70
    a = np.random.default_rng(4).standard_normal((3, k), dtype=np.float32)
    a[0, :32] = np.arange(-16, 16) + 0.5  # ties: amax 16 → d = 16/127; and exact halves after scaling
    a[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    a[2, :32] = np.linspace(-127, 127, 32).round() / 2  # d = 0.5: x / d exact, halves where x has them
    _, workspace = run_kernel(target, a, np.ones((k, 16), np.float32))
    d, q = q8gemm.quantize_q8_0(a)
    blocks = q8gemm.blocks_of(k)
    start = -workspace.ctypes.data % 64
    rows = workspace[start : start + 3 * q8gemm.quantized_row_bytes(k)].reshape(3, -1)
    np.testing.assert_array_equal(rows[:, : blocks * 32].view(np.int8), q)
    np.testing.assert_array_equal(rows[:, blocks * 32 : blocks * 36].copy().view(np.float32), d)
    sums = q.reshape(3, blocks, 32).astype(np.int32).sum(axis=2)
    np.testing.assert_array_equal(rows[:, blocks * 36 : blocks * 40].copy().view(np.int32), -128 * sums)
    assert d[1, 1] == 0 and not q[1, 32:64].any()
    assert q[2, 0] == -127 and q[2, 31] == 127


def test_quantize_rounds_halves_away_from_zero():
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 2.5, -2.5, 0.5, -1.5]  # d = 1: x / d are the values themselves
    d, q = q8gemm.quantize_q8_0(x)
    assert d[0, 0] == 1.0 and q[0, :5].tolist() == [127, 3, -3, 1, -2]


def test_panels_hold_the_quantized_columns():
    """Unpacked again, the panels are the columns' q8_0 blocks (q + 128 as unsigned bytes) and
    their scales in float16; past n, zeros (128) with scale 0."""
    target = host_target()
    nr = q8gemm.panel_width(target)
    k, n = 70, nr + 5
    w = np.random.default_rng(5).standard_normal((k, n), dtype=np.float32)
    panels = q8gemm.pack_panels(w, False, target)
    assert panels.ctypes.data % 64 == 0 and panels.size == q8gemm.panels_bytes(n, k, target)
    blocks = q8gemm.blocks_of(k)
    per_block = panels.reshape(2, blocks, 34 * nr)
    scales = per_block[..., : 2 * nr].copy().view(np.float16).transpose(0, 2, 1).reshape(2 * nr, blocks)
    values = per_block[..., 2 * nr :].reshape(2, blocks, 8, nr, 4).transpose(0, 3, 1, 2, 4).reshape(2 * nr, blocks * 32)
    d, q = q8gemm.quantize_q8_0(w.T)
    np.testing.assert_array_equal(scales[:n], d.astype(np.float16))
    np.testing.assert_array_equal((values[:n] ^ 128).view(np.int8), q)
    assert not scales[n:].any() and (values[n:] == 128).all()
    np.testing.assert_array_equal(q8gemm.pack_panels(w.T.copy(), True, target), panels)


def _product_flow(m: int, k: int, n: int, transposed: bool, seed: int):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n, k) if transposed else (k, n), dtype=np.float32) * 0.1
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT32, [m, k])
    y = f.matmul(x, f.const(weights), transpose_b=transposed)
    other = f.matmul(x, x, transpose_b=True)  # a product of activations: not int8
    y.var.out = other.var.out = True
    return flow, x, y, other, weights, rng.standard_normal((m, k), dtype=np.float32)


@pytest.mark.parametrize("m,k,n,transposed", [(1, 768, 2048, False), (1, 300, 1000, True), (6, 100, 90, False),
                                              (64, 288, 768, False)])
def test_int8_matmul_on_constants(m, k, n, transposed):
    """Compiler(matmul="int8"): a product by a constant runs on its q8_0 panels, split over the
    cores, as the kernel's float64 oracle says; a product of two activations stays float32."""
    flow, x, y, other, weights, value = _product_flow(m, k, n, transposed, seed=m + k + n)
    network = rv.Compiler("cpu", matmul="int8").compile(flow)
    cell = network.cell("f")
    assert {s.op.outputs[0].name: s.kernel for s in cell.steps}[y.var.name] == "Q8Gemm"
    data = cell.instance()
    data[x] = value
    data.compute()
    expected, bound = oracle(value, weights.T if transposed else weights)
    assert_within_bound(data[y], expected, bound, 1e-5)
    np.testing.assert_allclose(data[other], value.astype(np.float64) @ value.T, rtol=1e-5, atol=1e-4)


def test_int8_needs_no_vnni():
    """On a CPU without VNNI (AVX2, as Zen 3) the same product runs on the emulation."""
    flow, x, y, _, weights, value = _product_flow(3, 200, 100, False, seed=9)
    data = rv.Compiler("cpu", matmul="int8", cpu="-avx512,-avxvnni").compile(flow).cell("f").instance()
    data[x] = value
    data.compute()
    expected, bound = oracle(value, weights)
    assert_within_bound(data[y], expected, bound, 1e-5)
