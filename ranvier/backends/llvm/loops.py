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


def fold(ctx, start: Value | int, count: int, lanes: int, dtype: str, initial, combine, term) -> Value:
    """`combine` over `term(index, width)` for [start, start + count): partial results
    `lanes` wide, the scalar tail, then the lanes folded into one value."""
    vector = ctx.local(dtype, lanes, initial)
    scalar = ctx.local(dtype, 1, initial)

    def step(i: Value, width: int) -> None:
        acc = vector if width > 1 else scalar
        acc.set(combine(acc.value, term(i, width)))

    for_vectors(ctx, start, count, lanes, step)
    total = scalar.value
    if lanes > 1 and count >= lanes:
        partial = vector.value
        for lane in range(lanes):
            total = combine(total, partial.lane(lane))
    return total
