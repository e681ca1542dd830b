"""Calculate: a fused elementwise op whose body is a Calculate expression program.

The compiler's fusion pass creates it from chains of elementwise ops; its shape rule
and numpy reference evaluate the program statement by statement through the
registered op definitions, so a fused op means exactly what its parts meant.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from . import batch_norm, matmul, nn, nn_grad  # noqa: F401  (the products and row ops epilogues follow are defined first)
from .expression import Call, Ref, parsed, program_of
from .foreach import Member
from .registry import Attr, Attrs, TensorType, decomposition, define, op_def


class _Spec:
    """The name/dtype/shape view of a value that shape rules read."""

    def __init__(self, name: str, dtype: str, shape):
        self.name, self.dtype, self.shape = name, dtype, list(shape)
        self.data = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def program_types(program, inputs, op_name: str) -> dict[str, _Spec]:
    """Types of every temporary, output and call, inferred through the sub-ops' rules."""
    values = {f"%{i}": _Spec(getattr(v, "name", f"%{i}"), v.dtype, v.shape) for i, v in enumerate(inputs)}

    def evaluate(node):
        if isinstance(node, Ref):
            return values[str(node)]
        args = [evaluate(a) for a in node.args]
        (t,) = op_def(node.op_type).infer_types(f"{op_name}:{node.op_type}", args, dict(node.attrs))
        spec = values[str(node)] = _Spec(str(node), t.dtype, t.shape)
        return spec

    for target, call in program.statements:
        values[str(target)] = evaluate(call)
    return values


def _infer(ctx):
    program = parsed(ctx.attrs["expr"])
    values = program_types(program, ctx.inputs, ctx.op_name)
    for target, _ in program.statements:
        if target.kind == "%":
            written, into = values[str(target)], ctx.inputs[target.index]
            if written.dtype != into.dtype or list(written.shape) != list(into.shape):
                raise ctx.fail(f"a value of {into.name}'s type to write into it in place (got {written.dtype}{written.shape})")
    return [TensorType(v.dtype, v.shape) for v in _outputs(values)]


def _outputs(values: dict[str, _Spec]) -> list[_Spec]:
    """The program's outputs @0, @1, ... among the types `program_types` found."""
    return [v for _, v in sorted((int(k[1:]), v) for k, v in values.items() if k.startswith("@"))]


def written_inputs(op) -> list[int]:
    """A statement assigning %i writes input i in place (a fused parameter update)."""
    return program_of(op).writes


def _reference(attrs, args, outs):
    def call(node: Call, sub_args: list) -> np.ndarray:
        definition = op_def(node.op_type)
        sub_attrs = Attrs(dict(node.attrs), "Calculate", node.op_type, definition.attrs)
        dtype = _dtype_of(node, sub_args)
        (result,) = definition.reference(sub_attrs, sub_args, [TensorType(dtype, np.broadcast_shapes(*[np.shape(a) for a in sub_args]))])
        return np.asarray(result)

    return parsed(attrs["expr"]).evaluate(list(args), len(outs), call)


def _dtype_of(call: Call, args) -> str:
    if call.op_type == "Cast":
        return dict(call.attrs)["dtype"]
    return dtypes.from_numpy(np.asarray(args[0]).dtype) if args else dtypes.DT_FLOAT32


def _computing_statements(op) -> int:
    """The statements of the op's program that compute (not a copy)."""
    return sum(1 for _, call in program_of(op).statements if call.op_type != "Identity")


def _flops(op) -> int:
    """One operation per element for each statement that computes."""
    return max([v.size for v in op.outputs] + [v.size for v in op.inputs]) * _computing_statements(op)


define(
    "Calculate", _infer, _reference, (1, None), "fused", "fused elementwise program",
    attrs=[Attr("expr", "str", "", "the program, e.g. $0=Mul(%0,%1);@0=Add($0,%2)")],
    written=written_inputs,
    flops=_flops,
)


