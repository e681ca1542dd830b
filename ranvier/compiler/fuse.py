"""Elementwise fusion: chains of elementwise ops become one Calculate op (one loop).

Ops join a group when they compute the same output shape and joining creates no
cycle (no path leaves the group and comes back). A value leaves the group as an
output when something outside reads it or the cell must keep it. An `Assign` of a
group's value to a same-shaped variable folds into the group as an in-place write,
so an optimizer's update reads and writes each parameter in a single pass.

Two groups of one shape that read the same computed value, neither depending on the
other, become one loop that reads it once (a SwiGLU's gradient reads d h for the
gradients of both its inputs). A group that reads an elementwise op's value and already
reads all that op's inputs computes the value itself instead of reading it (Silu(a)
beside a, in that gradient), and the value is stored only if something else needs it.
"""

from __future__ import annotations

from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import op_def
from ..ops.expression import Call, Program, Ref
from .rewrite import fuse
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
    fusion = _Fusion()
    for position, op in enumerate(ops):
        fusion.visit(op, position)
    fusion.merge_siblings(ops)
    roots = {g.root(): None for g in fusion.group_of.values()}
    # Decide every fold and recomputation before rewriting anything: the checks read the original graph.
    recomputed = {group: _recomputed(group, func) for group in roots}
    recomputing = {(name, op) for group, names in recomputed.items() for name in names for op in group.members}
    plans = [(group, _assigns(group, func, keep, fusion)) for group in roots]
    for group, assigns in plans:
        if len(group.ops) > 1 or assigns or recomputed[group]:
            _build_calculate(flow, func, group, keep, assigns, recomputed[group], recomputing)


class _Fusion:
    """The groups formed so far and what every op depends on, kept current.

    Each group is a bit; `depends_on[op]` is the mask of groups op reads from, directly
    or through other ops. When two groups merge, the merged group reads what both read,
    so every op that depended on either of them gains that too: the masks stay
    transitive, and a convexity check is a few mask tests."""

    def __init__(self) -> None:
        self.group_of: dict[Operation, _Group] = {}
        self.depends_on: dict[Operation, int] = {}
        self.bits: dict[_Group, int] = {}  # the groups merged into a root, as a mask
        self.reads: dict[_Group, int] = {}  # what a root's members read (their depends_on)
        self.producers: dict[_Group, set[Operation]] = {}
        self.groups = 0  # groups ever made: the next one's bit

    def carried(self, producer: Operation) -> int:
        """The groups a value of `producer` depends on: its upstream and its own group."""
        mask = self.depends_on[producer]
        if producer in self.group_of:
            mask |= self.bits[self.group_of[producer].root()]
        return mask

    def visit(self, op: Operation, position: int) -> None:
        producers = {v.producer for v in op.inputs if v.producer in self.depends_on}
        mask = 0
        for producer in producers:
            mask |= self.carried(producer)
        self.depends_on[op] = mask
        if not is_elementwise(op):
            return
        shape = list(op.outputs[0].shape)
        candidates = {self.group_of[p].root() for p in producers if p in self.group_of and self.group_of[p].root().shape == shape}
        group = _Group(op, position)
        self.group_of[op] = group
        self.bits[group] = 1 << self.groups
        self.groups += 1
        self.reads[group] = mask
        self.producers[group] = producers
        for candidate in sorted(candidates, key=lambda g: min(p for p, _ in g.ops)):
            if self._convex(group.root(), candidate):
                self._merge(group.root(), candidate)

    def _convex(self, a: _Group, b: _Group) -> bool:
        """Merging is safe when no value flows from one group to the other through an
        outside op (or an outside group)."""
        inside = {a, b}
        both = self.bits[a] | self.bits[b]
        for producer in self.producers[a] | self.producers[b]:
            if producer in self.group_of and self.group_of[producer].root() in inside:
                continue
            if self.carried(producer) & both:
                return False
        return True

    def _merge(self, a: _Group, b: _Group) -> None:
        both = self.bits[a] | self.bits[b]
        reads = self.reads[a] | self.reads.pop(b)
        b.parent = a
        a.ops += b.ops
        self.bits[a] = both
        del self.bits[b]
        self.reads[a] = reads
        self.producers[a] |= self.producers.pop(b)
        # Whatever depended on either group now depends on all the merged group reads.
        for op, mask in self.depends_on.items():
            if mask & both:
                self.depends_on[op] = mask | reads
        for root, mask in self.reads.items():
            if mask & both and root is not a:
                self.reads[root] = mask | reads

    def merge_siblings(self, ops: list[Operation]) -> None:
        """Merge the groups of one shape that read a value an op of the function computes
        at that shape, where no path leads from one to the other."""
        for op in ops:
            for value in op.outputs:
                readers = [self.group_of[c] for c in value.consumers if c in self.group_of]
                for group in readers:
                    first, other = readers[0].root(), group.root()
                    if first is not other and first.shape == other.shape == list(value.shape) and self._convex(first, other):
                        self._merge(first, other)

    def unit_depends_on(self, op: Operation) -> int:
        """The groups the op's fused unit (its whole group, if it has one) depends on."""
        return self.reads[self.group_of[op].root()] if op in self.group_of else self.depends_on[op]


