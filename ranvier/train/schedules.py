"""Learning-rate schedules, evaluated on the host and fed to the compiled step as a scalar.

A schedule is any function of the step; those here are also written into a checkpoint
(`to_dict`) and read back from it (`from_dict`), so that a resumed run keeps its own."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from ..errors import RanvierError, brief
from .settings import check_settings

Schedule = Callable[[int], float]  # the learning rate of a step (counted from 0)


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


def to_dict(schedule: Schedule) -> dict[str, object] | None:
    """The schedule as a checkpoint records it; None for a function of the caller's, which a
    checkpoint cannot rebuild (a trainer loading it keeps the one it was given)."""
    if type(schedule) not in SCHEDULES.values():
        return None
    return {"type": type(schedule).__name__, **asdict(schedule)}


def from_dict(data: object, source: Path) -> Schedule:
    """The schedule `to_dict` wrote, read from `source` (a checkpoint's file, for the error
    a value that is not one gets)."""
    kind = SCHEDULES.get(data["type"]) if isinstance(data, dict) and isinstance(data.get("type"), str) else None
    if kind is None or not isinstance(data, dict):
        raise RanvierError(f"{source}: schedule is {brief(data)}, expected an object whose type is one of "
                           f"{', '.join(SCHEDULES)}")
    settings = {key: value for key, value in data.items() if key != "type"}
    names = [f.name for f in fields(kind)]
    required = [f.name for f in fields(kind) if f.default is MISSING]
    unknown, missing = sorted(set(settings) - set(names)), [n for n in required if n not in settings]
    if unknown or missing:
        raise RanvierError(f"{source}: the {kind.__name__} schedule has {', '.join(settings) or 'no settings'}, "
                           f"expected {', '.join(names)}")
    check_settings(source, kind, settings)
    return kind(**settings)
