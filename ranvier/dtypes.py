"""Element types: Myelin's dtype strings, their numpy types and `DT_*` constants."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import RanvierError

DT_FLOAT16 = "float16"
DT_BFLOAT16 = "bfloat16"
DT_FLOAT32 = "float32"
DT_FLOAT64 = "float64"
DT_INT8 = "int8"
DT_INT16 = "int16"
DT_INT32 = "int32"
DT_INT64 = "int64"
DT_UINT8 = "uint8"
DT_UINT16 = "uint16"
DT_UINT32 = "uint32"
DT_UINT64 = "uint64"
DT_BOOL = "bool"

DT_FLOAT = DT_FLOAT32
DT_DOUBLE = DT_FLOAT64
DT_HALF = DT_FLOAT16
DT_INT = DT_INT32
DT_RESOURCE = "resource"  # a handle on another instance: stored, never computed with

_NUMPY = {
    DT_FLOAT16: np.dtype(np.float16),
    DT_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DT_FLOAT32: np.dtype(np.float32),
    DT_FLOAT64: np.dtype(np.float64),
    DT_INT8: np.dtype(np.int8),
    DT_INT16: np.dtype(np.int16),
    DT_INT32: np.dtype(np.int32),
    DT_INT64: np.dtype(np.int64),
    DT_UINT8: np.dtype(np.uint8),
    DT_UINT16: np.dtype(np.uint16),
    DT_UINT32: np.dtype(np.uint32),
    DT_UINT64: np.dtype(np.uint64),
    DT_BOOL: np.dtype(np.bool_),
}

ALL_DTYPES: tuple[str, ...] = tuple(_NUMPY)
FLOAT_DTYPES = (DT_FLOAT16, DT_BFLOAT16, DT_FLOAT32, DT_FLOAT64)
INT_DTYPES = (DT_INT8, DT_INT16, DT_INT32, DT_INT64, DT_UINT8, DT_UINT16, DT_UINT32, DT_UINT64)
NUMERIC_DTYPES = FLOAT_DTYPES + INT_DTYPES

# Types Myelin's .flow files can name that ranvier carries but cannot compute with, with
# their element sizes from Myelin's type table (flow.cc): variables of these types load,
# save and print, and the compiler refuses any kernel that touches one.
STORAGE_DTYPES: dict[str, int] = {
    "void": 0, "string": 8, "resource": 1, "complex64": 8, "complex128": 16,
    "qint8": 1, "quint8": 1, "qint16": 2, "quint16": 2, "qint32": 4,
}
# Other spellings Myelin's type table accepts; "" is its invalid type, written back as "void".
ALIASES = {"float": DT_FLOAT32, "int": DT_INT32, "": "void"}


def to_numpy(dtype: str) -> np.dtype:
    """The numpy dtype of a ranvier dtype string."""
    try:
        return _NUMPY[dtype]
    except KeyError:
        raise RanvierError(f"unknown dtype {dtype!r}; expected one of {', '.join(ALL_DTYPES)}") from None


def from_numpy(dtype) -> str:
    """The ranvier dtype string of a numpy dtype (or anything np.dtype accepts)."""
    dt = np.dtype(dtype)
    for name, candidate in _NUMPY.items():
        if candidate == dt:
            return name
    raise RanvierError(f"numpy dtype {dt} has no ranvier equivalent; expected one of {', '.join(ALL_DTYPES)}")


def normalize(dtype) -> str:
    """Accept a dtype string (Myelin's aliases and storage-only types too), a numpy dtype
    or a numpy scalar type; return the dtype string."""
    if isinstance(dtype, str):
        dtype = ALIASES.get(dtype, dtype)
        if dtype in _NUMPY or dtype in STORAGE_DTYPES:
            return dtype
    try:
        return from_numpy(dtype)
    except TypeError:
        raise RanvierError(f"unknown dtype {dtype!r}; expected one of {', '.join(ALL_DTYPES)}") from None


def itemsize(dtype: str) -> int:
    if dtype in STORAGE_DTYPES:
        return STORAGE_DTYPES[dtype]
    return to_numpy(dtype).itemsize


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_integer(dtype: str) -> bool:
    return dtype in INT_DTYPES
