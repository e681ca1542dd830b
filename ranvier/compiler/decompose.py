"""Decomposition: rewrite composite ops into the ops their definitions decompose them into.

An op is rebuilt where the backend cannot run it whole, or where its decomposition is
preferred on any backend (see `ranvier.ops.Decomposition`). Every variable the rest of
the flow sees keeps its name; only the inside of the op changes.
"""

from __future__ import annotations

from collections.abc import Callable

from ..flow.builder import Builder
from ..flow.graph import Flow, Function, Operation
from ..ops import op_def
from .rewrite import splice


def decompose(flow: Flow, func: Function, runs_whole: Callable[[Operation], bool]) -> None:
    """Replace each op of `func` by its decomposition, except where the backend runs it
    whole (`runs_whole(op)`) and the decomposition is not preferred anyway. The ops a
    decomposition makes are looked at in turn (a convolution's input gradient becomes a
    convolution, which a backend without a kernel for it decomposes further)."""
    seen: set[str] = set()
    while fresh := [op for op in func.ops if op.name not in seen]:
        for op in fresh:
            seen.add(op.name)
            _decompose_op(flow, func, op, runs_whole)


def _decompose_op(flow: Flow, func: Function, op: Operation, runs_whole: Callable[[Operation], bool]) -> None:
    for decomposition in op_def(op.type).decompositions:
        preferred = decomposition.prefer is not None and decomposition.prefer(op)
        if runs_whole(op) and not preferred:
            continue
        result = decomposition.rule(Builder(flow, func), op)
        if result is not None:
            splice(flow, op, result if isinstance(result, list) else [result])
            return
