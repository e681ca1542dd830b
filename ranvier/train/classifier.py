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


def build_classifier(model, example_shape: Sequence[int], batch: int, eval_batch: int = 500, label_smoothing: float = 0.0,
                     uint8_divisor: float | None = None) -> Classifier:
    """With `uint8_divisor`, examples arrive as uint8 (pixels) and both functions divide
    them by it in float32 (255: to [0, 1], as numpy's `pixels / np.float32(255)`): a batch
    gathered from the dataset is a quarter of float32's bytes. The gather reads rows
    scattered over the dataset from memory; on MNIST's MLP it was a tenth of a step."""
    flow = Flow()
    train = Builder(flow, "train")
    dtype = dtypes.DT_UINT8 if uint8_divisor is not None else dtypes.DT_FLOAT

    def examples(b: Builder, x: Tensor) -> Tensor:
        return x if uint8_divisor is None else b.cast(x, dtypes.DT_FLOAT) / uint8_divisor

    x = train.var("x", dtype, [batch, *example_shape])
    labels = train.var("labels", dtypes.DT_INT32, [batch])
    params = model.parameters(train)
    loss = softmax_cross_entropy(model(train, examples(train, x), params), labels, label_smoothing, name="loss")

    infer = Builder(flow, "infer")
    x_eval = infer.var("x", dtype, [eval_batch, *example_shape])
    logits = model(infer, examples(infer, x_eval))
    logits.var.out = True
    return Classifier(flow, x, labels, loss, list(params.values()), logits)
