"""A small convolutional network: two conv → ReLU → max-pool blocks and a dense head."""

from __future__ import annotations

from collections.abc import Sequence

from ..flow.builder import Builder, Tensor
from .module import Module


class CNN(Module):
    """For [N, C, H, W] inputs: conv(k×k, 'same' padding) → ReLU → 2×2 max-pool per block,
    then a dense layer to the classes."""

    name = "cnn"

    def __init__(
        self,
        input_shape: Sequence[int] = (1, 28, 28),
        channels: Sequence[int] = (8, 16),
        kernel: int = 5,
        classes: int = 10,
        seed: int = 0,
    ):
        super().__init__(seed)
        self.input_shape = list(input_shape)
        self.channels = list(channels)
        self.kernel = kernel
        self.classes = classes
        c, h, w = self.input_shape
        for i, out in enumerate(self.channels):
            self.uniform_fan_in(f"conv{i}", (out, c, kernel, kernel), c * kernel * kernel)
            self.uniform_fan_in(f"conv{i}_b", (out, 1, 1), c * kernel * kernel)
            c, h, w = out, h // 2, w // 2
        self.features = c * h * w
        self.uniform_fan_in("W", (self.features, classes), self.features)
        self.uniform_fan_in("b", (classes,), self.features)

    def forward(self, b: Builder, x: Tensor, p) -> Tensor:
        pad = self.kernel // 2
        for i in range(len(self.channels)):
            x = b.conv2d(x, p[f"conv{i}"], padding=pad) + p[f"conv{i}_b"]
            x = b.max_pool(b.relu(x), 2)
        x = b.reshape(x, [x.shape[0], self.features])
        return x @ p["W"] + p["b"]

    def describe(self) -> dict:
        return {"model": "cnn", "input_shape": self.input_shape, "channels": self.channels, "kernel": self.kernel, "classes": self.classes}
