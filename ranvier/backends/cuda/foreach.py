"""A ForEach (`ranvier.ops.foreach`: one op over several sets of operands) as one kernel,
as PyTorch's multi_tensor_apply and apex run an optimizer: its members' own kernels (each a
single launch of the same kind: all a thread per element, or all blocks of one size), one
body per distinct member program however many members run it, each member's variables
read from a table.

What it saves is launches: a training step's per-parameter work (a weight's cast, a
gradient's sum of squares, an AdamW update) is hundreds of small kernels, each paying a
launch of a few microseconds for a few microseconds of work. A body per member instead of
per program made stories110M's AdamW ForEach 10,776 lines of PTX, and its ForEach kernels
most of ptxas's time.

A member program (`Part.key`) is a flat map's (`maps.FlatMap`: the same op and attributes,
dtypes, broadcasts and vector lanes, any size: an AdamW update, a cast; the size is read at
run time), or else the member's signature (`kernels.signature`: its type, attributes, dtypes
and shapes; a model's layers share theirs): the code of one member serves every member of
its program, its variables' pointers changed. Each member's launch elements are laid out
in whole chunks (of `CHUNK` threads' elements, so no block straddles two members; of one
element, a block, for block kernels), members of one program side by side. The kernel's
one parameter besides its status word is a `Table` in device memory, written once when an
instance is made: each chunk's member record, and each record's first chunk, elements,
size and variables' addresses. An element finds its program by comparing its index with
where each program's chunks start (a handful of branches), its record through its chunk
(one load), and runs its member's element at its own index.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from llvmlite import ir

from ...flow.graph import Variable
from ..llvm.irutil import i64, storage_type
from .launch import THREADS_PER_BLOCK

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

GROUPED_WORK = 1 << 22  # the most threads' worth of work a member may have: larger kernels gain little
# variables one ForEach kernel takes: its table's, in device memory (as its parameters, they were
# bounded by the 4 KB a launch may pass: stories110M's AdamW was cut in two kernels at 256)
MAX_OPERANDS = 1 << 12

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
CHUNK = THREADS_PER_BLOCK  # a thread kernel's launch elements given a member at a time: a block's


@dataclass(frozen=True)
class Part:
    """A member of a ForEach as its kernel runs it: its program (`key`: members of one key
    share one body), launch elements, size (a flat map's; read at run time), variables (in
    the order the body takes them), and element: `emit(ctx, index, size)` at its own index,
    its variables' pointers being `ctx.pointer`'s."""

    key: Hashable
    elements: int
    size: int
    variables: tuple[Variable, ...]
    emit: Callable[[ThreadContext, ir.Value, ir.Value], None]


@dataclass(frozen=True)
class Record:
    """A member in the table: its chunks (from `first`, `chunks` of them), launch elements,
    size, and each variable's operand number."""

    first: int
    chunks: int
    elements: int
    size: int
    variables: tuple[int, ...]


RECORD_WORDS = 3  # before a record's variables' addresses: its first chunk, elements and size


@dataclass(frozen=True)
class Table:
    """What a ForEach kernel reads of its members (module docstring): `words` is the table
    in device memory, 64-bit words: each chunk's record's word offset, then each record: its
    first chunk, elements, size and variables' addresses."""

    records: tuple[Record, ...]

    @property
    def chunks(self) -> int:
        return sum(record.chunks for record in self.records)

    def words(self, addresses: Sequence[int]) -> np.ndarray:
        """The table, the kernel's operands being at `addresses` (in order)."""
        sizes = [RECORD_WORDS + len(r.variables) for r in self.records]
        starts = list(itertools.accumulate(sizes, initial=self.chunks))[:-1]
        made = [np.repeat(np.array(starts, np.int64), [r.chunks for r in self.records])]
        for record in self.records:
            made.append(np.array([record.first, record.elements, record.size, *(addresses[k] for k in record.variables)],
                                 dtype=np.uint64).view(np.int64))
        return np.concatenate(made)


def table_driven(parts: Sequence[Part], operands: Sequence[Variable], threads: int) -> tuple[int, Emit, int, Table]:
    """The launch of a ForEach of `parts` over `operands` (its kernel's variables; `threads`
    a block's, of a block kernel, or 0), and its table (module docstring)."""
    programs: dict[Hashable, list[Part]] = {}
    for part in parts:
        programs.setdefault(part.key, []).append(part)
    chunk = 1 if threads else CHUNK
    number = {id(v): k for k, v in enumerate(operands)}
    records, launches, first = [], [], 0
    for group in programs.values():
        start = first
        for part in group:
            chunks = -(-part.elements // chunk)
            records.append(Record(first, chunks, part.elements, part.size, tuple(number[id(v)] for v in part.variables)))
            first += chunks
        launches.append(((first - start) * chunk, functools.partial(_member_element, part=group[0], first=start, chunk=chunk),
                         threads))
    elements, emit, _ = laid_end_to_end(launches)
    return elements, emit, threads, Table(tuple(records))


def _member_element(ctx: ThreadContext, index: ir.Value, part: Part, first: int, chunk: int) -> None:
    """Element `index` of the chunks of one member program (`part`'s) from chunk `first` on:
    its member's record found through its chunk, the member's element at its own index, with
    the member's variables in the program's code."""
    b = ctx.b
    table = ctx.table

    def word(at: ir.Value) -> ir.Value:
        return b.load(b.gep(table, [at]))

    at = b.add(index, i64(first * chunk)) if first else index  # in the whole launch
    record = word(b.udiv(at, i64(chunk)) if chunk > 1 else at)
    own = b.sub(at, b.mul(word(record), i64(chunk)) if chunk > 1 else word(record))
    with b.if_then(b.icmp_unsigned("<", own, word(b.add(record, i64(1))))):
        pointers = ctx.pointers
        ctx.pointers = {id(v): _device_pointer(ctx, word(b.add(record, i64(RECORD_WORDS + k))), storage_type(v.dtype))
                        for k, v in enumerate(part.variables)}
        part.emit(ctx, own, word(b.add(record, i64(2))))
        ctx.pointers = pointers


def _device_pointer(ctx: ThreadContext, address: ir.Value, element: ir.Type) -> ir.Value:
    """A pointer to `element`s at `address`, on the GPU cast through global memory's address
    space: LLVM then accesses it as global memory (ld.global, as a kernel's pointer
    parameter is), not through a generic address."""
    b = ctx.b
    if not ctx.on_gpu:
        return b.inttoptr(address, element.as_pointer())
    return b.addrspacecast(b.inttoptr(address, element.as_pointer(GLOBAL)), element.as_pointer())
