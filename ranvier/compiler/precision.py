"""Mixed precision: float32 matrix products run with inputs rounded to bfloat16 or TF32 and
float32 sums (`MatMul`'s precision attribute), where the user asks for it and the backend can.

Vector-matrix products (a decode step's) stay float32: they stream their matrix once,
so narrower inputs would save nothing there; so does a decode step's attention, of one
query.
"""

from __future__ import annotations

from .. import dtypes
from ..flow.graph import Function
from ..ops import attrs_of
from ..ops.attention import heads_first_shape


def _rows(op) -> int:
    """Rows of the product: of one matrix, or of every batch together where a batch of
    row blocks meets one shared matrix (x[B, T, K] @ W is a single product of B·T rows)."""
    a, b = op.inputs[:2]
    if attrs_of(op)["transpose_a"]:
        return a.shape[-1]
    return a.size // a.shape[-1] if b.rank == 2 and a.rank > 2 else a.shape[-2]


def use_matmul_precision(func: Function, precision: str) -> None:
    """Mark the float32 matrix products of `func` that have rows to run in `precision`,
    and the float32 attention ops (their products) and gradients of more than one query."""
    for op in func.ops:
        if op.inputs[0].dtype != dtypes.DT_FLOAT32:
            continue
        if (op.type == "MatMul" and _rows(op) > 1) or (op.type in ("Attention", "AttentionGrad") and _queries(op) > 1):
            op.set_attr("precision", precision)


def _queries(op) -> int:
    return heads_first_shape(op.inputs[0].shape, attrs_of(op)["heads_first"])[2]
