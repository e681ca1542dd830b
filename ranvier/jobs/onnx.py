"""`ranvier train onnx`: train an ONNX model in a run directory, as a classifier on MNIST
(the bundled subset, or a folder of its IDX files) or as a language model on token shards
(from `ranvier data pretokenize` or `ranvier data tinystories`).

The model is imported trainable (`ranvier.onnx.load(..., trainable=True)`): its weights
learn, batch norm and dropout compute as in training. Its one input takes a batch of
examples (28 × 28 images in any layout of 784 values, or token windows of --seq), its
symbolic sizes bound to the batch and window; its first output is the logits, over at
least 10 classes or the tokenizer's vocabulary. The run ends with the model evaluated
with its trained weights in inference mode (test accuracy, or validation loss) and written
as `trained.onnx` beside the checkpoint; config.json records the model file's SHA-256, so a
resume on another model is refused.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx
from onnx import numpy_helper

from ..atomic import atomic_write_bytes
from ..dashboard import training_display
from ..data import mnist
from ..data.shards import MANIFEST, TokenShards
from ..distributed import current_world
from ..errors import RanvierError
from ..onnx import load, read_model
from ..train import runs
from ..train.budget import plan_steps
from ..train.checkpoint import METADATA
from ..train.options import TrainOptions
from ..train.schedules import Constant
from ..train.step import CompiledStep
from . import rundir
from .llama import prepare_data, restore_sampler_rng
from .mnist import OPTIMIZERS
from .peak import measured_peak

MNIST_CLASSES = 10
TRAINED = "trained.onnx"


@dataclass
class OnnxRunConfig:
    model: str = ""  # the .onnx file the run started from
    model_sha256: str = ""
    data: str | None = None  # MNIST's IDX folder (None: the bundled subset), or a folder of token shards
    task: str = "classify"  # "classify" (MNIST) or "lm" (token shards), from the data
    shards: list[dict] | None = None  # a language model's shard files: {"path", "bytes", "mtime_ns"}
    steps: int | None = 1000  # None: as many as fit in `minutes`
    minutes: float | None = None
    batch: int = 32
    seq: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    optimizer: str = "adamw"
    seed: int = 0
    backend: str = "cpu"
    cpu: str = ""
    matmul: str = "float32"  # what ran
    matmul_requested: str | None = None  # what --matmul asked for
    checkpoint_every: int = 500
    log_every: int = 10
    eval_batches: int = 8  # a language model's validation windows, batches of them
    zero: bool = False

    POSITIVE: ClassVar[set[str]] = {"steps", "minutes", "batch", "seq", "lr", "checkpoint_every", "log_every", "eval_batches"}
    NON_NEGATIVE: ClassVar[set[str]] = {"weight_decay"}


@dataclass
class OnnxRun:
    step: CompiledStep
    proto: onnx.ModelProto
    dims: dict[str, int]  # the model's symbolic sizes, as bound for training
    backend: str
    evaluate: Callable[[OnnxRun], tuple[str, float]]  # the trained model's metric: (name, value)
    train: TokenShards | None = None  # a language model's training tokens (a classifier's are the step's dataset)


def model_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def task_of(data: str | None) -> str:
    """A folder of token shards trains a language model; MNIST (or no --data), a classifier."""
    return "lm" if data is not None and (Path(data) / MANIFEST).is_file() else "classify"


def _bind(proto: onnx.ModelProto, sizes: list[int], path: str) -> tuple[onnx.ValueInfoProto, dict[str, int]]:
    """The model's one input, and its symbolic sizes bound to `sizes` (the batch, then the
    window), checking fixed ones against them."""
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [v for v in proto.graph.input if v.name not in initializers]
    if len(inputs) != 1:
        raise RanvierError(f"ranvier train onnx trains a model of one input (images or tokens); {path} has "
                           f"{len(inputs)}: {', '.join(v.name for v in inputs)}")
    (value,) = inputs
    dims: dict[str, int] = {}
    for index, (dim, size) in enumerate(zip(value.type.tensor_type.shape.dim, sizes)):
        if dim.HasField("dim_value") and dim.dim_value != size:
            raise RanvierError(f"{path}'s input {value.name!r} has {dim.dim_value} in dimension {index}, where the run "
                               f"puts {size} ({'the batch on each worker' if index == 0 else '--seq'}); export it with "
                               "that size, or a symbolic one")
        if dim.dim_param:
            dims[dim.dim_param] = size
    return value, dims


def build(config: OnnxRunConfig, run_dir: Path) -> OnnxRun:
    if config.optimizer not in OPTIMIZERS:
        raise RanvierError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    proto = read_model(config.model)
    world = current_world()
    world.rows(config.batch)
    local = config.batch // world.size
    decay = {"weight_decay": config.weight_decay}
    optimizer = OPTIMIZERS[config.optimizer](lr=config.lr, **decay)
    options = TrainOptions(schedule=Constant(config.lr), backend=config.backend, cpu=config.cpu,
                           matmul=rundir.requested_matmul(config), zero=config.zero)
    if config.task == "lm":
        value, dims = _bind(proto, [local, config.seq], config.model)
        flow = load(proto, dims=dims, trainable=True)
        step = CompiledStep(flow, "cross_entropy", optimizer, np.zeros([local, config.seq], np.int32), config.seed, options)
        _, manifest, paths = prepare_data(config, run_dir, vocab_size=0)
        classes = step.model_outputs[0].shape[-1]
        vocabulary = int(manifest["tokenizer"]["vocab_size"])
        if classes < vocabulary:
            raise RanvierError(f"{config.model}'s logits have {classes} classes, fewer than the tokenizer's "
                               f"{vocabulary} tokens")
        train, validation = TokenShards(paths).split(fraction=0.05)
        return OnnxRun(step, proto, dims, config.backend, _language_model(config, validation), train)
    value, dims = _bind(proto, [local], config.model)
    shape = [d.dim_value or dims[d.dim_param] for d in value.type.tensor_type.shape.dim]
    if math.prod(shape[1:]) != 28 * 28:
        raise RanvierError(f"a classifier trained on MNIST takes 28 × 28 images; {config.model}'s input {value.name!r} "
                           f"is {shape} ({math.prod(shape[1:])} values an example)")
    flow = load(proto, dims=dims, trainable=True)
    step = CompiledStep(flow, "cross_entropy", optimizer, np.zeros([local], np.int32), config.seed, options)
    classes = step.model_outputs[0].shape[-1]
    if classes < MNIST_CLASSES:
        raise RanvierError(f"{config.model}'s logits have {classes} classes; MNIST has {MNIST_CLASSES}")
    train_split, test_split = mnist.load(config.data)
    step.set_dataset([_images(train_split, shape), train_split.labels.astype(np.int32)], seed=config.seed)
    return OnnxRun(step, proto, dims, config.backend, _classifier(test_split, shape))


def _images(split: mnist.Split, shape: list[int]) -> np.ndarray:
    """The split's images as the model reads them: float32 in [0, 1], each of its shape."""
    return split.pixels(shape[1:]).astype(np.float32) / np.float32(255)


