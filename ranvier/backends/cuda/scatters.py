"""Accumulations on the GPU: ScatterAdd (rows of updates added at their indices: an
embedding's gradient) and StridedScatterAdd (d added through a strided view: a
convolution's or a pooling's input gradient). Two launches each: the output zeroed, one
thread per element; then one thread per update element adds it where it lands, with an
atomic add, since several land on one element (a repeated token, overlapping windows):
the hardware's for 32- and 64-bit elements; for 8- and 16-bit ones (half precision,
small integers) a compare-and-swap loop on the aligned 32-bit word that holds the element.
The order of those adds is the threads' and may vary in the last bits from run to run;
the host check, adding in index order, matches the CPU. Myelin's AssignAddScatter adds
rows into its table in place the same way, one thread per added element (no zeroing). An
index outside the table sets the status word."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ..llvm.context import check_range, load_index
from ..llvm.convert import narrow, widen
from ..llvm.irutil import I32, I64, i64, storage_type
from ..llvm.values import Value, index_value
from .library import LIBRARY, Generator

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)


def supports(op: Operation) -> bool:
    return op.type in ("ScatterAdd", "StridedScatterAdd", "AssignAddScatter") and op.inputs[-1].dtype != dtypes.DT_BOOL


def _added(op: Operation) -> Variable:
    return op.inputs[1] if op.type == "ScatterAdd" else op.inputs[0]


def launches(op: Operation) -> list:
    if op.type == "AssignAddScatter":
        table, indices = op.inputs[:2]
        return [(indices.size * table.shape[1], lambda ctx, index: _assign_add(ctx, op, index_value(ctx.b, index)))]
    out = op.outputs[0]
    return [(out.size, lambda ctx, index: ctx.store(out, index_value(ctx.b, index), 0)),
            (_added(op).size, lambda ctx, index: _add(ctx, op, index_value(ctx.b, index)))]


def _atomic_add(ctx: ThreadContext, var: Variable, at: Value, value: Value) -> None:
    """var[at] += value, atomically (module docstring)."""
    stored = storage_type(var.dtype)
    if isinstance(stored, (ir.FloatType, ir.DoubleType)):
        ctx.b.atomic_rmw("fadd", ctx.element_pointer(var, at), value.ir, "monotonic")
    elif isinstance(stored, ir.IntType) and stored.width >= 32:
        ctx.b.atomic_rmw("add", ctx.element_pointer(var, at), value.ir, "monotonic")
    else:
        _add_by_compare_and_swap(ctx, var, at, value)


def _add_by_compare_and_swap(ctx: ThreadContext, var: Variable, at: Value, value: Value) -> None:
    """var[at] += value for an 8- or 16-bit element: read the aligned 32-bit word holding
    it, write the word back with the element's sum in place only if no other thread
    changed it meanwhile (cmpxchg), else try again with what that thread left."""
    b = ctx.b
    stored = storage_type(var.dtype)
    element = ir.IntType(stored.width if isinstance(stored, ir.IntType) else 16)
    address = b.ptrtoint(ctx.element_pointer(var, at), I64)
    word = b.inttoptr(b.and_(address, i64(~3)), I32.as_pointer())
    shift = b.trunc(b.shl(b.and_(address, i64(3)), i64(3)), I32)  # the element's bit offset (little-endian)
    mask = b.shl(ir.Constant(I32, (1 << element.width) - 1), shift)
    start = b.block
    first = b.load(word)
    retry, done = b.append_basic_block("cas.retry"), b.append_basic_block("cas.done")
    b.branch(retry)
    b.position_at_end(retry)
    old = b.phi(I32)
    old.add_incoming(first, start)
    current = widen(b, b.bitcast(b.trunc(b.lshr(old, shift), element), stored), var.dtype, 1)
    total = narrow(b, (Value(b, current, var.dtype) + value).ir, var.dtype, 1)
    new = b.or_(b.and_(old, b.not_(mask)), b.shl(b.zext(b.bitcast(total, element), I32), shift))
    exchanged = b.cmpxchg(word, old, new, "monotonic", "monotonic")
    old.add_incoming(b.extract_value(exchanged, 0), b.block)
    b.cbranch(b.extract_value(exchanged, 1), done, retry)
    b.position_at_end(done)


def _add(ctx: ThreadContext, op: Operation, index: Value) -> None:
    out, added = op.outputs[0], _added(op)
    value = ctx.load(added, index)
    if op.type == "ScatterAdd":
        width = math.prod(out.shape[1:])
        row = load_index(ctx, op.inputs[0], index // width)
        with ctx.when(check_range(ctx, row, out.shape[0])):
            _atomic_add(ctx, out, row * width + index % width, value)
        return
    attrs = attrs_of(op)
    target, rest = ctx.index(attrs["offset"]), index
    for d in reversed(range(added.rank)):
        coordinate = rest % added.shape[d] if d else rest
        rest = rest // added.shape[d]
        target = target + coordinate * attrs["strides"][d]
    _atomic_add(ctx, out, target, value)



def _assign_add(ctx: ThreadContext, op: Operation, index: Value) -> None:
    """Element i of added row n: table[indices[n]] += value[n] (value's one row, if it has
    one); a negative index adds to the out-of-vocabulary row, or without one ends the list
    (no row from that index on is added), as Myelin's kernel reads it."""
    table, indices, value, *oov = op.inputs
    width = table.shape[1]
    n, i = index // width, index % width
    row = load_index(ctx, indices, n)
    added = ctx.load(value, (n * width if value.shape[0] > 1 else 0) + i)
    if oov:
        with ctx.when(row < 0):
            _atomic_add(ctx, oov[0], i, added)
        listed = row >= 0
    else:
        ended = ctx.local(dtypes.DT_BOOL, initial=0)
        with ctx.loop(0, n + 1, name="m") as m:
            ended.set(ended.value | (load_index(ctx, indices, m) < 0))
        listed = ~ended.value
    with ctx.when(listed), ctx.when(check_range(ctx, row, table.shape[0])):
        _atomic_add(ctx, table, row * width + i, added)


LIBRARY.register(Generator("Scatter", None, launches, supports=supports, rank=70))
