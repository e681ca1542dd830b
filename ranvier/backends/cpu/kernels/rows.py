"""The CPU's row kernels: the fused row passes of `ranvier.backends.llvm.rows`, one kernel
for each row op declared there, rows shared out over the cores, each row's passes in vectors."""

from __future__ import annotations

from collections.abc import Callable

from ....flow.graph import Operation
from ...kernels import Kernel
from ...llvm.rows import ROW_OPS, RowOp, row_shape
from ...llvm.values import Value
from ..codegen import KernelContext
from ..parallel import share_out, thread_count, worth_splitting
from .library import LIBRARY


def each_row(ctx: KernelContext, op, body: Callable[[KernelContext, Value], None]) -> None:
    """`body(ctx, r)` for every row r; rows of a large op are shared out over threads."""
    rows, _ = row_shape(op)
    if rows == 0:
        return
    nbytes = sum(v.nbytes for v in [*op.inputs, *op.outputs])
    threads = thread_count() if worth_splitting(nbytes=nbytes) else 1

    def share(ctx: KernelContext, first: int | Value, last: int | Value) -> None:
        with ctx.loop(first, last, name="row") as r:
            body(ctx, r)

    share_out(ctx, rows, threads, share)


def _each_row_of(row: RowOp) -> Callable[[KernelContext, Operation], None]:
    return lambda ctx, op: each_row(ctx, op, row.body(op))


def _register_row_kernels() -> None:
    """A kernel for each row op (`llvm/rows.py`'s `@row_op`); the ops of one kernel name
    (the fused ones' RowEpilogue) share one kernel."""
    types: dict[str, list[str]] = {}
    for op_type, row in ROW_OPS.items():
        types.setdefault(row.kernel, []).append(op_type)
    for name, those in types.items():
        row = ROW_OPS[those[0]]
        LIBRARY.register(Kernel(name, frozenset(those), _each_row_of(row), supports=row.applies))


_register_row_kernels()
