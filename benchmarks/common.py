"""What the benchmarks share: the machine line printed beside every figure, and the race
of training sides (alternating repetitions, medians, ratios against PyTorch)."""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(torch=None) -> str:
    """CPU, the cores this process may use, the kernel variant ranvier generates (with AMX
    where usable) and, given the torch module, the threads PyTorch runs."""
    from ranvier.backends.cpu.amx import amx_usable
    from ranvier.backends.cpu.parallel import thread_count
    from ranvier.backends.cpu.target import host_target

    target = host_target()
    variant = target.variant + ("+amx-bf16" if amx_usable(target) else "")
    line = f"CPU: {cpu_model()} ({target.name}), {thread_count()} cores, ranvier kernels [{variant}]"
    if torch is not None:
        line += f"; torch {torch.__version__} with {torch.get_num_threads()} threads"
    return line


def training_arguments(description: str, presets, default: str) -> argparse.ArgumentParser:
    """The options every training benchmark takes: the model preset and the step's shape."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default=default, choices=sorted(presets))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def match_threads(torch) -> None:
    """PyTorch runs as many threads as ranvier splits its kernels into (the cores this
    process may use), so neither side gets more of the machine."""
    from ranvier.backends.cpu.parallel import thread_count

    torch.set_num_threads(thread_count())


Step = Callable[[np.ndarray, np.ndarray], float]


def race(sides: dict[str, Step], batches: list[tuple[np.ndarray, np.ndarray]], repeats: int, vocab_size: int) -> dict[str, float]:
    """Train every side on the same token batches, the sides alternating each repetition
    (so the machine's slow and fast spells fall on all of them); print each run, the
    median tokens/s per side and each side's ratio to "pytorch". Returns the medians."""
    tokens = sum(x.size for x, _ in batches)
    for step in sides.values():
        step(*batches[0])  # warm up
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(repeats):
        for name, step in sides.items():
            start = time.perf_counter()
            losses = [step(x, y) for x, y in batches]
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"  run {repeat + 1} {name:12s} {rates[name][-1]:9.0f} tokens/s  loss {losses[-1]:.3f} "
                  f"(ln V = {math.log(vocab_size):.3f})", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, rate in medians.items():
        print(f"{name:12s} median {rate:9.0f} tokens/s")
    for name in sides:
        if name != "pytorch" and "pytorch" in medians:
            print(f"ratio {name}/pytorch = {medians[name] / medians['pytorch']:.2f} (tokens/s; above 1: ranvier is faster)")
    return medians


def token_batches(vocab_size: int, batch: int, seq: int, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` (tokens, targets) pairs of random token ids, identical for every side."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab_size, (batch, seq), dtype=np.int32), rng.integers(0, vocab_size, (batch, seq), dtype=np.int32))
            for _ in range(count)]
