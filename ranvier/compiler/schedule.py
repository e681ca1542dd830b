"""Scheduling: the order a function's ops run in.

Data flow decides most of it; in-place writes add the rest: an op that overwrites a
variable (an optimizer's Assign, a fused update) runs after every other op of the
function that reads that variable, directly or through a view of it.
"""

from __future__ import annotations

from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import is_view, written_inputs


def readers(var: Variable) -> list[Operation]:
    """Ops that read `var`, directly or through ops that merely view it (a backend may
    alias a view's output to the variable's own memory)."""
    found = []
    for consumer in var.consumers:
        found.append(consumer)
        if is_view(consumer) and consumer.inputs[0] is var:
            found += readers(consumer.outputs[0])
    return found


def write_after_read(func: Function) -> dict[Operation, list[Operation]]:
    """For each op that overwrites a variable, the ops of the function that must run first."""
    after: dict[Operation, list[Operation]] = {}
    for op in func.ops:
        for target in written_inputs(op):
            after.setdefault(op, []).extend(c for c in readers(target) if c is not op and c.func is func)
    return after


def schedule(flow: Flow, func: Function) -> list[Operation]:
    """The function's ops in the order they run: dependencies first, writes after reads,
    otherwise as built."""
    return flow.op_order(func, write_after_read(func))
