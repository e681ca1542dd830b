"""Reductions over contiguous axes, the input seen as [outer, reduced, inner]: output
element (o, i) combines x[o, r, i] down r, by the CPU backend's own combiners
(`ranvier.backends.llvm.reductions`).

Many outputs with a short reduced axis (a bias gradient's column sums over a few rows)
get one thread per output element, summing in order (the CPU's column reduction, one lane
wide). Few outputs with a long axis (a loss's mean, a gradient norm's sum of squares over
millions of elements) get a block per output element instead, its threads splitting the
axis as a row kernel's do (`rows.fold_over_block`). ArgMax and ArgMin run the CPU's own
scan, one thread per output element.

A block per output leaves most of the GPU idle where there are few outputs of a very long
axis (a gradient's sum of squares for its norm: one output, millions of elements, one
multiprocessor of 132): those this backend declines, and the reduction's staged
decomposition (`ranvier.ops.reduce`) runs them as a reduction of many pieces, then one of
the pieces' results. So it does with long columns (a gain's gradient: 768 columns summed
over 32K rows), whose block per column would read one element a row, each a cache line
apart: their pieces of 32 rows are a thread's each, a warp reading 32 adjacent columns of
a row at once, and the pieces' results reduce the same way until few are left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops.reduce import staged_chunk
from ..llvm.reductions import (
    REDUCTIONS,
    arg_reduction_element,
    blocks,
    column_reduction,
    combiner,
    contiguous,
    finished,
    identity,
    term,
)
from ..llvm.values import index_value
from .library import LIBRARY, Generator
from .rows import fold_over_block, threads_per_row

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

ARG_REDUCTIONS = {"ArgMax", "ArgMin"}
SPLIT_AXIS = 64  # reduced elements from which a block splits the axis…
FEW_OUTPUTS = 1 << 16  # …where there are at most this many outputs (more fill the GPU a thread each)
STAGED_OUTPUTS = 64  # outputs under which a long axis reduces in stages…
STAGED_AXIS = 1 << 16  # …from this many reduced elements on
STAGED_COLUMNS = 1024  # rows from which columns that would take a block each reduce in stages


def supports(op: Operation) -> bool:
    if op.type in ARG_REDUCTIONS:
        return True
    return op.type in REDUCTIONS and contiguous(op) and not staged(op)


def staged(op: Operation) -> bool:
    """Whether the reduction is better run in stages (module docstring)."""
    outer, reduced, inner = blocks(op)
    dtype = op.inputs[0].dtype
    few_long = dtypes.is_float(dtype) and outer * inner < STAGED_OUTPUTS and reduced >= STAGED_AXIS
    # half-precision columns keep their one rounding (each piece's result would be rounded too)
    long_columns = (dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64) and inner > 1 and reduced >= STAGED_COLUMNS
                    and outer * inner <= FEW_OUTPUTS)
    return (few_long or long_columns) and staged_chunk(reduced, inner) is not None


def operands(op: Operation) -> tuple[Variable, ...]:
    return op.inputs[0], op.outputs[0]


def launches(op: Operation) -> list[tuple]:
    outer, reduced, inner = blocks(op)
    outputs = outer * inner
    if op.type in ARG_REDUCTIONS or op.inputs[0].dtype == dtypes.DT_BOOL or reduced < SPLIT_AXIS or outputs > FEW_OUTPUTS:
        return [(outputs, lambda ctx, index: _thread_element(ctx, op, index))]
    threads = threads_per_row(reduced)
    return [(outputs, lambda ctx, index: _block_element(ctx, op, threads, index), threads)]


def _thread_element(ctx: ThreadContext, op: Operation, index: ir.Value) -> None:
    inner = blocks(op)[2]
    at = index_value(ctx.b, index)
    if op.type in ARG_REDUCTIONS:
        arg_reduction_element(op)(ctx, at // inner, at % inner)
    else:
        column_reduction(op)(ctx, at // inner, at % inner, 1)


def _block_element(ctx: ThreadContext, op: Operation, threads: int, index: ir.Value) -> None:
    """One output element, its reduced axis split over the block (every thread stores the total)."""
    x, out = op.inputs[0], op.outputs[0]
    _, reduced, inner = blocks(op)
    at = index_value(ctx.b, index)
    base = at // inner * (reduced * inner) + at % inner
    element = term(op.type)
    total = fold_over_block(ctx, threads, ctx.index(0), reduced, x.dtype, identity(op.type, x.dtype), combiner(op.type),
                            lambda r, width: element(ctx.load(x, base + r * inner)))
    ctx.store(out, at, finished(op, total))


LIBRARY.register(Generator("Reduce", None, launches, supports=supports, rank=40, operands=operands, foreach=True))