# ---- MatMulCalculate, Conv2DCalculate: a product and the Calculate that reads it -----------
#
# The compiler's epilogue pass (compiler/epilogue.py) makes one of a MatMul or a Conv2D whose
# product only a Calculate reads: inputs the product's two (a, b; x, w), then the
# Calculate's other inputs; in the program %0 is the product and %i (i ≥ 1) is input i + 1.
# Output 0 has the product's type (or float32 for a half-precision product, whose float32
# sums it then keeps): the product is computed into it, and the program then runs over
# each block of it a GEMM call made, while the block is still in cache.

# The ops whose product an epilogue can follow, and how the GEMM writes it as a matrix:
# (outer, columns), its leading dimensions a call never crosses and its trailing dimensions
# that make the columns. A MatMul's rows run over every leading dimension (a batch of row
# blocks times one matrix is one GEMM); a convolution's [N, O, Ho, Wo] is, per image, O
# rows of Ho·Wo positions.
EPILOGUE_PRODUCTS = {"MatMul": (0, 1), "Conv2D": (1, 2)}


def fused_type(product_type: str) -> str:
    return f"{product_type}Calculate"


def product_type(fused: str) -> str:
    return fused.removesuffix("Calculate")


def _product_attrs(fused: str, raw: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in raw.items() if name in op_def(product_type(fused)).attrs}


def _infer_product_calculate(ctx):
    (product,) = op_def(product_type(ctx.op_type)).infer_types(ctx.op_name, ctx.inputs[:2], _product_attrs(ctx.op_type, ctx.attrs.raw))
    program = parsed(ctx.attrs["expr"])
    if program.writes:
        raise ctx.fail("an epilogue that writes no input in place")
    values = program_types(program, [_Spec("product", product.dtype, product.shape), *ctx.inputs[2:]], ctx.op_name)
    outputs = _outputs(values)
    widened = product.dtype in (dtypes.DT_BFLOAT16, dtypes.DT_FLOAT16) and outputs and outputs[0].dtype == dtypes.DT_FLOAT32
    if not outputs or (outputs[0].dtype != product.dtype and not widened) or list(outputs[0].shape) != list(product.shape):
        raise ctx.fail(f"a first output of the product's type, {product.dtype}{list(product.shape)} "
                       "(or float32, a half-precision product's float32 sums)")
    for v in outputs:
        if list(v.shape) != list(product.shape):
            raise ctx.fail(f"every output of the product's shape {list(product.shape)} (got {list(v.shape)})")
    return [TensorType(v.dtype, v.shape) for v in outputs]


def _product_calculate_reference(fused: str):
    def reference(attrs, args, outs):
        base = op_def(product_type(fused))
        raw = _product_attrs(fused, attrs.raw)
        (product,) = base.reference(Attrs(raw, "", base.type, base.attrs), args[:2], outs[:1])
        rounded = np.asarray(product).astype(dtypes.to_numpy(outs[0].dtype))  # as the kernel stores it
        return _reference(attrs, [rounded, *args[2:]], outs)

    return reference


def _product_calculate_flops(op) -> int:
    """The product's, then one operation per element of it for each statement that computes."""
    return op_def(product_type(op.type)).cost(op) + op.outputs[0].size * _computing_statements(op)


def epilogue_strides(shape, product_shape) -> tuple[int, int] | None:
    """How an epilogue reads an input of `shape` broadcast to the product's: element
    (row, column) of the product, rows counted over all its leading dimensions, is at
    row · r + column · c; (r, c), or None where no such pair exists (an input that
    broadcasts over some leading dimensions but not others)."""
    shape, product_shape = list(shape), list(product_shape)
    lead = len(product_shape) - len(shape)
    if lead < 0:
        return None
    own, step = [0] * len(shape), 1
    for i in reversed(range(len(shape))):
        own[i], step = step, step * shape[i]
    strides = [0] * lead + [0 if d == 1 else own[i] for i, d in enumerate(shape)]
    # rows a step of each leading dimension moves over, in the product's [rows, columns] view
    unit, rows = [0] * (len(product_shape) - 1), 1
    for i in reversed(range(len(product_shape) - 1)):
        unit[i], rows = rows, rows * product_shape[i]
    moving = [i for i in range(len(product_shape) - 1) if product_shape[i] != 1]
    row_stride = strides[moving[-1]] if moving else 0
    if any(strides[i] != row_stride * unit[i] for i in moving):
        return None
    return row_stride, strides[-1]


