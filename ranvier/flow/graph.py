"""The graph IR: a Flow holds variables, operations, functions, connectors and blobs.

The model follows Myelin's: a Variable is a typed tensor (a constant when it has
data), an Operation reads variables and writes variables, and a Function is the
ordered set of operations one compiled cell computes (`elements.py`, exported here).
`Flow.define` hands out a Builder, which builds into a flow's elements.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from .. import dtypes
from ..errors import RanvierError
from .builder import Builder
from .elements import Blob, Connector, Function, Operation, Variable
from .fileformat import read_flow, save_flow

__all__ = ["Blob", "Connector", "Flow", "Function", "Operation", "Variable"]


def _dependency_order(ops: list[Operation], after: dict[Operation, list[Operation]] | None, what: str) -> list[Operation]:
    """`ops` sorted so that every op comes after the ops computing its inputs (and after
    those `after` names); ties keep the given order."""
    position = {op: i for i, op in enumerate(ops)}
    prerequisites: dict[Operation, set[Operation]] = {op: set() for op in ops}
    for op in ops:
        for v in op.inputs:
            if v.producer is not None and v.producer in position and v.producer is not op:
                prerequisites[op].add(v.producer)
        for before in (after or {}).get(op, []):
            if before in position and before is not op:
                prerequisites[op].add(before)
    dependents: dict[Operation, list[Operation]] = {op: [] for op in ops}
    for op in ops:
        for p in prerequisites[op]:
            dependents[p].append(op)
    missing = {op: len(p) for op, p in prerequisites.items()}
    heap = [(position[op], op) for op in ops if missing[op] == 0]
    heapq.heapify(heap)
    ordered: list[Operation] = []
    while heap:
        _, op = heapq.heappop(heap)
        ordered.append(op)
        for dependent in dependents[op]:
            missing[dependent] -= 1
            if missing[dependent] == 0:
                heapq.heappush(heap, (position[dependent], dependent))
    if len(ordered) != len(ops):
        done = set(ordered)
        stuck = [op.name for op in ops if op not in done]
        raise RanvierError(f"{what} has a cycle through ops {', '.join(stuck[:5])}")
    return ordered


class Flow:
    """A graph of variables and operations grouped into functions."""

    def __init__(self) -> None:
        self.vars: dict[str, Variable] = {}
        self.ops: dict[str, Operation] = {}
        self.funcs: dict[str, Function] = {}
        self.cnxs: dict[str, Connector] = {}
        self.blobs: dict[str, Blob] = {}
        self.flags = 0  # Myelin's file-level flags: no bits are defined
        self._alias_index: dict[str, Variable] = {}

    # ---- creating elements -------------------------------------------------

    def add_var(self, name: str, dtype: str = dtypes.DT_FLOAT, shape: Iterable[int] = ()) -> Variable:
        if name in self.vars:
            raise RanvierError(f"variable {name} is already defined in the flow")
        var = Variable(name, dtype, shape)
        self.vars[name] = var
        return var

    def add_op(self, name: str, type: str) -> Operation:
        if name in self.ops:
            raise RanvierError(f"operation {name} is already defined in the flow")
        op = Operation(name, type)
        self.ops[name] = op
        return op

    def func(self, name: str | Function) -> Function:
        """The function with this name, created if it does not exist yet (as Myelin's flow.func)."""
        if isinstance(name, Function):
            return name
        if name not in self.funcs:
            self.funcs[name] = Function(name)
        return self.funcs[name]

    def cnx(self, name: str) -> Connector:
        if name not in self.cnxs:
            self.cnxs[name] = Connector(name)
        return self.cnxs[name]

    def blob(self, name: str) -> Blob:
        if name not in self.blobs:
            self.blobs[name] = Blob(name)
        return self.blobs[name]

    def add_alias(self, var: Variable, alias: str) -> None:
        if alias == var.name or alias in var.aliases:
            return
        var.aliases.append(alias)
        self._alias_index[alias] = var

    # ---- lookup ---------------------------------------------------------------

    def var(self, name: str | Variable, type: str = dtypes.DT_FLOAT, shape: Iterable[int] | None = None) -> Variable:
        """The variable of this name or alias (an op's name gives its first output), created
        with `type` and `shape` when there is none, as Myelin's flow.var does."""
        if isinstance(name, Variable):
            return name
        found = self.find_var(name)
        return found if found is not None else self.add_var(name, type, shape or ())

    def lookup(self, name: str) -> Variable:
        """The variable of this name or alias; an error naming it when there is none."""
        found = self.find_var(name)
        if found is None:
            raise RanvierError(f"no variable named {name!r} in the flow")
        return found

    def op(self, name: str | Operation) -> Operation:
        """The op of this name, created (without a type or function yet) when there is none."""
        if isinstance(name, Operation):
            return name
        return self.ops[name] if name in self.ops else self.add_op(name, "")

    def define(self, name: str) -> Builder:
        """A Builder for the function `name` (Myelin's flow.define)."""
        return Builder(self, name)

    def find_var(self, name: str) -> Variable | None:
        var = self.vars.get(name)
        if var is not None:
            return var
        var = self._alias_index.get(name)
        if var is not None:
            return var
        for candidate in self.vars.values():
            if name in candidate.aliases:
                self._alias_index[name] = candidate
                return candidate
        op = self.ops.get(name)
        if op is not None and op.outputs:
            return op.outputs[0]
        return None

    def unique_name(self, base: str, taken: dict, output_taken: bool = False) -> str:
        """`base`, or `base_1`, `base_2`, ...: the first name not in `taken` (and, for an
        op name, whose first output name `name:0` is not a variable already)."""

        def free(name: str) -> bool:
            return name not in taken and not (output_taken and f"{name}:0" in self.vars)

        if free(base):
            return base
        index = 1
        while not free(f"{base}_{index}"):
            index += 1
        return f"{base}_{index}"

    # ---- structure ---------------------------------------------------------------

    def op_order(self, func: Function, after: dict[Operation, list[Operation]] | None = None) -> list[Operation]:
        """The function's ops in dependency order; ties keep insertion order.

        `after` adds ordering constraints beyond data flow: `after[op]` lists ops that
        must run before `op` (the compiler uses it to run in-place writes last).
        """
        return _dependency_order(func.ops, after, f"function {func.name}")

    def order(self, func: Function | str | None = None) -> tuple[list[Variable], list[Operation]]:
        """Myelin's flow.order: (variables, ops) in dependency order, for one function or
        the whole flow; the variables start with those no op computes."""
        ops = self.op_order(self.func(func)) if func is not None else _dependency_order(list(self.ops.values()), None, "the flow")
        ordered = self.inputs(func) if func is not None else [v for v in self.vars.values() if v.producer is None]
        return ordered + [v for op in ops for v in op.outputs], ops

    def inputs(self, func: Function | str | None = None, variable: bool = True, const: bool = True) -> list[Variable]:
        """Variables read by the function that no op of the function produces; without a
        function, every variable no op produces. `variable`/`const` keep those without/with data."""
        if func is None:
            found = [v for v in self.vars.values() if v.producer is None]
        else:
            func = self.func(func)
            seen: dict[str, Variable] = {}
            for op in func.ops:
                for v in op.inputs:
                    if (v.producer is None or v.producer.func is not func) and v.name not in seen:
                        seen[v.name] = v
            found = list(seen.values())
        return [v for v in found if (const if v.data is not None else variable)]

    def outputs(self, func: Function | str | None = None, variable: bool = True, const: bool = True) -> list[Variable]:
        """Variables produced by the function that nothing in it reads, or that are flagged
        OUT; without a function, every variable nothing reads."""
        if func is None:
            found = [v for v in self.vars.values() if not v.consumers]
        else:
            func = self.func(func)
            found = []
            for op in func.ops:
                for v in op.outputs:
                    used_inside = any(c.func is func for c in v.consumers)
                    if v.out or not used_inside:
                        found.append(v)
        return [v for v in found if (const if v.data is not None else variable)]

    def rename_prefix(self, prefix: str, replacement: str) -> None:
        """Replace a prefix in the names of variables, ops, functions and connectors (Myelin's)."""
        self._rename(lambda name: replacement + name[len(prefix):] if name.startswith(prefix) else name)

    def rename_suffix(self, suffix: str, replacement: str) -> None:
        """Replace a suffix in the names of variables, ops, functions and connectors (Myelin's)."""
        self._rename(lambda name: name[: len(name) - len(suffix)] + replacement if suffix and name.endswith(suffix) else name)

    def _rename(self, rename) -> None:
        for table in (self.vars, self.ops, self.funcs, self.cnxs):
            renamed = {}
            for name, element in table.items():
                element.name = rename(name)
                if element.name in renamed:
                    raise RanvierError(f"renaming gives two elements the name {element.name!r}")
                renamed[element.name] = element
            table.clear()
            table.update(renamed)
        self._alias_index = {alias: var for var in self.vars.values() for alias in var.aliases}

    def rename_var(self, var: Variable, name: str) -> None:
        """Give a variable a new name (Myelin's builder.rename)."""
        if name in self.vars:
            raise RanvierError(f"variable {name} is already defined in the flow")
        del self.vars[var.name]
        var.name = name
        self.vars[name] = var

    def remove_op(self, op: Operation) -> None:
        for v in op.inputs:
            if op in v.consumers:
                v.consumers.remove(op)
        for v in op.outputs:
            if v.producer is op:
                v.producer = None
        if op.func is not None and op in op.func.ops:
            op.func.ops.remove(op)
        op.func = None
        self.ops.pop(op.name, None)

    def remove_var(self, var: Variable) -> None:
        self.vars.pop(var.name, None)
        for alias in var.aliases:
            self._alias_index.pop(alias, None)

    def copy(self) -> Flow:
        """A structural copy for the compiler to rewrite; constant data is shared, not copied."""
        clone = Flow()
        for var in self.vars.values():
            twin = clone.add_var(var.name, var.dtype, var.shape)
            twin.flags, twin.attrs, twin.data = var.flags, dict(var.attrs), var.data
            for alias in var.aliases:
                clone.add_alias(twin, alias)
        for func in self.funcs.values():
            twin_func = clone.func(func.name)
            twin_func.flags, twin_func.primal_link = func.flags, func.primal_link
        for op in self.ops.values():
            twin = clone.add_op(op.name, op.type)
            twin.attrs, twin.flags = dict(op.attrs), op.flags
            for v in op.inputs:
                twin.add_input(clone.vars[v.name])
            for v in op.outputs:
                twin.add_output(clone.vars[v.name])
        for func in self.funcs.values():
            for op in func.ops:
                clone.funcs[func.name].add(clone.ops[op.name])
        for cnx in self.cnxs.values():
            twin = clone.cnx(cnx.name)
            twin.flags = cnx.flags
            for v in cnx.links:
                twin.add(clone.vars[v.name])
        for blob in self.blobs.values():
            twin = clone.blob(blob.name)
            twin.type, twin.attrs, twin.data, twin.flags = blob.type, dict(blob.attrs), blob.data, blob.flags
        return clone

    # ---- files -------------------------------------------------------------------

    def save(self, path, version: int = 6) -> None:
        """Write the flow in Myelin's binary .flow format, atomically."""
        save_flow(self, path, version)

    def load(self, path, batch_size: int | None = None) -> Flow:
        """Read a Myelin .flow file (versions 3 to 6) into this flow and return it;
        `batch_size` replaces -1 dimensions, as Myelin's Flow::set_batch_size does."""
        read_flow(self, path, batch_size)
        return self

    def __str__(self) -> str:
        lines = []
        for var in self.vars.values():
            kind = "const" if var.constant else ("learnable" if var.learnable else "var")
            lines.append(f"{kind} {var.name}: {var.typestr()}")
        lines += [str(func) for func in self.funcs.values()]
        return "\n".join(lines)
