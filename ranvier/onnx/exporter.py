"""Export one inference function of a flow to an ONNX model.

    model = save(flow, "model.onnx", function="infer", weights=trainer.state_arrays())

Graph inputs are the function's variables without data, outputs its outputs, and
constants and parameters become initializers. Values keep their flow names
("infer/x", "mlp/W0", "infer/MatMul:0"); the extra values an op needs in ONNX are
named after the op ("infer/Attention/Softmax"). Every op maps to standard ONNX ops
(opset 18 or later); composite ops with no ONNX equivalent at the opset (RMSNorm,
Attention, Rotary, cross-entropy) are written as the primitives they are defined by. An op
with no mapping is an error naming it: the export never drops an op.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from .. import dtypes
from ..atomic import atomic_write
from ..errors import RanvierError, UnknownOpError
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of
from ..ops.attention import grouped_bias_shape, heads_first_shape, scale_of
from ..ops.shape import shape_fact
from ..ops.window import strided_view
from ..version import __version__

MIN_OPSET = 18  # Split's num_outputs, the reductions' axes as an input
# Protobuf cannot serialize a message of 2 GiB; beyond this many bytes of initializers
# (leaving room for the graph itself) their data goes to a file beside the model.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26
EXTERNAL_MIN_BYTES = 1024  # smaller tensors stay inline, as onnx's own writer does

ONNX_DTYPES = {
    "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT,
    "float64": TensorProto.DOUBLE, "int8": TensorProto.INT8, "int16": TensorProto.INT16, "int32": TensorProto.INT32,
    "int64": TensorProto.INT64, "uint8": TensorProto.UINT8, "uint16": TensorProto.UINT16, "uint32": TensorProto.UINT32,
    "uint64": TensorProto.UINT64, "bool": TensorProto.BOOL,
}


def onnx_dtype(dtype: str) -> int:
    """The ONNX element type of a ranvier dtype."""
    if dtype not in ONNX_DTYPES:
        raise RanvierError(f"ONNX export: dtype {dtype} has no ONNX element type; expected one of {', '.join(ONNX_DTYPES)}")
    return ONNX_DTYPES[dtype]


def save(
    flow: Flow,
    path: str | os.PathLike | None = None,
    function: str | None = None,
    opset: int = 20,
    inputs: Sequence | None = None,
    outputs: Sequence | None = None,
    *,
    weights: Mapping[str, np.ndarray] | None = None,
    external_data: bool | None = None,
) -> onnx.ModelProto:
    """Export `function` of `flow` (default: its only function) as an ONNX model, written
    atomically to `path` when one is given, and return it.

    inputs, outputs: the graph's inputs and outputs (names or handles) in order; by
        default the function's variables without data, and its outputs. Only the ops
        the outputs depend on are exported.
    weights: values to export instead of variables' data, by variable name: a trained
        model's parameters live in its compiled network (`trainer.state_arrays()`), not
        in the flow.
    external_data: write initializers to `<path>.data` beside the model; None: only
        when the model would pass protobuf's 2 GiB limit.
    """
    if not MIN_OPSET <= opset <= onnx.defs.onnx_opset_version():
        raise RanvierError(f"ONNX export: opset {opset} is not supported; use {MIN_OPSET} to {onnx.defs.onnx_opset_version()}")
    func = _function(flow, function)
    results = [_variable(flow, v) for v in outputs] if outputs is not None else flow.outputs(func)
    for var in results:
        if var.producer is None or var.producer.func is not func:
            raise RanvierError(f"ONNX export: output {var.name} is not computed by function {func.name}")
    ops = _needed_ops(flow, func, results)
    read = _read_variables(ops)
    feeds = [_variable(flow, v) for v in inputs] if inputs is not None else [v for v in read if _data(v, weights) is None]
    fed = {v.name for v in feeds}
    missing = [v.name for v in read if v.name not in fed and _data(v, weights) is None]
    if missing:
        raise RanvierError(f"ONNX export of {func.name}: no data for {', '.join(missing)}; feed them as inputs or give weights")

    graph = _Graph(flow, opset)
    for op in ops:
        graph.convert(op)
    # Constants that became attributes (Reshape's shape, Concat's axis) are no initializers.
    used = {name for node in graph.nodes for name in node.input}
    initializers = [numpy_helper.from_array(_data(v, weights), v.name) for v in read if v.name in used and v.name not in fed]
    model = helper.make_model(
        helper.make_graph(
            graph.nodes, func.name, [_value_info(v) for v in feeds], [_value_info(v) for v in results],
            initializers + graph.constants,
        ),
        opset_imports=[helper.make_opsetid("", opset)],
        producer_name="ranvier",
        producer_version=__version__,
    )
    # The oldest IR version that carries this opset, so older runtimes load the model too.
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    if path is not None:
        _write(model, Path(path), external_data)
    return model


def _function(flow: Flow, name: str | None) -> Function:
    if name is not None:
        if name not in flow.funcs:
            raise RanvierError(f"ONNX export: no function {name!r} in the flow; it has {', '.join(flow.funcs) or 'none'}")
        return flow.funcs[name]
    if len(flow.funcs) != 1:
        raise RanvierError(f"ONNX export: the flow has functions {', '.join(flow.funcs) or '(none)'}; name the one to export")
    return next(iter(flow.funcs.values()))


def _variable(flow: Flow, handle) -> Variable:
    return flow.lookup(handle) if isinstance(handle, str) else getattr(handle, "var", handle)


def _data(var: Variable, weights: Mapping | None) -> np.ndarray | None:
    value = weights.get(var.name) if weights is not None else None
    if value is None:
        return var.data
    if list(np.shape(value)) != var.shape:
        raise RanvierError(f"ONNX export: weights for {var.name} have shape {list(np.shape(value))}, expected {var.shape}")
    return np.asarray(value, dtypes.to_numpy(var.dtype))


def _needed_ops(flow: Flow, func: Function, results: list[Variable]) -> list[Operation]:
    """The function's ops the results depend on, in dependency order."""
    needed: set[Operation] = set()
    pending = [v.producer for v in results]
    while pending:
        op = pending.pop()
        if op in needed:
            continue
        needed.add(op)
        pending += [v.producer for v in op.inputs if v.producer is not None and v.producer.func is func]
    return [op for op in flow.op_order(func) if op in needed]


