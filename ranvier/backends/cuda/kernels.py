"""GPU kernels of one thread per output element, and the generators that fill them in.

A kernel's threads each take elements of its index space: thread t of the grid takes
elements t, t + (threads in the grid), ... (a grid-stride loop, so any launch shape covers
any size; `launch.py` picks one). What one element is, is a generator's: `maps` (an
elementwise op, a fused Calculate program or a copy: an output element), `pads` (a Pad's
output element), `reductions` (a
reduction's output element: a loop down the reduced axis, by a thread or a block), `rows` (a row op's row: the
CPU's row passes, split over a block's threads), `lookups` (one index of a Gather or OneHot, its row split over a block),
`scatters` (an accumulation: the output zeroed, then one thread per element added),
`experts` (a MoE layer's routing sort, one thread; its grouped products' elements),
`grouped_mma` (the grouped products in bfloat16 on tensor cores, a block per tile),
`products` (a matrix product's output element), `assigns` (an element written in
place: Assign, a KV cache's AssignSlice), `attention_mma` (attention in bfloat16 on
tensor cores, a warp per 16 query rows), `attention` (blocks of query or key rows of
attention and its gradient, streaming tiles through shared memory, no score matrix
formed) and `facts` (Shape, Size, Rank: constants stored). Each registers its kernels in
the GPU's kernel library (`library.py`), tried by rank as the CPU's are. A kernel says
which ops it `supports`; the variables its kernels read and write, if not every input and
output (`operands`, each once: the kernels' pointer parameters); and its launches
(`emit(op)`): each (elements, emit) — how many elements there are and how to emit one
at IR index `index` in a `ThreadContext` (the shared kernel vocabulary, `EmitContext`) —
or (blocks, emit, threads) for a block kernel, whose
element is a block of `threads` threads working together (`blocks.BlockProgram`). Every
kernel takes one more parameter, a status word (i64*) a thread sets to 1 on bad data (a
class label out of range): the runtime raises, naming the step. A kernel whose elements
check no data (`GPUKernel.fails` false) never writes it.

That element is a function of its own, `element(index, operands..., status)`, which the
kernel calls per element. The same function compiled for the host, inside a plain loop
(`host_module`), is how the code generated for the GPU is checked where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import numpy as np
from llvmlite import ir

from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops.foreach import Member, members
from ...runtime import workspace_variable
from ..kernels import Kernel
from ..llvm.context import EmitContext, ir_of
from ..llvm.irutil import I64, VOID, for_range, i64, storage_type, use_features
from ..llvm.values import Value
from . import (  # noqa: F401  (registration)
    assigns,
    attention,
    attention_mma,
    experts,
    facts,
    foreach,
    grouped_mma,
    lookups,
    maps,
    pads,
    products,
    reductions,
    rows,
    scatters,
)
from .blocks import SharedMemory, special_register
from .library import LIBRARY, Generator
from .ptx import ARCHITECTURE, gpu_module, mark_kernel

# What the kernels may assume of every NVIDIA GPU, in the names the shared emitters test
# (`has_feature`): a fused multiply-add, and half-precision conversions in hardware (as
# x86's F16C gives the CPU).
GPU_FEATURES = frozenset({"fma", "f16c"})


@dataclass(frozen=True)
class GPUKernel:
    """A generated kernel: its name, the variables its pointer parameters point at (in
    order; each once, whether read, written or both), and its elements (threads' work) —
    or, for a block kernel (`threads` > 0), its blocks of `threads` threads; whether
    it may set its status word (`fails`: its elements check their data); and whether its
    launch covers every element at once (`one_pass`). A ForEach's kernel (`foreach.py`)
    takes its operands' addresses in its `table`, in device memory, which is then its one
    pointer parameter besides the status word. A block kernel's shared arrays take
    `shared_bytes` of a block's shared memory; `dynamic_shared_bytes` of them (all or
    none: `blocks.SharedMemory`) are dynamic, which its launches pass. Its PTX bounds a
    block at `threads` threads (`.maxntid`: its launches never run more) and, where
    `blocks_per_multiprocessor` (its element asked for it: `ThreadContext`), caps a
    thread's registers so that many blocks fit a multiprocessor (`.minnctapersm`); the
    host emulator ignores both."""

    name: str
    operands: tuple[Variable, ...]
    elements: int
    threads: int = 0
    fails: bool = False
    one_pass: bool = False  # a thread (a block) per element, no grid-stride loop (`add_kernels`)
    table: foreach.Table | None = None
    shared_bytes: int = 0
    dynamic_shared_bytes: int = 0
    blocks_per_multiprocessor: int = 0

    @property
    def pointers(self) -> int:
        """The kernel's pointer parameters before its status word."""
        return 1 if self.table is not None else len(self.operands)


