"""What a converter sees of one ONNX node, and the table of converters."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper

from .. import dtypes
from ..errors import RanvierError, shape_str
from ..flow.builder import Tensor

if TYPE_CHECKING:
    from .importer import _GraphImporter

Value = np.ndarray | Tensor  # known at load time, or computed by the flow


class OnnxError(RanvierError):
    """A model ranvier cannot read or convert; the message names the node and the operator."""


class Node:
    """One ONNX node as a converter sees it: its inputs' values, attributes and builder."""

    def __init__(self, proto: onnx.NodeProto, inputs: list[Value | None], importer: _GraphImporter):
        self.proto = proto
        self.inputs = inputs
        self.importer = importer
        self.b = importer.b
        self.opset = importer.opsets.get(proto.domain or "ai.onnx", 0)
        self.attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}

    @property
    def name(self) -> str:
        return self.proto.name or self.proto.output[0]

    def attr(self, name: str, default=None):
        value = self.attrs.get(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def tensor(self, index: int) -> Tensor:
        """Input `index` as a flow variable (a constant if it is known at load time)."""
        return self.importer.as_tensor(self.inputs[index], self.proto.input[index])

    def constant(self, index: int, what: str) -> np.ndarray:
        """Input `index`, which must be known at load time."""
        value = self.inputs[index] if index < len(self.inputs) else None
        if value is None:
            raise self.error(f"needs its {what} (input {index})")
        if not isinstance(value, np.ndarray):
            raise self.error(f"needs its {what} (input {index}, {self.proto.input[index]!r}) known at load time; "
                             "it is computed from the model's inputs")
        return value

    def ints(self, index: int, what: str) -> list[int]:
        """Input `index`, known at load, as ONNX gives shapes, axes, sizes and pads: one
        dimension of integers (a [1, 1] axes tensor is refused, as ONNX Runtime refuses it)."""
        value = self.constant(index, what)
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise self.error(f"its {what} (input {index}) is {value.dtype}[{shape_str(value.shape)}], "
                             "not a vector of integers")
        return [int(v) for v in value]

    def optional(self, index: int) -> Value | None:
        return self.inputs[index] if index < len(self.inputs) else None

    def axis(self, value, rank: int) -> int:
        """An axis ONNX counts in [-rank, rank), from 0; an error naming the node outside it
        (where `% rank` would quietly take axis 35 of a rank-3 input for axis 2)."""
        axis = int(value)
        if not -rank <= axis < rank:
            raise self.error(f"axis {axis} is outside [-{rank}, {rank}) for its rank-{rank} input")
        return axis % rank

    def shape(self, index: int) -> list[int]:
        value = self.inputs[index]
        return list(value.shape)

    @property
    def label(self) -> str:
        """How messages name the node: "ONNX node 'fc1' (Gemm, opset 17)"."""
        return f"ONNX node {self.name!r} ({self.proto.op_type}, opset {self.opset})"

    def error(self, message: str) -> OnnxError:
        return OnnxError(f"{self.label}: {message}")


Converter = Callable[[Node], list[Value] | Value]
CONVERTERS: dict[str, Converter] = {}


def converts(*op_types: str, domain: str = "") -> Callable[[Converter], Converter]:
    """Register a converter for ONNX operators (of the default domain unless named)."""

    def register(converter: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[f"{domain}:{op_type}" if domain else op_type] = converter
        return converter

    return register


def onnx_dtype(elem_type: int, what: str) -> str:
    try:
        return dtypes.from_numpy(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, RanvierError):
        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else elem_type
        raise OnnxError(f"{what} has ONNX element type {name}, which ranvier does not compute with") from None
