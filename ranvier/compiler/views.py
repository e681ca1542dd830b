"""Chains of copies through views folded into one: Transposes, Gathers of one constant row
and Splits, with reshapes between them, whose results only the next op of the chain reads,
become one StridedView of the chain's first input (a Split's parts one each).

An attention layer exported from PyTorch's MultiheadAttention copies q, k and v seven
times (QKV's Transpose, a Gather of each one's rows, a head-splitting Transpose each):
folded, four (QKV's Transpose, a StridedView each); GPT-2's splits QKV, then each part's
heads: four copies, folded three. Each copy is a pass over memory and, on several cores, a
step the pool's threads meet at.

A view is an offset and, for each of its axes, that axis's parts in the chain's source,
(size, stride) in elements, outermost first: one part where the axis has a stride of its
own. A reshape may merge axes whose parts are not laid out one inside the next (no stride
reads them; numpy's reshape would copy), and a later reshape may split them apart again:
PyTorch's MultiheadAttention at batch 32 turns QKV [T, B, 3·D] into [3, T, B, D] (a copy),
takes q, k and v, and merges the batch with the heads ([T, B·H, D/H]) before its head
split's Transpose, so each head's view of QKV itself has strides again only once that merge
is split ([B, H, T, D/H]). A view that ends with such an axis is one StridedView with an axis
per part, reshaped (no copy) to the chain's result: the heads merged back into the features
after attention ([B, T, H, D/H] as [B, T, D]). A reshape no parts can take (sizes that do
not divide) starts the chain again at its input."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..flow.builder import Builder
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of, is_view, unchanging_constant
from .rewrite import splice

_Axis = tuple[tuple[int, int], ...]  # an axis's (size, stride) parts in the source, outermost first, none of size 1


@dataclass(frozen=True)
class _View:
    source: Variable
    offset: int
    axes: tuple[_Axis, ...]
    copies: int  # copying ops folded into it
    ops: tuple[Operation, ...]  # the chain's ops, first to last

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(size for size, _ in axis) for axis in self.axes)

    @property
    def strides(self) -> tuple[int, ...] | None:
        return _strides(self.axes)


def _strides(axes: tuple[_Axis, ...]) -> tuple[int, ...] | None:
    """Each axis's stride (0 for an axis of one element), or None where an axis has no
    stride of its own: its parts are not laid out one inside the next."""
    if any(len(axis) > 1 for axis in axes):
        return None
    return tuple(axis[0][1] if axis else 0 for axis in axes)


def _axes(shape: Sequence[int], strides: Sequence[int]) -> tuple[_Axis, ...]:
    """The axes of `shape` with `strides`."""
    return tuple(_merged([(size, stride)]) for size, stride in zip(shape, strides))


def _merged(parts: Sequence[tuple[int, int]]) -> _Axis:
    """Parts of size 1 dropped, each part laid out inside the one before merged into it."""
    merged: list[tuple[int, int]] = []
    for size, stride in parts:
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return tuple(merged)


def merged_parts(shape: Sequence[int], strides: Sequence[int]) -> _Axis:
    """The (size, stride) parts a view of `shape` with `strides` reads, outermost first, each
    part laid out inside the one before merged into it: ((n, 1),) for n elements in order."""
    return _merged(list(zip(shape, strides)))


def fold_view_chains(flow: Flow, func: Function, keep: set[str], runs: Callable[[Operation], bool]) -> None:
    """Replace each chain of two or more copies (see the module) by one StridedView, where
    it reads rows (`_reads_rows`) and the backend `runs` one whole; and any chain that reads
    its source in order (`_in_order`) by a reshape of it."""
    views: dict[str, _View] = {}
    for op in flow.op_order(func):  # producers first: a chain is seen from its start
        for out, view in zip(op.outputs, _folded(op, views, func) or ()):
            if _continues(out, view, func, keep):
                views[out.name] = view
                continue
            folds = (view.copies >= 2 and _reads_rows(view)) or (view.copies >= 1 and _in_order(view, out))
            if folds and len(op.outputs) == 1:
                _replace(flow, func, op, view, runs)


def _continues(x: Variable, view: _View, func: Function, keep: set[str]) -> bool:
    """Whether the chain goes on past x (x's `view`), so that x need not be made: x is read
    only by ops that continue it."""
    return _private(x, func, keep) and all(_step(reader, view) is not None for reader in x.consumers)


def _in_order(view: _View, out: Variable) -> bool:
    """Whether the view reads its whole source in its order, the copies having moved only
    axes of one element (at batch 1, PyTorch's MultiheadAttention's turns of [batch, sequence]
    to [sequence, batch] and back): a reshape of the source, no copy at all."""
    if view.offset or out.size != view.source.size or out.dtype != view.source.dtype:
        return False
    return _merged(_parts(view)) in ((), ((out.size, 1),))


def _parts(view: _View) -> list[tuple[int, int]]:
    """The view's parts, outermost first: the axes of the StridedView that reads it."""
    return [part for axis in view.axes for part in axis]


def _reads_rows(view: _View) -> bool:
    """Whether the view reads its innermost part contiguously: one that does not (Kᵀ, NCHW →
    NHWC) stays a chain, its Transpose of the innermost axis copied in tiles (TileTranspose)."""
    parts = _parts(view)
    return not parts or parts[-1][1] == 1


def _private(x: Variable, func: Function, keep: set[str]) -> bool:
    """Whether only ops that may continue a chain read `x` (QKV's three Gathers), each as its
    first input, and x is no result: then they read x's view of the chain's source instead,
    and x need not be made."""
    if not x.consumers or x.name in keep or x.out:
        return False
    return all(reader.func is func and reader.inputs[0] is x and (
        is_view(reader) or reader.type == "Transpose" or _row_of_constant(reader) is not None or split_axis(reader) is not None)
        for reader in x.consumers)


def _row_of_constant(op: Operation) -> int | None:
    """The row a Gather of one constant index (that no op writes) reads, else None."""
    data = op.inputs[1].data if op.type == "Gather" and len(op.inputs) == 2 else None
    if data is None or data.ndim != 0 or not unchanging_constant(op.inputs[1]):
        return None
    return int(data)


def split_axis(op: Operation) -> int | None:
    """The axis a Split cuts, given by a constant no op writes, else None."""
    data = op.inputs[2].data if op.type == "Split" and len(op.inputs) == 3 else None
    if data is None or not unchanging_constant(op.inputs[2]):
        return None
    return int(data.reshape(-1)[0]) % op.inputs[0].rank


def _folded(op: Operation, views: dict[str, _View], func: Function) -> list[_View] | None:
    """`op`'s results as views of its chain's source (x's view where the chain continues past
    its input x, else x's own), or None where `op` is no view copy."""
    if op.func is not func or not op.outputs or not op.inputs:
        return None
    x = op.inputs[0]
    start = views.get(x.name)
    if start is None:
        start = _View(x, 0, _axes(x.shape, _contiguous(x.shape)), 0, ())
    step = _step(op, start)
    if step is None and start.ops:  # a reshape the view cannot take: the chain starts again here
        start = _View(x, 0, _axes(x.shape, _contiguous(x.shape)), 0, ())
        step = _step(op, start)
    return step


def _step(op: Operation, view: _View) -> list[_View] | None:
    """`view` through `op`, a view for each of its results, or None where `op` is none of
    the ops a view folds."""
    out = op.outputs[0]
    copies, ops = view.copies, (*view.ops, op)
    if is_view(op) and len(op.inputs) <= 2:
        axes = _regrouped(view.axes, tuple(out.shape))
        return None if axes is None else [_View(view.source, view.offset, axes, copies, ops)]
    if op.type == "Transpose":
        perm = attrs_of(op)["perm"] or list(reversed(range(len(view.axes))))
        return [_View(view.source, view.offset, tuple(view.axes[p] for p in perm), copies + 1, ops)]
    row = _row_of_constant(op)
    if row is not None:
        if not 0 <= row < view.shape[0]:
            return None  # the Gather's own check names the index
        return [_View(view.source, view.offset + _position(view.axes[0], row), view.axes[1:], copies + 1, ops)]
    axis = split_axis(op)
    if axis is not None and len(view.axes[axis]) <= 1:  # each part a slice of the view along the axis
        stride = view.axes[axis][0][1] if view.axes[axis] else 0
        parts, first = [], 0
        for part in op.outputs:
            sliced = (*view.axes[:axis], _merged([(part.shape[axis], stride)]), *view.axes[axis + 1 :])
            parts.append(_View(view.source, view.offset + first * stride, sliced, copies + 1, ops))
            first += part.shape[axis]
        return parts
    return None


def _position(axis: _Axis, index: int) -> int:
    """Where element `index` of an axis lies from its first, in the source: its digit in each
    part (the last part's the fastest) times the part's stride."""
    offset = 0
    for size, stride in reversed(axis):
        index, digit = divmod(index, size)
        offset += digit * stride
    return offset


def _replace(flow: Flow, func: Function, last: Operation, view: _View, runs: Callable[[Operation], bool]) -> None:
    """`last`'s result read once from the chain's source (a reshape of it where the view
    reads it in order; else a StridedView with an axis per part, reshaped where an axis has
    several); the chain's other ops that nothing reads any more removed."""
    source = Builder(flow, func).wrap(view.source)
    if _in_order(view, last.outputs[0]):
        folded = source.reshape(list(view.shape))
    else:
        strides = view.strides
        parts = [(size, stride) for size, stride in zip(view.shape, strides)] if strides is not None else _parts(view)
        copied = source.strided_view(offset=view.offset, shape=[size for size, _ in parts], strides=[stride for _, stride in parts])
        if not runs(copied.var.producer):
            flow.remove_op(copied.var.producer)
            flow.remove_var(copied.var)
            return
        folded = copied if strides is not None else copied.reshape(list(view.shape))
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
    axes = _regrouped(_axes(shape, strides), new_shape)
    return None if axes is None else _strides(axes)


def _regrouped(axes: tuple[_Axis, ...], new_shape: tuple[int, ...]) -> tuple[_Axis, ...] | None:
    """The axes of `new_shape` reading the same elements in the same order as `axes`, each
    new axis the parts it spans (a part split where an axis ends inside it), or None where
    a part's size and an axis's do not divide one another."""
    if math.prod(math.prod(size for size, _ in axis) for axis in axes) == 0:
        return _axes(new_shape, _contiguous(new_shape))
    parts = list(_merged([part for axis in axes for part in axis]))
    regrouped = []
    for size in new_shape:
        taken, wanted = [], size
        while wanted > 1:
            if not parts:
                return None
            part_size, stride = parts[0]
            if part_size <= wanted:
                if wanted % part_size:
                    return None
                taken.append(parts.pop(0))
                wanted //= part_size
            else:
                if part_size % wanted:
                    return None
                taken.append((wanted, stride * (part_size // wanted)))
                parts[0] = (part_size // wanted, stride)
                wanted = 1
        regrouped.append(_merged(taken))
    return None if parts else tuple(regrouped)