def epilogue_input_strides(shape, product_shape, layout: tuple[int, int]) -> tuple[int, int, int] | None:
    """How an epilogue reads an input of `shape` over a product the GEMM writes in
    `layout` (see EPILOGUE_PRODUCTS): (outer, row, column) strides, the element at
    (outer index, row, column) being at their dot product; None where the input cannot be
    read so (its trailing dimensions must be all the product's or all 1, and its rows
    linear: `epilogue_strides`)."""
    outer, columns_rank = layout
    product_shape = list(product_shape)
    shape = [1] * (len(product_shape) - len(shape)) + list(shape)
    if len(shape) > len(product_shape):
        return None
    tail, product_tail = shape[-columns_rank:], product_shape[-columns_rank:]
    if tail != product_tail and any(d != 1 for d in tail):
        return None
    columns = math.prod(product_tail)
    inner = epilogue_strides([*shape[outer:-columns_rank], columns if tail == product_tail else 1],
                             [*product_shape[outer:-columns_rank], columns])
    if inner is None:
        return None
    outer_stride = 0 if not outer or shape[outer - 1] == 1 else math.prod(shape[outer:])
    return outer_stride, *inner


for _product in EPILOGUE_PRODUCTS:
    _inputs = "a @ b" if _product == "MatMul" else "Conv2D(x, w)"
    define(
        fused_type(_product), _infer_product_calculate, _product_calculate_reference(fused_type(_product)), (2, None), "fused",
        f"{_inputs}, then a Calculate program over the product (%0) and further inputs (%1 is input 2)",
        attrs=[*op_def(_product).attrs.values(), Attr("expr", "str", "", "the epilogue program; %0 is the product, %i input i + 1")],
        flops=_product_calculate_flops,
    )


# ---- RMSNormCalculate, LayerNormCalculate, RMSNormGradCalculate, MaxPoolGradCalculate,
# BatchNormTrainCalculate: an op that writes each element of its first output once, and the
# Calculate that reads it ------------------------------------------------------------------------
#
# The epilogue pass makes one of a row op (a norm or a norm's gradient, which writes each
# element of its first output once, in its last pass over the row) and the Calculate that
# alone reads that output, taking further inputs of its shape or single values: the
# Calculate then runs as each element is computed, and the row op's output is never
# stored (a norm's output rounded to bfloat16 for the products that read it; a norm's
# gradient added to the residual stream's). Inputs: the row op's (`row_inputs` of them),
# then the Calculate's others; in the program %0 is the row op's output, %i (i ≥ 1) input
# row_inputs + i − 1. Outputs: the program's, then the row op's further outputs.
#
# A max pooling's gradient takes one the same way (a CNN's ReLU gradient after it): where
# its windows tile the image, each element of dx is written once; where they overlap, a
# plane's windows add into the program's first output, and the program runs over the plane
# after them. So, as after a product, one output must be of dx's dtype, and comes first.
ROW_EPILOGUE_OPS = ("RMSNorm", "LayerNorm", "RMSNormGrad")
WINDOW_EPILOGUE_OPS = ("MaxPoolGrad",)
# Training-mode batch norm writes each element of y once too, a channel's planes at a time:
# a CNN's ReLU runs as y is computed, y never stored.
CHANNEL_EPILOGUE_OPS = ("BatchNormTrain",)
ELEMENT_EPILOGUE_OPS = ROW_EPILOGUE_OPS + WINDOW_EPILOGUE_OPS + CHANNEL_EPILOGUE_OPS
ROW_INPUTS = Attr("row_inputs", "int", 1, "how many of the inputs are the row op's (the pool gradient's)")


