"""An encoder for .flow bytes straight from Myelin's layout (flow.cc), independent of the
writer under test, so that the tests' expected files cannot share the writer's mistakes."""

from __future__ import annotations

import struct

from ranvier.flow import Flow
from ranvier.flow.fileformat import parse_flow

MAGIC = b"flow"


# ---- an independent encoder, straight from the layout -----------------------------------------


def i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def s(text: str | bytes) -> bytes:
    """A string field; bytes are written as they are, and surrogate escapes as the bytes they stand for."""
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")
    return i32(len(raw)) + raw


def strs(texts) -> bytes:
    return i32(len(texts)) + b"".join(s(t) for t in texts)


def attrs(d: dict) -> bytes:
    return i32(len(d)) + b"".join(s(k) + s(v) for k, v in d.items())


def var_rec(version, name, dtype, shape, data=b"", flags=0, aliases=(), var_attrs=None) -> bytes:
    out = i32(flags) if version >= 5 else b""
    out += s(name) + strs(list(aliases)) + s(dtype) + i32(len(shape), *shape)
    if version >= 6:
        out += attrs(var_attrs or {})
    return out + u64(len(data)) + data


def op_rec(version, name, optype, inputs, outputs, op_attrs=None, flags=0) -> bytes:
    out = i32(flags) if version >= 5 else b""
    return out + s(name) + s(optype) + strs(inputs) + strs(outputs) + attrs(op_attrs or {})


def list_rec(version, name, items, flags=0) -> bytes:
    """Functions and connectors share a layout: flags, name, a list of names."""
    return (i32(flags) if version >= 5 else b"") + s(name) + strs(items)


def blob_rec(version, name, blobtype, blob_attrs, data, flags=0) -> bytes:
    out = i32(flags) if version >= 5 else b""
    return out + s(name) + s(blobtype) + attrs(blob_attrs) + u64(len(data)) + data


def header(version: int) -> bytes:
    return MAGIC + i32(version) + (i32(0) if version >= 5 else b"")


def flow_file(version, vars=(), ops=(), funcs=(), cnxs=(), blobs=()) -> bytes:
    out = header(version)
    for section in (vars, ops, funcs, cnxs):
        out += i32(len(section)) + b"".join(section)
    if version >= 4:
        out += i32(len(blobs)) + b"".join(blobs)
    return out


def load_bytes(data: bytes) -> Flow:
    return parse_flow(Flow(), data, "test.flow")
