"""Memory planning: place a cell's local variables in one buffer, reusing dead storage.

Each variable is live from the step that writes it to the last step that reads it;
inputs and outputs are live for the whole cell. Variables whose live ranges do not
overlap may share bytes (Myelin prints them as a `union`). A backend may also let an
op write its output over an input that dies at that op (in-place), when its kernel
is safe for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..flow.graph import Operation, Variable
from ..runtime import Slot

ALIGNMENT = 64


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def live_ranges(
    steps: Sequence[Operation], local: Sequence[Variable], pinned: set[str], workspaces: dict[int, Variable] | None = None,
) -> dict[str, tuple[int, int]]:
    end = len(steps)
    ranges = {v.name: (-1, -1) for v in local}
    for index, workspace in (workspaces or {}).items():
        ranges[workspace.name] = (index, index)
    for i, op in enumerate(steps):
        for v in op.outputs:
            if v.name in ranges:
                ranges[v.name] = (i, max(ranges[v.name][1], i))
        for v in op.inputs:
            if v.name in ranges:
                first, _ = ranges[v.name]
                ranges[v.name] = (first, i)
    for name in pinned:
        if name in ranges:
            ranges[name] = (-1, end)
    return ranges


InPlace = Callable[[Operation, Variable, Variable], bool]


def plan_memory(
    steps: Sequence[Operation],
    local: Sequence[Variable],
    pinned: set[str],
    in_place: InPlace | None = None,
    alignment: int = ALIGNMENT,
    shares_storage: Callable[[Operation], bool] | None = None,
    workspaces: dict[int, Variable] | None = None,
) -> tuple[list[Slot], int]:
    """Offsets for every local variable and the total buffer size.

    `pinned` names variables that must keep their own storage for the whole cell
    (inputs, outputs). `in_place(op, input, output)` says whether `op` may write
    `output` over `input` when `input` dies at that op. `shares_storage(op)` says
    whether a view op's output (a reshape) may simply be its input's bytes: the two
    then live as one, from the first write to the last read of either. `workspaces`
    maps a step index to the working memory its kernel uses during that step only.
    """
    ranges = live_ranges(steps, local, pinned, workspaces)
    workspace_names = {w.name for w in (workspaces or {}).values()}
    root = _storage_roots(steps, local, shares_storage) if shares_storage else {}
    members: dict[str, list[Variable]] = {}
    for var in local:
        if var.name in root:
            members.setdefault(root[var.name], []).append(var)
            first, last = ranges[root[var.name]]
            ranges[root[var.name]] = (min(first, ranges[var.name][0]), max(last, ranges[var.name][1]))
    # Place by first use; among variables live from the start, keep the caller's order.
    given = {v.name: i for i, v in enumerate(local)}
    roots = [v for v in local if v.name not in root]
    order = sorted(roots, key=lambda v: (ranges[v.name][0], given[v.name] if ranges[v.name][0] < 0 else -v.nbytes))
    placed: list[Slot] = []
    for var in order:
        first, last = ranges[var.name]
        size = max(var.nbytes, 1)
        producer = steps[first] if first >= 0 else None
        busy = [s for s in placed if not (s.last < first or last < s.first)]
        # In place: an input that dies at this op may hand over its exact bytes (same
        # offset, so element i is written where element i was read, never elsewhere).
        candidates = []
        if producer is not None and in_place is not None and var.name not in workspace_names:
            for s in busy:
                sources = [v for v in [s.var, *members.get(s.var.name, [])] if v in producer.inputs]
                if s.last == first and s.size >= size and any(in_place(producer, v, var) for v in sources):
                    candidates.append(s)
        offset = None
        for candidate in candidates:
            others = [s for s in busy if s is not candidate and not (s.offset + s.size <= candidate.offset or candidate.offset + size <= s.offset)]
            if not others:
                offset = candidate.offset
                break
        if offset is None:
            offset = 0
            for start, stop in sorted((s.offset, s.offset + s.size) for s in busy):
                if offset + size <= start:
                    break
                offset = max(offset, align(stop, alignment))
        placed.append(Slot(var, offset, size, alignment, first, last))
        placed += [Slot(view, offset, size, alignment, first, last) for view in members.get(var.name, [])]
    total = align(max((s.offset + s.size for s in placed), default=0), alignment)
    placed.sort(key=lambda s: (s.offset, s.first))
    return placed, total


def _storage_roots(steps: Sequence[Operation], local: Sequence[Variable], shares_storage: Callable[[Operation], bool]) -> dict[str, str]:
    """For each view that shares its input's bytes, the variable that owns them."""
    names = {v.name for v in local}
    root: dict[str, str] = {}
    for op in steps:
        if not (op.inputs and op.outputs and shares_storage(op)):
            continue
        source, view = op.inputs[0], op.outputs[0]
        if source.name in names and view.name in names and source.nbytes == view.nbytes and view.name not in root:
            root[view.name] = root.get(source.name, source.name)
    return root
