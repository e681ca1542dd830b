"""Learning-rate schedules, evaluated on the host and fed to the compiled step as a scalar."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Constant:
    lr: float

    def __call__(self, step: int) -> float:
        return self.lr


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup from 0 over `warmup` steps, then cosine decay to `floor` at `total` steps."""

    lr: float
    warmup: int
    total: int
    floor: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if step >= self.total:
            return self.floor
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return self.floor + 0.5 * (self.lr - self.floor) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LinearDecay:
    """Optional linear warmup, then linear decay from `lr` to `floor` at `total` steps."""

    lr: float
    total: int
    floor: float = 0.0
    warmup: int = 0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.lr + (self.floor - self.lr) * progress


SCHEDULES = {cls.__name__: cls for cls in (Constant, WarmupCosine, LinearDecay)}


def to_dict(schedule) -> dict:
    return {"type": type(schedule).__name__, **asdict(schedule)}


def from_dict(data: dict):
    data = dict(data)
    return SCHEDULES[data.pop("type")](**data)
