"""Myelin's binary .flow format: read versions 3 to 6, write versions 4 to 6.

The files are byte-compatible with SLING's Myelin, so flows move between the two.
Every integer is a little-endian int32 unless noted; a string is an int32 byte
length followed by that many UTF-8 bytes; `[...]` parts exist only from the
version given.

    header  magic 0x776f6c66 ("flow"), version, [flags, v5]
    body    #vars var*  #ops op*  #funcs func*  #cnxs cnx*  [#blobs blob*, v4]
    var     [flags, v5] name #aliases alias* dtype #dims dim* [#attrs (name value)*, v6]
            uint64 #bytes, raw row-major little-endian element bytes (0 bytes: no data)
    op      [flags, v5] name type #inputs name* #outputs name* #attrs (name value)*
    func    [flags, v5] name #ops opname*
    cnx     [flags, v5] name #vars varname*
    blob    [flags, v5] name type #attrs (name value)* uint64 #bytes bytes

Before version 5 variables have no flags field; a REF variable's dtype is written
"&" + dtype instead (the reader accepts that spelling in every version).

The reader treats the file as untrusted: it reads it into memory and checks every
count and length against the bytes that are left before allocating anything, so a
truncated, corrupt or foreign file raises `FlowFileError` naming the record and the
byte offset rather than crashing, hanging or exhausting memory.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import struct
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import numpy as np

from .. import dtypes
from ..atomic import atomic_write
from ..errors import FlowFileError, RanvierError
from .flags import FuncFlags, OpFlags, VarFlags

if TYPE_CHECKING:  # the graph imports this module for Flow.save and Flow.load
    from .graph import Flow, Operation, Variable

MAGIC = 0x776F6C66
READ_VERSIONS = (3, 4, 5, 6)
WRITE_VERSIONS = (4, 5, 6)

_INT32 = struct.Struct("<i")
_UINT64 = struct.Struct("<Q")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

_Flags = TypeVar("_Flags", VarFlags, OpFlags, FuncFlags)


@functools.cache
def _known_bits(flags: type[_Flags]) -> int:
    return functools.reduce(operator.or_, (member.value for member in flags), 0)


# ---- reading -------------------------------------------------------------------------------


class _Reader:
    """A bounds-checked cursor over the file's bytes that knows which record it is in,
    so that every error can say where the file went wrong."""

    def __init__(self, data: memoryview, source: str):
        self.data = data
        self.pos = 0
        self.source = source
        self.record = "header"

    def error(self, message: str, offset: int | None = None) -> FlowFileError:
        at = self.pos if offset is None else offset
        return FlowFileError(f"{self.source}: {self.record}: {message} (at byte offset {at})")

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, size: int, what: str) -> memoryview:
        if size > self.left:
            raise self.error(f"truncated file: {what} needs {size} bytes but only {self.left} are left")
        start = self.pos
        self.pos += size
        return self.data[start : self.pos]

    def int32(self, what: str) -> int:
        return _INT32.unpack(self.take(4, what))[0]

    def uint64(self, what: str) -> int:
        return _UINT64.unpack(self.take(8, what))[0]

    def count(self, what: str, min_size: int) -> int:
        """A count of items that each take at least `min_size` bytes; checking it against the
        bytes left is what keeps a corrupt count from allocating or looping for long."""
        at = self.pos
        n = self.int32(what)
        if n < 0:
            raise self.error(f"{what} is negative ({n})", at)
        if n * min_size > self.left:
            raise self.error(f"{what} {n} cannot fit in the {self.left} bytes left (truncated or corrupt file)", at)
        return n

    def string(self, what: str) -> str:
        at = self.pos
        size = self.int32(f"length of {what}")
        if size < 0:
            raise self.error(f"length of {what} is negative ({size})", at)
        raw = self.take(size, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8", at) from None

    def flags(self, kind: type[_Flags], what: str) -> _Flags:
        at = self.pos
        value = self.int32(what)
        if value & ~_known_bits(kind):
            raise self.error(f"{what} 0x{value & 0xFFFFFFFF:x} has unknown bits", at)
        return kind(value)

    def attrs(self, what: str) -> dict[str, str]:
        attrs: dict[str, str] = {}
        for _ in range(self.count(f"{what} count", 8)):
            at = self.pos
            name = self.string(f"{what} name")
            if name in attrs:
                raise self.error(f"duplicate {what} {name!r}", at)
            attrs[name] = self.string(f"{what} value")
        return attrs


class _Parser:
    """Builds a fresh Flow from the file's records; names are linked once all ops are read,
    because an op input may name an op (its first output) that comes later in the file."""

    def __init__(self, reader: _Reader, flow: Flow):
        self.r = reader
        self.flow = flow
        self.version = 0
        self.names: dict[str, Variable] = {}  # variable names and aliases
        self.first_outputs: dict[str, str] = {}  # op name -> name of its first output

    def parse(self) -> Flow:
        r = self.r
        self.header()
        v5 = 4 if self.version >= 5 else 0
        var_size = v5 + 24 + (4 if self.version >= 6 else 0)
        r.record = "variable section"
        for index in range(r.count("variable count", var_size)):
            self.variable(index)
        r.record = "op section"
        pending = [self.op(index) for index in range(r.count("op count", v5 + 20))]
        for index, op, inputs, outputs in pending:
            self.link(index, op, inputs, outputs)
        r.record = "function section"
        for index in range(r.count("function count", v5 + 8)):
            self.function(index)
        r.record = "connector section"
        for index in range(r.count("connector count", v5 + 8)):
            self.connector(index)
        if self.version >= 4:
            r.record = "blob section"
            for index in range(r.count("blob count", v5 + 20)):
                self.blob(index)
        if r.left:
            r.record = "end of file"
            raise r.error(f"{r.left} bytes of trailing data after the last record")
        return self.flow

    def header(self) -> None:
        r = self.r
        if r.left < 4:
            raise r.error(f"not a flow file: {r.left} bytes is too short for the magic number 'flow'")
        magic = r.int32("magic")
        if magic != MAGIC:
            found = bytes(r.data[:4])
            raise r.error(f"not a flow file: the magic number is {found!r}, expected b'flow'", 0)
        at = r.pos
        self.version = r.int32("version")
        if self.version not in READ_VERSIONS:
            supported = ", ".join(map(str, READ_VERSIONS))
            raise r.error(f"unsupported flow file version {self.version} (this reader reads {supported})", at)
        if self.version >= 5:
            r.int32("header flags")  # Myelin writes 0 and defines no bits.

    def variable(self, index: int) -> None:
        r = self.r
        r.record = f"variable {index}"
        flags = r.flags(VarFlags, "variable flags") if self.version >= 5 else VarFlags.NONE
        at = r.pos
        name = r.string("variable name")
        r.record = f"variable {index} ({name})"
        if name in self.names:
            owner = self.names[name].name
            clash = "duplicate variable name" if owner == name else f"{owner!r} already has the alias"
            raise r.error(f"{clash} {name!r}", at)
        aliases = []
        for _ in range(r.count("alias count", 4)):
            alias_at = r.pos
            alias = r.string("alias")
            if alias in self.names:
                raise r.error(f"alias {alias!r} already names variable {self.names[alias].name!r}", alias_at)
            aliases.append(alias)
        at = r.pos
        dtype = r.string("dtype")
        if dtype.startswith("&"):
            flags |= VarFlags.REF
            dtype = dtype[1:]
        if dtype not in dtypes.ALL_DTYPES:
            raise r.error(f"unknown dtype {dtype!r} (expected one of {', '.join(dtypes.ALL_DTYPES)})", at)
        shape = []
        for _ in range(r.count("rank", 4)):
            at = r.pos
            dim = r.int32("dimension")
            if dim < -1:
                raise r.error(f"dimension {dim} is negative (only -1, undefined, is allowed)", at)
            shape.append(dim)
        attrs = r.attrs("variable attribute") if self.version >= 6 else {}
        at = r.pos
        size = r.uint64("data size")
        raw = r.take(size, "constant data")

        var = self.flow.add_var(name, dtype, shape)
        var.flags = flags
        var.attrs = attrs
        for alias in aliases:
            self.flow.add_alias(var, alias)
            self.names[alias] = var
        self.names[name] = var
        if size:
            var.data = self.array(raw, var, at)

    def array(self, raw: memoryview, var: Variable, at: int) -> np.ndarray:
        """The constant's own, writable copy in native byte order."""
        if not var.shape_defined:
            raise self.r.error(f"{len(raw)} bytes of constant data for {var.typestr()}, whose shape is undefined", at)
        expected = var.nbytes
        if len(raw) != expected:
            raise self.r.error(f"{len(raw)} bytes of constant data, but {var.typestr()} takes {expected}", at)
        if var.dtype == dtypes.DT_BOOL:
            return np.frombuffer(raw, np.uint8).astype(np.bool_).reshape(var.shape)
        native = dtypes.to_numpy(var.dtype)
        return np.frombuffer(raw, native.newbyteorder("<")).reshape(var.shape).astype(native)

    def op(self, index: int) -> tuple[int, Operation, list[tuple[int, str]], list[tuple[int, str]]]:
        r = self.r
        r.record = f"op {index}"
        flags = r.flags(OpFlags, "op flags") if self.version >= 5 else OpFlags.NONE
        at = r.pos
        name = r.string("op name")
        r.record = f"op {index} ({name})"
        if name in self.flow.ops:
            raise r.error(f"duplicate op name {name!r}", at)
        optype = r.string("op type")
        inputs = [(r.pos, r.string("input name")) for _ in range(r.count("input count", 4))]
        outputs = [(r.pos, r.string("output name")) for _ in range(r.count("output count", 4))]
        attrs = r.attrs("op attribute")
        op = self.flow.add_op(name, optype)
        op.flags = flags
        op.attrs = attrs
        if outputs:
            self.first_outputs[name] = outputs[0][1]
        return index, op, inputs, outputs

    def resolve(self, name: str) -> Variable | None:
        """A variable by name or alias; an op's name stands for its first output, as in Myelin."""
        var = self.names.get(name)
        if var is None and name in self.first_outputs:
            var = self.names.get(self.first_outputs[name])
        return var

    def variable_named(self, name: str, what: str, at: int) -> Variable:
        var = self.resolve(name)
        if var is None:
            raise self.r.error(f"{what} {name!r} is not a variable, alias or op name in the file", at)
        return var

    def link(self, index: int, op: Operation, inputs: list[tuple[int, str]], outputs: list[tuple[int, str]]) -> None:
        self.r.record = f"op {index} ({op.name})"
        for at, name in inputs:
            op.add_input(self.variable_named(name, "input", at))
        for at, name in outputs:
            var = self.variable_named(name, "output", at)
            try:
                op.add_output(var)
            except RanvierError:
                raise self.r.error(f"output {var.name!r} is already produced by op {var.producer.name!r}", at) from None

    def function(self, index: int) -> None:
        r = self.r
        r.record = f"function {index}"
        flags = r.flags(FuncFlags, "function flags") if self.version >= 5 else FuncFlags.NONE
        at = r.pos
        name = r.string("function name")
        r.record = f"function {index} ({name})"
        if name in self.flow.funcs:
            raise r.error(f"duplicate function name {name!r}", at)
        func = self.flow.func(name)
        func.flags = flags
        for _ in range(r.count("op count", 4)):
            at = r.pos
            opname = r.string("op name")
            op = self.flow.ops.get(opname)
            if op is None:
                raise r.error(f"op {opname!r} is not in the file", at)
            if op.func is not None:
                raise r.error(f"op {opname!r} already belongs to function {op.func.name!r}", at)
            func.add(op)

    def connector(self, index: int) -> None:
        r = self.r
        r.record = f"connector {index}"
        flags = r.int32("connector flags") if self.version >= 5 else 0
        at = r.pos
        name = r.string("connector name")
        r.record = f"connector {index} ({name})"
        if name in self.flow.cnxs:
            raise r.error(f"duplicate connector name {name!r}", at)
        cnx = self.flow.cnx(name)
        cnx.flags = flags
        for _ in range(r.count("link count", 4)):
            at = r.pos
            cnx.add(self.variable_named(r.string("link"), "link", at))

    def blob(self, index: int) -> None:
        r = self.r
        r.record = f"blob {index}"
        flags = r.int32("blob flags") if self.version >= 5 else 0
        at = r.pos
        name = r.string("blob name")
        r.record = f"blob {index} ({name})"
        if name in self.flow.blobs:
            raise r.error(f"duplicate blob name {name!r}", at)
        blob = self.flow.blob(name)
        blob.flags = flags
        blob.type = r.string("blob type")
        blob.attrs = r.attrs("blob attribute")
        blob.data = bytes(r.take(r.uint64("blob size"), "blob data"))


