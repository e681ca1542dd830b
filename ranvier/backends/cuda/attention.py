"""Attention and its gradient as GPU block kernels that never form the T × S score matrix:
a block of `TILE` threads takes `TILE` query rows (or key rows), one per thread, and streams
the rows they pair with through shared memory: the block's threads load a tile of them
together, once (`blocks.BlockProgram`), and every thread reads all of it.

Attention: query rows stream key and value tiles; each thread runs an online softmax over
its visible keys (the running maximum m, the running sum l, and the output row rescaled
when m grows). With statistics, the row's first lane writes L = m + log l (+∞ where l is
0: a query that sees no key).

AttentionGrad, from the forward's output and statistics, two launches that park nothing:
1. key rows streaming tiles of queries, their dout rows and L, in every head of the key's
   group: dk and dv, each pₛ = exp(scale · q · kₛ + bias − L) recomputed (0 in a row that
   sees no key, whose L is +∞). A tile's D = Σ dout ∘ out per query row is summed as its
   dout rows are copied in, row j by the threads of the block's row j (their lanes' parts
   added by shuffles), its out row read beside: every key block reads the out rows again
   (the tile's loads grow by half, from L2, issued with the q rows' before the one wait),
   but the products grow by 1/(4·TILE), and a pass of its own would cost a launch, a
   read of out and dout from memory and a buffer to park D in (parked in dq it would be
   rounded with half-precision operands);
2. query rows streaming key and value tiles: dq = scale · Σₛ pₛ (dout · vₛ − D) kₛ, D
   from the thread's own dout row and its out row, read once.
Any head size. Half-precision operands are loaded widened to float32 and the results
rounded once as they are stored; L and D are never rounded. Where the compile's products
run in bfloat16, `attention_mma.py`'s tensor-core kernels take head sizes that are
multiples of 16 instead.

A thread's own rows (its query's q and dout, its key's k and v, the rows it sums into) are
read from memory once, into private arrays: reading them from the operand at every key
instead had each of a warp's loads touch 32 lines (the rows are a head apart). For head
sizes up to `UNROLLED_SIZE` the loops along a row are unrolled, so LLVM reaches those
arrays at known indices and keeps them in registers; longer rows live in the thread's
local memory. Where a launch's rows would hold more than `ROW_REGISTERS` floats a thread
(the key gradients' four rows from head size 64 on, the query gradient's three and the
forward's two at 128: ptxas spilled hundreds of bytes of them), `parts` adjacent lanes of
a warp share each row (`RowThreads`), each holding every `parts`-th element: a block is
then `TILE` rows of `parts` threads, and each dot product with a streamed row is summed
over the row's lanes by warp shuffles (`warps.exchange`), a chunk of `SCORES` keys at a
time. An unrolled dot product runs over independent sums, so each multiply-add need not
wait for the one before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ...ops.attention import bias_dims, bias_of, bias_offset, heads_first_shape, scale_of
from ..llvm.context import Array
from ..llvm.loops import pairwise
from ..llvm.rows import finite_peak, log_sum_exp, unseen_inverse
from ..llvm.values import Value, index_value
from .blocks import BlockProgram, PrivateArray, barrier
from .library import LIBRARY, Generator
from .warps import exchange

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

TILE = 32  # a block's rows
UNROLLED_SIZE = 128  # head sizes whose loops along a row are unrolled, the thread's rows in registers
# A block's streamed tiles: whole tiles (`TILE` rows) of 4-byte elements up to head sizes of
# `UNROLLED_SIZE`, the key launch's two rows and L and D each (33,024 bytes at 128: a tile of
# 31 rows in the 32 KiB before); longer rows and float64's take fewer rows, not more memory
SHARED_BYTES = TILE * (2 * UNROLLED_SIZE + 2) * 4
ROW_REGISTERS = 128  # registers of its own rows a thread keeps: more are split over lanes
SCORES = 4  # streamed rows whose dot products a split row's lanes sum at once
_CHAINS = 4  # independent partial sums of an unrolled dot product


def supports(op: Operation) -> bool:
    """Either layout: [B, heads, T, hd], or [B, T, heads, hd] (rows heads · hd apart, read
    and written in place, so a Llama's projections need no transposes)."""
    return op.type in ("Attention", "AttentionGrad")


class AttentionShape:
    """An attention op's sizes and the element offsets of its rows."""

    def __init__(self, op: Operation):
        attrs = attrs_of(op)
        self.heads_first = attrs["heads_first"]
        q, k = (heads_first_shape(v.shape, self.heads_first) for v in op.inputs[:2])
        self.batch, self.heads, self.queries, self.size = q
        self.kv_heads, self.keys = k[1], k[2]
        self.group = self.heads // self.kv_heads
        self.causal, self.scale = attrs["causal"], scale_of(attrs, self.size)
        self.query_tiles, self.key_tiles = -(-self.queries // TILE), -(-self.keys // TILE)
        self.bias = bias_of(op)
        self.bias_dims = bias_dims(self.bias.shape) if self.bias is not None else None

    def score(self, ctx: ThreadContext, product: Value, b: Value, h: Value, t: Value, s: Value) -> Value:
        """Query t's score of key s from their dot product: scaled, plus the bias."""
        score = product * self.scale
        if self.bias is None:
            return score
        return score + ctx.load(self.bias, bias_offset(self.bias_dims, b, h, t, s))

    def statistic(self, b: Value, h: Value, t: Value) -> Value:
        """The element of query t's L in the statistics [B, H, T] (either layout)."""
        return (b * self.heads + h) * self.queries + t

    def query_row(self, b: Value, h: Value, t: Value) -> Value:
        if self.heads_first:
            return ((b * self.heads + h) * self.queries + t) * self.size
        return ((b * self.queries + t) * self.heads + h) * self.size

    def key_row(self, b: Value, kv: Value, s: Value) -> Value:
        if self.heads_first:
            return ((b * self.kv_heads + kv) * self.keys + s) * self.size
        return ((b * self.keys + s) * self.kv_heads + kv) * self.size

    def visible_keys(self, ctx: ThreadContext, t: Value) -> Value:
        """One past the last key query t sees."""
        return t + (self.keys - self.queries + 1) if self.causal else ctx.index(self.keys)


def row_parts(size: int, rows: int, dtype: str = dtypes.DT_FLOAT32) -> int:
    """Lanes sharing each of a launch's rows, whose threads hold `rows` rows of `size`
    elements of `dtype` each: the fewest (a power of two dividing the size) that leave a
    thread at most `ROW_REGISTERS` registers of them (a float64 takes two); one where the
    rows are not unrolled into registers."""
    words = rows * size * (2 if dtype == dtypes.DT_FLOAT64 else 1)
    parts = 1
    while size <= UNROLLED_SIZE and words // parts > ROW_REGISTERS and size % (2 * parts) == 0:
        parts *= 2
    return parts


class RowThreads:
    """A launch's threads and their rows: `parts` adjacent lanes to a row, a block of
    `TILE` rows; a lane holds the row's elements part, part + parts, ... (so a row's lanes
    read adjacent words of a streamed row in shared memory), `width` of them."""

    def __init__(self, program: BlockProgram, shape: AttentionShape, parts: int):
        self.program, self.size, self.parts, self.width = program, shape.size, parts, shape.size // parts
        self.unrolled = shape.size <= UNROLLED_SIZE

    @property
    def row(self) -> Value:
        """The running thread's row of the block (inside a phase)."""
        return self.program.thread // self.parts if self.parts > 1 else self.program.thread

    @property
    def part(self) -> Value:
        """The running thread's place among its row's lanes (inside a phase)."""
        return self.program.thread % self.parts if self.parts > 1 else self.program.ctx.index(0)

    def element(self, k: Value | int) -> Value:
        """The row element of the running thread's k-th."""
        return self.part + k * self.parts if self.parts > 1 else self.program.ctx.index(k)

    def own_rows(self, dtype: str, count: int) -> list[PrivateArray]:
        """`count` rows of each thread's own (its part of each)."""
        return [self.program.private(dtype, self.width) for _ in range(count)]

    def each(self, body: Callable[[Value | int, Value], None], name: str = "i") -> None:
        """`body(k, i)` for each of the thread's elements: k its own index (a number where the
        loop is unrolled), i the row's."""
        if self.unrolled:
            for k in range(self.width):
                body(k, self.element(k))
        else:
            with self.program.ctx.loop(0, self.width, name=name) as index:
                body(index, self.element(index))

    def dot(self, a: Callable[[Value | int, Value], Value], b: Callable[[Value | int, Value], Value], dtype: str) -> Value:
        """Σ a(k, i) · b(k, i) over the thread's elements (its part of a dot product):
        unrolled, over `_CHAINS` independent sums."""
        if not self.unrolled:
            total = self.program.ctx.local(dtype, initial=0.0)
            with self.program.ctx.loop(0, self.width, name="d") as index:
                i = self.element(index)
                total.set(a(index, i).mul_add(b(index, i), total.value))
            return total.value
        elements = [self.element(k) for k in range(self.width)]
        sums = [a(k, elements[k]) * b(k, elements[k]) for k in range(min(_CHAINS, self.width))]
        for k in range(len(sums), self.width):
            sums[k % _CHAINS] = a(k, elements[k]).mul_add(b(k, elements[k]), sums[k % _CHAINS])
        return pairwise(lambda x, y: x + y, sums)

    def read_row(self, var: Variable, at: Value, row: PrivateArray) -> None:
        ctx = self.program.ctx
        self.each(lambda k, i: row.store(k, ctx.load(var, at + i)))

    def lane_sums(self, sums: PrivateArray, scratch: PrivateArray, count: int) -> None:
        """The first `count` values of each lane's `sums` summed over its row's lanes, every
        lane left the same totals by a butterfly of shuffles (through `scratch`, as long).
        Called between phases."""
        mask = 1
        while mask < self.parts:
            exchange(self.program, scratch, sums, count, mask)
            with self.program.phase(wait=False):
                for k in range(count):
                    sums.store(k, sums.load(k) + scratch.load(k))
            mask *= 2

    def scored(self, rows: int, count: int, dtype: str, partials: Callable[[Value], list[Value]],
               visit: Callable[[Value, Callable[[], list[Value]]], None]) -> None:
        """For each streamed row j < `rows` of a tile: `visit(j, sums)`, `sums()` giving the
        `count` dot products whose thread's parts `partials(j)` gives, summed over the row's
        lanes (a loop every thread of the block runs, ending with the block waiting). A lane
        holding its whole row computes them where `visit` asks; split rows' lanes take
        `SCORES` rows at a time: their parts, then a butterfly of shuffles that leaves each
        lane the same sums, then the visits. A chunk's rows past the tile read its last and
        are not visited."""
        program, ctx = self.program, self.program.ctx
        if self.parts == 1:
            with program.phase(), ctx.loop(0, rows, name="j") as j:
                visit(j, lambda: partials(j))
            return
        chunk = min(SCORES, rows)
        sums, scratch = (program.private(dtype, count * chunk) for _ in range(2))

        def summed(c: int) -> list[Value]:
            return [sums.load(n * chunk + c) for n in range(count)]

        with ctx.loop(0, rows, step=chunk, name="chunk") as start:
            # the block waits after the parts: without a barrier LLVM keeps the rows they read
            # in registers for the visits to read again, a chunk's rows at once (ptxas spilled)
            with program.phase():
                for c in range(chunk):
                    for n, value in enumerate(partials((start + c).minimum(rows - 1))):
                        sums.store(n * chunk + c, value)
            self.lane_sums(sums, scratch, count * chunk)
            with program.phase(wait=False):
                for c in range(chunk):
                    with ctx.when(start + c < rows):
                        visit(start + c, functools.partial(summed, c))
        barrier(ctx)  # every thread done with the tile before the next is loaded over it


def _rescale(peak: Value, grown: Value, score: Value) -> tuple[Value, Value]:
    """The online softmax's factor for the sum so far and the new score's weight, when
    the running maximum goes from `peak` to `grown`. Until a score is finite (keys masked
    by a −∞ bias) the maximum stays −∞ and both are 0, not −∞ − (−∞)."""
    finite = finite_peak(grown)
    return (peak - finite).exp(), (score - finite).exp()


def _streamed_rows(op: Operation, row_floats: int) -> int:
    """Rows per streamed tile: as many as fit the shared memory, at most a block's."""
    item = 8 if op.outputs[0].dtype == dtypes.DT_FLOAT64 else 4
    return max(1, min(TILE, SHARED_BYTES // (row_floats * item)))


def _tile_row(tile: Array, j: Value, size: int) -> Callable[[Value | int, Value], Value]:
    """Element i of row j of a tile in shared memory."""
    return lambda k, i: tile.load(j * size + i)


def load_tiles(program: BlockProgram, first: Value, rows: int, last: int, sources: list[tuple[Variable, Callable, Array, int]],
               padding: int = 0, wait: bool = True) -> None:
    """One phase: the block's threads copy rows first .. first + rows - 1 (clamped to row
    `last`: a row past it is never used) of each source into its shared tile, a row every
    width + `padding` elements. A source is (variable, the element offset of its row r,
    the tile, elements per row). Unless `wait`, a later phase's barrier is the copies'."""
    ctx = program.ctx
    with program.phase(wait=wait) as thread:
        for var, row_at, tile, width in sources:
            with ctx.loop(thread, rows * width, step=program.threads, name="e") as e:
                row = (first + e // width).minimum(last)
                tile.store(e // width * (width + padding) + e % width, ctx.load(var, row_at(row) + e % width))


def _own(rows: int, row: Value) -> Value:
    """A thread's row, clamped to the last: a thread past the end reads a row it never uses."""
    return row.minimum(rows - 1)


def _query_block(shape: AttentionShape, block: Value) -> tuple[Value, Value, Value]:
    """(batch, head, first query row) of a block of query rows."""
    heads = block // shape.query_tiles
    return heads // shape.heads, heads % shape.heads, block % shape.query_tiles * TILE


def _key_tiles_seen(ctx: ThreadContext, shape: AttentionShape, first_query: Value, rows: int) -> Value:
    """How many tiles of `rows` keys a block of queries from `first_query` looks at."""
    last_query = (first_query + TILE).minimum(shape.queries) - 1
    return (shape.visible_keys(ctx, last_query) + (rows - 1)) // rows


def launches(op: Operation) -> list[tuple[int, Callable[[ThreadContext, ir.Value], None], int]]:
    shape = AttentionShape(op)
    query_blocks = shape.batch * shape.heads * shape.query_tiles

    def block(emit, held: int) -> tuple[Callable[[ThreadContext, ir.Value], None], int]:
        """A launch's element and threads a block, its threads holding `held` rows each."""
        parts = row_parts(shape.size, held, op.outputs[0].dtype)

        def element(ctx: ThreadContext, index: ir.Value) -> None:
            program = BlockProgram(ctx, TILE * parts, ctx.on_gpu)
            emit(program, RowThreads(program, shape, parts), op, shape, index_value(ctx.b, index))

        return element, TILE * parts

    if op.type == "Attention":
        return [(query_blocks, *block(_forward, 2))]  # q and the output
    return [(shape.batch * shape.kv_heads * shape.key_tiles, *block(_key_gradients, 4)),  # k, v, dk and dv
            (query_blocks, *block(_query_gradient, 3))]  # q, dout and dq


def _stream_keys(threads: RowThreads, op: Operation, shape: AttentionShape, b: Value, h: Value, first_query: Value,
                 count: int, partials: Callable[[Value, Array, Array], list[Value]],
                 visit: Callable[[Value, Value, Value, Array, Array, list[Value]], None]) -> None:
    """Stream the key and value rows a block of query rows sees through shared memory:
    for each thread's query t and each key s it sees (row j of the tiles), the `count` dot
    products `partials(j, keys, values)` gives the thread's parts of, summed over its row's
    lanes, then `visit(t, s, j, keys, values, sums)`."""
    program = threads.program
    ctx, size, kv = program.ctx, shape.size, h // shape.group
    rows = _streamed_rows(op, 2 * size)
    dtype = op.outputs[0].dtype
    keys, values = program.shared(dtype, rows * size), program.shared(dtype, rows * size)
    with ctx.loop(0, _key_tiles_seen(ctx, shape, first_query, rows), name="tile") as tile:
        first_key = tile * rows
        load_tiles(program, first_key, rows, shape.keys - 1, [
            (op.inputs[1], lambda s: shape.key_row(b, kv, s), keys, size),
            (op.inputs[2], lambda s: shape.key_row(b, kv, s), values, size)])

        def seen(j: Value, sums: Callable[[], list[Value]]) -> None:
            t = first_query + threads.row
            with ctx.when(t < shape.queries), ctx.when(first_key + j < shape.visible_keys(ctx, t)):
                visit(t, first_key + j, j, keys, values, sums())

        threads.scored(rows, count, dtype, lambda j: partials(j, keys, values), seen)


def _forward(program: BlockProgram, threads: RowThreads, op: Operation, shape: AttentionShape, block: Value) -> None:
    ctx, size = program.ctx, shape.size
    out = op.outputs[0]
    b, h, first_query = _query_block(shape, block)
    peak, total = program.private(out.dtype, 1), program.private(out.dtype, 1)
    acc, query = threads.own_rows(out.dtype, 2)
    with program.phase():
        peak.store(0, ctx.constant(out.dtype, -float("inf")))
        total.store(0, ctx.constant(out.dtype, 0.0))
        threads.each(lambda k, i: acc.store(k, ctx.constant(out.dtype, 0.0)))
        threads.read_row(op.inputs[0], shape.query_row(b, h, _own(shape.queries, first_query + threads.row)), query)

    def visit(t, s, j, keys, values, sums):
        score = shape.score(ctx, sums[0], b, h, t, s)
        grown = peak.load(0).maximum(score)
        correction, weight = _rescale(peak.load(0), grown, score)
        total.store(0, total.load(0) * correction + weight)
        threads.each(lambda k, i: acc.store(k, values.load(j * size + i).mul_add(weight, acc.load(k) * correction)))
        peak.store(0, grown)

    _stream_keys(threads, op, shape, b, h, first_query, 1,
                 lambda j, keys, values: [threads.dot(lambda k, i: query.load(k), _tile_row(keys, j, size), out.dtype)], visit)
    with program.phase():
        t = first_query + threads.row
        with ctx.when(t < shape.queries):
            inverse = unseen_inverse(total.load(0))
            threads.each(lambda k, i: ctx.store(out, shape.query_row(b, h, t) + i, acc.load(k) * inverse))
            if len(op.outputs) > 1:
                with ctx.when(threads.part.equal(0)):  # a row's first lane writes its statistic
                    statistic = log_sum_exp(finite_peak(peak.load(0)), total.load(0))
                    ctx.store(op.outputs[1], shape.statistic(b, h, t), statistic)


def _score_and_gradient(threads: RowThreads, query: PrivateArray, gradient: PrivateArray,
                        dtype: str) -> Callable[[Value, Array, Array], list[Value]]:
    """A query row's parts of its dot products with streamed row j: q · kⱼ (the score) and
    dout · vⱼ (the probability's gradient)."""
    size = threads.size

    def partials(j: Value, keys: Array, values: Array) -> list[Value]:
        return [threads.dot(lambda k, i: query.load(k), _tile_row(keys, j, size), dtype),
                threads.dot(lambda k, i: gradient.load(k), _tile_row(values, j, size), dtype)]

    return partials


def _probability(shape: AttentionShape, ctx: ThreadContext, product: Value, statistic: Value, b: Value, h: Value, t: Value,
                 s: Value) -> Value:
    """pₛ = exp(score − L) of query t and key s from their dot product and t's statistic L."""
    return (shape.score(ctx, product, b, h, t, s) - statistic).exp()


def _load_gradient_rows(threads: RowThreads, shape: AttentionShape, out: Variable, dout: Variable, b: Value, h: Value,
                        first_query: Value, rows: int, douts: Array, term: PrivateArray) -> None:
    """A phase with no wait: the dout rows of a tile of queries into shared memory, row j
    by the threads of the block's row j (each its part), and each their part of the row's
    D = Σ dout ∘ out into `term`, its out row read alongside (0 in a thread past the tile)."""
    program, ctx = threads.program, threads.program.ctx
    with program.phase(wait=False):
        term.store(0, ctx.constant(term.dtype, 0.0))
        j = threads.row
        with ctx.when(j < rows):
            at = shape.query_row(b, h, _own(shape.queries, first_query + j))

            def copied(k: Value | int, i: Value) -> Value:  # the dot product reads each element once
                value = ctx.load(dout, at + i)
                douts.store(j * shape.size + i, value)
                return value

            term.store(0, threads.dot(copied, lambda k, i: ctx.load(out, at + i), term.dtype))


def _key_gradients(program: BlockProgram, threads: RowThreads, op: Operation, shape: AttentionShape, block: Value) -> None:
    """Launch 1: each key row's dk and dv, over every query of its group's heads that sees
    it, streaming tiles of query rows, their dout rows, L and D (summed here)."""
    ctx, size = program.ctx, shape.size
    q, _, v, out, statistics, dout = op.inputs[:6]
    dk, dv = op.outputs[1:]
    heads = block // shape.key_tiles
    b, kv, first_key = heads // shape.kv_heads, heads % shape.kv_heads, block % shape.key_tiles * TILE
    dk_acc, dv_acc, key, value = threads.own_rows(dk.dtype, 4)

    def clear(k: Value | int, i: Value) -> None:
        dk_acc.store(k, ctx.constant(dk.dtype, 0.0))
        dv_acc.store(k, ctx.constant(dv.dtype, 0.0))

    with program.phase():
        threads.each(clear)
        at = shape.key_row(b, kv, _own(shape.keys, first_key + threads.row))
        threads.read_row(op.inputs[1], at, key)
        threads.read_row(v, at, value)
    rows = _streamed_rows(op, 2 * size + 2)
    queries, douts = (program.shared(dk.dtype, rows * size) for _ in range(2))
    lse, terms = (program.shared(statistics.dtype, rows) for _ in range(2))  # L and D of each query row
    term, scratch = (program.private(statistics.dtype, 1) for _ in range(2))
    # the first query that sees the block's first key
    first_seen = (first_key - (shape.keys - shape.queries)).maximum(0) if shape.causal else ctx.index(0)
    with ctx.loop(0, shape.group, name="g") as g, ctx.loop(first_seen // rows, -(-shape.queries // rows), name="tile") as tile:
        h, first_query = kv * shape.group + g, tile * rows
        load_tiles(program, first_query, rows, shape.queries - 1, [
            (q, lambda t: shape.query_row(b, h, t), queries, size), (statistics, lambda t: shape.statistic(b, h, t), lse, 1)],
            wait=False)
        _load_gradient_rows(threads, shape, out, dout, b, h, first_query, rows, douts, term)
        threads.lane_sums(term, scratch, 1)
        with program.phase(), ctx.when(threads.row < rows), ctx.when(threads.part.equal(0)):
            terms.store(threads.row, term.load(0))

        def partials(j: Value) -> list[Value]:
            return [threads.dot(_tile_row(queries, j, size), lambda k, i: key.load(k), dk.dtype),
                    threads.dot(_tile_row(douts, j, size), lambda k, i: value.load(k), dk.dtype)]

        def visit(j: Value, sums: Callable[[], list[Value]]) -> None:
            s, t = first_key + threads.row, first_query + j
            with ctx.when(s < shape.keys), ctx.when(t < shape.queries), ctx.when(s < shape.visible_keys(ctx, t)):
                dots = sums()
                p = _probability(shape, ctx, dots[0], lse.load(j), b, h, t, s)
                ds = p * (dots[1] - terms.load(j)) * shape.scale

                def add(k: Value | int, i: Value) -> None:
                    dk_acc.store(k, queries.load(j * size + i).mul_add(ds, dk_acc.load(k)))
                    dv_acc.store(k, douts.load(j * size + i).mul_add(p, dv_acc.load(k)))

                threads.each(add)

        threads.scored(rows, 2, dk.dtype, partials, visit)
    with program.phase():
        s = first_key + threads.row
        with ctx.when(s < shape.keys):
            at = shape.key_row(b, kv, s)

            def write(k: Value | int, i: Value) -> None:
                ctx.store(dk, at + i, dk_acc.load(k))
                ctx.store(dv, at + i, dv_acc.load(k))

            threads.each(write)


def _query_gradient(program: BlockProgram, threads: RowThreads, op: Operation, shape: AttentionShape, block: Value) -> None:
    """Launch 2: each query row's dq, its D summed from its own dout row and out row."""
    ctx, size = program.ctx, shape.size
    out, statistics, dout = op.inputs[3:6]
    dq = op.outputs[0]
    b, h, first_query = _query_block(shape, block)
    terms, scratch = program.private(statistics.dtype, 2), program.private(statistics.dtype, 1)  # D (over the row's lanes), L
    acc, query, gradient = threads.own_rows(dq.dtype, 3)
    with program.phase(wait=False):
        t = _own(shape.queries, first_query + threads.row)
        at = shape.query_row(b, h, t)
        threads.each(lambda k, i: acc.store(k, ctx.constant(dq.dtype, 0.0)))
        threads.read_row(op.inputs[0], at, query)
        threads.read_row(dout, at, gradient)
        terms.store(0, threads.dot(lambda k, i: gradient.load(k), lambda k, i: ctx.load(out, at + i), statistics.dtype))
        terms.store(1, ctx.load(statistics, shape.statistic(b, h, t)))
    threads.lane_sums(terms, scratch, 1)

    def visit(t, s, j, keys, values, sums):
        p = _probability(shape, ctx, sums[0], terms.load(1), b, h, t, s)
        ds = p * (sums[1] - terms.load(0))
        threads.each(lambda k, i: acc.store(k, keys.load(j * size + i).mul_add(ds, acc.load(k))))

    _stream_keys(threads, op, shape, b, h, first_query, 2, _score_and_gradient(threads, query, gradient, dq.dtype), visit)
    with program.phase():
        t = first_query + threads.row
        with ctx.when(t < shape.queries):
            threads.each(lambda k, i: ctx.store(dq, shape.query_row(b, h, t) + i, acc.load(k) * shape.scale))


LIBRARY.register(Generator("Attention", None, launches, supports=supports, rank=130))
