"""Conv2DCalculateMaxPool (compiler/conv_pool.py, kernels/conv_pool.py): a convolution, its
epilogue and the max pooling that alone reads it, computed in bands of the convolution's
rows and pooled from a part's scratch. Against PyTorch's float64 convolution and pooling
(of the bf16-rounded x and w on AVX512-BF16's pairs), every output element written (NaN
first): windows over the border and past the last row, bands that do not divide the rows
(bands of one pooled row, where each band's first rows are the previous band's last),
parts cut out of one image, every vector variant. The pass leaves training steps (whose
pool gradient reads the convolution's output) and the reference backend alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import cell_against_pytorch, random_array

import ranvier as rv
from ranvier.autodiff import backward
from ranvier.backends.cpu import sgemm
from ranvier.backends.cpu.backend import CPUCode
from ranvier.backends.cpu.kernels import conv, conv_pool, winograd
from ranvier.backends.cpu.target import host_target

TESTED_OPS = {"Conv2DCalculateMaxPool"}

needs_pairs = pytest.mark.skipif(not sgemm.pairs_supported(host_target()), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")

CASES = [
    # x shape, filters, conv (strides, padding), pool (ksize, strides, padding)
    ((2, 3, 30, 29), 20, ((2, 2), (3, 3)), ((3, 3), (2, 2), (1, 1))),  # a ResNet stem, odd sizes: windows overhang
    ((1, 4, 17, 23), 18, ((1, 1), (1, 1)), ((2, 2), (2, 2), (0, 0))),  # tiling windows: nothing carried, a row left over
    ((3, 5, 13, 12), 24, ((1, 1), (0, 0)), ((3, 2), (1, 3), (1, 1))),  # overlapping rows, stride 3 along them
    ((1, 6, 9, 40), 17, ((2, 1), (2, 1)), ((5, 3), (2, 2), (2, 1))),  # two rows carried
    ((1, 2, 19, 22), 9, ((3, 3), (2, 1)), ((3, 3), (2, 2), (1, 1))),  # stride 3: phase planes of an image's parts
]


@pytest.fixture(autouse=True)
def _windows_gemm(monkeypatch):
    """The windows GEMM on every geometry (which the pass asks for): no Winograd, no tiles."""
    monkeypatch.setattr(winograd, "_MAX_PAIRS", 0)
    monkeypatch.setattr(conv, "FEW_FILTERS", 0)
    monkeypatch.setattr(conv, "PLANE_FILTERS", 0)


def _stem_cell(case, mask: str = "", matmul: str = "float32", constant: bool = False):
    """The stem's cell; its filters a variable or (`constant`) _filters' values."""
    shape, filters, (strides, padding), (ksize, pool_strides, pool_padding) = case
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, shape)
    w = f.const(_filters(case)) if constant else f.var("w", rv.DT_FLOAT, [filters, shape[1], 5, 3])
    bias = f.var("b", rv.DT_FLOAT, [1, filters, 1, 1])
    y = f.max_pool(f.relu(f.conv2d(x, w, strides=strides, padding=padding) + bias), ksize=ksize, strides=pool_strides,
                   padding=pool_padding)
    y.var.out = True
    return rv.Compiler("cpu", cpu=mask, cache=False, matmul=matmul).compile(flow).cell("f"), y


def _filters(case) -> np.ndarray:
    shape, filters = case[:2]
    return random_array([filters, shape[1], 5, 3], "float32", seed=2, low=-1, high=1)


def _check(cell, y, case, pairs: bool, constant: bool = False) -> None:
    """The stem on random x, w and bias (w the cell's `constant` where it is one) against
    PyTorch's float64 one (of the bf16-rounded x and w where it ran on `pairs`)."""
    shape, filters, (strides, padding), (ksize, pool_strides, pool_padding) = case

    def stem(x, w, b):
        convolved = torch.relu(torch.nn.functional.conv2d(x, w, stride=strides, padding=padding) + b)
        return torch.nn.functional.max_pool2d(convolved, ksize, pool_strides, pool_padding)

    values = {"x": random_array(shape, "float32", seed=1), "w": _filters(case),
              "b": random_array([1, filters, 1, 1], "float32", seed=3)}
    cell_against_pytorch(cell, y, values, stem, constants=["w"] if constant else [], bf16=["x", "w"] if pairs else [])


def _small_bands(monkeypatch, band_bytes: int, threads: int) -> None:
    monkeypatch.setattr(conv_pool, "CALL_BYTES", band_bytes)
    monkeypatch.setattr(conv_pool, "thread_count", lambda: threads)
    monkeypatch.setattr(conv_pool, "worth_splitting", lambda flops, nbytes: threads > 1)


@pytest.mark.parametrize("mask", ["", "-avx512", "-avx512,-avx2"])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("band_bytes", [1, 3000, 1 << 18])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_a_convolution_and_its_max_pool_run_as_one_op_band_by_band(case, band_bytes, threads, mask, monkeypatch):
    """Bands of one pooled row, of a few (not dividing the rows), of a whole image; parts of
    whole images or of an image's rows; float32 on every vector variant."""
    _small_bands(monkeypatch, band_bytes, threads)
    cell, y = _stem_cell(case, mask)
    (step,) = cell.steps
    assert (step.op.type, step.kernel) == ("Conv2DCalculateMaxPool", "ConvPool") and step.variant != "python"
    _check(cell, y, case, pairs=False)


@pytest.mark.parametrize("constant", [False, True], ids=["variable", "constant"])
@pytest.mark.parametrize("mask", ["", "-avx512bf16"])
@pytest.mark.parametrize("band_bytes", [1, 3000])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_in_bf16_the_bands_are_multiplied_on_pairs_where_the_cpu_has_them(case, band_bytes, mask, constant, monkeypatch):
    """matmul="bfloat16", the choice forced to the pairs: ConvPoolDpbf16 matches float64 on
    the bf16-rounded x and w where the CPU has AVX512-BF16 (constant filters rounded into
    pairs once); masked, ConvPool in float32."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    _small_bands(monkeypatch, band_bytes, 2)
    cell, y = _stem_cell(case, mask, matmul="bfloat16", constant=constant)
    pairs = sgemm.pairs_supported(host_target(mask))
    (step,) = cell.steps
    assert step.kernel == ("ConvPoolDpbf16" if pairs else "ConvPool")
    assert [p.form for p in CPUCode.of(cell).layout.prepared] == ([conv.PAIRED_FILTERS] if pairs and constant else [])
    _check(cell, y, case, pairs, constant)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=["stride2", "strides2x1", "stride3"])
def test_a_stem_of_one_stride_reads_its_images_phase_planes(case):
    """A stride s in both directions (ResNet's stem: 7 × 7, stride 2) reads each image's s × s
    phase planes (conv.phase_planes), copied once a part, with stride 1 and their padding in
    them; a stride that differs between the directions reads the image in place."""
    cell, _ = _stem_cell(case)
    (step,) = cell.steps
    shape, (strides, padding) = case[0], case[2]
    out_height, out_width = ((size + 2 * pad - extent) // stride + 1
                             for size, extent, stride, pad in zip(shape[2:], (5, 3), strides, padding))
    geometry = conv_pool._plan(step.op).geometry
    if strides[0] != strides[1]:
        assert geometry == (*shape[2:], 5, 3, *strides, *padding, out_width, 1)
        return
    s = strides[0]
    assert geometry == (out_height + 4 // s, out_width + 2 // s, 5, 3, 1, 1, 0, 0, out_width, s)


def test_a_training_step_keeps_the_convolutions_output_for_the_gradients():
    """The max pool's gradient and the ReLU's read the convolution's output: no fusion, and
    the gradient of the filters matches PyTorch's."""
    x, w = random_array([2, 3, 15, 14], "float32", seed=1), random_array([20, 3, 3, 3], "float32", seed=2, low=-1, high=1)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    vx, vw = f.var("x", rv.DT_FLOAT, x.shape), f.var("w", rv.DT_FLOAT, w.shape)
    loss = f.sum(f.max_pool(f.relu(f.conv2d(vx, vw, strides=2, padding=1)), ksize=3, strides=2, padding=1))
    (grad,) = (backward(loss, [vw])[vw.name],)
    grad.var.out = True
    cell = rv.Compiler("cpu", cache=False).compile(flow).cell("f")
    assert "Conv2DCalculateMaxPool" not in {s.op.type for s in cell.steps}
    data = cell.instance()
    data["f/x"], data["f/w"] = x, w
    data.compute()
    tx, tw = torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64, requires_grad=True)
    convolved = torch.relu(torch.nn.functional.conv2d(tx, tw, stride=2, padding=1))
    torch.nn.functional.max_pool2d(convolved, 3, 2, 1).sum().backward()
    np.testing.assert_allclose(np.array(data[grad]), tw.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_the_fused_ops_reference_is_the_convolution_then_the_pool():
    case = ((2, 3, 11, 10), 4, ((2, 1), (1, 0)), ((3, 3), (2, 2), (1, 1)))
    shape, filters, (strides, padding), (ksize, pool_strides, pool_padding) = case
    x, w = random_array(shape, "float32", seed=1), random_array([filters, 3, 3, 3], "float32", seed=2)
    bias = random_array([1, filters, 1, 1], "float32", seed=3)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.op("Conv2DCalculateMaxPool", [f.var("x", rv.DT_FLOAT, x.shape), f.var("w", rv.DT_FLOAT, w.shape),
                                        f.var("b", rv.DT_FLOAT, bias.shape)],
             attrs={"strides": "2,1", "padding": "1,0", "expr": "$0=Add(%0,%1);@0=Relu($0)", "pool_ksize": "3,3",
                    "pool_strides": "2,2", "pool_padding": "1,1"})
    y.var.out = True
    data = rv.Compiler("reference").compile(flow).cell("f").instance()
    data["f/x"], data["f/w"], data["f/b"] = x, w, bias
    data.compute()
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64) for a in (x, w, bias))
    want = torch.nn.functional.max_pool2d(torch.relu(torch.nn.functional.conv2d(tx, tw, stride=strides, padding=padding) + tb),
                                          ksize, pool_strides, pool_padding).numpy()
    np.testing.assert_allclose(np.array(data[y]), want, rtol=1e-5, atol=1e-5)
