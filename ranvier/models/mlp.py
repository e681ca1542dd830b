"""A multilayer perceptron with any widths and a choice of activation."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ..errors import RanvierError
from ..flow.builder import Builder, Tensor
from .module import Module

ACTIVATIONS = {
    "relu": lambda b, x: b.relu(x),
    "gelu": lambda b, x: b.gelu(x),
    "gelu_tanh": lambda b, x: b.gelu(x, approximate="tanh"),
    "tanh": lambda b, x: b.tanh(x),
    "sigmoid": lambda b, x: b.sigmoid(x),
    "silu": lambda b, x: b.silu(x),
}


class MLP(Module):
    """sizes = [inputs, hidden..., outputs]; the activation follows every layer but the last."""

    name = "mlp"

    def __init__(self, sizes: Sequence[int], activation: str = "gelu", seed: int = 0):
        super().__init__(seed)
        if len(sizes) < 2 or min(sizes) < 1:
            raise RanvierError(f"MLP sizes must list at least an input and an output width, got {list(sizes)}")
        if activation not in ACTIVATIONS:
            raise RanvierError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.sizes = list(sizes)
        self.activation = activation
        self.reserve(sum((fan_in + 1) * fan_out for fan_in, fan_out in itertools.pairwise(sizes)), f"layer sizes {self.sizes}")
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            self.uniform_fan_in(f"W{i}", (fan_in, fan_out), fan_in)
            self.uniform_fan_in(f"b{i}", (fan_out,), fan_in)

    def forward(self, b: Builder, x: Tensor, p) -> Tensor:
        layers = len(self.sizes) - 1
        for i in range(layers):
            x = x @ p[f"W{i}"] + p[f"b{i}"]
            if i < layers - 1:
                x = ACTIVATIONS[self.activation](b, x)
        return x

    def describe(self) -> dict:
        return {"model": "mlp", "sizes": self.sizes, "activation": self.activation}
