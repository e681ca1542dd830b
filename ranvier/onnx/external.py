"""External data: tensors whose bytes lie in files beside the model, read by ranvier
itself rather than by the onnx package (which, before 1.21, follows a `location` that is
a symbolic link anywhere on the machine).

A location is a relative path inside the model's folder, through no symbolic link, to a
regular file holding `offset + length` bytes, where `length` is the tensor's size by its
element type and dimensions; anything else is refused, naming the tensor and the location.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePath

import onnx
from onnx import helper

from ..errors import shape_str
from ..limits import check_allocation
from .node import OnnxError


def load_external_data(model: onnx.ModelProto, folder: Path | None, source: str) -> None:
    """Read every tensor's external data into the tensor; `folder` is the model file's
    (None for a model given as bytes, which then may have none)."""
    for tensor in _tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        where = f"{source}: tensor {tensor.name!r}"
        if folder is None:
            raise OnnxError(f"{where} keeps its data in a file beside the model; load the model from its file")
        tensor.raw_data = _read(tensor, folder, where)
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def _read(tensor: onnx.TensorProto, folder: Path, where: str) -> bytes:
    entries = {entry.key: entry.value for entry in tensor.external_data}
    location = entries.get("location", "")
    path = _inside(folder, location, where)
    try:
        offset, length = int(entries.get("offset", 0)), entries.get("length")
        length = None if length is None else int(length)
    except ValueError:
        raise OnnxError(f"{where}: external data offset {entries.get('offset')!r} or length {entries.get('length')!r} "
                        "is not a whole number") from None
    expected = _nbytes(tensor, where)
    if length is not None and length != expected:
        raise OnnxError(f"{where}: external data length {length} is not the {expected} bytes of its "
                        f"{_type_name(tensor)}[{shape_str(tensor.dims)}]")
    check_allocation(expected, f"{where}: its external data", OnnxError)
    try:
        # Neither following a link nor waiting on a FIFO put there since the checks.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise OnnxError(f"{where}: cannot read its external data {location!r}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise OnnxError(f"{where}: its external data {location!r} is not a regular file")
        if offset < 0 or offset + expected > status.st_size:
            raise OnnxError(f"{where}: bytes {offset} to {offset + expected} of its external data {location!r} "
                            f"lie outside the file's {status.st_size}")
        file.seek(offset)
        data = file.read(expected)
    if len(data) != expected:  # the file shrank since
        raise OnnxError(f"{where}: its external data {location!r} ends before byte {offset + expected}")
    return data


def _inside(folder: Path, location: str, where: str) -> Path:
    """The file `location` names: a relative path under `folder` through no symbolic link."""
    relative = PurePath(location)
    if not location or relative.is_absolute() or ".." in relative.parts or "\0" in location:
        raise OnnxError(f"{where}: its external data location {location!r} is not a path inside the model's folder")
    path = folder
    for part in relative.parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise OnnxError(f"{where}: its external data file {location!r} does not exist beside the model") from None
        if stat.S_ISLNK(mode):
            raise OnnxError(f"{where}: its external data location {location!r} passes through a symbolic link, "
                            f"{part}; ranvier reads only files inside the model's folder")
    if not stat.S_ISREG(mode):  # a folder, a device, a FIFO (which would block the read)
        raise OnnxError(f"{where}: its external data {location!r} is not a regular file")
    return path


# Element types packed below a byte (two int4 to a byte): their data's length is not items × itemsize.
_PACKED = {getattr(onnx.TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2", "FLOAT6E2M3",
                                                        "FLOAT6E3M2") if hasattr(onnx.TensorProto, name)}


def _nbytes(tensor: onnx.TensorProto, where: str) -> int:
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 0
    unsized = tensor.data_type in _PACKED or tensor.data_type == onnx.TensorProto.STRING or itemsize == 0
    if unsized or any(d < 0 for d in tensor.dims):
        raise OnnxError(f"{where}: a {_type_name(tensor)}[{shape_str(tensor.dims)}] cannot be external data")
    return math.prod(tensor.dims) * itemsize


def _type_name(tensor: onnx.TensorProto) -> str:
    known = tensor.data_type in onnx.TensorProto.DataType.values()
    return onnx.TensorProto.DataType.Name(tensor.data_type).lower() if known else f"element type {tensor.data_type}"


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model: initializers, sparse ones' parts, and node attributes',
    in subgraphs and functions too."""
    graphs = [model.graph]
    nodes = [node for function in model.functions for node in function.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            nodes.extend(graph.node)
            continue
        for attribute in nodes.pop().attribute:
            yield from [attribute.t] if attribute.HasField("t") else ()
            yield from attribute.tensors
            for sparse in [*([attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []),
                           *attribute.sparse_tensors]:
                yield from (sparse.values, sparse.indices)
            graphs.extend([attribute.g] if attribute.HasField("g") else [])
            graphs.extend(attribute.graphs)