def parse_flow(flow: Flow, data: bytes, source: str = "<bytes>") -> Flow:
    """Add the flow encoded in `data` to `flow` and return it.

    The file is parsed into a fresh Flow first and merged only when all of it is valid,
    so a bad file leaves `flow` unchanged. Names in the file resolve only against the
    file's own variables and ops; a name the file shares with `flow` is an error.
    """
    loaded = _Parser(_Reader(memoryview(data), source), type(flow)()).parse()
    for kind in ("vars", "ops", "funcs", "cnxs", "blobs"):
        clash = getattr(flow, kind).keys() & getattr(loaded, kind).keys()
        if clash:
            raise FlowFileError(f"{source}: the flow already has {kind} named {', '.join(sorted(clash)[:5])}")
    for kind in ("vars", "ops", "funcs", "cnxs", "blobs"):
        getattr(flow, kind).update(getattr(loaded, kind))
    for var in loaded.vars.values():
        for alias in var.aliases:
            flow._alias_index[alias] = var
    return flow


def read_flow(flow: Flow, path: str | os.PathLike) -> Flow:
    """Read a .flow file into `flow` (see `parse_flow`); OSErrors opening it propagate."""
    with open(path, "rb") as file:
        data = file.read()
    return parse_flow(flow, data, os.fspath(path))


