"""Mixed precision: float32 matrix products run with inputs rounded to bfloat16 or TF32 and
float32 sums (`MatMul`'s precision attribute), where the user asks for it and the backend can;
so do attention's products and convolutions (products of filters by windows).

Vector-matrix products (a decode step's) stay float32 where the matrix would be rounded as
it is read: they stream it once, so narrower inputs would save nothing; so does a decode
step's attention, of one query. A backend that keeps an unchanging constant matrix (an
inference model's weights) in the narrower type ahead of time (`narrow_weights`: bfloat16
halves the bytes a product by it streams, int8's q8_0 blocks nearly quarter them): all of
those are marked for it, whatever their rows.
"""

from __future__ import annotations

from .. import dtypes
from ..backends.base import Capabilities
from ..flow.graph import Function, Operation
from ..ops import attrs_of, unchanging_constant
from ..ops.attention import heads_first_shape


def _rows(op: Operation) -> int:
    """Rows of the product: of one matrix, or of every batch together where a batch of
    row blocks meets one shared matrix (x[B, T, K] @ W is a single product of B·T rows)."""
    a, b = op.inputs[:2]
    if attrs_of(op)["transpose_a"]:
        return a.shape[-1]
    return a.size // a.shape[-1] if b.rank == 2 and a.rank > 2 else a.shape[-2]


def use_matmul_precision(func: Function, precision: str, capabilities: Capabilities) -> None:
    """Mark, to run in `precision`, the float32 matrix products of `func` that have rows, the
    float32 attention ops (their products) and gradients of more than one query, the
    float32 convolutions and a MoE layer's grouped products, where the backend computes in
    `precision`; and the products by an unchanging constant matrix, vector-matrix ones too,
    where the backend keeps such a matrix in `precision`."""
    products = precision in capabilities.matmul_precisions
    weights = precision in capabilities.narrow_weights
    for op in func.ops:
        if op.inputs[0].dtype != dtypes.DT_FLOAT32:
            continue
        if op.type == "MatMul":
            by_constant = op.inputs[1].rank == 2 and unchanging_constant(op.inputs[1])
            marked = (products and _rows(op) > 1) or (weights and by_constant)
        elif op.type in ("Conv2D", "GroupedMatMul", "GroupedMatMulWeightGrad"):
            marked = products
        else:
            marked = products and op.type in ("Attention", "AttentionGrad") and _queries(op) > 1
        if marked:
            op.set_attr("precision", precision)


def _queries(op: Operation) -> int:
    return heads_first_shape(op.inputs[0].shape, attrs_of(op)["heads_first"])[2]