def as_op(op: Operation | Member) -> Operation:
    """A ForEach's member as the library and its kernels read it: as they read an op."""
    return cast(Operation, op)


def supports(op: Operation | Member) -> bool:
    return LIBRARY.supports(as_op(op))


def foreach_key(op: Operation | Member) -> int | None:
    """Which ForEach kernels the op may join (`Capabilities.foreach`): the threads of a
    block of its one launch (0 for a thread per element), for a map (not a copy),
    reduction, row op or pad (`Generator.foreach`) of at most `foreach.GROUPED_WORK`
    threads' work; else None."""
    kernel = LIBRARY.choose(as_op(op))
    if not (isinstance(kernel, Generator) and kernel.foreach):
        return None
    launches = _launches(op, kernel)
    if len(launches) != 1:
        return None
    elements, _, threads, _ = launches[0]
    return threads if 0 < elements * max(threads, 1) <= foreach.GROUPED_WORK else None


def kernel_kind(op: Operation | Member) -> str:
    """What a cell printout calls the op's kernel: "Copy", "Map", "Pad", "Reduce", "Rows", "Lookup", "Scatter",
    "Route", "GroupedProductMMA", "GroupedProduct", "Product", "Assign", "AttentionMMA", "Attention", "ShapeFact" or "ForEach"."""
    return chosen(op).name


def chosen(op: Operation | Member) -> Generator:
    """The library's kernel for the op; an op no kernel runs is an error."""
    kernel = LIBRARY.choose(as_op(op))
    if not kernel.native or not isinstance(kernel, Generator):
        raise RanvierError(f"{op.name} ({op.type}): no GPU kernel computes it yet")
    return kernel


class ThreadContext(EmitContext):
    """What a GPU thread's element is written in: variables are the kernel's parameters,
    vectors are one lane wide, and bad data sets the kernel's status word."""

    row_passes_reread_memory = True  # a row's every pass reads it from memory (or L2) again

    def __init__(self, module: ir.Module, b: ir.IRBuilder, pointers: dict[int, ir.Value], status: ir.Value, on_gpu: bool):
        super().__init__(module, b)
        self.pointers, self.status, self.on_gpu = pointers, status, on_gpu
        self.row_threads = 0  # a row kernel's threads splitting each row (`rows.py`); 0: one thread's row
        self.table: ir.Value | None = None  # a ForEach's table (i64*), its one pointer parameter
        self.workspace: ir.Value | None = None  # the step's working memory (i8*), its last pointer parameter
        self.fails = False  # whether the element may set the status word
        self.shared_memory = SharedMemory()  # its block's shared arrays (`blocks.py`)
        self.blocks_per_multiprocessor = 0  # a block kernel's blocks that must fit a multiprocessor; 0: as ptxas likes

    def row_fold(self, start: Value | int, length: int | Value, lanes: int, dtype: str, initial, combine, term) -> Value:
        if not self.row_threads:
            return super().row_fold(start, length, lanes, dtype, initial, combine, term)
        return rows.fold_over_block(self, self.row_threads, start, length, dtype, initial, combine, term)

    def row_peak_and_exp_sum(self, start: Value | int, length: int | Value, lanes: int, dtype: str, read) -> tuple[Value, Value]:
        if not self.row_threads:
            return super().row_peak_and_exp_sum(start, length, lanes, dtype, read)
        return rows.peak_and_exp_sum_over_block(self, self.row_threads, start, length, dtype, read)

    def row_each(self, start: Value | int, length: int | Value, lanes: int, body) -> None:
        if not self.row_threads:
            super().row_each(start, length, lanes, body)
        else:
            rows.each_over_block(self, self.row_threads, start, length, body)

    def pointer(self, var: Variable) -> ir.Value:
        return self.pointers[id(var)]

    def lanes_for(self, dtypes_: list[str]) -> int:
        return 1

    def fail(self, condition: Value | ir.Value) -> None:
        self.fails = True
        with self.b.if_then(ir_of(condition), likely=False):
            self.b.store(i64(1), self.status)


def signature(op: Operation) -> str:
    """Everything an op's kernels are made from: its type and attributes, and each input's
    and output's dtype, shape, which earlier operand it is the same variable as, and a small
    constant's value (a concatenation's axis). Ops of equal signatures — a model's layers —
    have the same kernels, the variables they run on being their parameters."""
    first: dict[int, int] = {}
    lines = [f"{op.type} {sorted(op.attrs.items())}"]
    for v in (*op.inputs, *op.outputs):
        value = np.ascontiguousarray(v.data).tobytes().hex() if v.data is not None and v.size <= 16 else ""
        lines.append(f"  {first.setdefault(id(v), len(first))} {v.dtype}{list(v.shape)} {value}")
    return "\n".join(lines)