def trained_model(run: OnnxRun) -> onnx.ModelProto:
    """The model with the step's weights and running statistics as its initializers."""
    weights = run.step.weights()
    proto = onnx.ModelProto()
    proto.CopyFrom(run.proto)
    for index, tensor in enumerate(proto.graph.initializer):
        if tensor.name in weights:
            proto.graph.initializer[index].CopyFrom(numpy_helper.from_array(
                weights[tensor.name].astype(numpy_helper.to_array(tensor).dtype), tensor.name))
    return proto


def _inference(run: OnnxRun):
    """The trained model in inference mode, compiled: (instance, its input, its logits)."""
    from ..compiler import Compiler

    flow = load(trained_model(run), dims=run.dims)
    data = Compiler(run.backend).compile(flow).cell("main").instance()
    func = flow.funcs["main"]
    return data, flow.inputs(func)[0], flow.outputs(func)[0]


def _classifier(test: mnist.Split, shape: list[int]):
    def evaluate(run: OnnxRun) -> tuple[str, float]:
        data, x, logits = _inference(run)
        images, batch, hits = _images(test, shape), shape[0], 0
        for start in range(0, len(images), batch):
            chunk = images[start:start + batch]
            padded = np.zeros(shape, np.float32)
            padded[:len(chunk)] = chunk
            data[x] = padded
            data.compute()
            hits += int((np.asarray(data[logits])[:len(chunk), :MNIST_CLASSES].argmax(-1) == test.labels[start:start + batch]).sum())
        return "test_accuracy", hits / len(images)

    return evaluate


