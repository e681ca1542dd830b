"""Myelin's runtime handles: a tensor as an array and element by element, and channels.

`instance[x]` gives a `TensorArray`: a writable numpy view of the tensor that also
answers Myelin's `name()`, `rank()`, `shape()` and `type()`, so numpy code and the
examples of Myelin's guide both run on it; indexing and `len()` are numpy's.

`instance.tensor(x)` gives a `TensorHandle`, the tensor as Myelin's Python API indexes
it: an int on a tensor of rank 2 or more is a flat element index (`t[4]` of a [2, 3]
tensor is element [1, 1]), an index on a scalar is ignored, elements read as Python
numbers, `len()` counts elements; `np.asarray(handle)` is a writable view, never a copy.
A handle fetches its array at each use (`instance[x]`), so that where a device holds the
value (the CUDA backend) it reads the latest compute's and its writes reach the next one.

A `Channel` is a resizable array of tensors of one format, the memory a recurrent
cell's reference variables point into: `instance.connect(h_in, channel, t - 1)` makes
the cell read its `h_in` from element t − 1.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import dtypes
from .errors import RanvierError, shape_str
from .flow.graph import Variable


class Shape(tuple):
    """A shape that reads as numpy's tuple (`a.shape == (2, 3)`) and as a call, Myelin's
    `t.shape()`, which gives a list."""

    def __call__(self) -> list[int]:
        return list(self)


class TensorArray(np.ndarray):
    """A view of one tensor of an instance or a network: a numpy array that also has
    Myelin's tensor methods.

    Views of it (slices, reshapes) are views of the same tensor; what is computed from
    it (`t + 1`, `np.exp(t)`, `t.sum()`) is a plain array or number, and a copy has no name.
    """

    _var: Variable | None = None

    @classmethod
    def of(cls, var: Variable, array: np.ndarray) -> TensorArray:
        view = array.view(cls)
        view._var = var
        return view

    def __array_finalize__(self, obj) -> None:
        self._var = getattr(obj, "_var", None) if self.base is not None else None

    def __array_wrap__(self, array, context=None, return_scalar=False):
        # A result written into the tensor (`t += 1`) stays the tensor; any other is plain.
        result = array if isinstance(array, TensorArray) else array.view(np.ndarray)
        return result[()] if return_scalar else result

    @property
    def shape(self) -> Shape:
        return Shape(np.ndarray.shape.__get__(self))

    @shape.setter
    def shape(self, value) -> None:
        np.ndarray.shape.__set__(self, value)

    def name(self) -> str:
        if self._var is None:
            raise RanvierError("this array is a copy of a tensor, not the tensor: it has no name")
        return self._var.name

    def rank(self) -> int:
        return self.ndim

    def type(self) -> str:
        return dtypes.from_numpy(self.dtype)


class TensorHandle:
    """One tensor of an instance, a network or a channel, as Myelin's Python API shows it."""

    __array_priority__ = 1.0

    def __init__(self, var: Variable, fetch: Callable[[], np.ndarray]):
        self.var = var
        self._fetch = fetch

    @property
    def array(self) -> np.ndarray:
        """The tensor's array as it is now, a plain view: the handle's own indexing is Myelin's."""
        return np.asarray(self._fetch())

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

    def _index(self, array: np.ndarray, index):
        """Myelin's index as numpy's: an int into a tensor of rank 2 or more counts
        elements in row-major order; a scalar has one element whatever the index."""
        if array.ndim == 0:
            return ()
        if array.ndim > 1 and isinstance(index, (int, np.integer)):
            if not 0 <= index < array.size:
                raise IndexError(f"element {index} of {self.var.name}, which has {array.size} elements")
            return np.unravel_index(index, array.shape)
        return index

    def __getitem__(self, index):
        array = self.array
        element = array[self._index(array, index)]
        return element.item() if np.ndim(element) == 0 else element

    def __setitem__(self, index, value) -> None:
        array = self.array
        array[self._index(array, index)] = value

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
        self._check(index)
        return TensorHandle(self.format, lambda: self.element(index))

    def _check(self, index: int) -> int:
        if not 0 <= index < len(self.elements):
            raise RanvierError(f"channel of {self.format.name} has no element {index} (it has {len(self.elements)})")
        return index

    def element(self, index: int) -> np.ndarray:
        return self.elements[self._check(index)]
