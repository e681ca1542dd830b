"""Elementwise fusion: chains of elementwise ops become one Calculate op (one loop).

Ops join a group when they compute the same output shape and joining creates no
cycle (no path leaves the group and comes back). A value leaves the group as an
output when something outside reads it or the cell must keep it. An `Assign` of a
group's value to a same-shaped variable folds into the group as an in-place write,
so an optimizer's update reads and writes each parameter in a single pass.
"""

from __future__ import annotations

from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import op_def
from ..ops.expression import Call, Program, Ref

ELEMENTWISE_FAMILIES = ("elementwise",)


def is_elementwise(op: Operation) -> bool:
    return op_def(op.type).family in ELEMENTWISE_FAMILIES and op.type != "Identity" and len(op.outputs) == 1


class _Group:
    def __init__(self, first: Operation):
        self.ops = [first]
        self.shape = list(first.outputs[0].shape)
        self.produced = {v.name for v in first.outputs}


def fuse_elementwise(flow: Flow, func: Function, ops: list[Operation], keep: set[str]) -> None:
    """Replace groups of elementwise ops (given in dependency order) by Calculate ops.

    `keep` names variables that must stay visible (outputs, values other cells read).
    The function's op list changes; order it again before use.
    """
    group_of: dict[int, _Group] = {}
    depends_on: dict[int, set[int]] = {}  # op -> ids of groups it (transitively) reads from
    groups: list[_Group] = []
    for op in ops:
        inherited: set[int] = set()
        for v in op.inputs:
            producer = v.producer
            if producer is None or id(producer) not in depends_on:
                continue
            inherited |= depends_on[id(producer)]
            if id(producer) in group_of:
                inherited.add(id(group_of[id(producer)]))
        if is_elementwise(op):
            target = _joinable_group(op, group_of, depends_on)
            if target is None:
                target = _Group(op)
                groups.append(target)
            else:
                target.ops.append(op)
                target.produced.update(v.name for v in op.outputs)
            group_of[id(op)] = target
            inherited.discard(id(target))
        depends_on[id(op)] = inherited

    for group in groups:
        if len(group.ops) > 1 or _assign_of(group, func) is not None:
            _build_calculate(flow, func, group, keep)


def _joinable_group(op: Operation, group_of, depends_on) -> _Group | None:
    shape = list(op.outputs[0].shape)
    for v in op.inputs:
        if v.producer is None or id(v.producer) not in group_of:
            continue
        group = group_of[id(v.producer)]
        if group.shape != shape:
            continue
        # Joining is safe when no other input is computed from this group outside it.
        if all(
            u.producer is None
            or id(u.producer) in map(id, group.ops)
            or id(group) not in depends_on.get(id(u.producer), set())
            for u in op.inputs
        ):
            return group
    return None


def _assign_of(group: _Group, func: Function) -> list[Operation] | None:
    assigns = [
        c
        for op in group.ops
        for v in op.outputs
        for c in v.consumers
        if c.type == "Assign" and c.func is func and c.inputs[1] is v and list(c.inputs[0].shape) == group.shape
        and len(v.consumers) == 1
    ]
    return assigns or None


def _build_calculate(flow: Flow, func: Function, group: _Group, keep: set[str]) -> Operation:
    members = {id(op) for op in group.ops}
    assigns = _assign_of(group, func) or []
    assigned = {a.inputs[1].name: a.inputs[0] for a in assigns}
    inputs: list[Variable] = []
    input_index: dict[str, int] = {}
    names: dict[str, Ref] = {}
    outputs: list[Variable] = []
    statements: list[tuple[Ref | Variable, Call]] = []

    def operand(v: Variable) -> Ref:
        if v.name in names:
            return names[v.name]
        if v.name not in input_index:
            input_index[v.name] = len(inputs)
            inputs.append(v)
        return Ref("%", input_index[v.name])

    temps = 0
    for op in group.ops:
        call = Call(op.type, tuple(operand(v) for v in op.inputs), tuple(sorted(op.attrs.items())))
        out = op.outputs[0]
        if out.name in assigned:  # read by nothing but its Assign: write the target in place
            statements.append((assigned[out.name], call))
            continue
        if out.name in keep or out.out or any(id(c) not in members for c in out.consumers):
            ref = Ref("@", len(outputs))
            outputs.append(out)
        else:
            ref = Ref("$", temps)
            temps += 1
        names[out.name] = ref
        statements.append((ref, call))
    program = Program([(operand(t) if isinstance(t, Variable) else t, call) for t, call in statements])

    fused = flow.add_op(flow.unique_name(f"{func.name}/Calculate", flow.ops), "Calculate")
    fused.attrs = {"expr": str(program)}
    internal = [v for op in group.ops for v in op.outputs if v not in outputs]
    for op in [*group.ops, *assigns]:
        flow.remove_op(op)
    for v in internal:
        flow.remove_var(v)
    for v in inputs:
        fused.add_input(v)
    for v in outputs:
        fused.add_output(v)
    func.add(fused)
    return fused