def _read_variables(ops: list[Operation]) -> list[Variable]:
    """Variables the ops read that none of them computes, in first-use order."""
    produced = {id(v) for op in ops for v in op.outputs}
    read: dict[int, Variable] = {}
    for op in ops:
        for v in op.inputs:
            if id(v) not in produced:
                read.setdefault(id(v), v)
    return list(read.values())


def _value_info(var: Variable) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(var.name, onnx_dtype(var.dtype), var.shape)


def _write(model: onnx.ModelProto, path: Path, external_data: bool | None) -> None:
    tensors = list(model.graph.initializer)
    if external_data is None:
        external_data = sum(len(t.raw_data) for t in tensors) > EXTERNAL_DATA_THRESHOLD
    if not external_data:
        atomic_write(path, lambda f: f.write(model.SerializeToString()))
        return
    location = f"{path.name}.data"
    moved = [t for t in tensors if len(t.raw_data) >= EXTERNAL_MIN_BYTES]
    raw = {id(t): t.raw_data for t in moved}

    def write_data(f):
        for t in moved:
            external_data_helper.set_external_data(t, location, f.tell(), len(raw[id(t)]))
            f.write(raw[id(t)])
            t.ClearField("raw_data")

    # The returned model keeps its data inline: only the file refers to the data file.
    try:
        atomic_write(path.with_name(location), write_data)
        atomic_write(path, lambda f: f.write(model.SerializeToString()))
    finally:
        for t in moved:
            t.raw_data = raw[id(t)]
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]


