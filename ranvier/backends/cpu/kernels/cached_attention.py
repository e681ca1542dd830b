"""CachedAttention: the new positions' queries over the cache's live rows and the new
rows they see, the cache's rows read only up to `length` (read at run time, so a decode
step early in a long context reads a few rows, not the cache's S).

A key/value head with few query rows (a decode step's: G heads × T = 1 position) goes one
query row at a time (`CachedAttentionRow`): its scores against cache rows [0, length) and
new rows [0, t] into the part's scratch, their softmax in place, then the output row is
the probability-weighted sum of the same value rows. One with many (a prompt chunk's G × T
rows) goes as a block (`CachedAttentionBlock`): the block's scores against the live cache
rows and against the new rows by two BLAS products, each row's softmax over the keys it
sees (the rest zeroed), then the output by two more, P_cache · V_cache + P_new · V_new;
row by row, a 32-position chunk of stories110M late in a 960-token prompt spent 22 ms in
attention, a quarter of its time; as blocks 10 ms. Either way the rows or blocks are shared
out over the cores.
"""

from __future__ import annotations

from .... import dtypes
from ....ops import attrs_of
from ....ops.attention import scale_of
from ...llvm.context import load_index
from ...llvm.rows import Row, normalized_exponentials, row_axpy, row_dot, scaled_softmax
from ...llvm.values import Value
from ..parallel import each_part, shares, thread_count, worth_splitting
from .library import kernel
from .matmul import Blas, single_threaded_blas

# A key/value head's query rows (heads sharing it × new positions) from which its block's
# products go through BLAS rather than row by row. Measured at its two ends only: a decode
# step's single rows go faster row by row, a prompt chunk's dozens as blocks.
BLOCK_ROWS = 4


def _sizes(op) -> tuple[int, int, int, int, int, int, int]:
    """(batch, heads, queries, head size, key/value heads, cache rows, heads per key/value head)."""
    batch, heads, queries, size = op.inputs[0].shape
    kv_heads, rows = op.inputs[1].shape[1], op.inputs[3].shape[2]
    return batch, heads, queries, size, kv_heads, rows, heads // kv_heads


def _block_rows(op) -> int:
    """The query rows of one key/value head."""
    _, _, queries, _, _, _, groups = _sizes(op)
    return groups * queries


def _parts(op, items: int) -> list[tuple[int, int]]:
    """Each part's items (query rows or key/value heads); split where a full cache's
    products would be worth it."""
    batch, heads, queries, size, _, rows, _ = _sizes(op)
    flops = 4 * batch * heads * queries * (rows + queries) * size
    return shares(items, thread_count() if worth_splitting(flops, 2 * op.inputs[3].nbytes) else 1)


def _share(op, rows: int) -> int:
    """A part's scratch: `rows` rows of scores against every cache row and new row, cache-line rounded."""
    _, _, queries, _, _, cache_rows, _ = _sizes(op)
    return -(-rows * (cache_rows + queries) * dtypes.itemsize(op.inputs[0].dtype) // 64) * 64


def _live(ctx, op) -> Value:
    """The cache rows in use, read at run time; outside [0, S] the step fails (and reads none)."""
    rows = op.inputs[3].shape[2]
    live = load_index(ctx, op.inputs[5], 0)
    bad = (live < 0) | (live > rows)
    ctx.fail(bad)
    return bad.where(0, live)


def _scratch(ctx, op, number: int | Value, share: int):
    dtype = op.inputs[0].dtype
    return ctx.scratch(f"{op.name}/scores", dtype, share // dtypes.itemsize(dtype),
                       ctx.b.gep(ctx.address(ctx.workspace), [ctx.index(number * share).ir]))


def _floats(op) -> bool:
    return op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64)


def _blocks(op) -> bool:
    return _floats(op) and _block_rows(op) >= BLOCK_ROWS


@kernel("CachedAttentionBlock", {"CachedAttention"}, supports=_blocks, rank=10,
        workspace=lambda op: len(_parts(op, op.inputs[1].shape[0] * op.inputs[1].shape[1])) * _share(op, _block_rows(op)))
