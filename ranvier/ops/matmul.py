"""Matrix multiplication with optional transposes and broadcast batch dimensions."""

from __future__ import annotations

import numpy as np

from .registry import TensorType, define
from .rules import NUMERIC, broadcast_shapes, same_dtype


def matmul_dims(ctx):
    """(batch shape, M, K, N) of a MatMul, checking the inner dimensions agree."""
    a, b = ctx.inputs
    if a.rank < 2 or b.rank < 2:
        raise ctx.fail("inputs of rank 2 or more ([..., M, K] and [..., K, N])")
    m, ka = (a.shape[-1], a.shape[-2]) if ctx.attrs.bool("transpose_a") else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if ctx.attrs.bool("transpose_b") else (b.shape[-2], b.shape[-1])
    if ka != kb:
        ta = "ᵀ" if ctx.attrs.bool("transpose_a") else ""
        tb = "ᵀ" if ctx.attrs.bool("transpose_b") else ""
        raise ctx.fail(f"inner dimensions to agree in a{ta} @ b{tb} (got K={ka} and K={kb})")
    batch = broadcast_shapes(ctx, [a.shape[:-2], b.shape[:-2]])
    return batch, m, ka, n


def _infer_matmul(ctx):
    dtype = same_dtype(ctx, NUMERIC, "numeric inputs of one dtype")
    batch, m, _, n = matmul_dims(ctx)
    return [TensorType(dtype, (*batch, m, n))]


def _matmul(attrs, args, outs):
    a, b = args
    if attrs.bool("transpose_a"):
        a = np.swapaxes(a, -1, -2)
    if attrs.bool("transpose_b"):
        b = np.swapaxes(b, -1, -2)
    if np.issubdtype(a.dtype, np.floating):
        # Accumulate in float64 so the oracle is more accurate than any kernel it checks.
        return [np.matmul(a.astype(np.float64), b.astype(np.float64))]
    return [np.matmul(a, b)]


define("MatMul", _infer_matmul, _matmul, 2, "matmul", "a @ b; attributes transpose_a, transpose_b")
