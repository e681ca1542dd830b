"""PyTorch modules trained by ranvier: its compiled step against PyTorch eager and torch.compile.

The same random-initialised Hugging Face modules on every side (no download): ResNet-18
(ResNetConfig's basic blocks, 1,000 classes) at batch 32 × 224², and GPT-2 small
(GPT2Config's defaults, dropout off unless --dropout) at batch 8 × 256 tokens. Each side
trains a copy of the module from the same weights with AdamW (lr 1e-4) on cross-entropy,
on the same batches: ranvier through `ranvier.train.compile_step` (torch.export, the
trainable ONNX import, one compiled cell), PyTorch eager, and PyTorch through torch.compile
(Inductor's C++ kernels on the CPU; --no-torch-compile leaves it out). Each side runs in a
process of its own, so each one's memory is its own: the processes start one after another,
each printing its compile time (ranvier's: export, import and compile; torch.compile's: its
first step, beside its second); then the sides alternate for --repeats repetitions of
--steps steps, and the medians of examples/s (tokens/s for GPT-2) and their ratios are
printed, with each side's peak memory (its process's peak resident set, torch.compile's
compile workers beside it), the machine, the instructions each side's libraries run, and
where ranvier's step spent its time. Compile times are as the caches find them;
--cold-compile compiles with nothing cached. --quick: tiny shapes, to check the script runs.
Run: python benchmarks/torch_train.py [--models resnet18 gpt2-small] [--steps 2] [--repeats 3]
     [--torch-compile | --no-torch-compile] [--cold-compile] [--dropout 0.1] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from common import (
    TORCH_COMPILE,
    WARM_CACHES,
    cold_caches,
    compile_options,
    compiles,
    machine,
    match_threads,
    summary,
    torch_features,
)

LR = 1e-4
Batch = tuple[np.ndarray, np.ndarray]


@dataclass
class Model:
    module: object  # a torch.nn.Module returning logits
    batches: list[Batch]
    unit: str  # what a step trains on: examples or tokens
    per_batch: int  # of them in a batch
    shape: str


def resnet18(quick: bool, steps: int, dropout: float) -> Model:
    import transformers

    batch, size = (2, 32) if quick else (32, 224)
    config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                       embedding_size=64, num_labels=1000)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((batch, 3, size, size), dtype=np.float32), rng.integers(0, 1000, batch)) for _ in range(steps)]
    return Model(logits(transformers.ResNetForImageClassification(config)), batches, "examples", batch,
                 f"batch {batch} x {size}²")


def gpt2_small(quick: bool, steps: int, dropout: float) -> Model:
    import transformers

    batch, seq = (2, 16) if quick else (8, 256)
    sizes = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000} if quick else {}
    config = transformers.GPT2Config(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **sizes)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, config.vocab_size, (batch, seq + 1)) for _ in range(steps)]
    return Model(logits(transformers.GPT2LMHeadModel(config)), [(w[:, :-1], w[:, 1:]) for w in windows], "tokens", batch * seq,
                 f"batch {batch} x {seq} tokens, dropout {dropout:g}")


MODELS: dict[str, Callable[[bool, int, float], Model]] = {"resnet18": resnet18, "gpt2-small": gpt2_small}


def logits(model):
    """A module computing a Hugging Face model's logits, what the loss is taken of (torch is
    imported here, after --cold-compile has pointed Inductor's cache elsewhere)."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x).logits

    return Logits()


