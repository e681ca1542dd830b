"""Shape and dtype rules, and attributes, shared by several op families."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .. import dtypes
from .registry import Attr, InferContext


def broadcast_shapes(ctx: InferContext, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """numpy broadcasting; a mismatch names the op and its inputs."""
    rank = max((len(s) for s in shapes), default=0)
    result = []
    for axis in range(rank):
        size = 1
        for shape in shapes:
            offset = axis - (rank - len(shape))
            if offset < 0:
                continue
            dim = shape[offset]
            if dim == 1:
                continue
            if size != 1 and dim != size:
                raise ctx.fail("shapes that broadcast together (numpy rules)")
            size = dim
        result.append(size)
    return tuple(result)


def same_dtype(ctx: InferContext, allowed: Iterable[str] | None = None, what: str = "") -> str:
    """All inputs share one dtype, from the allowed set when one is given."""
    kinds = {v.dtype for v in ctx.inputs}
    if len(kinds) != 1:
        raise ctx.fail("inputs of one dtype")
    dtype = kinds.pop()
    if allowed is not None and dtype not in allowed:
        raise ctx.fail(what or f"dtype in {', '.join(allowed)}")
    return dtype


def normalize_axis(ctx: InferContext, axis: int, rank: int) -> int:
    if rank == 0:
        raise ctx.fail(f"no axis argument for a rank-0 input (got axis {axis})")
    if not -rank <= axis < rank:
        raise ctx.fail(f"an axis in [{-rank}, {rank}) (got {axis})")
    return axis % rank


def reduction_axes(ctx: InferContext, rank: int) -> tuple[int, ...]:
    """The `axis` attribute as a sorted tuple; absent means every axis."""
    axes = ctx.attrs["axis"]
    if axes is None:
        return tuple(range(rank))
    normalized = sorted({normalize_axis(ctx, a, rank) for a in axes})
    return tuple(normalized)


FLOATS = dtypes.FLOAT_DTYPES
NUMERIC = dtypes.NUMERIC_DTYPES
INDEX = (dtypes.DT_INT32, dtypes.DT_INT64)

# The matrix products' precision, set by the compiler (compiler/precision.py) on the ops whose
# float32 products a backend can run narrower: MatMul, Conv2D (filters by windows), Attention
# and its gradient (q kᵀ and p v), GroupedMatMul and its weight gradient, for their kernels.
PRECISION = Attr("precision", "str", "float32",
                 "float32, or bfloat16 / tfloat32: the products' float32 inputs may be rounded to that type, "
                 "float32 sums; int8 (a MatMul whose b is an unchanging constant): both quantized to blocks of 32 "
                 "int8 along k with a scale each (q8_0)")
