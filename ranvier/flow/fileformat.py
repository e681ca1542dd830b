"""Myelin's binary .flow format: read versions 3 to 6, write versions 4 to 6.

The files are byte-compatible with SLING's Myelin, so flows move between the two.
Every integer is a little-endian int32 unless noted; a string is an int32 byte
length followed by that many UTF-8 bytes; `[...]` parts exist only from the
version given.

    header  magic 0x776f6c66 ("flow"), version, [flags (Flow.flags), v5]
    body    #vars var*  #ops op*  #funcs func*  #cnxs cnx*  [#blobs blob*, v4]
    var     [flags, v5] name #aliases alias* dtype #dims dim* [#attrs (name value)*, v6]
            uint64 #bytes, raw row-major little-endian element bytes (0 bytes: no data)
    op      [flags, v5] name type #inputs name* #outputs name* #attrs (name value)*
    func    [flags, v5] name #ops opname*
    cnx     [flags, v5] name #vars varname*
    blob    [flags, v5] name type #attrs (name value)* uint64 #bytes bytes

Before version 5 variables have no flags field; a REF variable's dtype is written
"&" + dtype instead (the reader accepts that spelling in every version).

The reader accepts what Myelin's C++ reader (flow.cc, `Flow::Read`) accepts: every type
name of its type table ("float" and "int" as float32 and int32; "", "void", "string",
"resource", complex and quantized types as types ranvier carries but cannot compute
with), any flag bits (kept, so they are written back), repeated attributes (the last
value wins, at the first one's place), bytes after the last record (ignored), names
that are not UTF-8 (kept byte for byte) and a -1 dimension, bound to the batch size the
caller gives (`Flow.load(path, batch_size=N)`; kept as -1 without one). A constant is
raw bytes to Myelin; here it becomes an array of its variable's type, and bytes that do
not fill dtype × shape are read the way SLING's Python writer produces them (a float
as 4 float32 bytes, an int as 4 int32 bytes, an array in its own type; for a float
variable, bytes that read as nothing but subnormals and NaNs are an int's), converted,
and reported with a `FlowFileWarning`; bytes that cannot be read so are an error.

The reader treats the file as untrusted: it reads it into memory and checks every
count and length against the bytes that are left before allocating anything, so a
truncated, corrupt or foreign file raises `FlowFileError` naming the record and the
byte offset rather than crashing, hanging or exhausting memory.

The writer takes blob data in every form SLING's Python writer takes: numpy arrays and
scalars, array.array, memoryviews of any format and shape, bytes, bytearray, str
(UTF-8), a Python float (4 float32 bytes) or int (4 int32 bytes), and None (no data).
A constant is written as its variable's dtype and shape, converted by value; one of a
type ranvier cannot compute with, as its raw bytes. The byte count written is always
that of the bytes that follow.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import warnings
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import numpy as np

from .. import dtypes
from ..atomic import atomic_write
from ..errors import FlowFileError, RanvierError, shape_str
from .flags import FuncFlags, OpFlags, VarFlags

if TYPE_CHECKING:  # the graph imports this module for Flow.save and Flow.load
    from .graph import Flow, Operation, Variable

MAGIC = 0x776F6C66
READ_VERSIONS = (3, 4, 5, 6)
WRITE_VERSIONS = (4, 5, 6)

_INT32 = struct.Struct("<i")
_UINT32 = struct.Struct("<I")
_UINT64 = struct.Struct("<Q")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# Names in a file are bytes to Myelin; bytes that are not UTF-8 survive a load and a save.
_ENCODING, _ERRORS = "utf-8", "surrogateescape"

_Flags = TypeVar("_Flags", VarFlags, OpFlags, FuncFlags)

logger = logging.getLogger(__name__)


class FlowFileWarning(UserWarning):
    """A .flow file loaded, but some constant's bytes had to be reinterpreted to do so."""


# ---- constants -----------------------------------------------------------------------------

