"""The CPU kernels of a CNN's backward pass: ConvFilterGemm (a convolution's filter gradient,
never the whole batch's im2col: in float32 with few filters by tiles of dot products, whole
and at the edges, with positions left over past the last vector; with many filters, or
where the tiles' sums would leave the cache, on the generated GEMM slab by slab of
positions, part of an image or several images a slab; in float64 by one BLAS GEMM an
image) against PyTorch's float64 filter gradient, for strides,
padding, rectangular filters and the images shared out over parts; WindowMaxGrad (max pooling's gradient, each window's
first maximum found in place) against the reference, with ties, NaNs, overlapping and padded
windows, bare and with the ReLU gradient after it run as dx is written (MaxPoolGradCalculate)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_within_bound, check, fused_outputs_on_reference_and_cpu, random_array, run_flow

import ranvier as rv
from ranvier.backends.cpu.kernels import conv, window
from ranvier.backends.cpu.target import host_target
from ranvier.ops.nn_grad import max_pool_grad

TESTED_OPS = {"MaxPoolGradCalculate"}

FILTER_CASES = [
    # x, filters, strides, padding
    ((3, 2, 9, 8), (4, 2, 3, 3), (1, 1), (1, 1)),  # three images: parts of two and one
    ((2, 3, 11, 10), (5, 3, 5, 5), (1, 1), (2, 2)),  # the MNIST CNN's filters
    ((2, 2, 9, 8), (3, 2, 3, 2), (2, 3), (0, 1)),  # strides, rectangular filters, padding on one axis
    ((1, 4, 7, 7), (2, 4, 1, 1), (2, 2), (0, 0)),  # a 1 × 1 downsampling
    ((2, 2, 6, 5), (3, 2, 3, 3), (1, 1), (1, 1)),  # output rows shorter than a vector
    ((2, 1, 12, 12), (8, 1, 5, 5), (1, 1), (2, 2)),  # whole tiles of filters, a tap left over (MNIST's first)
    ((2, 3, 9, 8), (6, 3, 3, 5), (1, 1), (0, 2)),  # padding on one axis only, rectangular filters
    ((3, 32, 6, 6), (64, 32, 3, 3), (2, 2), (1, 1)),  # partial sums past the cache for 9 positions: no tiles in float32 either
]


# each dtype on the host's widest vectors; float32 also on AVX2's and SSE's (rows copied in
# vectors of 16, 8 and 4 floats, or two overlapping halves)
VARIANTS = [("", "float32"), ("", "float64"), ("-avx512", "float32"), ("-avx512,-avx2", "float32")]


@pytest.mark.parametrize("mask,dtype", VARIANTS)
@pytest.mark.parametrize("case", FILTER_CASES, ids=[f"case{i}" for i in range(len(FILTER_CASES))])
def test_the_filter_gradient_matches_pytorch_over_each_part(case, dtype, mask, monkeypatch):
    op = _check_filter_gradient(case, dtype, mask, monkeypatch)
    fewest = conv.PLANE_SLAB_FILTERS if tuple(case[2]) == (1, 1) else conv.SLAB_FILTERS
    wide = conv._wide(host_target(mask))
    past_cache = case is FILTER_CASES[-1]
    want = "blas" if dtype == "float64" else "slabs" if wide and (case[1][0] >= fewest or past_cache) else "blas" if past_cache else "tiles"
    assert conv._filter_gradient_way(op, wide) == want


SLAB_CASES = [
    # x, filters, strides, padding, (images, output rows) a slab takes
    ((3, 2, 24, 23), (128, 2, 3, 3), (1, 1), (1, 1), (1, 23)),  # 552 positions: a slab of 23 rows, then one of 1
    ((2, 3, 47, 45), (33, 3, 3, 3), (2, 2), (1, 1), (1, 23)),  # the same at stride 2 (every other column picked)
    ((9, 2, 16, 16), (128, 2, 3, 3), (1, 1), (1, 1), (2, 16)),  # two images a slab: parts of 5 and 4, one left over
    ((5, 4, 9, 9), (130, 4, 3, 3), (1, 1), (1, 1), (3, 9)),  # a part's images, fewer than a slab would take
    ((3, 4, 13, 11), (32, 4, 1, 1), (2, 2), (0, 0), (2, 7)),  # a 1 × 1 downsampling: rows of 6, an odd width
    ((2, 3, 30, 31), (36, 3, 7, 7), (2, 2), (3, 3), (1, 15)),  # a 7 × 7 stem at stride 2: 15 × 16 positions
    ((2, 5, 12, 10), (48, 5, 3, 3), (2, 3), (1, 0), (1, 6)),  # strides of 2 and 3, padding on one axis
]


@pytest.mark.parametrize("mask", ["", "-avx512", "-avx512bf16", "-avx512,-avx2"])
@pytest.mark.parametrize("case", SLAB_CASES, ids=[f"slab{i}" for i in range(len(SLAB_CASES))])
def test_the_filter_gradient_of_many_filters_goes_by_slabs_on_the_generated_gemm(case, mask, monkeypatch):
    """32 filters or more (128 at stride 1), on AVX-512: the generated GEMM adds each slab's
    product into the part's sums, slabs of part of an image (the last one shorter), or of
    whole images (dy's rows copied side by side; the last slab of a part fewer images).
    Narrower vectors keep the dot tiles."""
    op = _check_filter_gradient(case[:4], "float32", mask, monkeypatch)
    wide = conv._wide(host_target(mask))
    assert conv._filter_gradient_way(op, wide) == ("slabs" if wide else "tiles")
    assert conv._slab_shape(op) == case[4]


def _check_filter_gradient(case, dtype: str, mask: str, monkeypatch):
    """The CPU kernel's dw against PyTorch's in float64, over two parts where there are two
    images, its output filled with NaN and with a number first: returns the step's op."""
    monkeypatch.setattr(conv, "thread_count", lambda: 2)
    monkeypatch.setattr(conv, "worth_splitting", lambda flops=0, nbytes=0: True)
    x_shape, w_shape, strides, padding = case
    ho = (x_shape[2] + 2 * padding[0] - w_shape[2]) // strides[0] + 1
    wo = (x_shape[3] + 2 * padding[1] - w_shape[3]) // strides[1] + 1
    x_value = random_array(x_shape, dtype, seed=1)
    dy_value = random_array((x_shape[0], w_shape[0], ho, wo), dtype, seed=2)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, dy = f.var("x", dtype, x_shape), f.var("dy", dtype, dy_value.shape)
    dw = f.op("Conv2DBackpropFilter", [x, dy], attrs={"strides": list(strides), "padding": list(padding), "filter_shape": list(w_shape)})
    dw.var.out = True
    cell = rv.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f")
    assert [step.kernel for step in cell.steps] == [conv.FILTER_GRADIENT_KERNEL]
    assert len(conv._filter_gradient_parts(cell.steps[0].op)) == min(2, x_shape[0])
    data = cell.instance()
    data[x], data[dy] = x_value, dy_value
    tx, tdy = torch.tensor(x_value, dtype=torch.float64), torch.tensor(dy_value, dtype=torch.float64)
    want = torch.nn.grad.conv2d_weight(tx, w_shape, tdy, stride=strides, padding=padding).numpy()
    bound = torch.nn.grad.conv2d_weight(tx.abs(), w_shape, tdy.abs(), stride=strides, padding=padding).numpy()
    for sentinel in (np.nan, 5.0):
        data[dw] = np.full(w_shape, sentinel, dtype)
        data.compute()
        got = np.array(data[dw]).astype(np.float64)
        assert_within_bound(got, want, bound, 1e-6 if dtype == "float32" else 1e-13)
    return cell.steps[0].op


@pytest.mark.parametrize("mask", [m for m, dtype in VARIANTS if dtype == "float32"])
def test_the_filter_gradient_on_planes_reads_nothing_past_a_row(mask):
    """An infinity in the image's last column: the taps whose windows hold it take it, the
    others stay finite, though a row's last vector of the padded planes reads it past the
    output row's end (masked off there, where dy's zeros would make it a NaN)."""
    x_value = random_array((2, 2, 6, 10), "float32", seed=3)
    x_value[0, 1, 2, 9] = np.inf
    dy_value = random_array((2, 3, 6, 10), "float32", seed=4)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, dy = f.var("x", "float32", x_value.shape), f.var("dy", "float32", dy_value.shape)
    dw = f.op("Conv2DBackpropFilter", [x, dy], attrs={"strides": [1, 1], "padding": [1, 1], "filter_shape": [3, 2, 3, 3]})
    dw.var.out = True
    cell = rv.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f")
    assert conv._gradient_planes(cell.steps[0].op, conv._wide(host_target(mask))) is not None
    data = cell.instance()
    data[x], data[dy] = x_value, dy_value
    data.compute()
    got = np.array(data[dw])
    want = torch.nn.grad.conv2d_weight(torch.tensor(x_value, dtype=torch.float64), [3, 2, 3, 3],
                                       torch.tensor(dy_value, dtype=torch.float64), padding=1).numpy()
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    assert np.isfinite(want).any() and not np.isfinite(want).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


POOL_CASES = [
    ((2, 3, 8, 8), (2, 2), None, (0, 0)),  # a CNN's 2 × 2 pooling: windows apart, tiling the image
    ((1, 2, 28, 28), (2, 2), None, (0, 0)),  # MNIST's first: rows of 14 windows, the last vector overlapping
    ((3, 2, 14, 14), (2, 2), None, (0, 0)),  # and its second: rows of 7
    ((2, 2, 9, 6), (3, 2), None, (0, 0)),  # three rows by two columns, tiling
    ((1, 2, 7, 9), (3, 3), (2, 2), (1, 1)),  # overlapping windows over a padded border
    ((3, 1, 5, 6), (2, 3), (1, 2), (0, 1)),  # rectangular
    ((2, 1, 5, 6), (2, 2), None, (0, 0)),  # a row left over under the last windows
    ((2, 3, 23, 70), (3, 3), (2, 2), (1, 1)),  # ResNet's: rows of 35 windows in vectors of 16 (8 on AVX2), 2 and one
    ((1, 2, 9, 41), (3, 3), (1, 1), (1, 1)),  # stride 1: every tap's lanes side by side
    ((2, 2, 10, 50), (2, 3), (3, 3), (0, 1)),  # windows with gaps between them
]
TILED_POOL_CASES = 4  # the first ones: every element of dx in one window, a vector of windows at a time


@pytest.mark.parametrize("mask,dtype", VARIANTS)
@pytest.mark.parametrize("case", POOL_CASES, ids=[f"case{i}" for i in range(len(POOL_CASES))])
def test_the_max_pool_gradient_goes_to_each_windows_first_maximum(case, mask, dtype, monkeypatch):
    monkeypatch.setattr(window, "thread_count", lambda: 2)
    monkeypatch.setattr(window, "worth_splitting", lambda flops=0, nbytes=0: True)
    x_shape, ksize, strides, padding = case
    g = np.random.default_rng(3)
    x_value = g.integers(-2, 3, x_shape).astype(dtype)  # many ties
    x_value.reshape(-1)[[5, 17, 42]] = np.nan  # a NaN is its window's maximum
    attrs = {"ksize": list(ksize), "padding": list(padding), **({"strides": list(strides)} if strides else {})}
    steps = strides or ksize
    dy_shape = [*x_shape[:2], *((x_shape[2 + a] + 2 * padding[a] - ksize[a]) // steps[a] + 1 for a in (0, 1))]
    dy_value = random_array(dy_shape, dtype, seed=4)
    outputs = {}
    for backend in ("reference", "cpu"):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        x, dy = f.var("x", dtype, x_shape), f.var("dy", dtype, dy_shape)
        dx = f.op("MaxPoolGrad", [x, dy], attrs=attrs)
        dx.var.out = True
        cell = rv.Compiler(backend, cpu=mask if backend == "cpu" else "", cache=False).compile(flow).cell("f")
        if backend == "cpu":
            assert [step.kernel for step in cell.steps] == ["WindowMaxGrad"]
            assert window._tiled_pairs(cell.steps[0].op) == (POOL_CASES.index(case) < TILED_POOL_CASES)
        data = cell.instance()
        data[x], data[dy] = x_value, dy_value
        data[dx] = np.full(x_shape, np.nan, dtype)
        data.compute()
        outputs[backend] = np.array(data[dx]).astype(np.float64)
    got, want = outputs["cpu"], outputs["reference"]
    np.testing.assert_array_equal(got != 0, want != 0)  # the same elements took gradients
    # overlapping windows add in dx's dtype, in an order of their own: within its rounding of the terms' magnitudes
    bound = max_pool_grad(x_value, np.abs(dy_value), ksize, steps, padding)
    assert_within_bound(got, want, bound, 1e-6 if dtype == "float32" else 1e-14)


@pytest.mark.parametrize("mask,dtype", VARIANTS)
@pytest.mark.parametrize("case", POOL_CASES, ids=[f"case{i}" for i in range(len(POOL_CASES))])
def test_the_max_pool_gradient_runs_the_relu_gradient_after_it_as_it_writes(case, mask, dtype, monkeypatch):
    """MaxPoolGradCalculate: the ReLU's gradient (a mask read where dx is written), a second
    output through a residual, and dx rounded to bfloat16 as a third."""
    monkeypatch.setattr(window, "thread_count", lambda: 2)
    monkeypatch.setattr(window, "worth_splitting", lambda flops=0, nbytes=0: True)
    x_shape, ksize, strides, padding = case
    attrs = {"ksize": list(ksize), "padding": list(padding), **({"strides": list(strides)} if strides else {})}
    steps = strides or ksize
    dy_shape = [*x_shape[:2], *((x_shape[2 + a] + 2 * padding[a] - ksize[a]) // steps[a] + 1 for a in (0, 1))]
    x_value = np.random.default_rng(5).integers(-2, 3, x_shape).astype(dtype)  # ties, and zeros the ReLU masks
    x_value.reshape(-1)[[3, 20]] = np.nan
    values = [x_value, random_array(dy_shape, dtype, seed=6), random_array(x_shape, dtype, seed=7)]
    def relu_residual_and_bf16(f, x, dy, residual):
        dx = f.op("MaxPoolGrad", [x, dy], attrs=attrs)
        return [f.cast(dx, "bfloat16"), dx * 0.5 + residual, f.select(f.greater(x, 0.0), dx)]

    outputs = fused_outputs_on_reference_and_cpu(relu_residual_and_bf16, dict(zip(("x", "dy", "residual"), values)), mask,
                                                 [("WindowMaxGrad", "MaxPoolGradCalculate")])
    for got, want in zip(outputs["cpu"], outputs["reference"]):
        assert not np.isnan(got).any()  # every element written (x's NaNs take gradients that are finite)
        np.testing.assert_allclose(got, want, rtol=1e-6 if got.dtype == dtype else 8e-3)


def test_no_pool_gradient_epilogue_without_an_output_of_dxs_dtype():
    """Overlapping windows add up in the program's first output, so, as after a product, a
    program none of whose outputs is of dx's dtype stays apart."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, dy = f.var("x", "float32", [1, 2, 7, 9]), f.var("dy", "float32", [1, 2, 4, 5])
    dx = f.op("MaxPoolGrad", [x, dy], attrs={"ksize": [3, 3], "strides": [2, 2], "padding": [1, 1]})
    f.cast(dx, "bfloat16").var.out = True
    kinds = [step.op.type for step in rv.Compiler("cpu", cache=False).compile(flow).cell("f").steps]
    assert kinds == ["MaxPoolGrad", "Cast"], kinds


@pytest.mark.parametrize("ksize,strides", [((2, 2), None), ((3, 3), (2, 2))])
def test_a_fused_pool_gradient_means_the_pool_gradient_then_its_program(ksize, strides):
    x, scale, other = random_array([2, 3, 8, 8], "float32", seed=1), random_array([], "float32", seed=2), random_array([2, 3, 8, 8], "float32", seed=3)
    attrs = {"ksize": list(ksize), **({"strides": list(strides)} if strides else {})}
    out = 4 if strides is None else 3
    dy = random_array([2, 3, out, out], "float32", seed=4)

    def fused(f, x, dy, scale, other):
        return f.op("MaxPoolGradCalculate", [x, dy, scale, other], None,
                    {**attrs, "row_inputs": 2, "expr": "$0=Mul(%0,%1);@0=Tanh($0);@1=Add(%0,%2)"})

    def apart(f, x, dy, scale, other):
        dx = f.op("MaxPoolGrad", [x, dy], attrs=attrs)
        return f.tanh(dx * scale), dx + other

    got, want = run_flow(fused, [x, dy, scale, other]), run_flow(apart, [x, dy, scale, other])
    for a, b in zip(got, want):
        check(a, np.asarray(b, np.float64), "float32")
