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
`products` (a matrix product's output element), `assigns` (an element written in
place: Assign, a KV cache's AssignSlice), `attention_mma` (attention in bfloat16 on
tensor cores, a warp per 16 query rows), `attention` (blocks of query or key rows of
attention and its gradient, streaming tiles through shared memory, no score matrix
formed) and `facts` (Shape, Size, Rank: constants stored), tried in order. A generator says
which ops it `supports`; the variables its kernels read and write, if not every input and
output (`operands`, each once: the kernels' pointer parameters); and either how many
`elements` there are and how to `emit` one element at IR index `index` in a
`ThreadContext` (the shared kernel vocabulary, `EmitContext`), or its `launches`: several
such (elements, emit) in order, or (blocks, emit, threads) for a block kernel, whose
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

import numpy as np
from llvmlite import ir

from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops.foreach import Member, members
from ..llvm.context import EmitContext, ir_of
from ..llvm.irutil import I64, VOID, for_range, i64, storage_type, use_features
from ..llvm.values import Value
from . import (
    assigns,
    attention,
    attention_mma,
    experts,
    facts,
    foreach,
    lookups,
    maps,
    pads,
    products,
    reductions,
    rows,
    scatters,
)
from .blocks import special_register
from .ptx import ARCHITECTURE, gpu_module, mark_kernel

GENERATORS = (maps, pads, reductions, rows, lookups, scatters, experts, products, assigns, attention_mma, attention, facts)
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
    launch covers every element at once (`one_pass`)."""

    name: str
    operands: tuple[Variable, ...]
    elements: int
    threads: int = 0
    fails: bool = False
    one_pass: bool = False  # a thread (a block) per element, no grid-stride loop (`add_kernels`)


def supports(op: Operation | Member) -> bool:
    if op.type == "ForEach":
        keys = {foreach_key(member) for member in members(op)}
        return len(keys) == 1 and None not in keys
    return any(generator.supports(op) for generator in GENERATORS)


def foreach_key(op: Operation | Member) -> int | None:
    """Which ForEach kernels the op may join (`Capabilities.foreach`): the threads of a
    block of its one launch (0 for a thread per element), for a map (not a copy),
    reduction, row op or pad of at most `foreach.GROUPED_WORK` threads' work; else None."""
    generator = _supporting(op)
    if generator not in (maps, reductions, rows, pads) or (generator is maps and maps.is_copy(op)):
        return None
    launches = _launches(generator, op)
    if len(launches) != 1:
        return None
    elements, _, threads = launches[0]
    return threads if 0 < elements * max(threads, 1) <= foreach.GROUPED_WORK else None


def kernel_kind(op: Operation | Member) -> str:
    """What a cell printout calls the op's kernel: "Copy", "Map", "Pad", "Reduce", "Rows", "Lookup", "Scatter",
    "Route", "GroupedProduct", "Product", "Assign", "AttentionMMA", "Attention", "ShapeFact" or "ForEach"."""
    if op.type == "ForEach":
        return "ForEach"
    generator = _generator(op)
    if generator is maps:
        return "Copy" if maps.is_copy(op) else "Map"
    if generator is experts:
        return "Route" if op.type == "MoERoute" else "GroupedProduct"
    return {pads: "Pad", reductions: "Reduce", rows: "Rows", lookups: "Lookup", scatters: "Scatter", products: "Product",
            assigns: "Assign", attention_mma: "AttentionMMA", attention: "Attention", facts: "ShapeFact"}[generator]


class ThreadContext(EmitContext):
    """What a GPU thread's element is written in: variables are the kernel's parameters,
    vectors are one lane wide, and bad data sets the kernel's status word."""

    row_passes_reread_memory = True  # a row's every pass reads it from memory (or L2) again

    def __init__(self, module: ir.Module, b: ir.IRBuilder, pointers: dict[int, ir.Value], status: ir.Value, on_gpu: bool):
        super().__init__(module, b)
        self.pointers, self.status, self.on_gpu = pointers, status, on_gpu
        self.row_threads = 0  # a row kernel's threads splitting each row (`rows.py`); 0: one thread's row
        self.fails = False  # whether the element may set the status word

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


def _supporting(op: Operation | Member):
    """The first generator that supports the op, or None."""
    return next((g for g in GENERATORS if g.supports(op)), None)


def _generator(op: Operation | Member):
    if op.type == "ForEach":
        return foreach
    generator = _supporting(op)
    if generator is None:
        raise RanvierError(f"{op.name} ({op.type}): no GPU kernel computes it yet")
    return generator


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


def shared_kernels(made: list[GPUKernel], op: Operation) -> list[GPUKernel]:
    """`made` (the kernels of an op of the same signature) as `op`'s: the same code, run on
    `op`'s variables."""
    operands = _operands(_generator(op), op)
    return [replace(kernel, operands=operands) for kernel in made]


def kernel_name(op: Operation) -> str:
    """A PTX identifier for the op's kernel: its name's letters and digits."""
    return "k_" + "".join(c if c.isalnum() else "_" for c in op.name)


Emit = Callable[[ThreadContext, ir.Value], None]


def _launches(generator, op: Operation | Member) -> list[tuple[int, Emit, int]]:
    """The op's launches in order, each (elements, how to emit one, threads per block of a
    block kernel or 0): one for most ops; an accumulation first zeroes its output (a launch
    finishes before the next starts); a ForEach its members' single launches as one."""
    if op.type == "ForEach":
        return [foreach.laid_end_to_end([_launches(_generator(m), m)[0] for m in members(op)])]
    if hasattr(generator, "launches"):
        return [(*launch, 0) if len(launch) == 2 else launch for launch in generator.launches(op)]
    return [(generator.elements(op), lambda ctx, index: generator.emit(ctx, op, index), 0)]


def _operands(generator, op: Operation | Member) -> tuple[Variable, ...]:
    """The variables the op's kernels take, in order: the generator's choice (a ForEach:
    its members'), or the op's inputs and outputs, each once."""
    if op.type == "ForEach":
        return tuple({id(v): v for m in members(op) for v in _operands(_generator(m), m)}.values())
    if hasattr(generator, "operands"):
        return generator.operands(op)
    return tuple({id(v): v for v in (*op.inputs, *op.outputs)}.values())


def _element_functions(module: ir.Module, op: Operation, on_gpu: bool) -> list[tuple[ir.Function, GPUKernel]]:
    """`element(index, operands..., status)` for each of the op's launches, with its kernel,
    for the GPU or for the host emulator (`on_gpu`; they differ in block kernels alone)."""
    generator = _generator(op)
    operands = _operands(generator, op)
    pointers = [storage_type(v.dtype).as_pointer() for v in operands]
    made = []
    for number, (elements, emit, threads) in enumerate(_launches(generator, op)):
        name = kernel_name(op) + (f"$then{number}" if number else "")  # "$": no op name makes it
        function = ir.Function(module, ir.FunctionType(VOID, [I64, *pointers, I64.as_pointer()]), name=f"{name}_element")
        function.linkage = "internal"
        function.attributes.add("alwaysinline")
        index, *arguments, status = function.args
        ctx = ThreadContext(module, ir.IRBuilder(function.append_basic_block("entry")),
                            {id(v): arguments[k] for k, v in enumerate(operands)}, status, on_gpu)
        emit(ctx, index)
        ctx.b.ret_void()
        made.append((function, GPUKernel(name, operands, elements, threads, ctx.fails, one_pass=op.type == "ForEach")))
    return made


def kernel_module(op: Operation, architecture: str = ARCHITECTURE) -> tuple[ir.Module, list[GPUKernel]]:
    """A module of the op's GPU kernels alone (one per launch)."""
    module = gpu_module(kernel_name(op), architecture)
    return module, add_kernels(module, op)


def add_kernels(module: ir.Module, op: Operation) -> list[GPUKernel]:
    """The op's GPU kernels in `module` (a GPU module), one per launch, in launch order:
    `name(operands..., status)` runs a grid-stride loop over the launch's elements (a block
    kernel's blocks: each block takes whole elements), or, `one_pass`, its one element: a
    ForEach's pointer parameters (a hundred, for an optimizer's update) are then each
    loaded in the branch of the member that reads them, where a loop's every trip would
    keep them all in registers (ptxas gave an AdamW ForEach 168 registers a thread)."""
    use_features(module, GPU_FEATURES)
    kernels = []
    for element, kernel in _element_functions(module, op, on_gpu=True):
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
            mark_kernel(module, function)
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
        mark_kernel(module, function)
        kernels.append(kernel)
    return kernels


def host_module(op: Operation, triple: str, data_layout: str, features: frozenset[str]) -> tuple[ir.Module, list[GPUKernel]]:
    """A module of the op's launches for the host CPU (`triple`, `data_layout`, `features`):
    see `add_host_kernels`."""
    module = ir.Module(kernel_name(op))
    module.triple, module.data_layout = triple, data_layout
    use_features(module, features)
    return module, add_host_kernels(module, op)


def add_host_kernels(module: ir.Module, op: Operation) -> list[GPUKernel]:
    """Each launch's element function in a host loop, `name(operands..., status, first, last)`,
    in `module` (a host module): the GPU's arithmetic, run here (the launches one after
    another, as the GPU runs them)."""
    kernels = []
    for element, kernel in _element_functions(module, op, on_gpu=False):
        function = ir.Function(module, ir.FunctionType(VOID, [*element.function_type.args[1:], I64, I64]), name=kernel.name)
        *pointers, first, last = function.args
        b = ir.IRBuilder(function.append_basic_block("entry"))
        with for_range(b, first, last, name="e") as index:
            b.call(element, [index, *pointers])
        b.ret_void()
        kernels.append(kernel)
    return kernels