def row_split(op_type: str, attrs: dict[str, str], inputs: list, outputs: list) -> tuple:
    """(the row op's attributes, its inputs, the program's further inputs, the program's
    outputs, the row op's further outputs) of a fused row op."""
    count = int(attrs.get("row_inputs", 1))
    base = op_def(product_type(op_type))
    further_outputs = len(base.infer_types("", inputs[:count], _product_attrs(op_type, attrs))) - 1
    program_outputs = len(outputs) - further_outputs
    return (_product_attrs(op_type, attrs), inputs[:count], inputs[count:], outputs[:program_outputs],
            outputs[program_outputs:])


def _infer_row_calculate(ctx):
    count = ctx.attrs["row_inputs"]
    if not 1 <= count <= len(ctx.inputs):
        raise ctx.fail(f"attribute row_inputs between 1 and {len(ctx.inputs)} (got {count})")
    row_types = op_def(product_type(ctx.op_type)).infer_types(ctx.op_name, ctx.inputs[:count],
                                                              _product_attrs(ctx.op_type, ctx.attrs.raw))
    program = parsed(ctx.attrs["expr"])
    if program.writes:
        raise ctx.fail("an epilogue that writes no input in place")
    first = row_types[0]
    if any(list(v.shape) != list(first.shape) and v.size != 1 for v in ctx.inputs[count:]):
        raise ctx.fail(f"further inputs of the {product_type(ctx.op_type)} output's shape {list(first.shape)} or single values")
    values = program_types(program, [_Spec("row", first.dtype, first.shape), *ctx.inputs[count:]], ctx.op_name)
    outputs = _outputs(values)
    if not outputs or any(list(v.shape) != list(first.shape) for v in outputs):
        raise ctx.fail(f"program outputs of the {product_type(ctx.op_type)} output's shape {list(first.shape)}")
    return [TensorType(v.dtype, v.shape) for v in outputs] + row_types[1:]


def _row_calculate_reference(fused: str):
    def reference(attrs, args, outs):
        base = op_def(product_type(fused))
        count = attrs["row_inputs"]
        raw = _product_attrs(fused, attrs.raw)
        row_types = base.infer_types("", [_Spec(f"%{i}", dtypes.from_numpy(np.asarray(a).dtype), np.shape(a))
                                          for i, a in enumerate(args[:count])], raw)
        row = list(base.reference(Attrs(raw, "", base.type, base.attrs), args[:count], row_types))
        # the kernel applies the program to each element as computed, unrounded
        return _reference(attrs, [np.asarray(row[0]), *args[count:]], outs[:len(outs) - len(row) + 1]) + row[1:]

    return reference


def _row_calculate_flops(op) -> int:
    attrs, row_inputs, _, program_outputs, further = row_split(op.type, op.attrs, op.inputs, op.outputs)
    row = Member(op.name, product_type(op.type), row_inputs, program_outputs[:1] + further, attrs)
    return op_def(row.type).cost(row) + op.outputs[0].size * _computing_statements(op)


def _row_calculate_in_parts(b, op):
    """The row op, then the Calculate over its first output."""
    attrs, row_inputs, further_inputs, _, _ = row_split(op.type, op.attrs, op.inputs, op.outputs)
    row = b.op(product_type(op.type), row_inputs, None, attrs)
    row = list(row) if isinstance(row, tuple) else [row]
    result = b.op("Calculate", [row[0], *further_inputs], None, {"expr": op.attrs["expr"]})
    return [*(list(result) if isinstance(result, tuple) else [result]), *row[1:]]


for _row_op in ELEMENT_EPILOGUE_OPS:
    define(
        fused_type(_row_op), _infer_row_calculate, _row_calculate_reference(fused_type(_row_op)), (1, None), "fused",
        f"{_row_op} (its first row_inputs inputs), then a Calculate program over its first output (%0) and further "
        "inputs of its shape (%1 is input row_inputs); outputs: the program's, then the row op's others",
        attrs=[*op_def(_row_op).attrs.values(), ROW_INPUTS,
               Attr("expr", "str", "", "the epilogue program; %0 is the row op's first output")],
        flops=_row_calculate_flops,
    )
    decomposition(fused_type(_row_op))(_row_calculate_in_parts)


