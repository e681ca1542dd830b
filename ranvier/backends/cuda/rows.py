"""Row ops (softmax, norms, cross-entropy and its gradient, a head's rotary embedding) as
block kernels: a block of threads per row, running the CPU backend's row passes
(`ranvier.backends.llvm.rows`) with each pass split over the block
(`ThreadContext.row_fold`, `row_each`, which call here).

Thread t takes elements t, t + T, ... of the row (T the block's threads: neighbouring
threads read neighbouring elements, so a warp's loads are whole lines). A fold (a row's
maximum, a sum) leaves each thread a partial result; the block combines the partials in
shared memory, halving the active threads each round (a barrier between rounds), and
every thread reads the total. The host emulator folds in the same order — each thread's
partial in turn, then the same rounds — so its results are the GPU's bit for bit.
A pass's side stores (a softmax's exponentials, kept in its output between passes) land
in elements a thread later reads back itself. Values every thread computes alike (a
row's loss) every thread stores alike.

Top-k and the router's softmax-top-k pick from the whole row one element at a time: those
rows stay one thread's each.
"""

from __future__ import annotations

from contextlib import nullcontext

from llvmlite import ir

from ...flow.graph import Operation
from ..llvm.context import Array, EmitContext
from ..llvm.irutil import I32
from ..llvm.rows import ROW_OPS, row_shape
from ..llvm.values import Value, index_value
from .blocks import barrier, shared_variable, special_register

ONE_THREAD_ROWS = {"TopK", "SoftmaxTopK"}


def supports(op: Operation) -> bool:
    return op.type in ROW_OPS and ROW_OPS[op.type][1](op)


def threads_per_row(length: int) -> int:
    """A warp for a short row (a head's, a model's width), more for a long one (a
    vocabulary's): a power of two, so the fold's rounds halve evenly."""
    return 32 if length <= 1024 else 128 if length <= 8192 else 256


def row_launch(rows: int, length: int, body) -> tuple:
    """The launch of `body(ctx, r)` for each of `rows` rows of `length`, a block per row
    whose threads split its passes (`EmitContext.row_fold`, `row_each`)."""
    threads = threads_per_row(length)

    def emit(ctx, index: ir.Value) -> None:
        ctx.row_threads = threads
        body(ctx, index_value(ctx.b, index))

    return rows, emit, threads


def launches(op: Operation) -> list[tuple]:
    rows, length = row_shape(op)
    body = ROW_OPS[op.type][0](op)
    if op.type in ONE_THREAD_ROWS:
        return [(rows, lambda ctx, index: body(ctx, index_value(ctx.b, index)))]
    return [row_launch(rows, length, body)]


def _threads(ctx: EmitContext, threads: int):
    """The block's threads as the code sees them: on the GPU the one running (its
    number); on the host a loop over the first `threads` in turn (the with-block, once each)."""
    if ctx.on_gpu:
        return nullcontext(index_value(ctx.b, special_register(ctx.module, ctx.b, "tid.x")))
    return ctx.loop(0, threads, name="thread")


def fold_over_block(ctx: EmitContext, threads: int, start: Value, length: int, dtype: str, initial, combine, term) -> Value:
    """`combine` over `term(index, 1)` along a row, split over the block (module docstring)."""
    partials = _partials(ctx, dtype, threads) if ctx.on_gpu else ctx.array(dtype, threads)
    with _threads(ctx, threads) as thread:
        partial = ctx.local(dtype, 1, initial)
        with ctx.loop(thread, length, step=threads, name="i") as i:
            partial.set(combine(partial.value, term(start + i, 1)))
        partials.store(thread, partial.value)
    stride = threads // 2
    while stride:
        barrier(ctx)
        with _threads(ctx, stride if not ctx.on_gpu else threads) as thread, ctx.when(thread < stride):
            partials.store(thread, combine(partials.load(thread), partials.load(thread + stride)))
        stride //= 2
    barrier(ctx)
    total = partials.load(0)
    barrier(ctx)  # every thread has the total before a later fold writes the partials again
    return total


def _partials(ctx: EmitContext, dtype: str, threads: int) -> Array:
    """The shared array a fold leaves its threads' partial results in: one per dtype and
    block size in a module, which every fold reuses (a fold ends with a barrier after
    its total is read, so the next one may write it), so that a kernel of many folds —
    a ForEach of row ops — holds no more shared memory than a kernel of one."""
    name = f"fold_partials_{dtype}_{threads}"
    memory = ctx.module.globals.get(name)
    if memory is None:
        memory = shared_variable(ctx.module, dtype, threads, name)
    return Array(ctx.b, memory.gep([ir.Constant(I32, 0), ir.Constant(I32, 0)]), dtype)


def each_over_block(ctx: EmitContext, threads: int, start: Value, length: int, body) -> None:
    """`body(index, 1)` for each element of a row, thread t taking elements t, t + T, ..."""
    with _threads(ctx, threads) as thread, ctx.loop(thread, length, step=threads, name="i") as i:
        body(start + i, 1)
