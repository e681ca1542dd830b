"""Seeded shuffling and minibatch sampling with a resumable position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import RanvierError, brief


@dataclass
class BatchSampler:
    """Draws minibatch indices epoch by epoch; each epoch is a fresh seeded permutation.

    The state (seed, epoch, position) is all a checkpoint needs to resume the exact
    same sequence of batches. A remainder smaller than a batch is skipped each epoch.
    """

    size: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def __post_init__(self):
        if self.batch_size <= 0 or self.size < self.batch_size:
            raise RanvierError(f"cannot draw batches of {self.batch_size} from a dataset of {self.size} examples")
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _permutation(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.size) if self.shuffle else np.arange(self.size)
            self._order_epoch = self.epoch
        return self._order

    def next(self) -> np.ndarray:
        if self.position + self.batch_size > self.size:
            self.epoch += 1
            self.position = 0
        indices = self._permutation()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return indices

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "shuffle": self.shuffle}

    def restore(self, state: object, source: str) -> None:
        """Continue from a `state()` read from `source` (a checkpoint's file, for the error a
        state that is not one gets)."""
        counts = isinstance(state, dict) and all(type(state.get(name)) is int for name in ("seed", "epoch", "position"))
        if not counts or state["epoch"] < 0 or not 0 <= state["position"] <= self.size or \
                type(state.get("shuffle", True)) is not bool:
            raise RanvierError(f"{source}: sampler is {brief(state)}, expected this sampler's state: integers seed, "
                               f"epoch (0 or more) and position (0 to {self.size}), and a boolean shuffle")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.shuffle = state.get("shuffle", True)
        self._order_epoch = -1
