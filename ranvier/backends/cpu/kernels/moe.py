"""Mixture-of-experts kernels (top-k selection, alone or after the router's softmax in the
same pass over a row, is a row op: `llvm/rows.py`): the counting sort that routes tokens to experts, and the
grouped GEMMs, one GEMM call per expert over its run-time group of rows (or per piece of
its columns where experts are few beside the cores), the calls claimed one at a time by
the worker pool's parts, the largest groups first: ranvier's generated GEMM where it
measured faster than BLAS on a typical group, else BLAS; and the combine of each token's
expert rows, with its gradients."""

from __future__ import annotations

import functools
import operator

from llvmlite import ir

from .... import dtypes
from ....ops import attrs_of
from ...llvm.context import check_range, load_index
from ...llvm.irutil import I64, i64
from ...llvm.routing import group_bounds, route
from ...llvm.rows import Row
from ...llvm.values import Value
from .. import sgemm
from ..codegen import SGEMM_GENERATED
from ..gemm_choice import generated_is_faster
from ..parallel import each_claimed, run_parts, share_out, shares, thread_count, worth_splitting
from ..target import host_target
from .library import kernel
from .matmul import Blas, GeneratedGemm, single_threaded_blas


def _supported_float(op) -> bool:
    return op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64) and op.outputs[0].dtype == op.inputs[0].dtype


@kernel("MoERoute", {"MoERoute"})
def moe_route(ctx, op) -> None:
    route(ctx, op)


def _combine_threads(op) -> int:
    return thread_count() if worth_splitting(nbytes=sum(v.nbytes for v in (*op.inputs, *op.outputs))) else 1


def _slot(ctx, slot, n: Value, rows: int) -> tuple[Value, Value]:
    """(slot n, whether it names one of the rows); one that does not fails the step."""
    row = load_index(ctx, slot, n)
    return row, check_range(ctx, row, rows)


@kernel("MoECombineRows", {"MoECombine"}, supports=_supported_float)
def moe_combine(ctx, op) -> None:
    """Each token's row: its k expert rows read in place, weighted and summed in registers;
    the tokens shared out over the pool."""
    rows, slot, weights = op.inputs
    y = op.outputs[0]
    width, k = rows.shape[1], slot.shape[1]

    def tokens(ctx, first: int | Value, last: int | Value) -> None:
        with ctx.loop(first, last, name="t") as t:
            chosen = []
            for j in range(k):
                row, inside = _slot(ctx, slot, t * k + j, rows.shape[0])
                chosen.append((inside.where(row, 0) * width, inside.where(ctx.load(weights, t * k + j), 0.0)))

            def store(i, w):
                terms = [weight.splat(w) * ctx.load(rows, start + i - t * width, w) for start, weight in chosen]
                ctx.store(y, i, functools.reduce(operator.add, terms))

            Row(ctx, t * width, width, y.dtype).each(store)

    share_out(ctx, slot.shape[0], _combine_threads(op), tokens)