# ---- Conv2DCalculateMaxPool: a convolution, its epilogue, and the max pooling that alone reads it
#
# The compiler's conv-pool pass (compiler/conv_pool.py) makes one of a Conv2DCalculate of one
# output and the MaxPool that alone reads it (a ResNet stem: convolution, folded batch norm,
# ReLU, 3 × 3 max pool of stride 2), so a kernel can pool bands of the convolution's output
# while they are in cache and never store the whole of it (ResNet-18's stem at batch 32:
# 102 MB written and read back). Inputs and the program as Conv2DCalculate's; the pooling's
# attributes named pool_*; one output, the pooled tensor.
CONV_POOL = "Conv2DCalculateMaxPool"
CONV_CALCULATE = fused_type("Conv2D")  # a convolution and its epilogue
_POOL_ATTRS = {"pool_ksize": "ksize", "pool_strides": "strides", "pool_padding": "padding"}


def conv_pool_parts(attrs: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the Conv2DCalculate's attributes, the MaxPool's) of a Conv2DCalculateMaxPool's."""
    conv = {name: value for name, value in attrs.items() if name not in _POOL_ATTRS}
    pool = {_POOL_ATTRS[name]: value for name, value in attrs.items() if name in _POOL_ATTRS}
    return conv, pool


def conv_pool_attrs(conv: dict[str, str], pool: dict[str, str]) -> dict[str, str]:
    """A Conv2DCalculateMaxPool's attributes from its two ops'."""
    return {**conv, **{fused: pool[name] for fused, name in _POOL_ATTRS.items() if name in pool}}


def _infer_conv_pool(ctx):
    conv, pool = conv_pool_parts(ctx.attrs.raw)
    products = op_def(CONV_CALCULATE).infer_types(ctx.op_name, ctx.inputs, conv)
    if len(products) != 1:
        raise ctx.fail(f"an epilogue program of one output (got {len(products)})")
    return op_def("MaxPool").infer_types(ctx.op_name, [_Spec("product", products[0].dtype, products[0].shape)], pool)


def _conv_pool_reference(attrs, args, outs):
    conv, pool = conv_pool_parts(attrs.raw)
    convolved = op_def(CONV_CALCULATE)
    (product,) = convolved.infer_types("", [_Spec(f"%{i}", dtypes.from_numpy(np.asarray(a).dtype), np.shape(a))
                                            for i, a in enumerate(args)], conv)
    (y,) = convolved.reference(Attrs(conv, "", convolved.type, convolved.attrs), args, [product])
    return [nn.max_pool(np.asarray(y), *nn.pool_params(Attrs(pool, "", "MaxPool", op_def("MaxPool").attrs)))]


def _conv_pool_flops(op) -> int:
    conv, pool = conv_pool_parts(op.attrs)
    (product,) = op_def(CONV_CALCULATE).infer_types("", op.inputs, conv)
    member = Member(op.name, CONV_CALCULATE, list(op.inputs), [_Spec("product", product.dtype, product.shape)], conv)
    return op_def(CONV_CALCULATE).cost(member) + op.outputs[0].size * math.prod(nn.pool_params(
        Attrs(pool, "", "MaxPool", op_def("MaxPool").attrs))[0])


define(
    CONV_POOL, _infer_conv_pool, _conv_pool_reference, (2, None), "fused",
    f"{CONV_CALCULATE} (its inputs, attributes and program of one output), then a MaxPool (attributes pool_*) "
    "over that output",
    attrs=[*op_def(CONV_CALCULATE).attrs.values(),
           *(Attr(fused, op_def("MaxPool").attrs[name].kind, op_def("MaxPool").attrs[name].default,
                  f"the pooling's {op_def('MaxPool').attrs[name].doc}") for fused, name in _POOL_ATTRS.items())],
    flops=_conv_pool_flops,
)


@decomposition(CONV_POOL)
def _conv_pool_in_parts(b, op):
    conv, pool = conv_pool_parts(op.attrs)
    return b.op("MaxPool", [b.op(CONV_CALCULATE, list(op.inputs), None, conv)], None, pool)
