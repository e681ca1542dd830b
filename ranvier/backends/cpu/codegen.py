"""Cell code generation: a cell's LLVM modules (one, or several compiled side by side), one
native entry point.

The cell function takes a table of pointers, filled once per instance:

    ptrs[0] instance data   ptrs[1] status word   ptrs[2] profile counters
    ptrs[3] python fallback callback   ptrs[4] sgemm   ptrs[5] dgemm
    ptrs[6] BLAS set-thread-count function   ptrs[7] sgemv   ptrs[8] dgemv
    ptrs[9] the AMX bf16 GEMM (null without AMX)   ptrs[10] the generated float32 GEMM
    ptrs[11] the same on packed panels of B   ptrs[12] the worker pool's ranvier_pool_run
    ptrs[13] per-step cycles run on all cores
    ptrs[14 + k] the k-th global or linked (primal) variable, then the prepared constants

Nothing process-specific is baked into the code, so the object file can be cached
on disk and reused by another process. Each step is a function of its own (internal
where the cell is one module); the cell function calls them in order and adds each
step's cycle count to its profile counter.
Compiled to flush denormals, it sets the thread's FTZ and DAZ modes around them
(`fpmode`) and puts the thread's own back after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Variable
from ...runtime import Step
from ..kernels import Prepared
from ..llvm.context import EmitContext, ir_of
from ..llvm.irutil import (
    BYTE_PTR,
    I64,
    VOID,
    declared,
    i64,
    storage_type,
    use_features,
)
from ..llvm.values import Value
from . import fpmode
from .target import CPUTarget

(DATA, STATUS, PROFILE, CALLBACK, SGEMM, DGEMM, BLAS_THREADS, SGEMV, DGEMV, BF16GEMM, SGEMM_GENERATED, SGEMM_PACKED,
 SGEMM_PACKED_BF16, SGEMM_WINDOWS, Q8GEMM, DPBF16GEMV, POOL, ALL_CORES, SGEMM_DPBF16, SGEMM_PACKED_DPBF16,
 SGEMM_WINDOWS_DPBF16, SGEMM_ADD, SGEMM_PACKED_DPBF16_PAIRED, SGEMM_WINDOWS_DPBF16_PAIRED, FIRST_TABLE_SLOT) = range(25)


@dataclass
class Layout:
    """Where each variable of a cell lives: an instance offset, or a pointer-table slot."""

    offsets: dict[str, int]
    table: list[Variable] = field(default_factory=list)
    # Views of a table variable (a reshaped global) that share its memory instead of copying it.
    aliases: dict[str, Variable] = field(default_factory=dict)
    # Constants kernels read in a form of their own, after the table.
    prepared: list[Prepared] = field(default_factory=list)

    def prepared_slot(self, var: Variable, form: str) -> int:
        for k, p in enumerate(self.prepared):
            if (p.var.name, p.form) == (var.name, form):
                return FIRST_TABLE_SLOT + len(self.table) + k
        raise KeyError(f"{var.name} ({form})")

    def slot(self, var: Variable) -> int:
        for k, v in enumerate(self.table):
            if v.name == var.name:
                return FIRST_TABLE_SLOT + k
        raise KeyError(var.name)


def cycle_counter(module: ir.Module) -> ir.Function:
    """The module's declaration of LLVM's cycle counter intrinsic (made once)."""
    return declared(module, "llvm.readcyclecounter", ir.FunctionType(I64, []))


class KernelContext(EmitContext):
    """What a kernel emitter sees while generating one step's function: the shared
    vocabulary (`EmitContext`), with variables reached through the cell's pointer table."""

    def __init__(
        self, module: ir.Module, function: ir.Function, target: CPUTarget, layout: Layout, step_index: int,
        workspace: Variable | None = None,
    ):
        super().__init__(module, ir.IRBuilder(function.append_basic_block("entry")))
        self.function = function
        self.target = target
        self.layout = layout
        self.step_index = step_index
        self.workspace = workspace  # the step's working memory (see Backend.workspace_bytes)
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

    def scratch(self, name: str, dtype: str, count: int, address: ir.Value) -> Variable:
        """A variable of `count` elements at `address` (a part's share of the workspace), so
        loads, stores and row passes reach it as they reach the step's variables."""
        var = Variable(name, dtype, [count])
        self._pointers[name] = self.b.bitcast(address, storage_type(dtype).as_pointer())
        return var

    def prepared(self, var: Variable, form: str, element: ir.Type) -> ir.Value:
        """A pointer to the `element`s of constant `var` in `form` (a `Prepared` of the step's kernel)."""
        return self.b.bitcast(self.table_entry(self.layout.prepared_slot(var, form)), element.as_pointer())

    def lanes_for(self, dtypes_: list[str]) -> int:
        """Vector width for a loop touching these dtypes: one register of the widest element."""
        widest = max((4 if d in ("float16", "bfloat16", "bool") else dtypes.itemsize(d)) for d in dtypes_)
        return self.target.lanes(widest)

    def fail(self, condition: Value | ir.Value) -> None:
        """Record this step in the status word when `condition` holds (the runtime raises)."""
        with self.b.if_then(ir_of(condition), likely=False):
            status = self.b.bitcast(self.table_entry(STATUS), I64.as_pointer())
            self.b.store(i64(self.step_index + 1), status)

    @contextmanager
    def on_all_cores(self) -> Iterator[None]:
        """Count the cycles of the code emitted inside as this step's time on all cores
        (a job of the worker pool): the profile's utilisation."""
        clock = cycle_counter(self.module)
        start = self.b.call(clock, [])
        yield
        counters = self.b.bitcast(self.table_entry(ALL_CORES), I64.as_pointer())
        slot = self.b.gep(counters, [i64(self.step_index)])
        self.b.store(self.b.add(self.b.load(slot), self.b.sub(self.b.call(clock, []), start)), slot)

