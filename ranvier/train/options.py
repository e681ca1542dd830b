"""TrainOptions: how a trainer trains and compiles, one object for the three trainers.

`Trainer`, `CheckpointedStack` and `UnrolledTrainer` each take a `TrainOptions` (or its
fields as keyword arguments, which replace the object's), so a job builds its settings once
whichever trainer runs them. A trainer refuses by name a setting it cannot honour rather
than train without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from numbers import Integral, Real
from typing import Any

from ..distributed import World
from ..errors import RanvierError
from .loss_scale import DynamicLossScale
from .schedules import Schedule


@dataclass(frozen=True)
class TrainOptions:
    """schedule: the learning rate of each step (`ranvier.train.schedules`; a checkpoint
        records it and `load` restores it); default the optimizer's lr, constant.
    clip_norm: clip the global gradient norm to this (None: no clipping).
    track_grad_norm: also compute the global gradient norm (`grad_norm`) when not clipping.
    accumulate: split each batch into this many micro-batches; gradients accumulate in
        resident buffers and one update is applied per step.
    loss_scale: None, a number (static) or a DynamicLossScale.
    precision: "float32", or "bfloat16" / "float16": activations and their gradients stored in
        that type, matrix products on its inputs (see Compiler; where the backend cannot,
        float32). float16 turns on dynamic loss scaling unless `loss_scale` is given: its
        gradients would underflow below 6e-8 (`skipped_steps` counts the steps skipped).
    backend, cpu: the compiler backend and, for "cpu", features to mask (e.g. "-avx512").
        The CPU code flushes denormals (Compiler's denormals="flush"): optimizer state
        that decays below 1e-38 (Adam's moments of rarely used embedding rows) would
        otherwise slow every update it takes part in, on Intel cores 13-fold.
    matmul: "float32", or "bfloat16" for mixed-precision matrix products (see Compiler).
    world: the ranks of a data-parallel run (default: the MPI job this process was started
        in, or none). Each rank's inputs hold its share of the global batch; the gradients
        are averaged over the ranks before the update, so N ranks take the steps one process
        would take on the global batch. `step` and `set_dataset` take global batches.
    zero: ZeRO-1 in a data-parallel run: each rank holds the optimizer state of its share
        of the parameters and updates only those; the others' new values are gathered.
    """

    schedule: Schedule | None = None
    clip_norm: float | None = None
    track_grad_norm: bool = False
    accumulate: int = 1
    loss_scale: float | DynamicLossScale | None = None
    precision: str = "float32"
    backend: str = "cpu"
    cpu: str = ""
    matmul: str = "float32"
    world: World | None = None
    zero: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, Integral) or self.accumulate < 1:
            raise RanvierError(f"accumulate must be an integer >= 1, got {self.accumulate!r}")
        if self.clip_norm is not None and not (isinstance(self.clip_norm, Real) and self.clip_norm > 0):
            raise RanvierError(f"clip_norm must be above 0 (or None: no clipping), got {self.clip_norm!r}")

    @classmethod
    def merged(cls, options: TrainOptions | None, settings: Mapping[str, Any], trainer: str) -> TrainOptions:
        """`options` (default: every default) with `settings`, a trainer's keyword arguments,
        in place of its fields; a name that is not a field is refused."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise RanvierError(f"{trainer} got unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                               f"its options are {', '.join(names)}")
        if options is not None and not isinstance(options, TrainOptions):
            raise RanvierError(f"{trainer}'s options are a TrainOptions, not {type(options).__name__}")
        return replace(options or cls(), **settings)

    def refuse(self, trainer: str, reasons: Mapping[str, str]) -> None:
        """Refuse a setting `trainer` cannot honour (`reasons`: field → why) where it is
        not the default."""
        for name, why in reasons.items():
            value = getattr(self, name)
            if value != getattr(TrainOptions, name):
                raise RanvierError(f"{trainer} takes no {name}={value!r}: {why}")