def shared_kernels(made: list[GPUKernel], op: Operation, choice: Kernel | None = None) -> list[GPUKernel]:
    """`made` (the kernels of an op of the same signature) as `op`'s: the same code, run on
    `op`'s variables (`choice`: the op's library kernel, where it was chosen already)."""
    operands = _operands(op, choice)
    return [replace(kernel, operands=operands) for kernel in made]


def kernel_name(op: Operation) -> str:
    """A PTX identifier for the op's kernel: its name's letters and digits."""
    return "k_" + "".join(c if c.isalnum() else "_" for c in op.name)


Emit = Callable[[ThreadContext, ir.Value], None]
Launch = tuple[int, Emit, int, "foreach.Table | None"]  # elements, how to emit one, a block's threads or 0, a table


def _kernel(op: Operation | Member, choice: Kernel | None) -> Generator:
    """The op's kernel: `choice` where it was chosen already (a step's), else the library's."""
    if choice is None:
        return chosen(op)
    if not isinstance(choice, Generator):
        raise RanvierError(f"{op.name} ({op.type}): kernel {choice.name} is not a GPU kernel")
    return choice


def _launches(op: Operation | Member, choice: Kernel | None = None) -> list[Launch]:
    """The op's launches in order, each (elements, how to emit one, threads per block of a
    block kernel or 0, a ForEach's table or None): one for most ops; an
    accumulation first zeroes its output (a launch finishes before the next starts); a
    ForEach its members' single launches as one."""
    return [(*launch, *(0, None)[len(launch) - 2:]) for launch in _kernel(op, choice).emit(op)]


def _operands(op: Operation | Member, choice: Kernel | None = None) -> tuple[Variable, ...]:
    """The variables the op's kernels take, in order: the kernel's own (a ForEach:
    its members'), or the op's inputs and outputs, each once; then the step's workspace,
    where the kernel asks for one (`Kernel.workspace`: its element reads `ctx.workspace`)."""
    kernel = _kernel(op, choice)
    if kernel.operands is not None:
        return kernel.operands(as_op(op))
    operands = tuple({id(v): v for v in (*op.inputs, *op.outputs)}.values())
    nbytes = kernel.workspace_bytes(as_op(op))
    return (*operands, workspace_variable(as_op(op), nbytes)) if nbytes else operands


def _foreach_supported(op: Operation) -> bool:
    """Whether a ForEach's members all join kernels of one key (`foreach_key`)."""
    keys = {foreach_key(member) for member in members(op)}
    return len(keys) == 1 and None not in keys


def _foreach_operands(op: Operation) -> tuple[Variable, ...]:
    return tuple({id(v): v for m in members(op) for v in _operands(m)}.values())


def _foreach_launches(op: Operation) -> list[Launch]:
    """A ForEach's one launch: its members' (`foreach.py`)."""
    grouped = members(op)
    threads = _launches(grouped[0])[0][2]
    return [foreach.table_driven([_part(m) for m in grouped], _foreach_operands(op), threads)]


def _part(member: Member) -> foreach.Part:
    """A ForEach's member as its kernel runs it: a flat map's code for any size, or else
    its own kernel's, shared with the members of its signature."""
    flat = maps.flat_map(as_op(member)) if chosen(member).name == "Map" else None
    if flat is not None:
        return foreach.Part(("flat", flat.key), flat.elements, flat.size, _operands(member),
                            lambda ctx, index, size: maps.emit_flat(ctx, flat, size, index))
    elements, emit, _, _ = _launches(member)[0]
    return foreach.Part(signature(as_op(member)), elements, elements, _operands(member), lambda ctx, index, size: emit(ctx, index))


LIBRARY.register(Generator("ForEach", frozenset({"ForEach"}), _foreach_launches, supports=_foreach_supported,
                           operands=_foreach_operands))


def _element_functions(module: ir.Module, op: Operation, on_gpu: bool,
                       choice: Kernel | None = None) -> list[tuple[ir.Function, GPUKernel]]:
    """`element(index, operands..., status)` for each of the op's launches, with its kernel,
    for the GPU or for the host emulator (`on_gpu`; they differ in block kernels alone)."""
    operands = _operands(op, choice)
    made = []
    for number, (elements, emit, threads, table) in enumerate(_launches(op, choice)):
        name = kernel_name(op) + (f"$then{number}" if number else "")  # "$": no op name makes it
        pointers = [I64.as_pointer()] if table is not None else [storage_type(v.dtype).as_pointer() for v in operands]
        function = ir.Function(module, ir.FunctionType(VOID, [I64, *pointers, I64.as_pointer()]), name=f"{name}_element")
        function.linkage = "internal"
        function.attributes.add("alwaysinline")
        index, *arguments, status = function.args
        ctx = ThreadContext(module, ir.IRBuilder(function.append_basic_block("entry")),
                            {} if table is not None else {id(v): arguments[k] for k, v in enumerate(operands)}, status, on_gpu)
        if table is not None:
            ctx.table = arguments[0]
        elif _kernel(op, choice).workspace_bytes(as_op(op)):
            ctx.workspace = arguments[-1]
        emit(ctx, index)
        ctx.b.ret_void()
        dynamic = ctx.shared_memory.lay_out(ctx, on_gpu)
        made.append((function, GPUKernel(name, operands, elements, threads, ctx.fails, one_pass=op.type == "ForEach",
                                         table=table, shared_bytes=ctx.shared_memory.nbytes, dynamic_shared_bytes=dynamic,
                                         blocks_per_multiprocessor=ctx.blocks_per_multiprocessor)))
    return made


