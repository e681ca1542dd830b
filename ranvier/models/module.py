"""The base of ranvier's models: parameters declared once per flow, applied in any function."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from ..flow.builder import Builder, Tensor
from ..flow.flags import VarFlags
from ..flow.graph import Flow
from ..limits import check_allocation
from ..runtime import aligned_array


class Module:
    """A model owns named initial values; `parameters(b)` declares them as learnable
    globals of b's flow (once), so every function built from the same flow shares them.

    With `allocate=False` a model records only its parameters' shapes: its flow can be
    built and counted (a 6-billion-parameter preset's summary) without the weights."""

    name = "model"

    def __init__(self, seed: int = 0, allocate: bool = True):
        self.rng = np.random.default_rng(seed)
        self.allocate = allocate
        self.initial: dict[str, np.ndarray] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def reserve(self, count: int, sizes: str) -> None:
        """Before drawing any: refuse `count` float32 parameters past ranvier's memory limit,
        naming the `sizes` (from a config) they come from."""
        if self.allocate:
            check_allocation(4 * count, f"{self.name}'s {count:,} parameters ({sizes})")

    def add(self, key: str, value: np.ndarray) -> None:
        self.shapes[key] = tuple(np.shape(value))
        if self.allocate:
            # aligned as a network's globals are, so an inference network can use them in place
            self.initial[key] = aligned_array(value, np.float32)

    def _declare(self, key: str, shape, values: Callable[[], np.ndarray]) -> None:
        """A parameter of `shape` whose initial values `values()` makes (not called, and
        nothing drawn, without allocating)."""
        if self.allocate:
            self.add(key, values())
        else:
            self.shapes[key] = tuple(shape)

    def normal(self, key: str, shape, std: float = 0.02) -> None:
        """N(0, std²) values."""
        self._declare(key, shape, lambda: self.rng.normal(0.0, std, size=shape))

    def ones(self, key: str, shape) -> None:
        self._declare(key, shape, lambda: np.ones(shape))

    def uniform_fan_in(self, key: str, shape, fan_in: int) -> None:
        """PyTorch's default Linear/Conv initialization: U(−1/√fan_in, 1/√fan_in)."""
        bound = 1.0 / math.sqrt(fan_in)
        self._declare(key, shape, lambda: self.rng.uniform(-bound, bound, size=shape))

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())

    def parameters(self, b: Builder) -> dict[str, Tensor]:
        flow: Flow = b.flow
        result = {}
        for key, shape in self.shapes.items():
            name = f"{self.name}/{key}"
            var = flow.vars.get(name)
            if var is None:
                value = self.initial.get(key)
                var = flow.add_var(name, "float32", shape if value is None else value.shape)
                if value is not None:
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