def _assigns(group: _Group, func: Function, keep: set[str], fusion: _Fusion) -> list[Operation]:
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
        if any(fusion.unit_depends_on(r) & fusion.bits[group] for r in target_readers):
            continue
        found.append(writers[0])
    return found


def _recomputed(group: _Group, func: Function) -> dict[str, Operation]:
    """Values of the group's shape that it reads and an elementwise op of the function
    outside it computes from values the group reads anyway (or small constants): cheaper
    to compute again in the loop than to store and read back. Those values are computed
    by ops, not globals, so no in-place write comes between the two computations; a value
    of a smaller shape would be computed again for every element it is broadcast to. The
    producer, whose only readers could not all be this group (it would have joined it),
    stays for the others."""
    members = {op for _, op in group.ops}
    read = {v.name for op in members for v in op.inputs if v.producer not in members}  # from outside the loop
    found = {}
    for op in members:
        for value in op.inputs:
            producer = value.producer
            if (producer is None or producer in members or producer.func is not func or not is_elementwise(producer)
                    or list(value.shape) != group.shape or value.name in found):
                continue
            if all((v.name in read and v.producer is not None) or _small_constant(v) for v in producer.inputs):
                found[value.name] = producer
    return found


def _small_constant(var: Variable) -> bool:
    return var.data is not None and not var.learnable and var.size <= 16


def _build_calculate(flow: Flow, func: Function, group: _Group, keep: set[str], assigns: list[Operation],
                     recomputed: dict[str, Operation], recomputing: set[tuple[str, Operation]]) -> Operation:
    """The group as one Calculate. `recomputed`: values it computes again rather than
    reads, by the ops that computed them (as they were before any group was rewritten);
    `recomputing`: (value, op) pairs, an op of any group that does so, which so no longer
    needs the value stored."""
    members = {op for _, op in group.ops}
    assigned = {a.inputs[1].name: a.inputs[0] for a in assigns}
    inputs: list[Variable] = []
    input_index: dict[str, int] = {}
    names: dict[str, Ref] = {}
    outputs: list[Variable] = []
    statements: list[tuple[Ref | Variable, Call]] = []

    temps = 0

    def operand(v: Variable) -> Ref:
        nonlocal temps
        if v.name in names:
            return names[v.name]
        if v.name in recomputed:
            producer = recomputed[v.name]
            call = Call(producer.type, tuple(operand(u) for u in producer.inputs), tuple(sorted(producer.attrs.items())))
            names[v.name] = Ref("$", temps)
            statements.append((names[v.name], call))
            temps += 1
            return names[v.name]
        if v.name not in input_index:
            input_index[v.name] = len(inputs)
            inputs.append(v)
        return Ref("%", input_index[v.name])

    for op in group.members:
        call = Call(op.type, tuple(operand(v) for v in op.inputs), tuple(sorted(op.attrs.items())))
        out = op.outputs[0]
        if out.name in assigned:  # the Assign's target is written in place; members may read the value
            statements.append((Ref("$", temps), call))
            names[out.name] = Ref("$", temps)
            statements.append((assigned[out.name], Call("Identity", (Ref("$", temps),))))
            temps += 1
            continue
        if out.name in keep or out.out or any(c not in members and (out.name, c) not in recomputing for c in out.consumers):
            ref = Ref("@", len(outputs))
            outputs.append(out)
        else:
            ref = Ref("$", temps)
            temps += 1
        names[out.name] = ref
        statements.append((ref, call))
    program = Program(tuple((operand(t) if isinstance(t, Variable) else t, call) for t, call in statements))

    internal = [v for op in group.members for v in op.outputs if v not in outputs]
    return fuse(flow, func, [*group.members, *assigns], "Calculate", inputs, outputs, {"expr": str(program)}, dropped=internal)