class _Graph:
    """The ONNX graph under construction: its nodes and constants, with unique names."""

    def __init__(self, flow: Flow, opset: int):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self.taken = set(flow.vars) | {alias for v in flow.vars.values() for alias in v.aliases}
        self.node_names: set[str] = set()
        self.op: Operation | None = None
        self.first_node = 0  # where the current op's nodes start

    def fresh(self, base: str, taken: set[str] | None = None) -> str:
        """`base`, or `base_1`, `base_2`, ...: the first name not yet taken (by a value, by default)."""
        taken = self.taken if taken is None else taken
        name, index = base, 1
        while name in taken:
            name, index = f"{base}_{index}", index + 1
        taken.add(name)
        return name

    def node_name(self, op_type: str) -> str:
        return self.fresh(f"{self.op.name}/{op_type}", self.node_names)

    def const(self, value, dtype) -> str:
        """A constant value of the current op (a shape, an axis list, a scalar)."""
        name = self.fresh(f"{self.op.name}/const")
        self.constants.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def ints(self, values) -> str:
        return self.const(list(values), np.int64)

    def node(self, op_type: str, inputs: Sequence[str], outputs: int = 1, **attrs) -> str | list[str]:
        """Add a node of the current op; its outputs get fresh names."""
        names = [self.fresh(f"{self.op.name}/{op_type}") for _ in range(outputs)]
        node = helper.make_node(op_type, list(inputs), names, self.node_name(op_type), **attrs)
        self.nodes.append(node)
        return names[0] if outputs == 1 else names

    def convert(self, op: Operation) -> None:
        converter = CONVERTERS.get(op.type)
        if converter is None:
            hint = "; export the flow as built, not a compiled one" if op.type in ("Calculate", "MatMulCalculate") else ""
            raise UnknownOpError(f"ONNX export: op {op.name} of type {op.type} has no ONNX mapping{hint}")
        self.op, self.first_node = op, len(self.nodes)
        results = converter(self, op, *(v.name for v in op.inputs))
        results = [results] if isinstance(results, str) else results
        for result, var in zip(results, op.outputs, strict=True):
            self.bind(result, var.name)

    def bind(self, result: str, name: str) -> None:
        """Rename the current op's value `result` to the output variable's name."""
        own = self.nodes[self.first_node:]
        if not any(result in node.output for node in own):  # an input passed through unchanged
            self.nodes.append(helper.make_node("Identity", [result], [name], self.node_name("Identity")))
            return
        for node in own:
            for values in (node.input, node.output):
                for i, value in enumerate(values):
                    if value == result:
                        values[i] = name


# ---- converters: (graph, op, input names) -> output name(s) ----------------------------------------

Converter = Callable[..., "str | list[str]"]
CONVERTERS: dict[str, Converter] = {}


