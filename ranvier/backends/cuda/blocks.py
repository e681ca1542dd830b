"""Block programs: kernels whose threads work together — a block's threads load a tile into
shared memory once, wait for each other, and all read it.

A block program is written as phases: code every thread of the block runs (`phase`,
which yields the thread's number), with the block waiting for all its threads between one
phase and the next. Phases may sit in loops (`ctx.loop`) whose trip count is the same for
every thread of the block — bounds from the block's index alone — which is what lets a
kernel stream tiles: load a tile (a phase), use it (a phase), repeat. Memory is of three
kinds: the kernel's operands; `shared` arrays, one per block; and `private` arrays, one per
thread, which keep a thread's values from one phase to a later one (a local variable lives
in its phase only).

On the GPU a phase is the threads' code itself and the wait a barrier (`bar.sync`);
shared arrays are `.shared` memory and private ones the thread's own. The host emulator
runs a phase as a loop over the block's threads, one after another (the end of the loop is
the barrier), a private array as one slot per thread, and a shared array on the stack: the
same program, so the tests of a block kernel's arithmetic on the host test what the GPU runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from llvmlite import ir

from ..llvm.context import Array, ir_of
from ..llvm.irutil import I32, I64, VOID, compute_type, declared, i64
from ..llvm.values import Value, index_value

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

SHARED = 3  # NVPTX's address space of a block's shared memory


def special_register(module: ir.Module, b: ir.IRBuilder, name: str) -> ir.Value:
    """A thread's or the grid's coordinate (tid.x, ntid.x, ctaid.x, nctaid.x), as i64."""
    full = f"llvm.nvvm.read.ptx.sreg.{name}"
    return b.zext(b.call(declared(module, full, ir.FunctionType(I32, [])), []), I64)


def shared_variable(module: ir.Module, dtype: str, count: int, name: str) -> ir.GlobalVariable:
    """`count` scalars of the block's shared memory, a variable of the module."""
    memory = ir.GlobalVariable(module, ir.ArrayType(compute_type(dtype), count), name, addrspace=SHARED)
    memory.linkage, memory.align = "internal", 16
    memory.initializer = ir.Constant(memory.value_type, ir.Undefined)
    return memory


def shared_array(ctx: ThreadContext, dtype: str, count: int) -> Array:
    """`count` scalars in the block's shared memory, of this array's own (GPU code only)."""
    memory = shared_variable(ctx.module, dtype, count, ctx.module.get_unique_name("shared"))
    return Array(ctx.b, memory.gep([ir.Constant(I32, 0), ir.Constant(I32, 0)]), dtype)


def barrier(ctx: ThreadContext) -> None:
    """Wait until every thread of the block is here (`bar.sync`). On the host, where the
    block's threads run one after another, nothing: there the code is ordered already."""
    if ctx.on_gpu:
        ctx.b.call(declared(ctx.module, "llvm.nvvm.barrier0", ir.FunctionType(VOID, [])), [])


class PrivateArray:
    """`count` scalars of each thread, kept across phases: `.load(i)` and `.store(i, v)`
    reach the current phase's thread's own."""

    def __init__(self, program: BlockProgram, base: ir.Value, dtype: str, count: int):
        self.program, self.base, self.dtype, self.count = program, base, dtype, count

    def _array(self) -> Array:
        program = self.program
        if program.on_gpu:
            return Array(program.ctx.b, self.base, self.dtype)
        own = program.ctx.b.gep(self.base, [ir_of(program.thread * self.count)])
        return Array(program.ctx.b, own, self.dtype)

    def load(self, at: Value | int) -> Value:
        return self._array().load(at)

    def store(self, at: Value | int, value: Value) -> None:
        self._array().store(at, value)

    def of(self, thread: Value) -> Array:
        """Thread `thread`'s own array, on the host emulator (where a warp-wide operation
        reads its lanes' arrays one after another, `warps.py`)."""
        return Array(self.program.ctx.b, self.program.ctx.b.gep(self.base, [ir_of(thread * self.count)]), self.dtype)


class BlockProgram:
    """A block kernel's element (one block's work) being written; see the module docstring.
    `ctx` is the element function's context, `threads` the block's size, `on_gpu` whether
    the code is for the GPU or for the host emulator."""

    def __init__(self, ctx: ThreadContext, threads: int, on_gpu: bool):
        self.ctx, self.threads, self.on_gpu = ctx, threads, on_gpu
        self._thread: Value | None = None  # inside a phase: the thread's number in the block

    @property
    def in_phase(self) -> bool:
        return self._thread is not None

    @property
    def thread(self) -> Value:
        """The running thread's number in the block, inside a phase."""
        if self._thread is None:
            raise RuntimeError("a thread's number is known only inside a phase")
        return self._thread

    def shared(self, dtype: str, count: int) -> Array:
        """`count` scalars the block's threads share."""
        return shared_array(self.ctx, dtype, count) if self.on_gpu else self.ctx.array(dtype, count)

    def private(self, dtype: str, count: int) -> PrivateArray:
        """`count` scalars of each thread, kept from one phase to the next."""
        b = self.ctx.b
        with b.goto_entry_block():
            base = b.alloca(compute_type(dtype), size=i64(count if self.on_gpu else count * self.threads))
        return PrivateArray(self, base, dtype, count)

    @contextmanager
    def phase(self, wait: bool = True) -> Iterator[Value]:
        """Code each thread runs (the with-block; it gets the thread's number); the block
        then waits until all its threads are done, unless `wait` is false (a phase whose
        results only its own thread, or its warp through a warp-wide operation, reads)."""
        if self._thread is not None:
            raise RuntimeError("a phase cannot hold another: the block waits between phases")
        ctx = self.ctx
        if self.on_gpu:
            self._thread = index_value(ctx.b, special_register(ctx.module, ctx.b, "tid.x"))
            yield self._thread
            if wait:
                barrier(ctx)
        else:
            with ctx.loop(0, self.threads, name="thread") as thread:
                self._thread = thread
                yield thread
        self._thread = None