def build_modules(name: str, target: CPUTarget, steps: list[Step], layout: Layout, emitters,
                  flush_denormals: bool = False, parts: int = 1) -> list[ir.Module]:
    """The modules of one cell: a step function per op, spread over up to `parts` modules
    of about as many instructions each (compiled side by side: `parallel_compile`), and
    the `cell` entry point in the first, calling the others' steps by name."""
    modules = [_new_module(name if parts == 1 else f"{name}.{k}", target) for k in range(max(1, min(parts, len(steps))))]
    instructions = [0] * len(modules)
    step_type = ir.FunctionType(VOID, [BYTE_PTR.as_pointer()])
    step_functions = []
    for index, step in enumerate(steps):
        home = instructions.index(min(instructions))
        module = modules[home]
        known = len(module.functions)
        function = ir.Function(module, step_type, name=f"step{index}")
        if len(modules) == 1:
            function.linkage = "internal"
        # Kept out of line: optimizing many small functions is linear, one huge one is not.
        function.attributes.add("noinline")
        ctx = KernelContext(module, function, target, layout, index, step.workspace)
        emitters[index](ctx, step.op)
        ctx.b.ret_void()
        instructions[home] += sum(len(block.instructions) for made in module.functions[known:] for block in made.blocks)
        step_functions.append(function if home == 0 else ir.Function(modules[0], step_type, name=f"step{index}"))

    module = modules[0]
    cell = ir.Function(module, step_type, name="cell")
    b = ir.IRBuilder(cell.append_basic_block("entry"))
    ptrs = cell.args[0]
    clock = cycle_counter(module)
    counters = b.bitcast(b.load(b.gep(ptrs, [i64(PROFILE)])), I64.as_pointer())
    saved_mode = fpmode.flushing(b) if flush_denormals else None
    for index, function in enumerate(step_functions):
        start = b.call(clock, [])
        b.call(function, [ptrs])
        spent = b.sub(b.call(clock, []), start)
        slot = b.gep(counters, [i64(index)])
        b.store(b.add(b.load(slot), spent), slot)
    if saved_mode is not None:
        fpmode.write_mxcsr(b, saved_mode)
    b.ret_void()
    return modules


def _new_module(name: str, target: CPUTarget) -> ir.Module:
    module = ir.Module(name=name)
    module.triple = target.machine.triple
    module.data_layout = str(target.machine.target_data)
    use_features(module, target.feature_set)  # F16C conversions, FMA's exact products
    return module
