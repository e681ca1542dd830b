"""Myelin's runtime handles: a tensor seen element by element, and channels.

`instance.tensor(x)` gives a `TensorHandle`: Myelin's `name()`, `rank()`, `shape()`,
`type()`, element reads as Python numbers and element writes, and the buffer itself
through numpy (`np.asarray(handle)` is a writable view, never a copy).

A `Channel` is a resizable array of tensors of one format, the memory a recurrent
cell's reference variables point into: `instance.connect(h_in, channel, t - 1)` makes
the cell read its `h_in` from element t − 1.
"""

from __future__ import annotations

import numpy as np

from . import dtypes
from .errors import RanvierError, shape_str
from .flow.graph import Variable


class TensorHandle:
    """One tensor of an instance, a network or a channel, as Myelin's Python API shows it."""

    __array_priority__ = 1.0

    def __init__(self, var: Variable, array: np.ndarray):
        self.var = var
        self.array = array

    def name(self) -> str:
        return self.var.name

    def rank(self) -> int:
        return self.array.ndim

    def shape(self) -> list[int]:
        return list(self.array.shape)

    def type(self) -> str:
        return self.var.dtype

    def __len__(self) -> int:
        return self.array.size

    def __getitem__(self, index):
        element = self.array[index]
        return element.item() if np.ndim(element) == 0 else element

    def __setitem__(self, index, value) -> None:
        self.array[index] = value

    def __array__(self, dtype=None, copy=None):
        if copy:
            return np.array(self.array, dtype=dtype)
        return self.array if dtype is None else self.array.astype(dtype, copy=False)

    def __str__(self) -> str:
        return str(self.array)

    def __repr__(self) -> str:
        return f"<TensorHandle {self.var.name}: {self.var.typestr()}>"


class Channel:
    """A resizable array of tensors shaped like `format`, for reference variables to point into."""

    def __init__(self, format: Variable, size: int = 0):
        if not format.shape_defined():
            raise RanvierError(f"a channel of {format.name} needs a defined shape, not [{shape_str(format.shape)}]")
        self.format = format
        self.elements: list[np.ndarray] = []
        self.resize(size)

    def resize(self, size: int) -> None:
        """Grow with zeroed elements or shrink from the end; elements kept keep their values."""
        size = max(int(size), 0)
        while len(self.elements) < size:
            self.elements.append(np.zeros(self.format.shape, dtypes.to_numpy(self.format.dtype)))
        del self.elements[size:]

    def __len__(self) -> int:
        return len(self.elements)

    def __getitem__(self, index: int) -> TensorHandle:
        return TensorHandle(self.format, self.elements[self._check(index)])

    def _check(self, index: int) -> int:
        if not 0 <= index < len(self.elements):
            raise RanvierError(f"channel of {self.format.name} has no element {index} (it has {len(self.elements)})")
        return index

    def element(self, index: int) -> np.ndarray:
        return self.elements[self._check(index)]
