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
from .rewrite import erase
from .schedule import readers


def is_elementwise(op: Operation) -> bool:
    """Ops a Calculate can hold: elementwise, one output, with a formula to generate
    (an op without one would send the whole fused loop to a fallback)."""
    definition = op_def(op.type)
    return (
        definition.family == "elementwise" and definition.formula is not None
        and op.type != "Identity" and len(op.outputs) == 1
    )


class _Group:
    def __init__(self, first: Operation, position: int):
        self.ops = [(position, first)]
        self.shape = list(first.outputs[0].shape)
        self.parent: _Group = self

    def root(self) -> _Group:
        group = self
        while group.parent is not group:
            group.parent = group.parent.parent
            group = group.parent
        return group

    @property
    def members(self) -> list[Operation]:
        return [op for _, op in sorted(self.ops, key=lambda item: item[0])]


def fuse_elementwise(flow: Flow, func: Function, ops: list[Operation], keep: set[str]) -> None:
    """Replace groups of elementwise ops (given in dependency order) by Calculate ops.

    An op joins (and so merges) the groups of every input producer with its output
    shape, unless that would make a path leave the merged group and come back.
    `keep` names variables that must stay visible (outputs, values other cells read).
    The function's op list changes; order it again before use.
    """
    group_of: dict[Operation, _Group] = {}
    depends_on: dict[Operation, set[_Group]] = {}  # op -> groups it reads from, directly or not
    for position, op in enumerate(ops):
        upstream: set[_Group] = set()
        for v in op.inputs:
            producer = v.producer
            if producer is None or producer not in depends_on:
                continue
            upstream |= depends_on[producer]
            if producer in group_of:
                upstream.add(group_of[producer])
        depends_on[op] = upstream
        if not is_elementwise(op):
            continue
        shape = list(op.outputs[0].shape)
        candidates = {
            group_of[v.producer].root()
            for v in op.inputs
            if v.producer is not None and v.producer in group_of and group_of[v.producer].root().shape == shape
        }
        group = _Group(op, position)
        group_of[op] = group
        for candidate in sorted(candidates, key=lambda g: min(p for p, _ in g.ops)):
            if _convex(group.root(), candidate, group_of, depends_on):
                _merge(group.root(), candidate)

    roots = {g.root(): None for g in group_of.values()}
    # Decide every fold before rewriting anything: the checks read the original graph.
    plans = [(group, _assigns(group, func, keep, group_of, depends_on)) for group in roots]
    for group, assigns in plans:
        if len(group.ops) > 1 or assigns:
            _build_calculate(flow, func, group, keep, assigns)


def _merge(a: _Group, b: _Group) -> None:
    b.parent = a
    a.ops += b.ops


def _convex(a: _Group, b: _Group, group_of, depends_on) -> bool:
    """Merging is safe when no value flows from one group to the other through an outside op."""
    merged = {op for _, op in a.ops} | {op for _, op in b.ops}
    for _, op in a.ops + b.ops:
        for v in op.inputs:
            producer = v.producer
            if producer is None or producer in merged or producer not in depends_on:
                continue
            reached = {g.root() for g in depends_on[producer]}
            if producer in group_of:
                reached.add(group_of[producer].root())
            if a in reached or b in reached:
                return False
    return True


def _assigns(group: _Group, func: Function, keep: set[str], group_of, depends_on) -> list[Operation]:
    """Assigns of a group's value to a same-shaped variable, when nothing outside the group
    needs that value: they fold into the group as in-place writes. A write must follow
    every other reader of its target (directly or through a view), so an Assign stays
    separate when such a reader itself depends on the group (folding it would make a cycle)."""
    members = {op for _, op in group.ops}
    found = []
    for _, op in group.ops:
        out = op.outputs[0]
        writers = [c for c in out.consumers if c.type == "Assign" and c.func is func and c.inputs[1] is out]
        others = [c for c in out.consumers if c not in writers]
        if len(writers) != 1 or list(writers[0].inputs[0].shape) != group.shape or any(c not in members for c in others):
            continue
        if out.name in keep or out.out:
            continue  # the value itself must stay visible
        target_readers = [c for c in readers(writers[0].inputs[0]) if c.func is func and c is not writers[0] and c not in members]
        if any(group in _upstream(r, group_of, depends_on) for r in target_readers):
            continue
        found.append(writers[0])
    return found


def _upstream(op: Operation, group_of, depends_on) -> set[_Group]:
    """Groups the op's fused unit (its whole group, if it has one) reads from."""
    unit = [member for _, member in group_of[op].root().ops] if op in group_of else [op]
    return {g.root() for member in unit for g in depends_on.get(member, set())}


def _build_calculate(flow: Flow, func: Function, group: _Group, keep: set[str], assigns: list[Operation]) -> Operation:
    members = {op for _, op in group.ops}
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
    for op in group.members:
        call = Call(op.type, tuple(operand(v) for v in op.inputs), tuple(sorted(op.attrs.items())))
        out = op.outputs[0]
        if out.name in assigned:  # the Assign's target is written in place; members may read the value
            statements.append((Ref("$", temps), call))
            names[out.name] = Ref("$", temps)
            statements.append((assigned[out.name], Call("Identity", (Ref("$", temps),))))
            temps += 1
            continue
        if out.name in keep or out.out or any(c not in members for c in out.consumers):
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
    internal = [v for op in group.members for v in op.outputs if v not in outputs]
    erase(flow, [*group.members, *assigns], internal)
    for v in inputs:
        fused.add_input(v)
    for v in outputs:
        fused.add_output(v)
    func.add(fused)
    return fused
