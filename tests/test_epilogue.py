"""Epilogue fusion: a MatMul and the Calculate that alone reads its product run as one
MatMulCalculate, the program over each block of the product a GEMM call wrote."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_within_bound, check, random_array, run_flow

import ranvier as rv
from ranvier.autodiff import backward
from ranvier.backends.cpu import sgemm
from ranvier.backends.cpu.kernels import conv
from ranvier.backends.cpu.kernels.matmul import PACKED_KERNEL, _epilogue_tiles
from ranvier.ops.fused import epilogue_input_strides, epilogue_strides

TESTED_OPS = {"MatMulCalculate", "Conv2DCalculate"}
MASKS = ["", "-avx512", "-avx512,-avx2"]
GEMMS = ["generated", "blas"]


def _steps(flow: rv.Flow, **options) -> list:
    return rv.Compiler("cpu", **options).compile(flow).cell("f").steps


def _torch(*arrays):
    return [torch.tensor(np.asarray(a, np.float64)) for a in arrays]


def test_epilogue_strides_read_a_bias_a_same_shape_tensor_and_a_per_row_scale():
    assert epilogue_strides([70], [3, 37, 70]) == (0, 1)
    assert epilogue_strides([3, 37, 70], [3, 37, 70]) == (70, 1)
    assert epilogue_strides([37, 70], [1, 37, 70]) == (70, 1)
    assert epilogue_strides([3, 37, 1], [3, 37, 70]) == (1, 0)
    assert epilogue_strides([], [5, 6]) == (0, 0)
    # broadcast over one leading dimension but not another: no (row, column) strides
    assert epilogue_strides([3, 1, 70], [3, 37, 70]) is None
    assert epilogue_strides([37, 70], [3, 37, 70]) is None


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_bias_and_gelu_run_in_the_products_epilogue(gemm, ta, tb, monkeypatch):
    monkeypatch.setenv("RANVIER_GEMM", gemm)
    x = random_array([50, 37] if ta else [37, 50], "float32", seed=1)
    w = random_array([70, 50] if tb else [50, 70], "float32", seed=2)
    bias = random_array([70], "float32", seed=3)

    def build(f, x, w, b):
        return f.gelu(f.matmul(x, w, transpose_a=ta, transpose_b=tb) + b)

    result = run_flow(build, [x, w, bias])
    tx, tw, tb_ = _torch(x.T if ta else x, w.T if tb else w, bias)
    check(result[0], torch.nn.functional.gelu(tx @ tw + tb_).numpy().astype(np.float32))
    (step,) = _steps(result.flow)
    assert step.op.type == "MatMulCalculate"


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize(("m", "k", "n"), [(0, 50, 70), (37, 50, 0), (37, 0, 70), (0, 0, 0)])
def test_zero_size_products_compute_as_the_reference_does(gemm, m, k, n, monkeypatch):
    """A zero-size batch (m = 0) or layer (n = 0) has nothing to write, its epilogue
    included; a product over k = 0 is zeros, and its epilogue runs on them (here bias + gelu)."""
    monkeypatch.setenv("RANVIER_GEMM", gemm)
    x, w, bias = random_array([m, k], "float32", seed=1), random_array([k, n], "float32", seed=2), random_array([n], "float32", seed=3)

    def build(f, x, w, b):
        return f.gelu(f.matmul(x, w) + b), f.reduce("Sum", x, axis=1)

    product, sums = run_flow(build, [x, w, bias])
    tx, tw, tb = _torch(x, w, bias)
    check(product, torch.nn.functional.gelu(tx @ tw + tb).numpy().astype(np.float32))
    check(sums, np.zeros([m], np.float32) if k == 0 else x.sum(axis=1))


@pytest.mark.parametrize("mask", MASKS)
def test_a_residual_and_a_per_row_scale_over_a_batch_of_rows(mask):
    """x[B, T, K] @ W is one GEMM over B·T rows; the epilogue reads a same-shaped residual
    and a [B, T, 1] scale at each block's rows."""
    x, w = random_array([3, 37, 50], "float32", seed=1), random_array([50, 70], "float32", seed=2)
    residual, scale = random_array([3, 37, 70], "float32", seed=3), random_array([3, 37, 1], "float32", seed=4)

    def build(f, x, w, r, s):
        return (x @ w) * s + r

    result = run_flow(build, [x, w, residual, scale])
    tx, tw, tr, ts = _torch(x, w, residual, scale)
    check(result[0], ((tx @ tw) * ts + tr).numpy().astype(np.float32))
    (step,) = _steps(result.flow, cpu=mask)
    assert step.op.type == "MatMulCalculate" and step.variant != "python"


