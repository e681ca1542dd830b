"""Strided loops: the one loop engine behind elementwise ops, fused Calculate ops and copies.

Every operand is a strided view (`ranvier.backends.llvm.strided`), so transposes, slices,
concatenation and broadcasting run on one engine. Adjacent dimensions that every view
walks contiguously are merged first; the innermost dimension runs as vectors when every
view has stride 1 or 0 there, with a scalar loop for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..llvm.strided import Body, View, collapse
from ..llvm.values import Value
from .parallel import share_out, thread_count, worth_splitting


def emit_map(ctx, shape: Sequence[int | Value], inputs: list[View], outputs: list[View], body: Body, accumulate: bool = False,
             split: bool = True) -> None:
    """Loop over `shape`, read the inputs, compute `body(values, lanes)`, write the outputs
    (all through views). `values` are the inputs' elements as Values, `lanes` wide.

    With `accumulate`, results are added to what the outputs hold, in loop order, so
    views that visit an element more than once (overlapping windows) sum correctly.
    A large map is shared out over threads by its outermost dimension (an accumulating
    one only where its outputs' slices along it lie apart, so no two threads meet at an
    element: a scatter's images); without `split` it runs
    on the calling thread (a part of a kernel that is already one of several: a GEMM's
    epilogue over the block the part computed), and its outermost dimension and the views'
    offsets may be known only at run time (that block's rows and start).
    """
    if all(isinstance(d, int) for d in shape) and math.prod(shape) == 0:
        return
    views = inputs + outputs
    dims, strides = collapse(list(shape), views)
    lanes = ctx.lanes_for([v.var.dtype for v in views])
    nbytes = sum(v.var.nbytes for v in views)
    apart = not accumulate or all(_slices_apart(dims, s) for s in strides[len(inputs):])
    threads = thread_count() if split and apart and worth_splitting(nbytes=nbytes) else 1

    def emit(ctx, first: int | Value, last: int | Value) -> None:
        _emit_range(ctx, dims, strides, views, len(inputs), lanes, body, accumulate, first, last)

    if threads == 1:
        emit(ctx, 0, dims[0])
        return
    # A lone dimension is cut on vector boundaries, so only the last part has a scalar tail.
    share_out(ctx, dims[0], threads, emit, lanes if len(dims) == 1 else 1)


def _slices_apart(dims: list[int], strides: list[int]) -> bool:
    """Whether a view's slices along its outermost dimension share no element: each step
    of it goes past all the rest of the dimensions reach."""
    return abs(strides[0]) > sum(abs(s) * (d - 1) for s, d in zip(strides[1:], dims[1:]))


def _emit_range(ctx, dims, strides, views, n_in, lanes, body: Body, accumulate: bool, first: int | Value,
                last: int | Value) -> None:
    """emit_map's loops, over [first, last) of the outermost dimension."""
    inner_ok = all(s[-1] in (0, 1) for s in strides)
    # An input that stays put from some loop inward (a scalar, a bias along a row) is read
    # once, before that loop: read inside it, every store might have changed it, so LLVM
    # reloads it per vector and cannot take a condition on it (AdamW's skip flag) out of
    # the loop. Only inputs are read ahead: no map writes a variable it reads through a
    # broadcast (an in-place output has its input's shape).
    steady = [min(d for d in range(len(dims) + 1) if not any(strides[k][d:])) for k in range(n_in)]
    held: dict[int, Value] = {}

    def read(k: int, offset: Value, width: int, unit: bool) -> Value:
        if k in held:
            return held[k].splat(width)
        if width == 1 or unit:
            return ctx.load(views[k].var, offset, width)
        return ctx.load(views[k].var, offset).splat(width)

    def access(offsets: list[Value], width: int, unit: list[bool]) -> None:
        values = [read(k, offset, width, unit[k]) for k, offset in enumerate(offsets[:n_in])]
        for view, offset, value in zip(views[n_in:], offsets[n_in:], body(values, width)):
            ctx.store(view.var, offset, ctx.load(view.var, offset, width) + value if accumulate else value)

    def level(depth: int, offsets: list[Value]) -> None:
        for k in range(n_in):
            if steady[k] == depth:
                held[k] = ctx.load(views[k].var, offsets[k])
        if depth < len(dims) - 1:
            start, stop = (first, last) if depth == 0 else (0, dims[depth])
            with ctx.loop(start, stop, name=f"d{depth}") as i:
                level(depth + 1, [o + i * s[depth] for o, s in zip(offsets, strides)])
            return
        start, count = (first, last) if depth == 0 else (0, dims[-1])
        unit = [s[-1] == 1 for s in strides]
        vectors = inner_ok and lanes > 1
        vector_end = count - (count - start) % lanes if vectors else start
        # whole vectors, then the scalar tail: each loop only where it can run (bounds
        # known here, or a part's looked up at run time)
        length = count - start if isinstance(start, int) and isinstance(count, int) else None
        if vectors and (length is None or length >= lanes):
            with ctx.loop(start, vector_end, step=lanes, name="v") as i:
                access([o + i * s[-1] for o, s in zip(offsets, strides)], lanes, unit)
        if length is None or not vectors or length % lanes:
            with ctx.loop(vector_end, count, name="s") as i:
                access([o + i * s[-1] for o, s in zip(offsets, strides)], 1, unit)

    level(0, [ctx.index(v.offset) for v in views])
