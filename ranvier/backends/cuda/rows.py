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

import math
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
    partials = _partials(ctx, dtype, threads)
    with _threads(ctx, threads) as thread:
        partial = ctx.local(dtype, 1, initial)

        def fold_in(value: Value, inside: Value | None) -> None:
            _set_inside(partial, combine(partial.value, value), inside)

        _own_elements(ctx, thread, length, threads, lambda at: term(start + at, 1), fold_in)
        partials.store(thread, partial.value)
    (total,) = _combined_over_block(ctx, threads, [partials], lambda a, b: [combine(a[0], b[0])])
    return total


def peak_and_exp_sum_over_block(ctx: EmitContext, threads: int, start: Value, length: int, dtype: str,
                                read) -> tuple[Value, Value]:
    """A row's maximum and Σ exp(x − max) in one pass over it: each thread keeps its
    elements' running maximum and their sum rescaled whenever the maximum grows; the block
    then combines the threads' pairs as `fold_over_block` combines single values."""
    peaks, sums = _partials(ctx, dtype, threads), _partials(ctx, dtype, threads, "sums")
    with _threads(ctx, threads) as thread:
        peak, total = ctx.local(dtype, 1, -math.inf), ctx.local(dtype, 1, 0.0)

        def fold_in(value: Value, inside: Value | None) -> None:
            merged = _merged(peak.value, total.value, value, ctx.constant(dtype, 1.0))
            _set_inside(peak, merged[0], inside)
            _set_inside(total, merged[1], inside)

        _own_elements(ctx, thread, length, threads, lambda at: read(start + at, 1), fold_in)
        peaks.store(thread, peak.value)
        sums.store(thread, total.value)
    peak, total = _combined_over_block(ctx, threads, [peaks, sums], lambda a, b: _merged(*a, *b))
    return peak, total


def _set_inside(local, value: Value, inside: Value | None) -> None:
    """A fold's running value set to `value`, where the element folded in is in the row."""
    local.set(value if inside is None else inside.where(value, local.value))


def _combined_over_block(ctx: EmitContext, threads: int, partials: list, merge) -> list[Value]:
    """The block's threads' partial results (one array a value, thread t's at t) combined in
    rounds, each halving the threads still merging (`merge(first's values, second's)`, a
    barrier between rounds); every thread gets the totals."""
    stride = threads // 2
    while stride:
        barrier(ctx)
        with _threads(ctx, stride if not ctx.on_gpu else threads) as thread, ctx.when(thread < stride):
            merged = merge([a.load(thread) for a in partials], [a.load(thread + stride) for a in partials])
            for array, value in zip(partials, merged):
                array.store(thread, value)
        stride //= 2
    barrier(ctx)
    totals = [array.load(0) for array in partials]
    barrier(ctx)  # every thread has the totals before a later fold writes the partials again
    return totals


FOLDED_AT_ONCE = 4  # a thread's elements whose terms (their loads) a fold computes before folding them in


def _own_elements(ctx: EmitContext, thread: Value, length: int, threads: int, term, fold_in) -> None:
    """Thread `thread`'s elements of a row — thread, thread + T, ... (T the block's
    threads) — `FOLDED_AT_ONCE` at a time: every term computed first, so that their loads
    are in flight together (one at a time, a block of a warp per row leaves a GPU waiting
    on memory), then folded in order, `fold_in(term, inside)`: `inside` says whether the
    element is in the row (None: known to be); a term past the end reads the thread's
    first element of the trip, and is not folded in. The order of folding is the plain
    loop's, so the result is too."""
    with ctx.loop(thread, length, step=threads * FOLDED_AT_ONCE, name="i") as i:
        elements = [i] + [i + k * threads for k in range(1, FOLDED_AT_ONCE)]
        inside = [None] + [at < length for at in elements[1:]]
        terms = [term(at if within is None else within.where(at, i)) for at, within in zip(elements, inside)]
        for value, within in zip(terms, inside):
            fold_in(value, within)


def _merged(peak_a: Value, sum_a: Value, peak_b: Value, sum_b: Value) -> tuple[Value, Value]:
    """Two (maximum, Σ exp(x − maximum)) pairs as one, each sum rescaled to the larger
    maximum (a part that has seen only −∞ then adds nothing)."""
    peak = (peak_b > peak_a).where(peak_b, peak_a)
    return peak, _rescaled(sum_a, peak_a, peak) + _rescaled(sum_b, peak_b, peak)


def _rescaled(total: Value, own: Value, peak: Value) -> Value:
    return own.equal(peak).where(total, total * (own - peak).exp())


def _partials(ctx: EmitContext, dtype: str, threads: int, which: str = "") -> Array:
    """The shared array a fold leaves its threads' partial results in: one per dtype and
    block size in a module (and a second, `which`, for a fold of pairs), which every fold
    reuses (a fold ends with a barrier after its total is read, so the next one may write
    it), so that a kernel of many folds — a ForEach of row ops — holds no more shared
    memory than a kernel of one. On the host, an array of the element function's own."""
    if not ctx.on_gpu:
        return ctx.array(dtype, threads)
    name = f"fold_partials_{dtype}_{threads}{'_' + which if which else ''}"
    memory = ctx.module.globals.get(name)
    if memory is None:
        memory = shared_variable(ctx.module, dtype, threads, name)
    return Array(ctx.b, memory.gep([ir.Constant(I32, 0), ir.Constant(I32, 0)]), dtype)


def each_over_block(ctx: EmitContext, threads: int, start: Value, length: int, body) -> None:
    """`body(index, 1)` for each element of a row, thread t taking elements t, t + T, ..."""
    with _threads(ctx, threads) as thread, ctx.loop(thread, length, step=threads, name="i") as i:
        body(start + i, 1)
