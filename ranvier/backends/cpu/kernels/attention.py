"""Fused attention kernels, the B×H×T×S probabilities never stored whole.

In float32, per (batch·head, block of query rows): the block's scores S = Q_block Kᵀ by
the generated GEMM into the part's scratch (a block's rows of every key stay in L2), each
row scaled, biased, masked and turned into probabilities P in place; then the forward
(`AttentionGemm`) is O_block = P V, keeping each row's log-sum-exp L where asked. The
backward (`AttentionGradGemm`, a part owning whole key/value heads, or with fewer of those
than cores a share of one's blocks with partial sums of its own) takes the forward's O and
L, as FlashAttention-2's does: dP = dO Vᵀ, then in one pass per row P = exp(S − L) and
dS = scale · P (dP − D) with D = dO · O (no maximum or sum found again), dQ = dS K,
dK += dSᵀ Q_block and dV += Pᵀ dO_block, all by the GEMM. The key and value heads a
part's products read as B are packed into the GEMM's panels once per head (`_Panels`),
not by every product. Tensors [B, T, heads, hd] (`heads_first` false) are read and
written in place, a head's rows heads · hd apart instead of hd. Where the products'
precision lets their inputs be rounded to bfloat16 and the CPU has AVX512-BF16 without AMX
tiles (`AttentionGemmDpbf16`, `AttentionGradGemmDpbf16`), the same products run on the GEMM
on bf16 pairs, the heads packed into pairs; the softmax and its gradient stay float32.

In float64, one query row at a time: scores against every visible key into a row buffer
on the stack, their maximum, exponentials and sum, then the weighted sum of values. The
backward takes each key in one pass, from the forward's L and D = d out · out:
    p_j = exp(s_j − L),  dp_j = d out · v_j,  ds_j = p_j (dp_j − D),
    dq += scale · ds_j k_j,  dk_j += scale · ds_j q,  dv_j += p_j · d out.

They claim attention of every size (`SCORES_BUDGET`): the decomposed form (batched GEMMs
and a row softmax, which stores the scores) measured slower on AVX-512 and AVX2 alike.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

from llvmlite import ir

from .... import dtypes
from ....ops import attrs_of
from ....ops.attention import bias_dims, bias_of, bias_offset, heads_first_shape, scale_of
from ...llvm import mathlib
from ...llvm.irutil import BYTE_PTR, cache_line_aligned, i64, whole_lines
from ...llvm.loops import fill
from ...llvm.pointers import Pointer
from ...llvm.rows import Row, finite_peak, log_sum_exp, row_axpy, row_dot, scaled_softmax, unseen_inverse
from ...llvm.values import Value
from .. import sgemm
from ..codegen import SGEMM_DPBF16, SGEMM_GENERATED, SGEMM_PACKED, SGEMM_PACKED_DPBF16
from ..parallel import each_part, shares, thread_count, worth_splitting
from .library import kernel
from .matmul import (
    GeneratedGemm,
    PackedGemm,
    panel_floats,
)

# Attention whose score matrices (batch × heads × queries × keys) take more bytes than this
# runs fused; smaller ones decompose into GEMMs and a softmax (the tests raise it to run
# that decomposition). Every size runs fused. With AVX-512 (its 8 × 3 GEMM tiles, the fused
# gradient's blocks shared out with one key/value head), on an Emerald Rapids Xeon the
# moe-15M step (multi-query) took 3-4% less time in three alternated runs, the stories15M
# step -2% and +3%, BERT-base and GPT-2 inference at batch 1 2-3% less. On an AVX2 EPYC
# (Zen 3), 2 × 4 heads of 64, float32: at 256 positions forward 0.95 ms fused against
# 1.63 decomposed, backward 2.38 against 3.34; at 512, 3.10 against 6.66 and 7.70 against
# 15.41 (benchmarks/attention.py's cells); in the stories15M step (batch 4 × 256) its
# attention took 50 ms fused against about 67 decomposed, within the step's noise.
SCORES_BUDGET = 0


@dataclass(frozen=True)
class _Dims:
    """An attention op's sizes, whichever layout its tensors are in, and the elements
    between consecutive rows (positions) of one head: hd where heads come first, heads·hd
    where they are [B, T, heads, hd]."""

    batch: int
    heads: int
    queries: int
    size: int
    kv_heads: int
    keys: int
    heads_first: bool

    @property
    def q_stride(self) -> int:
        return self.size if self.heads_first else self.heads * self.size

    @property
    def kv_stride(self) -> int:
        return self.size if self.heads_first else self.kv_heads * self.size

    def kv_head_start(self, batch, kv_head):
        """Where key/value head kv_head of a batch starts (ints or Values)."""
        if self.heads_first:
            return (batch * self.kv_heads + kv_head) * (self.keys * self.size)
        return batch * (self.keys * self.kv_heads * self.size) + kv_head * self.size


def _dims(op) -> _Dims:
    first = attrs_of(op)["heads_first"]
    batch, heads, queries, size = heads_first_shape(op.inputs[0].shape, first)
    _, kv_heads, keys, _ = heads_first_shape(op.inputs[1].shape, first)
    return _Dims(batch, heads, queries, size, kv_heads, keys, first)


def _too_big_to_decompose(op) -> bool:
    d = _dims(op)
    fits = op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64)
    return fits and d.batch * d.heads * d.queries * d.keys * 4 > SCORES_BUDGET


def _rows_heads_first(op) -> bool:
    """The float64 row kernels read heads first; the other layout decomposes into
    transposes around an op they take."""
    return _too_big_to_decompose(op) and attrs_of(op)["heads_first"]


class _Heads:
    """Offsets of a (batch·head, query) pair's rows in q/out and its key/value head."""

    def __init__(self, ctx, q, k, op):
        attrs = attrs_of(op)
        self.ctx = ctx
        self.dims = d = _dims(op)
        self.batch, self.heads, self.queries, self.size = d.batch, d.heads, d.queries, d.size
        self.kv_heads, self.keys = d.kv_heads, d.keys
        self.groups = self.heads // self.kv_heads
        self.causal = attrs["causal"]
        self.scale = scale_of(attrs, self.size)
        self.dtype = q.dtype
        self.bias = bias_of(op)
        self.bias_dims = bias_dims(self.bias.shape) if self.bias is not None else None
        # The forward's statistics output, where asked for: each row's log-sum-exp [B·H, T]
        self.statistics = op.outputs[1] if len(op.outputs) == 2 and op.type == "Attention" else None
        # AttentionGrad's inputs from the forward: its output and each row's log-sum-exp [B·H, T]
        self.out, self.lse = (op.inputs[3], op.inputs[4]) if op.type == "AttentionGrad" else (None, None)
        # Where the products may round the probabilities to bfloat16, their exponentials need
        # not be float32's best: `exp_nonpositive` errs by 4e-7 of them, a ten-thousandth of the rounding's.
        self.exp = mathlib.exp_nonpositive if attrs["precision"] == "bfloat16" else Value.exp

    def kv_base(self, bh: Value) -> Value:
        """Where the key/value head query head bh reads starts."""
        return self.dims.kv_head_start(bh // self.heads, bh % self.heads // self.groups)

    def q_row(self, bh: Value, t: Value) -> Value:
        """Where query t of (batch·head) bh starts in q, the output and their gradients."""
        if self.dims.heads_first:
            return (bh * self.queries + t) * self.size
        return ((bh // self.heads * self.queries + t) * self.heads + bh % self.heads) * self.size

    def bias_start(self, bh: Value, t: Value) -> Value | int:
        """Where the bias row of (batch·head, query) starts; a broadcast axis stays put."""
        if self.bias is None:
            return 0
        return bias_offset(self.bias_dims, bh // self.heads, bh % self.heads, t, 0)

    def visible(self, t: Value) -> Value | int:
        """How many keys query t sees."""
        return t + (self.keys - self.queries + 1) if self.causal else self.keys

    def block(self, first_query: Value, rows_per_block: int) -> tuple[Value, Value | int]:
        """(its rows, the keys its last row sees) of the block of queries from `first_query`."""
        rows = (first_query + rows_per_block).minimum(self.queries) - first_query
        return rows, self.visible(first_query + rows - 1)

    def dot(self, x, x_start: Value, y, y_start: Value) -> Value:
        return row_dot(self.ctx, self.size, x, x_start, y, y_start)

    def axpy(self, alpha: Value, x, x_start: Value, y, y_start: Value) -> None:
        row_axpy(self.ctx, self.size, alpha, x, x_start, y, y_start)

    def score(self, q, q_start: Value, k, kv: Value, j: Value, bias_start: Value | int) -> Value:
        """Key j's scaled, biased score for the query at q_start."""
        score = self.dot(q, q_start, k, kv + j * self.size) * self.scale
        if self.bias is not None:
            score = score + self.ctx.load(self.bias, bias_start + (j if self.bias_dims[3] > 1 else 0))
        return score

    def probabilities(self, q, q_start: Value, k, kv: Value, count, p, bias_start: Value | int) -> Value:
        """Fill p[j] with the probability of each visible key j; returns their log-sum-exp."""
        ctx = self.ctx
        peak = ctx.local(self.dtype, 1, -math.inf)
        with ctx.loop(0, count, name="j") as j:
            score = self.score(q, q_start, k, kv, j, bias_start)
            p.store(j, score)
            peak.set((score > peak.value).where(score, peak.value))
        total = ctx.local(self.dtype, 1, 0.0)
        subtracted = finite_peak(peak.value)
        with ctx.loop(0, count, name="j") as j:
            e = (p.load(j) - subtracted).exp()
            p.store(j, e)
            total.set(total.value + e)
        inverse = unseen_inverse(total.value)
        with ctx.loop(0, count, name="j") as j:
            p.store(j, p.load(j) * inverse)
        return log_sum_exp(subtracted, total.value)

    def keep_statistic(self, bh: Value, t: Value, value: Value) -> None:
        """Query t of (batch·head) bh's log-sum-exp, where the forward outputs them."""
        if self.statistics is not None:
            self.ctx.store(self.statistics, bh * self.queries + t, value)

    def row_keys(self, t: Value) -> Value | int:
        """The keys query t sees, as the length of its row of scores (0 where it sees none)."""
        seen = self.visible(t)
        return seen.maximum(0) if isinstance(seen, Value) else seen

    def clear_unseen(self, row_values, start: Value, seen: Value | int, columns: Value | int) -> None:
        """Zero a block row's entries from `seen` to `columns` (the keys of the block's last
        row, which the products after read), where this query sees fewer."""
        if self.causal:
            unseen = columns - seen
            Row(self.ctx, start + seen, unseen.maximum(0) if isinstance(unseen, Value) else max(unseen, 0), self.dtype).each(
                lambda i, w: self.ctx.store(row_values, i, self.ctx.constant(self.dtype, 0.0, w)))

    def row_terms(self, dout, bh: Value, t: Value) -> tuple[Value, Value]:
        """What the gradient takes of query t of (batch·head) bh from the forward: its
        log-sum-exp L, and D = d out · out (= Σ p·dp, the softmax gradient's row term)."""
        row = self.q_row(bh, t)
        return self.ctx.load(self.lse, bh * self.queries + t), self.dot(dout, row, self.out, row)

    def probability(self, logit: Value, lse: Value) -> Value:
        """exp(logit − L), the forward's probability of a key from its scaled, biased score
        and the row's log-sum-exp: 0 for a masked key (−∞) and in a row that sees no key
        (L = +∞). L bounds every logit only up to rounding (a logit may exceed it by an ulp
        or so): a positive difference taken as 0 keeps `exp_nonpositive`'s argument in its
        domain, and p ≤ 1; NaN stays NaN (one compare, where `minimum`'s NaN check cost the
        float64 gradient 2%)."""
        difference = logit - lse.splat(logit.lanes)
        return self.exp((difference > 0.0).where(0.0, difference))

    def block_bias(self, bh: Value, t: Value, start: Value):
        """The bias of query t's keys as `Row` terms (i, width) over a block row from `start`, or None."""
        if self.bias is None:
            return None
        ctx, bias_start = self.ctx, self.bias_start(bh, t)

        def bias(i, w):
            if self.bias_dims[3] > 1:
                return ctx.load(self.bias, bias_start + (i - start), w)
            return ctx.load(self.bias, bias_start).splat(w)

        return bias

    def score_gradients(self, p, ds, start: Value, bh: Value, t: Value, columns: Value | int, dout) -> None:
        """A block row of raw scores (p: q · k of the block's `columns` keys) and d
        probabilities (ds: dP = d out · v) → query t's probabilities P and d scores
        scale · P (dP − D), in place, in one pass over the keys it sees: P from the
        forward's log-sum-exp (`probability`), D = d out · out (`row_terms`); 0 for the rest of the columns."""
        ctx = self.ctx
        seen, bias = self.row_keys(t), self.block_bias(bh, t, start)
        lse, d = self.row_terms(dout, bh, t)

        def gradient(i, w):
            logit = ctx.load(p, i, w) * self.scale
            probability = self.probability(logit + bias(i, w) if bias is not None else logit, lse)
            ctx.store(p, i, probability)
            ctx.store(ds, i, probability * (ctx.load(ds, i, w) - d.splat(w)) * self.scale)

        Row(ctx, start, seen, self.dtype).each(gradient)
        for values in (p, ds):
            self.clear_unseen(values, start, seen, columns)

    def normalize(self, scores, start: Value, bh: Value, t: Value, columns: Value | int) -> None:
        """A row of a block's raw scores (q · k of the block's `columns` keys) → query t's
        probabilities, in place: the keys it sees scaled, biased and normalized, only they
        passed over (a causal row sees half the keys on average), the rest at 0."""
        seen = self.row_keys(t)
        statistic = scaled_softmax(self.ctx, scores, start, seen, self.scale, self.block_bias(bh, t, start),
                                   unseen_zero=True, exp=self.exp)
        self.keep_statistic(bh, t, statistic)
        self.clear_unseen(scores, start, seen, columns)

    def each_query(self, q, k, p, body) -> None:
        """For every (batch·head, query): fill the probabilities p, then call
        body(key/value base, query row offset, visible key count)."""
        ctx = self.ctx
        with ctx.loop(0, self.batch * self.heads, name="bh") as bh:
            kv = self.kv_base(bh)
            with ctx.loop(0, self.queries, name="t") as t:
                row = (bh * self.queries + t) * self.size
                count = self.visible(t)
                self.keep_statistic(bh, t, self.probabilities(q, row, k, kv, count, p, self.bias_start(bh, t)))
                body(kv, row, count)

    def buffer(self):
        return self.ctx.array(self.dtype, self.keys)


# A block of query rows' scores, one row per key: small enough to stay in L2 between
# the two products.
_BLOCK_BYTES = 256 << 10


# Causal attention's blocks are shorter: a block's products run to the keys its last row
# sees, so its first rows compute scores they mask, half a block's square on average.
# Blocks of 32 rows against 64 (Emerald Rapids, 2 cores, alternated runs): moe-15M's
# [4, 6, 256, 48] forward 5-8% and gradient 4-7% faster, [8, 6, 256, 48] 7% and 5%,
# [1, 12, 128, 64] 11% and 9%; [1, 8, 1024, 64] +3% and -9%; without a mask level.
_CAUSAL_BLOCK_ROWS, _BLOCK_ROWS = 32, 64


def _block_rows(op) -> int:
    """Query rows per block: as many as `_BLOCK_BYTES` of scores hold (4 to 32 or 64, whole strips of 4)."""
    keys = _dims(op).keys
    most = _CAUSAL_BLOCK_ROWS if attrs_of(op)["causal"] else _BLOCK_ROWS
    return max(4, min(most, _BLOCK_BYTES // (4 * keys) // 4 * 4))


def _score_stride(op) -> int:
    """Floats from one row of a block's scores to the next: the keys, and a cache line more
    where that would put the rows a multiple of 4 KiB apart (1,024 keys, 2,048...). Such
    rows all fall in one set of the L1 cache, and the products that read a block's scores
    down its columns or strip by strip (P V, d keys, d values) then find none of the lines
    they read a moment before. On a Zen 3 core pair (causal, alternated runs), the line
    more took attention [2, 1024, 6 heads, 48] forward and backward to 0.81-0.86 and
    0.82-0.92 of the time, [4, 1024, 12, 64] to 0.81 and 0.91, [1, 2048, 6, 48] to 0.83 and
    0.90. At 256, 512 and 1,000 keys a line more changed nothing; at 128 keys, rows padded
    to an odd number of lines made the gradient 4% slower."""
    keys = _dims(op).keys
    return keys + 16 if keys % 1024 == 0 else keys


def _gemm_blocks(op) -> bool:
    return op.inputs[0].dtype == dtypes.DT_FLOAT32 and _too_big_to_decompose(op)


def _pair_blocks(op) -> bool:
    """`_gemm_blocks` whose products may round their inputs to bf16: marked so where the
    backend runs products on bf16 pairs (it passes the kernels on pairs over elsewhere)."""
    return _gemm_blocks(op) and attrs_of(op)["precision"] == "bfloat16"


def _block_parts(op) -> list[tuple[int, int]]:
    """Each worker-pool part's range of (batch·head, query block) items."""
    d = _dims(op)
    items = d.batch * d.heads * -(-d.queries // _block_rows(op))
    split = worth_splitting(4 * d.batch * d.heads * d.queries * d.keys * d.size)
    return shares(items, thread_count() if split else 1)


def _gemm_bytes(op) -> int:
    """A part's GEMM packing scratch, cache-line rounded: B is Kᵀ [hd × S] or V [S × hd]."""
    d = _dims(op)
    size, keys = d.size, d.keys
    return whole_lines(max(sgemm.workspace_bytes(keys, size), sgemm.workspace_bytes(size, keys)))


def _block_share(op) -> int:
    """A part's K and V in panels (a line to spare, to align them), then a block's scores."""
    return 64 + _panels_bytes(op, 2) + 4 * _block_rows(op) * _score_stride(op)


def _panels_bytes(op, count: int) -> int:
    """`count` key/value heads in the packed GEMM's panels, as Kᵀ [hd × S] or V [S × hd],
    cache-line rounded each: the GEMM reads panels as aligned vectors."""
    d = _dims(op)
    size, keys = d.size, d.keys
    return count * whole_lines(4 * max(panel_floats(keys, size), panel_floats(size, keys)))


class _Panels:
    """A key or value head packed for the GEMM once, not by every block of queries that
    reads it (a multi-query head serves every query head and block): moe-15M's attention
    [4, 6, 256, 48] packed K 24 times a batch, and packing took 15-40% of each product's
    time (one thread, Emerald Rapids). Its panels take `_panels_bytes(op, 1)` of the
    part's workspace from `at`; `pairs`: in bf16 pairs, for the GEMM on pairs."""

    def __init__(self, ctx, name: str, at: ir.Value, op, pairs: bool = False):
        self.ctx = ctx
        d = _dims(op)
        self.size, self.keys, self.stride, self.out_stride = d.size, d.keys, d.kv_stride, d.q_stride
        self.score_stride = _score_stride(op)  # between the rows of a block's scores, which its products write and read
        # (32-bit slots: floats, or pairs of bf16)
        self.var = ctx.scratch(name, dtypes.DT_FLOAT32, _panels_bytes(op, 1) // 4, at)
        self.nr = sgemm.panel_width(ctx.target)
        self.pairs = pairs

    def across_keys(self, source, kv: Value) -> None:
        """source's head at kv [S × hd] (rows `stride` apart) as op(B) = its transpose [hd × S]: S columns."""
        self._pack(source, kv, True, self.size, self.keys)

    def along_keys(self, source, kv: Value) -> None:
        """source's head at kv [S × hd] as op(B) = itself: hd columns, S deep."""
        self._pack(source, kv, False, self.keys, self.size)

    def _pack(self, source, kv: Value, transposed: bool, k: int, n: int) -> None:
        ctx = self.ctx
        sgemm.pack_at_run_time(ctx.module, ctx.target, ctx.b, transposed, ctx.element_pointer(source, kv), self.stride,
                               i64(k), i64(n), ctx.pointer(self.var), self.pairs)

    def times_keys(self, gemm: PackedGemm, rows, seen, a: ir.Value, lda: int, c: ir.Value) -> None:
        """C[rows × S'] (a block's scores) = A[rows × hd] · the across-keys panels' first `seen` columns."""
        gemm.gemm(False, rows, seen, self.size, a, lda, self.ctx.pointer(self.var), c, self.score_stride)

    def times_head(self, gemm: PackedGemm, rows, seen, a: ir.Value, c: ir.Value) -> None:
        """C[rows × hd] (rows of the output or d q) = A[rows × seen] (a block's scores) · the
        along-keys panels' first `seen` rows: a call per panel, as the panels are S deep
        and the product only `seen`."""
        depth = -(-self.keys // 2) if self.pairs else self.keys  # a panel's rows: S, or its pairs
        for first in range(0, self.size, self.nr):
            panel = self.ctx.b.gep(self.ctx.pointer(self.var), [i64(first * depth)])
            gemm.gemm(False, rows, min(self.nr, self.size - first), seen, a, self.score_stride, panel,
                      self.ctx.b.gep(c, [i64(first)]), self.out_stride)


def _prefetch_rows(ctx, var, start: Value, rows: Value | int, stride: int, size: int) -> None:
    """Ask for `rows` rows of `size` floats of `var`, `stride` apart from element `start`, to
    be brought into L2 (a prefetch never faults: rows past the end are asked for harmlessly)."""
    lines = -(-size * 4 // 64) + (1 if size * 4 % 64 else 0)
    with ctx.loop(0, rows, name="pf") as r:
        row = Pointer(ctx.b, ctx.element_pointer(var, start + r * stride), dtypes.DT_FLOAT32)
        for line in range(lines):
            (row + line * 16).prefetch()


def _block_workspace(op) -> int:
    return len(_block_parts(op)) * _block_share(op)


@kernel("AttentionGemmDpbf16", {"Attention"}, supports=_pair_blocks, rank=10, workspace=_block_workspace,
        calls=frozenset({SGEMM_PACKED_DPBF16}))
def attention_pair_blocks(ctx, op) -> None:
    _attention_blocks(ctx, op, pairs=True)


@kernel("AttentionGemm", {"Attention"}, supports=_gemm_blocks, rank=20, workspace=_block_workspace,
        calls=frozenset({SGEMM_PACKED}))
def attention_blocks(ctx, op) -> None:
    _attention_blocks(ctx, op, pairs=False)


def _attention_blocks(ctx, op, pairs: bool) -> None:
    """Per (batch·head, block of query rows): S = Q_block Kᵀ, P = softmax(S) in place, O_block
    = P V; on the GEMM on bf16 pairs where `pairs`."""
    q, k, v = op.inputs[:3]
    out = op.outputs[0]
    d = _dims(op)
    score_stride, rows_per_block = _score_stride(op), _block_rows(op)
    blocks = -(-d.queries // rows_per_block)
    share = _block_share(op)

    def part(ctx, number: int | Value, first: int | Value, last: int | Value) -> None:
        heads = _Heads(ctx, q, k, op)
        gemm = PackedGemm(ctx, pairs=pairs)

        start = cache_line_aligned(ctx.b, ctx.b.gep(ctx.address(ctx.workspace), [ctx.index(number * share).ir]), BYTE_PTR)

        def at(offset: int) -> ir.Value:
            return ctx.b.gep(start, [i64(offset)])

        keys_across, values = (_Panels(ctx, f"{op.name}/{name}", at(i * _panels_bytes(op, 1)), op, pairs)
                               for i, name in enumerate(("k", "v")))
        scores = ctx.scratch(f"{op.name}/scores", q.dtype, rows_per_block * score_stride, at(_panels_bytes(op, 2)))
        packed_kv = ctx.local(dtypes.DT_INT64, initial=-1)
        with ctx.loop(first, last, name="item") as item:
            bh, first_query = item // blocks, item % blocks * rows_per_block
            rows, seen = heads.block(first_query, rows_per_block)
            kv, query_rows = heads.kv_base(bh), heads.q_row(bh, first_query)
            with ctx.when(~kv.equal(packed_kv.value)):
                keys_across.across_keys(k, kv)
                values.along_keys(v, kv)
                packed_kv.set(kv)
            # The next head's keys and values (a share of their rows per block of this head's
            # queries) and the next block's queries, asked into L2 while this block computes: the
            # products' outputs they are come from L3 or memory, rows a model's width apart, which
            # packing them read at a fraction of the copy rate. BERT-base's [8, 128, 12, 64]
            # on bf16 pairs (one Zen 5 core, alternated): 0.95 of the time.
            per_block = -(-d.keys // blocks)
            first_key = item % blocks * per_block
            next_kv = heads.kv_base(bh + 1) + first_key * d.kv_stride
            for source in (k, v):
                _prefetch_rows(ctx, source, next_kv, (d.keys - first_key).minimum(per_block), d.kv_stride, d.size)
            _prefetch_rows(ctx, q, heads.q_row((item + 1) // blocks, (item + 1) % blocks * rows_per_block), rows_per_block,
                           d.q_stride, d.size)
            keys_across.times_keys(gemm, rows, seen, ctx.element_pointer(q, query_rows), d.q_stride, ctx.pointer(scores))
            with ctx.loop(0, rows, name="r") as r:
                heads.normalize(scores, r * score_stride, bh, first_query + r, seen)
            values.times_head(gemm, rows, seen, ctx.pointer(scores), ctx.element_pointer(out, query_rows))

    each_part(ctx, _block_parts(op), part)


@dataclass(frozen=True)
class _GradPart:
    """A worker-pool part of AttentionGradGemm: (batch, key/value head) items, and either
    all of their (query head, query block) pairs, adding into d keys and d values, or a
    share of one item's pairs (`pairs`), summed into the part's own partial d keys and d
    values that the step adds up after: no two parts add into the same rows."""

    items: tuple[int, int]
    pairs: tuple[int, int] | None = None


def _grad_parts(op) -> list[_GradPart]:
    """Whole items per part, or with fewer items than cores (a multi-query model at batch
    1 has one) each item's pairs shared out over the cores left to it."""
    d = _dims(op)
    batch, heads, queries, kv_heads = d.batch, d.heads, d.queries, d.kv_heads
    threads = thread_count() if worth_splitting(8 * batch * heads * queries * d.keys * d.size) else 1
    items = batch * kv_heads
    if items >= threads:
        return [_GradPart(share) for share in shares(items, threads)]
    pairs = heads // kv_heads * -(-queries // _block_rows(op))
    split = shares(pairs, threads // items)
    return [_GradPart((item, item + 1), share if len(split) > 1 else None) for item in range(items) for share in split]


def _grad_panels_offset(op) -> int:
    """Where a part's panels go in its share: after packing scratch, a block's
    probabilities and d scores, one head's d keys or values, and a share's partial d keys
    and d values."""
    d = _dims(op)
    size, keys = d.size, d.keys
    partials = 2 if any(part.pairs for part in _grad_parts(op)) else 0
    return _gemm_bytes(op) + 2 * 4 * _block_rows(op) * _score_stride(op) + (1 + partials) * 4 * keys * size


def _grad_share(op) -> int:
    """The scratch before the panels, then Kᵀ, Vᵀ and K in panels (a line to spare, to align them)."""
    return _grad_panels_offset(op) + 64 + _panels_bytes(op, 3)


def _grad_workspace(op) -> int:
    return len(_grad_parts(op)) * _grad_share(op)


@kernel("AttentionGradGemmDpbf16", {"AttentionGrad"}, supports=_pair_blocks, rank=10, workspace=_grad_workspace,
        calls=frozenset({SGEMM_DPBF16, SGEMM_PACKED_DPBF16}))
def attention_grad_pair_blocks(ctx, op) -> None:
    _attention_grad_blocks(ctx, op, pairs=True)


@kernel("AttentionGradGemm", {"AttentionGrad"}, supports=_gemm_blocks, rank=20, workspace=_grad_workspace,
        calls=frozenset({SGEMM_GENERATED, SGEMM_PACKED}))
def attention_grad_blocks(ctx, op) -> None:
    _attention_grad_blocks(ctx, op, pairs=False)


def _attention_grad_blocks(ctx, op, pairs: bool) -> None:
    """Per (batch, key/value head), for each query head of its group and block of query
    rows: the scores again (the forward's product), dP = dO Vᵀ, then P = exp(S − L) from the
    forward's statistics and dS in one pass per row, then dQ = dS K, dK += dSᵀ Q and
    dV += Pᵀ dO, the last two through a scratch head; on the GEMM on bf16 pairs where `pairs`.
    The one pass where the softmax took three and dS two: causal, one Zen 5 core, alternated,
    [32, 1024, 12, 64] 0.99 of the time (on bf16 pairs 0.97), [8, 256, 6, 48] 0.97 (1.00),
    [4, 256, 6 heads, 1, 48] 0.95; the five products take the rest."""
    q, k, v, _, _, dout = op.inputs[:6]
    dq, dk, dv = op.outputs
    d = _dims(op)
    size, keys, rows_per_block = d.size, d.keys, _block_rows(op)
    queries, heads, kv_heads = d.queries, d.heads, d.kv_heads
    groups, blocks = heads // kv_heads, -(-queries // rows_per_block)
    score_stride = _score_stride(op)
    block_floats, head_floats = rows_per_block * score_stride, keys * size
    share, parts = _grad_share(op), _grad_parts(op)

    def scratch(ctx, number: int | Value, name: str, offset: int, count: int):
        at = ctx.b.gep(ctx.address(ctx.workspace), [ctx.index(number * share + _gemm_bytes(op) + offset).ir])
        return ctx.scratch(f"{op.name}/{name}{number if isinstance(number, int) else ''}", q.dtype, count, at)

    def partials(ctx, number: int | Value):
        """A part's partial d keys and d values, after its scratch head."""
        return [scratch(ctx, number, name, 8 * block_floats + 4 * head_floats * (1 + i), head_floats)
                for i, name in enumerate(("dk", "dv"))]

    into_partials = parts[0].pairs is not None  # parts share out each item's pairs (the same for every part)

    def part(ctx, number: int | Value, first_item, last_item, first_pair, last_pair) -> None:
        geometry = _Heads(ctx, q, k, op)
        gemm = GeneratedGemm(ctx, SGEMM_DPBF16 if pairs else SGEMM_GENERATED, number, share)
        packed = PackedGemm(ctx, pairs=pairs)
        panels_at = cache_line_aligned(
            ctx.b, ctx.b.gep(ctx.address(ctx.workspace), [ctx.index(number * share + _grad_panels_offset(op)).ir]), BYTE_PTR)
        keys_across, values_across, keys_along = (
            _Panels(ctx, f"{op.name}/{name}", ctx.b.gep(panels_at, [i64(i * _panels_bytes(op, 1))]), op, pairs)
            for i, name in enumerate(("kt", "vt", "k")))
        p = scratch(ctx, number, "p", 0, block_floats)
        ds = scratch(ctx, number, "ds", 4 * block_floats, block_floats)
        head = scratch(ctx, number, "head", 8 * block_floats, head_floats)
        with ctx.loop(first_item, last_item, name="item") as item:
            batch, kv_head = item // kv_heads, item % kv_heads
            kv = d.kv_head_start(batch, kv_head)
            # where this part adds d keys and d values, and its rows' stride: the outputs, or its partials
            targets = ([(grad, kv, d.kv_stride) for grad in (dk, dv)] if not into_partials else
                       [(grad, 0, size) for grad in partials(ctx, number)])
            for grad, base, stride in targets:
                with ctx.loop(0, keys, name="j") as j:
                    Row(ctx, base + j * stride, size, q.dtype).each(
                        lambda i, w, grad=grad: ctx.store(grad, i, ctx.constant(q.dtype, 0.0, w)))  # type: ignore[misc]  # (mypy infers no lambda binding a loop variable by default)
            keys_across.across_keys(k, kv)
            values_across.across_keys(v, kv)
            keys_along.along_keys(k, kv)
            with ctx.loop(first_pair, last_pair, name="gb") as gb:
                bh = batch * heads + kv_head * groups + gb // blocks
                first_query = gb % blocks * rows_per_block
                rows, seen = geometry.block(first_query, rows_per_block)
                query_rows = geometry.q_row(bh, first_query)
                at_q, at_dout = ctx.element_pointer(q, query_rows), ctx.element_pointer(dout, query_rows)
                keys_across.times_keys(packed, rows, seen, at_q, d.q_stride, ctx.pointer(p))
                values_across.times_keys(packed, rows, seen, at_dout, d.q_stride, ctx.pointer(ds))
                with ctx.loop(0, rows, name="r") as r:
                    geometry.score_gradients(p, ds, r * score_stride, bh, first_query + r, seen, dout)
                keys_along.times_head(packed, rows, seen, ctx.pointer(ds), ctx.element_pointer(dq, query_rows))
                for (grad, base, stride), left, right in zip(targets, (ds, p), (at_q, at_dout)):
                    gemm.gemm(True, False, seen, size, rows, ctx.pointer(left), score_stride, right, d.q_stride, ctx.pointer(head),
                              size)
                    with ctx.loop(0, seen, name="j") as j:
                        row = base + j * stride - j * size  # the head's row j, where `head` has it at j · size
                        Row(ctx, j * size, size, q.dtype).each(lambda i, w, grad=grad, row=row: ctx.store(  # type: ignore[misc]  # (mypy infers no lambda binding a loop variable by default)
                            grad, row + i, ctx.load(grad, row + i, w) + ctx.load(head, i, w)))

    each_part(ctx, [(*shared.items, *(shared.pairs or (0, groups * blocks))) for shared in parts], part)
    for item in sorted({shared.items[0] for shared in parts if shared.pairs is not None}):
        shares_of_item = [partials(ctx, number) for number, shared in enumerate(parts) if shared.pairs and shared.items[0] == item]
        for grad, sources in zip((dk, dv), zip(*shares_of_item)):
            _add_up(ctx, grad, d.kv_head_start(item // kv_heads, item % kv_heads), d.kv_stride, sources, keys, size)


def _add_up(ctx, target, base: int, stride: int, sources, rows: int, size: int) -> None:
    """The target's `rows` rows of `size` from `base`, `stride` apart, = the sum of the
    sources' (rows of `size` one after another)."""
    with ctx.loop(0, rows, name="j") as j:
        def store(i, w):
            total = functools.reduce(operator.add, (ctx.load(source, i, w) for source in sources))
            ctx.store(target, base + j * stride + i - j * size, total)

        Row(ctx, j * size, size, target.dtype).each(store)


@kernel("AttentionRow", {"Attention"}, supports=_rows_heads_first, rank=30)
def attention(ctx, op) -> None:
    q, k, v = op.inputs[:3]
    out = op.outputs[0]
    heads = _Heads(ctx, q, k, op)
    p = heads.buffer()
    fill(ctx, out, 0.0)

    def weighted_values(kv, row, count):
        with ctx.loop(0, count, name="j") as j:
            heads.axpy(p.load(j), v, kv + j * heads.size, out, row)

    heads.each_query(q, k, p, weighted_values)


@kernel("AttentionGradRow", {"AttentionGrad"}, supports=_rows_heads_first, rank=30)
def attention_grad(ctx, op) -> None:
    """Per (batch·head, query), three passes over the keys it sees: their scores and
    d probabilities (dot products) into row buffers; each probability from the forward's
    log-sum-exp and its d score with the row's D = d out · out (no maximum or sum found
    again); then the three gradients' terms. The exponentials keep a loop of their own:
    [2, 4, 256, 64] float64, causal, one Zen 5 core, took 1.5 times as long with every
    key's work in one pass, 1.15 times with the exponentials in the dot products' loop."""
    q, k, v, _, _, dout = op.inputs[:6]
    dq, dk, dv = op.outputs
    heads = _Heads(ctx, q, k, op)
    p, ds = heads.buffer(), heads.buffer()
    for var in (dq, dk, dv):
        fill(ctx, var, 0.0)
    with ctx.loop(0, heads.batch * heads.heads, name="bh") as bh:
        kv = heads.kv_base(bh)
        with ctx.loop(0, heads.queries, name="t") as t:
            row, bias_start, seen = heads.q_row(bh, t), heads.bias_start(bh, t), heads.visible(t)
            lse, d = heads.row_terms(dout, bh, t)
            with ctx.loop(0, seen, name="j") as j:
                p.store(j, heads.score(q, row, k, kv, j, bias_start))
                ds.store(j, heads.dot(dout, row, v, kv + j * heads.size))
            with ctx.loop(0, seen, name="j") as j:
                probability = heads.probability(p.load(j), lse)
                p.store(j, probability)
                ds.store(j, probability * (ds.load(j) - d) * heads.scale)
            with ctx.loop(0, seen, name="j") as j:
                key_row = kv + j * heads.size
                heads.axpy(ds.load(j), k, key_row, dq, row)
                heads.axpy(ds.load(j), q, row, dk, key_row)
                heads.axpy(p.load(j), dout, row, dv, key_row)
