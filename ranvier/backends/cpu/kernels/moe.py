"""Mixture-of-experts kernels: top-k selection (alone, or after the router's softmax in
the same pass over a row), the counting sort that routes tokens to experts, and the
grouped GEMMs, one GEMM call per expert over its run-time group of rows (per slice of
columns, the slices shared out over the worker pool): ranvier's generated GEMM where it
measured faster than BLAS on a typical group, else BLAS."""

from __future__ import annotations

from .... import dtypes
from ....ops import attrs_of
from ...llvm.routing import group_bounds, route
from ...llvm.rows import softmax_top_k_rows, top_k_rows
from ...llvm.values import Value
from .. import sgemm
from ..codegen import SGEMM_GENERATED
from ..gemm_choice import generated_is_faster
from ..parallel import run_parts, shares, thread_count, worth_splitting
from .library import kernel
from .matmul import GENERATED_GEMM_KERNELS, Blas, GeneratedGemm, single_threaded_blas
from .rows import each_row


@kernel("TopKRow", {"TopK"})
def top_k(ctx, op) -> None:
    each_row(ctx, op, top_k_rows(op))


@kernel("SoftmaxTopKRow", {"SoftmaxTopK"})
def softmax_top_k(ctx, op) -> None:
    each_row(ctx, op, softmax_top_k_rows(op))


def _supported_float(op) -> bool:
    return op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64) and op.outputs[0].dtype == op.inputs[0].dtype


@kernel("MoERoute", {"MoERoute"})
def moe_route(ctx, op) -> None:
    route(ctx, op)


def _groups(ctx, offsets, experts: int, rows: int, body) -> None:
    """body(e, start, count) for each expert's group of rows; a group whose offsets are
    bad marks the step failed (the runtime raises) and is skipped."""
    with ctx.loop(0, experts, name="e") as e:
        start, stop, good = group_bounds(ctx, offsets, e, rows)
        with ctx.when(good):
            body(e, start, stop - start)


def _column_shares(rows: int, k: int, n: int) -> list[tuple[int, int]]:
    """The columns of a grouped product's output each worker-pool part computes, for
    every group (the split is fixed at compile time, so it assumes all rows are routed)."""
    worth = worth_splitting(2 * rows * k * n)
    return shares(n, thread_count() if worth else 1, 16)


