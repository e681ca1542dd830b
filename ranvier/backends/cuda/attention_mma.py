"""Attention and its gradient on tensor cores, FlashAttention-2's way: float32 operands of
a compile whose matrix products run in bfloat16 (`Compiler(matmul="bfloat16")` marks the
ops' precision), or bfloat16 operands (`Compiler(precision="bfloat16")`'s activations);
head sizes a multiple of 16 up to 128. Every product is a warp's `warps.mma` (bfloat16
inputs, float32 sums); no score matrix is formed.

A block of `WARPS` warps takes 64 rows, 16 a warp (the rows of an mma's A), and the warps
stream tiles of the rows they pair with through shared memory together, in bfloat16 (rows
padded by `PADDING` elements, 16 bytes, so the eight rows an ldmatrix reads fall on
different banks). A warp's own rows are rounded and packed into A fragments once; a
tile's rows come in as B fragments by `warps.load_matrices` (ldmatrix; transposed where
the tile is the product's right-hand side as stored); a product's float32 C fragments
become the next product's A fragments in place (the layouts line up), so the
probabilities never leave the registers. Tiles are double-buffered (`warps.pipelined`): the
next tile's copies are issued before this tile's products, bfloat16 rows by
`warps.copy_async` (cp.async, 16 bytes a thread at a time) so they land while the tensor
cores work; float32 rows are loaded and rounded by the threads at once.

Attention: query rows streaming key and value tiles. Per tile: S = Q Kᵀ, scaled, the bias
added, −∞ where the causal mask hides a key or past the last; the online softmax, each
row's maximum taken over the four lanes that hold the row (two `warps.exchange`s), the
running sum l kept as each lane's own share until the end; O += P V.

AttentionGrad, three launches as the float32 kernels' (`attention.py`), the same parked
statistics in the first elements of a dq row (in a bfloat16 row, each statistic's float32
bits in two elements, so none is rounded):
1. query rows streaming key and value tiles: S and dP = dO Vᵀ; m and l online as above,
   and D = Σₛ pₛ dPₛ beside l; parked m, 1/l and D/l;
2. key rows streaming tiles of query rows, their dout rows and parked statistics, in every
   head of the key's group: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, Pᵀ from the parked m and 1/l of each
   column's query, dSᵀ = Pᵀ ∘ (dPᵀ − D); dV += Pᵀ dO, dK += scale · dSᵀ Q;
3. query rows streaming key and value tiles: dQ += scale · dS K, with dS recomputed.
A query whose every key is masked attends to nothing (its row and gradients are 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ..llvm.context import Array, ir_of
from ..llvm.irutil import F32, I16, I32, load, storage_type, store, typed_pointer
from ..llvm.rows import finite_peak, unseen_inverse
from ..llvm.values import Value, index_value
from . import fastmath, warps
from .attention import PARKED, AttentionShape
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


def supports(op: Operation) -> bool:
    """Float32 operands whose products may round to bfloat16 (the op's precision), or
    bfloat16 operands (`Compiler(precision="bfloat16")`'s activations)."""
    if op.type not in ("Attention", "AttentionGrad") or len(op.outputs) == 2:
        return False
    size = op.inputs[0].shape[-1]
    operands = {v.dtype for v in (*op.inputs, *op.outputs)}
    rounded = attrs_of(op)["precision"] == "bfloat16" and operands == {FLOAT}
    return (rounded or operands == {dtypes.DT_BFLOAT16}) and size % 16 == 0 and 16 <= size <= 128


def _key_tile(size: int) -> int:
    """Key rows a streamed tile holds: its key and value rows, padded and double-buffered,
    in 40 KiB of bfloat16."""
    return 64 if size <= 64 else 32


def _stride(size: int) -> int:
    """32-bit words from one row of a shared tile to the next: `size` bfloat16 and the padding."""
    return (size + PADDING) // 2


def launches(op: Operation) -> list[tuple]:
    shape = AttentionShape(op)
    query_blocks = shape.batch * shape.heads * -(-shape.queries // ROWS)

    def block(kernel: Callable) -> Callable[[ThreadContext, ir.Value], None]:
        return lambda ctx, index: kernel(BlockProgram(ctx, THREADS, ctx.on_gpu), op, shape, index_value(ctx.b, index))

    if op.type == "Attention":
        return [(query_blocks, block(_forward), THREADS)]
    key_blocks = shape.batch * shape.kv_heads * -(-shape.keys // ROWS)
    return [(query_blocks, block(_statistics), THREADS), (key_blocks, block(_key_gradients), THREADS),
            (query_blocks, block(_query_gradient), THREADS)]


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


def _park(ctx: ThreadContext, dq: Variable, at: Value, k: int, value: Value) -> None:
    """Statistic k (m, 1/l or D) of the query row at element `at`, kept in its dq row until
    the third launch: element k of a float32 row; in a bfloat16 row, its float32 bits in
    elements 2k and 2k + 1 (the low half first), so nothing is rounded."""
    if dq.dtype == FLOAT:
        ctx.store(dq, at + k, value)
        return
    b = ctx.b
    bits = b.bitcast(value.ir, I32)
    for half, part in enumerate((bits, b.lshr(bits, ir.Constant(I32, 16)))):
        store(b, b.trunc(part, I16), ctx.pointer(dq), ir_of(at + 2 * k + half), I16)


def _parked(ctx: ThreadContext, dq: Variable, at: Value, k: Value | int) -> Value:
    """Statistic k of the query row at `at`, as `_park` left it."""
    if dq.dtype == FLOAT:
        return ctx.load(dq, at + k)
    b = ctx.b
    low, high = (b.zext(load(b, ctx.pointer(dq), ir_of(at + k * 2 + half), I16), I32) for half in (0, 1))
    return Value(b, b.bitcast(b.or_(low, b.shl(high, ir.Constant(I32, 16))), ir.FloatType()), FLOAT)


def _zero(program: BlockProgram, array: PrivateArray, count: int) -> None:
    for i in range(count):
        array.store(i, program.ctx.constant(FLOAT, 0.0))


def _times_transposed(program: BlockProgram, size: int, count: int, tile: Array, base: Value, a_words: PrivateArray,
                      b_words: PrivateArray, out: PrivateArray) -> None:
    """out = A · Tᵀ over `count` rows of a shared tile T from word `base`: 8 tile rows at a
    time, their B fragments (Tᵀ's columns: the rows as stored, 8 features a matrix) by
    ldmatrix, 32 features (or the last 16) at a time, then one product per 16 features."""
    stride = _stride(size)

    def row(thread: Value) -> Value:  # lanes 8i .. 8i + 7: rows 0-7 of matrix i, features 8i on
        lane = thread % warps.WARP
        return base + lane % 8 * stride + lane // 8 * 4

    for j in range(count // 8):
        with program.phase(wait=False):
            for i in range(4):
                out.store(j * 4 + i, program.ctx.constant(FLOAT, 0.0))
        for first in range(0, size // 8, 4):  # two chunks of 16 features (or the last one)
            warps.load_matrices(program, (b_words, 0), tile, row, min(4, size // 8 - first), offset=j * 8 * stride + first * 4)
            for chunk in range(first // 2, min(first // 2 + 2, size // 16)):
                warps.mma(program, (out, j * 4), (a_words, chunk * 4), (b_words, chunk % 2 * 2), (out, j * 4))


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
    return -(-rows * (size // 8) // program.threads) * sources


def _copy_rows(program: BlockProgram, copies: warps.AsyncCopies, first: Value, rows: int, last: Value | int, size: int,
               sources: list[tuple[Variable, Callable[[Value], Value], Array, Value]]) -> None:
    """The running thread's share of copying rows first .. first + rows − 1 (clamped to row
    `last`: a row past it is never used) of each source into its shared tile, 16 bytes of
    bfloat16 at a time: a bfloat16 source's by cp.async, a float32 source's loaded and
    rounded at once. A source is (variable, the element offset of its row r, the tile, the
    tile's first word)."""
    ctx = program.ctx
    parts, stride = size // 8, _stride(size)
    with ctx.loop(program.thread, rows * parts, step=program.threads, name="piece") as piece:
        row, part = piece // parts, piece % parts
        for var, row_at, tile, base in sources:
            at, word = row_at((first + row).minimum(last)) + part * 8, base + row * stride + part * 4
            if var.dtype == dtypes.DT_BFLOAT16:
                copies.copy(tile, word, typed_pointer(ctx.b, ctx.pointer(var), ir_of(at), storage_type(var.dtype)))
            else:  # two aligned vectors of 4 float32 (ld.global.v4), rounded in pairs
                b = ctx.b
                halves = [b.load(typed_pointer(b, ctx.pointer(var), ir_of(at + 4 * h), F32, 4), align=16) for h in range(2)]
                floats = [Value(b, b.extract_element(halves[k // 4], ir.Constant(I32, k % 4)), FLOAT) for k in range(8)]
                for k in range(4):
                    tile.store(word + k, warps.pack(program, floats[2 * k + 1], floats[2 * k]))


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
    privates, Q (and dout) packed once."""

    def __init__(self, program: BlockProgram, op: Operation, shape: AttentionShape, block: Value, with_gradient: bool):
        self.program, self.op, self.shape = program, op, shape
        size = shape.size
        query_blocks = -(-shape.queries // ROWS)
        head = block // query_blocks
        # a head's last rows first: under a causal mask they see the most keys, and the GPU
        # takes blocks in order, so the longest start first and the short ones fill the tail
        self.b, self.h = head // shape.heads, head % shape.heads
        self.first = (query_blocks - 1 - block % query_blocks) * ROWS
        self.per_tile = _key_tile(size)
        self.q_words = program.private(dtypes.DT_INT32, size // 16 * 4)
        self.g_words = program.private(dtypes.DT_INT32, size // 16 * 4) if with_gradient else None  # dout's
        self.b_words = program.private(dtypes.DT_INT32, 4)  # B fragments of two products
        self.a_words = program.private(dtypes.DT_INT32, 4)
        self.scores = program.private(FLOAT, self.per_tile // 8 * 4)
        self.tile_words = self.per_tile * _stride(size)
        self.keys, self.values = (program.shared(dtypes.DT_INT32, 2 * self.tile_words) for _ in range(2))  # two buffers each

    @property
    def dout_words(self) -> PrivateArray:
        """dout's A fragments, in a block made with its gradient."""
        if self.g_words is None:
            raise RuntimeError("a query block made without the gradient has no fragments of dout")
        return self.g_words

    def rows(self, thread: Value) -> list[Value]:
        return _own_rows(thread, self.first)

    def row_offsets(self, thread: Value) -> list[Value]:
        """The element offsets of the thread's two rows (clamped to the last: a row past
        it is read, never written)."""
        return [self.shape.query_row(self.b, self.h, t.minimum(self.shape.queries - 1)) for t in self.rows(thread)]

    def pack(self) -> None:
        """Q's A fragments, and dout's where the kernel has them (in a phase)."""
        offsets = self.row_offsets(self.program.thread)
        _pack_rows(self.program, self.op.inputs[0], offsets, self.shape.size, self.q_words)
        if self.g_words is not None:
            _pack_rows(self.program, self.op.inputs[5], offsets, self.shape.size, self.g_words)

    def stream(self, per_tile: Callable[[Value, Value], None]) -> None:
        """`per_tile(first key, first word)` for each tile of keys the block's queries see,
        the tile's key and value rows in shared memory from that word, the next tile's
        on their way (`warps.pipelined`)."""
        program, shape, ctx = self.program, self.shape, self.program.ctx
        kv = self.h // shape.group
        last_query = (self.first + ROWS).minimum(shape.queries) - 1

        def load(tile: Value, buffer: Value, copies: warps.AsyncCopies) -> None:
            _copy_rows(program, copies, tile * self.per_tile, self.per_tile, shape.keys - 1, shape.size, [
                (self.op.inputs[1], lambda s: shape.key_row(self.b, kv, s), self.keys, buffer * self.tile_words),
                (self.op.inputs[2], lambda s: shape.key_row(self.b, kv, s), self.values, buffer * self.tile_words)])

        tiles = (shape.visible_keys(ctx, last_query) + self.per_tile - 1) // self.per_tile
        warps.pipelined(program, tiles, _copies(program, self.per_tile, shape.size, 2), load,
                   lambda tile, buffer: per_tile(tile * self.per_tile, buffer * self.tile_words))

    def masked_scores(self, first_key: Value, visit: Callable[[int, int, Value], None]) -> None:
        """Each score of the tile scaled, the bias added, −∞ where its query does not see
        its key; `visit(r, at, score)` for each (in a phase)."""
        program, shape, ctx = self.program, self.shape, self.program.ctx
        _, _, place = warps.lane_of(program.thread)
        for r, t in enumerate(self.rows(program.thread)):
            seen = shape.visible_keys(ctx, t).minimum(shape.keys)
            for column, at in _elements(self.per_tile, r):
                s = first_key + place * 2 + column
                score = shape.score(ctx, self.scores.load(at), self.b, self.h, t.minimum(shape.queries - 1), s.minimum(shape.keys - 1))
                visit(r, at, (s < seen).where(score, -math.inf))


def _online_softmax(block: _QueryBlock, first_key: Value, peak, total, tile_peak, partner,
                    rescale: Callable[[int, Value], None], weigh: Callable[[int, int, Value], None]) -> None:
    """The online softmax's step over a tile of masked scores: each row's maximum over its
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
            for _, at in _elements(block.per_tile, r):
                weight = fastmath.exp(block.scores.load(at) - finite)
                block.scores.store(at, weight)
                weigh(r, at, weight)
                share = share + weight
            total.store(r, share)
            peak.store(r, grown)


def _forward(program: BlockProgram, op: Operation, shape: AttentionShape, index: Value) -> None:
    ctx, size = program.ctx, shape.size
    block = _QueryBlock(program, op, shape, index, with_gradient=False)
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

    def tile(first_key: Value, base: Value) -> None:
        _times_transposed(program, size, block.per_tile, block.keys, base, block.q_words, block.b_words, block.scores)
        _online_softmax(block, first_key, peak, total, tile_peak, partner, rescale, lambda r, at, p: None)
        _accumulate(program, size, block.per_tile, block.values, base, block.scores, block.a_words, block.b_words, output)

    block.stream(tile)
    _group_sum(program, total, partner)
    with program.phase(wait=False) as thread:
        _, _, place = warps.lane_of(thread)
        for r, t in enumerate(block.rows(thread)):
            inverse = unseen_inverse(total.load(r))
            with ctx.when(t < shape.queries):
                at = shape.query_row(block.b, block.h, t) + place * 2
                for column, i in _elements(size, r):
                    ctx.store(op.outputs[0], at + column, output.load(i) * inverse)


def _statistics(program: BlockProgram, op: Operation, shape: AttentionShape, index: Value) -> None:
    """Launch 1: m, 1/l and D of each query row, parked in its dq row."""
    ctx, size = program.ctx, shape.size
    dq = op.outputs[0]
    block = _QueryBlock(program, op, shape, index, with_gradient=True)
    products = program.private(FLOAT, block.per_tile // 8 * 4)  # dP = dout Vᵀ
    peak, total, d, tile_peak, partner = (program.private(FLOAT, 2) for _ in range(5))
    with program.phase(wait=False):
        for r in range(2):
            peak.store(r, ctx.constant(FLOAT, -math.inf))
            total.store(r, ctx.constant(FLOAT, 0.0))
            d.store(r, ctx.constant(FLOAT, 0.0))
        block.pack()

    def tile(first_key: Value, base: Value) -> None:
        _times_transposed(program, size, block.per_tile, block.keys, base, block.q_words, block.b_words, block.scores)
        _times_transposed(program, size, block.per_tile, block.values, base, block.dout_words, block.b_words, products)
        _online_softmax(block, first_key, peak, total, tile_peak, partner, lambda r, factor: d.store(r, d.load(r) * factor),
                        lambda r, at, p: d.store(r, p.mul_add(products.load(at), d.load(r))))

    block.stream(tile)
    _group_sum(program, total, partner)
    _group_sum(program, d, partner)
    with program.phase(wait=False) as thread:
        for r, t in enumerate(block.rows(thread)):
            inverse = unseen_inverse(total.load(r))
            with ctx.when(t < shape.queries):  # the four lanes of a row store the same three values
                at = shape.query_row(block.b, block.h, t)
                for k, value in enumerate((finite_peak(peak.load(r)), inverse, d.load(r) * inverse)):
                    _park(ctx, dq, at, k, value)


def _query_gradient(program: BlockProgram, op: Operation, shape: AttentionShape, index: Value) -> None:
    """Launch 3: each query row's dq, from its parked m, 1/l and D (read before the row is written)."""
    ctx, size = program.ctx, shape.size
    dq = op.outputs[0]
    block = _QueryBlock(program, op, shape, index, with_gradient=True)
    products = program.private(FLOAT, block.per_tile // 8 * 4)
    parked = program.private(FLOAT, 2 * PARKED)
    gradient = program.private(FLOAT, size // 8 * 4)
    with program.phase(wait=False) as thread:
        for r, at in enumerate(block.row_offsets(thread)):
            for k in range(PARKED):
                parked.store(r * PARKED + k, _parked(ctx, dq, at, k))
        _zero(program, gradient, size // 8 * 4)
        block.pack()

    def tile(first_key: Value, base: Value) -> None:
        _times_transposed(program, size, block.per_tile, block.keys, base, block.q_words, block.b_words, block.scores)
        _times_transposed(program, size, block.per_tile, block.values, base, block.dout_words, block.b_words, products)
        with program.phase(wait=False):
            def score_gradient(r: int, at: int, score: Value) -> None:
                peak, inverse, d = (parked.load(r * PARKED + k) for k in range(PARKED))
                p = fastmath.exp(score - peak) * inverse
                block.scores.store(at, p * (products.load(at) - d))

            block.masked_scores(first_key, score_gradient)
        _accumulate(program, size, block.per_tile, block.keys, base, block.scores, block.a_words, block.b_words, gradient)

    block.stream(tile)
    with program.phase(wait=False) as thread:
        _, _, place = warps.lane_of(thread)
        for r, t in enumerate(block.rows(thread)):
            with ctx.when(t < shape.queries):
                at = shape.query_row(block.b, block.h, t) + place * 2
                for column, i in _elements(size, r):
                    ctx.store(dq, at + column, gradient.load(i) * shape.scale)


def _key_gradients(program: BlockProgram, op: Operation, shape: AttentionShape, index: Value) -> None:
    """Launch 2: each key row's dk and dv, over every query of its group's heads that sees
    it, streaming tiles of query rows, their dout rows and parked (m, 1/l, D)."""
    ctx, size = program.ctx, shape.size
    q, k, v, _, _, dout = op.inputs[:6]
    dq, dk, dv = op.outputs
    key_blocks = -(-shape.keys // ROWS)
    head = index // key_blocks
    b, kv, first_key = head // shape.kv_heads, head % shape.kv_heads, index % key_blocks * ROWS
    k_words, v_words = (program.private(dtypes.DT_INT32, size // 16 * 4) for _ in range(2))
    b_words, a_words = program.private(dtypes.DT_INT32, 4), program.private(dtypes.DT_INT32, 4)
    weights, gradients = (program.private(FLOAT, QUERY_TILE // 8 * 4) for _ in range(2))  # Pᵀ, then dPᵀ and dSᵀ
    dk_sum, dv_sum = (program.private(FLOAT, size // 8 * 4) for _ in range(2))
    tile_words, parked_row = QUERY_TILE * _stride(size), PARKED  # an odd stride: the rows a warp reads on different banks
    queries, douts = (program.shared(dtypes.DT_INT32, 2 * tile_words) for _ in range(2))  # two buffers each
    parked = program.shared(FLOAT, 2 * QUERY_TILE * parked_row)
    with program.phase(wait=False) as thread:
        offsets = [shape.key_row(b, kv, s.minimum(shape.keys - 1)) for s in _own_rows(thread, first_key)]
        _pack_rows(program, k, offsets, size, k_words)
        _pack_rows(program, v, offsets, size, v_words)
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
        with ctx.loop(program.thread, QUERY_TILE * PARKED, step=program.threads, name="e") as e:
            row, statistic = e // PARKED, e % PARKED
            at = shape.query_row(b, h, (first_query + row).minimum(shape.queries - 1))
            parked.store((buffer * QUERY_TILE + row) * parked_row + statistic, _parked(ctx, dq, at, statistic))

    def use(i: Value, buffer: Value) -> None:
        h, first_query = head_and_query(i)
        base = buffer * tile_words
        _times_transposed(program, size, QUERY_TILE, queries, base, k_words, b_words, weights)  # Sᵀ
        _times_transposed(program, size, QUERY_TILE, douts, base, v_words, b_words, gradients)  # dPᵀ
        with program.phase(wait=False) as thread:
            _, _, place = warps.lane_of(thread)
            for r, s in enumerate(_own_rows(thread, first_key)):
                for column, held in _elements(QUERY_TILE, r):
                    t = first_query + place * 2 + column
                    row = (buffer * QUERY_TILE + place * 2 + column) * parked_row
                    peak, inverse, d = (parked.load(row + i) for i in range(PARKED))
                    score = shape.score(ctx, weights.load(held), b, h, t.minimum(shape.queries - 1), s.minimum(shape.keys - 1))
                    seen = (t < shape.queries) & (s < shape.visible_keys(ctx, t).minimum(shape.keys))
                    p = seen.where(fastmath.exp(score - peak) * inverse, 0.0)
                    weights.store(held, p)
                    gradients.store(held, p * (gradients.load(held) - d))
        _accumulate(program, size, QUERY_TILE, douts, base, weights, a_words, b_words, dv_sum)
        _accumulate(program, size, QUERY_TILE, queries, base, gradients, a_words, b_words, dk_sum)

    warps.pipelined(program, ctx.index(shape.group) * per_head, _copies(program, QUERY_TILE, size, 2), load, use)
    with program.phase(wait=False) as thread:
        _, _, place = warps.lane_of(thread)
        for r, s in enumerate(_own_rows(thread, first_key)):
            with ctx.when(s < shape.keys):
                at = shape.key_row(b, kv, s) + place * 2
                for column, i in _elements(size, r):
                    ctx.store(dk, at + column, dk_sum.load(i) * shape.scale)
                    ctx.store(dv, at + column, dv_sum.load(i))


LIBRARY.register(Generator("AttentionMMA", None, launches, supports=supports, rank=120))
