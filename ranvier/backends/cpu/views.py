"""Strided loops: the one loop engine behind elementwise ops, fused Calculate ops and copies.

Every operand is a strided view (`ranvier.backends.llvm.strided`), so transposes, slices,
concatenation and broadcasting run on one engine. Adjacent dimensions that every view
walks contiguously are merged first; the innermost dimension runs as vectors when every
view has stride 1 or 0 there, with a scalar loop for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ...flow.graph import Variable
from ..llvm.strided import Body, View, collapse
from ..llvm.values import Value
from .parallel import run_parts, shares, thread_count, worth_splitting


def emit_map(ctx, shape: Sequence[int], inputs: list[View], outputs: list[View], body: Body, accumulate: bool = False,
             split: bool = True) -> None:
    """Loop over `shape`, read the inputs, compute `body(values, lanes)`, write the outputs
    (all through views). `values` are the inputs' elements as Values, `lanes` wide.

    With `accumulate`, results are added to what the outputs hold, in loop order, so
    views that visit an element more than once (overlapping windows) sum correctly.
    A large map is shared out over threads by its outermost dimension (never an
    accumulating one, whose threads could meet at one element); without `split` it runs
    on the calling thread (a part of a kernel that is already one of several: a GEMM's
    epilogue over the block the part computed).
    """
    if math.prod(shape) == 0:
        return
    views = inputs + outputs
    dims, strides = collapse(list(shape), views)
    lanes = ctx.lanes_for([v.var.dtype for v in views])
    nbytes = sum(v.var.nbytes for v in views)
    threads = thread_count() if split and not accumulate and worth_splitting(nbytes=nbytes) else 1
    # A lone dimension is cut on vector boundaries, so only the last part has a scalar tail.
    unit = lanes if len(dims) == 1 else 1
    run_parts(ctx, [
        lambda ctx, first=first, last=last: _emit_range(ctx, dims, strides, views, len(inputs), lanes, body, accumulate, first, last)
        for first, last in shares(dims[0], threads, unit)
    ])


def _emit_range(ctx, dims, strides, views, n_in, lanes, body: Body, accumulate: bool, first: int, last: int) -> None:
    """emit_map's loops, over [first, last) of the outermost dimension."""
    inner_ok = all(s[-1] in (0, 1) for s in strides)

    def access(offsets: list[Value], width: int, unit: list[bool]) -> None:
        values = [
            ctx.load(v.var, offset, width) if width == 1 or unit[k] else ctx.load(v.var, offset).splat(width)
            for k, (v, offset) in enumerate(zip(views[:n_in], offsets))
        ]
        for view, offset, value in zip(views[n_in:], offsets[n_in:], body(values, width)):
            ctx.store(view.var, offset, ctx.load(view.var, offset, width) + value if accumulate else value)

    def level(depth: int, offsets: list[Value]) -> None:
        if depth < len(dims) - 1:
            start, stop = (first, last) if depth == 0 else (0, dims[depth])
            with ctx.loop(start, stop, name=f"d{depth}") as i:
                level(depth + 1, [o + i * s[depth] for o, s in zip(offsets, strides)])
            return
        start, count = (first, last) if depth == 0 else (0, dims[-1])
        unit = [s[-1] == 1 for s in strides]
        vector_end = start + (count - start) - (count - start) % lanes if inner_ok and lanes > 1 else start
        if vector_end > start:
            with ctx.loop(start, vector_end, step=lanes, name="v") as i:
                access([o + i * s[-1] for o, s in zip(offsets, strides)], lanes, unit)
        if vector_end < count:
            with ctx.loop(vector_end, count, name="s") as i:
                access([o + i * s[-1] for o, s in zip(offsets, strides)], 1, unit)

    level(0, [ctx.index(v.offset) for v in views])


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