# The element types a constant's bytes may be in when they do not fill its variable, by
# the kind of the variable and the width of one stored element: SLING's Python writer
# stores a Python float as a float32 and an int as an int32 whatever the variable's
# type, and an array in the array's own type.
_STAND_INS = {
    "float": {2: np.dtype(np.float16), 4: np.dtype(np.float32), 8: np.dtype(np.float64)},
    "int": {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)},
}
# The most elements one stored number may fill: a file's few bytes must not make the
# reader allocate without bound.
_MAX_FILL = 1 << 24


def _typestr(dtype: str, shape: list[int]) -> str:
    return dtype + (f"[{shape_str(shape)}]" if shape else "")


def _infer_dim(size: int, dtype: str, shape: list[int]) -> tuple[list[int], str]:
    """The shape with its one -1 dimension taken from the data's byte count."""
    known = math.prod(d for d in shape if d != -1)
    stride = known * dtypes.itemsize(dtype)
    if shape.count(-1) != 1 or not stride or size % stride:
        raise ValueError(
            f"{size} bytes of constant data for {_typestr(dtype, shape)}, whose shape is undefined "
            "(bind -1 to a batch size when loading: Flow().load(path, batch_size=N))"
        )
    inferred = [size // stride if d == -1 else d for d in shape]
    return inferred, f"its -1 dimension is {size // stride}, from the size of its data"


def _stand_in(raw: memoryview, dtype: str, count: int) -> np.ndarray | None:
    """The values SLING's Python writer most likely stored, as little-endian numbers of
    another width: one Python number (4 bytes), or one array element per element."""
    if len(raw) == 4:
        width = 4
    elif count and len(raw) % count == 0:
        width = len(raw) // count
    else:
        return None
    kind = "float" if dtypes.is_float(dtype) else "int"
    source = _STAND_INS[kind].get(width)
    if source is None:
        return None
    values = np.frombuffer(raw, source.newbyteorder("<"))
    if kind == "float" and _ints_in_floats(values):
        values = np.frombuffer(raw, _STAND_INS["int"][width].newbyteorder("<"))
    return values


def _ints_in_floats(values: np.ndarray) -> bool:
    """Whether floats read from a Python writer's bytes are ints' bytes instead: none of
    them is a number a program writes as a float (a normal number, an infinity, the NaN
    numpy and struct write), and one is not zero. A small int, the kind a program stores,
    is a subnormal float if it is positive and a NaN if it is negative (-1 is 0xFFFFFFFF)."""
    bits = values.view(values.dtype.str.replace("f", "u"))
    quiet_nan = np.array(np.nan, values.dtype).view(bits.dtype)
    plausible = (np.abs(values) >= np.finfo(values.dtype).tiny) | (bits == quiet_nan)
    return bool(np.any(values != 0)) and not np.any(plausible)


def _constant(raw: memoryview, dtype: str, shape: list[int]) -> tuple[np.ndarray, list[int], str]:
    """A constant's own writable array from its bytes, its shape (an undefined dimension
    taken from the byte count) and a note saying how the bytes were read where they did
    not simply fill dtype × shape; ValueError where they cannot be read as the variable."""
    if dtype in dtypes.STORAGE_DTYPES:
        return np.frombuffer(raw, np.uint8).copy(), shape, ""  # kept as raw bytes: nothing computes with them
    notes = []
    if -1 in shape:
        shape, note = _infer_dim(len(raw), dtype, shape)
        notes.append(note)
    native = dtypes.to_numpy(dtype)
    count = math.prod(shape)
    if len(raw) == count * native.itemsize:
        stored = np.uint8 if dtype == dtypes.DT_BOOL else native.newbyteorder("<")  # any nonzero byte is true
        return np.frombuffer(raw, stored).astype(native).reshape(shape), shape, "; ".join(notes)
    taken = count * native.itemsize
    values = _stand_in(raw, dtype, count)
    if values is None or not count or values.size not in (1, count) or count > max(values.size, _MAX_FILL):
        raise ValueError(f"{len(raw)} bytes of constant data, but {_typestr(dtype, shape)} takes {taken}")
    with np.errstate(all="ignore"):
        converted = values.astype(native)
    # Floats may round but not overflow; integers and bools must keep their values.
    lost = (
        np.any(np.isfinite(values) & ~np.isfinite(converted.astype(np.float64)))  # float64: isfinite knows it
        if dtypes.is_float(dtype)
        else not np.array_equal(converted.astype(values.dtype), values)
    )
    if lost:
        raise ValueError(f"{len(raw)} bytes of constant data for {_typestr(dtype, shape)} read as {values.dtype} "
                         f"values that {dtype} cannot hold")
    plural = "s" if values.size > 1 else ""
    spread = ", repeated to fill it" if values.size < count else ""
    notes.append(
        f"{len(raw)} bytes of data for {_typestr(dtype, shape)}, which takes {taken}: read as {values.size} "
        f"{values.dtype} value{plural} (as SLING's Python writer stores numbers){spread} and converted to {dtype}"
    )
    filled = converted.reshape(shape) if values.size == count else np.full(shape, converted[0], native)
    return filled, shape, "; ".join(notes)


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

    def uint32(self, what: str) -> int:
        return _UINT32.unpack(self.take(4, what))[0]

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
        return str(self.take(size, what), _ENCODING, _ERRORS)

    def flags(self, kind: type[_Flags], what: str) -> _Flags:
        # Read unsigned, so that every bit, known or not, survives in the IntFlag.
        return kind(self.uint32(what))

    def attrs(self, what: str) -> dict[str, str]:
        """Attributes in file order; a repeated name takes the last value, at the first
        one's place, as Myelin's SetAttr does."""
        attrs: dict[str, str] = {}
        for _ in range(self.count(f"{what} count", 8)):
            name = self.string(f"{what} name")
            attrs[name] = self.string(f"{what} value")
        return attrs


class _Parser:
    """Builds a fresh Flow from the file's records; names are linked once all ops are read,
    because an op input may name an op (its first output) that comes later in the file."""

    def __init__(self, reader: _Reader, flow: Flow, batch_size: int | None):
        self.r = reader
        self.flow = flow
        self.batch_size = batch_size
        self.bound: list[str] = []  # variables whose -1 dimensions took the batch size
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
        # Bytes after the last record are ignored, as Myelin's reader ignores them.
        if self.bound:
            logger.info(
                "%s: bound the -1 dimensions of %d variables to batch size %d: %s",
                r.source, len(self.bound), self.batch_size, ", ".join(self.bound),
            )
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
            # Myelin defines no bits; SLING's Python writer stores its flow's flags here.
            self.flow.flags = r.int32("header flags")

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
        dtype = dtypes.ALIASES.get(dtype, dtype)
        if dtype not in dtypes.ALL_DTYPES and dtype not in dtypes.STORAGE_DTYPES:
            known = sorted({*dtypes.ALL_DTYPES, *dtypes.STORAGE_DTYPES, *dtypes.ALIASES} - {""})
            raise r.error(f"unknown dtype {dtype!r} (expected one of {', '.join(known)})", at)
        shape = []
        for _ in range(r.count("rank", 4)):
            at = r.pos
            dim = r.int32("dimension")
            if dim < -1:
                raise r.error(f"dimension {dim} is negative (only -1, undefined, is allowed)", at)
            shape.append(dim)
        if -1 in shape and self.batch_size is not None:
            shape = [self.batch_size if d == -1 else d for d in shape]  # as Myelin's reader binds it
            self.bound.append(name)
        attrs = r.attrs("variable attribute") if self.version >= 6 else {}
        at = r.pos
        size = r.uint64("data size")
        raw = r.take(size, "constant data")
        data = None
        if size:
            try:
                data, shape, note = _constant(raw, dtype, shape)
            except ValueError as error:
                raise r.error(str(error), at) from None
            if note:
                warnings.warn(FlowFileWarning(f"{r.source}: {r.record}: {note} (at byte offset {at})"), stacklevel=2)

        var = self.flow.add_var(name, dtype, shape)
        var.flags = flags
        var.attrs = attrs
        var.data = data
        for alias in aliases:
            self.flow.add_alias(var, alias)
            self.names[alias] = var
        self.names[name] = var

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
            var = self.variable_named(r.string("link"), "link", at)
            if var not in cnx.links:  # Myelin links a variable once
                cnx.add(var)

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


def parse_flow(flow: Flow, data: bytes, source: str = "<bytes>", batch_size: int | None = None) -> Flow:
    """Add the flow encoded in `data` to `flow` and return it.

    The file is parsed into a fresh Flow first and merged only when all of it is valid,
    so a bad file leaves `flow` unchanged. Names in the file resolve only against the
    file's own variables and ops; a name the file shares with `flow` is an error.
    `batch_size` replaces every -1 dimension, as Myelin's `Flow::set_batch_size` does
    (the variables bound are logged at INFO level); without it -1 stays undefined.
    """
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise FlowFileError(f"{source}: batch_size must be a positive integer, not {batch_size!r}")
    loaded = _Parser(_Reader(memoryview(data), source), type(flow)(), batch_size).parse()
    for kind in ("vars", "ops", "funcs", "cnxs", "blobs"):
        clash = getattr(flow, kind).keys() & getattr(loaded, kind).keys()
        if clash:
            raise FlowFileError(f"{source}: the flow already has {kind} named {', '.join(sorted(clash)[:5])}")
    for kind in ("vars", "ops", "funcs", "cnxs", "blobs"):
        getattr(flow, kind).update(getattr(loaded, kind))
    flow.flags |= loaded.flags
    for var in loaded.vars.values():
        for alias in var.aliases:
            flow._alias_index[alias] = var
    return flow


def read_flow(flow: Flow, path: str | os.PathLike, batch_size: int | None = None) -> Flow:
    """Read a .flow file into `flow` (see `parse_flow`); OSErrors opening it propagate."""
    with open(path, "rb") as file:
        data = file.read()
    return parse_flow(flow, data, os.fspath(path), batch_size)


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

    def flags(self, value: int, what: str) -> None:
        """Flag bits, from an int32 or an unsigned 32-bit value (how the reader gives them)."""
        if not _INT32_MIN <= value < 2**32:
            raise FlowFileError(f"cannot write {what}: {value} does not fit in 32 bits")
        self.stream.write(_UINT32.pack(value & 0xFFFFFFFF))

    def data(self, payload: bytes | np.ndarray | None) -> None:
        """A byte count and the bytes, counted from the very bytes written."""
        raw = b"" if payload is None else memoryview(payload).cast("B")
        self.stream.write(_UINT64.pack(len(raw)))
        self.stream.write(raw)

    def string(self, text: str | None, what: str) -> None:
        if text is None:
            text = ""  # as SLING's Python writer writes None
        if not isinstance(text, str):
            raise FlowFileError(f"cannot write {what}: {text!r} is a {type(text).__name__}, not a string")
        try:
            encoded = text.encode(_ENCODING, _ERRORS)
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


def _raw_bytes(data, what: str) -> bytes:
    """Data in any form SLING's Python writer takes, as the bytes it writes for it."""
    if isinstance(data, str):
        return data.encode(_ENCODING, _ERRORS)
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, float):
        return struct.pack("<f", data)
    if isinstance(data, int):
        if not _INT32_MIN <= data <= _INT32_MAX:
            raise FlowFileError(f"cannot write {what}: the int {data} does not fit in the 4 bytes Myelin stores")
        return _INT32.pack(data)
    if hasattr(data, "tobytes"):  # numpy arrays and scalars, array.array, memoryviews: all their bytes, in order
        return data.tobytes()
    raise FlowFileError(f"cannot write {what}: its data is a {type(data).__name__}, not bytes, a string, a number or an array")


