"""Fused row kernels over the last axis: Softmax, LogSoftmax, LayerNorm, RMSNorm and
SoftmaxCrossEntropy, each in as few passes over the row as its math allows.

    softmax        max | exp, sum (exp stored) | scale
    log_softmax    max | sum of exp            | x − max − log(sum)
    layer_norm     mean | variance             | normalize, scale, shift
    rms_norm       mean square                 | normalize, scale
    cross-entropy  max | sum of exp (and of target·x) → one loss per row
"""

from __future__ import annotations

import math
from typing import Callable

from llvmlite import ir

from .... import dtypes
from ....ops import attrs_of
from .. import mathlib
from ..codegen import KernelContext
from ..convert import narrow, widen
from ..irutil import compute_type, constant, for_range, i64, intrinsic, load, splat, storage_type, store, vector_of
from ..parallel import run_parts, shares, thread_count, worth_splitting
from ..views import for_vectors
from .index import check_range, load_index


class Row:
    """Vector passes over one row of `length` elements starting at element `start`."""

    def __init__(self, ctx: KernelContext, start: ir.Value, length: int, dtype: str):
        self.ctx, self.b = ctx, ctx.b
        self.start, self.length, self.dtype = start, length, dtype
        self.ctype = compute_type(dtype)
        self.lanes = ctx.lanes_for([dtype])
        while self.lanes > 1 and self.lanes > length:  # short rows (a head of 8) use narrower vectors
            self.lanes //= 2

    def read(self, var, index, width):
        return widen(self.b, load(self.b, self.ctx.pointer(var), index, storage_type(var.dtype), width), var.dtype, width)

    def write(self, var, value, index, width):
        store(self.b, narrow(self.b, value, var.dtype, width), self.ctx.pointer(var), index, storage_type(var.dtype), width)

    def fold(self, init: float, combine, term) -> ir.Value:
        """Fold `term(index, width)` over the row with `combine`, vector lanes first."""
        b = self.b
        with b.goto_entry_block():
            vacc = b.alloca(vector_of(self.ctype, self.lanes))
            sacc = b.alloca(self.ctype)
        b.store(constant(vector_of(self.ctype, self.lanes), init), vacc)
        b.store(constant(self.ctype, init), sacc)

        def step(index, width):
            slot = vacc if width > 1 else sacc
            b.store(combine(b.load(slot), term(index, width)), slot)

        for_vectors(b, self.start, self.length, self.lanes, step)
        total = b.load(sacc)
        if self.lanes > 1 and self.length >= self.lanes:
            vector = b.load(vacc)
            for lane in range(self.lanes):
                total = combine(total, b.extract_element(vector, i64(lane)))
        return total

    def each(self, body) -> None:
        for_vectors(self.b, self.start, self.length, self.lanes, body)

    def splat(self, value, width):
        return splat(self.b, value, width)


def _max(b):
    return lambda acc, x: b.select(b.fcmp_ordered(">", x, acc), x, acc)


def _add(b):
    return lambda acc, x: b.fadd(acc, x)


def _rows(op):
    x = op.inputs[0]
    return x.size // x.shape[-1] if x.shape[-1] else 0, x.shape[-1]


def each_row(ctx: KernelContext, op, body: Callable[[KernelContext, ir.Value], None]) -> None:
    """`body(ctx, r)` for every row r; rows of a large op are shared out over threads."""
    rows, _ = _rows(op)
    if rows == 0:
        return
    nbytes = sum(v.nbytes for v in [*op.inputs, *op.outputs])
    threads = thread_count() if worth_splitting(nbytes=nbytes) else 1

    def part(first: int, last: int):
        def run(ctx: KernelContext) -> None:
            with for_range(ctx.b, i64(first), i64(last), name="row") as r:
                body(ctx, r)

        return run

    run_parts(ctx, [part(first, last) for first, last in shares(rows, threads)])


