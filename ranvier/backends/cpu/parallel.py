"""Splitting one step's work over the machine's cores, from generated code.

A kernel that divides its work into independent parts (row blocks of a GEMM, the
matrices of a batched product) emits each part's code once; `run_parts` puts them in
one task function that dispatches on the part index, runs part 0 on the calling
thread and every other part on a thread of its own (pthread_create), and joins them
all before the step returns. Starting a thread costs tens of microseconds, so only
kernels that take far longer than that are split (see `worth_splitting`).

The part count is fixed when the code is generated: `thread_count()`, which the
backend puts in the compile-cache key.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from llvmlite import ir

from ..llvm.irutil import BYTE_PTR, I32, I64, i64
from .codegen import KernelContext

Part = Callable[[KernelContext], None]

# Work below these sizes stays on one thread. AMX runs about 1e12 FLOP/s per core, so
# 2^27 FLOPs take ~130 µs; a core streams about 10 GB/s, so 2^24 bytes take ~1.6 ms:
# both several times a thread's start and join.
PARALLEL_FLOPS = 1 << 27
PARALLEL_BYTES = 1 << 24


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


def worth_splitting(flops: int = 0, nbytes: int = 0) -> bool:
    """Whether a kernel of this many FLOPs, or touching this many bytes, should be split."""
    return thread_count() > 1 and (flops >= PARALLEL_FLOPS or nbytes >= PARALLEL_BYTES)


def _declare(module: ir.Module, name: str, type_: ir.FunctionType) -> ir.Function:
    existing = module.globals.get(name)
    return existing if existing is not None else ir.Function(module, type_, name=name)


def run_parts(ctx: KernelContext, parts: list[Part]) -> None:
    """Emit `parts` as concurrent threads of this step (one part runs inline)."""
    if len(parts) == 1:
        parts[0](ctx)
        return
    module, b = ctx.module, ctx.b
    block_type = ir.LiteralStructType([BYTE_PTR.as_pointer(), I64])  # (pointer table, part index)
    task_type = ir.FunctionType(BYTE_PTR, [BYTE_PTR])
    # A step may run several parallel loops (Split writes each of its outputs in parts).
    task = ir.Function(module, task_type, name=module.get_unique_name(f"step{ctx.step_index}_part"))
    task.linkage = "internal"

    sub = KernelContext(module, task, ctx.target, ctx.layout, ctx.step_index, ctx.workspace)
    block = sub.b.bitcast(task.args[0], block_type.as_pointer())
    sub.ptrs = sub.b.load(sub.b.gep(block, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
    index = sub.b.load(sub.b.gep(block, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))
    for number, part in enumerate(parts):
        with sub.b.if_then(sub.b.icmp_signed("==", index, i64(number))):
            part(sub)
    sub.b.ret(ir.Constant(BYTE_PTR, None))

    create = _declare(module, "pthread_create", ir.FunctionType(I32, [I64.as_pointer(), BYTE_PTR, task_type.as_pointer(), BYTE_PTR]))
    join = _declare(module, "pthread_join", ir.FunctionType(I32, [I64, BYTE_PTR]))
    with b.goto_entry_block():
        blocks = b.alloca(block_type, i64(len(parts)))
        threads = b.alloca(I64, i64(len(parts)))
    started = []
    for number in range(len(parts)):
        slot = b.gep(blocks, [i64(number)])
        b.store(ctx.ptrs, b.gep(slot, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
        b.store(i64(number), b.gep(slot, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))
        if number:
            # A thread that cannot start leaves its part to this one.
            status = b.call(create, [b.gep(threads, [i64(number)]), ir.Constant(BYTE_PTR, None), task, b.bitcast(slot, BYTE_PTR)])
            failed = b.icmp_signed("!=", status, ir.Constant(I32, 0))
            with b.if_then(failed, likely=False):
                b.call(task, [b.bitcast(slot, BYTE_PTR)])
            started.append((number, failed))
    b.call(task, [b.bitcast(blocks, BYTE_PTR)])
    for number, failed in started:
        with b.if_then(b.not_(failed)):
            b.call(join, [b.load(b.gep(threads, [i64(number)])), ir.Constant(BYTE_PTR, None)])
