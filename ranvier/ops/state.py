"""State ops: Assign overwrites a variable in place (parameters, optimizer state, counters).

Assign has no outputs; it writes its second input into its first. The compiler
schedules it after every other reader of the target in the same function.
"""

from __future__ import annotations

import numpy as np

from .registry import Attr, define


def _infer_assign(ctx):
    target, value = ctx.inputs
    if target.dtype != value.dtype or tuple(target.shape) != tuple(value.shape):
        raise ctx.fail(f"a value of the target's type {target.dtype}[{'x'.join(map(str, target.shape))}]")
    return []


define(
    "Assign",
    _infer_assign,
    lambda attrs, args, outs: [np.asarray(args[1])],
    2,
    "state",
    "Assign(target, value): target = value, in place",
    written=lambda op: [0],
    method="assign",
)


def _infer_assign_slice(ctx):
    target, value, start = ctx.inputs
    axis = ctx.attrs["axis"]
    if start.dtype not in ("int32", "int64") or start.shape:
        raise ctx.fail("a scalar int32/int64 start position")
    if target.dtype != value.dtype or target.rank != value.rank or not -target.rank <= axis < target.rank:
        raise ctx.fail("a target and a value of one dtype and rank, and an axis of theirs")
    axis %= target.rank
    if any(t != v for i, (t, v) in enumerate(zip(target.shape, value.shape)) if i != axis) or value.shape[axis] > target.shape[axis]:
        raise ctx.fail(f"a value shaped like the target except along axis {axis}, where it is no longer")
    return []


def _assign_slice(attrs, args, outs):
    target, value, start = args
    axis = attrs["axis"] % target.ndim
    begin = int(start)
    if begin < 0 or begin >= target.shape[axis]:
        raise IndexError(f"start {begin} is outside [0, {target.shape[axis]})")
    count = min(value.shape[axis], target.shape[axis] - begin)  # rows past the end are dropped
    result = np.array(target)
    index = [slice(None)] * target.ndim
    index[axis] = slice(begin, begin + count)
    taken = [slice(None)] * target.ndim
    taken[axis] = slice(0, count)
    result[tuple(index)] = value[tuple(taken)]
    return [result]


define(
    "AssignSlice",
    _infer_assign_slice,
    _assign_slice,
    3,
    "state",
    "AssignSlice(target, value, start): target[start:start+n] = value along attribute axis, in place (rows past the end dropped)",
    attrs=[Attr("axis", "int", 0, "the axis the value is written along")],
    written=lambda op: [0],
    method="assign_slice",
)
