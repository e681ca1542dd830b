"""Warp-wide operations of a block program (`blocks.BlockProgram`): a tensor-core product
of bfloat16 fragments summed in float32 (`mma`: PTX's mma.sync.m16n8k16, 16 × 16 by
16 × 8 per warp), fragments loaded from a shared tile (`load_matrices`: ldmatrix), an
exchange of values between lanes (`exchange`: shfl.sync.bfly); a thread's copies
from global to shared memory that run while it computes (`AsyncCopies`: cp.async), a
16-byte chunk of a shared bfloat16 tile copied from any operand (`copy_chunk`: cp.async
where the operand is bfloat16, else loaded and rounded by the thread), and tiles
streamed through two shared buffers, the next tile's copies under this tile's products
(`pipelined`).

A warp's 32 lanes hold the product's matrices between them, a fragment each, laid out as
the PTX ISA says (lane = 4·g + q, g its group, q its place in the group):

    A, 16 × 16 by rows:   a lane's element i of 8 is A[g + 8·(i // 2 % 2)][2q + i % 2 + 8·(i // 4)]
    B, 16 × 8 by columns: element i of 4 is B[2q + i % 2 + 8·(i // 2)][g]
    C, D, 16 × 8:         element i of 4 is C[g + 8·(i // 2)][2q + i % 2]

ldmatrix gives these fragments from 8 × 8 matrices of 16-bit elements in shared memory,
lanes 8i .. 8i + 7 naming the 16-byte rows of matrix i: lane 4g + q gets, as its word i,
elements 2q and 2q + 1 of row g of matrix i (transposed: element g of rows 2q and 2q + 1).
So an 8-row slice of a tile stored by rows is B's fragment of its transpose (two matrices:
columns 0-7 and 8-15), and a 16-row slice, transposed, is B's fragment of itself.

A and B fragments are kept packed, two bfloat16 to a 32-bit word (`pack`: the element
numbered lower in the low half), C and D as float32; each lives in its threads' private
arrays (`BlockProgram.private`) from an offset on.

On the GPU each operation is its instruction, run by a warp's lanes together, and a
private array reached at known indices stays in registers. On the host emulator, where a
block's threads run one after another, a warp-wide operation comes between phases: a
loop over the block's threads that reads every lane's private array (or, for ldmatrix,
the rows every lane names) as the layouts above say (the product summed in order along
k, as float32 multiply-adds); an asynchronous copy is made at the wait that covers it.
So a kernel written with these, its fragments' layouts and its waits included, is
checked on the host before it runs on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ..llvm.context import Array, EmitContext, ir_of
from ..llvm.convert import narrow, widen
from ..llvm.irutil import F32, I16, I32, I64, VOID, declared, storage_type, typed_pointer
from ..llvm.values import Value, index_value
from .blocks import BlockProgram, PrivateArray

if TYPE_CHECKING:
    from ...flow.graph import Variable
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

WARP = 32
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
        "{$10,$11,$12,$13};")
_EMULATED_MMA = "ranvier_emulated_mma"  # the host emulator's product, one function per module
COPY_BYTES = 16  # what one cp.async (.cg) moves: 8 bfloat16, 4 float32
CHUNK = COPY_BYTES // 2  # bfloat16 values one copy puts into a shared tile (`copy_chunk`)


def lane_of(thread: Value) -> tuple[Value, Value, Value]:
    """A block thread's warp, and its lane's group g (the fragments' rows g and g + 8) and
    place q in the group (lane = 4·g + q, as the layouts above)."""
    lane = thread % WARP
    return thread // WARP, lane // 4, lane % 4


def pack(program: BlockProgram, high: Value, low: Value) -> Value:
    """Two float32 values rounded to bfloat16 (to nearest even) in one 32-bit word."""
    b = program.ctx.b
    if program.on_gpu:
        convert = ir.InlineAsm(ir.FunctionType(I32, [F32, F32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        return Value(b, b.call(convert, [high.ir, low.ir]), dtypes.DT_INT32)
    halves = [b.zext(narrow(b, v.ir, dtypes.DT_BFLOAT16, 1), I32) for v in (high, low)]
    return Value(b, b.or_(b.shl(halves[0], ir.Constant(I32, 16)), halves[1]), dtypes.DT_INT32)


def _unpacked(b: ir.IRBuilder, word: ir.Value, high: bool) -> ir.Value:
    bits = b.and_(word, ir.Constant(I32, -0x10000)) if high else b.shl(word, ir.Constant(I32, 16))
    return b.bitcast(bits, F32)


def _warp_sync(ctx: ThreadContext) -> None:
    """Every lane of the warp here before a warp-wide instruction (after code where they parted)."""
    ctx.b.call(declared(ctx.module, "llvm.nvvm.bar.warp.sync", ir.FunctionType(VOID, [I32])), [ir.Constant(I32, -1)])


def mma(program: BlockProgram, d: tuple[PrivateArray, int], a: tuple[PrivateArray, int], b: tuple[PrivateArray, int],
        c: tuple[PrivateArray, int]) -> None:
    """D = A · B + C in every warp of the block: each operand a private array and the
    offset of its fragment there (4 packed words of A, 2 of B, 4 floats of C and D; D may
    be C). Called between phases."""
    ctx = program.ctx
    if program.on_gpu:
        with program.phase(wait=False):
            _warp_sync(ctx)
            product = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4), _MMA,
                                   "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            result = ctx.b.call(product, [*_fragment(a, 4), *_fragment(b, 2), *_fragment(c, 4)])
            array, at = d
            for k in range(4):
                array.store(at + k, Value(ctx.b, ctx.b.extract_value(result, k), dtypes.DT_FLOAT32))
        return
    _between_phases(program)
    operands = []
    for array, at in (a, b, c, d):
        operands += [ctx.b.gep(array.base, [ir_of(at)]), ir.Constant(I64, array.count)]
    ctx.b.call(_emulated_mma(ctx.module), [*operands, ir.Constant(I64, program.threads)])


def _fragment(operand: tuple[PrivateArray, int], count: int) -> list[ir.Value]:
    """A lane's `count` registers of a fragment: its private array from the offset on."""
    array, at = operand
    return [array.load(at + k).ir for k in range(count)]


def _between_phases(program: BlockProgram) -> None:
    """The host emulator runs a warp-wide operation over every lane at once: outside a phase."""
    if program.in_phase:
        raise RuntimeError("a warp-wide operation comes between phases, not in one")


def _emulated_mma(module: ir.Module) -> ir.Function:
    """The host's mma over a block's threads: (A, its words per thread, B, …, C, …, D, …, threads)."""
    existing = module.globals.get(_EMULATED_MMA)
    if existing is not None:
        return existing
    words, floats = I32.as_pointer(), F32.as_pointer()
    function = ir.Function(module, ir.FunctionType(VOID, [words, I64, words, I64, floats, I64, floats, I64, I64]),
                           _EMULATED_MMA)
    function.linkage = "internal"
    a, a_count, b_, b_count, c, c_count, d, d_count, threads = function.args
    b = ir.IRBuilder(function.append_basic_block("entry"))
    ctx = EmitContext(module, b)

    def element(base, count, thread: Value, at) -> ir.Value:
        return b.load(b.gep(base, [ir_of(thread * index_value(b, count) + at)]))

    with ctx.loop(0, index_value(b, threads), name="thread") as thread:
        warp, group, place = lane_of(thread)
        first = warp * WARP  # the warp's lane 0
        for i in range(4):
            row_high, column = i // 2, place * 2 + i % 2
            total = element(c, c_count, thread, i)
            for k in range(16):
                a_word = element(a, a_count, first + group * 4 + k % 8 // 2, (k % 2 + 2 * row_high + 4 * (k // 8)) // 2)
                b_word = element(b_, b_count, first + column * 4 + k % 8 // 2, k // 8)
                product = b.fmul(_unpacked(b, a_word, k % 2 == 1), _unpacked(b, b_word, k % 2 == 1))
                total = b.fadd(total, product)
            b.store(total, b.gep(d, [ir_of(thread * index_value(b, d_count) + i)]))
    b.ret_void()
    return function


def exchange(program: BlockProgram, target: PrivateArray, source: PrivateArray, count: int, mask: int) -> None:
    """Each lane's `count` values of `source` from the lane whose number differs from its
    own in the bits of `mask` (a butterfly: masks 1 and 2 pass a value round a group of
    four lanes), into `target` (another array). Called between phases."""
    ctx = program.ctx
    if program.on_gpu:
        with program.phase(wait=False):
            for i in range(count):
                target.store(i, shuffled(ctx, source.load(i), "bfly", mask))
        return
    _between_phases(program)
    with ctx.loop(0, program.threads, name="lane") as thread:
        for i in range(count):
            target.of(thread).store(i, source.of(thread ^ mask).load(i))


def load_matrices(program: BlockProgram, target: tuple[PrivateArray, int], tile: Array, row: Callable[[Value], Value],
                  count: int = 4, transpose: bool = False, offset: int = 0) -> None:
    """ldmatrix in every warp of the block: `count` (1, 2 or 4) 8 × 8 matrices of 16-bit
    elements from the shared `tile` (32-bit words), lane 4g + q's word i (of its private
    array `target` from the offset) elements 2q and 2q + 1 of row g of matrix i, or with
    `transpose` element g of rows 2q and 2q + 1 (the lower-numbered in the low half).
    Lanes 8i .. 8i + 7 name matrix i's rows: thread t's row starts at word `row(t)` +
    `offset` of the tile, a multiple of 4 (16-byte rows). The constant `offset` is the
    instruction's own (an immediate), so a warp's loads at fixed distances share one
    address register. Called between phases."""
    if count not in (1, 2, 4):
        raise ValueError(f"ldmatrix loads 1, 2 or 4 matrices, not {count}")
    ctx = program.ctx
    array, at = target
    if program.on_gpu:
        with program.phase(wait=False) as thread:
            _warp_sync(ctx)
            registers = ",".join(f"${k}" for k in range(count))
            instruction = (f"ldmatrix.sync.aligned.m8n8.x{count}{'.trans' if transpose else ''}.shared.b16 "
                           f"{{{registers}}}, [${count}+{offset * 4}];")
            load = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([I32] * count), [I32]), instruction,
                                ",".join(["=r"] * count + ["r", "~{memory}"]), side_effect=True)
            address = ctx.b.ptrtoint(ctx.b.gep(tile.base, [ir_of(row(thread))]), I32)
            result = ctx.b.call(load, [address])
            for k in range(count):
                array.store(at + k, Value(ctx.b, ctx.b.extract_value(result, k), dtypes.DT_INT32))
        return
    _between_phases(program)
    b = ctx.b
    halves = b.bitcast(tile.base, I16.as_pointer())
    with ctx.loop(0, program.threads, name="lane") as thread:
        warp, group, place = lane_of(thread)
        first = warp * WARP  # the warp's lane 0
        for i in range(count):
            if transpose:
                low, high = (b.zext(b.load(b.gep(halves, [ir_of((row(first + 8 * i + place * 2 + k) + offset) * 2 + group)])), I32)
                             for k in range(2))
                word = Value(b, b.or_(low, b.shl(high, ir.Constant(I32, 16))), dtypes.DT_INT32)
            else:
                word = tile.load(row(first + 8 * i + group) + offset + place)
            array.of(thread).store(at + i, word)


class AsyncCopies:
    """A thread's copies from global to shared memory that run while it computes
    (cp.async.cg: 16 bytes at a time, through L2, not L1), in groups: `copy` starts one,
    `commit` closes the group of those started since the last, `wait(pending)` waits until
    at most the latest `pending` groups are still in flight (the block's threads see the
    copies after the next barrier). Each in a phase.

    The host emulator keeps each thread's copies in a queue and makes them at the wait
    that covers them, in order, as the GPU may: a kernel that reads a tile before waiting
    for it reads what the tile held before. The queue holds `per_group` copies of each of
    `groups` groups (at most as many as are in flight at once: the `pending` of the waits,
    and the group being started); the GPU needs nothing of these."""

    def __init__(self, program: BlockProgram, per_group: int, groups: int):
        self.program, self.capacity = program, per_group * groups
        if program.on_gpu:
            return
        self._sources, self._targets, self._groups = (program.private(dtypes.DT_INT64, self.capacity) for _ in range(3))
        self._state = program.private(dtypes.DT_INT64, 3)  # the first copy in flight, one past the last, groups committed
        with program.phase(wait=False):
            for k in range(3):
                self._state.store(k, program.ctx.index(0))

    def copy(self, tile: Array, word: Value, source: ir.Value, inside: Value | None = None) -> None:
        """`COPY_BYTES` from the global pointer `source` (16-byte aligned) to the shared
        `tile` (32-bit words) from `word` (a multiple of 4); where `inside` is given and
        false, 16 bytes of zeros instead (cp.async's source size 0: nothing is read, but
        `source` must still be an address of the operand)."""
        b = self.program.ctx.b
        target = b.gep(tile.base, [ir_of(word)])
        if self.program.on_gpu:
            operands, constraints, sized = [b.ptrtoint(target, I32), source], "r,l", ""
            if inside is not None:  # the source size as well: 16 bytes, or 0 for zeros
                operands.append(b.select(inside.ir, ir.Constant(I32, COPY_BYTES), ir.Constant(I32, 0)))
                constraints, sized = "r,l,r", ", $2"
            copy = ir.InlineAsm(ir.FunctionType(VOID, [operand.type for operand in operands]),
                                f"cp.async.cg.shared.global [$0], [$1], {COPY_BYTES}{sized};", constraints + ",~{memory}",
                                side_effect=True)
            b.call(copy, operands)
            return
        address = Value(b, b.ptrtoint(source, I64), dtypes.DT_INT64)
        last = self._state.load(1)
        slot = last % self.capacity
        self._sources.store(slot, address if inside is None else inside.where(address, 0))  # no source: zeros
        self._targets.store(slot, Value(b, b.ptrtoint(target, I64), dtypes.DT_INT64))
        self._groups.store(slot, self._state.load(2))
        self._state.store(1, last + 1)

    def commit(self) -> None:
        if self.program.on_gpu:
            self.program.ctx.b.call(ir.InlineAsm(ir.FunctionType(VOID, []), "cp.async.commit_group;", "~{memory}",
                                                 side_effect=True), [])
            return
        self._state.store(2, self._state.load(2) + 1)

    def wait(self, pending: int) -> None:
        ctx = self.program.ctx
        b = ctx.b
        if self.program.on_gpu:
            b.call(ir.InlineAsm(ir.FunctionType(VOID, []), f"cp.async.wait_group {pending};", "~{memory}", side_effect=True), [])
            return
        covered = self._state.load(2) - pending  # groups before this one land now: a prefix of the queue
        landed = ctx.local(dtypes.DT_INT64, initial=self._state.load(0))
        vector = ir.VectorType(I32, COPY_BYTES // 4).as_pointer()
        with ctx.loop(self._state.load(0), self._state.load(1), name="copy") as e:
            slot = e % self.capacity
            with ctx.when(self._groups.load(slot) < covered):
                source, target = (b.inttoptr(array.load(slot).ir, vector) for array in (self._sources, self._targets))
                b.store(ir.Constant(vector.pointee, None), target, align=4)  # a copy with no source: zeros
                with ctx.when(self._sources.load(slot).not_equal(0)):
                    b.store(b.load(source, align=4), target, align=4)  # the host's stack tile is 4-byte aligned only
                landed.set(e + 1)
        self._state.store(0, landed.value)



def copy_chunk(program: BlockProgram, copies: AsyncCopies, tile: Array, word: Value, var: Variable,
               place: Callable[[int, int], tuple[Value, Value | None]], lanes: int) -> None:
    """The running thread's copy of one chunk of a shared tile of bfloat16 (`CHUNK`
    values, 16 bytes, from `word` of `tile`, a multiple of 4) from the operand `var`, read
    `lanes` values at a time: a 16-byte vector (`vector_lanes`, from an element offset
    that is a multiple of it) or one value. `place(i, lanes)` is the element offset of
    the chunk's values i .. i + lanes − 1 in `var` and whether they are inside it (else
    zeros; None: always). A bfloat16 chunk read whole is one cp.async (`copies`; its
    zeros cp.async's source size 0); any other is loaded by the thread (ld.global.v4 for
    a vector), rounded to bfloat16 in pairs and stored at once."""
    ctx = program.ctx
    if var.dtype == dtypes.DT_BFLOAT16 and lanes == CHUNK:
        at, inside = place(0, CHUNK)
        copies.copy(tile, word, typed_pointer(ctx.b, ctx.pointer(var), ir_of(at), storage_type(var.dtype)), inside)
        return
    values: list[Value] = []
    for first in range(0, CHUNK, lanes):
        at, inside = place(first, lanes)
        loaded = load_vector(ctx, var, at, lanes).cast(dtypes.DT_FLOAT32)
        if inside is not None:
            loaded = inside.where(loaded, 0.0)
        values += [loaded.lane(lane) for lane in range(lanes)] if lanes > 1 else [loaded]
    for k in range(CHUNK // 2):
        tile.store(word + k, pack(program, values[2 * k + 1], values[2 * k]))


def vector_lanes(dtype: str) -> int:
    """Values of `dtype` one 16-byte vector load reads (8 bfloat16, 4 float32)."""
    return COPY_BYTES // dtypes.itemsize(dtype)


def load_vector(ctx: ThreadContext, var: Variable, at: Value, lanes: int) -> Value:
    """`lanes` elements of `var` from element `at` (a multiple of the lanes), as a compute
    value: one aligned vector load (ld.global.v4), or one element where `lanes` is 1."""
    if lanes == 1:
        return ctx.load(var, at)
    b = ctx.b
    raw = b.load(typed_pointer(b, ctx.pointer(var), ir_of(at), storage_type(var.dtype), lanes), align=COPY_BYTES)
    return Value(b, widen(b, raw, var.dtype, lanes), var.dtype)


def pipelined(program: BlockProgram, count: Value, per_tile: int, load: Callable[[Value, Value, AsyncCopies], None],
               use: Callable[[Value, Value], None]) -> None:
    """`use(i, buffer)` for each i < `count`, tile i in shared buffer `buffer` (i mod 2);
    `load(i, buffer, copies)` (in a phase, the running thread's share of tile i's copies,
    at most `per_tile`) is issued just before tile i − 1 is used, so its copies run under
    that tile's products. Each tile's copies are one group, and one barrier a tile
    serves both ends: each thread waits for its copies of tile i, then the block for
    every thread, after which tile i is whole and no thread still reads tile i − 1's
    buffer, which tile i + 1 then refills."""
    ctx = program.ctx
    copies = AsyncCopies(program, per_tile, groups=1)  # a tile's copies in flight at a time
    with program.phase(wait=False):
        with ctx.when(count > 0):
            load(ctx.index(0), ctx.index(0), copies)
        copies.commit()
    with ctx.loop(0, count, name="tile") as i:
        with program.phase():
            copies.wait(0)
        with program.phase(wait=False):
            with ctx.when(i + 1 < count):
                load(i + 1, (i + 1) % 2, copies)
            copies.commit()
        use(i, i % 2)


def shuffled(ctx: EmitContext, value: Value, mode: str, amount: int) -> Value:
    """`value` from another lane of the warp (shfl.sync: "down" `amount` lanes, "bfly" the
    lane whose number differs in `amount`'s bits, or "idx" lane `amount`), moved as 32-bit
    words whatever its type (a 64-bit value as its two halves)."""
    b = ctx.b
    kind = value.ir.type
    bits = kind.width if isinstance(kind, ir.IntType) else 64 if isinstance(kind, ir.DoubleType) else 32
    whole = ir.IntType(bits)
    as_bits = value.ir if isinstance(kind, ir.IntType) else b.bitcast(value.ir, whole)
    shuffle = declared(ctx.module, f"llvm.nvvm.shfl.sync.{mode}.i32", ir.FunctionType(I32, [I32] * 4))

    def moved(word: ir.Value) -> ir.Value:
        return b.call(shuffle, [ir.Constant(I32, -1), word, ir.Constant(I32, amount), ir.Constant(I32, WARP - 1)])

    if bits == 64:
        low, high = (moved(b.trunc(part, I32)) for part in (as_bits, b.lshr(as_bits, ir.Constant(whole, 32))))
        result = b.or_(b.zext(low, whole), b.shl(b.zext(high, whole), ir.Constant(whole, 32)))
    else:
        result = moved(b.zext(as_bits, I32) if bits < 32 else as_bits)
        result = b.trunc(result, whole) if bits < 32 else result
    return Value(b, result if isinstance(kind, ir.IntType) else b.bitcast(result, kind), value.dtype)
