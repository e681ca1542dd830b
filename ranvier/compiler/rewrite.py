"""Graph edits the passes are written in: small, each keeping the flow consistent
(producers, consumers and the function's op list)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import CompileError
from ..flow.graph import Flow, Function, Operation, Variable

if TYPE_CHECKING:
    from ..flow.builder import Tensor


def replace_uses(old: Variable, new: Variable, within: Function | None = None) -> None:
    """Every op (of `within`, if given) that reads `old` reads `new` instead."""
    for consumer in list(old.consumers):
        if within is None or consumer.func is within:
            consumer.replace_input(old, new)


def erase(flow: Flow, ops: Iterable[Operation], variables: Iterable[Variable] = ()) -> None:
    """Remove ops and variables nothing reads any more."""
    for op in ops:
        flow.remove_op(op)
    for var in variables:
        flow.remove_var(var)


def splice(flow: Flow, op: Operation, results: Sequence[Tensor]) -> None:
    """Replace `op` by the ops that computed `results` (handles, one per output): the last
    op of each result writes the original output variable instead of its own, so every
    name the rest of the flow reads stays."""
    originals = list(op.outputs)
    flow.remove_op(op)
    for original, new in zip(originals, results):
        last = new.var.producer
        if last is None:
            raise CompileError(f"{op.type} op {op.name}: its replacement's {new.var.name} is computed by no op")
        last.outputs[last.outputs.index(new.var)] = original
        original.producer = last
        flow.remove_var(new.var)


def depends_on(var: Variable, source: Variable, func: Function) -> bool:
    """Whether `var` is computed (within func) from `source`."""
    pending, seen = [var], set()
    while pending:
        v = pending.pop()
        if v is source:
            return True
        producer = v.producer
        if producer is None or producer.func is not func or producer in seen:
            continue
        seen.add(producer)
        pending.extend(producer.inputs)
    return False
