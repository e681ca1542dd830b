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


def add_op(flow: Flow, func: Function, op_type: str, inputs: Iterable[Variable], outputs: Iterable[Variable],
           attrs: dict[str, str] | None = None, *, name: str | None = None, at: int | None = None) -> Operation:
    """A new op of `op_type` with `attrs` in `func`, reading `inputs` and writing `outputs`
    (variables no op computes), named `name` (by default `<function>/<op_type>`) made
    unique; listed last in the function, or at index `at` of its list."""
    op = flow.add_op(flow.unique_name(name or f"{func.name}/{op_type}", flow.ops), op_type)
    op.attrs = dict(attrs or {})
    for v in inputs:
        op.add_input(v)
    for v in outputs:
        op.add_output(v)
    if at is None:
        func.add(op)
    else:
        func.ops.insert(at, op)
        op.func = func
    return op


def fuse(flow: Flow, func: Function, ops: Sequence[Operation], op_type: str, inputs: Iterable[Variable],
         outputs: Iterable[Variable], attrs: dict[str, str] | None = None, *, name: str | None = None,
         dropped: Iterable[Variable] = (), keep_place: bool = False) -> Operation:
    """Replace the group `ops` of `func` by one new op (`add_op`'s) reading `inputs` and
    writing `outputs` in that order. Every value the group computed is one of `outputs` or
    of `dropped`: values only the group read, removed with it. The op is listed last in
    the function, or with `keep_place` at the first op's index in the list (ties in the
    run order keep the list's order)."""
    inputs, outputs, dropped = list(inputs), list(outputs), list(dropped)
    kept = {id(v) for v in (*outputs, *dropped)}
    for op in ops:
        lost = [v.name for v in op.outputs if id(v) not in kept]
        if lost:
            raise CompileError(f"fusing {op.type} op {op.name} into one {op_type} would lose {', '.join(lost)}: "
                               "each value of the group must be an output of the fused op or dropped")
    at = func.ops.index(ops[0]) if keep_place else None
    erase(flow, ops, dropped)
    return add_op(flow, func, op_type, inputs, outputs, attrs, name=name, at=at)


def write_into(op: Operation, index: int, var: Variable) -> Variable:
    """Make `op` write its output `index` into `var` (which no op computes) instead of the
    variable it wrote there, which no op computes then; returns that variable."""
    if var.producer is not None:
        raise CompileError(f"{op.type} op {op.name} cannot write {var.name}: {var.producer.name} computes it")
    replaced = op.outputs[index]
    replaced.producer = None
    op.outputs[index] = var
    var.producer = op
    return replaced


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
        flow.remove_var(write_into(last, last.outputs.index(new.var), original))


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
