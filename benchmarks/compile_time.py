"""Cold compile time of a Llama training step on the CPU backend, and how much code it is.

Each repetition compiles the step (forward, backward, AdamW) with nothing compiled in the
cache, as a user's first run of a model finds it; what the machine measured once (its
split thresholds, its GEMM choices) is kept between repetitions, as it is between a
user's runs. Prints the median seconds, the lines of LLVM IR of the step's cell and the
share of the time LLVM took. With --cores N the code is generated as for an N-core
machine (each split kernel in N parts), still running on this one's cores: how compile
time grows with the core count, where a lent 16-core host is not at hand.
Run: python benchmarks/compile_time.py [--preset stories15M] [--batch 8] [--seq 256] [--cores 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="stories15M")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--cores", type=int, default=0, help="generate code as for this many cores (default: this machine's)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.cores:
        os.sched_getaffinity = lambda pid: set(range(args.cores))  # before ranvier reads it
    from common import machine, ranvier_trainer

    from ranvier.backends import compile_cache
    from ranvier.backends.cpu import backend, parallel_compile
    from ranvier.models.llama import PRESETS, Llama

    print(machine() + (f"; code generated as for {args.cores} cores" if args.cores else ""))
    lines: list[int] = []
    make_modules = backend.CPUBackend._modules

    def counting(self, cell, layout):
        modules = make_modules(self, cell, layout)
        if cell.name == "train":
            lines.append(sum(str(module).count("\n") for module in modules))
        return modules

    backend.CPUBackend._modules = counting
    compile_modules, in_llvm = parallel_compile.compile_modules, [0.0]

    def timed(modules, target):
        start = time.perf_counter()
        try:
            return compile_modules(modules, target)
        finally:
            in_llvm[0] += time.perf_counter() - start

    parallel_compile.compile_modules = timed
    measured = Path(tempfile.mkdtemp())  # what the machine measured, carried from one repetition to the next
    seconds, llvm_shares = [], []
    for repeat in range(args.repeats + 1):  # the first also measures the machine, and is not counted
        cache = Path(tempfile.mkdtemp())
        for kept in measured.glob("*.json"):
            shutil.copy(kept, cache)
        os.environ["RANVIER_CACHE"] = str(cache)
        compile_cache._MEMORY_CACHE.clear()
        in_llvm[0] = 0.0
        start = time.perf_counter()
        ranvier_trainer(Llama(PRESETS[args.preset], seed=0), args.batch, args.seq)
        took = time.perf_counter() - start
        for kept in cache.glob("*.json"):
            shutil.copy(kept, measured)
        shutil.rmtree(cache)
        if repeat:
            seconds.append(took)
            llvm_shares.append(in_llvm[0] / took)
    print(f"{args.preset} training step, batch {args.batch} x seq {args.seq}: {lines[-1]:,} lines of LLVM IR; "
          f"compiled in {statistics.median(seconds):.1f} s (median of {args.repeats}), "
          f"{statistics.median(llvm_shares):.0%} of it in LLVM")


if __name__ == "__main__":
    main()
