"""Reading safetensors files, every header field checked against the file's size before any
tensor is made, so a header that claims more data than the file holds is refused with an
error naming the file, the tensor and the field. (Files are written with the `safetensors`
package.)

The layout: an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {...}}, then
the data; offsets count from the data's start.
"""

from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np

from .errors import RanvierError, brief, parse_json

DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype("<u1"), "I8": np.dtype("<i1"), "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"), "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
}
LENGTH_BYTES = 8


def read_safetensors(blob: bytes, source: str, error: type[RanvierError] = RanvierError) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, given its bytes: read-only views of them.

    `source` names the file in errors, which are raised as `error`.
    """
    if len(blob) < LENGTH_BYTES:
        raise error(f"{source} is not a safetensors file: {len(blob)} bytes, shorter than the 8-byte header length")
    (length,) = struct.unpack_from("<Q", blob)
    if length > len(blob) - LENGTH_BYTES:
        raise error(f"{source}: the header length field says {length:,} bytes, but the file holds {len(blob):,}: "
                    "truncated or not a safetensors file")
    header = parse_json(blob[LENGTH_BYTES:LENGTH_BYTES + length], error, f"{source}: the safetensors header is not JSON")
    if not isinstance(header, dict):
        raise error(f"{source}: the safetensors header is a JSON {type(header).__name__}, not an object")
    data = memoryview(blob)[LENGTH_BYTES + length:]
    return {name: _tensor(data, info, f"{source}: tensor {name!r}", error)
            for name, info in header.items() if name != "__metadata__"}


def _naturals(value: object) -> bool:
    """A JSON list of non-negative integers (booleans are not)."""
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _tensor(data: memoryview, info: object, where: str, error: type[RanvierError]) -> np.ndarray:
    if not isinstance(info, dict):
        raise error(f"{where}: expected an object with dtype, shape and data_offsets, got {brief(info)}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise error(f"{where}: dtype {brief(dtype)} is not one of {', '.join(DTYPES)}")
    if not _naturals(shape):
        raise error(f"{where}: shape {brief(shape)} is not a list of non-negative integers")
    if not (_naturals(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1] <= len(data)):
        raise error(f"{where}: data_offsets {brief(offsets)} do not lie within the {len(data):,} bytes "
                    "of data after the header")
    begin, end = offsets
    needed = math.prod(shape) * DTYPES[dtype].itemsize
    if needed != end - begin:
        raise error(f"{where}: shape {shape} of {dtype} needs {needed:,} bytes, "
                    f"its data_offsets [{begin}, {end}] hold {end - begin:,}")
    try:
        return np.frombuffer(data[begin:end], DTYPES[dtype]).reshape(shape)
    except ValueError as problem:  # more dimensions than numpy takes, or a zero-size shape too large to index
        raise error(f"{where}: shape {shape}: {problem}") from None
