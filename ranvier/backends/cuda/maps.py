"""Elementwise kernels for the GPU: one thread per element.

An elementwise op with a formula, or a fused Calculate program, becomes a kernel whose
threads each compute elements of the output: thread t of the grid takes elements t,
t + (threads in the grid), ... (a grid-stride loop, so any launch shape covers any size;
`launch.py` picks one). An element's index is split into the iteration dimensions (merged
where every operand walks them as one), and each operand is read through its strided view,
so a broadcast costs no copy. The element's arithmetic is the CPU backend's, from the same
formulas on the same IR values (`ranvier.backends.llvm.formulas`), one lane wide.

That arithmetic is a function of its own, `element(index, operands...)`, which the kernel
calls per element. The same function compiled for the host, inside a plain loop
(`host_module`), is how the code generated for the GPU is checked where there is no GPU:
its results must equal the CPU backend's bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llvmlite import ir

from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops import op_def
from ...ops.expression import parse
from ..llvm.convert import narrow, widen
from ..llvm.formulas import apply, program_body
from ..llvm.irutil import I32, I64, VOID, for_range, i64, load, storage_type, store, use_features
from ..llvm.strided import Body, View, broadcast_view, collapse, dense_view
from ..llvm.values import Value
from .ptx import ARCHITECTURE, gpu_module, mark_kernel

# What the kernels may assume of every NVIDIA GPU, in the names the shared emitters test
# (`has_feature`): a fused multiply-add, and half-precision conversions in hardware (as
# x86's F16C gives the CPU).
GPU_FEATURES = frozenset({"fma", "f16c"})


@dataclass(frozen=True)
class MapKernel:
    """A generated elementwise kernel: its name, the variables its pointer parameters
    point at (in order; each once, whether read, written or both), and its elements."""

    name: str
    operands: tuple[Variable, ...]
    elements: int


@dataclass(frozen=True)
class _Map:
    shape: list[int]
    inputs: list[View]
    outputs: list[View]
    body: Body


def supports(op: Operation) -> bool:
    """An elementwise op with a formula, or a Calculate whose outputs share one shape."""
    if op.type == "Calculate":
        return len({tuple(v.shape) for v in op.outputs}) <= 1
    definition = op_def(op.type)
    return definition.family == "elementwise" and definition.formula is not None and op.type != "Identity"


def _describe(op: Operation) -> _Map:
    if not supports(op):
        raise RanvierError(f"{op.name} ({op.type}): no elementwise GPU kernel computes it")
    if op.type != "Calculate":
        shape = list(op.outputs[0].shape)
        return _Map(shape, [broadcast_view(v, shape) for v in op.inputs], [dense_view(op.outputs[0])],
                    lambda values, lanes: [apply(op.type, op.attrs, values)])
    program = parse(op.attrs["expr"])
    written = [t.index for t, _ in program.statements if t.kind == "%"]
    shape = list(op.outputs[0].shape) if op.outputs else list(op.inputs[written[0]].shape)
    outputs = [dense_view(v) for v in op.outputs] + [dense_view(op.inputs[i]) for i in written]
    return _Map(shape, [broadcast_view(v, shape) for v in op.inputs], outputs, program_body(program, len(op.outputs)))


def _operands(description: _Map) -> tuple[Variable, ...]:
    return tuple({id(v.var): v.var for v in description.inputs + description.outputs}.values())


def _element_function(module: ir.Module, name: str, description: _Map, operands: tuple[Variable, ...]) -> ir.Function:
    """`element(index, operands...)`: one element of the map, read and written through the views."""
    pointers = [storage_type(v.dtype).as_pointer() for v in operands]
    function = ir.Function(module, ir.FunctionType(VOID, [I64, *pointers]), name=f"{name}_element")
    function.linkage = "internal"
    function.attributes.add("alwaysinline")
    index, *arguments = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))
    views = description.inputs + description.outputs
    dims, strides = collapse(description.shape, views)
    coordinates, rest = [], index
    for d in reversed(range(len(dims))):  # the outermost coordinate needs no division
        coordinates.insert(0, b.srem(rest, i64(dims[d])) if d else rest)
        if d:
            rest = b.sdiv(rest, i64(dims[d]))
    pointer_of = {id(v): arguments[k] for k, v in enumerate(operands)}

    def offset(view_number: int) -> ir.Value:
        total = i64(views[view_number].offset)
        for coordinate, stride in zip(coordinates, strides[view_number]):
            if stride:
                total = b.add(total, b.mul(coordinate, i64(stride)))
        return total

    values = []
    for k, view in enumerate(description.inputs):
        raw = load(b, pointer_of[id(view.var)], offset(k), storage_type(view.var.dtype))
        values.append(Value(b, widen(b, raw, view.var.dtype, 1), view.var.dtype))
    results = description.body(values, 1)
    first_output = len(description.inputs)
    for k, (view, value) in enumerate(zip(description.outputs, results)):
        narrowed = narrow(b, value.ir, view.var.dtype, 1)
        store(b, narrowed, pointer_of[id(view.var)], offset(first_output + k), storage_type(view.var.dtype))
    b.ret_void()
    return function


def _special_register(module: ir.Module, b: ir.IRBuilder, name: str) -> ir.Value:
    """A thread's or the grid's coordinate (tid.x, ntid.x, ctaid.x, nctaid.x), as i64."""
    full = f"llvm.nvvm.read.ptx.sreg.{name}"
    function = module.globals.get(full) or ir.Function(module, ir.FunctionType(I32, []), name=full)
    return b.zext(b.call(function, []), I64)


def kernel_name(op: Operation) -> str:
    """A PTX identifier for the op's kernel: its name's letters and digits."""
    return "k_" + "".join(c if c.isalnum() else "_" for c in op.name)


def kernel_module(op: Operation, architecture: str = ARCHITECTURE) -> tuple[ir.Module, MapKernel]:
    """The op's GPU kernel: `name(operands...)` runs a grid-stride loop over the elements."""
    description = _describe(op)
    operands = _operands(description)
    name = kernel_name(op)
    module = gpu_module(name, architecture)
    use_features(module, GPU_FEATURES)
    element = _element_function(module, name, description, operands)
    kernel = ir.Function(module, ir.FunctionType(VOID, list(element.function_type.args[1:])), name=name)
    b = ir.IRBuilder(kernel.append_basic_block("entry"))
    elements = math.prod(description.shape)
    threads = _special_register(module, b, "ntid.x")
    first = b.add(b.mul(_special_register(module, b, "ctaid.x"), threads), _special_register(module, b, "tid.x"))
    step = b.mul(_special_register(module, b, "nctaid.x"), threads)
    loop, body, done = (kernel.append_basic_block(n) for n in ("loop", "body", "done"))
    b.branch(loop)
    b.position_at_end(loop)
    index = b.phi(I64)
    index.add_incoming(first, kernel.blocks[0])
    b.cbranch(b.icmp_unsigned("<", index, i64(elements)), body, done)
    b.position_at_end(body)
    b.call(element, [index, *kernel.args])
    index.add_incoming(b.add(index, step), body)
    b.branch(loop)
    b.position_at_end(done)
    b.ret_void()
    mark_kernel(module, kernel)
    return module, MapKernel(name, operands, elements)


def host_module(op: Operation, triple: str, data_layout: str, features: frozenset[str]) -> tuple[ir.Module, MapKernel]:
    """The kernel's element function in a host loop, `name(operands..., first, last)`, for
    the host CPU (`triple`, `data_layout`, `features`): the GPU's arithmetic, run here."""
    description = _describe(op)
    operands = _operands(description)
    name = kernel_name(op)
    module = ir.Module(name)
    module.triple, module.data_layout = triple, data_layout
    use_features(module, features)
    element = _element_function(module, name, description, operands)
    loop = ir.Function(module, ir.FunctionType(VOID, [*element.function_type.args[1:], I64, I64]), name=name)
    *pointers, first, last = loop.args
    b = ir.IRBuilder(loop.append_basic_block("entry"))
    with for_range(b, first, last, name="e") as index:
        b.call(element, [index, *pointers])
    b.ret_void()
    return module, MapKernel(name, operands, math.prod(description.shape))

