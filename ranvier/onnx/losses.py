"""ONNX's losses over class scores: NegativeLogLikelihoodLoss, and SoftmaxCrossEntropyLoss
(the same over the log-softmax of its scores, which it can also return).

The classes are axis 1 of the input [N, C, d1, ...]; each target names one class per
[N, d1, ...] position, or the ignore_index, which adds nothing and counts for nothing.
The picked log-probabilities are one Gather from the input laid out class-last, at
position × C + target (an ignored position reads class 0 and is masked out), so a -inf
among the classes not picked never turns a product into NaN.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from ..flow.builder import Tensor
from .node import Node, converts

REDUCTIONS = ("none", "sum", "mean")


def _negative_log_likelihood(node: Node, log_probs: Tensor, target: Tensor, weight: Tensor | None) -> Tensor:
    n, classes = log_probs.shape[:2]
    if log_probs.rank < 2 or target.shape != [n, *log_probs.shape[2:]]:
        raise node.error(f"its target of shape {target.shape} is not [N, d1, ...] of its input of shape "
                         f"{log_probs.shape} ([N, C, d1, ...])")
    if target.dtype not in (dtypes.DT_INT32, dtypes.DT_INT64):
        raise node.error(f"its target is {target.dtype}, not int32 or int64 class indices")
    if weight is not None and weight.shape != [classes]:
        raise node.error(f"its weight of shape {weight.shape} is not one value per class, [{classes}]")
    reduction = node.attr("reduction", "mean")
    if reduction not in REDUCTIONS:
        raise node.error(f"reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}")
    target = target.cast(dtypes.DT_INT64) if target.dtype != dtypes.DT_INT64 else target
    ignore_index = node.attr("ignore_index")
    kept = None if ignore_index is None else node.b.not_equal(target, node.b.const(np.int64(ignore_index)))
    picked_class = target if kept is None else node.b.cond(kept, target, node.b.const(np.int64(0)))

    positions = math.prod(target.shape)
    class_last = log_probs.reshape([n, classes, positions // n]).transpose([0, 2, 1]).reshape([positions * classes])
    starts = np.arange(positions, dtype=np.int64).reshape(target.shape) * classes
    loss = -node.b.gather(class_last, picked_class + node.importer.as_tensor(starts, ""))
    share = None if weight is None else node.b.gather(weight, picked_class)
    if kept is not None:
        mask = kept.cast(log_probs.dtype)
        share = mask if share is None else share * mask
    if share is not None:
        loss = loss * share
    if reduction == "none":
        return loss
    total = node.b.sum(loss, axis=list(range(loss.rank)))
    if reduction == "sum":
        return total
    return total / (node.b.sum(share, axis=list(range(share.rank))) if share is not None else float(positions))


@converts("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(node: Node):
    weight = node.tensor(2) if node.optional(2) is not None else None
    return _negative_log_likelihood(node, node.tensor(0), node.tensor(1), weight)


@converts("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(node: Node):
    scores = node.tensor(0)
    if scores.rank < 2:
        raise node.error(f"its scores of shape {scores.shape} are not [N, C, d1, ...]")
    log_probs = node.b.log_softmax(scores, axis=1)
    weight = node.tensor(2) if node.optional(2) is not None else None
    return [_negative_log_likelihood(node, log_probs, node.tensor(1), weight), log_probs]