def _dtype_of(var: Variable) -> str:
    try:
        return dtypes.normalize(var.dtype)
    except RanvierError:
        raise FlowFileError(f"cannot write variable {var.name}: unknown dtype {var.dtype!r}") from None


def _data_bytes(var: Variable, dtype: str) -> np.ndarray | bytes | None:
    """The constant's bytes as written. A type ranvier carries but cannot compute with
    keeps its raw bytes; any other gets its elements converted by value to its dtype, in
    little-endian order, checked against its shape (one value fills the variable), so
    that the reader gives back the same array."""
    what = f"variable {var.name}"
    if var.data is None:
        return None
    if dtype in dtypes.STORAGE_DTYPES:
        return _raw_bytes(var.data, what)
    if not var.shape_defined():
        raise FlowFileError(f"cannot write {what}: constant data needs a defined shape, not {var.typestr()}")
    native = dtypes.to_numpy(dtype)
    try:
        array = np.asarray(var.data, dtype=native)
    except (TypeError, ValueError) as error:
        raise FlowFileError(f"cannot write {what}: its data cannot be read as {dtype} ({error})") from None
    if array.size == 1:
        array = np.broadcast_to(array.reshape(()), var.shape)
    if array.size != math.prod(var.shape):
        raise FlowFileError(f"cannot write {what}: its data has {array.size} elements but its type is {var.typestr()}")
    little = np.ascontiguousarray(array, dtype=native.newbyteorder("<"))
    return little.reshape(-1).view(np.uint8)


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
    flags but drops variable attributes. A dtype alias is written as the type it names
    ("float" as "float32"), as Myelin writes it.
    """
    _check_writable(version)
    w = _Writer(stream)
    w.int32(MAGIC, "magic")
    w.int32(version, "version")
    if version >= 5:
        w.flags(flow.flags, "header flags")

    w.int32(len(flow.vars), "variable count")
    for var in flow.vars.values():
        what = f"variable {var.name!r}"
        if version >= 5:
            w.flags(int(var.flags), f"flags of {what}")
        w.string(var.name, "variable name")
        w.strings(var.aliases, f"alias of {what}")
        dtype = _dtype_of(var)
        w.string(("&" if var.ref and version < 5 else "") + dtype, f"dtype of {what}")
        w.int32(len(var.shape), f"rank of {what}")
        for dim in var.shape:
            w.int32(dim, f"dimension of {what}")
        if version >= 6:
            w.attrs(var.attrs, what)
        w.data(_data_bytes(var, dtype))

    w.int32(len(flow.ops), "op count")
    for op in flow.ops.values():
        what = f"op {op.name!r}"
        if version >= 5:
            w.flags(int(op.flags), f"flags of {what}")
        w.string(op.name, "op name")
        w.string(op.type, f"type of {what}")
        w.strings([_name_in(flow.vars, v, what) for v in op.inputs], f"input of {what}")
        w.strings([_name_in(flow.vars, v, what) for v in op.outputs], f"output of {what}")
        w.attrs(op.attrs, what)

    w.int32(len(flow.funcs), "function count")
    for func in flow.funcs.values():
        what = f"function {func.name!r}"
        if version >= 5:
            w.flags(int(func.flags), f"flags of {what}")
        w.string(func.name, "function name")
        w.strings([_name_in(flow.ops, op, what) for op in func.ops], f"op of {what}")

    w.int32(len(flow.cnxs), "connector count")
    for cnx in flow.cnxs.values():
        what = f"connector {cnx.name!r}"
        if version >= 5:
            w.flags(int(cnx.flags), f"flags of {what}")
        w.string(cnx.name, "connector name")
        w.strings([_name_in(flow.vars, v, what) for v in cnx.links], f"link of {what}")

    w.int32(len(flow.blobs), "blob count")
    for blob in flow.blobs.values():
        what = f"blob {blob.name!r}"
        if version >= 5:
            w.flags(int(blob.flags), f"flags of {what}")
        w.string(blob.name, "blob name")
        w.string(blob.type, f"type of {what}")
        w.attrs(blob.attrs, what)
        w.data(None if blob.data is None else _raw_bytes(blob.data, what))


def save_flow(flow: Flow, path: str | os.PathLike, version: int = 6) -> None:
    """Write `flow` to `path` atomically (see `ranvier.atomic`): readers see the old file or
    the whole new one, and a save that fails midway leaves `path` as it was."""
    _check_writable(version)  # before touching the filesystem
    atomic_write(path, lambda stream: write_flow(flow, stream, version))
