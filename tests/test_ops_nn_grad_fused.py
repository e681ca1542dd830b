"""SoftmaxCrossEntropyGrad, the fused backward of softmax cross-entropy, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FLOATS, assert_mentions, check, random_array, rng, run1, shape_error

TESTED_OPS = {"SoftmaxCrossEntropyGrad"}


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


def test_shape_errors():
    message = shape_error(
        lambda f, x, t, g: f.op("SoftmaxCrossEntropyGrad", [x, t, g]),
        [("x", "float32", [4, 10]), ("t", "int32", [4]), ("g", "float32", [5])],
    )
    assert_mentions(message, "SoftmaxCrossEntropyGrad", "g: float32[5]", "float32[4]")