def _language_model(config: OnnxRunConfig, validation: TokenShards):
    def evaluate(run: OnnxRun) -> tuple[str, float]:
        data, tokens, logits = _inference(run)
        rng = np.random.default_rng(12345)  # the same windows every time
        losses = []
        for _ in range(config.eval_batches):
            x, y = validation.sample(config.batch // current_world().size, config.seq, rng)
            data[tokens] = x
            data.compute()
            z = np.asarray(data[logits], np.float64)
            z = z - z.max(-1, keepdims=True)
            log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
            losses.append(-np.take_along_axis(log_p, y[..., None].astype(np.int64), -1).mean())
        return "val_loss", float(np.mean(losses))

    return evaluate


def read_config(run_dir: Path) -> OnnxRunConfig:
    return runs.read_config(run_dir, OnnxRunConfig, ("onnx",))


def resume_onnx(run_dir: Path, flags: dict | None = None, progress: bool = True, dashboard: bool = False) -> float | None:
    """Continue a run from its checkpoint (on the same model file), to its configured steps
    or as `flags` say; None when it had finished."""
    config = read_config(run_dir)
    if not Path(config.model).is_file():
        raise RanvierError(f"{run_dir} trains {config.model}, which is missing; put it back to resume")
    if model_digest(config.model) != config.model_sha256:
        raise RanvierError(f"{config.model} has changed since {run_dir} started (its SHA-256 differs); "
                           "resume on the model the run started from, or start a new run")
    if not rundir.prepare_resume(run_dir, config, flags or {}):
        return None
    return train_onnx(config, run_dir, resume=True, progress=progress, dashboard=dashboard)


def train_onnx(config: OnnxRunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
               dashboard: bool = False) -> float:
    """Train (or resume); returns the final metric (test accuracy, or validation loss),
    printed last as `test_accuracy=...` or `validation_loss=...`."""
    if not resume:
        config.model_sha256 = model_digest(config.model)
        config.task = task_of(config.data)
    rundir.write_config(run_dir, "onnx", config)
    run = build(config, run_dir)
    step = run.step
    rundir.record_matmul(config, step.matmul)
    rundir.write_config(run_dir, "onnx", config)
    rng = np.random.default_rng(config.seed)
    if resume and rundir.checkpoint_step(run_dir) is not None:
        metadata = step.load(run_dir / "checkpoint")
        if config.task == "lm":
            restore_sampler_rng(rng, metadata.get("rng"), run_dir / "checkpoint" / METADATA)
    metrics_path = run_dir / "metrics.jsonl"
    rundir.keep_metrics_until(metrics_path, step.step_count)
    world = step.world
    progress, dashboard = progress and world.is_root, dashboard and world.is_root
    learnable = sum(v.size for v in step.flow.vars.values() if v.learnable)
    print(f"model: {config.model}, {learnable / 1e6:.2f}M weights learning, a {'language model' if config.task == 'lm' else 'classifier'}; "
          f"compiled in {step.compile_seconds:.1f}s{f' on each of {world.size} workers' if world.size > 1 else ''}; "
          f"from step {step.step_count}")
    items = config.batch * (config.seq if config.task == "lm" else 1)

    def checkpoint() -> None:
        step.save(run_dir / "checkpoint", {"rng": rng.bit_generator.state})

    with rundir.MetricsLog(metrics_path) as metrics:
        def run_step() -> tuple[int, float, float, dict]:
            batch = None
            if config.task == "lm":
                batch = run.train.sample(config.batch, config.seq, rng, rows=world.rows(config.batch))
            start = time.perf_counter()
            loss = step.step(batch)
            seconds = time.perf_counter() - start
            done = step.step_count
            record = {"step": done, "loss": loss, "lr": config.lr, "ms": seconds * 1e3}
            if done % config.log_every == 0 or done == config.steps:
                metrics.write(record)
            if rundir.checkpoint_due(config, done):
                checkpoint()
            return done, loss, seconds, record

        if config.minutes is not None:
            config.steps, plan = plan_steps(run_step, step.step_count, config.minutes, config.steps)
            print(plan)
            rundir.write_config(run_dir, "onnx", config)
        shown = training_display(
            config.steps, done=step.step_count, progress=progress, dashboard=dashboard,
            title=f"ranvier train onnx {Path(config.model).name}: {run_dir}", compile_seconds=step.compile_seconds,
            flops_per_step=step.cell.flops * world.size, items_per_step=items, unit="tokens" if config.task == "lm" else "examples",
            profile=step.profile, peak=lambda: measured_peak(config.backend, step.matmul),
        )
        with shown as show:
            while step.step_count < config.steps:
                show(*run_step())
        name, value = run.evaluate(run)
        metrics.write({"step": step.step_count, name: value})
    checkpoint()
    if world.is_root:
        atomic_write_bytes(run_dir / TRAINED, trained_model(run).SerializeToString())
    print(f"{'validation_loss' if name == 'val_loss' else name}={value:.4f} (the trained model: {run_dir / TRAINED})")
    return value