def converts(*op_types: str) -> Callable[[Converter], Converter]:
    def register(converter: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[op_type] = converter
        return converter

    return register


def _numpy(var: Variable) -> np.dtype:
    return dtypes.to_numpy(var.dtype)


def _chain(*onnx_types: str) -> Converter:
    """x through the ONNX ops in order (Rsqrt is Sqrt then Reciprocal)."""

    def convert(g, op, *inputs):
        value = g.node(onnx_types[0], inputs)
        for onnx_type in onnx_types[1:]:
            value = g.node(onnx_type, [value])
        return value

    return convert


CHAINS = {
    # Elementwise ops ONNX has under the same name.
    **{t: (t,) for t in (
        "Abs", "Neg", "Sign", "Relu", "Identity", "Exp", "Log", "Sqrt", "Reciprocal", "Sin", "Cos", "Tan", "Tanh",
        "Sigmoid", "Erf", "Softplus", "Softsign", "Floor", "Ceil", "Round", "Not", "Asin", "Acos", "Atan", "Sinh",
        "Cosh", "Asinh", "Acosh", "Atanh", "Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "Greater", "And",
        "Or", "Xor",
    )},
    # Under other names, or as two ops.
    "LessEqual": ("LessOrEqual",), "GreaterEqual": ("GreaterOrEqual",), "Minimum": ("Min",), "Maximum": ("Max",),
    "Cond": ("Where",), "NotEqual": ("Equal", "Not"),
    # Myelin's reciprocal trigonometric family.
    "Rsqrt": ("Sqrt", "Reciprocal"), "Cot": ("Tan", "Reciprocal"), "Sec": ("Cos", "Reciprocal"),
    "Csc": ("Sin", "Reciprocal"), "Coth": ("Tanh", "Reciprocal"), "Sech": ("Cosh", "Reciprocal"),
    "Csch": ("Sinh", "Reciprocal"), "Asec": ("Reciprocal", "Acos"), "Acsc": ("Reciprocal", "Asin"),
    "Acoth": ("Reciprocal", "Atanh"), "Asech": ("Reciprocal", "Acosh"), "Acsch": ("Reciprocal", "Asinh"),
    "LogSigmoid": ("Neg", "Softplus", "Neg"),
}
for _type, _onnx_types in CHAINS.items():
    CONVERTERS[_type] = _chain(*_onnx_types)


@converts("Square")
def _square(g, op, x):
    return g.node("Mul", [x, x])


@converts("Silu")
def _silu(g, op, x):
    return g.node("Mul", [x, g.node("Sigmoid", [x])])


@converts("Trunc")
def _trunc(g, op, x):
    negative = g.node("Less", [x, g.const(0, _numpy(op.inputs[0]))])
    return g.node("Where", [negative, g.node("Ceil", [x]), g.node("Floor", [x])])


@converts("Acot")
def _acot(g, op, x):
    return g.node("Sub", [g.const(math.pi / 2, _numpy(op.inputs[0])), g.node("Atan", [x])])


@converts("AndNot")
def _and_not(g, op, a, b):
    return g.node("And", [g.node("Not", [a]), b])


@converts("Select")
def _select(g, op, c, x):
    return g.node("Where", [c, x, g.const(0, _numpy(op.inputs[1]))])


@converts("Gelu")
def _gelu(g, op, x):
    approximate = attrs_of(op)["approximate"]
    if g.opset >= 20:
        return g.node("Gelu", [x], approximate=approximate)
    # Before opset 20: x·Φ(x), with Φ from erf or (the tanh form) from tanh.
    dtype = _numpy(op.inputs[0])
    if approximate == "tanh":
        cube = g.node("Mul", [g.node("Mul", [x, x]), x])
        inner = g.node("Add", [x, g.node("Mul", [cube, g.const(0.044715, dtype)])])
        core = g.node("Tanh", [g.node("Mul", [inner, g.const(math.sqrt(2 / math.pi), dtype)])])
    else:
        core = g.node("Erf", [g.node("Mul", [x, g.const(1 / math.sqrt(2), dtype)])])
    gate = g.node("Mul", [g.node("Add", [core, g.const(1, dtype)]), g.const(0.5, dtype)])
    return g.node("Mul", [x, gate])


@converts("Cast")
def _cast(g, op, x):
    return g.node("Cast", [x], to=onnx_dtype(op.outputs[0].dtype))


# ---- matrices and shapes ----------------------------------------------------------------------------


def _swap_last(g, x, rank):
    return g.node("Transpose", [x], perm=[*range(rank - 2), rank - 1, rank - 2])


@converts("MatMul")
def _matmul(g, op, a, b):
    attrs = attrs_of(op)
    if attrs["transpose_a"]:
        a = _swap_last(g, a, op.inputs[0].rank)
    if attrs["transpose_b"]:
        b = _swap_last(g, b, op.inputs[1].rank)
    if attrs["precision"] == "bfloat16":
        # ranvier rounds float32 operands to bfloat16 and sums in float32: so does this.
        a, b = (g.node("Cast", [g.node("Cast", [t], to=TensorProto.BFLOAT16)], to=TensorProto.FLOAT) for t in (a, b))
    return g.node("MatMul", [a, b])


@converts("Reshape", "ExpandDims", "Squeeze")
def _reshape(g, op, x, *shape):
    return g.node("Reshape", [x, g.ints(op.outputs[0].shape)])


@converts("Transpose")
def _transpose(g, op, x):
    perm = attrs_of(op)["perm"]
    return g.node("Transpose", [x], perm=perm if perm is not None else list(reversed(range(op.inputs[0].rank))))


def _constant_axis(var: Variable, rank: int) -> int:
    return int(np.asarray(var.data).reshape(-1)[0]) % rank


@converts("Concat")
def _concat(g, op, *inputs):
    return g.node("Concat", inputs[:-1], axis=_constant_axis(op.inputs[-1], op.outputs[0].rank))


@converts("Split")
def _split(g, op, x, splits, axis):
    axis = _constant_axis(op.inputs[2], op.inputs[0].rank)
    sizes = [v.shape[axis] for v in op.outputs]
    return g.node("Split", [x, g.ints(sizes)], outputs=len(sizes), axis=axis)


@converts("Slice")
def _slice(g, op, x):
    begin = attrs_of(op)["begin"]
    ends = [b + d for b, d in zip(begin, op.outputs[0].shape)]
    return g.node("Slice", [x, g.ints(begin), g.ints(ends), g.ints(range(len(begin)))])


@converts("BroadcastTo")
def _broadcast_to(g, op, x):
    return g.node("Expand", [x, g.ints(op.outputs[0].shape)])


@converts("Shape", "Size", "Rank")
def _shape_fact(g, op, x):
    value = shape_fact(op.type, op.inputs[0].shape)
    return g.node("Constant", [], value=numpy_helper.from_array(value))


# ---- reductions ---------------------------------------------------------------------------------------


def _axes(op, rank: int) -> list[int]:
    axes = attrs_of(op)["axis"]
    return list(range(rank)) if axes is None else sorted({a % rank for a in axes})


def _reduce(g, op, onnx_type: str, x: str) -> str:
    # Axes always listed: an empty list reduces nothing, as in ranvier (ONNX would reduce all).
    axes = g.ints(_axes(op, op.inputs[0].rank))
    return g.node(onnx_type, [x, axes], keepdims=int(attrs_of(op)["keepdims"]), noop_with_empty_axes=1)


def _reduction(onnx_type: str) -> Converter:
    return lambda g, op, x: _reduce(g, op, onnx_type, x)


REDUCTIONS = {"Sum": "ReduceSum", "SumSquares": "ReduceSumSquare", "Mean": "ReduceMean", "Max": "ReduceMax", "Min": "ReduceMin",
              "Product": "ReduceProd"}
for _type, _onnx_type in REDUCTIONS.items():
    CONVERTERS[_type] = _reduction(_onnx_type)


@converts("All", "Any")
def _all_any(g, op, x):
    # As the minimum or maximum of 0/1 values: not every runtime reduces bool tensors.
    as_int = g.node("Cast", [x], to=TensorProto.INT32)
    reduced = _reduce(g, op, "ReduceMin" if op.type == "All" else "ReduceMax", as_int)
    return g.node("Cast", [reduced], to=TensorProto.BOOL)


@converts("Count")
def _count(g, op, x):
    source = op.inputs[0]
    hits = x if source.dtype == "bool" else g.node("Not", [g.node("Equal", [x, g.const(0, _numpy(source))])])
    return _reduce(g, op, "ReduceSum", g.node("Cast", [hits], to=onnx_dtype(op.outputs[0].dtype)))


@converts("ArgMax", "ArgMin")
def _arg(g, op, x):
    attrs = attrs_of(op)
    axis = attrs["axis"]
    if axis is None:  # an index into the flattened input
        x, axis = g.node("Reshape", [x, g.ints([-1])]), 0
    index = g.node(op.type, [x], axis=axis, keepdims=int(attrs["keepdims"]))
    if attrs["axis"] is None:
        index = g.node("Reshape", [index, g.ints(op.outputs[0].shape)])
    return g.node("Cast", [index], to=onnx_dtype(op.outputs[0].dtype))


# ---- neural-network ops ---------------------------------------------------------------------------------


@converts("Softmax", "LogSoftmax")
def _softmax(g, op, x):
    return g.node(op.type, [x], axis=attrs_of(op)["axis"])


@converts("LayerNorm")
def _layer_norm(g, op, x, *affine):
    x_var = op.inputs[0]
    scale = affine[0] if affine else g.const(np.ones(x_var.shape[-1]), _numpy(x_var))
    return g.node("LayerNormalization", [x, scale, *affine[1:]], axis=-1, epsilon=attrs_of(op)["eps"])


@converts("RMSNorm")
def _rms_norm(g, op, x, *gamma):
    dtype = _numpy(op.inputs[0])
    mean_square = g.node("ReduceMean", [g.node("Mul", [x, x]), g.ints([-1])], keepdims=1)
    rms = g.node("Sqrt", [g.node("Add", [mean_square, g.const(attrs_of(op)["eps"], dtype)])])
    y = g.node("Div", [x, rms])
    return g.node("Mul", [y, gamma[0]]) if gamma else y


def _one_hot(g, indices: str, index_var: Variable, depth: int, dtype: int) -> str:
    """Rows of zeros with a one at each index: indices[..., None] == range(depth)."""
    column = g.node("Unsqueeze", [indices, g.ints([-1])])
    hits = g.node("Equal", [column, g.const(np.arange(depth), _numpy(index_var))])
    return g.node("Cast", [hits], to=dtype)


@converts("SoftmaxCrossEntropy")
def _cross_entropy(g, op, logits, target):
    logits_var, target_var = op.inputs
    loss_dtype = op.outputs[0].dtype
    if loss_dtype != logits_var.dtype:  # half-precision logits: computed in float32, as ranvier does
        logits = g.node("Cast", [logits], to=onnx_dtype(loss_dtype))
        if target_var.dtype == logits_var.dtype:
            target = g.node("Cast", [target], to=onnx_dtype(loss_dtype))
    dtype = dtypes.to_numpy(loss_dtype)
    classes = logits_var.shape[-1]
    probs = target
    if target_var.dtype != logits_var.dtype:
        probs = _one_hot(g, target, target_var, classes, onnx_dtype(loss_dtype))
    smoothing = attrs_of(op)["label_smoothing"]
    if smoothing:
        probs = g.node("Add", [g.node("Mul", [probs, g.const(1 - smoothing, dtype)]), g.const(smoothing / classes, dtype)])
    log_probs = g.node("LogSoftmax", [logits], axis=-1)
    total = g.node("ReduceSum", [g.node("Mul", [probs, log_probs]), g.ints([-1])], keepdims=0)
    return g.node("Neg", [total])


@converts("OneHot")
def _one_hot_op(g, op, indices):
    return _one_hot(g, indices, op.inputs[0], attrs_of(op)["depth"], onnx_dtype(op.outputs[0].dtype))


def _window_attrs(op, kernel=None) -> dict:
    attrs = attrs_of(op)
    padding = attrs["padding"]
    return {"strides": attrs["strides"] or kernel, "pads": [*padding, *padding]}


@converts("Conv2D")
def _conv(g, op, x, w):
    return g.node("Conv", [x, w], kernel_shape=op.inputs[1].shape[2:], **_window_attrs(op))


@converts("MaxPool")
def _max_pool(g, op, x):
    kernel = attrs_of(op)["ksize"]
    return g.node("MaxPool", [x], kernel_shape=kernel, **_window_attrs(op, kernel))


@converts("AvgPool")
def _avg_pool(g, op, x):
    kernel = attrs_of(op)["ksize"]
    return g.node("AveragePool", [x], kernel_shape=kernel, count_include_pad=1, **_window_attrs(op, kernel))


@converts("Pad")
def _pad(g, op, x):
    attrs = attrs_of(op)
    value = g.const(attrs["value"], _numpy(op.inputs[0]))
    return g.node("Pad", [x, g.ints([*attrs["before"], *attrs["after"]]), value], mode="constant")


@converts("StridedView")
def _strided_view(g, op, x):
    # Any affine view is a gather of the flattened input at constant positions.
    attrs = attrs_of(op)
    positions = strided_view(np.arange(op.inputs[0].size), attrs["offset"], attrs["shape"], attrs["strides"])
    return g.node("Gather", [g.node("Reshape", [x, g.ints([-1])]), g.ints(positions)], axis=0)


@converts("Gather")
def _gather(g, op, params, indices, *oov):
    if not oov:
        return g.node("Gather", [params, indices], axis=0)
    # An index outside the table reads Myelin's out-of-vocabulary row instead.
    table, index_var = op.inputs[0], op.inputs[1]
    index_dtype = _numpy(index_var)
    valid = g.node("And", [
        g.node("GreaterOrEqual", [indices, g.const(0, index_dtype)]),
        g.node("Less", [indices, g.const(table.shape[0], index_dtype)]),
    ])
    rows = g.node("Gather", [params, g.node("Where", [valid, indices, g.const(0, index_dtype)])], axis=0)
    row_axes = g.ints(range(index_var.rank, index_var.rank + table.rank - 1))
    mask = g.node("Unsqueeze", [valid, row_axes])
    return g.node("Where", [mask, rows, g.node("Reshape", [oov[0], g.ints(table.shape[1:])])])


def _top_k(g, op, x):
    values, indices = g.node("TopK", [x, g.ints([attrs_of(op)["k"]])], outputs=2, axis=-1, largest=1, sorted=1)
    return values, g.node("Cast", [indices], to=onnx_dtype(op.outputs[-1].dtype))


@converts("TopK")
def _top_k_op(g, op, x):
    return list(_top_k(g, op, x))


@converts("SoftmaxTopK")
def _softmax_top_k(g, op, x):
    probs = g.node("Softmax", [x], axis=-1)
    return [probs, *_top_k(g, op, probs)]


@converts("Rotary")
def _rotary(g, op, x, cos, sin):
    """Each pair (2i, 2i+1) turned by its position's angle, as Split, products and Concat
    over x's pairs [..., T, H, D/2, 2] (ONNX's RotaryEmbedding needs opset 23)."""
    shape = op.inputs[0].shape
    positions, pairs = op.inputs[1].shape
    even, odd = g.node("Split", [g.node("Reshape", [x, g.ints([*shape[:-1], pairs, 2])]), g.ints([1, 1])], outputs=2, axis=-1)
    c, s = (g.node("Reshape", [table, g.ints([positions, 1, pairs, 1])]) for table in (cos, sin))
    if attrs_of(op)["inverse"]:
        s = g.node("Neg", [s])
    first = g.node("Sub", [g.node("Mul", [even, c]), g.node("Mul", [odd, s])])
    second = g.node("Add", [g.node("Mul", [even, s]), g.node("Mul", [odd, c])])
    return g.node("Reshape", [g.node("Concat", [first, second], axis=-1), g.ints(shape)])


@converts("Attention")
def _attention(g, op, q, k, v, bias=None):
    """softmax(scale · q kᵀ + bias + causal mask) v, as its decomposition in
    ranvier.ops.attention: the G query heads sharing a key/value head are stacked as G·T
    rows of one matrix; [B, T, heads, hd] tensors are transposed to it and back."""
    q_var, k_var = op.inputs[0], op.inputs[1]
    attrs = attrs_of(op)
    first = attrs["heads_first"]
    batch, heads, queries, size = heads_first_shape(q_var.shape, first)
    _, kv_heads, keys, _ = heads_first_shape(k_var.shape, first)
    groups = heads // kv_heads
    dtype = _numpy(q_var)
    if not first:
        q, k, v = (g.node("Transpose", [x], perm=[0, 2, 1, 3]) for x in (q, k, v))
    stacked = g.node("Reshape", [q, g.ints([batch, kv_heads, groups * queries, size])])
    scores = g.node("MatMul", [stacked, _swap_last(g, k, 4)])
    scores = g.node("Mul", [scores, g.const(scale_of(attrs, size), dtype)])
    if attrs["causal"] or bias is not None:
        scores = g.node("Reshape", [scores, g.ints([batch, kv_heads, groups, queries, keys])])
        if bias is not None:
            grouped = grouped_bias_shape(op.inputs[3].shape, kv_heads, groups)
            scores = g.node("Add", [scores, g.node("Reshape", [bias, g.ints(grouped)])])
        if attrs["causal"]:
            hidden = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
            scores = g.node("Add", [scores, g.const(np.where(hidden, -np.inf, 0.0), dtype)])
        scores = g.node("Reshape", [scores, g.ints([batch, kv_heads, groups * queries, keys])])
    probs = g.node("Softmax", [scores], axis=-1)
    out = g.node("Reshape", [g.node("MatMul", [probs, v]), g.ints([batch, heads, queries, size])])
    out = out if first else g.node("Transpose", [out], perm=[0, 2, 1, 3])
    if len(op.outputs) == 1:
        return out
    # the statistics: each row's log-sum-exp, +inf (not ONNX's -inf) where a query sees no key
    if op.outputs[1].dtype != q_var.dtype:  # float32 statistics of half-precision scores
        scores = g.node("Cast", [scores], to=onnx_dtype(op.outputs[1].dtype))
    statistics = g.node("ReduceLogSumExp", [scores, g.ints([-1])], keepdims=0)
    unseen = g.node("IsInf", [statistics], detect_positive=0)
    statistics = g.node("Where", [unseen, g.const(np.inf, _numpy(op.outputs[1])), statistics])
    return [out, g.node("Reshape", [statistics, g.ints([batch, heads, queries])])]