@kernel("MoECombineGradRows", {"MoECombineGrad"}, supports=_supported_float)
def moe_combine_grad(ctx, op) -> None:
    """Each part: the weights' gradients of its share of the tokens (a dot product a
    choice), then the rows' gradients of its share of the rows, scanning every slot for
    those it owns, so no two parts add into one row."""
    dy, rows, slot, weights = op.inputs
    d_rows, d_weights = op.outputs
    width, (tokens, k) = rows.shape[1], slot.shape
    threads = _combine_threads(op)

    def part(tokens_share: tuple[int, int], rows_share: tuple[int, int]):
        def emit(ctx) -> None:
            with ctx.loop(*tokens_share, name="t") as t:
                for j in range(k):
                    row, inside = _slot(ctx, slot, t * k + j, rows.shape[0])
                    start = inside.where(row, 0) * width
                    dot = Row(ctx, t * width, width, dy.dtype).sum(
                        lambda i, w, start=start: ctx.load(dy, i, w) * ctx.load(rows, start + i - t * width, w))  # type: ignore[misc]  # (mypy infers no lambda binding a loop variable by default)
                    ctx.store(d_weights, t * k + j, inside.where(dot, 0.0))
            low, high = rows_share
            Row(ctx, ctx.index(low * width), (high - low) * width, d_rows.dtype).each(
                lambda i, w: ctx.store(d_rows, i, ctx.constant(d_rows.dtype, 0.0, w)))
            with ctx.loop(0, tokens * k, name="n") as n:
                row = load_index(ctx, slot, n)
                with ctx.when((row >= low) & (row < high)):
                    t, weight = n // k, ctx.load(weights, n)
                    Row(ctx, row * width, width, d_rows.dtype).each(lambda i, w: ctx.store(
                        d_rows, i, ctx.load(d_rows, i, w) + weight.splat(w) * ctx.load(dy, i - row * width + t * width, w)))

        return emit

    token_shares, row_shares = shares(tokens, threads), shares(rows.shape[0], threads)
    count = max(len(token_shares), len(row_shares))
    token_shares += [(tokens, tokens)] * (count - len(token_shares))
    row_shares += [(rows.shape[0], rows.shape[0])] * (count - len(row_shares))
    run_parts(ctx, [part(*shared) for shared in zip(token_shares, row_shares)])


def _group(ctx, offsets, e: Value, rows: int, body) -> None:
    """body(start, count) for expert e's group of rows; a group whose offsets are bad
    marks the step failed (the runtime raises) and is skipped."""
    start, stop, good = group_bounds(ctx, offsets, e, rows)
    with ctx.when(good):
        body(start, stop - start)


def _output_columns(op) -> int:
    """The columns each expert's product is cut along: y's, or dy's for a weight gradient."""
    return op.outputs[0].shape[1] if op.type == "GroupedMatMul" else op.inputs[1].shape[1]


def _experts(op) -> int:
    return op.outputs[0].shape[0] if op.type == "GroupedMatMulWeightGrad" else op.inputs[1].shape[0]


def _parts(op) -> int:
    """Worker-pool parts: every core where the product is worth splitting."""
    x = op.inputs[0]
    return thread_count() if worth_splitting(2 * x.shape[0] * x.shape[1] * _output_columns(op)) else 1


# Work items per part: groups of uneven sizes, claimed as parts finish, even out. An
# expert's whole product is one item where there are enough of them: cut in two halves
# of columns (as every part's slice of all groups was), a 512-column product of 8 groups
# of ~256 rows ran 10% slower on 2 cores of an Emerald Rapids Xeon (a ragged panel per
# half, and every part through every group).
_ITEMS_PER_PART = 4


