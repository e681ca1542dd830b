"""Attention and its gradient on tensor cores, FlashAttention-2's way: float32 operands of
a compile whose matrix products run in bfloat16 (`Compiler(matmul="bfloat16")` marks the
ops' precision), or bfloat16 operands (`Compiler(precision="bfloat16")`'s activations);
head sizes a multiple of 16 up to 128. Every product is a warp's `warps.mma` (bfloat16
inputs, float32 sums); no score matrix is formed.

A block of `WARPS` warps takes 64 rows, 16 a warp (the rows of an mma's A), and the warps
stream tiles of the rows they pair with through shared memory together, in bfloat16 (rows
padded by `PADDING` elements, 16 bytes, so the eight rows an ldmatrix reads fall on
different banks). A warp's own rows are rounded and packed into A fragments once (the
forward's query rows), or stay in shared memory and come in as A fragments by ldmatrix,
32 features at a time (the gradient's key and value rows: beside dK's and dV's sums a
head of 128's rows would not fit the registers); a tile's rows come in as B fragments by
`warps.load_matrices` (ldmatrix; transposed where the tile is the product's right-hand
side as stored); a product's float32 C fragments become the next product's A fragments
in place (the layouts line up), so the probabilities never leave the registers. Tiles are
double-buffered (`warps.pipelined`): the next tile's copies are issued before this
tile's products, bfloat16 rows by `warps.AsyncCopies` (cp.async, 16 bytes a thread at a
time) so they land while the tensor cores work; float32 rows are loaded and rounded by
the threads at once. At heads of 128 the forward's tiles take 68 KB of shared memory and
the gradient's key launch 75 KB, past the 48 KB of static shared memory (`blocks.py`
makes it dynamic).

Attention: query rows streaming tiles of `KEY_TILE` key rows and their value rows (one
cp.async wait and one barrier a tile), in steps of the keys whose scores the registers
hold (`_scored_keys`: the whole tile, or half at heads of 128). Per step: S = Q Kᵀ,
scaled, the bias added, −∞ where the causal mask hides a key or past the last; the
online softmax, each row's maximum taken over the four lanes that hold the row (two
`warps.exchange`s), the running sum l kept as each lane's own share until the end;
O += P V. With the op's statistics output, each row's log-sum-exp L = m + log l (+∞
where the row sees no key).

AttentionGrad, FlashAttention-2's, from the forward's output O and statistics L:
1. query rows, two threads a row: D = Σ dO ∘ O of each row into the step's workspace, and
   the row's float32 dQ accumulator zeroed. A pass of its own, not computed where the
   gradient's tiles are loaded: that launch would read O again for every block of keys;
   here it is read once, and the accumulator has to be zeroed before any block adds to it;
2. key rows (a block's 64, resident in shared memory with their value rows) streaming
   tiles of `QUERY_TILE` query rows, their dO rows, L and D, in every head of the key's
   group: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (A fragments from the resident tiles), Pᵀ = exp(Sᵀ − L)
   (0 where masked), dSᵀ = scale · Pᵀ ∘ (dPᵀ − D); dV += Pᵀ dO and dK += dSᵀ Q in registers;
   dSᵀ stored to shared memory in bfloat16, and the tile's dQ = dS K (each warp 16 query
   rows and half the features, dS's A fragments by a transposing ldmatrix) added to the
   float32 accumulator in global memory (`red.global.add.f32`: every key block of the head
   adds to the same rows). Five products a tile, no statistic found again;
3. bfloat16 dq only: the float32 accumulator (the workspace's) rounded into dq. A float32
   dq is its own accumulator, done after launch 2.
Launch 2 takes 168 registers a thread at heads of 64 (three blocks a multiprocessor) and
255 at 128 (two), ptxas for sm_90 knowing its blocks are 128 threads (`.maxntid`).
`RANVIER_ATTENTION_GRAD_BLOCKS_PER_SM=N` (read at compile) bounds it to N blocks
(`.minnctapersm`: at most 65,536 / (128 · N) registers, ptxas spilling the rest; 3 at 128:
168 registers and 236 bytes of spills, 4 at 64: 128 and 12 bytes), a trade of spills for
occupancy that only the GPU's clock can judge (.ci/gpu-check races it).
A query whose every key is masked attends to nothing (L = +∞: its p are 0, its row and
gradients 0).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ...ops.attention import statistics_of
from ..llvm.context import Array, ir_of
from ..llvm.irutil import F32, I64, VOID, typed_pointer
from ..llvm.loops import pairwise
from ..llvm.rows import finite_peak, log_sum_exp, unseen_inverse
from ..llvm.values import Value, index_value
from . import fastmath, warps
from .attention import AttentionShape
from .blocks import BlockProgram, PrivateArray
from .library import LIBRARY, Generator

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

WARPS = 4
ROWS = 16 * WARPS  # a block's own rows
THREADS = warps.WARP * WARPS
PADDING = 8  # bfloat16 elements (16 bytes) after each row of a shared tile
QUERY_TILE = 32  # query rows a key block streams at a time (its scores take half the registers of 64)
FLOAT = dtypes.DT_FLOAT32
# blocks of the gradient's key launch a multiprocessor must hold (its registers capped to fit)
KEY_BLOCKS_ENVIRONMENT = "RANVIER_ATTENTION_GRAD_BLOCKS_PER_SM"


def supports(op: Operation) -> bool:
    """Float32 operands whose products may round to bfloat16 (the op's precision), or
    bfloat16 operands (`Compiler(precision="bfloat16")`'s activations); the statistics
    float32 either way."""
    if op.type not in ("Attention", "AttentionGrad"):
        return False
    size = op.inputs[0].shape[-1]
    statistics = statistics_of(op)
    operands = {v.dtype for v in (*op.inputs, *op.outputs) if v is not statistics}
    rounded = attrs_of(op)["precision"] == "bfloat16" and operands == {FLOAT}
    return ((rounded or operands == {dtypes.DT_BFLOAT16}) and size % 16 == 0 and 16 <= size <= 128
            and (statistics is None or statistics.dtype == FLOAT))


KEY_TILE = 64  # key rows a streamed tile of the forward holds (68 KB of shared memory at heads of 128)


def _scored_keys(size: int) -> int:
    """Keys of a tile whose scores a warp holds at once (a 16 × n S fragment, n / 2 floats
    a lane): the whole tile up to heads of 64; at 128, beside the output's 64 floats and
    Q's 32 words, half of it at a time (ptxas for sm_90: 166 registers with bfloat16
    operands, 168 with float32, three blocks an SM; the whole tile's scores took 212,
    leaving room for two)."""
    return KEY_TILE if size <= 64 else KEY_TILE // 2


def _stride(size: int) -> int:
    """32-bit words from one row of a shared tile to the next: `size` bfloat16 and the padding."""
    return (size + PADDING) // 2


def _score_gradient_stride() -> int:
    """32-bit words from one key's row of a tile of dSᵀ (`QUERY_TILE` bfloat16 and the
    padding) to the next: 80 bytes, so the eight rows an ldmatrix reads fall on different banks."""
    return (QUERY_TILE + PADDING) // 2


def _row_terms_words(shape: AttentionShape) -> int:
    """The workspace's first words, D of each query row [B, H, T], rounded up to 16 bytes."""
    return -(-shape.batch * shape.heads * shape.queries // 4) * 4


def _workspace_bytes(op: Operation) -> int:
    """The gradient's: D of each query row, then a bfloat16 dq's float32 accumulator."""
    if op.type != "AttentionGrad":
        return 0
    shape, dq = AttentionShape(op), op.outputs[0]
    return 4 * (_row_terms_words(shape) + (0 if dq.dtype == FLOAT else dq.size))


def key_blocks_per_multiprocessor() -> int:
    """The gradient's key launch's blocks that must fit a multiprocessor at once, as
    `KEY_BLOCKS_ENVIRONMENT` asks (0 where unset: as many as ptxas's registers allow)."""
    setting = os.environ.get(KEY_BLOCKS_ENVIRONMENT, "").strip()
    most = 2048 // THREADS  # a multiprocessor's threads
    if setting.isdigit() and int(setting) <= most:
        return int(setting)
    if setting:
        raise RanvierError(f"{KEY_BLOCKS_ENVIRONMENT}={setting!r}: expected a number of blocks from 1 to {most} "
                           "(or 0, or unset: no bound)")
    return 0


def launches(op: Operation) -> list[tuple]:
    shape = AttentionShape(op)
    query_blocks = shape.batch * shape.heads * -(-shape.queries // ROWS)

    def block(kernel: Callable, blocks_per_multiprocessor: int = 0) -> Callable[[ThreadContext, ir.Value], None]:
        def emit(ctx: ThreadContext, index: ir.Value) -> None:
            ctx.blocks_per_multiprocessor = blocks_per_multiprocessor
            kernel(BlockProgram(ctx, THREADS, ctx.on_gpu), op, shape, index_value(ctx.b, index))
        return emit

    if op.type == "Attention":
        return [(query_blocks, block(_forward), THREADS)]
    key_blocks = shape.batch * shape.kv_heads * -(-shape.keys // ROWS)
    made = [(query_blocks, block(_row_terms), THREADS),
            (key_blocks, block(_gradients, key_blocks_per_multiprocessor()), THREADS)]
    dq = op.outputs[0]
    if dq.dtype != FLOAT:
        made.append((dq.size, lambda ctx, index: _round_query_gradient(ctx, op, shape, index_value(ctx.b, index)), 0))
    return made


# ---- a warp's fragments -----------------------------------------------------------------

def _own_rows(thread: Value, first: Value) -> list[Value]:
    """The two rows, of a block's `ROWS` from `first`, whose fragments the thread holds."""
    warp, group, _ = warps.lane_of(thread)
    row = first + warp * 16 + group
    return [row, row + 8]


def _elements(columns: int, r: int) -> Iterator[tuple[int, int]]:
    """(offset in the fragment's columns from 2q, index in the lane's C fragments) of each
    float the lane holds of row r (of its two) of a 16 × `columns` product."""
    for j in range(columns // 8):
        for half in range(2):
            yield j * 8 + half, j * 4 + 2 * r + half


def _pack_rows(program: BlockProgram, var: Variable, rows: list[Value], size: int, words: PrivateArray) -> None:
    """A fragments of the warp's 16 rows of `var` (the element offsets of the lane's rows)."""
    ctx = program.ctx
    _, _, place = warps.lane_of(program.thread)
    for chunk in range(size // 16):
        for word in range(4):  # rows g, g + 8, g, g + 8; features 2q, 2q, 2q + 8, 2q + 8 (and one more each)
            at = rows[word % 2] + chunk * 16 + place * 2 + 8 * (word // 2)
            words.store(chunk * 4 + word, warps.pack(program, ctx.load(var, at + 1), ctx.load(var, at)))


def _zero(program: BlockProgram, array: PrivateArray, count: int) -> None:
    for i in range(count):
        array.store(i, program.ctx.constant(FLOAT, 0.0))


def _times_transposed(program: BlockProgram, size: int, count: int, tile: Array, base: Value, a_words: PrivateArray,
                      b_words: PrivateArray, out: PrivateArray, resident: Array | None = None) -> None:
    """out = A · Tᵀ over `count` rows of a shared tile T from word `base`, 32 features (or
    the last 16) at a time: 8 tile rows at a time, their B fragments (Tᵀ's columns: the
    rows as stored, 8 features a matrix) by ldmatrix, then one product per 16 features.
    A is the warp's 16 rows: packed in `a_words` (every 16 features' fragment), or rows
    of the block's `resident` tile, whose fragments of each 32 features are read into
    `a_words` just before their products (8 registers, not a whole row's)."""
    stride = _stride(size)

    def row(thread: Value) -> Value:  # lanes 8i .. 8i + 7: rows 0-7 of matrix i, features 8i on
        lane = thread % warps.WARP
        return base + lane % 8 * stride + lane // 8 * 4

    with program.phase(wait=False):
        _zero(program, out, count // 8 * 4)
    for first in range(0, size // 8, 4):
        chunks = range(first // 2, min(first // 2 + 2, size // 16))
        if resident is not None:
            _resident_fragments(program, size, resident, a_words, chunks)
        for j in range(count // 8):
            warps.load_matrices(program, (b_words, 0), tile, row, min(4, size // 8 - first), offset=j * 8 * stride + first * 4)
            for chunk in chunks:
                a_at = chunk % 2 * 4 if resident is not None else chunk * 4
                warps.mma(program, (out, j * 4), (a_words, a_at), (b_words, chunk % 2 * 2), (out, j * 4))


def _accumulate(program: BlockProgram, size: int, count: int, tile: Array, base: Value, weights: PrivateArray,
                a_words: PrivateArray, b_words: PrivateArray, out: PrivateArray) -> None:
    """out += W · T, W the lanes' C fragments over `count` rows of the shared tile T from
    word `base`: W's A fragment packed from two 8-column fragments, 16 tile rows at a
    time, then one product per 8 features, T's B fragments by a transposing ldmatrix (rows
    0-7 and 8-15 of the chunk, of 16 features)."""
    stride = _stride(size)

    def row(thread: Value) -> Value:  # matrix i: rows 8·(i mod 2) on, features 8·(i // 2) on
        lane = thread % warps.WARP
        return base + (lane // 8 % 2 * 8 + lane % 8) * stride + lane // 16 * 4

    for chunk in range(count // 16):
        with program.phase(wait=False):
            for word in range(4):  # rows g, g + 8 of columns 2q (and 2q + 1) of the chunk's first 8, then its last 8
                at = (2 * chunk + word // 2) * 4 + 2 * (word % 2)
                a_words.store(word, warps.pack(program, weights.load(at + 1), weights.load(at)))
        for pair in range(size // 16):
            warps.load_matrices(program, (b_words, 0), tile, row, transpose=True, offset=chunk * 16 * stride + pair * 8)
            for half in range(2):
                warps.mma(program, (out, (pair * 2 + half) * 4), (a_words, 0), (b_words, half * 2), (out, (pair * 2 + half) * 4))


def _copies(program: BlockProgram, rows: int, size: int, sources: int) -> int:
    """The most 16-byte copies a thread makes of `sources` tiles of `rows` rows (`_copy_rows`)."""
    return -(-rows * (size // warps.CHUNK) // program.threads) * sources


def _copy_rows(program: BlockProgram, copies: warps.AsyncCopies, first: Value, rows: int, last: Value | int, size: int,
               sources: list[tuple[Variable, Callable[[Value], Value], Array, Value]]) -> None:
    """The running thread's share of copying rows first .. first + rows − 1 (clamped to row
    `last`: a row past it is never used) of each source into its shared tile, 16 bytes of
    bfloat16 at a time (`warps.copy_chunk`: a bfloat16 source's by cp.async, a float32
    source's loaded and rounded at once). A source is (variable, the element offset of its
    row r, the tile, the tile's first word)."""
    ctx = program.ctx
    parts, stride = size // warps.CHUNK, _stride(size)

    def from_element(at: Value) -> Callable[[int, int], tuple[Value, Value | None]]:  # a chunk of a clamped row: all inside
        return lambda i, lanes: (at + i, None)

    with ctx.loop(program.thread, rows * parts, step=program.threads, name="piece") as piece:
        row, part = piece // parts, piece % parts
        for var, row_at, tile, base in sources:
            at = row_at((first + row).minimum(last)) + part * warps.CHUNK
            warps.copy_chunk(program, copies, tile, base + row * stride + part * (warps.CHUNK // 2), var, from_element(at),
                             warps.vector_lanes(var.dtype))


def _group_sum(program: BlockProgram, values: PrivateArray, partner: PrivateArray, combine=lambda a, b: a + b) -> None:
    """Each lane's two values combined over the four lanes that hold the same rows."""
    for mask in (1, 2):
        warps.exchange(program, partner, values, 2, mask)
        with program.phase(wait=False):
            for r in range(2):
                values.store(r, combine(values.load(r), partner.load(r)))


# ---- the kernels ------------------------------------------------------------------------

class _QueryBlock:
    """A block of query rows streaming key and value tiles: its head and rows, its
    privates, Q packed once."""

    def __init__(self, program: BlockProgram, op: Operation, shape: AttentionShape, block: Value):
        self.program, self.op, self.shape = program, op, shape
        size = shape.size
        query_blocks = -(-shape.queries // ROWS)
        head = block // query_blocks
        # a head's last rows first: under a causal mask they see the most keys, and the GPU
        # takes blocks in order, so the longest start first and the short ones fill the tail
        self.b, self.h = head // shape.heads, head % shape.heads
        self.first = (query_blocks - 1 - block % query_blocks) * ROWS
        self.per_tile, self.per_step = KEY_TILE, _scored_keys(size)
        self.q_words = program.private(dtypes.DT_INT32, size // 16 * 4)
        self.b_words = program.private(dtypes.DT_INT32, 4)  # B fragments of two products
        self.a_words = program.private(dtypes.DT_INT32, 4)
        self.scores = program.private(FLOAT, self.per_step // 8 * 4)
        self.tile_words = self.per_tile * _stride(size)
        self.keys, self.values = (program.shared(dtypes.DT_INT32, 2 * self.tile_words) for _ in range(2))  # two buffers each

    def rows(self, thread: Value) -> list[Value]:
        return _own_rows(thread, self.first)

    def row_offsets(self, thread: Value) -> list[Value]:
        """The element offsets of the thread's two rows (clamped to the last: a row past
        it is read, never written)."""
        return [self.shape.query_row(self.b, self.h, t.minimum(self.shape.queries - 1)) for t in self.rows(thread)]

    def pack(self) -> None:
        """Q's A fragments (in a phase)."""
        _pack_rows(self.program, self.op.inputs[0], self.row_offsets(self.program.thread), self.shape.size, self.q_words)

    def stream(self, per_step: Callable[[Value, Value], None]) -> None:
        """`per_step(first key, first word)` for each `per_step` keys of each tile of keys
        the block's queries see, their key and value rows in shared memory from that word,
        the next tile's on their way (`warps.pipelined`: one wait and one barrier a tile).
        A tile's steps are a loop, not unrolled: ptxas would interleave them (175
        registers at heads of 128, where one step's 166 leave room for three blocks an SM)."""
        program, shape, ctx = self.program, self.shape, self.program.ctx
        kv = self.h // shape.group
        last_query = (self.first + ROWS).minimum(shape.queries) - 1

        def load(tile: Value, buffer: Value, copies: warps.AsyncCopies) -> None:
            _copy_rows(program, copies, tile * self.per_tile, self.per_tile, shape.keys - 1, shape.size, [
                (self.op.inputs[1], lambda s: shape.key_row(self.b, kv, s), self.keys, buffer * self.tile_words),
                (self.op.inputs[2], lambda s: shape.key_row(self.b, kv, s), self.values, buffer * self.tile_words)])

        tiles = (shape.visible_keys(ctx, last_query) + self.per_tile - 1) // self.per_tile

        def use(tile: Value, buffer: Value) -> None:
            with ctx.loop(0, self.per_tile // self.per_step, name="step") as step:
                first = step * self.per_step
                per_step(tile * self.per_tile + first, buffer * self.tile_words + first * _stride(shape.size))

        warps.pipelined(program, tiles, _copies(program, self.per_tile, shape.size, 2), load, use)

    def masked_scores(self, first_key: Value, visit: Callable[[int, int, Value], None]) -> None:
        """Each score of the step's keys from `first_key` scaled, the bias added, −∞ where
        its query does not see its key; `visit(r, at, score)` for each (in a phase)."""
        program, shape, ctx = self.program, self.shape, self.program.ctx
        _, _, place = warps.lane_of(program.thread)
        for r, t in enumerate(self.rows(program.thread)):
            seen = shape.visible_keys(ctx, t).minimum(shape.keys)
            for column, at in _elements(self.per_step, r):
                s = first_key + place * 2 + column
                score = shape.score(ctx, self.scores.load(at), self.b, self.h, t.minimum(shape.queries - 1), s.minimum(shape.keys - 1))
                visit(r, at, (s < seen).where(score, -math.inf))


def _online_softmax(block: _QueryBlock, first_key: Value, peak, total, tile_peak, partner,
                    rescale: Callable[[int, Value], None], weigh: Callable[[int, int, Value], None]) -> None:
    """The online softmax over a step's masked scores: each row's maximum over its
    four lanes, m grown to it, the scores replaced by exp(score − m), the lane's share of l
    (and whatever `rescale(r, factor)` keeps) rescaled by exp(m_old − m), `weigh(r, at, p)`
    for each weight."""
    program = block.program
    with program.phase(wait=False):
        for r in range(2):
            tile_peak.store(r, program.ctx.constant(FLOAT, -math.inf))

        def keep(r: int, at: int, score: Value) -> None:
            block.scores.store(at, score)
            tile_peak.store(r, tile_peak.load(r).maximum(score))

        block.masked_scores(first_key, keep)
    _group_sum(program, tile_peak, partner, lambda a, b: a.maximum(b))
    with program.phase(wait=False):
        for r in range(2):
            grown = peak.load(r).maximum(tile_peak.load(r))
            finite = finite_peak(grown)
            correction = fastmath.exp(peak.load(r) - finite)
            share = total.load(r) * correction
            rescale(r, correction)
            for _, at in _elements(block.per_step, r):
                weight = fastmath.exp(block.scores.load(at) - finite)
                block.scores.store(at, weight)
                weigh(r, at, weight)
                share = share + weight
            total.store(r, share)
            peak.store(r, grown)


def _forward(program: BlockProgram, op: Operation, shape: AttentionShape, index: Value) -> None:
    ctx, size = program.ctx, shape.size
    block = _QueryBlock(program, op, shape, index)
    output = program.private(FLOAT, size // 8 * 4)
    peak, total, tile_peak, partner = (program.private(FLOAT, 2) for _ in range(4))
    with program.phase(wait=False):
        for r in range(2):
            peak.store(r, ctx.constant(FLOAT, -math.inf))
            total.store(r, ctx.constant(FLOAT, 0.0))
        _zero(program, output, size // 8 * 4)
        block.pack()

    def rescale(r: int, factor: Value) -> None:
        for _, at in _elements(size, r):
            output.store(at, output.load(at) * factor)

    def step(first_key: Value, base: Value) -> None:
        _times_transposed(program, size, block.per_step, block.keys, base, block.q_words, block.b_words, block.scores)
        _online_softmax(block, first_key, peak, total, tile_peak, partner, rescale, lambda r, at, p: None)
        _accumulate(program, size, block.per_step, block.values, base, block.scores, block.a_words, block.b_words, output)

    block.stream(step)
    _group_sum(program, total, partner)
    with program.phase(wait=False) as thread:
        _, _, place = warps.lane_of(thread)
        for r, t in enumerate(block.rows(thread)):
            inverse = unseen_inverse(total.load(r))
            with ctx.when(t < shape.queries):
                at = shape.query_row(block.b, block.h, t) + place * 2
                for column, i in _elements(size, r):
                    ctx.store(op.outputs[0], at + column, output.load(i) * inverse)
                if len(op.outputs) == 2:  # the row's four lanes hold the same m and l: the first stores L
                    with ctx.when(place.equal(0)):
                        statistic = log_sum_exp(finite_peak(peak.load(r)), total.load(r))
                        ctx.store(op.outputs[1], shape.statistic(block.b, block.h, t), statistic)


# ---- the gradient -----------------------------------------------------------------------

def _workspace_floats(ctx: ThreadContext, first: int) -> Array:
    """The step's workspace as float32 words, from word `first`."""
    b = ctx.b
    if ctx.workspace is None:
        raise RuntimeError("the attention gradient's kernels are written with the step's workspace")
    return Array(b, b.gep(b.bitcast(ctx.workspace, F32.as_pointer()), [ir.Constant(I64, first)]), FLOAT)


def _row_terms_of(ctx: ThreadContext) -> Array:
    """D of each query row [B, H, T] (the workspace's first words)."""
    return _workspace_floats(ctx, 0)


def _accumulator(ctx: ThreadContext, op: Operation, shape: AttentionShape) -> Array:
    """dq's float32 sums, element for element as dq is laid out: a float32 dq itself, else
    the workspace's after D."""
    dq = op.outputs[0]
    if dq.dtype == FLOAT:
        return Array(ctx.b, ctx.pointer(dq), FLOAT)
    return _workspace_floats(ctx, _row_terms_words(shape))


def _add_to(ctx: ThreadContext, array: Array, at: Value, offset: int, value: Value) -> None:
    """array[at + offset] += value in global memory, where other blocks add to it too: on
    the GPU red.global.add.f32 (an atomic add whose old value is not wanted), the constant
    `offset` the instruction's own (so a row's adds share one address register); on the
    host emulator, whose blocks run one after another, an add."""
    b = ctx.b
    pointer = b.gep(array.base, [ir_of(at)])
    if ctx.on_gpu:
        add = ir.InlineAsm(ir.FunctionType(VOID, [pointer.type, F32]), f"red.global.add.f32 [$0+{offset * 4}], $1;",
                           "l,f,~{memory}", side_effect=True)
        b.call(add, [pointer, value.ir])
        return
    pointer = b.gep(pointer, [ir.Constant(I64, offset)])
    b.store(b.fadd(b.load(pointer), value.ir), pointer)


def _row_part(ctx: ThreadContext, var: Variable, at: Value, count: int) -> list[Value]:
    """`count` elements of `var` from element `at`, 16 bytes a load (ld.global.v4: a row's
    halves start 16-byte aligned, as cp.async needs the rows to), as float32."""
    lanes = warps.vector_lanes(var.dtype)
    vectors = (warps.load_vector(ctx, var, at + first, lanes).cast(FLOAT) for first in range(0, count, lanes))
    return [vector.lane(lane) for vector in vectors for lane in range(lanes)]


def _row_terms(program: BlockProgram, op: Operation, shape: AttentionShape, index: Value) -> None:
    """Launch 1: D = Σ dout ∘ out of each of a block's 64 query rows, two threads a row
    (half each, summed by a shuffle), and the row's dq accumulator zeroed."""
    ctx, size = program.ctx, shape.size
    out, dout = op.inputs[3], op.inputs[5]
    query_blocks = -(-shape.queries // ROWS)
    head = index // query_blocks
    b, h, first = head // shape.heads, head % shape.heads, index % query_blocks * ROWS
    half = size // 2
    partial, other = program.private(FLOAT, 1), program.private(FLOAT, 1)
    with program.phase(wait=False) as thread:
        t = first + thread // 2
        at = shape.query_row(b, h, t.minimum(shape.queries - 1)) + thread % 2 * half
        products = zip(_row_part(ctx, out, at, half), _row_part(ctx, dout, at, half))
        sums = [x * y for x, y in itertools.islice(products, 4)]
        for i, (x, y) in enumerate(products):  # four independent sums: each multiply-add need not wait for the one before
            sums[i % 4] = x.mul_add(y, sums[i % 4])
        partial.store(0, pairwise(lambda x, y: x + y, sums))
        with ctx.when(t < shape.queries):
            sums_at = _accumulator(ctx, op, shape).base
            zeros = ir.Constant(ir.VectorType(F32, 4), None)
            for i in range(0, half, 4):  # st.global.v4
                ctx.b.store(zeros, typed_pointer(ctx.b, sums_at, ir_of(at + i), F32, 4), align=16)
    warps.exchange(program, other, partial, 1, 1)
    with program.phase(wait=False) as thread:
        t = first + thread // 2
        with ctx.when((t < shape.queries) & (thread % 2).equal(0)):
            _row_terms_of(ctx).store(shape.statistic(b, h, t), partial.load(0) + other.load(0))


def _resident_fragments(program: BlockProgram, size: int, tile: Array, words: PrivateArray, chunks: range) -> None:
    """A fragments of the warp's 16 rows of a block's `ROWS`-row shared tile, features
    16·c on for each c of `chunks` (into `words` from 4·(c mod 2)), by ldmatrix: rows 0-7
    and 8-15 of features 0-7, then of features 8-15."""
    stride = _stride(size)

    def row(thread: Value) -> Value:
        warp, lane = thread // warps.WARP, thread % warps.WARP
        return (warp * 16 + lane % 8 + lane // 8 % 2 * 8) * stride + lane // 16 * 4

    for chunk in chunks:
        warps.load_matrices(program, (words, chunk % 2 * 4), tile, row, offset=chunk * 8)


def _query_gradient_tile(program: BlockProgram, size: int, score_gradients: Array, keys: Array, a_words: PrivateArray,
                         b_words: PrivateArray, out: PrivateArray) -> None:
    """out = dS K of a tile: warp w's 16 query rows 16·(w mod 2) on, features w // 2 · size/2
    on, summed over the block's 64 keys. dS's A fragments from the tile of dSᵀ by a
    transposing ldmatrix (a fragment's rows are dSᵀ's columns), K's B fragments as
    `_accumulate` takes them, 8 or 16 features a load."""
    stride, ds_stride, groups = _stride(size), _score_gradient_stride(), size // 16  # a warp's 8-feature groups

    def gradient_row(thread: Value) -> Value:  # matrix i: keys 8·(i // 2) on, queries 8·(i mod 2) on
        warp, lane = thread // warps.WARP, thread % warps.WARP
        return (lane % 8 + lane // 16 * 8) * ds_stride + (warp % 2 * 16 + lane // 8 % 2 * 8) // 2

    def key_row(thread: Value) -> Value:  # matrix i: keys 8·(i mod 2) on, features 8·(i // 2) on
        warp, lane = thread // warps.WARP, thread % warps.WARP
        return (lane // 8 % 2 * 8 + lane % 8) * stride + lane // 16 * 4 + warp // 2 * (size // 4)

    with program.phase(wait=False):
        _zero(program, out, groups * 4)
    for chunk in range(ROWS // 16):
        warps.load_matrices(program, (a_words, 0), score_gradients, gradient_row, transpose=True, offset=chunk * 16 * ds_stride)
        for group in range(0, groups, 2):
            count = min(2, groups - group)
            warps.load_matrices(program, (b_words, 0), keys, key_row, count=2 * count, transpose=True,
                                offset=chunk * 16 * stride + group * 4)
            for half in range(count):
                at = (group + half) * 4
                warps.mma(program, (out, at), (a_words, 0), (b_words, half * 2), (out, at))


def _gradients(program: BlockProgram, op: Operation, shape: AttentionShape, index: Value) -> None:
    """Launch 2: a block of 64 key rows' dk and dv, and their share of dq, over every query
    of its group's heads that sees them (the module docstring)."""
    ctx, size = program.ctx, shape.size
    q, k, v, _, lse, dout = op.inputs[:6]
    _, dk, dv = op.outputs
    key_blocks = -(-shape.keys // ROWS)
    head = index // key_blocks
    b, kv, first_key = head // shape.kv_heads, head % shape.kv_heads, index % key_blocks * ROWS
    stride, ds_stride = _stride(size), _score_gradient_stride()
    keys, values = (program.shared(dtypes.DT_INT32, ROWS * stride) for _ in range(2))
    tile_words = QUERY_TILE * stride
    queries, douts = (program.shared(dtypes.DT_INT32, 2 * tile_words) for _ in range(2))  # two buffers each
    terms = program.shared(FLOAT, 2 * 2 * QUERY_TILE)  # each buffer's L, then D, of its queries
    score_gradients = program.shared(dtypes.DT_INT32, ROWS * ds_stride)  # dSᵀ, a key's row of bfloat16 a tile
    a_words, b_words = program.private(dtypes.DT_INT32, 8), program.private(dtypes.DT_INT32, 4)  # 32 features' A fragments
    packed = program.private(dtypes.DT_INT32, 4)  # a C fragment's A fragment
    weights, gradients = (program.private(FLOAT, QUERY_TILE // 8 * 4) for _ in range(2))  # Pᵀ, then dPᵀ and dSᵀ
    dk_sum, dv_sum = (program.private(FLOAT, size // 8 * 4) for _ in range(2))
    dq_part = program.private(FLOAT, size // 16 * 4)
    resident = warps.AsyncCopies(program, _copies(program, ROWS, size, 2), groups=1)
    with program.phase():  # the block's key and value rows, there for every tile
        _copy_rows(program, resident, first_key, ROWS, shape.keys - 1, size, [
            (k, lambda s: shape.key_row(b, kv, s), keys, ctx.index(0)),
            (v, lambda s: shape.key_row(b, kv, s), values, ctx.index(0))])
        resident.commit()
        resident.wait(0)
        _zero(program, dk_sum, size // 8 * 4)
        _zero(program, dv_sum, size // 8 * 4)
    # the tiles of query rows from the first query that sees the block's first key, in each head of the group
    first_seen = (first_key - (shape.keys - shape.queries)).maximum(0) if shape.causal else ctx.index(0)
    first_tile = first_seen // QUERY_TILE
    per_head = -(-shape.queries // QUERY_TILE) - first_tile

    def head_and_query(i: Value) -> tuple[Value, Value]:
        return kv * shape.group + i // per_head, (first_tile + i % per_head) * QUERY_TILE

    def load(i: Value, buffer: Value, copies: warps.AsyncCopies) -> None:
        h, first_query = head_and_query(i)
        _copy_rows(program, copies, first_query, QUERY_TILE, shape.queries - 1, size, [
            (q, lambda t: shape.query_row(b, h, t), queries, buffer * tile_words),
            (dout, lambda t: shape.query_row(b, h, t), douts, buffer * tile_words)])
        with ctx.loop(program.thread, QUERY_TILE, step=program.threads, name="row") as row:
            at = shape.statistic(b, h, (first_query + row).minimum(shape.queries - 1))
            terms.store(buffer * 2 * QUERY_TILE + row, ctx.load(lse, at))
            terms.store((buffer * 2 + 1) * QUERY_TILE + row, _row_terms_of(ctx).load(at))

    def use(i: Value, buffer: Value) -> None:
        h, first_query = head_and_query(i)
        base = buffer * tile_words
        _times_transposed(program, size, QUERY_TILE, queries, base, a_words, b_words, weights, resident=keys)  # Sᵀ
        _times_transposed(program, size, QUERY_TILE, douts, base, a_words, b_words, gradients, resident=values)  # dPᵀ
        with program.phase() as thread:
            warp, group, place = warps.lane_of(thread)
            for r, s in enumerate(_own_rows(thread, first_key)):
                for column, held in _elements(QUERY_TILE, r):
                    t = first_query + place * 2 + column
                    at = buffer * 2 * QUERY_TILE + place * 2 + column
                    lse_t, d = terms.load(at), terms.load(at + QUERY_TILE)
                    score = shape.score(ctx, weights.load(held), b, h, t.minimum(shape.queries - 1), s.minimum(shape.keys - 1))
                    seen = (t < shape.queries) & (s < shape.visible_keys(ctx, t).minimum(shape.keys))
                    p = seen.where(fastmath.exp(score - lse_t), 0.0)
                    weights.store(held, p)
                    gradients.store(held, p * (gradients.load(held) - d) * shape.scale)
                for j in range(QUERY_TILE // 8):  # dSᵀ's row s, queries 8j + 2q and 8j + 2q + 1, in one word
                    word = (warp * 16 + group + 8 * r) * ds_stride + j * 4 + place
                    score_gradients.store(word, warps.pack(program, gradients.load(j * 4 + 2 * r + 1), gradients.load(j * 4 + 2 * r)))
        _accumulate(program, size, QUERY_TILE, douts, base, weights, packed, b_words, dv_sum)
        _accumulate(program, size, QUERY_TILE, queries, base, gradients, packed, b_words, dk_sum)
        _query_gradient_tile(program, size, score_gradients, keys, a_words, b_words, dq_part)
        with program.phase(wait=False) as thread:
            warp, group, place = warps.lane_of(thread)
            accumulator = _accumulator(ctx, op, shape)
            for r in range(2):
                t = first_query + warp % 2 * 16 + group + 8 * r
                with ctx.when(t < shape.queries):
                    at = shape.query_row(b, h, t) + warp // 2 * (size // 2) + place * 2
                    for column, held in _elements(size // 2, r):
                        _add_to(ctx, accumulator, at, column, dq_part.load(held))

    warps.pipelined(program, ctx.index(shape.group) * per_head, _copies(program, QUERY_TILE, size, 2), load, use)
    with program.phase(wait=False) as thread:
        _, _, place = warps.lane_of(thread)
        for r, s in enumerate(_own_rows(thread, first_key)):
            with ctx.when(s < shape.keys):
                at = shape.key_row(b, kv, s) + place * 2
                for column, i in _elements(size, r):
                    ctx.store(dk, at + column, dk_sum.load(i))
                    ctx.store(dv, at + column, dv_sum.load(i))


def _round_query_gradient(ctx: ThreadContext, op: Operation, shape: AttentionShape, index: Value) -> None:
    """Launch 3 of a bfloat16 dq: element `index` of the float32 accumulator, rounded into dq."""
    ctx.store(op.outputs[0], index, _accumulator(ctx, op, shape).load(index))


LIBRARY.register(Generator("AttentionMMA", None, launches, supports=supports, workspace=_workspace_bytes, rank=120))
