"""Fused row kernels over the last axis, for every LLVM backend: Softmax, LogSoftmax,
LayerNorm, RMSNorm and SoftmaxCrossEntropy with their gradients, each in as few passes over
the row as its math allows.

    softmax        max | exp, sum (exp stored) | scale
    log_softmax    max | sum of exp            | x − max − log(sum)
    layer_norm     mean | variance             | normalize, scale, shift
    rms_norm       mean square                 | normalize, scale
    its gradient   mean square | Σ dy·γ·x      | dx (and dy·x̂, for γ's gradient)
    cross-entropy  max | sum of exp (and of target·x) → one loss per row
    its gradient   max | sum of exp            | softmax · Σp' − p'  (and the loss)
                   (on a GPU, whose every pass reads the row from memory again, the max and
                   the sum of exp in one pass, the sum rescaled as the max grows)
    top-k          k passes, each the best after the last pick (a router's few experts)
    softmax-top-k  the softmax's passes, then top-k of the probabilities
    rotary         each pair of a head's features turned by its position's angle

Each `*_rows(op)` gives the body of one row, `body(ctx, r)`, over an `EmitContext`: the CPU
backend shares rows out over its cores and runs the passes in vectors; on a GPU a block's
threads split each pass of a row (`EmitContext.row_fold`, `row_each`), or for top-k one
thread runs a row's passes one element at a time. `@row_op` on a body is all a row op
needs to run on both backends: each makes its kernels from `ROW_OPS`, which the decorator
fills (the CPU's in `cpu/kernels/rows.py`, a GPU's in `cuda/rows.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ... import dtypes
from ...ops import attrs_of, op_def
from ...ops.expression import program_of
from ...ops.foreach import Member
from ...ops.fused import ROW_EPILOGUE_OPS, fused_type, product_type, row_split
from .context import EmitContext, check_range, load_index
from .formulas import program_body
from .store_epilogue import StoreEpilogue, Unstored
from .values import Value

RowBody = Callable[[EmitContext, Value], None]


def nonempty_rows(op) -> bool:
    return op.inputs[0].shape[-1] > 0


@dataclass(frozen=True)
class RowOp:
    """How an op type's rows run: `body(op)` gives the body of one row; `applies(op)` says
    whether it runs this op; `kernel` is its kernel's name, as cells print it; `one_thread`:
    a GPU runs each row on one thread (the row picks one element at a time)."""

    kernel: str
    body: Callable[..., RowBody]
    applies: Callable[..., bool] = nonempty_rows
    one_thread: bool = False


# The row ops, by op type: filled by `@row_op` on their bodies below.
ROW_OPS: dict[str, RowOp] = {}


def row_op(kernels: dict[str, str], applies: Callable[..., bool] = nonempty_rows,
           one_thread: bool = False) -> Callable[[Callable[..., RowBody]], Callable[..., RowBody]]:
    """Decorator: the decorated `*_rows(op)` is the row body of each op type in `kernels`
    (type -> its kernel's name), for both backends."""

    def register(body: Callable[..., RowBody]) -> Callable[..., RowBody]:
        for op_type, kernel in kernels.items():
            if op_type in ROW_OPS:
                raise ValueError(f"row op {op_type} is declared twice ({ROW_OPS[op_type].kernel}, {kernel})")
            ROW_OPS[op_type] = RowOp(kernel, body, applies, one_thread)
        return body

    return register


class Row:
    """Vector passes over one row of `length` elements starting at element `start`; a
    length known only at run time is a non-negative int64 Value (the CPU's loops take one)."""

    def __init__(self, ctx: EmitContext, start: Value | int, length: int | Value, dtype: str):
        self.ctx, self.start, self.length, self.dtype = ctx, start, length, dtype
        self.lanes = ctx.lanes_for([dtype])
        while isinstance(length, int) and self.lanes > 1 and self.lanes > length:  # short rows (a head of 8) use narrower vectors
            self.lanes //= 2

    def fold(self, initial: float, combine, term: Callable[[Value, int], Value]) -> Value:
        """`combine` over `term(index, width)` along the row, as the context splits it
        (vector lanes first on the CPU)."""
        return self.ctx.row_fold(self.start, self.length, self.lanes, self.dtype, initial, combine, term)

    def sum(self, term: Callable[[Value, int], Value]) -> Value:
        return self.fold(0.0, _add, term)

    def max(self, var) -> Value:
        return self.fold(-math.inf, _max, lambda i, w: self.ctx.load(var, i, w))

    def each(self, body: Callable[[Value, int], None]) -> None:
        self.ctx.row_each(self.start, self.length, self.lanes, body)


def row_dot(ctx, size: int, x, x_start: Value | int, y, y_start: Value | int) -> Value:
    """x[x_start:+size] · y[y_start:+size], in vectors."""
    return Row(ctx, x_start, size, x.dtype).sum(lambda i, w: ctx.load(x, i, w) * ctx.load(y, i - x_start + y_start, w))


def row_axpy(ctx, size: int, alpha: Value, x, x_start: Value, y, y_start: Value) -> None:
    """y[y_start:+size] += alpha · x[x_start:+size], in vectors."""
    Row(ctx, y_start, size, y.dtype).each(
        lambda i, w: ctx.store(y, i, ctx.load(y, i, w) + alpha.splat(w) * ctx.load(x, i - y_start + x_start, w)))


def _max(acc: Value, x: Value) -> Value:
    return (x > acc).where(x, acc)


def _add(acc: Value, x: Value) -> Value:
    return acc + x


def _square(x: Value) -> Value:
    return x * x


def row_shape(op) -> tuple[int, int]:
    """(rows, row length) of a row op over the last axis."""
    x = op.inputs[0]
    return x.size // x.shape[-1] if x.shape[-1] else 0, x.shape[-1]


def last_axis(op) -> bool:
    x = op.inputs[0]
    return attrs_of(op)["axis"] % x.rank == x.rank - 1 and x.shape[-1] > 0


@row_op({"Softmax": "SoftmaxRow", "LogSoftmax": "LogSoftmaxRow"}, applies=last_axis)
def softmax_rows(op) -> RowBody:
    x, y = op.inputs[0], op.outputs[0]
    _, n = row_shape(op)
    log = op.type == "LogSoftmax"

    def body(ctx, r):
        row = Row(ctx, r * n, n, x.dtype)
        if log:
            peak, total = _peak_and_exp_sum(row, x)
            shift = peak + total.log()
            row.each(lambda i, w: ctx.store(y, i, ctx.load(x, i, w) - shift.splat(w)))
        else:
            _, total, exponential = _exponentials(row, x, y)
            scale = 1.0 / total
            row.each(lambda i, w: ctx.store(y, i, exponential(i, w) * scale.splat(w)))

    return body


@row_op({"LayerNorm": "LayerNormRow", "RMSNorm": "RMSNormRow"})
def norm_rows(op) -> RowBody:
    x, y = op.inputs[0], op.outputs[0]
    gamma = op.inputs[1] if len(op.inputs) > 1 else None
    beta = op.inputs[2] if len(op.inputs) > 2 else None
    _, n = row_shape(op)
    eps = attrs_of(op)["eps"]

    def body(ctx, r):
        start = r * n
        row = Row(ctx, start, n, x.dtype)
        if op.type == "RMSNorm":
            mean = ctx.constant(x.dtype, 0.0)
            square = row.sum(lambda i, w: _square(ctx.load(x, i, w)))
        else:
            mean = row.sum(lambda i, w: ctx.load(x, i, w)) * (1.0 / n)
            square = row.sum(lambda i, w: _square(ctx.load(x, i, w) - mean.splat(w)))
        rstd = 1.0 / (square * (1.0 / n) + eps).sqrt()

        def normalize(i, w):
            value = (ctx.load(x, i, w) - mean.splat(w)) * rstd.splat(w)
            column = i - start
            if gamma is not None:
                value = value * ctx.load(gamma, column, w)
            if beta is not None:
                value = value + ctx.load(beta, column, w)
            ctx.store(y, i, value)

        row.each(normalize)

    return body


@row_op({"RMSNormGrad": "RMSNormGradRow"})
def rms_norm_grad_rows(op) -> RowBody:
    """dx = rstd · (dy·γ − x · rstd² · mean(dy·γ·x)) over each row, in three passes (the
    mean square, the dot, the output), and with a gain dy·x̂ beside it. dy and γ may be
    stored in another float dtype than x: they are widened as they are read."""
    x, dy, *gain = op.inputs
    dx = op.outputs[0]
    scaled = op.outputs[1] if gain else None
    _, n = row_shape(op)
    eps = attrs_of(op)["eps"]

    def body(ctx, r):
        start = r * n
        row = Row(ctx, start, n, x.dtype)

        def read(var, i, w) -> Value:
            value = ctx.load(var, i, w)
            return value if var.dtype == x.dtype else value.cast(x.dtype)

        def dxhat(i, w) -> Value:
            return read(dy, i, w) * read(gain[0], i - start, w) if gain else read(dy, i, w)

        rstd = 1.0 / (row.sum(lambda i, w: _square(ctx.load(x, i, w))) * (1.0 / n) + eps).sqrt()
        shift = row.sum(lambda i, w: dxhat(i, w) * ctx.load(x, i, w)) * (rstd * rstd * (1.0 / n))

        def gradient(i, w):
            value = ctx.load(x, i, w)
            ctx.store(dx, i, (dxhat(i, w) - value * shift.splat(w)) * rstd.splat(w))
            if scaled is not None:
                ctx.store(scaled, i, read(dy, i, w) * value * rstd.splat(w))

        row.each(gradient)

    return body


@row_op({"Rotary": "RotaryRow"})
def rotary_rows(op) -> RowBody:
    """Each row a head's D features at one position: pairs turned by the position's angle,
    w pairs at a time (2w lanes: the pairs' partners swapped and the tables' entries
    doubled by shuffles), or one pair of scalars."""
    x, cos, sin = op.inputs
    y = op.outputs[0]
    _, n = row_shape(op)
    heads, positions, pairs = x.shape[-2], x.shape[-3], n // 2
    back = attrs_of(op)["inverse"]

    def pair_lanes(ctx) -> int:
        """Pairs a vector holds (half its lanes), fewer for a short head."""
        w = max(1, ctx.lanes_for([x.dtype]) // 2)
        while w > 1 and w > pairs:
            w //= 2
        return w

    def body(ctx, r):
        start, table = r * n, (r // heads) % positions * pairs

        def turn(p, w):
            at = start + p * 2
            c, s = ctx.load(cos, table + p, w), ctx.load(sin, table + p, w)
            if w == 1:
                even, odd = ctx.load(x, at), ctx.load(x, at + 1)
                s = -s if back else s
                ctx.store(y, at, even * c - odd * s)
                ctx.store(y, at + 1, even * s + odd * c)
                return
            value = ctx.load(x, at, 2 * w)
            doubled = [i // 2 for i in range(2 * w)]
            # even lanes take −sin (+sin turning back), odd lanes +sin (−sin): from -s where picked at w + i
            signed = [w + i // 2 if (i % 2 == 0) != back else i // 2 for i in range(2 * w)]
            partners = value.shuffle([i ^ 1 for i in range(2 * w)])
            ctx.store(y, at, value * c.shuffle(doubled) + partners * s.shuffle(signed, -s))

        ctx.row_each(ctx.index(0), pairs, pair_lanes(ctx), turn)

    return body


def _peak_and_exp_sum(row: Row, x) -> tuple[Value, Value]:
    """A row's maximum and Σ exp(x − max), which every log-sum-exp starts with: two passes,
    or one where the context prefers (`EmitContext.row_peak_and_exp_sum`)."""
    ctx = row.ctx
    return ctx.row_peak_and_exp_sum(row.start, row.length, row.lanes, row.dtype, lambda i, w: ctx.load(x, i, w))


def _exponentials(row: Row, x, y) -> tuple[Value, Value, Callable[[Value, int], Value]]:
    """A row's maximum, Σ exp(x − max), and `exponential(index, width)` for the pass that
    writes `y` (the output the exponentials become). Where the row stays in cache between
    passes (a CPU core's), a float32/float64 y holds them from the sum pass on, so each is
    computed once; a half-precision y would round them, and the result twice, and where
    each pass reads memory again (a GPU) a store and its reload would cost twice: there
    they are computed again."""
    ctx = row.ctx
    if y.dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64) and not ctx.row_passes_reread_memory:
        peak = row.max(x)
        total = row.sum(lambda i, w: _stored(ctx, y, i, (ctx.load(x, i, w) - peak.splat(w)).exp()))
        return peak, total, lambda i, w: ctx.load(y, i, w)
    peak, total = _peak_and_exp_sum(row, x)
    return peak, total, lambda i, w: (ctx.load(x, i, w) - peak.splat(w)).exp()


def _stored(ctx, var, at, value: Value) -> Value:
    """`value`, stored at element `at` of `var` on the way (exponentials kept between passes)."""
    ctx.store(var, at, value)
    return value


def _smoothed(row: Row, target, smoothing: float, n: int | Value) -> Callable[[Value, int], Value]:
    """Reader of a probability target row with label smoothing: p' = p(1 − s) + s/n."""

    def read(i, w):
        p = row.ctx.load(target, i, w)
        return p * (1.0 - smoothing) + smoothing / n if smoothing else p

    return read


def _label(ctx, target, r: Value, n: int) -> Value:
    """Row r's class, checked against the class count (a bad one marks the step failed)."""
    label = load_index(ctx, target, r)
    check_range(ctx, label, n)
    return label


def _row_loss(row: Row, logits, target, label: Value | None, peak: Value, total: Value, smoothing: float) -> Value:
    """A row's cross-entropy from its max and Σ exp: lse − x[label] for a class (with
    smoothing, less s/n·Σx), or Σ p'·(lse − x) for a probability target."""
    ctx, n = row.ctx, row.length
    logsumexp = peak + total.log()
    if label is not None:
        inside = (label >= 0) & (label < n)  # a bad class was reported; read a safe one
        picked = ctx.load(logits, row.start + inside.where(label, 0))
        value = logsumexp - picked * (1.0 - smoothing)
        if smoothing:
            value = value - row.sum(lambda i, w: ctx.load(logits, i, w)) * (smoothing / n)
        return value
    target_row = _smoothed(row, target, smoothing, n)
    return row.sum(lambda i, w: target_row(i, w) * (logsumexp.splat(w) - ctx.load(logits, i, w)))


def _class_targets(target) -> bool:
    return target.dtype in (dtypes.DT_INT32, dtypes.DT_INT64)


@row_op({"SoftmaxCrossEntropy": "CrossEntropyRow"})
def cross_entropy_rows(op) -> RowBody:
    logits, target = op.inputs
    loss = op.outputs[0]
    _, n = row_shape(op)
    smoothing = attrs_of(op)["label_smoothing"]

    def body(ctx, r):
        row = Row(ctx, r * n, n, logits.dtype)
        peak, total = _peak_and_exp_sum(row, logits)
        label = _label(ctx, target, r, n) if _class_targets(target) else None
        ctx.store(loss, r, _row_loss(row, logits, target, label, peak, total, smoothing))

    return body


@row_op({"SoftmaxCrossEntropyGrad": "CrossEntropyGradRow"})
def cross_entropy_grad_rows(op) -> RowBody:
    """d logits = d loss · (softmax · Σp' − p') in three passes per row (max, sum of exp,
    output; two where the context takes the max and sum in one), with the target row p'
    built on the fly: no one-hot, no stored softmax. Where the row stays in cache, a
    float32/float64 output holds the exponentials between the last two passes (as the
    softmax does), so each element's exp is computed once: the kernel's main cost there.
    Fused with the forward (`with_loss`), the row's loss comes from the same max and sum."""
    logits, target, dloss = op.inputs
    out = op.outputs[0]
    loss = op.outputs[1] if len(op.outputs) > 1 else None
    _, n = row_shape(op)
    smoothing = attrs_of(op)["label_smoothing"]
    classes = _class_targets(target)

    def body(ctx, r):
        start = r * n
        row = Row(ctx, start, n, logits.dtype)
        peak, total, exponential = _exponentials(row, logits, out)
        g = ctx.load(dloss, r)
        if classes:
            label = _label(ctx, target, r, n)
            mass = ctx.constant(logits.dtype, 1.0)
        else:
            label, smoothed = None, _smoothed(row, target, smoothing, n)
            mass = row.sum(smoothed)
        scale = g * mass / total
        if loss is not None:
            ctx.store(loss, r, _row_loss(row, logits, target, label, peak, total, smoothing))

        def gradient(i, w):
            probability = exponential(i, w) * scale.splat(w)
            if classes:
                hot = ((i - start).splat(w) + ctx.lane_numbers(w)).equal(label.splat(w))
                on, off = ctx.constant(logits.dtype, 1.0 - smoothing + smoothing / n, w), smoothing / n
                share = hot.where(on, off)
            else:
                share = smoothed(i, w)
            ctx.store(out, i, probability - share * g.splat(w))

        row.each(gradient)

    return body


def _key(value: Value) -> Value:
    """The order top-k ranks by: NaN counts as the largest."""
    return value.not_equal(value).where(math.inf, value) if value.is_float else value


def select_top_k(ctx, source, start: Value, n: int, k: int, values, indices, out_start: Value) -> None:
    """The k largest of source[start:start+n] into values/indices[out_start:+k], largest
    first, ties to the lower index: k passes, each taking the best element ranked after
    the previous pick (k·n compares; k and n are a router's few experts)."""
    previous = ctx.local(source.dtype)
    previous_index = ctx.local(dtypes.DT_INT64)
    best = ctx.local(source.dtype)
    best_index = ctx.local(dtypes.DT_INT64)
    with ctx.loop(0, k, name="pick") as j:
        best_index.set(ctx.index(-1))
        with ctx.loop(0, n, name="i") as i:
            key = _key(ctx.load(source, start + i))
            after_previous = j.equal(0) | (key < previous.value) | (key.equal(previous.value) & (i > previous_index.value))
            better = (best_index.value < 0) | (key > best.value)
            with ctx.when(after_previous & better):
                best.set(key)
                best_index.set(i)
        ctx.store(values, out_start + j, ctx.load(source, start + best_index.value))
        ctx.store(indices, out_start + j, best_index.value.cast(indices.dtype))
        previous.set(best.value)
        previous_index.set(best_index.value)


@row_op({"TopK": "TopKRow"}, one_thread=True)
def top_k_rows(op) -> RowBody:
    """Each row's k largest values and their indices."""
    x = op.inputs[0]
    values, indices = op.outputs
    _, n = row_shape(op)
    k = attrs_of(op)["k"]
    return lambda ctx, r: select_top_k(ctx, x, r * n, n, k, values, indices, r * k)


@row_op({"SoftmaxTopK": "SoftmaxTopKRow"}, one_thread=True)
def softmax_top_k_rows(op) -> RowBody:
    """softmax over the row (its exponentials stored, then scaled in place), then the top k
    of the probabilities just written."""
    x = op.inputs[0]
    probs, values, indices = op.outputs
    _, n = row_shape(op)
    k = attrs_of(op)["k"]

    def body(ctx, r):
        row = Row(ctx, r * n, n, x.dtype)
        normalized_exponentials(ctx, row, x, probs, row.max(x))
        select_top_k(ctx, probs, r * n, n, k, values, indices, r * k)

    return body


def normalized_exponentials(ctx: EmitContext, row: Row, source, target, peak: Value, unseen_zero: bool = False,
                            exp: Callable[[Value], Value] = Value.exp) -> Value:
    """target = exp(source − peak) / their sum along the row (source may be target): the
    exponentials stored, then scaled in place. With `unseen_zero` a row of −∞ (an
    attention query that sees no key) gives zeros rather than 0/0. `exp` is of values <= 0.
    Returns the row's log Σ exp(source) (`log_sum_exp`)."""
    if unseen_zero:
        peak = finite_peak(peak)

    def exponential(i, w):
        e = exp(ctx.load(source, i, w) - peak.splat(w))
        ctx.store(target, i, e)
        return e

    total = row.sum(exponential)
    scale = unseen_inverse(total) if unseen_zero else 1.0 / total
    row.each(lambda i, w: ctx.store(target, i, ctx.load(target, i, w) * scale.splat(w)))
    return log_sum_exp(peak, total)


def log_sum_exp(peak: Value, total: Value) -> Value:
    """log Σ exp(xᵢ) of a row from its finite peak and total = Σ exp(xᵢ − peak): +∞ where the
    total is 0 (an attention query that sees no key, whose exp(score − ∞) are then all 0)."""
    return total.equal(0.0).where(math.inf, peak + total.log())


def scaled_softmax(ctx: EmitContext, scores, start: Value, seen: int | Value, scale: float, bias=None,
                   unseen_zero: bool = False, exp: Callable[[Value], Value] = Value.exp) -> Value:
    """scores[start:+seen] → softmax(scale · scores + bias(i, width)), in place (an attention
    query's raw scores to its probabilities): the logits stored as the maximum is taken over
    them, then `normalized_exponentials` (by `exp`). Returns the logits' log-sum-exp."""
    row = Row(ctx, start, seen, scores.dtype)

    def logit(i, w):
        value = ctx.load(scores, i, w) * scale
        value = value + bias(i, w) if bias is not None else value
        ctx.store(scores, i, value)
        return value

    peak = row.fold(-math.inf, _max, logit)
    return normalized_exponentials(ctx, row, scores, scores, peak, unseen_zero, exp)


def finite_peak(peak: Value) -> Value:
    """The maximum a row's exponentials are taken against, 0 for a row of −∞ (an attention
    query that sees no key), whose exp(−∞ − 0) are then 0 rather than exp(−∞ + ∞) = NaN."""
    return peak.equal(-math.inf).where(0.0, peak)


def unseen_inverse(total: Value) -> Value:
    """1 / a sum of exponentials, or 0 where it is 0 (every term exp(−∞): an attention
    query that sees no key attends to nothing). A NaN sum stays NaN."""
    return (total.equal(0.0)).where(0.0, 1.0 / total)


def _min(acc: Value, x: Value) -> Value:
    return (x < acc).where(x, acc)


def _flip_negatives(bits: Value) -> Value:
    """int32 bits with a negative value's other bits reversed: its own inverse."""
    return (bits < 0).where(bits ^ 0x7FFFFFFF, bits)


def _ordered(value: Value) -> Value:
    """A float32 as an int32 key that orders as the floats do: bisection over keys ends on a
    row's exact value."""
    return _flip_negatives(value.bitcast(dtypes.DT_INT32))


def _ordered_inverse(key: Value) -> Value:
    """The float32 of an (int64-held) key."""
    return _flip_negatives(key.cast(dtypes.DT_INT32)).bitcast(dtypes.DT_FLOAT32)


def _bisect(ctx, low: int | Value, high: int | Value, steps: int, holds: Callable[[Value], Value], upper: bool) -> Value:
    """Over the integers [low, high]: with `upper`, the largest m where `holds(m)` (it holds
    at `low` and fails from some point on); else the smallest m where it holds (it holds at
    `high` and from some point on). `steps` halvings cover the range; each costs a pass."""
    lo = ctx.local(dtypes.DT_INT64, 1, ctx.index(low).cast(dtypes.DT_INT64))
    hi = ctx.local(dtypes.DT_INT64, 1, ctx.index(high).cast(dtypes.DT_INT64))
    with ctx.loop(0, steps, name="bisect"), ctx.when(lo.value < hi.value):
        mid = lo.value + (hi.value - lo.value + (1 if upper else 0)) / 2
        yes = holds(mid)
        if upper:
            lo.set(yes.where(mid, lo.value))
            hi.set(yes.where(hi.value, mid - 1))
        else:
            hi.set(yes.where(mid, hi.value))
            lo.set(yes.where(lo.value, mid + 1))
    return lo.value


def _first_passing(ctx, probs, start: Value, n: int, drawn: Value) -> Value:
    """The first position of the row whose running sum of `probs` exceeds `drawn`
    (n − 1 where none does): a bisection over positions whose every step sums only the
    half it rules on, the sum before it carried, so all its steps together read the row
    about twice rather than once a step."""
    f32 = dtypes.DT_FLOAT32
    lo = ctx.local(dtypes.DT_INT64, 1, ctx.index(0).cast(dtypes.DT_INT64))
    hi = ctx.local(dtypes.DT_INT64, 1, ctx.index(n - 1).cast(dtypes.DT_INT64))
    before = ctx.local(f32, 1, 0.0)  # the sum of probs before lo
    with ctx.loop(0, max(1, (n - 1).bit_length()), name="bisect"), ctx.when(lo.value < hi.value):
        mid = lo.value + (hi.value - lo.value) / 2
        through_mid = before.value + Row(ctx, start + lo.value, mid - lo.value + 1, f32).sum(lambda i, w: ctx.load(probs, i, w))
        passed = through_mid > drawn
        hi.set(passed.where(mid, hi.value))
        lo.set(passed.where(lo.value, mid + 1))
        before.set(passed.where(before.value, through_mid))
    return lo.value


@row_op({"SampleToken": "SampleTokenRow"})
def sample_rows(op) -> RowBody:
    """A token per row (`ranvier.ops.sampling`), every step a pass or a bisection of passes:
    the row's maximum; greedy: its first position; else the k-th largest logit (bisection
    over the logits' ordered bits: each pass counts the logits at least a candidate), the
    exponentials kept in `probabilities` with their sum, the nucleus's cut (bisection over
    the probabilities' bits: each pass sums those at least a candidate), and the token
    (bisection over positions, `_first_passing`)."""
    logits, uniform, temperature, top_k, top_p = op.inputs
    token, probs = op.outputs
    _, n = row_shape(op)
    f32 = dtypes.DT_FLOAT32

    def body(ctx, r):
        start = r * n
        row = Row(ctx, start, n, f32)
        heat, k, nucleus = (ctx.load(v, 0) for v in (temperature, top_k, top_p))
        peak = row.max(logits)

        def position(i, w):
            return (i - start).splat(w) + ctx.lane_numbers(w)

        def one(w):
            return ctx.constant(f32, 1.0, w)

        chosen = ctx.local(dtypes.DT_INT64, 1, 0)
        greedy = heat <= 0.0
        with ctx.when(greedy):
            first = row.fold(float(n), _min, lambda i, w: ctx.load(logits, i, w).equal(peak.splat(w)).where(position(i, w).cast(f32), float(n)))
            chosen.set(first.cast(dtypes.DT_INT64))
            row.each(lambda i, w: ctx.store(probs, i, position(i, w).equal(chosen.value.splat(w)).where(one(w), 0.0)))
        with ctx.when(~greedy):
            cut = ctx.local(f32, 1, -math.inf)
            cutting = (k > 0) & (k < n)
            with ctx.when(cutting):
                def at_least_k(key):
                    candidate = _ordered_inverse(key)
                    return row.sum(lambda i, w: (ctx.load(logits, i, w) >= candidate.splat(w)).where(one(w), 0.0)) >= k.cast(f32)

                cut.set(_ordered_inverse(_bisect(ctx, -(1 << 31), _ordered(peak), 32, at_least_k, upper=True)))
            scale = 1.0 / heat

            def exponential(i, w):
                x = ctx.load(logits, i, w)
                e = (x >= cut.value.splat(w)).where(((x - peak.splat(w)) * scale.splat(w)).exp(), 0.0)
                ctx.store(probs, i, e)
                return e

            total = ctx.local(f32, 1, row.sum(exponential))
            with ctx.when((nucleus > 0.0) & (nucleus < 1.0)):
                target = nucleus * total.value

                def reaches(key):
                    candidate = _ordered_inverse(key)

                    def kept(i, w):
                        e = ctx.load(probs, i, w)
                        return (e >= candidate.splat(w)).where(e, 0.0)

                    return row.sum(kept) >= target

                # the exponentials lie in [0, 1]: their bits in [0, 2^30)
                smallest = _ordered_inverse(_bisect(ctx, 0, _ordered(ctx.constant(f32, 1.0)), 30, reaches, upper=True))

                def trimmed(i, w):
                    e = ctx.load(probs, i, w)
                    e = (e >= smallest.splat(w)).where(e, 0.0)
                    ctx.store(probs, i, e)
                    return e

                total.set(row.sum(trimmed))
            chosen.set(_first_passing(ctx, probs, start, n, ctx.load(uniform, r) * total.value))
            # rounding can leave the running sum short of the drawn mass: the last kept position
            with ctx.when(ctx.load(probs, start + chosen.value).equal(0.0)):
                last = row.fold(-1.0, _max, lambda i, w: (ctx.load(probs, i, w) > 0.0).where(position(i, w).cast(f32), -1.0))
                chosen.set(last.cast(dtypes.DT_INT64))
            factor = 1.0 / total.value
            row.each(lambda i, w: ctx.store(probs, i, ctx.load(probs, i, w) * factor.splat(w)))
        ctx.store(token, r, chosen.value.cast(token.dtype))

    return body


def _row_op_applies(op) -> bool:
    attrs, row_inputs, _, program_outputs, other_outputs = row_split(op.type, op.attrs, op.inputs, op.outputs)
    base = product_type(op.type)
    return ROW_OPS[base].applies(Member(op.name, base, row_inputs, [program_outputs[0], *other_outputs], attrs))


@row_op({fused_type(name): "RowEpilogue" for name in ROW_EPILOGUE_OPS}, applies=_row_op_applies)
def with_epilogue(op) -> RowBody:
    """A fused row op (`ranvier.ops.fused`: RMSNormCalculate and its kin): its row op's
    passes, each element of the row op's first output handed to the program as it is
    computed."""
    attrs, row_inputs, further, program_outputs, other_outputs = row_split(op.type, op.attrs, op.inputs, op.outputs)
    base = product_type(op.type)
    (first, *_) = op_def(base).infer_types(op.name, row_inputs, attrs)
    unstored = Unstored(f"{op.name}:row", first.dtype, tuple(first.shape))
    body = ROW_OPS[base].body(Member(op.name, base, row_inputs, [unstored, *other_outputs], attrs))
    program = program_body(program_of(op), len(program_outputs))

    def fused(ctx, r):
        body(StoreEpilogue(ctx, unstored, further, program_outputs, program), r)

    return fused

