"""Indexing kernels: Gather (embedding rows), ScatterAdd (its transpose) and OneHot.

An index outside the table is not read or written; the step records itself in the
status word and the runtime raises an error naming the op, as the reference does.
"""

from __future__ import annotations

import math

from llvmlite import ir

from .... import dtypes
from ..convert import narrow, widen
from ..irutil import I64, compute_type, constant, for_range, i64, load, storage_type, store, vector_of
from ..views import for_vectors


def load_index(ctx, var, position) -> ir.Value:
    """Element `position` of an integer variable, as i64."""
    value = load(ctx.b, ctx.pointer(var), position, storage_type(var.dtype))
    return ctx.b.sext(value, I64) if value.type.width < 64 else value


def check_range(ctx, index, rows) -> ir.Value:
    """Whether 0 <= index < rows; when not, the step marks itself failed (the runtime raises)."""
    b = ctx.b
    bad = b.or_(b.icmp_signed("<", index, i64(0)), b.icmp_signed(">=", index, i64(rows)))
    ctx.fail(bad)
    return b.not_(bad)


def gather(ctx, op) -> None:
    params, indices = op.inputs
    out = op.outputs[0]
    b = ctx.b
    width = math.prod(params.shape[1:])
    element = storage_type(params.dtype)
    lanes = ctx.lanes_for([params.dtype])
    pp, po = ctx.pointer(params), ctx.pointer(out)
    with for_range(b, i64(0), i64(indices.size), name="n") as n:
        row = load_index(ctx, indices, n)
        with b.if_then(check_range(ctx, row, params.shape[0])):
            source, target = b.mul(row, i64(width)), b.mul(n, i64(width))

            def copy(i, w):
                store(b, load(b, pp, b.add(source, i), element, w), po, b.add(target, i), element, w)

            for_vectors(b, i64(0), width, lanes, copy)


def scatter_add(ctx, op) -> None:
    indices, updates = op.inputs
    out = op.outputs[0]
    b = ctx.b
    width = math.prod(out.shape[1:])
    lanes = ctx.lanes_for([out.dtype])
    pu, po = ctx.pointer(updates), ctx.pointer(out)
    element = storage_type(out.dtype)
    is_float = isinstance(compute_type(out.dtype), (ir.FloatType, ir.DoubleType))
    for_vectors(b, i64(0), out.size, lanes, lambda i, w: store(b, narrow(b, constant(_ctype(out, w), 0), out.dtype, w), po, i, element, w))
    with for_range(b, i64(0), i64(indices.size), name="n") as n:
        row = load_index(ctx, indices, n)
        with b.if_then(check_range(ctx, row, out.shape[0])):
            source, target = b.mul(n, i64(width)), b.mul(row, i64(width))

            def add(i, w):
                current = widen(b, load(b, po, b.add(target, i), element, w), out.dtype, w)
                extra = widen(b, load(b, pu, b.add(source, i), storage_type(updates.dtype), w), updates.dtype, w)
                total = b.fadd(current, extra) if is_float else b.add(current, extra)
                store(b, narrow(b, total, out.dtype, w), po, b.add(target, i), element, w)

            for_vectors(b, i64(0), width, lanes, add)


def _ctype(var, width):
    return vector_of(compute_type(var.dtype), width)


def one_hot(ctx, op) -> None:
    """Rows of zeros with a one at the index; an out-of-range index leaves its row zero."""
    (indices,) = op.inputs
    out = op.outputs[0]
    b = ctx.b
    depth = out.shape[-1]
    po = ctx.pointer(out)
    element = storage_type(out.dtype)
    lanes = ctx.lanes_for([out.dtype])
    for_vectors(b, i64(0), out.size, lanes, lambda i, w: store(b, narrow(b, constant(_ctype(out, w), 0), out.dtype, w), po, i, element, w))
    one = narrow(b, constant(compute_type(out.dtype), 1), out.dtype, 1)
    with for_range(b, i64(0), i64(indices.size), name="n") as n:
        hot = load_index(ctx, indices, n)
        inside = b.and_(b.icmp_signed(">=", hot, i64(0)), b.icmp_signed("<", hot, i64(depth)))
        with b.if_then(inside):
            store(b, one, po, b.add(b.mul(n, i64(depth)), hot), element)


def choose(op):
    if op.type == "ScatterAdd" and op.outputs[0].dtype in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16):
        # Sums must build up in float32 and round once, as the reference does: rounding
        # to half precision after every add loses most of a long sum (bfloat16 stops
        # growing at 256 when adding values below 1). Without a float32 buffer the
        # size of the output, the Python fallback is the accurate kernel here.
        return None
    return {"Gather": ("Gather", gather), "ScatterAdd": ("ScatterAdd", scatter_add), "OneHot": ("OneHot", one_hot)}.get(op.type)
