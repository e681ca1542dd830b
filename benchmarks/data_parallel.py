"""Data-parallel training: ranvier over MPI vs PyTorch DistributedDataParallel (gloo), 1 to N ranks.

Weak scaling: every rank trains the same per-rank batch, so N ranks process N times the
tokens of one. For each worker count this script starts one `mpiexec -n N` job whose
ranks train a Llama both ways, alternating for several repetitions on identical global
batches: ranvier through a CheckpointedStack (each layer's gradients averaged on a
thread while the next layer's backward runs) and PyTorch eager under DDP (its bucketed
all-reduce overlapped with backward). It prints tokens/s summed over the ranks, the
scaling efficiency per core used (tokens/s per core against one rank's: ranks on one
machine split its cores), ranvier's all-reduce time, the share of it hidden behind
computation, and ranvier against PyTorch at each N.
Run: python benchmarks/data_parallel.py [--workers 1,2,4] [--preset stories15M] [--batch 4] [--seq 256]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from common import comparison, machine, match_threads, ranvier_trainer, token_batches, torch_trainer
from llama_train import dense_feed_forward

RESULT = "RESULT "  # rank 0's last line: its measurements as JSON, for the driver


def arguments() -> argparse.Namespace:
    from ranvier.models.llama import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="", help="comma-separated rank counts (default: 1, 2, 4… up to the cores)")
    parser.add_argument("--preset", default="stories15M", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=4, help="rows per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker_counts(text: str, cores: int) -> list[int]:
    if text:
        return [int(n) for n in text.split(",")]
    counts = [1]
    while counts[-1] * 2 <= max(cores, 2):
        counts.append(counts[-1] * 2)
    return counts


def join_torch(world) -> None:
    """PyTorch's process group over the same ranks, meeting at a port rank 0 chose."""
    import torch.distributed as dist

    address = None
    if world.is_root:
        with socket.socket() as probe:
            probe.bind(("", 0))
            address = (socket.gethostbyname(socket.gethostname()), probe.getsockname()[1])
    host, port = world.share(address, "the PyTorch rendezvous address")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=world.rank, world_size=world.size)


def worker(args: argparse.Namespace) -> None:
    """One rank: train both sides on this rank's rows; rank 0 prints the runs and the result."""
    from ranvier.distributed.world import current_world

    world = current_world()  # first: pins this rank to its share of the cores
    if not world.is_root:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- this rank's output, for the rest of the process
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ranvier.backends.cpu.parallel import thread_count
    from ranvier.models.llama import PRESETS, Llama

    match_threads(torch)
    print(f"  rank 0 of {world.size}: {machine(torch)}", flush=True)
    config = PRESETS[args.preset]
    batches = token_batches(config.vocab_size, args.batch * world.size, args.seq, args.steps)
    trainer = ranvier_trainer(Llama(config, seed=0), args.batch, args.seq, checkpointed=True)
    wrap = None
    if world.size > 1:
        join_torch(world)
        wrap = DistributedDataParallel
    torch_step = torch_trainer(config, args.batch, args.seq, *dense_feed_forward(config), wrap=wrap)
    mine = world.rows(args.batch * world.size)
    sides = {"ranvier": lambda x, y: trainer.step([x, y]), "pytorch": lambda x, y: torch_step(x[mine], y[mine])}

    for step in sides.values():
        step(*batches[0])  # warm up
    tokens = sum(x.size for x, _ in batches)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    busy, wait, hidden = [], [], []
    for repeat in range(args.repeats):
        for name, step in sides.items():
            world.barrier(f"the start of {name}'s repetition {repeat + 1}")
            start = time.perf_counter()
            losses = []
            for x, y in batches:
                losses.append(step(x, y))
                if name == "ranvier":
                    times = trainer.reduce_times
                    busy.append(times.communicating)
                    wait.append(times.waiting)
                    hidden.append(times.hidden)
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"  {world.size} ranks, run {repeat + 1} {name:8s} {rates[name][-1]:9.0f} tokens/s  loss {losses[-1]:.3f}",
                  flush=True)
    if wrap is not None:
        # Gloo's threads must be joined before the interpreter tears down, or the rank dies in std::terminate
        # ("terminate called without an active exception", exit 6) at exit: DistributedDataParallel's reducer
        # holds the process group, so the model goes first (with destroy_process_group alone, 2-rank jobs
        # died so in 4 of 8 runs; with the model collected first, in 0 of 12)
        import gc

        import torch.distributed as dist

        del sides, step, torch_step
        gc.collect()
        dist.destroy_process_group()
    result = {"workers": world.size, "cores_per_rank": thread_count(), "rates": rates, "busy": busy, "wait": wait,
              "hidden": hidden}
    print(RESULT + json.dumps(result), flush=True)


