"""Reductions over a contiguous block of axes: the input is seen as [outer, reduced, inner].

With nothing inside the reduced block (inner = 1) each output is a row reduction,
accumulated in vector registers and folded at the end; otherwise whole vectors of
the inner dimension accumulate down the reduced axis. ArgMax/ArgMin scan rows.
"""

from __future__ import annotations

import math

from llvmlite import ir

from .... import dtypes
from ....ops import attrs_of
from ..convert import narrow, widen
from ..irutil import I1, compute_type, constant, for_range, i64, is_signed, load, storage_type, store, vector_of
from ..views import for_vectors

REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Product", "All", "Any"}


def blocks(op) -> tuple[int, int, int] | None:
    """(outer, reduced, inner) sizes, or None when the reduced axes are not contiguous."""
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


def _identity(kind: str, t: ir.Type, dtype: str):
    if kind in ("Sum", "Mean", "Any"):
        return constant(t, 0)
    if kind in ("Product", "All"):
        return constant(t, 1)
    if dtypes.is_float(dtype):
        return constant(t, math.inf if kind == "Min" else -math.inf)
    bits = compute_type(dtype).width
    if is_signed(dtype):
        return constant(t, (1 << (bits - 1)) - 1 if kind == "Min" else -(1 << (bits - 1)))
    return constant(t, (1 << bits) - 1 if kind == "Min" else 0)


def _combine(b: ir.IRBuilder, kind: str, dtype: str, acc: ir.Value, x: ir.Value) -> ir.Value:
    is_float = dtypes.is_float(dtype)
    if kind in ("Sum", "Mean"):
        return b.fadd(acc, x) if is_float else b.add(acc, x)
    if kind == "Product":
        return b.fmul(acc, x) if is_float else b.mul(acc, x)
    if kind == "All":
        return b.and_(acc, x)
    if kind == "Any":
        return b.or_(acc, x)
    predicate = "<" if kind == "Min" else ">"
    if is_float:
        # NaN wins, as in numpy's max/min.
        take = b.or_(b.fcmp_ordered(predicate, x, acc), b.fcmp_unordered("uno", x, x))
    else:
        take = (b.icmp_signed if is_signed(dtype) else b.icmp_unsigned)(predicate, x, acc)
    return b.select(take, x, acc)


def _horizontal(b: ir.IRBuilder, kind: str, dtype: str, vector: ir.Value, lanes: int) -> ir.Value:
    result = b.extract_element(vector, i64(0))
    for lane in range(1, lanes):
        result = _combine(b, kind, dtype, result, b.extract_element(vector, i64(lane)))
    return result


def reduction(ctx, op) -> None:
    x, out = op.inputs[0], op.outputs[0]
    outer, reduced, inner = blocks(op)
    b = ctx.b
    kind = op.type
    ctype = compute_type(x.dtype)
    lanes = ctx.lanes_for([x.dtype])
    px, po = ctx.pointer(x), ctx.pointer(out)
    xs = storage_type(x.dtype)
    scale = 1.0 / reduced if kind == "Mean" and reduced else None

    def finish(value, width):
        if scale is not None:
            value = b.fmul(value, constant(value.type, scale))
        return narrow(b, value, out.dtype, width)

    with for_range(b, i64(0), i64(outer), name="o") as o:
        row = b.mul(o, i64(reduced * inner))
        if inner == 1:
            with b.goto_entry_block():
                vacc = b.alloca(vector_of(ctype, lanes))
                sacc = b.alloca(ctype)
            b.store(_identity(kind, vector_of(ctype, lanes), x.dtype), vacc)
            b.store(_identity(kind, ctype, x.dtype), sacc)

            def step(index, width):
                value = widen(b, load(b, px, index, xs, width), x.dtype, width)
                slot = vacc if width > 1 else sacc
                b.store(_combine(b, kind, x.dtype, b.load(slot), value), slot)

            for_vectors(b, row, reduced, lanes, step)
            total = b.load(sacc)
            if lanes > 1 and reduced >= lanes:
                total = _combine(b, kind, x.dtype, _horizontal(b, kind, x.dtype, b.load(vacc), lanes), total)
            store(b, finish(total, 1), po, o, storage_type(out.dtype))
        else:
            def column(index, width):
                t = vector_of(ctype, width)
                with b.goto_entry_block():
                    acc = b.alloca(t)
                b.store(_identity(kind, t, x.dtype), acc)
                with for_range(b, i64(0), i64(reduced), name="r") as r:
                    offset = b.add(b.add(row, b.mul(r, i64(inner))), index)
                    b.store(_combine(b, kind, x.dtype, b.load(acc), widen(b, load(b, px, offset, xs, width), x.dtype, width)), acc)
                store(b, finish(b.load(acc), width), po, b.add(b.mul(o, i64(inner)), index), storage_type(out.dtype), width)

            for_vectors(b, i64(0), inner, lanes, column)


def arg_reduction(ctx, op) -> None:
    """Index of the first maximum (minimum) along the axis; NaN counts as the extreme, as numpy."""
    x, out = op.inputs[0], op.outputs[0]
    outer, reduced, inner = blocks(op)
    b = ctx.b
    ctype = compute_type(x.dtype)
    px, po = ctx.pointer(x), ctx.pointer(out)
    predicate = ">" if op.type == "ArgMax" else "<"
    is_float = dtypes.is_float(x.dtype)
    with b.goto_entry_block():
        best, where, seen_nan = b.alloca(ctype), b.alloca(ir.IntType(64)), b.alloca(I1)
    with for_range(b, i64(0), i64(outer), name="o") as o:
        with for_range(b, i64(0), i64(inner), name="i") as i:
            base = b.add(b.mul(o, i64(reduced * inner)), i)
            b.store(widen(b, load(b, px, base, storage_type(x.dtype)), x.dtype, 1), best)
            b.store(i64(0), where)
            b.store(b.fcmp_unordered("uno", b.load(best), b.load(best)) if is_float else constant(I1, 0), seen_nan)
            with for_range(b, i64(1), i64(reduced), name="r") as r:
                value = widen(b, load(b, px, b.add(base, b.mul(r, i64(inner))), storage_type(x.dtype)), x.dtype, 1)
                if is_float:
                    better = b.fcmp_ordered(predicate, value, b.load(best))
                    is_nan = b.fcmp_unordered("uno", value, value)
                    take = b.and_(b.not_(b.load(seen_nan)), b.or_(better, is_nan))
                    b.store(b.or_(b.load(seen_nan), is_nan), seen_nan)
                else:
                    take = (b.icmp_signed if is_signed(x.dtype) else b.icmp_unsigned)(predicate, value, b.load(best))
                with b.if_then(take):
                    b.store(value, best)
                    b.store(r, where)
            result = b.load(where)
            out_type = storage_type(out.dtype)
            store(b, b.trunc(result, out_type) if out_type.width < 64 else result, po, b.add(b.mul(o, i64(inner)), i), out_type)


def choose(op):
    if op.type in REDUCTIONS and blocks(op) is not None:
        return "Reduce", reduction
    if op.type in ("ArgMax", "ArgMin"):
        return "ArgReduce", arg_reduction
    return None



