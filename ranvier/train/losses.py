"""Loss functions as graph builders returning a scalar loss tensor."""

from __future__ import annotations

from ..flow.builder import Tensor


def softmax_cross_entropy(logits: Tensor, target: Tensor, label_smoothing: float | None = None, name: str | None = None) -> Tensor:
    """Mean cross-entropy of logits [..., C] against integer classes [...] or probabilities [..., C].

    Its gradient is the analytic softmax − target (no log in the backward), fp16-safe.
    """
    b = logits.builder
    per_example = b.softmax_cross_entropy(logits, target, label_smoothing)
    return b.mean(per_example, name=name)


def mse(prediction: Tensor, target: Tensor, name: str | None = None) -> Tensor:
    """Mean squared error."""
    b = prediction.builder
    diff = prediction - target
    return b.mean(diff * diff, name=name)