def run_job(workers: int, args: argparse.Namespace) -> dict:
    """One mpiexec job of `workers` ranks; echoes rank 0's lines, returns its result."""
    from ranvier.distributed.launch import find_mpiexec

    command = [find_mpiexec(), "-n", str(workers), sys.executable, __file__, "--worker", "--preset", args.preset,
               "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--repeats", str(args.repeats)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    result = None
    for line in job.stdout:
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
        else:
            print(line, end="", flush=True)
    if job.wait() != 0 or result is None:
        raise SystemExit(f"the {workers}-rank job failed (exit code {job.returncode})")
    return result


def report(results: list[dict], cores: int, gradient_bytes: int) -> None:
    base = {side: statistics.median(results[0]["rates"][side]) for side in ("ranvier", "pytorch")}
    single = results[0]["workers"]
    print(f"\n{'ranks':>5s} {'cores/rank':>10s} | {'ranvier tok/s':>13s} {'scaling':>7s} {'all-reduce':>10s} {'hidden':>6s} | "
          f"{'pytorch tok/s':>13s} {'scaling':>7s}")
    for result in results:
        n = result["workers"]
        rate = {side: statistics.median(result["rates"][side]) for side in base}
        cores_used = n * result["cores_per_rank"] / (single * results[0]["cores_per_rank"])
        scaling = {side: rate[side] / (cores_used * base[side]) for side in base}
        reduce = f"{statistics.median(result['busy']) * 1e3:8.1f}ms" if n > 1 else f"{'-':>10s}"
        hidden = f"{statistics.median(result['hidden']):6.0%}" if n > 1 else f"{'-':>6s}"
        print(f"{n:5d} {result['cores_per_rank']:10d} | {rate['ranvier']:13.0f} {scaling['ranvier']:7.0%} {reduce} {hidden} | "
              f"{rate['pytorch']:13.0f} {scaling['pytorch']:7.0%}")
    print("scaling: tokens/s per core used, relative to the first row (100%: N ranks on M cores each train "
          "N×M/cores(1) times as fast; on one machine the ranks split its cores)")
    print(f"gradients all-reduced per step: {gradient_bytes / 2**20:.1f} MiB (float32), in 4 MiB buckets")
    for result in results:
        n = result["workers"]
        rate = {side: statistics.median(result["rates"][side]) for side in base}
        print(f"{n} ranks: {comparison('ranvier', rate['ranvier'], 'pytorch', rate['pytorch'], True)} (median tokens/s)")
    crowded = [r["workers"] for r in results if r["workers"] > cores]
    if crowded:
        print(f"note: {', '.join(map(str, crowded))} ranks on {cores} cores share cores (oversubscribed): those rows measure "
              "the cost of communication and contention, not a speed-up")


def main() -> None:
    args = arguments()
    if args.worker:
        worker(args)
        return
    import torch

    from ranvier.backends.cpu.parallel import thread_count

    print(machine(torch))
    cores = thread_count()
    counts = worker_counts(args.workers, cores)
    if not counts or counts[0] < 1 or counts != sorted(set(counts)):
        raise SystemExit(f"--workers takes increasing rank counts from 1 up, got {args.workers!r}")
    from ranvier.models.llama import PRESETS

    config = PRESETS[args.preset]
    print(f"{args.preset}: {config.parameter_count() / 1e6:.1f}M parameters, batch {args.batch} x seq {args.seq} per rank, "
          f"{args.steps} steps x {args.repeats} repetitions per side; ranks: {', '.join(map(str, counts))}", flush=True)
    report([run_job(n, args) for n in counts], cores, 4 * config.parameter_count())


if __name__ == "__main__":
    main()
