"""`ranvier train mnist` and `ranvier eval`: train a classifier on MNIST in a run directory.

A run directory holds config.json (everything needed to rebuild the model), metrics.jsonl
(one line per logged step), and checkpoint/ (weights, optimizer state, data position).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..dashboard import training_display
from ..data import mnist
from ..distributed import current_world
from ..errors import RanvierError
from ..models import CNN, MLP
from ..train import runs
from ..train.budget import plan_steps
from ..train.classifier import build_classifier
from ..train.optimizers import SGD, Adam, AdamW
from ..train.options import TrainOptions
from ..train.schedules import Constant
from ..train.trainer import Trainer
from . import rundir
from .peak import measured_peak

OPTIMIZERS = {"adam": Adam, "adamw": AdamW, "sgd": SGD}


@dataclass
class MnistConfig:
    model: str = "mlp"
    steps: int | None = 2340  # None: as many as fit in `minutes`
    minutes: float | None = None  # plan the steps to fit this training time
    batch: int = 128
    lr: float = 1e-3
    optimizer: str = "adam"
    hidden: list[int] = field(default_factory=lambda: [256])
    activation: str = "gelu"
    backend: str = "cpu"
    cpu: str = ""
    matmul: str = "float32"  # what ran: "bfloat16" is mixed-precision matrix products on AMX
    matmul_requested: str | None = None  # what --matmul asked for
    precision: str = "float32"  # what activations are stored in: "bfloat16" or "float16" on a GPU
    seed: int = 0
    data: str | None = None
    checkpoint_every: int = 500
    log_every: int = 10
    zero: bool = False  # ZeRO-1 over data-parallel workers (a resume may change it)

    # The settings above 0 (each width of `hidden`), as a saved config.json is checked.
    POSITIVE: ClassVar[set[str]] = {"steps", "minutes", "batch", "lr", "hidden", "checkpoint_every", "log_every"}


def make_model(config: MnistConfig):
    if config.model == "mlp":
        return MLP([784, *config.hidden, 10], activation=config.activation, seed=config.seed)
    if config.model == "cnn":
        return CNN(seed=config.seed)
    raise RanvierError(f"unknown model {config.model!r}; choose mlp or cnn")


def make_trainer(config: MnistConfig) -> tuple[Trainer, mnist.Split, mnist.Split]:
    if config.optimizer not in OPTIMIZERS:
        raise RanvierError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    train_split, test_split = mnist.load(config.data)
    model = make_model(config)
    shape = example_shape(config)
    # In a data-parallel run --batch is the global batch; each rank's cell takes its share.
    world = current_world()
    world.rows(config.batch)
    setup = build_classifier(model, shape, config.batch // world.size, uint8_divisor=255.0)
    trainer = Trainer(
        setup.loss,
        setup.params,
        OPTIMIZERS[config.optimizer](lr=config.lr),
        TrainOptions(schedule=Constant(config.lr), backend=config.backend, cpu=config.cpu,
                     matmul=rundir.requested_matmul(config), precision=config.precision, zero=config.zero),
        predict=setup.logits,
        inputs=[setup.x, setup.labels],
    )
    trainer.set_dataset([train_split.pixels(shape), train_split.labels.astype(np.int32)], seed=config.seed)
    return trainer, train_split, test_split


def example_shape(config: MnistConfig) -> list[int]:
    """One image as the model reads it."""
    return [784] if config.model == "mlp" else [1, 28, 28]


def _test_images(config: MnistConfig, split: mnist.Split) -> np.ndarray:
    return split.pixels(example_shape(config))


def read_config(run_dir: Path) -> MnistConfig:
    return runs.read_config(run_dir, MnistConfig, ("mnist",))


def resume_mnist(run_dir: Path, flags: dict | None = None, progress: bool = True, profile: bool = False,
                 dashboard: bool = False) -> float | None:
    """Continue a run from its checkpoint, to its configured steps or as `flags` (the
    command line's, by config field) say; None when it had finished."""
    config = read_config(run_dir)
    if not rundir.prepare_resume(run_dir, config, flags or {}):
        return None
    return train_mnist(config, run_dir, resume=True, progress=progress, profile=profile, dashboard=dashboard)


def train_mnist(config: MnistConfig, run_dir: Path, resume: bool = False, progress: bool = True, profile: bool = False,
                dashboard: bool = False) -> float:
    """Train (or resume) and return the test accuracy. Prints `test_accuracy=0.XXXX` last."""
    trainer, _, test_split = make_trainer(config)
    rundir.record_matmul(config, trainer.matmul)
    rundir.note_precision(config, trainer)
    rundir.write_config(run_dir, "mnist", config)
    metrics_path = run_dir / "metrics.jsonl"
    if resume and rundir.checkpoint_step(run_dir) is not None:
        trainer.load(run_dir / "checkpoint")
    rundir.keep_metrics_until(metrics_path, trainer.step_count)
    workers = f" on each of {trainer.world.size} workers" if trainer.world.size > 1 else ""
    print(f"compiled in {trainer.compile_seconds:.2f}s ({config.backend} backend){workers}; training from step {trainer.step_count}")
    progress, dashboard = progress and trainer.world.is_root, dashboard and trainer.world.is_root
    if trainer.world.size > 1:
        print(trainer.parallel_summary())

    if profile or dashboard:  # a GPU times each step only when asked
        trainer.reset_profile()
    start = time.perf_counter()
    with rundir.MetricsLog(metrics_path) as metrics:
        def run_step() -> tuple[int, float, float, dict]:
            step_start = time.perf_counter()
            loss = trainer.step()
            seconds = time.perf_counter() - step_start
            step = trainer.step_count
            if step % config.log_every == 0 or step == config.steps:
                metrics.write({"step": step, "loss": loss, "lr": config.lr, "elapsed": time.perf_counter() - start})
            if rundir.checkpoint_due(config, step):
                trainer.save(run_dir / "checkpoint")
            return step, loss, seconds, {}

        if config.minutes is not None:
            config.steps, plan = plan_steps(run_step, trainer.step_count, config.minutes, config.steps)
            print(plan)
            rundir.write_config(run_dir, "mnist", config)
        shown = training_display(
            config.steps, done=trainer.step_count, progress=progress, dashboard=dashboard,
            title=f"ranvier train mnist {config.model}: {run_dir}", compile_seconds=trainer.compile_seconds,
            flops_per_step=trainer.cell.flops * trainer.world.size, items_per_step=config.batch, unit="examples", profile=trainer.data.profile,
            peak=lambda: measured_peak(config.backend, trainer.matmul),
        )
        with shown as show:
            while trainer.step_count < config.steps:
                show(*run_step())
        if profile:
            print(trainer.data.profile())
        accuracy = trainer.accuracy(_test_images(config, test_split), test_split.labels)
        # Logged before the last checkpoint commits the run as finished: a run killed in between
        # resumes from the checkpoint before, which drops this line and logs it again.
        metrics.write({"step": trainer.step_count, "test_accuracy": accuracy})
    trainer.save(run_dir / "checkpoint")
    rundir.note_skipped(config, trainer)
    print(f"test_accuracy={accuracy:.4f}")
    return accuracy


def evaluate_run(run_dir: Path) -> float:
    config = read_config(run_dir)
    trainer, _, test_split = make_trainer(config)
    trainer.load(run_dir / "checkpoint")
    accuracy = trainer.accuracy(_test_images(config, test_split), test_split.labels)
    print(f"step={trainer.step_count}")
    print(f"test_accuracy={accuracy:.4f}")
    return accuracy
