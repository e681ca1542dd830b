"""Cell code generation: one LLVM module per cell, one native entry point.

The cell function takes a table of pointers, filled once per instance:

    ptrs[0] instance data   ptrs[1] status word   ptrs[2] profile counters
    ptrs[3] python fallback callback   ptrs[4] sgemm   ptrs[5] dgemm
    ptrs[6] BLAS set-thread-count function   ptrs[7] the machine's thread count
    ptrs[8] sgemv   ptrs[9] dgemv   ptrs[10] the AMX bf16 GEMM (null without AMX)
    ptrs[11 + k] the k-th global or linked (primal) variable

Nothing process-specific is baked into the code, so the object file can be cached
on disk and reused by another process. Each step is an internal function; the cell
function calls them in order and adds each step's cycle count to its profile counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llvmlite import ir

from ...flow.graph import Variable
from ...runtime import Step
from .convert import use_target
from .irutil import BYTE_PTR, I64, VOID, i64, storage_type
from .target import CPUTarget

DATA, STATUS, PROFILE, CALLBACK, SGEMM, DGEMM, BLAS_THREADS, MAX_THREADS, SGEMV, DGEMV, BF16GEMM, FIRST_TABLE_SLOT = range(12)


@dataclass
class Layout:
    """Where each variable of a cell lives: an instance offset, or a pointer-table slot."""

    offsets: dict[str, int]
    table: list[Variable] = field(default_factory=list)
    # Views of a table variable (a reshaped global) that share its memory instead of copying it.
    aliases: dict[str, Variable] = field(default_factory=dict)

    def slot(self, var: Variable) -> int:
        for k, v in enumerate(self.table):
            if v.name == var.name:
                return FIRST_TABLE_SLOT + k
        raise KeyError(var.name)


class KernelContext:
    """What a kernel emitter sees while generating one step's function."""

    def __init__(
        self, module: ir.Module, function: ir.Function, target: CPUTarget, layout: Layout, step_index: int,
        workspace: Variable | None = None,
    ):
        self.module = module
        self.function = function
        self.target = target
        self.layout = layout
        self.step_index = step_index
        self.workspace = workspace  # the step's working memory (see Backend.workspace_bytes)
        self.b = ir.IRBuilder(function.append_basic_block("entry"))
        self.ptrs = function.args[0]
        self._pointers: dict[str, ir.Value] = {}

    def table_entry(self, slot: int) -> ir.Value:
        return self.b.load(self.b.gep(self.ptrs, [i64(slot)]))

    def address(self, var: Variable) -> ir.Value:
        """An i8* to the first byte of `var`."""
        if var.name in self.layout.offsets:
            return self.b.gep(self.table_entry(DATA), [i64(self.layout.offsets[var.name])])
        return self.table_entry(self.layout.slot(var))

    def pointer(self, var: Variable) -> ir.Value:
        """A pointer to `var`'s elements, typed by how its dtype is stored (computed once per step)."""
        if var.name not in self._pointers:
            with self.b.goto_entry_block():
                self._pointers[var.name] = self.b.bitcast(self.address(var), storage_type(var.dtype).as_pointer())
        return self._pointers[var.name]

    def lanes_for(self, dtypes_: list[str]) -> int:
        """Vector width for a loop touching these dtypes: one register of the widest element."""
        from ... import dtypes

        widest = max((4 if d in ("float16", "bfloat16", "bool") else dtypes.itemsize(d)) for d in dtypes_)
        return self.target.lanes(widest)

    def fail(self, condition: ir.Value) -> None:
        """Record this step in the status word when `condition` holds (the runtime raises)."""
        with self.b.if_then(condition, likely=False):
            status = self.b.bitcast(self.table_entry(STATUS), I64.as_pointer())
            self.b.store(i64(self.step_index + 1), status)


def build_module(name: str, target: CPUTarget, steps: list[Step], layout: Layout, emitters) -> ir.Module:
    """The module of one cell: a step function per op and the `cell` entry point."""
    module = ir.Module(name=name)
    module.triple = target.machine.triple
    module.data_layout = str(target.machine.target_data)
    use_target(module, target)  # half-precision conversions use F16C where the target has it
    step_type = ir.FunctionType(VOID, [BYTE_PTR.as_pointer()])
    step_functions = []
    for index, step in enumerate(steps):
        function = ir.Function(module, step_type, name=f"step{index}")
        function.linkage = "internal"
        # Kept out of line: optimizing many small functions is linear, one huge one is not.
        function.attributes.add("noinline")
        ctx = KernelContext(module, function, target, layout, index, step.workspace)
        emitters[index](ctx, step.op)
        ctx.b.ret_void()
        step_functions.append(function)

    cell = ir.Function(module, step_type, name="cell")
    b = ir.IRBuilder(cell.append_basic_block("entry"))
    ptrs = cell.args[0]
    clock = ir.Function(module, ir.FunctionType(I64, []), name="llvm.readcyclecounter")
    counters = b.bitcast(b.load(b.gep(ptrs, [i64(PROFILE)])), I64.as_pointer())
    for index, function in enumerate(step_functions):
        start = b.call(clock, [])
        b.call(function, [ptrs])
        spent = b.sub(b.call(clock, []), start)
        slot = b.gep(counters, [i64(index)])
        b.store(b.add(b.load(slot), spent), slot)
    b.ret_void()
    return module
