"""Wire a model into a classification flow: a training function and an inference function
that share the model's parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import dtypes
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow
from .losses import softmax_cross_entropy


@dataclass
class Classifier:
    flow: Flow
    x: Tensor
    labels: Tensor
    loss: Tensor
    params: list[Tensor]
    logits: Tensor  # in the inference function


def build_classifier(model, example_shape: Sequence[int], batch: int, eval_batch: int = 500, label_smoothing: float = 0.0) -> Classifier:
    flow = Flow()
    train = Builder(flow, "train")
    x = train.var("x", dtypes.DT_FLOAT, [batch, *example_shape])
    labels = train.var("labels", dtypes.DT_INT32, [batch])
    params = model.parameters(train)
    loss = softmax_cross_entropy(model(train, x, params), labels, label_smoothing, name="loss")

    infer = Builder(flow, "infer")
    x_eval = infer.var("x", dtypes.DT_FLOAT, [eval_batch, *example_shape])
    logits = model(infer, x_eval)
    logits.var.out = True
    return Classifier(flow, x, labels, loss, list(params.values()), logits)
