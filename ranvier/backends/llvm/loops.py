"""Loops every LLVM backend's kernels are made of, over an `EmitContext`: whole vectors
then single elements (`for_vectors`), a fold of partial results (`fold`), a fill, a copy
in overlapping vectors (`copy_run`). With one lane (a GPU thread's view of a row) they are
plain scalar loops."""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from ...flow.graph import Variable
from .values import Value


def for_vectors(ctx, start: Value | int, count: int | Value, lanes: int, body: Callable[[Value, int], None]) -> None:
    """Call `body(index, width)` over [start, start + count): whole vectors, then single
    elements. `count` may be known only at run time (a non-negative int64 Value)."""
    start = ctx.index(start)
    vector_end = _whole(count, lanes) if lanes > 1 else 0
    if isinstance(count, Value) or vector_end:
        with ctx.loop(0, vector_end, step=lanes, name="v") as i:
            body(start + i, lanes)
    if isinstance(count, Value) or vector_end < count:
        with ctx.loop(vector_end, count, name="s") as i:
            body(start + i, 1)


def _whole(count: int | Value, size: int) -> int | Value:
    """`count` rounded down to a multiple of `size` (a power of two where count is a Value)."""
    if isinstance(count, Value):
        return count & -size
    return count - count % size


def fill(ctx, var: Variable, value: float) -> None:
    """Every element of `var` set to `value`."""
    lanes = ctx.lanes_for([var.dtype])
    for_vectors(ctx, 0, var.size, lanes, lambda i, w: ctx.store(var, i, ctx.constant(var.dtype, value, w)))


def copy_run(ctx, source, source_at: Value | int, target, target_at: Value | int, count: int, lanes: int) -> None:
    """`count` (at least 1) contiguous elements from `source` to `target`, in vectors as wide
    as fit: a 14-element run two of 8, the second overlapping the first, where `for_vectors`
    would take one of 8 and six single elements. The overlapping vector reads and writes
    some elements again, so the source run and the target run must not overlap."""
    w = 1 << (min(lanes, count).bit_length() - 1)
    with ctx.loop(0, count - w + 1, step=w, name="run") as at:
        ctx.store(target, target_at + at, ctx.load(source, source_at + at, w))
    if count % w:
        ctx.store(target, target_at + (count - w), ctx.load(source, source_at + (count - w), w))


# A fold keeps this many partial results: each vector add waits for the one before it on
# its chain (about 4 cycles), so one chain reads a vector per 4 cycles even from L1.
FOLD_CHAINS = 4


def fold(ctx, start: Value | int, count: int | Value, lanes: int, dtype: str, initial, combine, term) -> Value:
    """`combine` over `term(index, width)` for [start, start + count): partial results
    `lanes` wide on `FOLD_CHAINS` independent chains where the row has room for them, the
    scalar tail, then the chains and the lanes folded into one value. A `count` known only
    at run time (a non-negative int64 Value) gets every chain; `initial` must then be
    `combine`'s identity, as unused chains are folded in too."""
    start = ctx.index(start)
    known = not isinstance(count, Value)
    chains = FOLD_CHAINS if lanes > 1 and (not known or count >= FOLD_CHAINS * lanes) else 1
    vectors = [ctx.local(dtype, lanes, initial) for _ in range(chains)]
    scalar = ctx.local(dtype, 1, initial)
    interleaved = _whole(count, chains * lanes) if chains > 1 else 0
    if not known or interleaved:
        with ctx.loop(0, interleaved, step=chains * lanes, name="f") as i:
            for chain, vector in enumerate(vectors):
                vector.set(combine(vector.value, term(start + i + chain * lanes, lanes)))

    def step(i: Value, width: int) -> None:
        acc = vectors[0] if width > 1 else scalar
        acc.set(combine(acc.value, term(i, width)))

    for_vectors(ctx, start + interleaved, count - interleaved, lanes, step)
    total = scalar.value
    if lanes > 1 and (not known or count >= lanes):
        total = combine(total, fold_lanes(pairwise(combine, [vector.value for vector in vectors]), combine))
    return total


def fold_lanes(vector: Value, combine: Callable[[Value, Value], Value]) -> Value:
    """`combine` over a vector's lanes, as a scalar (a scalar is returned as it is). Halves
    are combined until one lane is left: four dependent steps for 16 lanes where lane by
    lane took 16, the latency a short row (an attention query's) waits on."""
    if not isinstance(vector.ir.type, ir.VectorType):
        return vector
    while vector.lanes > 1:
        vector = combine(*vector.halves())
    return vector.lane(0)


def pairwise(combine, partials: list[Value]) -> Value:
    """The independent chains' partial results combined two by two (an odd one out passes
    to the next round as it is)."""
    while len(partials) > 1:
        partials = [combine(partials[j], partials[j + 1]) if j + 1 < len(partials) else partials[j]
                    for j in range(0, len(partials), 2)]
    return partials[0]
