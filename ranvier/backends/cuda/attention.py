"""Attention and its gradient as GPU block kernels that never form the T × S score matrix:
a block of `TILE` threads takes `TILE` query rows (or key rows), one per thread, and streams
the rows they pair with through shared memory: the block's threads load a tile of them
together, once (`blocks.BlockProgram`), and every thread reads all of it.

Attention: query rows stream key and value tiles; each thread runs an online softmax over
its visible keys (the running maximum m, the running sum l, and the output row rescaled
when m grows).

AttentionGrad, three launches in order:
1. query rows streaming key and value tiles: m, 1/l and D = Σₛ pₛ (dout · vₛ) (summed online
   as the output is, rescaled when m grows), parked in the first elements of the row's dq
   (a head has at least three), which the third launch overwrites; a query whose every key
   is masked parks m = 0 and 1/l = 0, so its pₛ = exp(−∞) · 0 are 0, as its output is;
2. key rows streaming tiles of queries, their dout rows and parked (m, 1/l, D), in every
   head of the key's group: dk and dv, each pₛ recomputed;
3. query rows streaming key and value tiles: dq = scale · Σₛ pₛ (dout · vₛ − D) kₛ.
Head sizes under three, and half-precision gradients (m, l, D would be rounded), are
decomposed into products and a softmax instead. Correct at any size, in float32; where the
compile's products run in bfloat16, `attention_mma.py`'s tensor-core kernels take head
sizes that are multiples of 16 instead.

A thread's own rows (its query's q and dout, its key's k and v, the rows it sums into) are
read from memory once, into private arrays: reading them from the operand at every key
instead had each of a warp's loads touch 32 lines (the rows are a head apart). For head
sizes up to `UNROLLED_SIZE` the loops along a row are unrolled, so LLVM reaches those
arrays at known indices and keeps them in registers (ptxas spills what does not fit: the
key gradients' four rows from head size 48 on, the query gradient's three from 64); longer
rows live in the thread's local memory. An unrolled dot product runs over independent
sums, so each multiply-add need not wait for the one before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ...ops.attention import bias_dims, bias_of, bias_offset, heads_first_shape, scale_of
from ..llvm.context import Array
from ..llvm.loops import pairwise
from ..llvm.rows import finite_peak, unseen_inverse
from ..llvm.values import Value, index_value
from .blocks import BlockProgram, PrivateArray
from .library import LIBRARY, Generator

if TYPE_CHECKING:
    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

PARKED = 3  # m, 1/l and D, in a dq row between launches
TILE = 32  # a block's rows, one per thread: a warp
SHARED_BYTES = 32 << 10  # a block's streamed tiles (48 KiB is the most a kernel gets without asking)
UNROLLED_SIZE = 128  # head sizes whose loops along a row are unrolled, the thread's rows in registers
_CHAINS = 4  # independent partial sums of an unrolled dot product


def supports(op: Operation) -> bool:
    """Either layout: [B, heads, T, hd], or [B, T, heads, hd] (rows heads · hd apart, read
    and written in place, so a Llama's projections need no transposes)."""
    if op.type not in ("Attention", "AttentionGrad"):
        return False
    return op.type == "Attention" or (op.inputs[0].shape[-1] >= PARKED and op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64))


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


def _unrolled(shape: AttentionShape) -> bool:
    return shape.size <= UNROLLED_SIZE


def _each(ctx: ThreadContext, shape: AttentionShape, body: Callable[[Value | int], None], name: str = "i") -> None:
    """`body(i)` for each element i of a row: i a number where the loop is unrolled."""
    if _unrolled(shape):
        for i in range(shape.size):
            body(i)
    else:
        with ctx.loop(0, shape.size, name=name) as index:
            body(index)