# ---- writing -------------------------------------------------------------------------------


class _Writer:
    """Encodes the primitive fields, rejecting values the format cannot hold instead of
    letting struct or the UTF-8 codec fail without saying which element was at fault."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream

    def int32(self, value: int, what: str) -> None:
        if not _INT32_MIN <= value <= _INT32_MAX:
            raise FlowFileError(f"cannot write {what}: {value} does not fit in an int32")
        self.stream.write(_INT32.pack(value))

    def uint64(self, value: int) -> None:
        self.stream.write(_UINT64.pack(value))

    def string(self, text: str, what: str) -> None:
        try:
            encoded = text.encode("utf-8")
        except UnicodeEncodeError:
            raise FlowFileError(f"cannot write {what} {text!r}: it is not encodable as UTF-8") from None
        self.int32(len(encoded), f"length of {what}")
        self.stream.write(encoded)

    def strings(self, texts: list[str], what: str) -> None:
        self.int32(len(texts), f"{what} count")
        for text in texts:
            self.string(text, what)

    def attrs(self, attrs: dict[str, str], what: str) -> None:
        self.int32(len(attrs), f"{what} attribute count")
        for name, value in attrs.items():
            self.string(name, f"{what} attribute name")
            self.string(value, f"{what} attribute {name!r}")


def _data_bytes(var: Variable) -> np.ndarray | None:
    """The constant's elements as little-endian bytes, checked against its dtype and shape."""
    if var.data is None:
        return None
    if var.dtype not in dtypes.ALL_DTYPES:
        raise FlowFileError(f"cannot write variable {var.name}: unknown dtype {var.dtype!r}")
    native = dtypes.to_numpy(var.dtype)
    array = np.ascontiguousarray(var.data, dtype=native)
    if not var.shape_defined or array.size != math.prod(var.shape):
        raise FlowFileError(
            f"cannot write variable {var.name}: its data has {array.size} elements but its type is {var.typestr()}"
        )
    return array.astype(native.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)


