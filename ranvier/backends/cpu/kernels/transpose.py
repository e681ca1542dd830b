"""Transposes that move the innermost axis (Kᵀ in attention, NCHW → NHWC): in L × L tiles.

Once adjacent axes that stay adjacent are merged, such a transpose is out[b, p, q] =
x[b, q, p]. The strided loop engine would read x one element at a time, a cache line
apart; here each tile is L vector loads along x's rows, a transpose in registers
(`transpose_square`) and L vector stores along out's rows (L the lanes of a register).
Rows and columns past the last whole tile go element by element. The output's rows are
shared out over the worker pool in whole tiles.
"""

from __future__ import annotations

from .... import dtypes
from ....ops import attrs_of
from ...kernels import planned
from ...llvm.irutil import transpose_square
from ...llvm.strided import View, collapse, contiguous_strides, dense_view
from ...llvm.values import Value
from ..parallel import run_parts, shares, thread_count, worth_splitting
from .library import kernel

_MOVED_AS_IS = (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64, dtypes.DT_INT32, dtypes.DT_INT64)


def batched_transpose(op) -> tuple[int, int, int] | None:
    """(batch, p, q) when the Transpose is out[b, p, q] = x[b, q, p] with its axes merged."""
    x, out = op.inputs[0], op.outputs[0]
    perm = attrs_of(op)["perm"] or list(reversed(range(x.rank)))
    own = contiguous_strides(x.shape)
    dims, (reads, _) = collapse(list(out.shape), [View(x, 0, [own[p] for p in perm]), dense_view(out)])
    if len(dims) == 2:
        dims, reads = [1, *dims], [0, *reads]
    if len(dims) != 3:
        return None
    batch, p, q = dims
    return (batch, p, q) if reads[1:] == [1, p] and (batch == 1 or reads[0] == p * q) else None


def _tiles_pay(op) -> bool:
    return op.inputs[0].dtype in _MOVED_AS_IS and batched_transpose(op) is not None


@kernel("TileTranspose", {"Transpose"}, supports=_tiles_pay, rank=10)
def tile_transpose(ctx, op) -> None:
    x, out = op.inputs[0], op.outputs[0]
    batch, p, q = planned(batched_transpose(op), op)
    lanes = ctx.target.lanes(dtypes.itemsize(x.dtype))
    threads = thread_count() if worth_splitting(nbytes=2 * x.nbytes) else 1
    whole_p, whole_q = p - p % lanes, q - q % lanes

    def rows(first: int, last: int):
        """out's rows [first, last) of every batch: whole tiles, then what is left of
        each row past the last whole tile, then (in the last part) the rows left over."""

        def emit(ctx) -> None:
            def element(b: Value, row: Value, column: Value) -> None:
                ctx.store(out, (b * p + row) * q + column, ctx.load(x, (b * q + column) * p + row))

            with ctx.loop(0, batch, name="b") as b:
                tiled_end = min(last, whole_p)
                with ctx.loop(first, tiled_end, step=lanes, name="p0") as p0, ctx.loop(0, whole_q, step=lanes, name="q0") as q0:
                    loaded = [ctx.load(x, (b * q + q0 + i) * p + p0, lanes).ir for i in range(lanes)]
                    for j, vector in enumerate(transpose_square(ctx.b, loaded)):
                        ctx.store(out, (b * p + p0 + j) * q + q0, Value(ctx.b, vector, x.dtype))
                if whole_q < q:
                    with ctx.loop(first, tiled_end, name="pe") as row, ctx.loop(whole_q, q, name="qe") as column:
                        element(b, row, column)
                if last > whole_p:
                    with ctx.loop(max(first, whole_p), last, name="pr") as row, ctx.loop(0, q, name="qr") as column:
                        element(b, row, column)

        return emit

    run_parts(ctx, [rows(first, last) for first, last in shares(p, threads, lanes)])
