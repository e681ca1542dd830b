"""The elements of the graph IR: a Variable is a typed tensor (a constant when it has
data), an Operation reads variables and writes variables, a Function is the ordered set of
operations one compiled cell computes; Connectors and Blobs are carried along. The Flow
that holds them is `graph.py`'s.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import Any, Protocol, overload

import numpy as np

from .. import dtypes
from ..errors import RanvierError, shape_str
from .flags import FuncFlags, OpFlags, VarFlags


def _as_array(value, var: Variable) -> np.ndarray:
    """`value` as an array of the variable's shape: numpy arrays keep their dtype; raw
    bytes are read as the variable's dtype, other buffers and numbers converted to it. A
    type ranvier only stores (string, resource, ...) keeps raw bytes; text is UTF-8."""
    if var.dtype in dtypes.STORAGE_DTYPES:
        raw = value.encode() if isinstance(value, str) else memoryview(np.ascontiguousarray(value)).tobytes()
        return np.frombuffer(raw, np.uint8).copy()
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (bytes, bytearray)) or (isinstance(value, memoryview) and value.format in ("B", "b", "c")):
        raw = memoryview(value).tobytes()  # C order; cast("B") refuses strided and empty views
        itemsize = dtypes.itemsize(var.dtype)
        if len(raw) % itemsize:
            raise RanvierError(f"{len(raw)} bytes of data for variable {var.name} of type {var.typestr()} is not a whole number of elements")
        array = np.frombuffer(raw, dtype=dtypes.to_numpy(var.dtype))
    else:
        array = np.asarray(value, dtype=dtypes.to_numpy(var.dtype))
    array = np.require(array, requirements="C")
    if var.shape_defined() and list(array.shape) != var.shape and array.size == math.prod(var.shape):
        array = array.reshape(var.shape)
    return array


def _variable(x) -> Variable:
    """The variable itself, or the one behind a builder's handle (Myelin programs pass
    what the builder returned wherever a variable goes)."""
    return getattr(x, "var", x)


def _with_flag(flags, flag, on: bool):
    """`flags` with `flag` set or cleared, keeping bits the flag type does not name (a
    .flow file may carry them; an IntFlag's ~ covers only the named bits)."""
    value = int(flags) | int(flag) if on else int(flags) & ~int(flag)
    return type(flag)(value)


class _Flagged(Protocol):
    flags: Any


class _Flag:
    """A bool attribute that reads and sets one bit of its owner's `flags` (Myelin's flag
    accessors: `var.out = True`, `func.training`)."""

    def __init__(self, flag: enum.IntFlag):
        self.flag = flag

    @overload
    def __get__(self, owner: None, owner_type: type) -> _Flag: ...

    @overload
    def __get__(self, owner: _Flagged, owner_type: type | None = None) -> bool: ...

    def __get__(self, owner: _Flagged | None, owner_type: type | None = None) -> bool | _Flag:
        return self if owner is None else bool(owner.flags & self.flag)

    def __set__(self, owner: _Flagged, on: bool) -> None:
        owner.flags = _with_flag(owner.flags, self.flag, on)


class Rank(int):
    """A rank that reads as a number (ranvier: `x.rank`) and as a call (Myelin: `x.rank()`)."""

    def __call__(self) -> int:
        return int(self)


class Variable:
    """A tensor in the flow: an input, an intermediate, an output, a constant or a parameter."""

    def __init__(self, name: str, dtype: str = dtypes.DT_FLOAT, shape: Iterable[int] = ()):
        self.name = name
        self.aliases: list[str] = []
        self.dtype = dtypes.normalize(dtype)
        self.shape: list[int] = [int(d) for d in shape]
        self.flags = VarFlags.NONE
        self.attrs: dict[str, str] = {}
        self.data: np.ndarray | None = None
        self.producer: Operation | None = None
        self.consumers: list[Operation] = []

    in_ = _Flag(VarFlags.IN)
    out = _Flag(VarFlags.OUT)
    ref = _Flag(VarFlags.REF)
    learnable = _Flag(VarFlags.LEARNABLE)
    unique = _Flag(VarFlags.UNIQUE)
    dynamic = _Flag(VarFlags.DYNAMIC)
    nogradient = _Flag(VarFlags.NOGRADIENT)
    # Myelin's Python API spells the IN and OUT flags `input` and `output`.
    input = in_
    output = out

    @property
    def type(self) -> str:
        """The dtype, under Myelin's name for it; settable."""
        return self.dtype

    @type.setter
    def type(self, dtype: str) -> None:
        self.dtype = dtypes.normalize(dtype)

    @property
    def data(self) -> np.ndarray | None:
        """The constant's (or parameter's initial) value, or None."""
        return self._data

    @data.setter
    def data(self, value) -> None:
        # Myelin programs assign numpy arrays, array.array, memoryviews and raw bytes;
        # every reader here (compiler, runtime, file writer) gets a numpy array.
        self._data = None if value is None else _as_array(value, self)

    @property
    def constant(self) -> bool:
        return self.data is not None and not self.learnable

    @property
    def is_global(self) -> bool:
        """Globals live in the Network and are shared by every cell: constants and parameters."""
        return self.data is not None or self.learnable

    @property
    def rank(self) -> Rank:
        return Rank(len(self.shape))

    def elements(self) -> int:
        """Number of elements (Myelin's name for `size`)."""
        return self.size

    @property
    def size(self) -> int:
        """Number of elements (the shape must be fully defined)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * dtypes.itemsize(self.dtype)

    def shape_defined(self) -> bool:
        return all(d >= 0 for d in self.shape)

    def set_data(self, value) -> None:
        """Attach constant data; it must match the variable's dtype and shape."""
        array = np.ascontiguousarray(value, dtype=dtypes.to_numpy(self.dtype))
        if list(array.shape) != self.shape:
            if array.size != self.size:
                raise RanvierError(
                    f"data for variable {self.name} has shape {list(array.shape)}, expected {self.shape}"
                )
            array = array.reshape(self.shape)
        self.data = array

    def attr(self, name: str, default: str | None = None) -> str | None:
        return self.attrs.get(name, default)

    def set_attr(self, name: str, value) -> None:
        self.attrs[name] = attr_string(value)

    add_attr = set_attr

    def typestr(self) -> str:
        t = ("&" if self.ref else "") + self.dtype
        return t + (f"[{shape_str(self.shape)}]" if self.shape else "")

    def __repr__(self) -> str:
        return f"<Variable {self.name}: {self.typestr()}>"


class Operation:
    """One op of a function: a type (Myelin's op names), inputs, outputs and string attributes."""

    def __init__(self, name: str, type: str = ""):
        self.name = name
        self.type = type
        self.inputs: list[Variable] = []
        self.outputs: list[Variable] = []
        self.attrs: dict[str, str] = {}
        self.flags = OpFlags.NONE
        self.func: Function | None = None

    def add_input(self, var: Variable) -> None:
        var = _variable(var)
        self.inputs.append(var)
        var.consumers.append(self)

    def add_output(self, var: Variable) -> None:
        var = _variable(var)
        if var.producer is not None and var.producer is not self:
            raise RanvierError(f"variable {var.name} is already produced by {var.producer.name}; {self.name} cannot write it")
        self.outputs.append(var)
        var.producer = self

    def replace_input(self, old: Variable, new: Variable) -> None:
        for i, v in enumerate(self.inputs):
            if v is old:
                self.inputs[i] = new
                old.consumers.remove(self)
                new.consumers.append(self)

    def attr(self, name: str, default: str | None = None) -> str | None:
        return self.attrs.get(name, default)

    def set_attr(self, name: str, value) -> None:
        self.attrs[name] = attr_string(value)

    add_attr = set_attr

    nogradient = _Flag(OpFlags.NOGRADIENT)

    def __repr__(self) -> str:
        ins = ", ".join(v.name for v in self.inputs)
        outs = ", ".join(v.name for v in self.outputs)
        return f"<Operation {self.name}: {outs} = {self.type}({ins})>"


class Function:
    """A named, ordered set of operations; each function compiles into one cell."""

    def __init__(self, name: str):
        self.name = name
        self.ops: list[Operation] = []
        self.flags = FuncFlags.NONE
        # The variable bound to the instance of another function this one reads values
        # of (Myelin's Reference input); None: `<name>/primal` when it reads any.
        self.primal_link: str | None = None

    def add(self, op: Operation) -> None:
        self.ops.append(op)
        op.func = self

    training = _Flag(FuncFlags.TRAINING)
    backprop = _Flag(FuncFlags.BACKPROP)

    def __str__(self) -> str:
        lines = [f"func {self.name} {{"]
        for op in self.ops:
            outs = ", ".join(v.name for v in op.outputs)
            ins = ", ".join(v.name for v in op.inputs)
            attrs = "".join(f" {k}={v}" for k, v in op.attrs.items())
            lines.append(f"  {outs} = {op.type}({ins}){attrs}")
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Function {self.name}: {len(self.ops)} ops>"


class Connector:
    """Links variables of different cells that share storage (Myelin's channels)."""

    def __init__(self, name: str):
        self.name = name
        self.links: list[Variable] = []
        self.flags = 0

    def add(self, var: Variable) -> None:
        self.links.append(_variable(var))


class Blob:
    """Extra data stored with the flow: lexicons, tokenizers, configuration."""

    def __init__(self, name: str, type: str = "", data: bytes = b""):
        self.name = name
        self.type = type
        self.attrs: dict[str, str] = {}
        self.data = bytes(data)
        self.flags = 0

    def set_attr(self, name: str, value) -> None:
        self.attrs[name] = attr_string(value)

    add_attr = set_attr

    def get_attr(self, name: str, default: str | None = None) -> str | None:
        return self.attrs.get(name, default)


def attr_string(value) -> str:
    """Attributes are strings, as in Myelin; lists are comma separated and booleans are 1/0."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(attr_string(v) for v in value)
    return str(value)