def cached_attention_blocks(ctx, op) -> None:
    q, k, v, k_cache, v_cache, _ = op.inputs
    out = op.outputs[0]
    batch, _, queries, size, kv_heads, rows, groups = _sizes(op)
    block, width = groups * queries, rows + queries
    scale = scale_of(attrs_of(op), size)
    share = _share(op, block)
    single_threaded_blas(ctx)

    def part(ctx, number: int | Value, first: int | Value, last: int | Value) -> None:
        live = _live(ctx, op)
        scores = _scratch(ctx, op, number, share)
        blas = Blas(ctx, q.dtype)
        with ctx.loop(first, last, name="kv") as kv:
            at = kv * (block * size)  # the key/value head's query heads are adjacent in q and out
            cached, new = kv * (rows * size), kv * (queries * size)
            fresh = ctx.element_pointer(scores, live)
            with ctx.when(live > 0):
                blas.gemm(False, True, block, live, size, ctx.element_pointer(q, at), size,
                          ctx.element_pointer(k_cache, cached), size, ctx.pointer(scores), width)
            blas.gemm(False, True, block, queries, size, ctx.element_pointer(q, at), size, ctx.element_pointer(k, new), size,
                      fresh, width)
            with ctx.loop(0, block, name="r") as r:
                start, seen = r * width, live + r % queries + 1
                scaled_softmax(ctx, scores, start, seen, scale)
                Row(ctx, start + seen, live + queries - seen, q.dtype).each(
                    lambda i, w: ctx.store(scores, i, ctx.constant(q.dtype, 0.0, w)))
            blas.gemm(False, False, block, size, queries, fresh, width, ctx.element_pointer(v, new), size,
                      ctx.element_pointer(out, at), size)
            with ctx.when(live > 0):
                blas.gemm(False, False, block, size, live, ctx.pointer(scores), width, ctx.element_pointer(v_cache, cached),
                          size, ctx.element_pointer(out, at), size, add=True)

    each_part(ctx, _parts(op, batch * kv_heads), part)


@kernel("CachedAttentionRow", {"CachedAttention"}, supports=_floats, rank=20,
        workspace=lambda op: len(_parts(op, op.outputs[0].size // op.inputs[0].shape[3])) * _share(op, 1))
def cached_attention_rows(ctx, op) -> None:
    q, k, v, k_cache, v_cache, _ = op.inputs
    out = op.outputs[0]
    batch, heads, queries, size, kv_heads, rows, groups = _sizes(op)
    scale = scale_of(attrs_of(op), size)
    share = _share(op, 1)

    def part(ctx, number: int | Value, first: int | Value, last: int | Value) -> None:
        live = _live(ctx, op)
        scores = _scratch(ctx, op, number, share)
        with ctx.loop(first, last, name="row") as r:
            t, bh = r % queries, r // queries
            kv = bh // heads * kv_heads + bh % heads // groups
            cached, new, at = kv * (rows * size), kv * (queries * size), r * size
            peak = ctx.local(q.dtype, 1, float("-inf"))

            def score(keys, key_start: Value, j: Value) -> None:
                value = row_dot(ctx, size, q, at, keys, key_start) * scale
                ctx.store(scores, j, value)
                peak.set((value > peak.value).where(value, peak.value))

            with ctx.loop(0, live, name="j") as j:
                score(k_cache, cached + j * size, j)
            with ctx.loop(0, t + 1, name="j") as j:
                score(k, new + j * size, live + j)
            normalized_exponentials(ctx, Row(ctx, ctx.index(0), live + t + 1, q.dtype), scores, scores, peak.value)
            Row(ctx, at, size, out.dtype).each(lambda i, w: ctx.store(out, i, ctx.constant(out.dtype, 0.0, w)))
            with ctx.loop(0, live, name="j") as j:
                row_axpy(ctx, size, ctx.load(scores, j), v_cache, cached + j * size, out, at)
            with ctx.loop(0, t + 1, name="j") as j:
                row_axpy(ctx, size, ctx.load(scores, live + j), v, new + j * size, out, at)

    each_part(ctx, _parts(op, batch * heads * queries), part)
