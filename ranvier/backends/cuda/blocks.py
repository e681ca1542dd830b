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

Shared memory past 48 KB. A block's static `.shared` variables may hold at most 48 KB on
every architecture; Hopper gives a block up to 227 KB, but only as dynamic shared memory:
the module's one `.extern .shared` array, sized by each launch (`sharedMemBytes`), which
the driver allows past 48 KB once the function's attribute
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES says so. A kernel does nothing of its own
for it: it asks for every array with `program.shared(dtype, count)`, whatever their sizes
(double buffers of 64 × 128 bfloat16 tiles: `program.shared(DT_INT32, 2 * 64 * 64)` each),
and the element function's `SharedMemory` (`ThreadContext.shared_memory`) places them
once the element is written (`SharedMemory.lay_out`, called by `kernels.py`):
- 48 KB or less in all: each array stays a static variable of its own (the code is what
  it was before dynamic shared memory existed);
- more: each becomes a slice of the dynamic array, in the order they were asked for, at
  offsets that are multiples of 16 bytes (`shared_bytes`), and the total is the kernel's
  `GPUKernel.dynamic_shared_bytes`. The driver sets the function's attribute to it when it
  loads the module and passes it at every launch (a captured graph holds it with the
  launch). The host emulator lays the arrays out the same way, as slices of one array on
  the stack, so slices that overlapped would show in its results.
A block's arrays past what the device gives one (its
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN; a compile without a GPU, Hopper's
227 KB) are an error naming the kernel and its bytes, at compile and when the driver loads
it. A launch shape counts the block's shared memory against the multiprocessor's 228 KB
(`launch.resident_blocks`): 100 KB a block leaves room for two. A row fold's partials
(`rows.py`, a few words) stay static variables beside them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llvmlite import ir

from ..llvm.context import Array, EmitContext, ir_of
from ..llvm.irutil import I1, I8, I32, I64, VOID, compute_type, declared, i64
from ..llvm.values import Value, index_value

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

SHARED = 3  # NVPTX's address space of a block's shared memory
STATIC_SHARED_LIMIT = 48 * 1024  # a block's static shared variables at most, on every architecture
SHARED_ALIGNMENT = 16  # bytes: every shared array's start (cp.async's and ldmatrix's 16-byte rows)
DYNAMIC_SHARED = "dynamic_shared"  # the module's extern shared array, sized by each launch


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


def shared_bytes(dtype: str, count: int) -> int:
    """What an array of `count` scalars takes of a block's shared memory, rounded up to
    `SHARED_ALIGNMENT` (the next array's start)."""
    scalar = compute_type(dtype)
    size = count * (4 if isinstance(scalar, ir.FloatType) else 8 if isinstance(scalar, ir.DoubleType)
                    else max(1, scalar.width // 8))
    return -(-size // SHARED_ALIGNMENT) * SHARED_ALIGNMENT


@dataclass
class _Placed:
    """One array of a kernel's shared memory: the instruction its users read its start
    from (`start` itself, which `SharedMemory.lay_out` may replace), its bytes, and on
    the GPU its static variable."""

    pointer: ir.Instruction
    start: ir.Value
    nbytes: int
    variable: ir.GlobalVariable | None


class SharedMemory:
    """A kernel's shared arrays (the module docstring): each array is first a static one
    (`array`), and `lay_out`, once the kernel's element is written, moves them all into
    one dynamic allocation where they take more than `STATIC_SHARED_LIMIT`."""

    def __init__(self) -> None:
        self.arrays: list[_Placed] = []

    @property
    def nbytes(self) -> int:
        """The block's shared memory its arrays take, each from a 16-byte boundary."""
        return sum(placed.nbytes for placed in self.arrays)

    def array(self, ctx: EmitContext, dtype: str, count: int, on_gpu: bool) -> Array:
        """`count` scalars in the block's shared memory: on the GPU a shared variable of
        its own, on the host an array on the stack."""
        b = ctx.b
        variable = None
        if on_gpu:
            variable = shared_variable(ctx.module, dtype, count, ctx.module.get_unique_name("shared"))
            start: ir.Value = variable.gep([ir.Constant(I32, 0), ir.Constant(I32, 0)])
        else:
            start = ctx.array(dtype, count).base
        with b.goto_entry_block():  # the one place `lay_out` may change: the array's users read its start here
            pointer = b.select(ir.Constant(I1, 1), start, start)  # (an instruction of `start` whose operand can change)
        self.arrays.append(_Placed(pointer, start, shared_bytes(dtype, count), variable))
        return Array(b, pointer, dtype)

    def lay_out(self, ctx: EmitContext, on_gpu: bool) -> int:
        """Where the arrays take more than `STATIC_SHARED_LIMIT`, each becomes a slice of
        one dynamic allocation, in order from offset 0: on the GPU the module's extern
        array (`DYNAMIC_SHARED`), which each launch sizes; on the host one array at the
        start of the element's stack frame. The bytes a launch must then pass as dynamic
        shared memory, else 0 (the arrays stay static)."""
        total = self.nbytes
        if total <= STATIC_SHARED_LIMIT:
            return 0
        entry = ctx.b.function.entry_basic_block
        b = ir.IRBuilder(entry)
        b.position_at_start(entry)
        base = _dynamic_shared(ctx.module) if on_gpu else b.alloca(ir.ArrayType(I8, total))
        if not on_gpu:
            base.align = SHARED_ALIGNMENT
        offset = 0
        for placed in self.arrays:
            at = [ir.Constant(I32, 0), ir.Constant(I32, offset)]
            if placed.variable is not None:  # a constant, and the static variable leaves the module
                placed.pointer.replace_usage(placed.start, base.gep(at).bitcast(placed.start.type))
                del ctx.module.globals[placed.variable.name]
            else:
                placed.pointer.replace_usage(placed.start, b.bitcast(b.gep(base, at), placed.start.type))
            offset += placed.nbytes
        return total


def _dynamic_shared(module: ir.Module) -> ir.GlobalVariable:
    """The module's dynamic shared memory, `.extern .shared .align 16 .b8 dynamic_shared[]`:
    one array every kernel of the module starts its own slices in."""
    memory = module.globals.get(DYNAMIC_SHARED)
    if memory is None:
        memory = ir.GlobalVariable(module, ir.ArrayType(I8, 0), DYNAMIC_SHARED, addrspace=SHARED)
        memory.linkage, memory.align = "external", SHARED_ALIGNMENT
    return memory


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
        # the kernel's (laid out when its element is written); a context of no kernel's
        # (a test's own function) keeps its arrays static
        memory = getattr(ctx, "shared_memory", None)
        self.shared_memory: SharedMemory = memory if isinstance(memory, SharedMemory) else SharedMemory()
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
        """`count` scalars the block's threads share (static, or a slice of the kernel's
        dynamic shared memory: the module docstring)."""
        return self.shared_memory.array(self.ctx, dtype, count, self.on_gpu)

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

