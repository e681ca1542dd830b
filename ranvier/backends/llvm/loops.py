"""Loops every LLVM backend's kernels are made of, over an `EmitContext`: whole vectors
then single elements (`for_vectors`), a fold of partial results (`fold`), a fill. With
one lane (a GPU thread's view of a row) they are plain scalar loops."""

from __future__ import annotations

from collections.abc import Callable

from ...flow.graph import Variable
from .values import Value


def for_vectors(ctx, start: Value | int, count: int, lanes: int, body: Callable[[Value, int], None]) -> None:
    """Call `body(index, width)` over [start, start + count): whole vectors, then single elements."""
    start = ctx.index(start)
    vector_end = count - count % lanes if lanes > 1 else 0
    if vector_end:
        with ctx.loop(0, vector_end, step=lanes, name="v") as i:
            body(start + i, lanes)
    if vector_end < count:
        with ctx.loop(vector_end, count, name="s") as i:
            body(start + i, 1)


def fill(ctx, var: Variable, value: float) -> None:
    """Every element of `var` set to `value`."""
    lanes = ctx.lanes_for([var.dtype])
    for_vectors(ctx, 0, var.size, lanes, lambda i, w: ctx.store(var, i, ctx.constant(var.dtype, value, w)))


# A fold keeps this many partial results: each vector add waits for the one before it on
# its chain (about 4 cycles), so one chain reads a vector per 4 cycles even from L1.
FOLD_CHAINS = 4


def fold(ctx, start: Value | int, count: int, lanes: int, dtype: str, initial, combine, term) -> Value:
    """`combine` over `term(index, width)` for [start, start + count): partial results
    `lanes` wide on `FOLD_CHAINS` independent chains where the row has room for them, the
    scalar tail, then the chains and the lanes folded into one value."""
    start = ctx.index(start)
    chains = FOLD_CHAINS if lanes > 1 and count >= FOLD_CHAINS * lanes else 1
    vectors = [ctx.local(dtype, lanes, initial) for _ in range(chains)]
    scalar = ctx.local(dtype, 1, initial)
    interleaved = count - count % (chains * lanes) if chains > 1 else 0
    if interleaved:
        with ctx.loop(0, interleaved, step=chains * lanes, name="f") as i:
            for chain, vector in enumerate(vectors):
                vector.set(combine(vector.value, term(start + i + chain * lanes, lanes)))

    def step(i: Value, width: int) -> None:
        acc = vectors[0] if width > 1 else scalar
        acc.set(combine(acc.value, term(i, width)))

    for_vectors(ctx, start + interleaved, count - interleaved, lanes, step)
    total = scalar.value
    if lanes > 1 and count >= lanes:
        partial = pairwise(combine, [vector.value for vector in vectors])
        for lane in range(lanes):
            total = combine(total, partial.lane(lane))
    return total


def pairwise(combine, partials: list[Value]) -> Value:
    """The independent chains' partial results combined two by two (their count a power of two)."""
    while len(partials) > 1:
        partials = [combine(partials[j], partials[j + 1]) for j in range(0, len(partials), 2)]
    return partials[0]
