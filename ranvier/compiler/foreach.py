"""Horizontal fusion: independent ops of one type and attributes → one ForEach, which a
backend paying for each kernel launch (a GPU) runs as one kernel. A training step's
per-parameter work is the case: every weight's cast before its products, every gradient's
widening, sum of squares and AdamW update — hundreds of launches of a few microseconds each.

The backend says which ops its ForEach kernel takes together (`Capabilities.foreach`: a
key, equal for ops one kernel can run side by side, or None) and how many variables one
kernel may take (`Capabilities.foreach_operands`: its parameters are bounded). Among ops of
one key, type and attributes, the pass groups
- sinks: ops nothing in the function reads (a parameter's update, written in place);
- sources: ops that read nothing the function computes (a weight's cast);
- siblings: ops read by the same ops, or groups of ops, looking through views (each
  gradient's sum of squares, all read by the clipping's norm; the gradients' casts, read by
  those sums and the updates).
No member of such a group reaches another: a sink has no readers, a source no producer in the
function, and a path from one sibling to another would run through their common readers,
which come after both. So the function stays acyclic. A sibling that reads a variable
another op overwrites (which it must read before the write) or that itself writes is left
alone, so that no write-after-read order loops through a group either.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ..flow.graph import Flow, Function, Operation
from ..ops import is_view, written_inputs
from .rewrite import fuse
from .schedule import readers

GroupKey = Callable[[Operation], Hashable | None]


def fuse_foreach(flow: Flow, func: Function, key_of: GroupKey, max_operands: int) -> None:
    """Replace each group of independent ops (module docstring) by one ForEach op of at
    most `max_operands` distinct variables."""
    order = flow.op_order(func)
    position = {id(op): i for i, op in enumerate(order)}
    overwritten = {id(op) for target in {id(v): v for op in func.ops for v in written_inputs(op)}.values()
                   for op in readers(target)}
    node: dict[int, frozenset[Hashable]] = {}  # id(op) -> the group it joins, or the op's own id (a view: its readers')
    groups: dict[Hashable, list[Operation]] = {}
    for op in reversed(order):  # readers first: an op's readers have found their groups
        if is_view(op):  # seen through: its readers read its input
            node[id(op)] = _readers(op, func, node)
            continue
        group = _group_of(op, func, key_of(op), node, overwritten)
        node[id(op)] = frozenset([group if group is not None else id(op)])
        if group is not None:
            groups.setdefault(group, []).append(op)
    for members in groups.values():
        members.sort(key=lambda op: position[id(op)])
        for chunk in _chunks(members, max_operands):
            if len(chunk) > 1:
                _fuse(flow, func, chunk)


def _group_of(op: Operation, func: Function, key: Hashable | None, node: dict[int, frozenset[Hashable]],
              overwritten: set[int]) -> Hashable | None:
    if key is None:
        return None
    kind = (key, op.type, tuple(sorted(op.attrs.items())), len(op.inputs), len(op.outputs))
    readers_ = _readers(op, func, node)
    if not readers_:
        return kind, "sinks"
    if written_inputs(op):
        return None
    if not any(v.producer is not None and v.producer.func is func for v in op.inputs):
        return kind, "sources"
    return None if id(op) in overwritten else (kind, "siblings", readers_)


def _readers(op: Operation, func: Function, node: dict[int, frozenset[Hashable]]) -> frozenset[Hashable]:
    """The groups and ops that read the op's outputs, through views."""
    return frozenset().union(*(node[id(c)] for v in op.outputs for c in v.consumers if c.func is func))


def _chunks(members: list[Operation], max_operands: int) -> list[list[Operation]]:
    """`members` in runs of at most `max_operands` distinct variables each."""
    chunks: list[list[Operation]] = []
    current: list[Operation] = []
    seen: set[int] = set()
    for op in members:
        own = {id(v) for v in (*op.inputs, *op.outputs)}
        if current and len(seen | own) > max_operands:
            chunks.append(current)
            current, seen = [], set()
        current.append(op)
        seen |= own
    return [*chunks, current] if current else chunks


def _fuse(flow: Flow, func: Function, members: list[Operation]) -> None:
    """One ForEach in place of `members` (ops of one type and attributes), where the first
    of them was in the function's list (ties in the run order keep that list's order)."""
    first = members[0]
    fuse(flow, func, members, "ForEach", [v for op in members for v in op.inputs], [v for op in members for v in op.outputs],
         {"op": first.type, "count": str(len(members)), **first.attrs}, name=f"{first.name}.foreach", keep_place=True)
