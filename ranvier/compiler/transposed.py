"""Transposed operands: a matrix product reading a Transpose of a matrix's last two axes
reads the matrix itself, its transpose flag flipped (the GEMM reads either layout), so
the transposed copy is never made.

Exporters write `x @ Wᵀ` as a Transpose and a MatMul (GPT-2's LM head, tied to the token
embedding): for GPT-2 small a 147 MB copy of the embedding every step, which a training
step keeps for its backward and whose gradient it transposes back.
"""

from __future__ import annotations

from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of
from .rewrite import erase

_FLAGS = ("transpose_a", "transpose_b")


def fold_transposed_operands(flow: Flow, func: Function, keep: set[str]) -> None:
    for product in [op for op in func.ops if op.type == "MatMul"]:
        if product.inputs[0] is product.inputs[1]:
            continue  # one variable read twice: both flags would have to flip
        for index, flag in enumerate(_FLAGS):
            transpose = _swap_of_last_two(product.inputs[index], func, keep)
            if transpose is None:
                continue
            swapped = transpose.outputs[0]
            product.replace_input(swapped, transpose.inputs[0])
            product.attrs[flag] = "0" if attrs_of(product)[flag] else "1"
            erase(flow, [transpose], [swapped])


def _swap_of_last_two(var: Variable, func: Function, keep: set[str]) -> Operation | None:
    """The Transpose of `func` computing `var` by swapping its input's last two axes,
    where the product is its only reader and `var` no result."""
    op = var.producer
    if op is None or op.type != "Transpose" or op.func is not func or len(var.consumers) != 1 or var.name in keep or var.out:
        return None
    rank = var.rank
    perm = list(attrs_of(op)["perm"])
    return op if rank >= 2 and perm == [*range(rank - 2), rank - 1, rank - 2] else None
