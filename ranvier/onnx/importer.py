"""ONNX models as flows: `load(path) -> Flow`.

The importer walks the graph's nodes in order and asks a table of converters, one per
ONNX operator (`converters.py`), for the ranvier ops that compute each node. Every value
is either known at load time (a numpy array: initializers, constants, shapes, and
anything computed only from them, folded with ONNX's own reference implementation) or
a flow variable. Shapes are static: a symbolic dimension (`batch`, `sequence`) is bound
to a size given at load (`dims={"batch": 1}`), so `Shape`, `Range` and
`ConstantOfShape` fold away and `Reshape` targets are constants. A trainable import
(`training.py`) makes the weights learnable variables instead of known values.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .. import dtypes
from ..errors import UnknownOpError, shape_str
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow
from ..runtime import aligned_zeros
from . import (  # noqa: F401  (each converter registers itself)
    algebra,
    attention,
    bilinear,
    blocks,
    control,
    converters,
    elementwise,
    indexing,
    losses,
    normalization,
    optimizers,
    quantize,
    recurrent,
    resize,
    rotary,
    sampling,
    spectral,
    training,
    windows,
)
from .external import load_external_data
from .inference import check_fold_sizes, check_results, infer_outputs
from .node import CONVERTERS, Node, OnnxError, Value, onnx_dtype

# Operators never folded: those whose result is not a function of their inputs' values, and
# those of sequences (lists of values, which only the converters hold).
_NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
               "SplitToSequence", "SequenceAt"}


def load(model: str | os.PathLike | bytes | onnx.ModelProto, dims: Mapping[str, int] | None = None,
         function: str = "main", constants: Mapping[str, np.ndarray] | None = None,
         trainable: bool | Collection[str] = False) -> Flow:
    """A flow with one function computing the ONNX model's graph.

    model: a file (external-data files beside it are read too), its bytes, or a ModelProto.
    dims: sizes for the graph's symbolic dimensions, e.g. {"batch": 1, "sequence": 128}.
    function: the name of the flow function (its variables are named `<function>/...`;
        the graph's inputs and outputs are also reachable by their ONNX names).
    constants: values for graph inputs, bound at load as if they were initializers: an
        input that fixes a shape (a Reshape's target, a TopK's k, pads, axes) must be
        known when the flow is built (`ValueNeeded` names the inputs a node waits for).
    trainable: True to train the model: its weights become learnable variables (reachable
        by their initializer names), and batch norm and dropout compute as in training
        (see `training.py` for which initializers are weights); or the initializer names
        to learn.
    """
    proto = read_model(model)
    flow = Flow()
    learnable = training.learnable_initializers(proto, trainable) if trainable is not False else None
    _GraphImporter(proto, flow, function, dict(dims or {}), dict(constants or {}), learnable).run()
    return flow


def read_model(model: str | os.PathLike | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """The ModelProto with its external data read (`external.py`), checked by ONNX's
    checker; a clear error for anything unreadable."""
    source = "<bytes>" if isinstance(model, bytes) else "<ModelProto>" if isinstance(model, onnx.ModelProto) else os.fspath(model)
    try:
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, bytes):
            proto = onnx.load_from_string(model)
        else:
            proto = onnx.load(os.fspath(model), load_external_data=False)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001  (protobuf's errors have no common base)
        raise _invalid(source, error) from None
    folder = None if isinstance(model, (bytes, onnx.ModelProto)) else Path(os.fspath(model)).parent
    load_external_data(proto, folder, source)
    try:
        onnx.checker.check_model(proto)
    except Exception as error:  # noqa: BLE001  (the checker raises several kinds)
        raise _invalid(source, error) from None
    return proto


def _invalid(source: str, error: Exception) -> OnnxError:
    return OnnxError(f"{source} is not a valid ONNX model: {type(error).__name__}: {str(error).strip()[:300]}")


class _GraphImporter:
    def __init__(self, model: onnx.ModelProto, flow: Flow, function: str, dims: dict[str, int],
                 constants: dict[str, np.ndarray], learnable: list[str] | None = None):
        self.model = model
        self.constants = constants
        self.graph = model.graph
        self.flow = flow
        self.b = Builder(flow, function)
        self.dims = dims
        self.opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
        self.values: dict[str, Value] = {}
        self.value_infos = {v.name: v for v in self.graph.value_info}  # types the graph declares for its values
        self.constant_vars: dict[str, Tensor] = {}
        self.training = learnable is not None  # batch norm and dropout compute as in training
        self.learnable = learnable or []
        self.origin: dict[str, str] = {}  # a flow op's name -> the ONNX node it came from
        self._seed: Tensor | None = None
        self._streams = 0

    def run(self) -> None:
        version, newest = self.opsets.get("ai.onnx", 0), onnx.defs.onnx_opset_version()
        if version > newest:  # its operators' meaning is not yet known (ONNX Runtime refuses it too)
            raise OnnxError(f"the model imports opset {version} of ONNX's operators; the onnx package installed "
                            f"({onnx.__version__}) knows them up to opset {newest}")
        if not self.graph.output:
            raise OnnxError("the model's graph has no outputs: it computes nothing")
        initializers = {t.name: _initializer(t) for t in self.graph.initializer}
        self.values.update(initializers)
        params = [self.parameter(name, initializers[name]) for name in self.learnable]
        inputs = [v for v in self.graph.input if v.name not in initializers]
        unknown = set(self.constants) - {v.name for v in inputs}
        if unknown:
            raise OnnxError(f"constants names {sorted(unknown)}, which are not inputs of the model; its inputs are "
                            f"{[v.name for v in inputs]}")
        for value_info in inputs:
            if value_info.name in self.constants:
                self.values[value_info.name] = self.constant(value_info)
            else:
                self.values[value_info.name] = self.input(value_info)
        unused = set(self.dims) - self._dim_names()
        if unused:
            raise OnnxError(f"dims names {sorted(unused)}, which the model's inputs do not use; they use {sorted(self._dim_names())}")
        for proto in self.graph.node:
            self.convert(proto)
        for value_info in self.graph.output:
            self.output(value_info)
        if self.training:
            training.check_gradients(self, params)

    def _dim_names(self) -> set[str]:
        return {d.dim_param for v in self.graph.input for d in v.type.tensor_type.shape.dim if d.dim_param}

    def input(self, value_info: onnx.ValueInfoProto) -> Tensor:
        tensor_type = value_info.type.tensor_type
        if not value_info.type.HasField("tensor_type"):
            raise OnnxError(f"graph input {value_info.name!r} is not a tensor (sequences and maps are not supported)")
        shape = []
        for index, dim in enumerate(tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif dim.dim_param in self.dims:
                shape.append(int(self.dims[dim.dim_param]))
            else:
                symbol = dim.dim_param or f"dimension {index}"
                raise OnnxError(f"graph input {value_info.name!r} has a symbolic size {symbol!r}; give it one at load: "
                                f"load(..., dims={{{symbol!r}: N}})")
        # Names that clean alike ("x/y", "x:y", "x_y") are numbered apart; each keeps its ONNX name as an alias.
        free = self.b.varname(_clean(value_info.name) or "input").removeprefix(f"{self.b.func.name}/")
        var = self.b.var(free, onnx_dtype(tensor_type.elem_type, value_info.name), shape)
        self.flow.add_alias(var.var, value_info.name)
        return var

    def constant(self, value_info: onnx.ValueInfoProto) -> np.ndarray:
        """A graph input bound at load (`load(..., constants=...)`), held to its declared type and sizes."""
        value = np.asarray(self.constants[value_info.name])
        tensor_type = value_info.type.tensor_type
        declared = onnx_dtype(tensor_type.elem_type, f"graph input {value_info.name!r}")
        dims = tensor_type.shape.dim
        fits = len(dims) == value.ndim and all(not d.HasField("dim_value") or d.dim_value == size
                                              for d, size in zip(dims, value.shape))
        if dtypes.from_numpy(value.dtype) != declared or (tensor_type.HasField("shape") and not fits):
            shape = "x".join(str(d.dim_value) if d.HasField("dim_value") else d.dim_param or "?" for d in dims)
            raise OnnxError(f"constant for graph input {value_info.name!r} is {value.dtype}[{shape_str(value.shape)}]; "
                            f"the model declares it {declared}[{shape}]")
        return value

    def inputs_feeding(self, name: str) -> set[str]:
        """The graph inputs (not bound as constants) that value `name` is computed from."""
        producers = {output: node for node in self.graph.node for output in node.output if output}
        inputs, seen, stack = set(), set(), [name]
        while stack:
            value = stack.pop()
            if value in seen:
                continue
            seen.add(value)
            if value in producers:
                stack.extend(n for n in producers[value].input if n)
            elif isinstance(self.values.get(value), Tensor) and self.values[value].producer is None:
                inputs.add(value)
        return inputs

    def output(self, value_info: onnx.ValueInfoProto) -> None:
        name = value_info.name
        value = self.values.get(name)
        if value is None:
            raise OnnxError(f"graph output {name!r} is computed by no node")
        self.check_declared(value_info, value, "graph output")
        tensor = value if isinstance(value, Tensor) and value.producer is not None else self.b.identity(self.as_tensor(value, name))
        tensor.var.out = True
        if self.flow.find_var(name) is None:
            self.flow.add_alias(tensor.var, name)

    def check_declared(self, value_info: onnx.ValueInfoProto, value: Value, what: str) -> None:
        """A value must have the element type the graph declares for it (ONNX Runtime
        refuses a model where it does not); a declared shape is a hint, as it is there."""
        kind = value_info.type.WhichOneof("value")
        if kind is None:  # declared without a type
            return
        declared = value_info.type.tensor_type.elem_type if kind == "tensor_type" else None
        if not declared:
            raise OnnxError(f"{what} {value_info.name!r} is declared a {kind} of element type {declared}, not a tensor "
                            "of a known one")
        dtype = dtypes.from_numpy(value.dtype) if isinstance(value, np.ndarray) else value.dtype
        if onnx_dtype(declared, f"{what} {value_info.name!r}") != dtype:
            raise OnnxError(f"{what} {value_info.name!r} is declared {onnx_dtype(declared, value_info.name)} but its node "
                            f"computes {dtype}")

    def convert(self, proto: onnx.NodeProto) -> None:
        domain = proto.domain if proto.domain not in ("", "ai.onnx") else ""
        key = f"{domain}:{proto.op_type}" if domain else proto.op_type
        missing = [name for name in proto.input if name and name not in self.values]
        if missing:
            raise OnnxError(f"ONNX node {proto.name!r} reads {missing[0]!r}, which no earlier node computes")
        inputs = [self.values[name] if name else None for name in proto.input]
        node = Node(proto, inputs, self)
        inferred = {} if _has_subgraph(proto) else infer_outputs(node)
        ops_before = len(self.flow.ops)
        if (not domain and proto.op_type not in _NOT_FOLDED and not _has_subgraph(proto)
                and all(v is None or isinstance(v, np.ndarray) for v in inputs)):
            check_fold_sizes(node, inferred)
            results = self.fold(node)
        else:
            converter = CONVERTERS.get(key)
            if converter is None:
                raise UnknownOpError(
                    f"ONNX operator {proto.op_type} (domain {domain or 'ai.onnx'}, opset {node.opset}) of node "
                    f"{node.name!r} is not supported by ranvier's importer"
                )
            try:
                results = converter(node)
            except UnknownOpError:  # a KeyError too, but already says what is missing
                raise
            except (ValueError, TypeError, IndexError, KeyError, OverflowError, ZeroDivisionError) as error:
                # A malformed node (attributes of the wrong kind or size, inconsistent shapes) that passed
                # ONNX's checker: report it by node rather than as a Python error from deep inside.
                raise node.error(f"could not be converted: {type(error).__name__}: {error}") from None
            node.check_all_read()
        results = results if isinstance(results, (list, tuple)) else [results]
        check_results(node, inferred, results)
        for op_name in itertools.islice(reversed(self.flow.ops), len(self.flow.ops) - ops_before):
            self.origin[op_name] = node.name
        for name, value in zip(proto.output, results):
            if name and value is not None and name in self.value_infos:
                self.check_declared(self.value_infos[name], value, "value")
            if name:
                self.values[name] = value

    def fold(self, node: Node) -> list[np.ndarray]:
        """Evaluate a node whose inputs are all known, with ONNX's reference implementation
        (or numpy's, where that one fails)."""
        from onnx.reference import ReferenceEvaluator

        if node.proto.op_type in _FOLDED_BY_NUMPY:
            return _FOLDED_BY_NUMPY[node.proto.op_type](node)
        feeds = {name: value for name, value in zip(node.proto.input, node.inputs.untracked) if name}
        # A one-node graph: ReferenceEvaluator ignores the opsets of a bare node and takes its
        # newest version (an opset-11 Unsqueeze's axes attribute then fails to fold).
        untyped = onnx.TypeProto()
        graph = onnx.helper.make_graph([node.proto], "fold", [onnx.helper.make_value_info(n, untyped) for n in feeds],
                                       [onnx.helper.make_value_info(n, untyped) for n in node.proto.output if n])
        try:
            evaluator = ReferenceEvaluator(graph, opsets={"": node.opset})
            return [np.asarray(v) for v in evaluator.run(None, feeds)]
        except Exception as error:  # noqa: BLE001  (the reference raises anything)
            raise node.error(f"could not be computed at load time: {type(error).__name__}: {error}") from None

    def as_tensor(self, value: Value, name: str) -> Tensor:
        if isinstance(value, Tensor):
            return value
        if name in self.constant_vars:
            return self.constant_vars[name]
        array = np.asarray(value, order="C")  # ascontiguousarray would make a scalar [1]
        dtypes.from_numpy(array.dtype)  # refuses what ranvier cannot hold
        tensor = self.b.array(_clean(name) or "const", array) if array.size > 16 else self.b.const(array, dtypes.from_numpy(array.dtype))
        if name:
            self.constant_vars[name] = tensor
        return tensor

    def parameter(self, name: str, value: np.ndarray) -> Tensor:
        """A learnable variable holding initializer `name`, reachable by that name. Its data
        is a writable aligned copy (the initializer may be a read-only view of the model's
        bytes), so that a network may train that array itself (`Compiler.compile(share_data=True)`)."""
        data = aligned_zeros(value.shape, value.dtype)
        data[...] = value
        tensor = self.b.parameter(_clean(name) or "weight", data)
        self.flow.add_alias(tensor.var, name)
        self.values[name] = tensor
        return tensor

    def state_variable(self, node: Node, index: int) -> Tensor:
        """Input `index` of `node`, an initializer the node updates in place (batch norm's
        running statistics), as a global variable holding it, reachable by its name."""
        name, value = node.proto.input[index], node.optional(index)
        if isinstance(value, Tensor):
            if not value.var.is_global or value.var.learnable:
                raise node.error(f"input {index} ({name!r}) must be an initializer of its own to be updated in training")
            return value
        array = np.ascontiguousarray(node.constant(index, f"input {index}"))
        var = self.flow.add_var(self.b.varname(_clean(name) or "state"), dtypes.from_numpy(array.dtype), array.shape)
        var.set_data(array)
        var.nogradient = True
        self.flow.add_alias(var, name)
        self.values[name] = tensor = self.b.wrap(var)
        return tensor

    def dropout_seed(self) -> tuple[Tensor, int]:
        """The seed every dropout of the step reads (a global the step counts up, so each
        step draws new masks) and the next dropout's stream."""
        if self._seed is None:
            var = self.flow.add_var(self.b.varname("dropout_seed"), dtypes.DT_INT32, [])
            var.set_data(np.zeros((), np.int32))
            var.nogradient = True
            self._seed = self.b.wrap(var)
            self.b.assign(self._seed, self._seed + 1)
        self._streams += 1
        return self._seed, self._streams - 1


def _gather_elements(node: Node) -> list[np.ndarray]:
    """ONNX's reference takes at most 64 rows (numpy's `choose`) and then fails."""
    data, indices = node.constant(0, "data"), node.constant(1, "indices")
    axis = int(node.attr("axis", 0)) % max(data.ndim, 1)
    return [np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis)]


_FOLDED_BY_NUMPY = {"GatherElements": _gather_elements}


def _initializer(tensor: onnx.TensorProto) -> np.ndarray:
    if any(d < 0 for d in tensor.dims):  # onnx 1.16 read a one-element tensor of dims [-2^31] as of [-1]
        raise OnnxError(f"initializer {tensor.name!r} has negative dimensions {list(tensor.dims)}")
    try:
        return numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError) as error:  # an unknown element type, data not matching its dims
        raise OnnxError(f"initializer {tensor.name!r} cannot be read: {type(error).__name__}: {error}") from None


def _has_subgraph(proto: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in proto.attribute)


def _clean(name: str) -> str:
    """An ONNX value name as a flow name: no leading slashes or runs of separators."""
    return re.sub(r"[/:]+", "_", name).strip("_")
