"""Batch norm in training mode as ops (BatchNormTrain and its gradient BatchNormTrainGrad):
the CPU kernels (a channel's planes in two passes, channels shared over the cores) and the
decomposition into elementwise ops and reductions against the float64 reference and
PyTorch, over ranks, planes that end in a partial vector, the AVX2 and SSE variants, a
mean far larger than the spread, and every output element written; shape errors named.
The ReLU after it runs as y is written (BatchNormTrainCalculate), y never stored. (The
gradient against finite differences and PyTorch: tests/test_vjp.py's cases.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_mentions, check, fused_outputs_on_reference_and_cpu, random_array, run_flow, shape_error

import ranvier as rv
from ranvier.backends.cpu.kernels import batch_norm as kernels
from ranvier.ops.batch_norm import batch_norm_train, batch_norm_train_grad

TESTED_OPS = {"BatchNormTrain", "BatchNormTrainGrad", "BatchNormTrainCalculate"}

SHAPES = [
    (4, 3, 9, 7),  # planes of 63: whole vectors and a tail
    (2, 5, 37),  # rank 3
    (6, 4),  # rank 2: planes of one element
    (3, 2, 2, 3, 5),  # rank 5
    (32, 16, 5, 5),  # many short planes per channel
]
VARIANTS = [("", "float32"), ("", "float64"), ("-avx512", "float32"), ("-avx512,-avx2", "float32")]


def _run(shape, dtype, mask, values, backend="cpu", eps=1e-5):
    """y, mean, var, dx, dgamma, dbeta computed by one cell, every output NaN-filled first."""
    c = shape[1]
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, dy, gamma, beta = f.var("x", dtype, shape), f.var("dy", dtype, shape), f.var("gamma", dtype, [c]), f.var("beta", dtype, [c])
    y, mean, var = f.op("BatchNormTrain", [x, gamma, beta], None, {"eps": eps})
    dx, dgamma, dbeta = f.op("BatchNormTrainGrad", [x, dy, gamma, mean, var], None, {"eps": eps})
    outputs = [y, mean, var, dx, dgamma, dbeta]
    for t in outputs:
        t.var.out = True
    cell = rv.Compiler(backend, cpu=mask, cache=False).compile(flow).cell("f")
    data = cell.instance()
    for handle, value in zip((x, dy, gamma, beta), values):
        data[handle] = value
    for t in outputs:
        data[t] = np.full(t.shape, np.nan, dtype)
    data.compute()
    return cell, [np.array(data[t]).astype(np.float64) for t in outputs]


def _values(shape, dtype, seed=1, mean=0.0):
    c = shape[1]
    return [random_array(shape, dtype, seed=seed) + np.asarray(mean, dtype), random_array(shape, dtype, seed=seed + 1),
            random_array([c], dtype, seed=seed + 2), random_array([c], dtype, seed=seed + 3)]


def _expected(values, eps=1e-5):
    x, dy, gamma, beta = (v.astype(np.float64) for v in values)
    y, mean, var = batch_norm_train(x, gamma, beta, eps)
    return [y, mean, var, *batch_norm_train_grad(x, dy, gamma, mean, var, eps)]


def _close(got, want, dtype) -> None:
    """Each output within its dtype's rounding of the values it is made of."""
    tolerance = 2e-5 if dtype == "float32" else 1e-12
    for g, w in zip(got, want):
        assert not np.isnan(g).any()  # every element written
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance * max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("mask,dtype", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_the_kernels_match_the_reference(shape, mask, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "thread_count", lambda: 2)
    monkeypatch.setattr(kernels, "worth_splitting", lambda flops=0, nbytes=0: True)
    values = _values(shape, dtype)
    cell, got = _run(shape, dtype, mask, values)
    assert [step.kernel for step in cell.steps] == ["BatchNormChannels", "BatchNormChannelsGrad"]
    _close(got, _expected(values), dtype)


def test_the_kernels_match_pytorch():
    shape = (8, 6, 11, 13)
    x, dy, gamma, beta = _values(shape, "float32", seed=5)
    _, (y, mean, var, dx, dgamma, dbeta) = _run(shape, "float32", "", [x, dy, gamma, beta])
    tx, tg, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, gamma, beta))
    ty = torch.nn.functional.batch_norm(tx, None, None, tg, tb, training=True, eps=1e-5)
    ty.backward(torch.tensor(dy, dtype=torch.float64))
    for got, want in ((y, ty), (dx, tx.grad), (dgamma, tg.grad), (dbeta, tb.grad)):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(mean, x.astype(np.float64).mean((0, 2, 3)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var, x.astype(np.float64).var((0, 2, 3)), rtol=1e-5)


@pytest.mark.parametrize("mask", ["", "-avx512"])
def test_a_mean_far_larger_than_the_spread_loses_nothing(mask):
    """x around 1000 with a spread of 1: Σx² − n·mean² in float32 would lose the variance to
    rounding; the planes' deviations and the mean taken off in x's dtype keep it."""
    shape = (16, 3, 10, 12)
    values = _values(shape, "float32", seed=9, mean=1000.0)
    _, got = _run(shape, "float32", mask, values)
    _close(got, _expected(values), "float32")


def test_half_precision_decomposes_into_ops():
    """The kernels take float32 and float64; bfloat16 runs the ops' decomposition."""
    shape = (4, 3, 5, 6)
    values = _values(shape, "bfloat16", seed=3)
    cell, got = _run(shape, "bfloat16", "", values)
    assert not {"BatchNormChannels", "BatchNormChannelsGrad"} & {step.kernel for step in cell.steps}
    for g, w in zip(got, _expected(values)):
        np.testing.assert_allclose(g, w, rtol=5e-2, atol=5e-2 * max(1.0, np.abs(w).max()))


def test_shape_errors_name_what_was_expected():
    message = shape_error(lambda f, x, g: f.op("BatchNormTrain", [x, g, g], None, {"eps": 1e-5}),
                          [("x", "float32", [2, 3, 4]), ("g", "float32", [4])])
    assert_mentions(message, "BatchNormTrain", "per-channel inputs of shape [3]")
    message = shape_error(lambda f, x, g: f.op("BatchNormTrain", [x, g, g], None, {"eps": 1e-5}),
                          [("x", "float32", [3]), ("g", "float32", [3])])
    assert_mentions(message, "BatchNormTrain", "rank 2 or more")
    message = shape_error(lambda f, x, dy, g: f.op("BatchNormTrainGrad", [x, dy, g, g, g], None, {"eps": 1e-5}),
                          [("x", "float32", [2, 3, 4]), ("dy", "float32", [2, 3, 5]), ("g", "float32", [3])])
    assert_mentions(message, "BatchNormTrainGrad", "a gradient dy of x's shape [2, 3, 4]")


@pytest.mark.parametrize("mask,dtype", VARIANTS)
def test_the_relu_after_it_runs_as_y_is_written(mask, dtype, monkeypatch):
    """BatchNormTrainCalculate: a CNN's ReLU, a second output through a residual and y
    rounded to bfloat16 as a third, from one pass that never stores y."""
    monkeypatch.setattr(kernels, "thread_count", lambda: 2)
    monkeypatch.setattr(kernels, "worth_splitting", lambda flops=0, nbytes=0: True)
    shape = (3, 4, 6, 11)
    x, residual, gamma, beta = _values(shape, dtype, seed=11)
    def relu_residual_and_bf16(f, x, residual, gamma, beta):
        y, mean, var = f.op("BatchNormTrain", [x, gamma, beta], None, {"eps": 1e-5})
        return [y.relu(), y * 0.5 + residual, f.cast(y, "bfloat16"), mean, var]

    outputs = fused_outputs_on_reference_and_cpu(relu_residual_and_bf16, {"x": x, "residual": residual, "gamma": gamma, "beta": beta},
                                                 mask, [("BatchNormChannels", "BatchNormTrainCalculate")])
    for got, want in zip(outputs["cpu"], outputs["reference"]):
        assert not np.isnan(got).any()
        tolerance = 8e-3 if got is outputs["cpu"][2] else (2e-5 if dtype == "float32" else 1e-12)
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * max(1.0, np.abs(want).max()))


def test_a_fused_batch_norm_means_the_batch_norm_then_its_program():
    values = _values((2, 3, 4, 5), "float32", seed=13)

    def fused(f, x, other, gamma, beta):
        return f.op("BatchNormTrainCalculate", [x, gamma, beta, other], None,
                    {"eps": 1e-5, "row_inputs": 3, "expr": "@0=Relu(%0);@1=Add(%0,%1)"})

    def apart(f, x, other, gamma, beta):
        y, mean, var = f.op("BatchNormTrain", [x, gamma, beta], None, {"eps": 1e-5})
        return y.relu(), y + other, mean, var

    got, want = run_flow(fused, values), run_flow(apart, values)
    for a, b in zip(got, want):
        check(a, np.asarray(b, np.float64), "float32")
