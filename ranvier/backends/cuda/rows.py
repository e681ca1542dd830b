"""Row ops (softmax, norms, cross-entropy and its gradient, a head's rotary embedding) as
block kernels: a group of threads per row, running the CPU backend's row passes
(`ranvier.backends.llvm.rows`) with each pass split over the group
(`ThreadContext.row_fold`, `row_each`, which call here).

A short row (a head's, a model's width: at most 1,024 elements) is a warp's, four rows to
a block of 128 threads (a block of one warp would leave half a multiprocessor's threads
unused: it holds at most 32 blocks); a long one (a vocabulary's) a block of 128 or 256
threads. Thread t of a row's T takes elements t, t + T, ... (neighbouring threads read
neighbouring elements, so a warp's loads are whole lines). A fold (a row's maximum, a sum)
leaves each thread a partial result; each warp combines its lanes' partials by shuffles
(`shfl.sync.down`, halving the distance each round: 16, 8, 4, 2, 1), and a block of
several warps then its warps' results, one word each through shared memory, by the same
rounds in its first warp; every thread gets the total (a shuffle from lane 0, or shared
memory). The host emulator folds in the same order — each thread's partial in turn, then
the same rounds over an array of the partials — so its results are the GPU's bit for bit.
A pass's side stores (a softmax's exponentials, kept in its output between passes) land
in elements a thread later reads back itself. Values every thread computes alike (a
row's loss) every thread stores alike.

Top-k and the router's softmax-top-k pick from the whole row one element at a time: those
rows stay one thread's each (`RowOp.one_thread`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING

from llvmlite import ir

from ...flow.graph import Operation
from ..llvm.context import Array
from ..llvm.irutil import I32
from ..llvm.rows import ROW_OPS, row_shape
from ..llvm.values import Value, index_value
from .blocks import barrier, shared_variable, special_register
from .library import LIBRARY, Generator
from .warps import WARP, shuffled

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

def supports(op: Operation) -> bool:
    return op.type in ROW_OPS and ROW_OPS[op.type].applies(op)


ROWS_PER_BLOCK = 4  # warps' rows a block of short rows takes


def threads_per_row(length: int) -> int:
    """A warp for a short row (a head's, a model's width), more for a long one (a
    vocabulary's): a power of two, so the fold's rounds halve evenly."""
    return WARP if length <= 1024 else 128 if length <= 8192 else 256


def row_launch(rows: int, length: int, body) -> tuple:
    """The launch of `body(ctx, r)` for each of `rows` rows of `length`: a warp per short
    row, `ROWS_PER_BLOCK` of them to a block, or a block per long row, whose threads split
    its passes (`EmitContext.row_fold`, `row_each`). A warp's row needs no barrier, so the
    warps of a block's last rows past the end skip theirs."""
    threads = threads_per_row(length)
    together = ROWS_PER_BLOCK if threads == WARP and rows > 1 else 1

    def emit(ctx, index: ir.Value) -> None:
        ctx.row_threads = threads
        if together == 1:
            body(ctx, index_value(ctx.b, index))
            return
        first = index_value(ctx.b, index) * together
        if ctx.on_gpu:
            row = first + index_value(ctx.b, special_register(ctx.module, ctx.b, "tid.x")) // threads
            with ctx.when(row < rows):
                body(ctx, row)
            return
        with ctx.loop(0, together, name="row") as number, ctx.when(first + number < rows):
            body(ctx, first + number)

    return -(-rows // together), emit, threads * together


def launches(op: Operation) -> list[tuple]:
    rows, length = row_shape(op)
    body = ROW_OPS[op.type].body(op)
    if ROW_OPS[op.type].one_thread:
        return [(rows, lambda ctx, index: body(ctx, index_value(ctx.b, index)))]
    return [row_launch(rows, length, body)]


def _threads(ctx: ThreadContext, threads: int):
    """A row's threads as the code sees them: on the GPU the one running (its number in
    its row's group of `threads`); on the host a loop over them in turn (the with-block,
    once each)."""
    if ctx.on_gpu:
        return nullcontext(index_value(ctx.b, special_register(ctx.module, ctx.b, "tid.x")) % threads)
    return ctx.loop(0, threads, name="thread")


def fold_over_block(ctx: ThreadContext, threads: int, start: Value | int, length: int | Value, dtype: str, initial, combine, term) -> Value:
    """`combine` over `term(index, 1)` along a row, split over the block (module docstring)."""
    partials = _partials(ctx, dtype, threads)
    with _threads(ctx, threads) as thread:
        partial = ctx.local(dtype, 1, initial)

        def fold_in(value: Value, inside: Value | None) -> None:
            _set_inside(partial, combine(partial.value, value), inside)

        _own_elements(ctx, thread, length, threads, lambda at: term(start + at, 1), fold_in)
        own = [partial.value]
        if not ctx.on_gpu:
            partials.store(thread, own[0])
    (total,) = _combined_over_block(ctx, threads, own, [partials], lambda a, b: [combine(a[0], b[0])])
    return total


def peak_and_exp_sum_over_block(ctx: ThreadContext, threads: int, start: Value | int, length: int | Value, dtype: str,
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
        own = [peak.value, total.value]
        if not ctx.on_gpu:
            peaks.store(thread, own[0])
            sums.store(thread, own[1])
    block_peak, block_total = _combined_over_block(ctx, threads, own, [peaks, sums], lambda a, b: _merged(*a, *b))
    return block_peak, block_total


def _set_inside(local, value: Value, inside: Value | None) -> None:
    """A fold's running value set to `value`, where the element folded in is in the row."""
    local.set(value if inside is None else inside.where(value, local.value))


def _combined_over_block(ctx: ThreadContext, threads: int, own: list[Value], partials: list[Array], merge) -> list[Value]:
    """The row's threads' partial results combined (`merge(first's values, second's)`), in
    the rounds the module docstring says; every thread gets the totals. On the GPU `own`
    are the thread's values, and `partials` (one array a value) hold a block's warps'
    results; on the host `partials` hold every thread's, thread t's at t."""
    if ctx.on_gpu:
        return _combined_on_gpu(ctx, threads, own, partials, merge)
    stride = min(threads, WARP) // 2
    while stride:  # each warp's lanes, as its shuffles combine them into lane 0
        with ctx.loop(0, threads, name="lane") as thread, ctx.when(thread % WARP < stride):
            _merge_into(partials, thread, thread + stride, merge)
        stride //= 2
    stride = threads // WARP // 2
    while stride:  # the warps' results, at their lanes 0, as the first warp combines them
        with ctx.loop(0, stride, name="warp") as warp:
            _merge_into(partials, warp * WARP, (warp + stride) * WARP, merge)
        stride //= 2
    return [array.load(0) for array in partials]


def _merge_into(partials: list[Array], first: Value, second: Value, merge) -> None:
    merged = merge([a.load(first) for a in partials], [a.load(second) for a in partials])
    for array, value in zip(partials, merged):
        array.store(first, value)


def _combined_on_gpu(ctx: ThreadContext, threads: int, own: list[Value], partials: list[Array], merge) -> list[Value]:
    """`_combined_over_block` on the GPU: shuffles within each warp, then, for a block of
    several warps, the warps' results through shared memory, combined by the first warp."""
    values = _warp_folded(ctx, own, min(threads, WARP), merge)
    if threads <= WARP:
        return [shuffled(ctx, value, "idx", 0) for value in values]
    warps = threads // WARP
    thread = index_value(ctx.b, special_register(ctx.module, ctx.b, "tid.x"))
    lane, warp = thread % WARP, thread // WARP
    with ctx.when(lane.equal(0)):
        for array, value in zip(partials, values):
            array.store(warp, value)
    barrier(ctx)
    with ctx.when(thread < WARP):
        # lanes past the warps' count read a result too (any: only lane 0's total is kept)
        totals = _warp_folded(ctx, [array.load(lane % warps) for array in partials], warps, merge)
        with ctx.when(thread.equal(0)):
            for array, value in zip(partials, totals):
                array.store(0, value)
    barrier(ctx)
    totals = [array.load(0) for array in partials]
    barrier(ctx)  # every thread has the totals before a later fold writes the partials again
    return totals


def _warp_folded(ctx: ThreadContext, values: list[Value], width: int, merge) -> list[Value]:
    """Lane 0's values merged with lanes 1 .. width − 1's, a tree of shuffles down."""
    stride = width // 2
    while stride:
        values = merge(values, [shuffled(ctx, value, "down", stride) for value in values])
        stride //= 2
    return values


FOLDED_AT_ONCE = 4  # a thread's elements whose terms (their loads) a fold computes before folding them in


def _own_elements(ctx: ThreadContext, thread: Value, length: int | Value, threads: int, term, fold_in) -> None:
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


def _partials(ctx: ThreadContext, dtype: str, threads: int, which: str = "") -> Array:
    """Where a fold leaves its partial results: on the host an array of the element
    function's own, a slot per thread; on the GPU a block's warps' results in shared
    memory, one array per dtype and block size in a module (and a second, `which`, for a
    fold of pairs), which every fold reuses (a fold ends with a barrier after its total is
    read, so the next one may write it), so that a kernel of many folds — a ForEach of row
    ops — holds no more shared memory than a kernel of one. A warp's row needs none."""
    if not ctx.on_gpu:
        return ctx.array(dtype, threads)
    warps = max(1, threads // WARP)
    name = f"fold_partials_{dtype}_{warps}{'_' + which if which else ''}"
    memory = ctx.module.globals.get(name)
    if memory is None:
        memory = shared_variable(ctx.module, dtype, warps, name)
    return Array(ctx.b, memory.gep([ir.Constant(I32, 0), ir.Constant(I32, 0)]), dtype)


def each_over_block(ctx: ThreadContext, threads: int, start: Value | int, length: int | Value, body) -> None:
    """`body(index, 1)` for each element of a row, thread t taking elements t, t + T, ..."""
    with _threads(ctx, threads) as thread, ctx.loop(thread, length, step=threads, name="i") as i:
        body(start + i, 1)


LIBRARY.register(Generator("Rows", None, launches, supports=supports, rank=50, foreach=True))
