"""The base of ranvier's models: parameters declared once per flow, applied in any function."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..flow.builder import Builder, Tensor
from ..flow.flags import VarFlags
from ..flow.graph import Flow


class Module:
    """A model owns named initial values; `parameters(b)` declares them as learnable
    globals of b's flow (once), so every function built from the same flow shares them."""

    name = "model"

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.initial: dict[str, np.ndarray] = {}

    def add(self, key: str, value: np.ndarray) -> None:
        self.initial[key] = np.ascontiguousarray(value, dtype=np.float32)

    def uniform_fan_in(self, key: str, shape, fan_in: int) -> None:
        """PyTorch's default Linear/Conv initialization: U(−1/√fan_in, 1/√fan_in)."""
        bound = 1.0 / math.sqrt(fan_in)
        self.add(key, self.rng.uniform(-bound, bound, size=shape))

    def parameters(self, b: Builder) -> dict[str, Tensor]:
        flow: Flow = b.flow
        result = {}
        for key, value in self.initial.items():
            name = f"{self.name}/{key}"
            var = flow.vars.get(name)
            if var is None:
                var = flow.add_var(name, "float32", value.shape)
                var.set_data(value)
                var.flags |= VarFlags.LEARNABLE
            result[key] = b.wrap(var)
        return result

    def __call__(self, b: Builder, x: Tensor, params: Mapping[str, Tensor] | None = None) -> Tensor:
        """Apply the model to x; `params` may override parameter values (keyed "W0" or "mlp/W0"),
        e.g. with the updated values an unrolled training step threads through."""
        values = self.parameters(b)
        prefix = f"{self.name}/"
        for key, value in (params or {}).items():
            values[key.removeprefix(prefix)] = value
        return self.forward(b, x, values)

    def forward(self, b: Builder, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError
