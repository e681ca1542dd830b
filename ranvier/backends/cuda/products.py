"""Matrix products (MatMul, batched and broadcast as numpy does, either operand
transposed) as one GPU thread per output element: element (batch, i, j) sums
op(A)[batch][i, :] · op(B)[batch][:, j] in the output's compute type. Consecutive threads
take consecutive j: they read one row of A (the same addresses) and neighbouring columns
of B. Correct for every float dtype and shape; products on tensor cores (cuBLASLt, or
generated tiles) are the GPU speed issue's work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ..llvm.strided import contiguous_strides
from ..llvm.values import index_value
from .library import LIBRARY, Generator, one_launch

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)


def supports(op: Operation) -> bool:
    return op.type == "MatMul"


def elements(op: Operation) -> int:
    return op.outputs[0].size


def batch_strides(var: Variable, batch: list[int]) -> list[int]:
    """The element strides of `var`'s matrices along the output's batch dimensions
    (0 where `var` is broadcast)."""
    own = contiguous_strides(var.shape)[:-2]
    lead = len(batch) - (var.rank - 2)
    return [0 if d < lead or var.shape[d - lead] == 1 else own[d - lead] for d in range(len(batch))]


def emit(ctx: ThreadContext, op: Operation, index: ir.Value) -> None:
    a, b = op.inputs[:2]
    out = op.outputs[0]
    attrs = attrs_of(op)
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    *batch, m, n = out.shape
    k = a.shape[-2] if ta else a.shape[-1]
    element = index_value(ctx.b, index)
    i, j, rest = (element // n) % m, element % n, element // (m * n)
    a_start, b_start = ctx.index(0), ctx.index(0)
    for size, a_stride, b_stride in reversed(list(zip(batch, batch_strides(a, batch), batch_strides(b, batch)))):
        coordinate = rest % size
        rest = rest // size
        a_start, b_start = a_start + coordinate * a_stride, b_start + coordinate * b_stride
    a_row, a_step = (a_start + i, m) if ta else (a_start + i * k, 1)
    b_column, b_step = (b_start + j * k, 1) if tb else (b_start + j, n)
    total = ctx.local(out.dtype, initial=0)
    with ctx.loop(0, k, name="p") as p:
        total.set(total.value + ctx.load(a, a_row + p * a_step) * ctx.load(b, b_column + p * b_step))
    ctx.store(out, element, total.value)


LIBRARY.register(Generator("Product", None, one_launch(elements, emit), supports=supports, rank=100))