def torch_step(module, compiled: bool) -> Callable[[np.ndarray, np.ndarray], float]:
    """PyTorch's training step of the module, eager or through torch.compile."""
    import torch
    import torch.nn.functional as F

    module.train()
    forward = torch.compile(module) if compiled else module
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        logits = forward(torch.from_numpy(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def ranvier_step(module, batch: Batch):
    """ranvier's compiled step of the module, and the words on what its compile took."""
    import ranvier.train
    from ranvier.train.optimizers import AdamW

    start = time.perf_counter()
    step = ranvier.train.compile_step(module, "cross_entropy", AdamW(lr=LR), batch=batch)
    seconds = time.perf_counter() - start
    return step, (f"compile ranvier        {seconds:9.2f} s  (torch.export and the ONNX import "
                  f"{seconds - step.compile_seconds:.1f} s, the cell {step.compile_seconds:.1f} s)")


def peak_memory() -> tuple[float, float]:
    """This process's peak resident set and its children's (Inductor's compile workers), GiB."""
    kib = 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / kib)


def serve(connection, side: str, name: str, quick: bool, steps: int, dropout: float) -> None:
    """One side of the race, in a process of its own: make its step (the module's weights
    are every side's: the same seed), take its first step, report what that took, then run
    --steps steps per request. The torch module goes once the step holds what it needs."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    match_threads(torch)
    model = MODELS[name](quick, steps, dropout)
    module, batches = model.module, model.batches
    model.module = None
    words = ""
    if side == "ranvier":
        step, words = ranvier_step(module, batches[0])
        del module
        gc.collect()
        step(*batches[0])
        step.reset_profile()
    else:
        step = torch_step(module, compiled=side == TORCH_COMPILE)
        start = time.perf_counter()
        if side == TORCH_COMPILE:
            if not compiles(lambda: step(*batches[0])):
                connection.send(None)
                return
            first = time.perf_counter() - start
            start = time.perf_counter()
            step(*batches[0])
            words = f"compile {TORCH_COMPILE:14s} {first:9.2f} s  (its first step; its second {time.perf_counter() - start:.1f} s)"
        else:
            step(*batches[0])  # its memory touched for the first time
    connection.send(words)
    while connection.recv() == "run":
        start = time.perf_counter()
        losses = [step(x, y) for x, y in batches[:steps]]
        connection.send((steps * model.per_batch / (time.perf_counter() - start), losses[-1]))
    connection.send((peak_memory(), step.profile().by_kernel() if side == "ranvier" else ""))


class Side:
    """A side's process, started (its step compiled and warm) before the next one starts,
    so that no two compiles share the cores."""

    def __init__(self, side: str, name: str, args: argparse.Namespace):
        context = multiprocessing.get_context("spawn")
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(theirs, side, name, args.quick, args.steps, args.dropout))
        self.process.start()
        theirs.close()  # theirs alone now: should the side fail, recv raises EOFError rather than waiting
        self.words = self.connection.recv()  # None: the side is left out
        if self.words:
            print(f"  {self.words}", flush=True)

    def run(self) -> tuple[float, float]:
        self.connection.send("run")
        return self.connection.recv()

    def close(self) -> tuple[tuple[float, float], str]:
        self.connection.send("close")
        result = self.connection.recv()
        self.process.join()
        return result


def race(name: str, args: argparse.Namespace, torch_compile: bool) -> None:
    model = MODELS[name](args.quick, args.steps, args.dropout)
    print(f"{name}: {sum(p.numel() for p in model.module.parameters()) / 1e6:.1f}M parameters, {model.shape}", flush=True)
    model.module = None  # each side makes its own
    gc.collect()
    names = ["ranvier", "pytorch", *([TORCH_COMPILE] if torch_compile else [])]
    sides = {side: Side(side, name, args) for side in names}
    sides = {side: worker for side, worker in sides.items() if worker.words is not None}
    names = list(sides)
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in names[repeat % len(names):] + names[:repeat % len(names)]:  # each side first in turn
            rate, loss = sides[side].run()
            rates[side].append(rate)
            print(f"  run {repeat + 1} {side:14s} {rate:9.1f} {model.unit}/s  loss {loss:.3f}", flush=True)
    closed = {side: worker.close() for side, worker in sides.items()}
    summary({side: statistics.median(values) for side, values in rates.items()}, f"{model.unit}/s", higher_is_better=True, digits=1)
    for side, ((peak, children), _) in closed.items():
        workers = f" (+ {children:.2f} GiB its compile workers)" if side == TORCH_COMPILE and children else ""
        print(f"{side:14s} peak memory {peak:6.2f} GiB{workers}")
    print(closed["ranvier"][1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per side (medians are compared)")
    parser.add_argument("--dropout", type=float, default=0.0, help="GPT-2's dropout (its config's default is 0.1)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script runs")
    compile_options(parser)
    args = parser.parse_args()
    compile_times = cold_caches() if args.cold_compile else WARM_CACHES
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    match_threads(torch)
    torch_compile = args.torch_compile is not False
    print(machine(torch))
    print(torch_features(torch, torch_compile))
    print(compile_times)
    for name in args.models:
        race(name, args, torch_compile)


if __name__ == "__main__":
    main()
