"""Cold compile time of a Llama training step on the CPU backend, and how much code it is.

Each repetition compiles the step (forward, backward, AdamW) with nothing compiled in the
cache, as a user's first run of a model finds it; what the machine measured once (its
split thresholds, its GEMM choices) is kept between repetitions, as it is between a
user's runs. Prints the median seconds, the lines of LLVM IR of the step's cell and the
share of the time LLVM took. With --cores N the code is generated as for an N-core
machine (each split kernel in N parts), still running on this one's cores: how compile
time grows with the core count, where a lent 16-core host is not at hand.
With --backend cuda it times the step as the CUDA backend compiles it, with no GPU (as
.ci/cuda-step-floor does: the cell is compiled before an instance needs a device), its
activations in --precision (bfloat16 by default), and prints where the time goes by phase:
the flow passes, kernel choice with the cuBLASLt plans, memory planning, the GPU kernels
built as LLVM IR, LLVM's PTX (the IR printed, optimized and emitted) and ptxas's machine
code; a GPU host adds only loading that code onto the device, at the first instance. --quick: stories260K at batch 2 x 16, once.
Run: python benchmarks/compile_time.py [--preset stories15M] [--batch 8] [--seq 256] [--cores 16] [--repeats 3]
     python benchmarks/compile_time.py --backend cuda [--preset stories110M] [--batch 32] [--seq 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
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
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", default="bfloat16", help="the CUDA step's activations")
    parser.add_argument("--quick", action="store_true", help="stories260K at batch 2 x 16, once")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq, args.repeats = "stories260K", 2, 16, 1
    if args.backend == "cuda":
        cuda_compile_times(args)
        return
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


CUDA_PHASES = (  # (module, function, what it does): the compile's phases, none inside another
    ("ranvier.compiler.compiler", "run_pipeline", "flow passes"),
    ("ranvier.backends.cuda.backend", "CUDABackend.choose", "kernel choice, cuBLASLt plans"),
    ("ranvier.compiler.compiler", "plan_memory", "memory plan"),
    ("ranvier.backends.cuda.kernels", "add_kernels", "GPU kernels built (LLVM IR)"),
    ("ranvier.backends.cuda.ptx", "emit_ptx", "PTX (IR printed, optimized, emitted)"),
    ("ranvier.backends.cuda.ptx", "assemble", "ptxas"),
)


def _timing(function, name: str, spent: dict[str, float]):
    """`function`, adding the seconds each call takes to `spent[name]`."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return timed


@contextlib.contextmanager
def timed_phases(phases: tuple[tuple[str, str, str], ...]):
    """Seconds spent in each of `phases` (module, function or Class.method, name) while the
    block runs, by name."""
    import importlib

    spent = dict.fromkeys((name for _, _, name in phases), 0.0)
    restore = []
    for module_name, path, name in phases:
        owner = importlib.import_module(module_name)
        *classes, function = path.split(".")
        for part in classes:
            owner = getattr(owner, part)
        original = getattr(owner, function)
        setattr(owner, function, _timing(original, name, spent))
        restore.append((owner, function, original))
    try:
        yield spent
    finally:
        for owner, function, original in restore:
            setattr(owner, function, original)


def cuda_compile_times(args: argparse.Namespace) -> None:
    """The Llama's CUDA training step compiled cold --repeats times, no GPU needed: median
    seconds, by phase."""
    os.environ.pop("RANVIER_CUDA_DEVICE", None)  # compile only: no emulated device
    os.environ.setdefault("RANVIER_MAX_MEMORY_MB", str(1 << 20))  # a device's arena, never allocated here
    from common import ranvier_trainer

    import ranvier as rv
    from ranvier.backends import compile_cache
    from ranvier.backends.cuda import ptx
    from ranvier.backends.cuda.code import CUDACode
    from ranvier.models.llama import PRESETS, Llama

    config = dataclasses.replace(PRESETS[args.preset], max_seq_len=args.seq)
    compile_flow, compiled = rv.Compiler.compile, []

    def keeping(self, flow, *more):
        compiled[:] = [compile_flow(self, flow, *more)]  # the last only: each holds its globals, 1.3 GB at stories110M
        return compiled[0]

    rv.Compiler.compile = keeping
    seconds, made, phases = [], [], []
    for _ in range(args.repeats):
        cache = Path(tempfile.mkdtemp())
        os.environ["RANVIER_CACHE"] = str(cache)
        compile_cache._MEMORY_CACHE.clear()
        # (the trainer raises once the cell is compiled: an instance needs a GPU)
        with timed_phases((("ranvier", "Compiler.compile", "compile"), *CUDA_PHASES)) as spent, \
                contextlib.suppress(rv.RanvierError):
            model, start = Llama(config, seed=0), time.perf_counter()
            try:
                ranvier_trainer(model, args.batch, args.seq, "bfloat16", backend="cuda", precision=args.precision)
            finally:
                made.append(time.perf_counter() - start)
        seconds.append(spent.pop("compile"))
        phases.append(spent)
        shutil.rmtree(cache)
    rv.Compiler.compile = compile_flow
    code = CUDACode.of(compiled[0].cell("train"))
    median = statistics.median(seconds)
    print(f"CUDA backend, compiled for {ptx.ARCHITECTURE} without a GPU; ptxas: {ptx.ptxas_version() or 'none (the driver compiles the PTX at load)'}")
    print(f"{args.preset} CUDA training step, {args.precision} activations, batch {args.batch} x seq {args.seq}: "
          f"{code.ptx.count(chr(10)):,} lines of PTX, {len(re.findall(r'^.visible .entry', code.ptx, re.MULTILINE))} kernels; "
          f"compiled in {median:.1f} s (median of {args.repeats}; the trainer, with its flow, gradient and optimizer, "
          f"{statistics.median(made):.1f} s)")
    for name in phases[0]:
        taken = statistics.median(spent[name] for spent in phases)
        print(f"  {name:<42} {taken:6.2f} s {taken / median:4.0%}")
    rest = median - statistics.median(sum(spent.values()) for spent in phases)
    print(f"  {'the rest (gradient, type checks, globals)':<42} {rest:6.2f} s {rest / median:4.0%}")
    print("A GPU host adds loading the machine code onto the device (cuModuleLoadData) at the first instance, "
          "and the driver's compile of the PTX there where ptxas was missing here.")


if __name__ == "__main__":
    main()
