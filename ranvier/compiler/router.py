"""Router fusion: a softmax over the last axis read by a TopK (a MoE router's
probabilities and its choice of experts) becomes one SoftmaxTopK op, which computes
both in one pass over each row. The probabilities stay an output for their other
readers (the load-balancing loss)."""

from __future__ import annotations

from typing import TypeGuard

from ..flow.graph import Flow, Function, Operation
from ..ops import attrs_of
from .rewrite import fuse


def _softmax_over_last_axis(op: Operation | None) -> TypeGuard[Operation]:
    return op is not None and op.type == "Softmax" and attrs_of(op)["axis"] % op.inputs[0].rank == op.inputs[0].rank - 1


def fuse_softmax_top_k(flow: Flow, func: Function) -> None:
    for top_k in [op for op in func.ops if op.type == "TopK"]:
        softmax = top_k.inputs[0].producer
        if not _softmax_over_last_axis(softmax) or softmax.func is not func:
            continue
        fuse(flow, func, [softmax, top_k], "SoftmaxTopK", softmax.inputs[:1], [*softmax.outputs, *top_k.outputs],
             {"k": str(attrs_of(top_k)["k"])})
