"""CachedAttention: each new position's query over the cache's live rows and the new
rows it sees, one query row at a time, the rows shared out over the cores.

Per row: its scores against cache rows [0, length) (`length` read at run time, so a
decode step early in a long context reads a few rows, not the cache's S) and against new
rows [0, t], into the part's scratch; their softmax in place; then the output row is the
probability-weighted sum of the same value rows. A decode step's query rows are its heads.
"""

from __future__ import annotations

from .... import dtypes
from ....ops import attrs_of
from ....ops.attention import scale_of
from ...llvm.context import load_index
from ...llvm.rows import Row, normalized_exponentials
from ...llvm.values import Value
from ..parallel import each_part, shares, thread_count, worth_splitting
from .attention import row_axpy, row_dot
from .library import kernel


def _rows(op) -> int:
    """Query rows: batch × heads × new positions."""
    batch, heads, queries, _ = op.inputs[0].shape
    return batch * heads * queries


def _parts(op) -> list[tuple[int, int]]:
    """Each part's query rows; split where a full cache's products would be worth it."""
    flops = op.inputs[0].shape[-1] * 4 * _rows(op) * (op.inputs[3].shape[2] + op.inputs[0].shape[2])
    split = worth_splitting(flops, 2 * op.inputs[3].nbytes)
    return shares(_rows(op), thread_count() if split else 1)


def _share(op) -> int:
    """A part's row of scores (every cache row and new row), cache-line rounded."""
    itemsize = dtypes.itemsize(op.inputs[0].dtype)
    return -(-(op.inputs[3].shape[2] + op.inputs[0].shape[2]) * itemsize // 64) * 64


def _workspace(op) -> int:
    return len(_parts(op)) * _share(op)


def _floats(op) -> bool:
    return op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64)


@kernel("CachedAttentionRow", {"CachedAttention"}, supports=_floats, workspace=_workspace)
def cached_attention(ctx, op) -> None:
    q, k, v, k_cache, v_cache, length = op.inputs
    out = op.outputs[0]
    _, heads, queries, size = q.shape
    kv_heads, rows = k.shape[1], k_cache.shape[2]
    groups = heads // kv_heads
    scale = scale_of(attrs_of(op), size)
    share = _share(op)

    def part(ctx, number: int | Value, first: int | Value, last: int | Value) -> None:
        live = load_index(ctx, length, 0)
        bad = (live < 0) | (live > rows)
        ctx.fail(bad)
        live = bad.where(0, live)
        scores = ctx.scratch(f"{op.name}/scores", q.dtype, share // dtypes.itemsize(q.dtype),
                             ctx.b.gep(ctx.address(ctx.workspace), [ctx.index(number * share).ir]))
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

    each_part(ctx, _parts(op), part)
