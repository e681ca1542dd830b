"""Strided loops: the one loop engine behind elementwise ops, fused Calculate ops and copies.

An operand is a `View`: a variable plus an element offset and one stride per
iteration dimension (0 where it broadcasts). Transposes, slices, concatenation and
broadcasting are all views, so one engine serves them. Adjacent dimensions that
every view walks contiguously are merged first; the innermost dimension runs as
vectors when every view has stride 1 or 0 there, with a scalar loop for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from llvmlite import ir

from ...flow.graph import Variable
from .convert import narrow, widen
from .irutil import for_range, i64, load, splat, storage_type, store
from .parallel import run_parts, shares, thread_count, worth_splitting


@dataclass
class View:
    var: Variable
    offset: int
    strides: list[int]


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def broadcast_view(var: Variable, shape: Sequence[int]) -> View:
    """`var` read as if broadcast to `shape` (numpy rules)."""
    own = contiguous_strides(var.shape)
    lead = len(shape) - len(var.shape)
    strides = [0] * lead + [0 if d == 1 and shape[lead + i] != 1 else own[i] for i, d in enumerate(var.shape)]
    return View(var, 0, strides)


def dense_view(var: Variable) -> View:
    return View(var, 0, contiguous_strides(var.shape))


def _collapse(shape: list[int], views: list[View]) -> tuple[list[int], list[list[int]]]:
    """Merge dimension i into i+1 where every view steps through both as one dimension."""
    dims = [d for d in shape]
    strides = [list(v.strides) for v in views]
    keep = [i for i, d in enumerate(dims) if d != 1]
    dims = [dims[i] for i in keep] or [1]
    strides = [[s[i] for i in keep] or [0] for s in strides]
    merged_dims = [dims[-1]]
    merged = [[s[-1]] for s in strides]
    for i in range(len(dims) - 2, -1, -1):
        if all(s[i] == m[0] * merged_dims[0] for s, m in zip(strides, merged)):
            merged_dims[0] *= dims[i]
            continue
        merged_dims.insert(0, dims[i])
        for s, m in zip(strides, merged):
            m.insert(0, s[i])
    return merged_dims, merged


Body = Callable[[ir.IRBuilder, list[ir.Value], int], list[ir.Value]]


def emit_map(ctx, shape: Sequence[int], inputs: list[View], outputs: list[View], body: Body, accumulate: bool = False) -> None:
    """Loop over `shape`, read the inputs, compute `body`, write the outputs (all through views).

    With `accumulate`, results are added to what the outputs hold, in loop order, so
    views that visit an element more than once (overlapping windows) sum correctly.
    A large map is shared out over threads by its outermost dimension (never an
    accumulating one, whose threads could meet at one element).
    """
    if math.prod(shape) == 0:
        return
    views = inputs + outputs
    dims, strides = _collapse(list(shape), views)
    lanes = ctx.lanes_for([v.var.dtype for v in views])
    nbytes = sum(v.var.nbytes for v in views)
    threads = thread_count() if not accumulate and worth_splitting(nbytes=nbytes) else 1
    # A lone dimension is cut on vector boundaries, so only the last part has a scalar tail.
    unit = lanes if len(dims) == 1 else 1
    run_parts(ctx, [
        lambda ctx, first=first, last=last: _emit_range(ctx, dims, strides, views, len(inputs), lanes, body, accumulate, first, last)
        for first, last in shares(dims[0], threads, unit)
    ])


def _emit_range(ctx, dims, strides, views, n_in, lanes, body: Body, accumulate: bool, first: int, last: int) -> None:
    """emit_map's loops, over [first, last) of the outermost dimension."""
    b = ctx.b
    bases = [ctx.pointer(v.var) for v in views]
    dtypes_ = [v.var.dtype for v in views]
    inner_ok = all(s[-1] in (0, 1) for s in strides)

    def access(offsets: list[ir.Value], width: int, unit: list[bool]) -> None:
        values = []
        for k in range(n_in):
            element = storage_type(dtypes_[k])
            if width > 1 and not unit[k]:
                values.append(splat(b, widen(b, load(b, bases[k], offsets[k], element), dtypes_[k], 1), width))
            else:
                values.append(widen(b, load(b, bases[k], offsets[k], element, width), dtypes_[k], width))
        results = body(b, values, width)
        for k, value in enumerate(results):
            j = n_in + k
            element = storage_type(dtypes_[j])
            if accumulate:
                current = widen(b, load(b, bases[j], offsets[j], element, width), dtypes_[j], width)
                value = b.fadd(current, value) if isinstance(current.type.element if width > 1 else current.type, (ir.FloatType, ir.DoubleType)) else b.add(current, value)
            store(b, narrow(b, value, dtypes_[j], width), bases[j], offsets[j], element, width)

    def level(depth: int, offsets: list[ir.Value]) -> None:
        if depth < len(dims) - 1:
            start, stop = (first, last) if depth == 0 else (0, dims[depth])
            with for_range(b, i64(start), i64(stop), name=f"d{depth}") as index:
                level(depth + 1, [b.add(o, b.mul(index, i64(s[depth]))) for o, s in zip(offsets, strides)])
            return
        start, count = (first, last) if depth == 0 else (0, dims[-1])
        unit = [s[-1] == 1 for s in strides]
        vector_end = start + (count - start) - (count - start) % lanes if inner_ok and lanes > 1 else start
        if vector_end > start:
            with for_range(b, i64(start), i64(vector_end), step=lanes, name="v") as index:
                access([b.add(o, b.mul(index, i64(s[-1]))) for o, s in zip(offsets, strides)], lanes, unit)
        if vector_end < count:
            with for_range(b, i64(vector_end), i64(count), name="s") as index:
                access([b.add(o, b.mul(index, i64(s[-1]))) for o, s in zip(offsets, strides)], 1, unit)

    level(0, [i64(v.offset) for v in views])


def for_vectors(b: ir.IRBuilder, start: ir.Value, count: int, lanes: int, body: Callable[[ir.Value, int], None]) -> None:
    """Call `body(index, width)` over [start, start + count): whole vectors, then single elements."""
    vector_end = count - count % lanes if lanes > 1 else 0
    if vector_end:
        with for_range(b, i64(0), i64(vector_end), step=lanes, name="v") as index:
            body(b.add(start, index), lanes)
    if vector_end < count:
        with for_range(b, i64(vector_end), i64(count), name="s") as index:
            body(b.add(start, index), 1)