def _dot(ctx: ThreadContext, shape: AttentionShape, a: Callable, b: Callable, dtype: str) -> Value:
    """Σᵢ a(i) · b(i) along a row: unrolled, over `_CHAINS` independent sums."""
    if not _unrolled(shape):
        total = ctx.local(dtype, initial=0.0)
        with ctx.loop(0, shape.size, name="d") as d:
            total.set(a(d).mul_add(b(d), total.value))
        return total.value
    sums = [a(i) * b(i) for i in range(min(_CHAINS, shape.size))]
    for i in range(len(sums), shape.size):
        sums[i % _CHAINS] = a(i).mul_add(b(i), sums[i % _CHAINS])
    return pairwise(lambda x, y: x + y, sums)


def _own_rows(program: BlockProgram, shape: AttentionShape, dtype: str, count: int) -> list[PrivateArray]:
    """`count` rows of each thread's own."""
    return [program.private(dtype, shape.size) for _ in range(count)]


def _read_row(ctx: ThreadContext, shape: AttentionShape, var: Variable, at: Value, row: PrivateArray) -> None:
    _each(ctx, shape, lambda i: row.store(i, ctx.load(var, at + i)))


def _tile_row(tile: Array, j: Value, size: int) -> Callable[[Value], Value]:
    """Element i of row j of a tile in shared memory."""
    return lambda i: tile.load(j * size + i)


def load_tiles(program: BlockProgram, first: Value, rows: int, last: int, sources: list[tuple[Variable, Callable, Array, int]],
               padding: int = 0) -> None:
    """One phase: the block's threads copy rows first .. first + rows - 1 (clamped to row
    `last`: a row past it is never used) of each source into its shared tile, a row every
    width + `padding` elements. A source is (variable, the element offset of its row r,
    the tile, elements per row)."""
    ctx = program.ctx
    with program.phase() as thread:
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

    def block(emit):
        return lambda ctx, index: emit(BlockProgram(ctx, TILE, ctx.on_gpu), op, shape, index_value(ctx.b, index))

    if op.type == "Attention":
        return [(query_blocks, block(_forward), TILE)]
    return [(query_blocks, block(_statistics), TILE),
            (shape.batch * shape.kv_heads * shape.key_tiles, block(_key_gradients), TILE),
            (query_blocks, block(_query_gradient), TILE)]


def _stream_keys(program: BlockProgram, op: Operation, shape: AttentionShape, b: Value, h: Value, first_query: Value,
                 visit: Callable[[Value, Value, Value, Array, Array], None]) -> None:
    """Stream the key and value rows a block of query rows sees through shared memory:
    `visit(t, s, j, keys, values)` for each thread's query t and each key s it sees (row j
    of the tiles)."""
    ctx, size, kv = program.ctx, shape.size, h // shape.group
    rows = _streamed_rows(op, 2 * size)
    dtype = op.outputs[0].dtype
    keys, values = program.shared(dtype, rows * size), program.shared(dtype, rows * size)
    with ctx.loop(0, _key_tiles_seen(ctx, shape, first_query, rows), name="tile") as tile:
        first_key = tile * rows
        load_tiles(program, first_key, rows, shape.keys - 1, [
            (op.inputs[1], lambda s: shape.key_row(b, kv, s), keys, size),
            (op.inputs[2], lambda s: shape.key_row(b, kv, s), values, size)])
        with program.phase() as thread:
            t = first_query + thread
            with ctx.when(t < shape.queries):
                seen = (shape.visible_keys(ctx, t) - first_key).minimum(rows)
                with ctx.loop(0, seen, name="j") as j:
                    visit(t, first_key + j, j, keys, values)