def _name_in(flow_items: dict, item, owner: str) -> str:
    """The name to write for a referenced element; it must be the flow's own, or the file
    would hold a reference that cannot be read back."""
    if flow_items.get(item.name) is not item:
        raise FlowFileError(f"cannot write {owner}: it refers to {item.name!r}, which is not part of the flow")
    return item.name


def _check_writable(version: int) -> None:
    if version not in WRITE_VERSIONS:
        raise FlowFileError(
            f"cannot write .flow version {version}; writable versions are {', '.join(map(str, WRITE_VERSIONS))}"
        )


def write_flow(flow: Flow, stream: BinaryIO, version: int = 6) -> None:
    """Encode `flow` into a binary stream in .flow format `version` (4, 5 or 6).

    Version 4 has no flag fields and no variable attributes: those are dropped, except
    that a REF variable keeps its REF-ness as an "&" prefix on its dtype. Version 5 keeps
    flags but drops variable attributes.
    """
    _check_writable(version)
    w = _Writer(stream)
    w.int32(MAGIC, "magic")
    w.int32(version, "version")
    if version >= 5:
        w.int32(0, "header flags")

    w.int32(len(flow.vars), "variable count")
    for var in flow.vars.values():
        what = f"variable {var.name!r}"
        if version >= 5:
            w.int32(int(var.flags), f"flags of {what}")
        w.string(var.name, "variable name")
        w.strings(var.aliases, f"alias of {what}")
        w.string(("&" if var.ref and version < 5 else "") + var.dtype, f"dtype of {what}")
        w.int32(len(var.shape), f"rank of {what}")
        for dim in var.shape:
            w.int32(dim, f"dimension of {what}")
        if version >= 6:
            w.attrs(var.attrs, what)
        data = _data_bytes(var)
        w.uint64(0 if data is None else data.size)
        if data is not None:
            stream.write(data)

    w.int32(len(flow.ops), "op count")
    for op in flow.ops.values():
        what = f"op {op.name!r}"
        if version >= 5:
            w.int32(int(op.flags), f"flags of {what}")
        w.string(op.name, "op name")
        w.string(op.type, f"type of {what}")
        w.strings([_name_in(flow.vars, v, what) for v in op.inputs], f"input of {what}")
        w.strings([_name_in(flow.vars, v, what) for v in op.outputs], f"output of {what}")
        w.attrs(op.attrs, what)

    w.int32(len(flow.funcs), "function count")
    for func in flow.funcs.values():
        what = f"function {func.name!r}"
        if version >= 5:
            w.int32(int(func.flags), f"flags of {what}")
        w.string(func.name, "function name")
        w.strings([_name_in(flow.ops, op, what) for op in func.ops], f"op of {what}")

    w.int32(len(flow.cnxs), "connector count")
    for cnx in flow.cnxs.values():
        what = f"connector {cnx.name!r}"
        if version >= 5:
            w.int32(int(cnx.flags), f"flags of {what}")
        w.string(cnx.name, "connector name")
        w.strings([_name_in(flow.vars, v, what) for v in cnx.links], f"link of {what}")

    w.int32(len(flow.blobs), "blob count")
    for blob in flow.blobs.values():
        what = f"blob {blob.name!r}"
        if version >= 5:
            w.int32(int(blob.flags), f"flags of {what}")
        w.string(blob.name, "blob name")
        w.string(blob.type, f"type of {what}")
        w.attrs(blob.attrs, what)
        w.uint64(len(blob.data))
        stream.write(blob.data)


def save_flow(flow: Flow, path: str | os.PathLike, version: int = 6) -> None:
    """Write `flow` to `path` atomically (see `ranvier.atomic`): readers see the old file or
    the whole new one, and a save that fails midway leaves `path` as it was."""
    _check_writable(version)  # before touching the filesystem
    atomic_write(path, lambda stream: write_flow(flow, stream, version))
