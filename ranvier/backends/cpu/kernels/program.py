"""Elementwise programs as loop bodies: an op's formula applied to IR values, a Calculate
program evaluated statement by statement, and that program run as a GEMM's epilogue over
the block of the product a call just wrote. Registers no kernel (maps.py and matmul.py
use it), so importing it leaves the order kernels are tried in alone."""

from __future__ import annotations

import math

from ....ops import Attrs, op_def
from ....ops.expression import Program, parse
from ....ops.fused import EPILOGUE_PRODUCTS, epilogue_input_strides, fused_type, product_type
from ...llvm.values import Value
from ..views import Body, View, emit_map

FUSED_PRODUCTS = {fused_type(product) for product in EPILOGUE_PRODUCTS}


def apply(op_type: str, attrs: dict[str, str], args: list[Value]) -> Value:
    """`op_type(args)` on IR values, by the op's formula, with its typed attributes."""
    definition = op_def(op_type)
    return definition.formula(*args, **Attrs(attrs, op_type, op_type, definition.attrs).values())


def program_body(program: Program, outputs: int) -> Body:
    """A Calculate program as a loop body: its `outputs` results, then what it writes in place."""

    def body(values, lanes):
        return program.evaluate(values, outputs, lambda node, args: apply(node.op_type, dict(node.attrs), args))

    return body


def epilogue(ctx, op, at: int, rows: int, columns: int) -> None:
    """A MatMulCalculate's or Conv2DCalculate's program over the block of its product a GEMM
    call just wrote: `rows` × `columns` from element `at` of output 0 (in the matrix the
    GEMM writes, rows `n` apart), on the calling thread. A plain product has none."""
    if op.type not in FUSED_PRODUCTS:
        return
    product = op.outputs[0]
    layout = EPILOGUE_PRODUCTS[product_type(op.type)]
    outer, columns_rank = layout
    n = math.prod(product.shape[-columns_rank:])
    per_index = math.prod(product.shape[outer:])  # elements under one outer index (an image's)
    index, within = divmod(at, per_index)
    row, column = divmod(within, n)

    def block(var, strides: tuple[int, int, int]) -> View:
        over, down, across = strides
        return View(var, index * over + row * down + column * across, [down, across])

    own = (per_index if outer else 0, n, 1)
    inputs = [block(product, own)] + [block(v, epilogue_input_strides(v.shape, product.shape, layout)) for v in op.inputs[2:]]
    emit_map(ctx, [rows, columns], inputs, [block(v, own) for v in op.outputs],
             program_body(parse(op.attrs["expr"]), len(op.outputs)), split=False)
