"""A ForEach (`ranvier.ops.foreach`: one op over several sets of operands) as one kernel:
its members' own kernels, each a single launch of the same kind (all a thread per element,
or all blocks of one size), with their index spaces laid end to end. An element finds its
member by comparing its index with where each member's elements start — a binary search
unrolled into branches, a handful of comparisons — and runs that member's element at its
own index. A block takes one member's element whole, so a block kernel's barriers are
reached by all its threads alike.

What it saves is launches: a training step's per-parameter work (a weight's cast, a
gradient's sum of squares, an AdamW update) is hundreds of small kernels, each paying a
launch of a few microseconds for a few microseconds of work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from llvmlite import ir

from ..llvm.irutil import i64

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

GROUPED_WORK = 1 << 22  # the most threads' worth of work a member may have: larger kernels gain little
MAX_OPERANDS = 256  # variables one ForEach kernel takes: 2 KB of the 4 KB of parameters a launch may pass

Emit = Callable[["ThreadContext", ir.Value], None]


def laid_end_to_end(launches: list[tuple[int, Emit, int]]) -> tuple[int, Emit, int]:
    """One launch running each of `launches` (elements, emit, threads; all of equal
    threads) over its own range of a shared index space."""
    starts = [0]
    for elements, _, _ in launches:
        starts.append(starts[-1] + elements)
    emits = [emit for _, emit, _ in launches]

    def emit(ctx: ThreadContext, index: ir.Value) -> None:
        b = ctx.b

        def between(lo: int, hi: int) -> None:
            if hi - lo == 1:
                emits[lo](ctx, b.sub(index, i64(starts[lo])) if starts[lo] else index)
                return
            middle = (lo + hi) // 2
            with b.if_else(b.icmp_unsigned("<", index, i64(starts[middle]))) as (lower, upper):
                with lower:
                    between(lo, middle)
                with upper:
                    between(middle, hi)

        between(0, len(emits))

    return starts[-1], emit, launches[0][2]