def test_a_batched_product_and_float64_and_two_outputs():
    """Batched products (a GEMM per matrix) each run the epilogue over their own block; a
    Calculate that also keeps its pre-activation writes both outputs."""
    a, b = random_array([4, 9, 13], "float64", seed=1), random_array([4, 13, 11], "float64", seed=2)
    bias = random_array([11], "float64", seed=3)

    def build(f, a, b, bias):
        h = a @ b + bias
        return [h, f.tanh(h)]

    result = run_flow(build, [a, b, bias])
    want = np.matmul(a, b) + bias
    check(result[0], want)
    check(result[1], np.tanh(want))
    (step,) = _steps(result.flow)
    assert step.op.type == "MatMulCalculate" and len(step.op.outputs) == 2


def test_an_integer_product_runs_its_epilogue_after_the_loop():
    a = np.random.default_rng(1).integers(-5, 5, (6, 7)).astype(np.int32)
    b = np.random.default_rng(2).integers(-5, 5, (7, 3)).astype(np.int32)
    result = run_flow(lambda f, a, b: f.abs(a @ b) + 1, [a, b])
    check(result[0], np.abs(a @ b) + 1)
    (step,) = _steps(result.flow)
    assert step.op.type == "MatMulCalculate" and step.kernel == "LoopMatMul"


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_product_split_over_every_core_runs_each_blocks_epilogue(gemm, monkeypatch):
    """Large enough to be cut into blocks of C, one per worker-pool part."""
    from ranvier.backends.cpu.parallel import split_thresholds

    monkeypatch.setenv("RANVIER_GEMM", gemm)
    m = max(67, math.isqrt(split_thresholds().flops // 2) // 64 + 3)
    x, w, bias = random_array([m, 64], "float32", seed=1), random_array([64, 150], "float32", seed=2), random_array([150], "float32")
    result = run_flow(lambda f, x, w, b: f.relu(x @ w - b), [x, w, bias])
    check(result[0], np.maximum(x.astype(np.float64) @ w - bias, 0).astype(np.float32))


@pytest.mark.parametrize("dtype,gemm", [("float32", "generated"), ("float32", "blas"), ("float64", "blas")])
def test_a_short_product_over_a_deep_k_adds_its_partial_products_before_the_epilogue(dtype, gemm, monkeypatch):
    """Cut along k over three parts, each computing all of C over its slice (slices 1 and 2
    into partial products in the workspace), then summed into C a share of rows per part,
    the bias and GELU run over each share of the sum."""
    from ranvier.backends.cpu.kernels import matmul

    monkeypatch.setenv("RANVIER_GEMM", gemm)
    monkeypatch.setattr(matmul, "thread_count", lambda: 3)
    monkeypatch.setattr(matmul, "worth_splitting", lambda flops=0, nbytes=0: True)
    x, w, bias = random_array([20, 901], dtype, seed=4), random_array([901, 40], dtype, seed=5), random_array([40], dtype, seed=6)
    result = run_flow(lambda f, x, w, b: f.gelu(x @ w + b), [x, w, bias])
    want = torch.nn.functional.gelu(*_torch(x @ w.astype(np.float64) + bias)).numpy()
    check(result[0], want.astype(dtype))
    (step,) = _steps(result.flow)
    assert step.op.type == "MatMulCalculate" and step.kernel == ("Gemm" if gemm == "generated" else "BlasGemm")
    parts = matmul.gemm_parts(step.op, 16, slices=True)
    assert [[(g.slice, g.k) for g in part] for part in parts] == [[(0, 301)], [(1, 301)], [(2, 299)]]


def test_weights_packed_ahead_of_time_take_the_epilogue_too(monkeypatch):
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    rng = np.random.default_rng(0)
    w, bias = rng.standard_normal((96, 200)).astype(np.float32), rng.standard_normal(200).astype(np.float32)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    xs = f.var("x", rv.DT_FLOAT, [40, 96])
    y = f.silu(xs @ f.const(w) + f.const(bias))
    y.var.out = True
    cell = rv.Compiler().compile(flow).cell("f")
    (step,) = cell.steps
    assert (step.op.type, step.kernel) == ("MatMulCalculate", "PackedGemm")
    data = cell.instance()
    data[xs] = x
    data.compute()
    check(data[y], torch.nn.functional.silu(torch.tensor(x, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64) + torch.tensor(bias)).numpy().astype(np.float32))


def _fused_types(build, shapes) -> list[str]:
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", rv.DT_FLOAT, shape) for i, shape in enumerate(shapes)]
    outputs = build(f, *handles)
    for t in outputs if isinstance(outputs, list) else [outputs]:
        t.var.out = True
    return sorted(s.op.type for s in _steps(flow))


def test_no_epilogue_where_the_product_is_needed_elsewhere_or_cannot_be_read_by_rows():
    # the product is itself an output, or read by two ops
    assert "MatMulCalculate" not in _fused_types(lambda f, x, w: [x @ w, f.tanh(x @ w)], [[5, 6], [6, 7]])
    assert "MatMulCalculate" not in _fused_types(lambda f, x, w: [f.tanh(x @ w), f.sum(x @ w)], [[5, 6], [6, 7]])
    # an input broadcast over the batch but not over the rows
    assert "MatMulCalculate" not in _fused_types(lambda f, x, w, b: (x @ w) + b, [[3, 5, 6], [6, 7], [3, 1, 7]])
    # an op whose output is larger than the product (it broadcasts the product); the Tanh
    # before such an Add is an epilogue of its own
    assert "MatMulCalculate" not in _fused_types(lambda f, x, w, y: (x @ w) + y, [[5, 6], [6, 7], [2, 5, 7]])
    assert sorted(_fused_types(lambda f, x, w, y: f.tanh(x @ w) + y, [[5, 6], [6, 7], [2, 5, 7]])) == ["Add", "MatMulCalculate"]
    # a [T, n] tensor under a [B, T, n] product repeats every T rows: not (row, column) strides
    assert "MatMulCalculate" not in _fused_types(lambda f, x, w, b: f.tanh(x @ w + b), [[3, 5, 6], [6, 7], [5, 7]])
    assert "MatMulCalculate" in _fused_types(lambda f, x, w, b: f.tanh(x @ w + b), [[3, 5, 6], [6, 7], [7]])


def test_a_training_step_fuses_its_epilogues_and_matches_torch():
    """An MLP's loss and gradients: bias and activation epilogues in the forward pass, and
    the gradients equal float64 PyTorch's and the unfused reference backend's."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in ((16, 12), (12, 20), (20,), (20, 5))]

    def build(f, x, w1, b1, w2):
        loss = f.sum(f.gelu(x @ w1 + b1) @ w2 * 0.5)
        grads = backward(loss, [w1, b1, w2])
        return [loss, *(grads[p.name] for p in (w1, b1, w2))]

    result = run_flow(build, arrays)
    tx, tw1, tb1, tw2 = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays)
    loss = (torch.nn.functional.gelu(tx @ tw1 + tb1) @ tw2 * 0.5).sum()
    loss.backward()
    check(result[0], loss.detach().numpy().astype(np.float32), rtol=1e-5)
    for got, want in zip(result[1:], (tw1, tb1, tw2)):
        check(got, want.grad.numpy().astype(np.float32), rtol=1e-4, atol=1e-4)
    assert "MatMulCalculate" in {s.op.type for s in _steps(result.flow)}


def test_a_malformed_epilogue_is_named():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w = f.var("x", rv.DT_FLOAT, [5, 6]), f.var("w", rv.DT_FLOAT, [6, 7])
    small = f.var("s", rv.DT_FLOAT, [5, 7])
    with pytest.raises(rv.ShapeError, match="in place"):
        f.op("MatMulCalculate", [x, w, small], attrs={"expr": "%1=Tanh(%0)"})
    with pytest.raises(rv.ShapeError, match="first output of the product's type"):
        f.op("MatMulCalculate", [x, w], attrs={"expr": "@0=Cast[dtype=float64](%0)"})
    with pytest.raises(rv.ShapeError, match="inner dimensions"):
        f.op("MatMulCalculate", [w, w], attrs={"expr": "@0=Tanh(%0)"})


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_wide_product_runs_its_epilogue_block_by_block(gemm, monkeypatch):
    """Each call is cut into blocks of columns that fit the L2 (here 700 rows: 96 columns),
    the last narrower; weights packed ahead of time are packed per block."""
    monkeypatch.setenv("RANVIER_GEMM", gemm)
    rng = np.random.default_rng(0)
    x, w, bias = rng.standard_normal((700, 30)), rng.standard_normal((30, 1000)), rng.standard_normal(1000)  # k 30 < 2 · 96
    x, w, bias = (a.astype(np.float32) for a in (x, w, bias))
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    xs = f.var("x", rv.DT_FLOAT, [700, 30])
    y = f.tanh(xs @ f.const(w) + f.const(bias))
    y.var.out = True
    data = rv.Compiler().compile(flow).cell("f").instance()
    data[xs] = x
    data[y] = np.nan
    data.compute()
    check(data[y], np.tanh(x.astype(np.float64) @ w + bias).astype(np.float32))


@pytest.mark.parametrize("ta", [False, True], ids=["a", "a-transposed"])
@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask", MASKS)
def test_a_product_by_a_constant_runs_its_epilogue_block_by_block_as_it_writes(matmul, mask, ta, monkeypatch):
    """Weights packed ahead of time: each call computes C a block at a time (the GEMM's
    blocks of columns, the last narrower, by rows that hold 256 KiB, the last fewer) and
    runs the epilogue (bias, Tanh, a residual) over each block as soon as it is written.
    Every element written (NaN first), against float64 on the operands the GEMM read: both
    rounded to bf16 on pairs, the constant alone on bf16 panels, neither in float32; A read
    as it is and transposed."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    rng = np.random.default_rng(7)
    x, w, bias, residual = (rng.standard_normal(shape, np.float32) for shape in ((1100, 200), (200, 900), (900,), (1100, 900)))
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    xs, rs = f.var("x", rv.DT_FLOAT, x.T.shape if ta else x.shape), f.var("r", rv.DT_FLOAT, residual.shape)
    y = f.tanh(f.matmul(xs, f.const(w), transpose_a=ta) + f.const(bias)) + rs
    y.var.out = True
    cell = rv.Compiler(cpu=mask, matmul=matmul).compile(flow).cell("f")
    (step,) = cell.steps
    kernel = step.kernel.split("[")[0]
    assert step.op.type == "MatMulCalculate" and kernel.startswith(PACKED_KERNEL), kernel
    data = cell.instance()
    data[xs], data[rs] = np.ascontiguousarray(x.T) if ta else x, residual
    data[y][...] = np.nan
    data.compute()

    def bf16(a):
        return a.astype(ml_dtypes.bfloat16).astype(np.float64)

    xa = bf16(x) if kernel.endswith("Dpbf16") else x.astype(np.float64)
    wb = bf16(w) if kernel != PACKED_KERNEL else w.astype(np.float64)
    expected = np.tanh(xa @ wb + bias) + residual
    assert_within_bound(data[y], expected, np.abs(xa) @ np.abs(wb) + np.abs(bias) + 0.1 * (1 + np.abs(residual)), 1e-5)


@pytest.mark.parametrize("mask", MASKS)
def test_a_packed_products_epilogue_blocks_are_the_gemms_blocks_of_columns_in_256_kib(mask):
    """The blocks of C a packed product with an epilogue computes one at a time: the GEMM's
    own blocks of columns (no more than the product's), by the most rows, a power of two,
    whose floats fit 256 KiB."""
    target = rv.Compiler(cpu=mask).backend.target
    for columns in (3072, 768, 130, 30):
        width, rows = _epilogue_tiles(target, columns)
        assert width == min(columns, sgemm.block_columns(target, packed=True))
        assert rows & (rows - 1) == 0  # whole strips of the GEMM's tiles
        assert 4 * width * rows <= 256 << 10 < 8 * width * rows


def test_a_convolutions_matrix_is_its_channels_by_positions():
    """A Conv2D's product [N, O, Ho, Wo] is written per image as O rows of Ho·Wo columns: a
    per-channel bias reads one value per row, a same-shaped residual every element, a
    per-image one a value per image; an input along one axis of the image only has no
    (row, column) strides."""
    assert epilogue_input_strides([1, 8, 1, 1], [3, 8, 5, 6], (1, 2)) == (0, 1, 0)
    assert epilogue_input_strides([3, 8, 5, 6], [3, 8, 5, 6], (1, 2)) == (240, 30, 1)
    assert epilogue_input_strides([3, 8, 1, 1], [3, 8, 5, 6], (1, 2)) == (8, 1, 0)
    assert epilogue_input_strides([8, 1, 1], [3, 8, 5, 6], (1, 2)) == (0, 1, 0)
    assert epilogue_input_strides([1, 1, 1, 6], [3, 8, 5, 6], (1, 2)) is None
    assert epilogue_input_strides([1, 1, 5, 6], [3, 8, 5, 6], (1, 2)) == (0, 0, 1)  # per position
    # a MatMul's rows run over its batch: a [T, n] input under [B, T, n] repeats every T rows
    assert epilogue_input_strides([7], [3, 5, 7], (0, 1)) == (0, 0, 1)
    assert epilogue_input_strides([5, 7], [3, 5, 7], (0, 1)) is None


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("size", "filters", "kernel"), [(3, 8, "WinogradConv"), (3, 8, "ConvTiles"), (1, 24, "ConvTiles"),
                                                          (1, 72, "ConvGemm")])
def test_a_residual_block_runs_bias_residual_and_relu_in_the_convolutions_epilogue(batch, mask, size, filters, kernel, monkeypatch):
    """relu(conv(x, w) + bias + skip), and a ReLU alone after a convolution, each one
    Conv2DCalculate on the convolution's kernel (for 3 × 3 filters the tiles, or Winograd's
    where the tiles leave them to it; for 1 × 1 the tiles for few filters, the implicit GEMM
    for more), every output element written; float64 PyTorch agrees (to float32 rounding of
    sums of |terms|)."""
    if kernel == "WinogradConv":
        monkeypatch.setattr(conv, "WINOGRAD_PAIRS", 0)
    arrays = {"x": random_array([batch, 6, 13, 11], "float32", seed=1),
              "w1": random_array([filters, 6, size, size], "float32", seed=2),
              "w2": random_array([filters, filters, size, size], "float32", seed=3),
              "bias": random_array([1, filters, 1, 1], "float32", seed=4),
              "skip": random_array([batch, filters, 13, 11], "float32", seed=5)}
    padding = size // 2
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    v = {name: f.var(name, rv.DT_FLOAT, a.shape) for name, a in arrays.items()}
    h = f.relu(f.conv2d(v["x"], v["w1"], padding=padding))
    y = f.relu(f.conv2d(h, v["w2"], padding=padding) + v["bias"] + v["skip"])
    y.var.out = True
    cell = rv.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f")
    assert [(s.op.type, s.kernel) for s in cell.steps] == [("Conv2DCalculate", kernel)] * 2
    assert all(s.variant != "python" for s in cell.steps)
    data = cell.instance()
    for name, value in arrays.items():
        data[v[name]] = value
    data[y] = np.full(y.shape, np.nan, np.float32)
    data.compute()
    t = {name: torch.tensor(a, dtype=torch.float64) for name, a in arrays.items()}
    inner = torch.relu(torch.nn.functional.conv2d(t["x"], t["w1"], padding=padding))
    want = torch.relu(torch.nn.functional.conv2d(inner, t["w2"], padding=padding) + t["bias"] + t["skip"]).numpy()
    bound = (torch.nn.functional.conv2d(inner, t["w2"].abs(), padding=padding) + t["bias"].abs() + t["skip"].abs()).numpy()
    got = np.array(data[y])
    assert np.isfinite(got).all()
    assert_within_bound(got, want, bound, 1e-5)


def test_the_fused_convolutions_reference_is_the_unfused_flows():
    x, w = random_array([2, 3, 7, 9], "float32", seed=1), random_array([4, 3, 3, 3], "float32", seed=2)
    bias = random_array([1, 4, 1, 1], "float32", seed=3)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.op("Conv2DCalculate", [f.var("x", rv.DT_FLOAT, x.shape), f.var("w", rv.DT_FLOAT, w.shape),
                                 f.var("b", rv.DT_FLOAT, bias.shape)],
             attrs={"strides": "2,1", "padding": "1,0", "expr": "$0=Add(%0,%1);@0=Tanh($0)"})
    y.var.out = True
    data = rv.Compiler("reference").compile(flow).cell("f").instance()
    data["f/x"], data["f/w"], data["f/b"] = x, w, bias
    data.compute()
    tx, tw, tb = _torch(x, w, bias)
    check(np.array(data[y]), torch.tanh(torch.nn.functional.conv2d(tx, tw, stride=(2, 1), padding=(1, 0)) + tb).numpy(),
          "float32", rtol=1e-5, atol=1e-6)


# ---- row ops: a norm or a norm's gradient, and the Calculate after it -----------------------

TESTED_OPS |= {"RMSNormCalculate", "LayerNormCalculate", "RMSNormGradCalculate"}


def _norms_and_their_epilogues(f, x, dy, g, b, res):
    """A norm's output rounded to bfloat16 for a product, a layer norm's through a GELU with
    a residual, and a norm's gradient added to the residual stream's (and rounded for the
    next product), its gain's terms kept apart."""
    rounded = f.cast(f.rms_norm(x, g), "bfloat16")
    activated = f.gelu(f.layer_norm(x, g, b)) + res * 0.5
    dx, scaled = f.op("RMSNormGrad", [x, dy, g], None, {"eps": 1e-5})
    stream = dx + res
    return rounded, activated, stream, f.cast(stream, "bfloat16"), scaled


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_norm_and_a_norms_gradient_run_their_epilogues_as_they_write(on_device, backend):
    inputs = [random_array([6, 40], "float32", seed=1), random_array([6, 40], "bfloat16", seed=2),
              random_array([40], "float32", seed=3), random_array([40], "float32", seed=4),
              random_array([6, 40], "float32", seed=5)]
    want = run_flow(_norms_and_their_epilogues, inputs)  # the reference (and the CPU)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", rv.dtypes.from_numpy(a.dtype), a.shape) for i, a in enumerate(inputs)]
    outputs = _norms_and_their_epilogues(f, *handles)
    for t in outputs:
        t.var.out = True
    cell = rv.Compiler(backend).compile(flow).cell("f")
    assert sorted(s.op.type for s in cell.steps) == ["LayerNormCalculate", "RMSNormCalculate", "RMSNormGradCalculate"]
    data = cell.instance()
    for handle, value in zip(handles, inputs):
        data[handle] = value
    data.compute()
    for t, expected in zip(outputs, want):
        check(np.array(data[t]), np.asarray(expected, np.float64), t.dtype)


@pytest.mark.parametrize("row_op", ["RMSNorm", "LayerNorm", "RMSNormGrad"])
def test_a_fused_row_op_means_its_row_op_then_its_program(row_op):
    x, dy, g = random_array([3, 5, 24], "float32", seed=6), random_array([3, 5, 24], "float32", seed=7), random_array([24], "float32", seed=8)
    scale = random_array([], "float32", seed=9)
    row_inputs = {"RMSNorm": [x, g], "LayerNorm": [x, g, g], "RMSNormGrad": [x, dy, g]}[row_op]

    def fused(f, *t):
        return f.op(f"{row_op}Calculate", list(t), None,
                    {"eps": 1e-5, "row_inputs": len(row_inputs), "expr": "$0=Mul(%0,%1);@0=Tanh($0);@1=Add(%0,%2)"})

    def apart(f, *t):
        made = f.op(row_op, list(t[:len(row_inputs)]), None, {"eps": 1e-5})
        made = list(made) if isinstance(made, tuple) else [made]
        return [f.tanh(made[0] * t[-2]), made[0] + t[-1], *made[1:]]

    got = run_flow(fused, [*row_inputs, scale, dy])
    want = run_flow(apart, [*row_inputs, scale, dy])
    assert len(got) == len(want) == (3 if row_op == "RMSNormGrad" else 2)
    for a, b in zip(got, want):
        check(a, np.asarray(b, np.float64), "float32")


def test_no_row_epilogue_where_the_output_is_read_elsewhere_or_broadcast():
    def build(f, x, g, b):
        y = f.rms_norm(x, g)
        shifted = y + b  # a bias along the row: read per column, not element by element
        return shifted, f.rms_norm(x, b) * 2.0, f.exp(f.rms_norm(g * 1.0, b))

    flow = run_flow(build, [random_array([4, 16], "float32", seed=1), random_array([16], "float32", seed=2),
                            random_array([16], "float32", seed=3)]).flow
    kinds = sorted(s.op.type for s in _steps(flow))
    assert "RMSNorm" in kinds and kinds.count("RMSNormCalculate") == 2, kinds


def test_a_malformed_row_epilogue_is_named():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, g = f.var("x", "float32", [4, 8]), f.var("g", "float32", [8])
    with pytest.raises(rv.ShapeError, match="RMSNormCalculate.*RMSNorm output's shape"):
        f.op("RMSNormCalculate", [x, g, f.var("v", "float32", [4, 1])], None, {"row_inputs": 2, "expr": "@0=Add(%0,%1)"})
    with pytest.raises(rv.ShapeError, match="row_inputs between 1 and 2"):
        f.op("RMSNormCalculate", [x, g], None, {"row_inputs": 3, "expr": "@0=Exp(%0)"})
