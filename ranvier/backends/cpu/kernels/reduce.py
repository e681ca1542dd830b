"""Reductions over a contiguous block of axes: the input is seen as [outer, reduced, inner].

With nothing inside the reduced block (inner = 1) each output is a row reduction,
accumulated in vector registers and folded at the end; otherwise whole vectors of
the inner dimension accumulate down the reduced axis. ArgMax/ArgMin scan rows.
Reductions over axes that are not adjacent decompose (see `ranvier.ops.reduce`).
"""

from __future__ import annotations

import functools

from ...llvm.irutil import compute_type
from ...llvm.loops import fold, for_vectors
from ...llvm.reductions import (
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
from ...llvm.values import Value
from ..parallel import each_part, share_out, shares, thread_count, worth_splitting
from .library import kernel


def _threads(op) -> int:
    x, out = op.inputs[0], op.outputs[0]
    return thread_count() if worth_splitting(nbytes=x.nbytes + out.nbytes) else 1


def _row_pieces(op) -> int:
    """How many pieces each row of a row reduction is cut into: one per core when there
    are fewer rows than cores (a whole-tensor sum, a gradient's finiteness check)."""
    outer, _, inner = blocks(op)
    threads = _threads(op)
    return threads if inner == 1 and outer < threads else 1


def _partials_bytes(op) -> int:
    """Where the pieces of the rows leave their partial results: eight bytes each."""
    pieces = _row_pieces(op)
    return blocks(op)[0] * pieces * 8 if pieces > 1 else 0


@kernel("Reduce", REDUCTIONS, supports=contiguous, workspace=_partials_bytes)
def reduction(ctx, op) -> None:
    """A large reduction is shared out over the pool by its blocks; with fewer blocks
    than cores, by vectors of its columns (a bias gradient's column sums) or, for rows,
    by pieces of each row whose partial results are combined after (a whole-tensor sum)."""
    x, out = op.inputs[0], op.outputs[0]
    outer, reduced, inner = blocks(op)
    combine, start, element = combiner(op.type), identity(op.type, x.dtype), term(op.type)
    lanes = ctx.lanes_for([x.dtype])
    columns = column_reduction(op)

    def finish(value: Value) -> Value:
        return finished(op, value)

    def block(ctx, rows: tuple[int | Value, int | Value], cols: tuple[int | Value, int | Value]) -> None:
        with ctx.loop(*rows, name="o") as o:
            if inner == 1:
                total = fold(ctx, o * reduced, reduced, lanes, x.dtype, start, combine, lambda i, w: element(ctx.load(x, i, w)))
                ctx.store(out, o, finish(total))
            else:
                for_vectors(ctx, cols[0], cols[1] - cols[0], lanes, lambda i, w: columns(ctx, o, i, w))

    threads, pieces = _threads(op), _row_pieces(op)
    if pieces > 1:
        _reduce_rows_in_pieces(ctx, op, pieces, lanes)
    elif outer >= threads or inner == 1:
        share_out(ctx, outer, threads, lambda ctx, first, last: block(ctx, (first, last), (0, inner)))
    else:
        share_out(ctx, inner, threads, lambda ctx, first, last: block(ctx, (0, outer), (first, last)), lanes)


def _reduce_rows_in_pieces(ctx, op, pieces: int, lanes: int) -> None:
    """Each row cut into `pieces` runs of whole vectors, one per pool part, each folded
    into a partial result in the workspace; the caller then combines each row's partials."""
    x, out = op.inputs[0], op.outputs[0]
    outer, reduced, _ = blocks(op)
    combine, start, element = combiner(op.type), identity(op.type, x.dtype), term(op.type)
    runs = shares(reduced, pieces, lanes)

    def partials(ctx):
        return ctx.b.bitcast(ctx.address(ctx.workspace), compute_type(x.dtype).as_pointer())

    def piece(ctx, number: int | Value, first: int | Value, last: int | Value) -> None:
        with ctx.loop(0, outer, name="o") as o:
            total = fold(ctx, o * reduced + first, last - first, lanes, x.dtype, start, combine,
                         lambda i, w: element(ctx.load(x, i, w)))
            ctx.b.store(total.ir, ctx.b.gep(partials(ctx), [(o * len(runs) + number).ir]))

    each_part(ctx, runs, piece)
    with ctx.loop(0, outer, name="o") as o:
        values = [Value(ctx.b, ctx.b.load(ctx.b.gep(partials(ctx), [(o * len(runs) + number).ir])), x.dtype)
                  for number in range(len(runs))]
        ctx.store(out, o, finished(op, functools.reduce(combine, values)))


@kernel("ArgReduce", {"ArgMax", "ArgMin"})
def arg_reduction(ctx, op) -> None:
    outer, _, inner = blocks(op)
    body = arg_reduction_element(op)
    with ctx.loop(0, outer, name="o") as o, ctx.loop(0, inner, name="i") as i:
        body(ctx, o, i)