def softmax(ctx, op) -> None:
    x, y = op.inputs[0], op.outputs[0]
    rows, n = _rows(op)
    log = op.type == "LogSoftmax"
    # A float32/float64 y holds the exponentials between passes; a half-precision y
    # would round them, and the result twice, so there they are computed again.
    keep = not log and y.dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64)

    def body(ctx, r):
        b = ctx.b
        row = Row(ctx, b.mul(r, i64(n)), n, x.dtype)
        peak = row.fold(-math.inf, _max(b), lambda i, w: row.read(x, i, w))

        def exponential(i, w):
            return mathlib.emit("exp", b, b.fsub(row.read(x, i, w), row.splat(peak, w)))

        def exp_term(i, w):
            e = exponential(i, w)
            if keep:
                row.write(y, e, i, w)
            return e

        total = row.fold(0.0, _add(b), exp_term)
        if log:
            shift = b.fadd(peak, mathlib.emit("log", b, total))
            row.each(lambda i, w: row.write(y, b.fsub(row.read(x, i, w), row.splat(shift, w)), i, w))
        elif keep:
            scale = b.fdiv(constant(row.ctype, 1.0), total)
            # The exponentials were stored in y by the sum pass; scale them in place.
            row.each(lambda i, w: row.write(y, b.fmul(row.read(y, i, w), row.splat(scale, w)), i, w))
        else:
            scale = b.fdiv(constant(row.ctype, 1.0), total)
            row.each(lambda i, w: row.write(y, b.fmul(exponential(i, w), row.splat(scale, w)), i, w))

    each_row(ctx, op, body)


def norm(ctx, op) -> None:
    x, y = op.inputs[0], op.outputs[0]
    gamma = op.inputs[1] if len(op.inputs) > 1 else None
    beta = op.inputs[2] if len(op.inputs) > 2 else None
    rows, n = _rows(op)
    eps = attrs_of(op)["eps"]
    rms = op.type == "RMSNorm"

    def body(ctx, r):
        b = ctx.b
        start = b.mul(r, i64(n))
        row = Row(ctx, start, n, x.dtype)
        inverse_n = constant(row.ctype, 1.0 / n)
        if rms:
            mean = constant(row.ctype, 0.0)
            square = row.fold(0.0, _add(b), lambda i, w: (lambda v: b.fmul(v, v))(row.read(x, i, w)))
        else:
            mean = b.fmul(row.fold(0.0, _add(b), lambda i, w: row.read(x, i, w)), inverse_n)
            square = row.fold(0.0, _add(b), lambda i, w: (lambda v: b.fmul(v, v))(b.fsub(row.read(x, i, w), row.splat(mean, w))))
        variance = b.fmul(square, inverse_n)
        sqrt = intrinsic(ctx.module, "sqrt", row.ctype)
        rstd = b.fdiv(constant(row.ctype, 1.0), b.call(sqrt, [b.fadd(variance, constant(row.ctype, eps))]))

        def normalize(i, w):
            value = b.fmul(b.fsub(row.read(x, i, w), row.splat(mean, w)), row.splat(rstd, w))
            column = b.sub(i, start)
            if gamma is not None:
                value = b.fmul(value, row.read(gamma, column, w))
            if beta is not None:
                value = b.fadd(value, row.read(beta, column, w))
            row.write(y, value, i, w)

        row.each(normalize)

    each_row(ctx, op, body)


def _peak_and_exp_sum(row: Row, x) -> tuple[ir.Value, ir.Value]:
    """A row's maximum and Σ exp(x − max): the two passes every log-sum-exp starts with."""
    b = row.b
    peak = row.fold(-math.inf, _max(b), lambda i, w: row.read(x, i, w))
    total = row.fold(0.0, _add(b), lambda i, w: mathlib.emit("exp", b, b.fsub(row.read(x, i, w), row.splat(peak, w))))
    return peak, total


def _smoothed(row: Row, target, smoothing: float, n: int):
    """Reader of a probability target row with label smoothing: p' = p(1 − s) + s/n."""
    b, t = row.b, row.ctype

    def read(i, w):
        p = row.read(target, i, w)
        if smoothing:
            p = b.fadd(b.fmul(p, row.splat(constant(t, 1.0 - smoothing), w)), row.splat(constant(t, smoothing / n), w))
        return p

    return read


def cross_entropy(ctx, op) -> None:
    logits, target = op.inputs
    loss = op.outputs[0]
    rows, n = _rows(op)
    smoothing = attrs_of(op)["label_smoothing"]
    classes_target = target.dtype in (dtypes.DT_INT32, dtypes.DT_INT64)

    def body(ctx, r):
        row = Row(ctx, ctx.b.mul(r, i64(n)), n, logits.dtype)
        peak, total = _peak_and_exp_sum(row, logits)
        label = _label(ctx, target, r, n) if classes_target else None
        row.write(loss, _row_loss(row, logits, target, label, peak, total, smoothing), r, 1)

    each_row(ctx, op, body)