def _piece_columns(op) -> int:
    """The columns of one work item: each expert's product in as few pieces as give every
    part `_ITEMS_PER_PART` items, each piece whole panels of the GEMM."""
    n, parts = _output_columns(op), _parts(op)
    if parts == 1:
        return n
    pieces = -(-_ITEMS_PER_PART * parts // _experts(op))
    return shares(n, pieces, sgemm.panel_width(host_target()))[0][1]


def _typical_rows(op) -> int:
    """An expert's rows when routing is balanced: what the GEMM choice is measured on."""
    return max(2, op.inputs[0].shape[0] // _experts(op))


def _group_call(op, columns: int) -> tuple[bool, bool, int, int, int, int, int]:
    """(ta, tb, m, n, k, lda, ldb) of a part's GEMM for one typical group."""
    x, rows = op.inputs[0], _typical_rows(op)
    k = x.shape[1]
    if op.type == "GroupedMatMul":
        w = op.inputs[1]
        return False, bool(attrs_of(op)["transpose_b"]), rows, columns, k, k, w.shape[2]
    n = op.inputs[1].shape[1]
    if attrs_of(op)["transpose"]:
        return True, False, columns, k, rows, n, k
    return True, False, k, columns, rows, k, n


def _float32(op) -> bool:
    return _supported_float(op) and op.inputs[0].dtype == dtypes.DT_FLOAT32


def _generated_faster(op) -> bool:
    """The generated GEMM measured faster than BLAS on a typical group."""
    return generated_is_faster(*_group_call(op, _piece_columns(op)))


def _share(op) -> int:
    """The packing scratch of one part: B of a group call at most every row long."""
    _, _, _, n, _, _, _ = _group_call(op, _piece_columns(op))
    k = op.inputs[0].shape[1] if op.type == "GroupedMatMul" else op.inputs[0].shape[0]
    return sgemm.workspace_bytes(n, k)


_COUNTER_BYTES = 64  # the work-item counter, on a cache line of its own


def _order_bytes(op) -> int:
    """The experts in the order their pieces are claimed: one int64 each."""
    return 8 * _experts(op)


def _workspace(op) -> int:
    """The parts' packing scratch, then the counter and the claiming order."""
    return _parts(op) * _share(op) + _COUNTER_BYTES + _order_bytes(op)


def _blas_workspace(op) -> int:
    return _COUNTER_BYTES + _order_bytes(op)


class _Caller:
    """The GEMM a part calls, generated or BLAS, and where the step's work-item counter
    and claiming order are."""

    def __init__(self, op, generated: bool):
        self.share = _share(op) if generated else 0
        self.counter_at = _parts(op) * self.share
        self.dtype = op.inputs[0].dtype
        self.name, self.experts = op.name, _experts(op)

    def gemm(self, ctx, number: int):
        if self.share:
            return GeneratedGemm(ctx, SGEMM_GENERATED, number, self.share)
        return Blas(ctx, self.dtype)

    def counter(self, ctx) -> ir.Value:
        return ctx.b.bitcast(self._at(ctx, self.counter_at), I64.as_pointer())

    def order(self, ctx):
        """The experts, largest group first (`_largest_first`)."""
        return ctx.scratch(f"{self.name}/order", dtypes.DT_INT64, self.experts, self._at(ctx, self.counter_at + _COUNTER_BYTES))

    @staticmethod
    def _at(ctx, offset: int) -> ir.Value:
        return ctx.b.gep(ctx.address(ctx.workspace), [i64(offset)])


def _largest_first(ctx, offsets, order, experts: int) -> None:
    """order = the experts by group size, largest first (ties by number): each expert's
    place is how many groups come before it. Parts claiming the largest products first
    finish nearly together: in the experts' order, moe-15M's steps left one part idle for
    4.8% of a grouped product on average (simulated from its routing, 2 parts), largest
    first 1.5%. Emerald Rapids, 2 cores: groups of 18 to 541 rows in rising order 2.81 →
    2.45 ms, seven of 128 and one of 1,152 3.31 → 2.42; the moe-15M step 245.2 → 240.8
    and 247.4 → 245.5 ms (alternated trainers)."""
    def size(e):
        return ctx.load(offsets, e + 1).cast(dtypes.DT_INT64) - ctx.load(offsets, e).cast(dtypes.DT_INT64)

    with ctx.loop(0, experts, name="e") as e:
        place = ctx.local(dtypes.DT_INT64, initial=0)
        with ctx.loop(0, experts, name="other") as other:
            before = (size(other) > size(e)) | (size(other).equal(size(e)) & (other < e))
            place.set(before.where(place.value + 1, place.value))
        ctx.store(order, place.value, e)


def _each_piece(ctx, op, caller: _Caller, body) -> None:
    """body(ctx, gemm, e, first, columns) for every expert e and piece of columns
    [first, first + columns) of its product, the pieces claimed by the parts at run time,
    the largest groups' first."""
    n, experts, size = _output_columns(op), _experts(op), _piece_columns(op)
    pieces = -(-n // size)
    ctx.b.store(i64(0), caller.counter(ctx))
    _largest_first(ctx, op.inputs[2], caller.order(ctx), experts)

    def part(number: int):
        def emit(ctx) -> None:
            gemm, order = caller.gemm(ctx, number), caller.order(ctx)
            with each_claimed(ctx, caller.counter(ctx), experts * pieces) as item:
                first = (item % pieces) * size
                body(ctx, gemm, ctx.load(order, item // pieces), first, (first + size).minimum(n) - first)

        return emit

    run_parts(ctx, [part(number) for number in range(_parts(op))])


@kernel("GroupedGemm", {"GroupedMatMul"}, supports=_float32, rank=10, prefer=_generated_faster, workspace=_workspace,
        calls=frozenset({SGEMM_GENERATED}))
def grouped_generated(ctx, op) -> None:
    """The grouped product through ranvier's generated GEMM."""
    _grouped_matmul(ctx, op, _Caller(op, generated=True))


@kernel("GroupedBlasGemm", {"GroupedMatMul"}, supports=_supported_float, rank=20, workspace=_blas_workspace)
def grouped_blas(ctx, op) -> None:
    single_threaded_blas(ctx)
    _grouped_matmul(ctx, op, _Caller(op, generated=False))


@kernel("GroupedGemmWeightGrad", {"GroupedMatMulWeightGrad"}, supports=_float32, rank=10, prefer=_generated_faster,
        workspace=_workspace, calls=frozenset({SGEMM_GENERATED}))
def grouped_weight_grad_generated(ctx, op) -> None:
    _grouped_weight_grad(ctx, op, _Caller(op, generated=True))


@kernel("GroupedBlasGemmWeightGrad", {"GroupedMatMulWeightGrad"}, supports=_supported_float, rank=20, workspace=_blas_workspace)
def grouped_weight_grad_blas(ctx, op) -> None:
    single_threaded_blas(ctx)
    _grouped_weight_grad(ctx, op, _Caller(op, generated=False))



def _grouped_matmul(ctx, op, caller: _Caller) -> None:
    """y[group e] = x[group e] · w[e], a piece of its columns at a time."""
    x, w, offsets = op.inputs
    y = op.outputs[0]
    tb = attrs_of(op)["transpose_b"]
    experts = w.shape[0]
    rows, k = x.shape
    n = y.shape[1]

    def piece(ctx, gemm, e: Value, first: Value, columns: Value) -> None:
        def group(start: Value, count: Value) -> None:
            with ctx.when(count > 0):
                matrix = ctx.element_pointer(w, e * (k * n) + (first * k if tb else first))
                gemm.gemm(False, tb, count, columns, k, ctx.element_pointer(x, start * k), k, matrix, w.shape[2],
                          ctx.element_pointer(y, start * n + first), n)

        _group(ctx, offsets, e, rows, group)

    _each_piece(ctx, op, caller, piece)
    # Rows past the last group (choices dropped at capacity) are zero.
    last = ctx.load(offsets, experts).cast(dtypes.DT_INT64).minimum(rows).maximum(0)
    with ctx.loop(last * n, rows * n, name="z") as i:
        ctx.store(y, i, 0.0)


def _grouped_weight_grad(ctx, op, caller: _Caller) -> None:
    """dw[e] = x_eᵀ · dy_e (or, transposed, dy_eᵀ · x_e); an expert no row chose gets zeros.
    A piece of dy's columns makes that slice of dw[e]."""
    x, dy, offsets = op.inputs
    dw = op.outputs[0]
    transpose = attrs_of(op)["transpose"]
    rows, k = x.shape
    n = dy.shape[1]
    block = k * n

    def piece(ctx, gemm, e: Value, first: Value, columns: Value) -> None:
        def group(start: Value, count: Value) -> None:
            with ctx.when(count > 0):
                x_rows, dy_rows = ctx.element_pointer(x, start * k), ctx.element_pointer(dy, start * n + first)
                if transpose:  # dw[e] is [n, k]: its rows first..last
                    gemm.gemm(True, False, columns, k, count, dy_rows, n, x_rows, k, ctx.element_pointer(dw, e * block + first * k), k)
                else:  # dw[e] is [k, n]: its columns first..last
                    gemm.gemm(True, False, k, columns, count, x_rows, k, dy_rows, n, ctx.element_pointer(dw, e * block + first), n)
            with ctx.when(count.equal(0)), ctx.loop(0, k, name="r") as r, ctx.loop(first, first + columns, name="z") as j:
                ctx.store(dw, e * block + (j * k + r if transpose else r * n + j), 0.0)

        _group(ctx, offsets, e, rows, group)

    _each_piece(ctx, op, caller, piece)
