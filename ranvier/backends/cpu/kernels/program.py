"""A Calculate program run as a GEMM's epilogue over the block of the product a call just
wrote (after adding the partial products of a product cut along k). Registers no kernel
(matmul.py and conv.py use it), so importing it leaves the order kernels are tried in
alone."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ....flow.graph import Variable
from ....ops import attrs_of
from ....ops.expression import program_of
from ....ops.fused import EPILOGUE_PRODUCTS, epilogue_input_strides, fused_type, product_type
from ...kernels import planned
from ...llvm import mathlib
from ...llvm.formulas import Formulas, program_body
from ...llvm.strided import View
from ...llvm.values import Value
from ..views import emit_map

FUSED_PRODUCTS = {fused_type(product) for product in EPILOGUE_PRODUCTS}


def _fast_gelu(args: list[Value], attrs: dict[str, str]) -> Value:
    (x,) = args
    return x.gelu("tanh") if attrs.get("approximate") == "tanh" else mathlib.gelu_erf_fast(x)


def _formulas(op) -> Formulas | None:
    """Where the product's inputs may be rounded to bfloat16, its program's exact Gelu is
    `mathlib.gelu_erf_fast`, whose error (2.5e-7 · max(|x|, 1)) is a thousandth of the
    rounding's. BERT-base at batch 32 (bf16 pairs, one Zen 5 core): the FFN's first product
    with its bias and Gelu took 1.15 times the second's time (the same FLOPs, a bias and a
    residual after it) with `gelu_erf`, 1.04 with this."""
    if attrs_of(op)["precision"] != "bfloat16":
        return None
    return lambda call: _fast_gelu if call.op_type == "Gelu" else None


def epilogue(ctx, op, at: int | Value, rows: int | Value, columns: int, partials: Sequence[Variable] = ()) -> None:
    """A MatMulCalculate's or Conv2DCalculate's program over the block of its product a GEMM
    call just wrote: `rows` × `columns` from element `at` of output 0 (in the matrix the
    GEMM writes, rows `n` apart), on the calling thread; `at` and `rows` may be known only
    at run time (a pool part's block). `partials` (laid out as that matrix: the products
    of other slices of k) are added to the product first; a plain product has no program,
    and only those to add."""
    fused = op.type in FUSED_PRODUCTS
    if not fused and not partials:
        return
    product = op.outputs[0]
    layout = EPILOGUE_PRODUCTS[product_type(op.type) if fused else op.type]
    outer, columns_rank = layout
    n = math.prod(product.shape[-columns_rank:])
    per_index = math.prod(product.shape[outer:])  # elements under one outer index (an image's)
    index, within = at // per_index, at % per_index
    row, column = within // n, within % n

    def block(var, strides: tuple[int, int, int]) -> View:
        over, down, across = strides
        return View(var, index * over + row * down + column * across, [down, across])

    own = (per_index if outer else 0, n, 1)
    others = op.inputs[2:] if fused else []
    program = program_body(program_of(op), len(op.outputs), _formulas(op)) if fused else lambda values, lanes: values[:1]
    added = len(partials)

    def body(values: list[Value], lanes: int) -> list[Value]:
        return program([sum(values[1 : 1 + added], values[0]), *values[1 + added :]], lanes)

    inputs = [block(v, own) for v in (product, *partials)]
    inputs += [block(v, planned(epilogue_input_strides(v.shape, product.shape, layout), op)) for v in others]
    outputs = [block(v, own) for v in (op.outputs if fused else [product])]
    emit_map(ctx, [rows, columns], inputs, outputs, body, split=False)
