"""Reductions as math on IR values, for every LLVM backend: the block structure of a
reduction over contiguous axes ([outer, reduced, inner]), the value each starts from, and
how two partial results combine (NaN wins a maximum or minimum, as in numpy); and, for
both backends, the reduction of columns down the reduced axis and the scan of
ArgMax/ArgMin for one output element."""

from __future__ import annotations

import math
from collections.abc import Callable

from ... import dtypes
from ...errors import RanvierError
from ...ops import attrs_of
from .context import EmitContext
from .irutil import compute_type, is_signed
from .loops import FOLD_CHAINS, pairwise
from .values import Value

REDUCTIONS = {"Sum", "SumSquares", "Mean", "Max", "Min", "Product", "All", "Any"}


def contiguous(op) -> bool:
    """Whether the reduction's axes are contiguous, so a kernel reads its input as blocks."""
    return _blocks(op) is not None


def blocks(op) -> tuple[int, int, int]:
    """(outer, reduced, inner) sizes of a reduction whose axes are `contiguous`."""
    found = _blocks(op)
    if found is None:
        raise RanvierError(f"{op.type} op {op.name}: its reduced axes are not contiguous, so no kernel reads it as blocks")
    return found


def _blocks(op) -> tuple[int, int, int] | None:
    x = op.inputs[0]
    attrs = attrs_of(op)
    if op.type in ("ArgMax", "ArgMin"):
        axis = attrs["axis"]
        axes = list(range(x.rank)) if axis is None else [axis % x.rank]
    else:
        given = attrs["axis"]
        axes = list(range(x.rank)) if given is None else sorted({a % x.rank for a in given})
    if not axes:
        return 1, 1, x.size
    if axes != list(range(axes[0], axes[-1] + 1)):
        return None
    shape = x.shape
    return math.prod(shape[: axes[0]]), math.prod(shape[axes[0] : axes[-1] + 1]), math.prod(shape[axes[-1] + 1 :])


def identity(kind: str, dtype: str):
    """The value a reduction starts from: 0, 1, or the far end of the dtype's range."""
    if kind in ("Sum", "SumSquares", "Mean", "Any"):
        return 0
    if kind in ("Product", "All"):
        return 1
    if dtypes.is_float(dtype):
        return math.inf if kind == "Min" else -math.inf
    bits = compute_type(dtype).width
    if is_signed(dtype):
        return (1 << (bits - 1)) - 1 if kind == "Min" else -(1 << (bits - 1))
    return (1 << bits) - 1 if kind == "Min" else 0


def combiner(kind: str):
    def combine(acc: Value, x: Value) -> Value:
        if kind in ("Sum", "SumSquares", "Mean"):
            return acc + x
        if kind == "Product":
            return acc * x
        if kind == "All":
            return acc & x
        if kind == "Any":
            return acc | x
        take = x < acc if kind == "Min" else x > acc
        if x.is_float:
            take = take | x.not_equal(x)  # NaN wins, as in numpy's max/min
        return take.where(x, acc)

    return combine


def term(kind: str) -> Callable[[Value], Value]:
    """What a reduction combines of each element: its square for SumSquares, else itself."""
    return (lambda x: x * x) if kind == "SumSquares" else (lambda x: x)


def finished(op, value: Value) -> Value:
    """A reduction's result from its combined value: a mean divides by the count."""
    reduced = blocks(op)[1]
    return value * (1.0 / reduced) if op.type == "Mean" and reduced else value


def column_reduction(op) -> Callable[[EmitContext, Value, Value, int], None]:
    """`body(ctx, o, i, width)`: `width` columns from i of block o reduced down the reduced
    axis into the output (the CPU's vectors of a bias gradient's columns, a GPU thread's one)."""
    x, out = op.inputs[0], op.outputs[0]
    _, reduced, inner = blocks(op)
    combine, start, element = combiner(op.type), identity(op.type, x.dtype), term(op.type)
    chains = FOLD_CHAINS if reduced >= FOLD_CHAINS else 1
    interleaved = reduced - reduced % chains

    def body(ctx: EmitContext, o: Value, i: Value, width: int) -> None:
        # the rows on independent chains (`loops.FOLD_CHAINS`), each row's vector joining one
        sums = [ctx.local(x.dtype, width, start) for _ in range(chains)]

        def add(acc, r) -> None:
            acc.set(combine(acc.value, element(ctx.load(x, o * (reduced * inner) + r * inner + i, width))))

        with ctx.loop(0, interleaved, step=chains, name="r") as r:
            for chain, acc in enumerate(sums):
                add(acc, r + chain)
        with ctx.loop(interleaved, reduced, name="rt") as r:
            add(sums[0], r)
        ctx.store(out, o * inner + i, finished(op, pairwise(combine, [acc.value for acc in sums])))

    return body


def arg_reduction_element(op) -> Callable[[EmitContext, Value, Value], None]:
    """Index of the first maximum (minimum) along the axis; NaN counts as the extreme, as numpy."""
    x, out = op.inputs[0], op.outputs[0]
    _, reduced, inner = blocks(op)
    better = (lambda v, best: v > best) if op.type == "ArgMax" else (lambda v, best: v < best)

    def body(ctx: EmitContext, o: Value, i: Value) -> None:
        best = ctx.local(x.dtype)
        where = ctx.local(dtypes.DT_INT64)
        seen_nan = ctx.local(dtypes.DT_BOOL)
        base = o * (reduced * inner) + i
        first = ctx.load(x, base)
        best.set(first)
        where.set(ctx.index(0))
        seen_nan.set(first.not_equal(first) if dtypes.is_float(x.dtype) else ctx.constant(dtypes.DT_BOOL, 0))
        with ctx.loop(1, reduced, name="r") as r:
            value = ctx.load(x, base + r * inner)
            if dtypes.is_float(x.dtype):
                is_nan = value.not_equal(value)
                take = ~seen_nan.value & (better(value, best.value) | is_nan)
                seen_nan.set(seen_nan.value | is_nan)
            else:
                take = better(value, best.value)
            with ctx.when(take):
                best.set(value)
                where.set(r)
        ctx.store(out, o * inner + i, where.value.cast(out.dtype))

    return body