def _row_loss(row: Row, logits, target, label, peak, total, smoothing: float) -> ir.Value:
    """A row's cross-entropy from its max and Σ exp: lse − x[label] for a class (with
    smoothing, less s/n·Σx), or Σ p'·(lse − x) for a probability target."""
    b, t, n = row.b, row.ctype, row.length
    logsumexp = b.fadd(peak, mathlib.emit("log", b, total))
    if label is not None:
        safe = b.select(b.icmp_unsigned("<", label, i64(n)), label, i64(0))
        picked = row.read(logits, b.add(row.start, safe), 1)
        value = b.fsub(logsumexp, b.fmul(picked, constant(t, 1.0 - smoothing)))
        if smoothing:
            everything = row.fold(0.0, _add(b), lambda i, w: row.read(logits, i, w))
            value = b.fsub(value, b.fmul(everything, constant(t, smoothing / n)))
        return value
    target_row = _smoothed(row, target, smoothing, n)

    def weighted(i, w):
        return b.fmul(target_row(i, w), b.fsub(row.splat(logsumexp, w), row.read(logits, i, w)))

    return row.fold(0.0, _add(b), weighted)


def _label(ctx, target, r, n):
    """Row r's class, checked against the class count (a bad one marks the step failed)."""
    label = load_index(ctx, target, r)
    check_range(ctx, label, n)
    return label


def cross_entropy_grad(ctx, op) -> None:
    """d logits = d loss · (softmax · Σp' − p') in three passes per row (max, sum of exp,
    output), with the target row p' built on the fly: no one-hot, no stored softmax.
    Fused with the forward (a second output), the row's loss comes from the same max
    and sum."""
    logits, target, dloss = op.inputs
    out = op.outputs[0]
    loss = op.outputs[1] if len(op.outputs) > 1 else None
    rows, n = _rows(op)
    smoothing = attrs_of(op)["label_smoothing"]
    classes_target = target.dtype in (dtypes.DT_INT32, dtypes.DT_INT64)

    def body(ctx, r):
        b = ctx.b
        start = b.mul(r, i64(n))
        row = Row(ctx, start, n, logits.dtype)
        t = row.ctype
        peak, total = _peak_and_exp_sum(row, logits)
        g = row.read(dloss, r, 1)
        if classes_target:
            label = _label(ctx, target, r, n)
            mass = constant(t, 1.0)
        else:
            smoothed = _smoothed(row, target, smoothing, n)
            mass = row.fold(0.0, _add(b), smoothed)
        scale = b.fdiv(b.fmul(g, mass), total)
        if loss is not None:
            row.write(loss, _row_loss(row, logits, target, label if classes_target else None, peak, total, smoothing), r, 1)

        def emit(i, w):
            probability = b.fmul(mathlib.emit("exp", b, b.fsub(row.read(logits, i, w), row.splat(peak, w))), row.splat(scale, w))
            if classes_target:
                columns = b.add(row.splat(b.sub(i, start), w), ir.Constant(vector_of(ir.IntType(64), w), list(range(w))) if w > 1 else i64(0))
                hot = b.icmp_signed("==", columns, row.splat(label, w))
                share = b.select(hot, row.splat(constant(t, 1.0 - smoothing + smoothing / n), w), row.splat(constant(t, smoothing / n), w))
            else:
                share = smoothed(i, w)
            row.write(out, b.fsub(probability, b.fmul(share, row.splat(g, w))), i, w)

        row.each(emit)

    each_row(ctx, op, body)


def choose(op):
    if op.type == "SoftmaxCrossEntropyGrad" and op.inputs[0].shape[-1] > 0:
        return "CrossEntropyGradRow", cross_entropy_grad
    if op.type in ("Softmax", "LogSoftmax"):
        x = op.inputs[0]
        if attrs_of(op)["axis"] % x.rank == x.rank - 1 and x.shape[-1] > 0:
            return "SoftmaxRow" if op.type == "Softmax" else "LogSoftmaxRow", softmax
    if op.type in ("LayerNorm", "RMSNorm") and op.inputs[0].shape[-1] > 0:
        return f"{op.type}Row", norm
    if op.type == "SoftmaxCrossEntropy" and op.inputs[0].shape[-1] > 0:
        return "CrossEntropyRow", cross_entropy
    return None



