"""A product by a constant matrix whose result is read only as blocks of its columns (QKV's
q, k and v) computed as one product per block, each by the block's columns of the matrix.

An attention layer's QKV product writes q, k and v side by side in each row, and each is then
copied out of those rows (a StridedView each, after fold-views): three copies of the
activations a layer (12.6 MB each in BERT-base at batch 32). One product per block writes each
block whole, so what read it as a view of QKV reads it as it is (a reshape, no copy). The
products do the same multiply-adds; a bias row added after the product is cut the same way.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of, unchanging_constant
from .rewrite import erase, splice
from .views import merged_parts, split_axis


def split_column_products(flow: Flow, func: Function, keep: set[str]) -> None:
    """Cut each product by a constant matrix whose result (after bias rows) only StridedViews
    of blocks of its columns read into a product per block (see the module)."""
    for product in [op for op in flow.op_order(func) if op.type == "MatMul"]:
        if product.func is not func or not _by_constant(product):
            continue
        biases, result = _bias_rows(product, func, keep)
        if result.name in keep or result.out or not result.consumers:
            continue
        readers = list(result.consumers)
        blocks = [found for reader in readers if (found := _column_blocks(reader, result))]
        if len(blocks) != len(readers) or any(last - first == result.shape[-1] for found in blocks for first, last in found):
            continue
        b = Builder(flow, func)
        for reader, found in zip(readers, blocks):
            splice(flow, reader, [_block_product(b, product, biases, first, last).reshape(list(out.shape))
                                  for out, (first, last) in zip(reader.outputs, found)])
        adds = [add for add, _ in biases]
        erase(flow, [*reversed(adds), product], [op.outputs[0] for op in (product, *adds)])


def _by_constant(product: Operation) -> bool:
    """x · B (or x · Bᵀ) with B a constant matrix no op writes."""
    matrix = product.inputs[1]
    return (matrix.rank == 2 and unchanging_constant(matrix) and matrix.data is not None
            and not attrs_of(product)["transpose_a"] and product.inputs[0] is not matrix)


def _bias_rows(product: Operation, func: Function, keep: set[str]) -> tuple[list[tuple[Operation, Variable]], Variable]:
    """The Adds of a constant row to the product's result that follow it, each the only reader
    of what it adds to, with their rows; and the last result."""
    biases: list[tuple[Operation, Variable]] = []
    result = product.outputs[0]
    while len(result.consumers) == 1 and result.name not in keep and not result.out:
        (add,) = result.consumers
        others = [v for v in add.inputs if v is not result]
        if (add.func is not func or add.type != "Add" or len(others) != 1 or add.outputs[0].shape != result.shape
                or not unchanging_constant(others[0]) or others[0].data is None or others[0].size != result.shape[-1]):
            break
        biases.append((add, others[0]))
        result = add.outputs[0]
    return biases, result


def _column_blocks(reader: Operation, result: Variable) -> list[tuple[int, int]] | None:
    """The columns [first, last) of `result` each output of `reader` holds, where it is a
    StridedView that reads every row's block of them, rows in order, or a Split of the
    columns; else None."""
    columns = result.shape[-1]
    if reader.inputs[0] is not result or any(v is result for v in reader.inputs[1:]):
        return None
    if reader.type == "Split":
        axis = split_axis(reader)
        if axis != result.rank - 1:
            return None
        starts = itertools.accumulate((out.shape[-1] for out in reader.outputs), initial=0)
        return list(itertools.pairwise(starts))
    if reader.type != "StridedView":
        return None
    attrs = attrs_of(reader)
    rows = result.size // columns
    width = math.prod(attrs["shape"]) // rows if rows else 0
    first = int(attrs["offset"] or 0)
    parts = merged_parts(attrs["shape"], attrs["strides"])
    wanted = merged_parts([rows, width], [columns, 1])
    return [(first, first + width)] if width and first + width <= columns and parts == wanted else None


def _block_product(b: Builder, product: Operation, biases: list[tuple[Operation, Variable]], first: int, last: int) -> Tensor:
    """x · B's columns [first, last), plus those columns of each bias row."""
    x, matrix = product.inputs
    data = np.asarray(matrix.data)
    columns = data[first:last] if attrs_of(product)["transpose_b"] else data[:, first:last]
    value: Tensor = b.op("MatMul", [x, b.const(np.ascontiguousarray(columns)).var], None, dict(product.attrs))
    for _, row in biases:
        value = value + b.const(np.ascontiguousarray(np.asarray(row.data).reshape(-1)[first:last]))
    return value
