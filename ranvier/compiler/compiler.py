"""The Compiler turns each function of a flow into a Cell of a Network: the pass pipeline,
the schedule, the backend's kernel for every step, and the memory plan."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from .. import dtypes
from ..autodiff import gradient_function
from ..backends import CompileOptions, create_backend
from ..errors import CompileError, RanvierError, UnknownOpError
from ..flow.graph import Flow, Function, Operation, Variable
from ..limits import byte_size, check_allocation
from ..ops import has_op, op_def, written_inputs
from ..runtime import Cell, Network, Step, workspace_variable
from .declared import convert_declared_conditions, reshape_declared_outputs
from .memory import plan_memory
from .pipeline import PassContext, run_pipeline
from .references import resolve_references
from .schedule import schedule

# Given the flow about to be compiled, a context manager around the compile.
CompileObserver = Callable[[Flow], contextlib.AbstractContextManager[object]]

_observer: ContextVar[CompileObserver | None] = ContextVar("compile observer", default=None)

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def observing(observer: CompileObserver | None) -> Iterator[None]:
    """Within the block, each compile (in this thread) runs inside `observer(flow)`: how the
    `ranvier` command shows a slow compile, where the library itself prints nothing. None:
    compiles unobserved (a data-parallel rank that does not print). Blocks nest."""
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)


def undefined_shape(var: Variable, func: Function) -> CompileError:
    return CompileError(
        f"variable {var.name} of function {func.name} has an undefined shape [{'x'.join(map(str, var.shape))}]; "
        "give every dimension a size before compiling (a .flow file's -1 dimensions take a batch size "
        "when loaded, as in Myelin: Flow().load(path, batch_size=N))"
    )


def bind_undefined_dimensions(flow: Flow) -> None:
    """Give the -1 dimensions still in the flow batch size 1, as Myelin does when it
    compiles (pysling's compiler, and C++ Flow::Read without a batch size)."""
    bound = [var for var in flow.vars.values() if -1 in var.shape and var.data is None]
    for var in bound:
        var.shape = [1 if d == -1 else d for d in var.shape]
    if bound:
        logger.info("bound the -1 dimensions of %d variables to batch size 1 (as Myelin does; "
                    "Flow().load(path, batch_size=N) binds another): %s", len(bound), ", ".join(v.name for v in bound))


def check_types(op: Operation) -> None:
    """Re-infer an op's output types and compare (or fill in, for files without shapes)."""
    for var in [*op.inputs, *op.outputs]:
        if var.dtype in dtypes.STORAGE_DTYPES:
            raise CompileError(
                f"{op.type} op {op.name}: {var.name} is {var.dtype}, a type ranvier loads and saves "
                "but cannot compute with"
            )
    try:
        types = op_def(op.type).infer_types(op.name, op.inputs, op.attrs)
    except RanvierError as error:
        raise CompileError(str(error)) from error
    if len(types) != len(op.outputs):
        raise CompileError(f"{op.type} op {op.name} has {len(op.outputs)} outputs, expected {len(types)}")
    for var, t in zip(op.outputs, types):
        if not var.shape_defined() or (not var.shape and t.shape):
            var.shape = list(t.shape)
        if var.dtype != t.dtype or tuple(var.shape) != t.shape:
            raise CompileError(
                f"{op.type} op {op.name}: output {var.name} is declared {var.typestr()}, "
                f"but the op computes {t.dtype}[{'x'.join(map(str, t.shape))}]"
            )


class Compiler:
    """Compile a flow for a backend: `Compiler().compile(flow)` returns a Network."""

    def __init__(self, backend: str = "cpu", cpu: str = "", cache: bool = True, matmul: str = "float32", denormals: str = "keep",
                 precision: str = "float32"):
        """backend: "cpu" (LLVM JIT), "reference" (numpy oracle), or any registered backend.
        cpu: CPU features to mask, e.g. "-avx512" or "-avx512,-avx2" (Myelin's --cpu).
        cache: reuse generated code across processes (the on-disk compile cache).
        matmul: "float32", or "bfloat16" / "tfloat32": float32 matrix products round their
            inputs to that type and accumulate in float32 (mixed precision: bfloat16 on AMX
            tiles on the CPU, either on tensor cores through cuBLASLt on a GPU; where the
            backend cannot, products stay float32).
        denormals: "keep" (IEEE subnormal numbers) or "flush" (the CPU backend's code treats
            them as zero: far faster on Intel cores where values decay below 1e-38).
        precision: "float32", or "bfloat16" / "float16": activations and their gradients
            stored in that type, parameters, optimizer state and losses in float32, matrix
            products on its inputs (mixed precision; where the backend cannot, float32;
            float16's narrow range wants loss scaling, which Trainer turns on for it)."""
        self.backend_name = backend
        if precision == "bfloat16" and matmul == "float32":
            matmul = "bfloat16"  # the products left in float32 (an attention gradient's) round their inputs too
        self.options = CompileOptions(cpu, cache, matmul, denormals, precision)
        self.backend = create_backend(backend, self.options)

    def compile(self, flow: Flow, share_data: bool = False) -> Network:
        """share_data: the network's globals are the flow's data arrays themselves where
        those are aligned (`runtime.aligned_array`), not copies: an inference network keeps
        one copy of its weights, and writes to either side reach the other."""
        observer = _observer.get()
        with observer(flow) if observer is not None else contextlib.nullcontext():
            # Passes rewrite the flow; they work on a copy so the caller's flow stays as built.
            network = Network(flow.copy(), self.backend_name, share_data)
            bind_undefined_dimensions(network.flow)
            for func in list(network.flow.funcs.values()):
                if func.backprop and f"gradients/{func.name}" not in network.flow.funcs and not func.name.startswith("gradients/"):
                    gradient_function(network.flow, func)
            resolve_references(network.flow)
            convert_declared_conditions(network.flow)
            reshape_declared_outputs(network.flow)
            for func in network.flow.funcs.values():
                network.cells[func.name] = self.compile_function(network, func)
        return network

    def compile_function(self, network: Network, func: Function) -> Cell:
        flow = network.flow
        for op in func.ops:
            if not has_op(op.type):  # a file or Myelin's builder may hold any op type
                raise UnknownOpError(f"{op.type} op {op.name} of function {func.name}: ranvier has no definition "
                                     f"of op type {op.type!r}, so it cannot compile it")
        for var in flow.inputs(func):
            if var.producer is None and not var.shape_defined():
                raise undefined_shape(var, func)
        for op in schedule(flow, func):
            check_types(op)
        keep = {v.name for v in flow.outputs(func)} | {v.name for v in flow.vars.values() if v.out or v.in_}
        keep |= {v.name for v in flow.vars.values() if any(c.func is not func for c in v.consumers)}
        run_pipeline(PassContext(flow, func, self.backend, self.options, keep))
        ops = schedule(flow, func)
        for op in ops:
            check_types(op)  # every pass leaves a well-typed function
        steps = [self.backend.choose(op) for op in ops]
        workspaces = self._workspaces(steps)

        # Locals live in the instance; globals in the network; variables computed by
        # another function are read from a linked (primal) instance.
        local: dict[str, Variable] = {}
        external: dict[str, Variable] = {}
        for op in ops:
            for v in [*op.inputs, *op.outputs]:
                if v.is_global:
                    network.add_global(v)
                elif v.producer is not None and v.producer.func is not func:
                    external[v.name] = v
                elif v.name not in local:
                    if not v.shape_defined():
                        raise undefined_shape(v, func)
                    local[v.name] = v
        roles = {v.name: "input" for v in flow.inputs(func) if v.name in local}
        roles.update({v.name: "output" for v in flow.outputs(func) if v.name in local})
        roles.update({v.name: "input" if v.in_ else "output" for v in local.values() if v.in_ or v.out})
        roles.update({t.name: "state" for op in ops for t in written_inputs(op) if t.name in local})
        order = {"input": 0, "state": 1, "output": 2}
        ranked = sorted(local.values(), key=lambda v: order.get(roles.get(v.name, ""), 3))
        slots, size = plan_memory(
            ops, ranked + list(workspaces.values()), set(roles), self.backend.in_place,
            shares_storage=self.backend.shares_storage, workspaces=workspaces,
        )
        if local:
            largest = max(local.values(), key=lambda v: v.nbytes)
            known_as = f" ({', '.join(largest.aliases)})" if largest.aliases else ""
            check_allocation(size, f"an instance of cell {func.name} (its largest variable {largest.name}{known_as}: "
                                   f"{largest.typestr()}, {byte_size(largest.nbytes)})", CompileError)
        cell = Cell(network, func, steps, slots, size, self.backend, roles, list(external.values()))
        self.backend.finish(cell)
        return cell

    def _workspaces(self, steps: list[Step]) -> dict[int, Variable]:
        """A byte buffer for each step whose kernel needs working memory, live during that step."""
        workspaces = {}
        for index, step in enumerate(steps):
            size = self.backend.workspace_bytes(step)
            if size:
                step.workspace = workspace_variable(step.op, size)
                workspaces[index] = step.workspace
        return workspaces