def _typical_rows(op) -> int:
    """An expert's rows when routing is balanced: what the GEMM choice is measured on."""
    experts = op.outputs[0].shape[0] if op.type == "GroupedMatMulWeightGrad" else op.inputs[1].shape[0]
    return max(2, op.inputs[0].shape[0] // experts)


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


def _parts(op) -> list[tuple[int, int]]:
    x = op.inputs[0]
    n = op.outputs[0].shape[1] if op.type == "GroupedMatMul" else op.inputs[1].shape[1]
    return _column_shares(x.shape[0], x.shape[1], n)


def _generated_faster(op) -> bool:
    """float32, and the generated GEMM measured faster than BLAS on a typical group."""
    if not _supported_float(op) or op.inputs[0].dtype != dtypes.DT_FLOAT32:
        return False
    first, last = _parts(op)[0]
    return generated_is_faster(*_group_call(op, last - first))


def _share(op) -> int:
    """The packing scratch of one part: B of a group call at most every row long."""
    first, last = _parts(op)[0]
    _, _, _, n, _, _, _ = _group_call(op, last - first)
    k = op.inputs[0].shape[1] if op.type == "GroupedMatMul" else op.inputs[0].shape[0]
    return sgemm.workspace_bytes(n, k)


def _workspace(op) -> int:
    return len(_parts(op)) * _share(op)


def _generated(op):
    share = _share(op)
    return lambda ctx, number: GeneratedGemm(ctx, SGEMM_GENERATED, number, share)


def _blas(ctx, op):
    single_threaded_blas(ctx)
    return lambda ctx, number: Blas(ctx, op.inputs[0].dtype)


@kernel("GroupedGemm", {"GroupedMatMul"}, supports=_generated_faster, workspace=_workspace)
def grouped_generated(ctx, op) -> None:
    """The grouped product through ranvier's generated GEMM."""
    _grouped_matmul(ctx, op, _generated(op))


@kernel("GroupedBlasGemm", {"GroupedMatMul"}, supports=_supported_float)
def grouped_blas(ctx, op) -> None:
    _grouped_matmul(ctx, op, _blas(ctx, op))


@kernel("GroupedGemmWeightGrad", {"GroupedMatMulWeightGrad"}, supports=_generated_faster, workspace=_workspace)
def grouped_weight_grad_generated(ctx, op) -> None:
    _grouped_weight_grad(ctx, op, _generated(op))


@kernel("GroupedBlasGemmWeightGrad", {"GroupedMatMulWeightGrad"}, supports=_supported_float)
def grouped_weight_grad_blas(ctx, op) -> None:
    _grouped_weight_grad(ctx, op, _blas(ctx, op))


GENERATED_GEMM_KERNELS.update({"GroupedGemm", "GroupedGemmWeightGrad"})


def _grouped_matmul(ctx, op, caller) -> None:
    """y[group e] = x[group e] · w[e], each part computing its columns of every group
    (`caller(ctx, part)`: the GEMM a part calls, generated or BLAS)."""
    x, w, offsets = op.inputs
    y = op.outputs[0]
    tb = attrs_of(op)["transpose_b"]
    experts = w.shape[0]
    rows, k = x.shape
    n = y.shape[1]

    def part(number: int, first: int, last: int):
        def emit(ctx) -> None:
            gemm = caller(ctx, number)

            def group(e: Value, start: Value, count: Value) -> None:
                with ctx.when(count > 0):
                    matrix = ctx.element_pointer(w, e * (k * n) + (first * k if tb else first))
                    gemm.gemm(False, tb, count, last - first, k, ctx.element_pointer(x, start * k), k, matrix, w.shape[2],
                              ctx.element_pointer(y, start * n + first), n)

            _groups(ctx, offsets, experts, rows, group)

        return emit

    run_parts(ctx, [part(number, first, last) for number, (first, last) in enumerate(_parts(op))])
    # Rows past the last group (choices dropped at capacity) are zero.
    last = ctx.load(offsets, experts).cast(dtypes.DT_INT64).minimum(rows).maximum(0)
    with ctx.loop(last * n, rows * n, name="z") as i:
        ctx.store(y, i, 0.0)


def _grouped_weight_grad(ctx, op, caller) -> None:
    """dw[e] = x_eᵀ · dy_e (or, transposed, dy_eᵀ · x_e); an expert no row chose gets zeros.
    Each part computes the slice of every dw[e] that its columns of dy make."""
    x, dy, offsets = op.inputs
    dw = op.outputs[0]
    transpose = attrs_of(op)["transpose"]
    experts = dw.shape[0]
    rows, k = x.shape
    n = dy.shape[1]
    block = k * n

    def part(number: int, first: int, last: int):
        def emit(ctx) -> None:
            gemm = caller(ctx, number)
            columns = last - first

            def group(e: Value, start: Value, count: Value) -> None:
                with ctx.when(count > 0):
                    x_rows, dy_rows = ctx.element_pointer(x, start * k), ctx.element_pointer(dy, start * n + first)
                    if transpose:  # dw[e] is [n, k]: its rows first..last
                        gemm.gemm(True, False, columns, k, count, dy_rows, n, x_rows, k, ctx.element_pointer(dw, e * block + first * k), k)
                    else:  # dw[e] is [k, n]: its columns first..last
                        gemm.gemm(True, False, k, columns, count, x_rows, k, dy_rows, n, ctx.element_pointer(dw, e * block + first), n)
                with ctx.when(count.equal(0)), ctx.loop(0, k, name="r") as r, ctx.loop(first, last, name="z") as j:
                    ctx.store(dw, e * block + (j * k + r if transpose else r * n + j), 0.0)

            _groups(ctx, offsets, experts, rows, group)

        return emit

    run_parts(ctx, [part(number, first, last) for number, (first, last) in enumerate(_parts(op))])