def kernel_module(op: Operation, architecture: str = ARCHITECTURE) -> tuple[ir.Module, list[GPUKernel]]:
    """A module of the op's GPU kernels alone (one per launch)."""
    module = gpu_module(kernel_name(op), architecture)
    return module, add_kernels(module, op)


def add_kernels(module: ir.Module, op: Operation, choice: Kernel | None = None) -> list[GPUKernel]:
    """The op's GPU kernels in `module` (a GPU module), one per launch, in launch order:
    `name(operands..., status)` runs a grid-stride loop over the launch's elements (a block
    kernel's blocks: each block takes whole elements), or, `one_pass` (a ForEach's), its one
    element: a thread reads its member's record once (when a ForEach's parameters were
    every member's pointers, a loop's every trip kept them all in registers: ptxas gave an
    AdamW ForEach 168 registers a thread).
    `choice`: the op's library kernel, where it was chosen already (its step's)."""
    use_features(module, GPU_FEATURES)
    kernels = []
    for element, kernel in _element_functions(module, op, on_gpu=True, choice=choice):
        function = ir.Function(module, ir.FunctionType(VOID, list(element.function_type.args[1:])), name=kernel.name)
        b = ir.IRBuilder(function.append_basic_block("entry"))
        if kernel.threads:
            first, step = special_register(module, b, "ctaid.x"), special_register(module, b, "nctaid.x")
        else:
            threads = special_register(module, b, "ntid.x")
            first = b.add(b.mul(special_register(module, b, "ctaid.x"), threads), special_register(module, b, "tid.x"))
            step = b.mul(special_register(module, b, "nctaid.x"), threads)
        if kernel.one_pass:
            with b.if_then(b.icmp_unsigned("<", first, i64(kernel.elements))):
                b.call(element, [first, *function.args])
            b.ret_void()
            mark_kernel(module, function, kernel.threads, kernel.blocks_per_multiprocessor)
            kernels.append(kernel)
            continue
        loop, body, done = (function.append_basic_block(n) for n in ("loop", "body", "done"))
        b.branch(loop)
        b.position_at_end(loop)
        index = b.phi(I64)
        index.add_incoming(first, function.blocks[0])
        b.cbranch(b.icmp_unsigned("<", index, i64(kernel.elements)), body, done)
        b.position_at_end(body)
        b.call(element, [index, *function.args])
        index.add_incoming(b.add(index, step), body)
        b.branch(loop)
        b.position_at_end(done)
        b.ret_void()
        mark_kernel(module, function, kernel.threads, kernel.blocks_per_multiprocessor)
        kernels.append(kernel)
    return kernels


def host_module(op: Operation, triple: str, data_layout: str, features: frozenset[str]) -> tuple[ir.Module, list[GPUKernel]]:
    """A module of the op's launches for the host CPU (`triple`, `data_layout`, `features`):
    see `add_host_kernels`."""
    module = ir.Module(kernel_name(op))
    module.triple, module.data_layout = triple, data_layout
    use_features(module, features)
    return module, add_host_kernels(module, op)


def add_host_kernels(module: ir.Module, op: Operation, choice: Kernel | None = None) -> list[GPUKernel]:
    """Each launch's element function in a host loop, `name(operands..., status, first, last)`,
    in `module` (a host module): the GPU's arithmetic, run here (the launches one after
    another, as the GPU runs them). `choice`: as `add_kernels` takes it."""
    kernels = []
    for element, kernel in _element_functions(module, op, on_gpu=False, choice=choice):
        function = ir.Function(module, ir.FunctionType(VOID, [*element.function_type.args[1:], I64, I64]), name=kernel.name)
        *pointers, first, last = function.args
        b = ir.IRBuilder(function.append_basic_block("entry"))
        with for_range(b, first, last, name="e") as index:
            b.call(element, [index, *pointers])
        b.ret_void()
        kernels.append(kernel)
    return kernels
