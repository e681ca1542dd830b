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

A ForEach of flat maps (`maps.FlatMap`: an AdamW update, a cast) is table-driven instead, as
PyTorch's multi_tensor_apply and apex run an optimizer: its code is one body per distinct
member program (the same expression, dtypes, broadcasts and vector lanes), however many
members run it, where a body per member made stories110M's AdamW ForEach 10,776 lines of
PTX and most of ptxas's time. Each member's elements are laid out in whole chunks of
`CHUNK` launch elements (a block's threads: no block straddles two members); the kernel's
one parameter besides its status word is a `Table` in device memory, written once when an
instance is made, holding each chunk's member record and each record's first chunk, size
and views' addresses. A thread finds its chunk's record (one load), and runs the member's
element there.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from llvmlite import ir

from ... import dtypes
from ...flow.graph import Variable
from ..llvm.irutil import i64, storage_type
from .launch import THREADS_PER_BLOCK
from .maps import FlatMap, emit_flat

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

GROUPED_WORK = 1 << 22  # the most threads' worth of work a member may have: larger kernels gain little
MAX_OPERANDS = 256  # variables one ForEach kernel takes: 2 KB of the 4 KB of parameters a launch may pass

Emit = Callable[["ThreadContext", ir.Value], None]


def laid_end_to_end(launches: Sequence[tuple[int, Emit, int]]) -> tuple[int, Emit, int]:
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


GLOBAL = 1  # NVPTX's address space of global memory
CHUNK = THREADS_PER_BLOCK  # launch elements a table-driven ForEach gives a member at a time: a block's


@dataclass(frozen=True)
class Record:
    """A member of a table-driven ForEach: its chunks (from `first`, `chunks` of them), its
    map's size, and each view's first element as (operand number, byte offset)."""

    first: int
    chunks: int
    size: int
    views: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Table:
    """What a table-driven ForEach kernel reads of its members (module docstring): `words`
    is the table in device memory, 64-bit words: each chunk's record's word offset, then
    each record: its first chunk, its size, its views' addresses."""

    records: tuple[Record, ...]

    @property
    def chunks(self) -> int:
        return sum(record.chunks for record in self.records)

    def record_words(self) -> list[int]:
        """Where each record starts in the table, in words."""
        starts = list(itertools.accumulate((2 + len(r.views) for r in self.records), initial=self.chunks))
        return starts[:-1]

    def words(self, addresses: Sequence[int]) -> np.ndarray:
        """The table, the kernel's operands being at `addresses` (in order)."""
        starts = self.record_words()
        made = [np.repeat(np.array(starts, np.int64), [r.chunks for r in self.records])]
        for record in self.records:
            made.append(np.array([record.first, record.size, *(addresses[k] + offset for k, offset in record.views)],
                                 dtype=np.uint64).view(np.int64))
        return np.concatenate(made)


def table_driven(flats: Sequence[FlatMap], operands: Sequence[Variable]) -> tuple[int, Emit, int, Table]:
    """The launch of a ForEach whose members are the flat maps `flats` (`maps.flat_map`),
    over `operands` (its kernel's variables), table-driven (module docstring), with its table."""
    programs: dict[Hashable, list[FlatMap]] = {}
    for flat in flats:
        programs.setdefault(flat.key, []).append(flat)
    number = {id(v): k for k, v in enumerate(operands)}
    records, launches, first = [], [], 0
    for group in programs.values():
        launches.append((sum(-(-flat.elements // CHUNK) for flat in group) * CHUNK,
                         functools.partial(_member_element, flat=group[0], first=first), 0))
        for flat in group:
            chunks = -(-flat.elements // CHUNK)
            views = tuple((number[id(view.var)], view.offset * dtypes.itemsize(view.var.dtype)) for view in flat.views)
            records.append(Record(first, chunks, flat.size, views))
            first += chunks
    elements, emit, _ = laid_end_to_end(launches)
    return elements, emit, 0, Table(tuple(records))


def _member_element(ctx: ThreadContext, index: ir.Value, flat: FlatMap, first: int) -> None:
    """Element `index` of the chunks of one member program (`flat`'s key) from chunk `first`
    on: its member's record found through its chunk, the member's element at its own index."""
    b = ctx.b
    table = ctx.table

    def word(at: ir.Value) -> ir.Value:
        return b.load(b.gep(table, [at]))

    at = b.add(index, i64(first * CHUNK)) if first else index  # in the whole launch
    record = word(b.udiv(at, i64(CHUNK)))
    own = b.sub(at, b.mul(word(record), i64(CHUNK)))
    views = flat.description.inputs + flat.description.outputs
    bases = [_device_pointer(ctx, word(b.add(record, i64(2 + k))), storage_type(view.var.dtype)) for k, view in enumerate(views)]
    emit_flat(ctx, flat, bases, word(b.add(record, i64(1))), own)


def _device_pointer(ctx: ThreadContext, address: ir.Value, element: ir.Type) -> ir.Value:
    """A pointer to `element`s at `address`, on the GPU cast through global memory's address
    space: LLVM then accesses it as global memory (ld.global, as a kernel's pointer
    parameter is), not through a generic address."""
    b = ctx.b
    if not ctx.on_gpu:
        return b.inttoptr(address, element.as_pointer())
    return b.addrspacecast(b.inttoptr(address, element.as_pointer(GLOBAL)), element.as_pointer())
