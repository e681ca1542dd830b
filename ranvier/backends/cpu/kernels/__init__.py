"""Kernel choice: for each op, the native kernel that handles it, or the Python fallback."""

from __future__ import annotations

from typing import Callable

from ....flow.graph import Operation
from . import attention, index, maps, matmul, reduce, rows, window
from .python import python_callback

Emitter = Callable[[object, Operation], None]

FALLBACK = ("Python", python_callback)


def _uniform_outputs(op: Operation) -> bool:
    return len({tuple(v.shape) for v in op.outputs}) <= 1


def choose(op: Operation) -> tuple[str, Emitter]:
    """(kernel name, emitter) for an op; ops without native code use the Python fallback."""
    if op.type == "MatMul":
        return matmul.kernel_name(op), matmul.matmul
    if op.type in maps.KERNELS and (op.type != "Calculate" or _uniform_outputs(op)):
        return maps.KERNELS[op.type]
    for family in _FAMILIES:
        chosen = family(op)
        if chosen is not None:
            return chosen
    return FALLBACK


_FAMILIES: list[Callable[[Operation], tuple[str, Emitter] | None]] = [reduce.choose, rows.choose, index.choose, window.choose, attention.choose]
