"""The CPU's row kernels: the fused row passes of `ranvier.backends.llvm.rows`, rows shared
out over the cores, each row's passes in vectors."""

from __future__ import annotations

from collections.abc import Callable

from ...llvm.rows import (
    cross_entropy_grad_rows,
    cross_entropy_rows,
    last_axis,
    nonempty_rows,
    norm_rows,
    rms_norm_grad_rows,
    rotary_rows,
    row_shape,
    sample_rows,
    softmax_rows,
    with_epilogue,
)
from ...llvm.values import Value
from ..codegen import KernelContext
from ..parallel import share_out, thread_count, worth_splitting
from .library import kernel


def each_row(ctx: KernelContext, op, body: Callable[[KernelContext, Value], None]) -> None:
    """`body(ctx, r)` for every row r; rows of a large op are shared out over threads."""
    rows, _ = row_shape(op)
    if rows == 0:
        return
    nbytes = sum(v.nbytes for v in [*op.inputs, *op.outputs])
    threads = thread_count() if worth_splitting(nbytes=nbytes) else 1

    def share(ctx: KernelContext, first: int | Value, last: int | Value) -> None:
        with ctx.loop(first, last, name="row") as r:
            body(ctx, r)

    share_out(ctx, rows, threads, share)


@kernel("SoftmaxRow", {"Softmax"}, supports=last_axis)
@kernel("LogSoftmaxRow", {"LogSoftmax"}, supports=last_axis)
def softmax(ctx, op) -> None:
    each_row(ctx, op, softmax_rows(op))


@kernel("LayerNormRow", {"LayerNorm"}, supports=nonempty_rows)
@kernel("RMSNormRow", {"RMSNorm"}, supports=nonempty_rows)
def norm(ctx, op) -> None:
    each_row(ctx, op, norm_rows(op))


@kernel("RMSNormGradRow", {"RMSNormGrad"}, supports=nonempty_rows)
def norm_grad(ctx, op) -> None:
    each_row(ctx, op, rms_norm_grad_rows(op))


@kernel("RowEpilogue", {"RMSNormCalculate", "LayerNormCalculate", "RMSNormGradCalculate"}, supports=nonempty_rows)
def norm_with_epilogue(ctx, op) -> None:
    each_row(ctx, op, with_epilogue(op))


@kernel("RotaryRow", {"Rotary"})
def rotary(ctx, op) -> None:
    each_row(ctx, op, rotary_rows(op))


@kernel("CrossEntropyRow", {"SoftmaxCrossEntropy"}, supports=nonempty_rows)
def cross_entropy(ctx, op) -> None:
    each_row(ctx, op, cross_entropy_rows(op))


@kernel("CrossEntropyGradRow", {"SoftmaxCrossEntropyGrad"}, supports=nonempty_rows)
def cross_entropy_grad(ctx, op) -> None:
    each_row(ctx, op, cross_entropy_grad_rows(op))


@kernel("SampleTokenRow", {"SampleToken"}, supports=nonempty_rows)
def sample_token(ctx, op) -> None:
    each_row(ctx, op, sample_rows(op))
