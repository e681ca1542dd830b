"""ONNX models made trainable: which initializers are weights, and the operators that
compute differently in training (batch norm, dropout).

A trainable import makes the weights learnable variables of the flow (named after the
initializers, which stay reachable by their ONNX names), keeps every other initializer a
constant, and computes as the model does in training: batch norm normalises by the
batch's own statistics and updates its running ones in place, dropout drops. Every op
between a weight and an output must have a gradient: one without is refused at load,
by the ONNX node it came from, instead of at the first step.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import numpy_helper

from .. import dtypes
from ..autodiff import ungradable_ops
from ..errors import UnknownOpError
from ..flow.builder import Tensor
from .node import Node, OnnxError

if TYPE_CHECKING:
    from .importer import _GraphImporter

# How torch.export marks a graph input's kind; the dynamo exporter keeps it on the value_info
# of each initializer it lifted from the module's parameters and buffers.
_TORCH_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"

# The inputs of these operators that hold statistics, never weights.
_STATISTICS = {"BatchNormalization": (3, 4)}


def learnable_initializers(model: onnx.ModelProto, trainable: bool | Collection[str]) -> list[str]:
    """The initializers to learn, in the model's order: those named, or for `True` those
    torch.export marked as parameters (where the exporter recorded it), else every
    floating-point initializer of more than one element, all finite, that is not a
    statistic (batch norm's running mean and variance)."""
    initializers = {t.name: t for t in model.graph.initializer}
    if not isinstance(trainable, bool):
        names = set(trainable)
        unknown = sorted(names - set(initializers))
        if unknown:
            raise OnnxError(f"trainable names {unknown[:5]}, which are not initializers of the model "
                            f"(it has {len(initializers)}, e.g. {sorted(initializers)[:5]})")
        for name in sorted(names):
            if not _floating(initializers[name]):
                raise OnnxError(f"initializer {name!r} is {onnx.TensorProto.DataType.Name(initializers[name].data_type)}; "
                                "only floating-point weights can be learned")
        return [name for name in initializers if name in names]
    kinds = {v.name: p.value for v in model.graph.value_info for p in v.metadata_props if p.key == _TORCH_KIND}
    if any(kinds.get(name) == "PARAMETER" for name in initializers):
        return [name for name in initializers if kinds.get(name) == "PARAMETER"]
    statistics = {node.input[i] for node in model.graph.node for i in _STATISTICS.get(node.op_type, ()) if i < len(node.input)}
    return [name for name, tensor in initializers.items()
            if name not in statistics and _floating(tensor) and _weight_like(numpy_helper.to_array(tensor))]


def _floating(tensor: onnx.TensorProto) -> bool:
    return tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                onnx.TensorProto.BFLOAT16)


def _weight_like(array: np.ndarray) -> bool:
    return array.size > 1 and bool(np.all(np.isfinite(array)))


def batch_norm(node: Node):
    """BatchNormalization in training mode, as torch.nn.BatchNorm computes it: normalised
    by the batch's mean and (biased) variance over every axis but the channels (one
    BatchNormTrain op, whose gradient is one op too); the running mean and variance (the
    latter from the unbiased variance) move towards them by 1 − momentum, written in
    place; outputs 1 and 2 are the new running values."""
    b, x = node.b, node.tensor(0)
    node.attr("training_mode")  # a trainable import trains, whatever the export's mode
    if x.rank < 2:
        raise node.error(f"needs an input of rank 2 or more ([N, C, ...]), not {x.rank}")
    channels = x.shape[1]
    count = x.size // channels
    if count < 2:
        raise node.error(f"needs more than one value per channel to train (input shape {x.shape}), as PyTorch does")
    y, mean, variance = b.op("BatchNormTrain", [x, node.tensor(1), node.tensor(2)], None,
                             {"eps": float(node.attr("epsilon", 1e-5))})
    momentum = float(node.attr("momentum", 0.9))
    updated = []
    for index, statistic, factor in ((3, mean, 1.0), (4, variance, count / (count - 1))):
        running = node.importer.state_variable(node, index)
        new = running * momentum + statistic * ((1.0 - momentum) * factor)
        b.assign(running, new)
        updated.append(new)
    return [y, *updated]


def dropout(node: Node):
    """Dropout in training mode: each element zeroed with probability `ratio` (ONNX's
    default 0.5), the kept ones scaled by 1 / (1 − ratio); the mask comes from the step's
    seed and the node's own stream (see `ranvier.ops.random`)."""
    x = node.tensor(0)
    node.optional(2), node.attr("seed")  # a trainable import drops whatever training_mode says, by the step's seed
    ratio = float(node.constant(1, "ratio")) if node.optional(1) is not None else 0.5
    if len(node.proto.output) > 1 and node.proto.output[1]:
        raise node.error("its mask output is not supported")
    if not 0.0 <= ratio < 1.0:
        raise node.error(f"ratio {ratio} is outside [0, 1)")
    if ratio == 0.0:
        return node.b.identity(x)
    seed, stream = node.importer.dropout_seed()
    return node.b.dropout(x, seed, ratio, stream)


def check_gradients(importer: _GraphImporter, params: list[Tensor]) -> None:
    """Refuse, by its ONNX node, an op between a weight and an output without a gradient."""
    outputs = [v for v in importer.flow.outputs(importer.b.func) if dtypes.is_float(v.dtype)]
    for op in ungradable_ops(importer.flow, importer.b.func, params, outputs):
        node = importer.origin.get(op.name, "?")
        raise UnknownOpError(f"ONNX node {node!r} became op {op.type} ({op.name}), which has no gradient: "
                             "the model cannot be trained through it")
