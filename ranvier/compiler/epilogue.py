"""Epilogue fusion: a MatMul (or Conv2D) whose product only a Calculate (or a single
elementwise op: a ReLU) reads becomes one MatMulCalculate (Conv2DCalculate), so the
Calculate runs over each block of the product its GEMM call just wrote (still in cache)
instead of as a pass of its own over the whole product: a bias, an activation, a residual
added, any fused elementwise program.

It applies when the Calculate's outputs all have the product's shape, one of them its
dtype too (the product is computed into it, then overwritten in place by the program; a
backend that states its epilogues, `accepts`, may take a half-precision product's
float32 sums into a float32 output instead: cuBLASLt's D),
the Calculate writes no input in place, and each of its other inputs reads one element
per (row, column) of the matrix the GEMM writes (`epilogue_input_strides`: a bias, a
same-shaped tensor, a per-row scale; a convolution's per-channel bias).

A row op that writes each element of its first output once (a norm, a norm's gradient:
`ROW_EPILOGUE_OPS`) takes the Calculate that alone reads that output the same way, as
RMSNormCalculate and its kin: the program runs as each element is computed and the row
op's output is never stored — a norm's output rounded to bfloat16 as it is written, a
norm's gradient added to the residual stream's. The Calculate's other inputs must be of
the output's shape or single values. A max pooling's gradient (`WINDOW_EPILOGUE_OPS`)
takes one too, as MaxPoolGradCalculate: a CNN's ReLU gradient runs as dx is written,
rather than as a pass over the whole of it. Where its windows overlap, dx adds up in the
program's first output, so, as after a product, one output must be of dx's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

from ..flow.graph import Flow, Function, Operation, Variable
from ..ops.expression import Call, Program, Ref, program_of
from ..ops.fused import (
    ELEMENT_EPILOGUE_OPS,
    EPILOGUE_PRODUCTS,
    ROW_EPILOGUE_OPS,
    epilogue_input_strides,
    fused_type,
    written_inputs,
)
from .fuse import is_elementwise
from .rewrite import fuse


def fuse_epilogues(flow: Flow, func: Function, keep: set[str],
                   accepts: Callable[[Variable, str, list[Variable]], bool] | None = None) -> None:
    """Replace each MatMul, Conv2D, row op or pool gradient and the Calculate that alone
    reads its product by one op (where given, only those `accepts(product, program, further inputs)`:
    `Capabilities`)."""
    # Where a Calculate adds two products (a SwiGLU's d x, a chunked LM head's d W), the one
    # listed later takes it: the earlier one's epilogue would wait for the later product,
    # holding its inputs (a chunk of logits' gradient) meanwhile. The fused op keeps the
    # product's place in the list, so it runs where the product would have.
    for producer in reversed([op for op in func.ops if op.type in EPILOGUE_PRODUCTS or op.type in ELEMENT_EPILOGUE_OPS]):
        calculate = _epilogue_of(producer, func, keep)
        if calculate is None:
            continue
        landed = any(v.dtype == producer.outputs[0].dtype for v in calculate.outputs)
        if accepts is None and not landed and producer.type not in ROW_EPILOGUE_OPS:
            continue  # the product computed into no output of its dtype: only a backend that says so runs that
        program, others, order = _fused_program(producer, calculate)
        if accepts is None or accepts(producer.outputs[0], str(program), others):
            _fuse(flow, func, producer, calculate, program, others, order)


def _epilogue_of(producer: Operation, func: Function, keep: set[str]) -> Operation | None:
    product = producer.outputs[0]
    if product.name in keep or product.out or len(product.consumers) != 1:
        return None
    calculate = product.consumers[0]
    if not (calculate.type == "Calculate" or is_elementwise(calculate)) or calculate.func is not func or written_inputs(calculate):
        return None
    if sum(v is product for v in calculate.inputs) != 1:
        return None
    if any(list(v.shape) != list(product.shape) for v in calculate.outputs):
        return None
    others = [v for v in calculate.inputs if v is not product]
    if producer.type in ELEMENT_EPILOGUE_OPS:  # read element by element as the output is written
        return calculate if all(list(v.shape) == list(product.shape) or v.size == 1 for v in others) else None
    if any(epilogue_input_strides(v.shape, product.shape, EPILOGUE_PRODUCTS[producer.type]) is None for v in others):
        return None
    return calculate


def _program(op: Operation) -> Program:
    """A Calculate's program, or a single elementwise op's as one."""
    if op.type == "Calculate":
        return program_of(op)
    call = Call(op.type, tuple(Ref("%", i) for i in range(len(op.inputs))), tuple(sorted(op.attrs.items())))
    return Program(((Ref("@", 0), call),))


def _renumbered(program: Program, inputs: dict[int, int], outputs: dict[int, int]) -> Program:
    def ref(node: Ref) -> Ref:
        if node.kind == "%":
            return Ref("%", inputs[node.index])
        return Ref("@", outputs[node.index]) if node.kind == "@" else node

    def call(node: Call) -> Call:
        return Call(node.op_type, tuple(call(a) if isinstance(a, Call) else ref(a) for a in node.args), node.attrs)

    return Program(tuple((ref(target), call(node)) for target, node in program.statements))


def _fused_program(producer: Operation, calculate: Operation) -> tuple[Program, list[Variable], list[Variable]]:
    """The fused op's program (%0 the product, then the Calculate's other inputs in order;
    @0 the output the product lands in), those other inputs, and the outputs in order."""
    product = producer.outputs[0]
    others = [v for v in calculate.inputs if v is not product]
    inputs = {i: (0 if v is product else 1 + others.index(v)) for i, v in enumerate(calculate.inputs)}
    if producer.type in ROW_EPILOGUE_OPS:
        order = list(calculate.outputs)
    else:
        landing = next((v for v in calculate.outputs if v.dtype == product.dtype), calculate.outputs[0])
        order = [landing, *(v for v in calculate.outputs if v is not landing)]
    outputs = {j: order.index(v) for j, v in enumerate(calculate.outputs)}
    return _renumbered(_program(calculate), inputs, outputs), others, order


def _fuse(flow: Flow, func: Function, producer: Operation, calculate: Operation, program: Program,
          others: list[Variable], order: list[Variable]) -> None:
    """Put the fused op (`_fused_program`'s program, inputs and outputs) in their place."""
    attrs = {**producer.attrs, "expr": str(program)}
    if producer.type in ELEMENT_EPILOGUE_OPS:
        attrs["row_inputs"] = str(len(producer.inputs))
    fuse(flow, func, [producer, calculate], fused_type(producer.type), [*producer.inputs, *others],
         [*order, *producer.outputs[1:]], attrs, dropped=producer.outputs[:1], keep_place=True)