def _forward(program: BlockProgram, op: Operation, shape: AttentionShape, block: Value) -> None:
    ctx, size = program.ctx, shape.size
    out = op.outputs[0]
    b, h, first_query = _query_block(shape, block)
    peak, total = program.private(out.dtype, 1), program.private(out.dtype, 1)
    acc, query = _own_rows(program, shape, out.dtype, 2)
    with program.phase() as thread:
        peak.store(0, ctx.constant(out.dtype, -float("inf")))
        total.store(0, ctx.constant(out.dtype, 0.0))
        _each(ctx, shape, lambda i: acc.store(i, ctx.constant(out.dtype, 0.0)))
        _read_row(ctx, shape, op.inputs[0], shape.query_row(b, h, _own(shape.queries, first_query + thread)), query)

    def visit(t, s, j, keys, values):
        score = shape.score(ctx, _dot(ctx, shape, query.load, _tile_row(keys, j, size), out.dtype), b, h, t, s)
        grown = peak.load(0).maximum(score)
        correction, weight = _rescale(peak.load(0), grown, score)
        total.store(0, total.load(0) * correction + weight)
        _each(ctx, shape, lambda i: acc.store(i, values.load(j * size + i).mul_add(weight, acc.load(i) * correction)))
        peak.store(0, grown)

    _stream_keys(program, op, shape, b, h, first_query, visit)
    with program.phase() as thread:
        t = first_query + thread
        with ctx.when(t < shape.queries):
            inverse = unseen_inverse(total.load(0))
            _each(ctx, shape, lambda i: ctx.store(out, shape.query_row(b, h, t) + i, acc.load(i) * inverse))


def _statistics(program: BlockProgram, op: Operation, shape: AttentionShape, block: Value) -> None:
    """Launch 1: m, 1/l and D of each query row, parked in its dq row."""
    ctx, size = program.ctx, shape.size
    dout, dq = op.inputs[3], op.outputs[0]
    b, h, first_query = _query_block(shape, block)
    peak, total, d = (program.private(dq.dtype, 1) for _ in range(PARKED))
    query, gradient = _own_rows(program, shape, dq.dtype, 2)
    with program.phase() as thread:
        for value, initial in ((peak, -float("inf")), (total, 0.0), (d, 0.0)):
            value.store(0, ctx.constant(dq.dtype, initial))
        at = shape.query_row(b, h, _own(shape.queries, first_query + thread))
        _read_row(ctx, shape, op.inputs[0], at, query)
        _read_row(ctx, shape, dout, at, gradient)

    def visit(t, s, j, keys, values):
        score = shape.score(ctx, _dot(ctx, shape, query.load, _tile_row(keys, j, size), dq.dtype), b, h, t, s)
        grown = peak.load(0).maximum(score)
        correction, weight = _rescale(peak.load(0), grown, score)
        total.store(0, total.load(0) * correction + weight)
        d.store(0, d.load(0) * correction + weight * _dot(ctx, shape, gradient.load, _tile_row(values, j, size), dq.dtype))
        peak.store(0, grown)

    _stream_keys(program, op, shape, b, h, first_query, visit)
    with program.phase() as thread:
        t = first_query + thread
        with ctx.when(t < shape.queries):
            at = shape.query_row(b, h, t)
            inverse = unseen_inverse(total.load(0))
            ctx.store(dq, at, finite_peak(peak.load(0)))
            ctx.store(dq, at + 1, inverse)
            ctx.store(dq, at + 2, d.load(0) * inverse)


