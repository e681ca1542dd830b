"""Mixture-of-experts routing for every LLVM backend: MoERoute's counting sort of the
expert choices, and how a grouped product finds and checks its run-time groups of rows.

The sort is one pass after another over all the choices (count, offsets, place), so it is
written once, as `route(ctx, op)`: the CPU runs it as a step, a GPU as one thread.
"""

from __future__ import annotations

from ... import dtypes
from ...ops import attrs_of
from .context import EmitContext
from .loops import fill
from .values import Value


def route(ctx: EmitContext, op) -> None:
    """A counting sort of the choices by expert: count, room (capacity), offsets, then
    place each choice at its expert's next free row, in token order. A choice naming no
    expert fails the step (the runtime raises) and is left out."""
    (choices,) = op.inputs
    order, slot, offsets, kept, counts = op.outputs
    attrs = attrs_of(op)
    experts, capacity = attrs["experts"], attrs["capacity"]
    tokens, k = choices.shape
    filled = ctx.array(dtypes.DT_INT64, experts)
    fill(ctx, counts, 0)
    fill(ctx, order, 0)  # rows past the last group stay a valid token (0)
    with ctx.loop(0, tokens * k, name="c") as c:
        expert = ctx.load(choices, c).cast(dtypes.DT_INT64)
        bad = (expert < 0) | (expert >= experts)
        ctx.fail(bad)
        with ctx.when(~bad):
            ctx.store(counts, expert, ctx.load(counts, expert) + 1)

    def room(e: Value) -> Value:
        count = ctx.load(counts, e).cast(dtypes.DT_INT64)
        return count.minimum(capacity) if capacity else count

    ctx.store(offsets, 0, 0)
    with ctx.loop(0, experts, name="e") as e:
        ctx.store(offsets, e + 1, ctx.load(offsets, e) + room(e).cast(dtypes.DT_INT32))
        filled.store(e, ctx.index(0))
    with ctx.loop(0, tokens * k, name="c") as c:
        expert = ctx.load(choices, c).cast(dtypes.DT_INT64)
        inside = (expert >= 0) & (expert < experts)
        safe = inside.where(expert, 0)
        taken = filled.load(safe)
        fits = inside & (taken < room(safe))
        row = ctx.load(offsets, safe).cast(dtypes.DT_INT64) + taken
        with ctx.when(fits):
            ctx.store(order, row, (c // k).cast(order.dtype))
            filled.store(safe, taken + 1)
        ctx.store(slot, c, fits.where(row, 0).cast(slot.dtype))
        ctx.store(kept, c, fits)


def group_bounds(ctx: EmitContext, offsets, e: Value, rows: int) -> tuple[Value, Value, Value]:
    """(start, stop, good) of expert e's group of rows; offsets that do not rise from 0
    within the rows fail the step (the runtime raises), and such a group is not good."""
    start = ctx.load(offsets, e).cast(dtypes.DT_INT64)
    stop = ctx.load(offsets, e + 1).cast(dtypes.DT_INT64)
    # Rows before the first group would be left unwritten (the reference refuses them too).
    first = ctx.load(offsets, 0).cast(dtypes.DT_INT64)
    bad = first.not_equal(0) | (start < 0) | (stop < start) | (stop > rows)
    ctx.fail(bad)
    return start, stop, ~bad
