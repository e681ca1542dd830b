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


class ValueNeeded(OnnxError):
    """A node needs a value known at load (a shape, axes, sizes, pads, k) that is computed
    from graph inputs: bound to their values (`load(..., constants=...)`), the node converts.
    `inputs` names them; `ranvier.onnx.backend` binds them to the values it is run with."""

    def __init__(self, message: str, inputs: set[str]):
        super().__init__(message)
        self.inputs = inputs


class _Inputs(list):
    """A node's input values, noting which ones a converter reads."""

    def __init__(self, values: list[Value | None]):
        super().__init__(values)
        self.read: set[int] = set()

    def __getitem__(self, index):
        self.read.update(range(len(self))[index] if isinstance(index, slice) else [range(len(self))[index]])
        return super().__getitem__(index)

    def __iter__(self):
        self.read.update(range(len(self)))
        return super().__iter__()

    @property
    def untracked(self) -> list[Value | None]:
        """The values, not counted as read (for the importer's own checks)."""
        return list.copy(self)


class _Attributes(dict):
    """A node's attribute values by name, noting which ones a converter reads."""

    def __init__(self, values: dict):
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)

    def __contains__(self, name) -> bool:
        self.read.add(name)
        return super().__contains__(name)


class Node:
    """One ONNX node as a converter sees it: its inputs' values, attributes and builder.

    A converter reads every input and attribute it honours (`tensor`, `constant`, `attr`
    and the like); after it returns, the importer refuses the node if it holds an input,
    or an attribute with other than its default value, that the converter never read
    (`check_all_read`): what a converter does not know of is refused by name, never
    computed as if absent."""

    def __init__(self, proto: onnx.NodeProto, inputs: list[Value | None], importer: _GraphImporter):
        self.proto = proto
        self.inputs = _Inputs(inputs)
        self.importer = importer
        self.b = importer.b
        self.opset = importer.opsets.get(proto.domain or "ai.onnx", 0)
        self.attrs = _Attributes({a.name: helper.get_attribute_value(a) for a in proto.attribute})

    def check_all_read(self) -> None:
        """Refuse an input or a non-default attribute the converter did not read."""
        for index, name in enumerate(self.proto.input):
            if name and index not in self.inputs.read:
                raise self.error(f"its input {index} ({self._input_name(index)}, {name!r}) is not supported")
        for name in sorted(set(self.attrs) - self.attrs.read):
            value = dict.__getitem__(self.attrs, name)
            if value != self._default(name):
                shown = value.decode() if isinstance(value, bytes) else value
                raise self.error(f"attribute {name}={shown!r} is not supported")

    def _schema(self) -> onnx.defs.OpSchema | None:
        try:
            return onnx.defs.get_schema(self.proto.op_type, self.opset, self.proto.domain or "")
        except onnx.defs.SchemaError:
            return None

    def _input_name(self, index: int) -> str:
        schema = self._schema()
        if schema is None or not schema.inputs:
            return "unnamed"
        formal = schema.inputs[min(index, len(schema.inputs) - 1)]  # a variadic last input repeats
        return formal.name

    def _default(self, name: str):
        """The attribute's default by the operator's schema; None where it has none."""
        schema = self._schema()
        attribute = schema.attributes.get(name) if schema is not None else None
        if attribute is None or not attribute.default_value.type:
            return None
        return helper.get_attribute_value(attribute.default_value)

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
            inputs = self.importer.inputs_feeding(self.proto.input[index])
            raise ValueNeeded(f"{self.label}: needs its {what} (input {index}, {self.proto.input[index]!r}) known at "
                              f"load time; it is computed from graph inputs {sorted(inputs)}: bind them with "
                              f"load(..., constants={{name: value}})", inputs)
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
