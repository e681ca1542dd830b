"""Attention's forward pass on tensor cores, FlashAttention-2's way: for a compile whose
matrix products run in bfloat16 (`Compiler(matmul="bfloat16")` marks the op's precision),
float32 operands, head sizes a multiple of 16 up to 128.

A block of `WARPS` warps takes `ROWS` query rows of one head, 16 a warp (the rows of an
mma's A), and the warps stream tiles of key and value rows through shared memory
together (rows padded by `PADDING` floats, so a fragment's lanes fall on different banks).
Per tile, each warp:
1. S = Q Kᵀ: bfloat16 products summed in float32 (`warps.mma`; Q's fragments are rounded
   and packed once, before the first tile), then scaled, the bias added, the causal mask
   and keys past the end set to −∞;
2. the online softmax: each row's maximum over the four lanes that hold it (two
   `warps.exchange`s), the running maximum m, P = exp(S − m), the output rescaled where
   m grew, the running sum l kept as each lane's own share until the end;
3. O += P V, P's bfloat16 A fragments packed straight from S's float32 fragments (the
   accumulator's layout is the next product's input layout: no exchange).
No score matrix is formed; a lane holds two rows of a tile's scores. A query whose every
key is masked attends to nothing (its row is 0), as on the CPU. The gradient stays with
the float32 kernels (`attention.py`), which recompute the probabilities unrounded.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Operation
from ...ops import attrs_of
from ..llvm.context import EmitContext
from ..llvm.rows import finite_peak, unseen_inverse
from ..llvm.values import Value, index_value
from . import warps
from .attention import AttentionShape, load_tiles
from .blocks import BlockProgram

WARPS = 4
ROWS = 16 * WARPS  # query rows a block takes
THREADS = warps.WARP * WARPS
PADDING = 8  # floats after each row of a shared tile


def supports(op: Operation) -> bool:
    if op.type != "Attention" or attrs_of(op)["precision"] != "bfloat16":
        return False
    size = op.inputs[0].shape[-1]
    return all(v.dtype == dtypes.DT_FLOAT32 for v in (*op.inputs, *op.outputs)) and size % 16 == 0 and 16 <= size <= 128


def _keys_per_tile(size: int) -> int:
    """Key rows a streamed tile holds: its key and value rows, padded, in 40 KiB of float32."""
    return 64 if size <= 64 else 32


def launches(op: Operation) -> list[tuple]:
    shape = AttentionShape(op)
    blocks = shape.batch * shape.heads * -(-shape.queries // ROWS)

    def emit(ctx: EmitContext, index: ir.Value) -> None:
        _forward(BlockProgram(ctx, THREADS, ctx.on_gpu), op, shape, index_value(ctx.b, index))

    return [(blocks, emit, THREADS)]


def _lane(thread: Value) -> tuple[Value, Value, Value]:
    """A thread's warp, its lane's group g (the fragments' rows g and g + 8) and place q in it."""
    lane = thread % warps.WARP
    return thread // warps.WARP, lane // 4, lane % 4


def _forward(program: BlockProgram, op: Operation, shape: AttentionShape, block: Value) -> None:
    ctx, size = program.ctx, shape.size
    q, k, v = op.inputs[:3]
    out = op.outputs[0]
    per_tile = _keys_per_tile(size)
    stride = size + PADDING
    query_blocks = -(-shape.queries // ROWS)
    head = block // query_blocks
    b, h, first_query = head // shape.heads, head % shape.heads, block % query_blocks * ROWS
    kv = h // shape.group
    q_words = program.private(dtypes.DT_INT32, size // 16 * 4)  # A fragments of Q, by chunk of 16 features
    scores = program.private(dtypes.DT_FLOAT32, per_tile // 8 * 4)  # C fragments, by 8 keys
    output = program.private(dtypes.DT_FLOAT32, size // 8 * 4)  # C fragments, by 8 features
    k_words = program.private(dtypes.DT_INT32, size // 16 * 2)  # B fragments of one 8 keys' Kᵀ
    p_words, v_words = program.private(dtypes.DT_INT32, 4), program.private(dtypes.DT_INT32, 2)
    peak, total, tile_peak, partner = (program.private(dtypes.DT_FLOAT32, 2) for _ in range(4))
    keys, values = (program.shared(dtypes.DT_FLOAT32, per_tile * stride) for _ in range(2))

    def rows(thread: Value) -> list[Value]:
        warp, group, _ = _lane(thread)
        first = first_query + warp * 16 + group
        return [first, first + 8]

    with program.phase(wait=False) as thread:
        _, _, place = _lane(thread)
        for r in range(2):
            peak.store(r, ctx.constant(dtypes.DT_FLOAT32, -math.inf))
            total.store(r, ctx.constant(dtypes.DT_FLOAT32, 0.0))
        for i in range(size // 8 * 4):
            output.store(i, ctx.constant(dtypes.DT_FLOAT32, 0.0))
        query_rows = [shape.query_row(b, h, t.minimum(shape.queries - 1)) for t in rows(thread)]
        for chunk in range(size // 16):
            for word in range(4):  # rows g, g + 8, g, g + 8; features 2q, 2q, 2q + 8, 2q + 8 (and one more each)
                at = query_rows[word % 2] + chunk * 16 + place * 2 + 8 * (word // 2)
                q_words.store(chunk * 4 + word, warps.pack(program, ctx.load(q, at + 1), ctx.load(q, at)))

    last_query = (first_query + ROWS).minimum(shape.queries) - 1
    with ctx.loop(0, (shape.visible_keys(ctx, last_query) + per_tile - 1) // per_tile, name="tile") as tile:
        first_key = tile * per_tile
        load_tiles(program, first_key, per_tile, shape.keys - 1, [
            (k, lambda s: shape.key_row(b, kv, s), keys, size), (v, lambda s: shape.key_row(b, kv, s), values, size)], PADDING)
        _scores(program, size, per_tile, stride, keys, q_words, k_words, scores)
        _mask(program, shape, b, h, first_key, per_tile, rows, scores, tile_peak)
        for mask in (1, 2):
            warps.exchange(program, partner, tile_peak, 2, mask)
            with program.phase(wait=False):
                for r in range(2):
                    tile_peak.store(r, tile_peak.load(r).maximum(partner.load(r)))
        _softmax(program, size, per_tile, scores, output, peak, total, tile_peak)
        _add_products(program, size, per_tile, stride, values, scores, p_words, v_words, output)
        with program.phase():  # every warp done with the tiles before the next overwrites them
            pass
    for mask in (1, 2):
        warps.exchange(program, partner, total, 2, mask)
        with program.phase(wait=False):
            for r in range(2):
                total.store(r, total.load(r) + partner.load(r))
    with program.phase(wait=False) as thread:
        _, _, place = _lane(thread)
        for r, t in enumerate(rows(thread)):
            inverse = unseen_inverse(total.load(r))
            with ctx.when(t < shape.queries):
                at = shape.query_row(b, h, t) + place * 2
                for n in range(size // 8):
                    for half in range(2):
                        ctx.store(out, at + n * 8 + half, output.load(n * 4 + 2 * r + half) * inverse)


def _scores(program: BlockProgram, size: int, per_tile: int, stride: int, keys, q_words, k_words, scores) -> None:
    """S = Q Kᵀ for the tile, 8 keys at a time: Kᵀ's B fragments from the shared tile, then
    one product per 16 features."""
    for j in range(per_tile // 8):
        with program.phase(wait=False) as thread:
            _, group, place = _lane(thread)
            row = (j * 8 + group) * stride + place * 2
            for chunk in range(size // 16):
                for word in range(2):  # features 2q (and 2q + 1), 2q + 8 (and 2q + 9) of key g
                    at = row + chunk * 16 + 8 * word
                    k_words.store(chunk * 2 + word, warps.pack(program, keys.load(at + 1), keys.load(at)))
            for i in range(4):
                scores.store(j * 4 + i, program.ctx.constant(dtypes.DT_FLOAT32, 0.0))
        for chunk in range(size // 16):
            warps.mma(program, (scores, j * 4), (q_words, chunk * 4), (k_words, chunk * 2), (scores, j * 4))


def _mask(program: BlockProgram, shape: AttentionShape, b: Value, h: Value, first_key: Value, per_tile: int, rows, scores,
          tile_peak) -> None:
    """Each score scaled, the bias added, −∞ where the query does not see the key (or past
    the last key); each lane's maximum of its two rows."""
    ctx = program.ctx
    with program.phase(wait=False) as thread:
        _, _, place = _lane(thread)
        for r, t in enumerate(rows(thread)):
            seen = shape.visible_keys(ctx, t).minimum(shape.keys)
            peak = ctx.constant(dtypes.DT_FLOAT32, -math.inf)
            for j in range(per_tile // 8):
                for half in range(2):
                    at, s = j * 4 + 2 * r + half, first_key + j * 8 + place * 2 + half
                    score = shape.score(ctx, scores.load(at), b, h, t.minimum(shape.queries - 1), s.minimum(shape.keys - 1))
                    score = (s < seen).where(score, -math.inf)
                    scores.store(at, score)
                    peak = peak.maximum(score)
            tile_peak.store(r, peak)


def _softmax(program: BlockProgram, size: int, per_tile: int, scores, output, peak, total, tile_peak) -> None:
    """The online softmax's step: scores → exp(score − m) with m the grown maximum, the
    lane's share of the sum and the output rows rescaled by exp(m_old − m)."""
    with program.phase(wait=False):
        for r in range(2):
            grown = peak.load(r).maximum(tile_peak.load(r))
            finite = finite_peak(grown)
            correction = (peak.load(r) - finite).exp()
            share = total.load(r) * correction
            for j in range(per_tile // 8):
                for half in range(2):
                    at = j * 4 + 2 * r + half
                    weight = (scores.load(at) - finite).exp()
                    scores.store(at, weight)
                    share = share + weight
            total.store(r, share)
            for n in range(size // 8):
                for half in range(2):
                    at = n * 4 + 2 * r + half
                    output.store(at, output.load(at) * correction)
            peak.store(r, grown)


def _add_products(program: BlockProgram, size: int, per_tile: int, stride: int, values, scores, p_words, v_words,
                  output) -> None:
    """O += P V, 16 keys at a time: P's A fragment packed from the weights of two 8-key
    score fragments, then one product per 8 features, V's B fragment from the shared tile."""
    for chunk in range(per_tile // 16):
        with program.phase(wait=False):
            for word in range(4):  # rows g, g + 8 of keys 2q (and 2q + 1) of the chunk's first 8, then its last 8
                at = (2 * chunk + word // 2) * 4 + 2 * (word % 2)
                p_words.store(word, warps.pack(program, scores.load(at + 1), scores.load(at)))
        for n in range(size // 8):
            with program.phase(wait=False) as thread:
                _, group, place = _lane(thread)
                for word in range(2):  # keys 2q (and 2q + 1), 2q + 8 (and 2q + 9) of the chunk, feature g
                    at = (chunk * 16 + place * 2 + 8 * word) * stride + n * 8 + group
                    v_words.store(word, warps.pack(program, values.load(at + stride), values.load(at)))
            warps.mma(program, (output, n * 4), (p_words, 0), (v_words, 0), (output, n * 4))