def _key_gradients(program: BlockProgram, op: Operation, shape: AttentionShape, block: Value) -> None:
    """Launch 2: each key row's dk and dv, over every query of its group's heads that sees
    it, streaming tiles of query rows, their dout rows and parked (m, 1/l, D)."""
    ctx, size = program.ctx, shape.size
    q, _, v, dout = op.inputs[:4]
    dq, dk, dv = op.outputs
    heads = block // shape.key_tiles
    b, kv, first_key = heads // shape.kv_heads, heads % shape.kv_heads, block % shape.key_tiles * TILE
    dk_acc, dv_acc, key, value = _own_rows(program, shape, dk.dtype, 4)
    def clear(i: Value | int) -> None:
        dk_acc.store(i, ctx.constant(dk.dtype, 0.0))
        dv_acc.store(i, ctx.constant(dv.dtype, 0.0))

    with program.phase() as thread:
        _each(ctx, shape, clear)
        at = shape.key_row(b, kv, _own(shape.keys, first_key + thread))
        _read_row(ctx, shape, op.inputs[1], at, key)
        _read_row(ctx, shape, v, at, value)
    rows = _streamed_rows(op, 2 * size + PARKED)
    queries, douts, parked = (program.shared(dk.dtype, rows * width) for width in (size, size, PARKED))
    # the first query that sees the block's first key
    first_seen = (first_key - (shape.keys - shape.queries)).maximum(0) if shape.causal else ctx.index(0)
    with ctx.loop(0, shape.group, name="g") as g, ctx.loop(first_seen // rows, -(-shape.queries // rows), name="tile") as tile:
        h, first_query = kv * shape.group + g, tile * rows
        load_tiles(program, first_query, rows, shape.queries - 1, [
            (q, lambda t: shape.query_row(b, h, t), queries, size), (dout, lambda t: shape.query_row(b, h, t), douts, size),
            (dq, lambda t: shape.query_row(b, h, t), parked, PARKED)])
        with program.phase() as thread:
            s = first_key + thread
            with (ctx.when(s < shape.keys), ctx.loop(0, (shape.queries - first_query).minimum(rows), name="j") as j,
                  ctx.when(s < shape.visible_keys(ctx, first_query + j))):
                peak, inverse, d = (parked.load(j * PARKED + k) for k in range(PARKED))
                score = shape.score(ctx, _dot(ctx, shape, _tile_row(queries, j, size), key.load, dk.dtype), b, h, first_query + j, s)
                p = (score - peak).exp() * inverse
                ds = p * (_dot(ctx, shape, _tile_row(douts, j, size), value.load, dk.dtype) - d) * shape.scale
                def add(i: Value | int) -> None:
                    dk_acc.store(i, queries.load(j * size + i).mul_add(ds, dk_acc.load(i)))
                    dv_acc.store(i, douts.load(j * size + i).mul_add(p, dv_acc.load(i)))

                _each(ctx, shape, add)
    with program.phase() as thread:
        s = first_key + thread
        with ctx.when(s < shape.keys):
            at = shape.key_row(b, kv, s)
            def write(i: Value | int) -> None:
                ctx.store(dk, at + i, dk_acc.load(i))
                ctx.store(dv, at + i, dv_acc.load(i))

            _each(ctx, shape, write)


def _query_gradient(program: BlockProgram, op: Operation, shape: AttentionShape, block: Value) -> None:
    """Launch 3: each query row's dq, from its parked m, 1/l and D (read before the row is written)."""
    ctx, size = program.ctx, shape.size
    dout, dq = op.inputs[3], op.outputs[0]
    b, h, first_query = _query_block(shape, block)
    parked = program.private(dq.dtype, PARKED)
    acc, query, gradient = _own_rows(program, shape, dq.dtype, 3)
    with program.phase() as thread:
        at = shape.query_row(b, h, _own(shape.queries, first_query + thread))
        for k in range(PARKED):
            parked.store(k, ctx.load(dq, at + k))
        _each(ctx, shape, lambda i: acc.store(i, ctx.constant(dq.dtype, 0.0)))
        _read_row(ctx, shape, op.inputs[0], at, query)
        _read_row(ctx, shape, dout, at, gradient)

    def visit(t, s, j, keys, values):
        peak, inverse, d = (parked.load(k) for k in range(PARKED))
        score = shape.score(ctx, _dot(ctx, shape, query.load, _tile_row(keys, j, size), dq.dtype), b, h, t, s)
        p = (score - peak).exp() * inverse
        ds = p * (_dot(ctx, shape, gradient.load, _tile_row(values, j, size), dq.dtype) - d)
        _each(ctx, shape, lambda i: acc.store(i, keys.load(j * size + i).mul_add(ds, acc.load(i))))

    _stream_keys(program, op, shape, b, h, first_query, visit)
    with program.phase() as thread:
        t = first_query + thread
        with ctx.when(t < shape.queries):
            _each(ctx, shape, lambda i: ctx.store(dq, shape.query_row(b, h, t) + i, acc.load(i) * shape.scale))


LIBRARY.register(Generator("Attention", None, launches, supports=supports, rank=130))
