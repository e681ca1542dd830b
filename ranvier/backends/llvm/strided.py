"""Strided views: how a loop over an iteration shape reaches each operand's elements.

An operand is a `View`: a variable plus an element offset and one stride per iteration
dimension (0 where it broadcasts). Transposes, slices, concatenation and broadcasting are
all views, so one loop engine per backend serves them (the CPU's vector loops, the GPU's
one thread per element). Adjacent dimensions every view walks as one are merged first
(`collapse`): fewer loops on the CPU, fewer divisions per thread on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...flow.graph import Variable
from ...ops import attrs_of
from .values import Value


@dataclass
class View:
    var: Variable
    offset: int
    strides: list[int]


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def broadcast_view(var: Variable, shape: Sequence[int]) -> View:
    """`var` read as if broadcast to `shape` (numpy rules)."""
    own = contiguous_strides(var.shape)
    lead = len(shape) - len(var.shape)
    strides = [0] * lead + [0 if d == 1 and shape[lead + i] != 1 else own[i] for i, d in enumerate(var.shape)]
    return View(var, 0, strides)


def dense_view(var: Variable) -> View:
    return View(var, 0, contiguous_strides(var.shape))


def collapse(shape: list, views: list[View]) -> tuple[list, list[list[int]]]:
    """Merge dimension i into i+1 where every view steps through both as one dimension (a
    dimension known only at run time, a Value, is never taken for 1)."""
    dims = list(shape)
    strides = [list(v.strides) for v in views]
    keep = [i for i, d in enumerate(dims) if not (isinstance(d, int) and d == 1)]
    dims = [dims[i] for i in keep] or [1]
    strides = [[s[i] for i in keep] or [0] for s in strides]
    merged_dims = [dims[-1]]
    merged = [[s[-1]] for s in strides]
    for i in range(len(dims) - 2, -1, -1):
        if all(s[i] == m[0] * merged_dims[0] for s, m in zip(strides, merged)):
            merged_dims[0] *= dims[i]
            continue
        merged_dims.insert(0, dims[i])
        for s, m in zip(strides, merged):
            m.insert(0, s[i])
    return merged_dims, merged


Body = Callable[[list[Value], int], list[Value]]


def attribute_view(op, var: Variable) -> View:
    """`var` through the view an op's attributes give (StridedView's source, StridedScatterAdd's target)."""
    attrs = attrs_of(op)
    return View(var, attrs["offset"], attrs["strides"])


def _transposed(op) -> View:
    x = op.inputs[0]
    perm = attrs_of(op)["perm"] or list(reversed(range(x.rank)))
    own = contiguous_strides(x.shape)
    return View(x, 0, [own[p] for p in perm])


def _sliced(op) -> View:
    x = op.inputs[0]
    own = contiguous_strides(x.shape)
    return View(x, sum(b * s for b, s in zip(attrs_of(op)["begin"], own)), own)


# Copies: the input each op's output reads, as a view over the output's shape.
SOURCE_VIEWS: dict[str, Callable[..., View]] = {
    "BroadcastTo": lambda op: broadcast_view(op.inputs[0], op.outputs[0].shape),
    "Transpose": _transposed,
    "Slice": _sliced,
    "StridedView": lambda op: attribute_view(op, op.inputs[0]),
}


def part_views(op) -> list[tuple[Variable, View]]:
    """Each part of a Concat (its inputs) or Split (its outputs), with the view of the whole
    that is its place along the axis."""
    concat = op.type == "Concat"
    whole = op.outputs[0] if concat else op.inputs[0]
    axis_var = op.inputs[-1] if concat else op.inputs[2]
    axis = int(np.asarray(axis_var.data).reshape(-1)[0]) % whole.rank
    strides = contiguous_strides(whole.shape)
    places, position = [], 0
    for part in op.inputs[:-1] if concat else op.outputs:
        places.append((part, View(whole, position * strides[axis], strides)))
        position += part.shape[axis]
    return places
