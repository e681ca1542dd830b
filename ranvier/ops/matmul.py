"""Matrix multiplication with optional transposes and broadcast batch dimensions."""

from __future__ import annotations

import numpy as np

from .registry import Attr, TensorType, define, op_def
from .rules import NUMERIC, PRECISION, broadcast_shapes, same_dtype


def matmul_dims(ctx):
    """(batch shape, M, K, N) of a MatMul, checking the inner dimensions agree."""
    a, b = ctx.inputs
    if a.rank < 2 or b.rank < 2:
        raise ctx.fail("inputs of rank 2 or more ([..., M, K] and [..., K, N])")
    m, ka = (a.shape[-1], a.shape[-2]) if ctx.attrs["transpose_a"] else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if ctx.attrs["transpose_b"] else (b.shape[-2], b.shape[-1])
    if ka != kb:
        ta = "ᵀ" if ctx.attrs["transpose_a"] else ""
        tb = "ᵀ" if ctx.attrs["transpose_b"] else ""
        raise ctx.fail(f"inner dimensions to agree in a{ta} @ b{tb} (got K={ka} and K={kb})")
    batch = broadcast_shapes(ctx, [a.shape[:-2], b.shape[:-2]])
    return batch, m, ka, n


def _infer_matmul(ctx):
    dtype = same_dtype(ctx, NUMERIC, "numeric inputs of one dtype")
    batch, m, _, n = matmul_dims(ctx)
    return [TensorType(dtype, (*batch, m, n))]


def _matmul(attrs, args, outs):
    a, b = args
    if attrs["transpose_a"]:
        a = np.swapaxes(a, -1, -2)
    if attrs["transpose_b"]:
        b = np.swapaxes(b, -1, -2)
    if np.issubdtype(a.dtype, np.floating):
        # Accumulate in float64 so the oracle is more accurate than any kernel it checks.
        return [np.matmul(a.astype(np.float64), b.astype(np.float64))]
    return [np.matmul(a, b)]


def _matmul_vjp(ctx, g):
    a, c = ctx.inputs
    dy = g[0]
    ta, tb = ctx.attrs["transpose_a"], ctx.attrs["transpose_b"]
    if a.rank > 2 and c.rank == 2 and not ta:
        # A shared matrix under a batch of rows (x[B, T, K] @ W): its gradient is one
        # GEMM over all B·T rows, not B products summed afterwards.
        rows_a, rows_dy = a.reshape([-1, a.shape[-1]]), dy.reshape([-1, dy.shape[-1]])
        da = dy.matmul(c, transpose_b=not tb)
        dc = rows_dy.matmul(rows_a, transpose_a=True) if tb else rows_a.matmul(rows_dy, transpose_a=True)
        return [da, dc]
    if not ta and not tb:
        da, dc = dy.matmul(c, transpose_b=True), a.matmul(dy, transpose_a=True)
    elif not ta and tb:
        da, dc = dy.matmul(c), dy.matmul(a, transpose_a=True)
    elif ta and not tb:
        da, dc = c.matmul(dy, transpose_b=True), a.matmul(dy)
    else:
        da, dc = c.matmul(dy, transpose_a=True, transpose_b=True), dy.matmul(a, transpose_a=True, transpose_b=True)
    return [ctx.unbroadcast(da, a), ctx.unbroadcast(dc, c)]


def _matmul_flops(op) -> int:
    a = op.inputs[0]
    k = a.shape[-2] if op_def("MatMul").attrs_of(op)["transpose_a"] else a.shape[-1]
    return 2 * op.outputs[0].size * k


define(
    "MatMul", _infer_matmul, _matmul, 2, "matmul", "a @ b, batch dimensions broadcast as numpy's",
    attrs=[
        Attr("transpose_a", "bool", False, "use aᵀ"),
        Attr("transpose_b", "bool", False, "use bᵀ"),
        PRECISION,
    ],
    vjp=_matmul_vjp, flops=_matmul_flops, method="matmul",
)
