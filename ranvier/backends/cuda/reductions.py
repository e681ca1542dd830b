"""One output element of a reduction over contiguous axes (`kernels.py` runs one thread per
element): the input seen as [outer, reduced, inner], element (o, i) combines x[o, r, i]
down r from the reduction's starting value, with the CPU backend's combining rules
(`ranvier.backends.llvm.reductions`); ArgMax and ArgMin run the CPU's own scan. Each thread sums in order, so a long row is one
thread's loop: correct everywhere, fast where outputs are many (a bias gradient's column
sums); a row split over a block's threads is the GPU speed issue's."""

from __future__ import annotations

from llvmlite import ir

from ...flow.graph import Operation, Variable
from ..llvm.context import EmitContext
from ..llvm.convert import narrow, widen
from ..llvm.irutil import compute_type, constant, for_range, i64, load, storage_type, store
from ..llvm.reductions import REDUCTIONS, arg_reduction_element, blocks, combiner, identity
from ..llvm.values import Value, index_value

ARG_REDUCTIONS = {"ArgMax", "ArgMin"}


def supports(op: Operation) -> bool:
    return op.type in ARG_REDUCTIONS or (op.type in REDUCTIONS and blocks(op) is not None)


def operands(op: Operation) -> tuple[Variable, ...]:
    return op.inputs[0], op.outputs[0]


def elements(op: Operation) -> int:
    return op.outputs[0].size


def emit(ctx: EmitContext, op: Operation, index: ir.Value) -> None:
    b = ctx.b
    x, out = op.inputs[0], op.outputs[0]
    _, reduced, inner = blocks(op)
    if op.type in ARG_REDUCTIONS:
        at = index_value(b, index)
        arg_reduction_element(op)(ctx, at // inner, at % inner)
        return
    combine = combiner(op.type)
    kind = compute_type(x.dtype)
    total = b.alloca(kind)
    b.store(constant(kind, identity(op.type, x.dtype)), total)
    base = b.add(b.mul(b.sdiv(index, i64(inner)), i64(reduced * inner)), b.srem(index, i64(inner)))
    with for_range(b, i64(0), i64(reduced), name="r") as r:
        raw = load(b, ctx.pointer(x), b.add(base, b.mul(r, i64(inner))), storage_type(x.dtype))
        value = combine(Value(b, b.load(total), x.dtype), Value(b, widen(b, raw, x.dtype, 1), x.dtype))
        b.store(value.ir, total)
    result = Value(b, b.load(total), x.dtype)
    if op.type == "Mean" and reduced:
        result = result * (1.0 / reduced)
    store(b, narrow(b, result.ir, out.dtype, 1), ctx.pointer(out), index, storage_type(out.dtype))
