"""A mixture-of-experts layer's GPU kernels: the routing sort and the grouped products.

MoERoute is the CPU's counting sort (`ranvier.backends.llvm.routing`) in one thread: it is
a few passes over the choices, each depending on the last. A grouped product is one thread
per output element: GroupedMatMul's element y[r, j] finds the group row r belongs to and
sums x[r, :] · w[e][:, j] (rows past the last group are zero); the weight gradient's
element dw[e][a, b] sums x[r, a] · dy[r, b] over group e's rows (zero for an expert no row
chose). Bad group offsets set the status word, as on the CPU. Correct at any shape and
dtype: the fallback of the tiled tensor-core kernels (`grouped_mma.py`, bfloat16 products).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation
from ...ops import attrs_of
from ..llvm.routing import group_bounds, route
from ..llvm.values import Value, index_value
from .library import LIBRARY, Generator, one_launch

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

OPS = ("MoERoute", "GroupedMatMul", "GroupedMatMulWeightGrad")


def supports(op: Operation) -> bool:
    return op.type in OPS


def elements(op: Operation) -> int:
    return 1 if op.type == "MoERoute" else op.outputs[0].size


def emit(ctx: ThreadContext, op: Operation, index: ir.Value) -> None:
    if op.type == "MoERoute":
        route(ctx, op)
    elif op.type == "GroupedMatMul":
        _grouped_product(ctx, op, index_value(ctx.b, index))
    else:
        _grouped_weight_grad(ctx, op, index_value(ctx.b, index))


def _grouped_product(ctx: ThreadContext, op: Operation, index: Value) -> None:
    x, w, offsets = op.inputs
    y = op.outputs[0]
    transposed = attrs_of(op)["transpose_b"]
    rows, k = x.shape
    n = y.shape[1]
    r, j = index // n, index % n
    group = ctx.local(dtypes.DT_INT64, initial=-1)
    with ctx.loop(0, w.shape[0], name="e") as e:
        start, stop, good = group_bounds(ctx, offsets, e, rows)
        with ctx.when(good & (start <= r) & (r < stop)):
            group.set(e)
    total = ctx.local(y.dtype, initial=0.0)
    e = group.value
    with ctx.when(e >= 0), ctx.loop(0, k, name="p") as p:
        weight = ctx.load(w, e * (k * n) + (j * k + p if transposed else p * n + j))
        total.set(total.value + ctx.load(x, r * k + p) * weight)
    ctx.store(y, index, total.value)


def _grouped_weight_grad(ctx: ThreadContext, op: Operation, index: Value) -> None:
    x, dy, offsets = op.inputs
    dw = op.outputs[0]
    rows, k = x.shape
    n = dy.shape[1]
    e, within = index // (k * n), index % (k * n)
    a, b = (within % k, within // k) if attrs_of(op)["transpose"] else (within // n, within % n)
    start, stop, good = group_bounds(ctx, offsets, e, rows)
    total = ctx.local(dw.dtype, initial=0.0)
    with ctx.when(good), ctx.loop(start, stop, name="r") as r:
        total.set(total.value + ctx.load(x, r * k + a) * ctx.load(dy, r * n + b))
    ctx.store(dw, index, total.value)


LIBRARY.register(Generator("Route", frozenset({"MoERoute"}), one_launch(elements, emit), rank=80))
LIBRARY.register(Generator("GroupedProduct", frozenset(OPS) - {"MoERoute"}, one_launch(elements, emit), rank=90))
