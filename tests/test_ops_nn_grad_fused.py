"""The fused backward ops of the nn composites: SoftmaxCrossEntropyGrad against numpy,
RMSNormGrad against PyTorch's autograd in float64."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FLOATS, assert_mentions, check, random_array, rng, run1, run_flow, shape_error

TESTED_OPS = {"SoftmaxCrossEntropyGrad", "RMSNormGrad"}


def expected(logits, probs, dloss):
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    soft = e / e.sum(axis=-1, keepdims=True)
    return dloss.astype(np.float64)[..., None] * (soft * probs.sum(axis=-1, keepdims=True) - probs)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_class_targets(dtype, smoothing, index_dtype):
    logits = random_array([5, 3, 37], dtype, seed=4)
    labels = rng(5).integers(0, 37, (5, 3)).astype(index_dtype)
    dloss = random_array([5, 3], dtype, seed=6)
    got = run1(lambda f, x, t, g: f.op("SoftmaxCrossEntropyGrad", [x, t, g], None, {"label_smoothing": smoothing or None}), logits, labels, dloss)
    probs = np.eye(37)[labels] * (1 - smoothing) + smoothing / 37
    check(got, expected(logits, probs, dloss), dtype)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_probability_targets_of_any_mass(smoothing):
    logits = random_array([7, 19], "float32", seed=7)
    target = np.abs(random_array([7, 19], "float32", seed=8))  # rows need not sum to 1
    dloss = random_array([7], "float32", seed=9)
    got = run1(lambda f, x, t, g: f.op("SoftmaxCrossEntropyGrad", [x, t, g], None, {"label_smoothing": smoothing or None}), logits, target, dloss)
    probs = target.astype(np.float64) * (1 - smoothing) + smoothing / 19
    check(got, expected(logits, probs, dloss), "float32")


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_half_precision_logits_take_a_float32_loss_gradient_and_give_float32_losses(low):
    """The per-example loss of half-precision logits is float32 (SoftmaxCrossEntropy's
    type), so its gradient comes in float32; the fused loss output is float32 too, to
    float32's tolerance (a bfloat16 loss near 4 would be off by up to 0.008)."""
    logits = random_array([6, 41], low, seed=17, low=-6, high=6)
    labels = rng(18).integers(0, 41, (6,)).astype("int32")
    dloss = random_array([6], "float32", seed=19)
    got, loss = run_flow(lambda f, x, t, g: f.op("SoftmaxCrossEntropyGrad", [x, t, g], None, {"with_loss": True}),
                         [logits, labels, dloss])
    check(got, expected(logits, np.eye(41)[labels], dloss), low)
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1)) + x.max(axis=-1)
    check(loss, lse - x[np.arange(6), labels], "float32")


def test_shape_errors():
    message = shape_error(
        lambda f, x, t, g: f.op("SoftmaxCrossEntropyGrad", [x, t, g]),
        [("x", "float32", [4, 10]), ("t", "int32", [4]), ("g", "float32", [5])],
    )
    assert_mentions(message, "SoftmaxCrossEntropyGrad", "g: float32[5]", "float32[4]")
    message = shape_error(
        lambda f, x, t, g: f.op("SoftmaxCrossEntropyGrad", [x, t, g]),
        [("x", "bfloat16", [4, 10]), ("t", "int32", [4]), ("g", "float64", [4])],
    )
    assert_mentions(message, "SoftmaxCrossEntropyGrad", "g: float64[4]", "loss's type float32[4]")


# ---- RMSNormGrad ----------------------------------------------------------------------------------


def _rms_norm_gradients(x, dy, gamma, eps):
    """dx, and with gamma dy·x̂, from PyTorch's autograd through RMSNorm in float64."""
    torch = pytest.importorskip("torch")
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    xhat = xt / torch.sqrt((xt * xt).mean(dim=-1, keepdim=True) + eps)
    y = xhat if gamma is None else xhat * torch.tensor(gamma.astype(np.float64))
    dyt = torch.tensor(dy.astype(np.float64))
    y.backward(dyt)
    return [xt.grad.numpy()] + ([(dyt * xhat).detach().numpy()] if gamma is not None else [])


RMS_CASES = [([5, 3, 37], True), ([4, 300], True), ([6, 8], False), ([1, 2000], True)]


@pytest.mark.parametrize("shape,gain", RMS_CASES, ids=[f"{'x'.join(map(str, s))}-{'gain' if g else 'plain'}" for s, g in RMS_CASES])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_grad(dtype, shape, gain):
    x, dy = random_array(shape, dtype, seed=11), random_array(shape, dtype, seed=12)
    gamma = random_array(shape[-1:], dtype, seed=13) if gain else None
    inputs = [x, dy] + ([gamma] if gain else [])
    got = run_flow(lambda f, *t: f.op("RMSNormGrad", list(t), None, {"eps": 1e-5}), inputs)
    for value, want in zip(got, _rms_norm_gradients(x, dy, gamma, 1e-5)):
        check(value, want, dtype)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_rms_norm_grad_reads_a_half_precision_gradient_beside_float32_rows(low):
    x, dy = random_array([7, 96], "float32", seed=14), random_array([7, 96], low, seed=15)
    gamma = random_array([96], "float32", seed=16)
    dx, scaled = run_flow(lambda f, *t: f.op("RMSNormGrad", list(t), None, {"eps": 1e-6}), [x, dy, gamma])
    want_dx, want_scaled = _rms_norm_gradients(x, dy.astype(np.float32), gamma, 1e-6)
    check(dx, want_dx, "float32")
    check(scaled, want_scaled, "float32")  # the gain's terms in float32, as its gradient is


def test_rms_norm_grad_shape_errors():
    message = shape_error(lambda f, x, g: f.op("RMSNormGrad", [x, g]), [("x", "float32", [4, 10]), ("g", "float32", [4, 9])])
    assert_mentions(message, "RMSNormGrad", "f/g: float32[4x9]", "a gradient dy of x's shape")
    message = shape_error(lambda f, x, g, w: f.op("RMSNormGrad", [x, g, w]),
                          [("x", "float32", [4, 10]), ("g", "float32", [4, 10]), ("w", "float32", [9])])
    assert_mentions(message, "RMSNormGrad", "a gain of shape [10]")
    message = shape_error(lambda f, x, g: f.op("RMSNormGrad", [x, g]), [("x", "int32", [4, 10]), ("g", "float32", [4, 10])])
    assert_mentions(message, "RMSNormGrad", "floating-point inputs")
