"""Chains of copies through views folded into one: Transposes, Gathers of one constant row
and Splits, with reshapes between them, whose results only the next op of the chain reads,
become one StridedView of the chain's first input (a Split's parts one each).

An attention layer exported from PyTorch's MultiheadAttention copies q, k and v seven
times (QKV's Transpose, a Gather of each one's rows, a head-splitting Transpose each):
folded, four (QKV's Transpose, a StridedView each); GPT-2's splits QKV, then each part's
heads: four copies, folded three. Each copy is a pass over memory and, on several cores, a
step the pool's threads meet at.

A view is (offset, shape, strides) in elements of the chain's source. A reshape of a view
keeps it a view where each group of axes it merges or splits is laid out contiguously
(numpy's no-copy reshape); where not, the chain starts again at that reshape's input."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..flow.builder import Builder
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of, is_view, unchanging_constant
from .rewrite import splice


@dataclass(frozen=True)
class _View:
    source: Variable
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    copies: int  # copying ops folded into it
    ops: tuple[Operation, ...]  # the chain's ops, first to last


def fold_view_chains(flow: Flow, func: Function, keep: set[str], runs: Callable[[Operation], bool]) -> None:
    """Replace each chain of two or more copies (see the module) by one StridedView, where
    it reads rows (`_reads_rows`) and the backend `runs` one whole; and any chain that reads
    its source in order (`_in_order`) by a reshape of it."""
    views: dict[str, _View] = {}
    for op in flow.op_order(func):  # producers first: a chain is seen from its start
        for out, view in zip(op.outputs, _folded(op, views, func, keep) or ()):
            views[out.name] = view
            ends = not (_private(out, func, keep) and all(_step(reader, view) is not None for reader in out.consumers))
            folds = (view.copies >= 2 and _reads_rows(view)) or (view.copies >= 1 and _in_order(view, out))
            if ends and folds and len(op.outputs) == 1:
                _replace(flow, func, op, view, runs)


def _in_order(view: _View, out: Variable) -> bool:
    """Whether the view reads its whole source in its order, the copies having moved only
    axes of one element (at batch 1, PyTorch's MultiheadAttention's turns of [batch, sequence]
    to [sequence, batch] and back): a reshape of the source, no copy at all."""
    if view.offset or out.size != view.source.size or out.dtype != view.source.dtype:
        return False
    return all(size == 1 or stride == wanted for size, stride, wanted in zip(view.shape, view.strides, _contiguous(view.shape)))


def _reads_rows(view: _View) -> bool:
    """Whether the view reads its innermost axis contiguously: one that does not (Kᵀ, NCHW →
    NHWC) stays a chain, its Transpose of the innermost axis copied in tiles (TileTranspose)."""
    return not view.shape or view.shape[-1] == 1 or view.strides[-1] == 1


def _private(x: Variable, func: Function, keep: set[str]) -> bool:
    """Whether one op that may continue a chain reads `x`, as its first input, and x is no
    result: then it reads x's view of the chain's source instead, and x need not be made.
    (Not several: QKV's Transpose folded into each of its three Gathers, the heads'
    reshapes after them could no longer be views, and each head's copies were two again.)"""
    if len(x.consumers) != 1 or x.name in keep or x.out:
        return False
    (reader,) = x.consumers
    return reader.func is func and reader.inputs[0] is x and (
        is_view(reader) or reader.type == "Transpose" or _row_of_constant(reader) is not None or _split_axis(reader) is not None)


def _row_of_constant(op: Operation) -> int | None:
    """The row a Gather of one constant index (that no op writes) reads, else None."""
    data = op.inputs[1].data if op.type == "Gather" and len(op.inputs) == 2 else None
    if data is None or data.ndim != 0 or not unchanging_constant(op.inputs[1]):
        return None
    return int(data)


def _split_axis(op: Operation) -> int | None:
    """The axis a Split cuts, given by a constant no op writes, else None."""
    data = op.inputs[2].data if op.type == "Split" and len(op.inputs) == 3 else None
    if data is None or not unchanging_constant(op.inputs[2]):
        return None
    return int(data.reshape(-1)[0]) % op.inputs[0].rank


def _folded(op: Operation, views: dict[str, _View], func: Function, keep: set[str]) -> list[_View] | None:
    """`op`'s results as views of its chain's source, or None where `op` is no view copy."""
    if op.func is not func or not op.outputs or not op.inputs:
        return None
    x = op.inputs[0]
    start = views.get(x.name) if _private(x, func, keep) else None
    if start is None:
        start = _View(x, 0, tuple(x.shape), _contiguous(x.shape), 0, ())
    step = _step(op, start)
    if step is None and start.ops:  # a reshape the view cannot take: the chain starts again here
        start = _View(x, 0, tuple(x.shape), _contiguous(x.shape), 0, ())
        step = _step(op, start)
    return step


def _step(op: Operation, view: _View) -> list[_View] | None:
    """`view` through `op`, a view for each of its results, or None where `op` is none of
    the ops a view folds."""
    out = op.outputs[0]
    copies, ops = view.copies, (*view.ops, op)
    if is_view(op) and len(op.inputs) <= 2:
        strides = _reshaped(view.shape, view.strides, tuple(out.shape))
        return None if strides is None else [_View(view.source, view.offset, tuple(out.shape), strides, copies, ops)]
    if op.type == "Transpose":
        perm = attrs_of(op)["perm"] or list(reversed(range(len(view.shape))))
        return [_View(view.source, view.offset, tuple(view.shape[p] for p in perm), tuple(view.strides[p] for p in perm),
                      copies + 1, ops)]
    row = _row_of_constant(op)
    if row is not None:
        if not 0 <= row < view.shape[0]:
            return None  # the Gather's own check names the index
        return [_View(view.source, view.offset + row * view.strides[0], view.shape[1:], view.strides[1:], copies + 1, ops)]
    axis = _split_axis(op)
    if axis is not None:  # each part a slice of the view along the axis
        parts, first = [], 0
        for part in op.outputs:
            parts.append(_View(view.source, view.offset + first * view.strides[axis], tuple(part.shape), view.strides, copies + 1, ops))
            first += part.shape[axis]
        return parts
    return None


def _replace(flow: Flow, func: Function, last: Operation, view: _View, runs: Callable[[Operation], bool]) -> None:
    """`last`'s result read once from the chain's source (a reshape of it where the view
    reads it in order); the chain's other ops that nothing reads any more removed."""
    source = Builder(flow, func).wrap(view.source)
    if _in_order(view, last.outputs[0]):
        folded = source.reshape(list(view.shape))
    else:
        folded = source.strided_view(offset=view.offset, shape=list(view.shape), strides=list(view.strides))
    if not runs(folded.var.producer):
        flow.remove_op(folded.var.producer)
        flow.remove_var(folded.var)
        return
    splice(flow, last, [folded])
    for op in reversed(view.ops[:-1]):
        outputs = list(op.outputs)
        if not any(var.consumers for var in outputs):
            flow.remove_op(op)
            for var in outputs:
                flow.remove_var(var)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _reshaped(shape: tuple[int, ...], strides: tuple[int, ...], new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of `new_shape` reading the same elements in the same order as (shape,
    strides), or None where no strides do (numpy's no-copy reshape)."""
    if math.prod(shape) == 0:
        return _contiguous(new_shape)
    old = [(size, stride) for size, stride in zip(shape, strides) if size != 1]
    wanted = [size for size in new_shape if size != 1]
    found: list[int] = []
    i = j = 0
    while i < len(old) and j < len(wanted):
        old_end, new_end = i + 1, j + 1
        old_size, new_size = old[i][0], wanted[j]
        while old_size != new_size:  # the smallest groups of axes of equal size
            if old_size < new_size:
                old_size *= old[old_end][0]
                old_end += 1
            else:
                new_size *= wanted[new_end]
                new_end += 1
        if any(old[a][1] != old[a + 1][1] * old[a + 1][0] for a in range(i, old_end - 1)):
            return None  # the group's axes are not laid out one inside the next
        stride, group = old[old_end - 1][1], []
        for size in reversed(wanted[j:new_end]):
            group.append(stride)
            stride *= size
        found.extend(reversed(group))
        i, j = old_end, new_end
    found_iter = iter(found)
    return tuple(0 if size == 1 else next(found_iter) for size in new_shape)
