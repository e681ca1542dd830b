"""Splitting one step's work over the machine's cores, from generated code.

A kernel that divides its work into independent parts (row blocks of a GEMM, the
matrices of a batched product, slices of a map) hands them to the process's worker pool
(pool.py) as one task function, which the pool runs on its threads and the calling one,
returning when all are done. Parts whose code is the same but for a few numbers (a
share's first and last row, where its scratch starts, a GEMM block's rows) are emitted
once, those numbers looked up by the part's index at run time (`each_part`,
`share_out`): the code does not grow with the core count (stories15M's training step
was 1.07 M lines of LLVM IR cut in sixteen parts, 0.15 M in two, when every part was
emitted apart; 0.12 M and 0.11 M now). Parts whose code differs (a convolution's calls)
are emitted each (`run_parts`), the task dispatching on the index.

Only work that takes several times a job's cost is split. That cost is measured on
each machine (`split_thresholds`): the pool's latency with its workers spinning and
when they must be woken from sleep, against what one core streams or computes meanwhile. The
part count and the thresholds are fixed when the code is generated, and are in the
backend's compile-cache key.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import numpy as np
from llvmlite import ir

from ..llvm.irutil import BYTE_PTR, I32, I64, i64
from ..llvm.values import Value
from ..measured import kept, kept_path
from .codegen import POOL, KernelContext
from .pool import RUN, pool

Part = Callable[[KernelContext], None]

# A kernel is split when one core would take this many times a job's cost to run it
# (on two cores it then takes 3/4 of its time).
SPLIT_FACTOR = 4
_METHOD = "spinning: median of 5, at least a line's round trip"
_LINE_ROUND_TRIP_SECONDS = 50e-9  # a cache line to another core and back: ~2 × 100 cycles
SPLIT_ENVIRONMENT = "RANVIER_SPLIT_BYTES"  # a fixed byte threshold (FLOPs: 8 per byte), skipping the measurement


def thread_count() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def shares(length: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[0, length) cut into at most `parts` contiguous (start, stop) ranges of near-equal
    size, every boundary but the end a multiple of `unit`."""
    size = max(unit, -(-length // parts // unit) * unit)
    return [(start, min(length, start + size)) for start in range(0, length, size)]


@dataclass(frozen=True)
class SplitThresholds:
    """Work at or above either size is split over the cores."""

    flops: int
    nbytes: int
    wake_seconds: float  # what they were derived from: a job's cost with the workers asleep,
    spin_seconds: float  # and with them spinning,
    core_bytes_per_second: float  # one core's copy rate (read + write),
    core_flops: float  # and one core's peak arithmetic (vector FMA units at the counter's clock)

    def __str__(self) -> str:
        return f"split at {self.nbytes:,} bytes or {self.flops:,} FLOPs"


def _power_of_two(value: float) -> int:
    return 1 << max(10, round(math.log2(max(value, 1.0))))


def _measure(cores: int) -> SplitThresholds:
    from .jit import cycles_per_second
    from .target import host_target

    workers = pool()
    wake = workers.job_seconds(cores, asleep=True)
    # A job with the workers spinning costs about 0.1 µs, near the timer's noise: one
    # measurement in a noisy moment came out 0, was kept, and split everything from 8 KiB
    # (16 times too small) on that machine for good. The median of several, and never less
    # than a cache line's trip to another core and back, which every job makes.
    spin = max(_LINE_ROUND_TRIP_SECONDS, statistics.median(workers.job_seconds(cores, asleep=False) for _ in range(5)))
    source = np.ones(1 << 21, np.float32)  # 8 MiB: beyond the caches, on one core (numpy's copy)
    target = np.empty_like(source)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    bandwidth = 2 * source.nbytes / sorted(times)[3]
    core_flops = cycles_per_second() * host_target().lanes(4) * 4  # two FMA units, 2 FLOPs each
    # A step's kernels run back to back, so its jobs mostly find the workers spinning and
    # sometimes (after a long one-core kernel) asleep: a job costs between the two, taken
    # as their geometric mean. On the 2-core EPYC this was tuned on that splits from
    # 128 KiB; the asleep cost alone made it 1 MiB, and MNIST's training step 15% slower.
    work = SPLIT_FACTOR * max(math.sqrt(wake * spin), 1e-7)
    return SplitThresholds(_power_of_two(work * core_flops), _power_of_two(work * bandwidth), wake, spin, bandwidth, core_flops)


@functools.cache
def split_thresholds() -> SplitThresholds:
    """This machine's thresholds: `$RANVIER_SPLIT_BYTES` if set, else measured once and
    kept (measured.py)."""
    from .target import host_target

    fixed = os.environ.get(SPLIT_ENVIRONMENT)
    if fixed:
        nbytes = int(fixed)
        return SplitThresholds(8 * nbytes, nbytes, 0.0, 0.0, 0.0, 0.0)
    cores = thread_count()
    # kept per machine, core count and way of measuring: a change to the last measures anew
    with kept(kept_path("split", f"{host_target().key()}\n{cores}\n{_METHOD}")) as values:
        if values and _are_thresholds(values):
            return SplitThresholds(**values)
        if values:  # kept by an older version, or corrupt: measured anew
            values.clear()
        measured = _measure(cores)
        if values is not None:
            values.update(asdict(measured))
        return measured


def _are_thresholds(values: dict[str, float]) -> bool:
    """Whether kept numbers are a SplitThresholds' fields: sizes of at least 1, costs and rates above 0."""
    if set(values) != {field.name for field in fields(SplitThresholds)} or any(type(v) is bool for v in values.values()):
        return False
    return all(values[name] >= 1 and type(values[name]) is int for name in ("flops", "nbytes")) and \
        all(value > 0 for value in values.values())


def worth_splitting(flops: int = 0, nbytes: int = 0) -> bool:
    """Whether a kernel of this many FLOPs, or touching this many bytes, should be split."""
    if thread_count() == 1:
        return False
    thresholds = split_thresholds()
    return flops >= thresholds.flops or nbytes >= thresholds.nbytes


def run_parts(ctx: KernelContext, parts: list[Part]) -> None:
    """Emit `parts` as one job of the worker pool (a single part runs inline), each part's
    code apart."""
    if len(parts) == 1:
        parts[0](ctx)
        return

    def dispatch(sub: KernelContext, index: Value) -> None:
        for number, part in enumerate(parts):
            with sub.b.if_then(sub.b.icmp_signed("==", index.ir, i64(number))):
                part(sub)

    run_each_part(ctx, len(parts), dispatch)


def run_each_part(ctx: KernelContext, count: int, emit: Callable[[KernelContext, Value], None]) -> None:
    """`count` parts as one job of the worker pool, their code emitted once: `emit(ctx,
    number)` with the part's number as a run-time Value (`per_part` looks up what differs)."""
    module, b = ctx.module, ctx.b
    block_type = ir.LiteralStructType([BYTE_PTR.as_pointer(), I64])  # (pointer table, part index)
    task_type = ir.FunctionType(BYTE_PTR, [BYTE_PTR])
    # A step may run several parallel loops (Split writes each of its outputs in parts).
    task = ir.Function(module, task_type, name=module.get_unique_name(f"step{ctx.step_index}_part"))
    task.linkage = "internal"

    sub = KernelContext(module, task, ctx.target, ctx.layout, ctx.step_index, ctx.workspace)
    block = sub.b.bitcast(task.args[0], block_type.as_pointer())
    sub.ptrs = sub.b.load(sub.b.gep(block, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
    emit(sub, sub.index(sub.b.load(sub.b.gep(block, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))))
    sub.b.ret(ir.Constant(BYTE_PTR, None))

    with b.goto_entry_block():
        blocks = b.alloca(block_type, i64(count))
    with ctx.loop(0, count, name="part") as number:  # a loop: the code stays the same size for any count
        slot = b.gep(blocks, [number.ir])
        b.store(ctx.ptrs, b.gep(slot, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
        b.store(number.ir, b.gep(slot, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))
    run = b.bitcast(ctx.table_entry(POOL), RUN.as_pointer())
    stride = block_type.get_abi_size(ctx.target.machine.target_data)
    with ctx.on_all_cores():
        b.call(run, [task, b.bitcast(blocks, BYTE_PTR), i64(count), i64(stride)])


def per_part(ctx: KernelContext, number: Value, values: list[int]) -> int | Value:
    """values[number]: the number itself where every part has the same (the code may then
    be planned around it), else read from a table of them in the module's constants."""
    if len(set(values)) == 1:
        return values[0]
    array_type = ir.ArrayType(I64, len(values))
    table = ir.GlobalVariable(ctx.module, array_type, name=ctx.module.get_unique_name("per_part"))
    table.linkage, table.global_constant = "private", True
    table.initializer = ir.Constant(array_type, values)
    return ctx.index(ctx.b.load(ctx.b.gep(table, [i64(0), number.ir])))


def each_part(ctx: KernelContext, values: Sequence[tuple[int, ...]], body: Callable[..., None]) -> None:
    """A part per entry of `values`, as one job: `body(ctx, number, *entry)` emitted once,
    the part's number and entry run-time Values (`per_part`: a number where every part
    has the same; all numbers where a single part runs inline). No entries, no parts."""
    if len(values) <= 1:
        for entry in values:
            body(ctx, 0, *entry)
        return

    def emit(sub: KernelContext, number: Value) -> None:
        body(sub, number, *(per_part(sub, number, list(column)) for column in zip(*values)))

    run_each_part(ctx, len(values), emit)


def share_out(ctx: KernelContext, length: int, parts: int,
              body: Callable[[KernelContext, int | Value, int | Value], None], unit: int = 1) -> None:
    """`body(ctx, first, last)` over [0, length) cut as `shares` cuts it, a part per share
    (`each_part`)."""
    each_part(ctx, shares(length, parts, unit), lambda ctx, number, first, last: body(ctx, first, last))


@contextmanager
def each_claimed(ctx: KernelContext, counter: ir.Value, items: int) -> Iterator[Value]:
    """A part's loop over work items it claims one at a time from `counter` (an i64* shared
    by the job's parts, zero when the job starts) until all `items` are taken: the body,
    emitted in the with-block, gets the item's number. Items of sizes known only at run
    time (an expert's group of rows) so balance over the parts as they finish."""
    b = ctx.b
    claim, body, done = (b.append_basic_block(name) for name in ("claim", "claimed", "all_claimed"))
    b.branch(claim)
    b.position_at_end(claim)
    item = b.atomic_rmw("add", counter, i64(1), "monotonic")
    b.cbranch(b.icmp_signed("<", item, i64(items)), body, done)
    b.position_at_end(body)
    yield ctx.index(item)
    b.branch(claim)
    b.position_at_end(done)
