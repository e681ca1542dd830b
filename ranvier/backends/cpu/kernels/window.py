"""Window primitives on the strided loop engine: Pad, StridedView, StridedScatterAdd; and
MaxPool whole, each window's maximum read from the input where it lies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from .... import dtypes
from ....flow.graph import Variable
from ....ops import attrs_of, op_def
from ....ops.expression import program_of
from ....ops.fused import product_type, row_split
from ....ops.nn import pool_params
from ...llvm.formulas import program_body
from ...llvm.loops import fill, for_vectors
from ...llvm.store_epilogue import StoreEpilogue, Unstored
from ...llvm.strided import View, attribute_view, contiguous_strides, dense_view
from ...llvm.values import Value
from ..parallel import share_out, thread_count, worth_splitting
from ..views import emit_map
from .library import kernel


def _identity(values, lanes):
    return values


@kernel("Pad", {"Pad"})
def pad(ctx, op) -> None:
    """The border's value everywhere, then x over the inside: both maps, so a large pad
    is shared out over the cores."""
    x, out = op.inputs[0], op.outputs[0]
    attrs = attrs_of(op)
    emit_map(ctx, out.shape, [], [dense_view(out)], lambda values, lanes: [ctx.constant(out.dtype, attrs["value"], lanes)])
    strides = contiguous_strides(out.shape)
    offset = sum(p * s for p, s in zip(attrs["before"], strides))
    emit_map(ctx, x.shape, [dense_view(x)], [View(out, offset, strides)], _identity)


@kernel("StridedView", {"StridedView"})
def strided_view(ctx, op) -> None:
    out = op.outputs[0]
    emit_map(ctx, out.shape, [attribute_view(op, op.inputs[0])], [dense_view(out)], _identity)


@kernel("StridedScatterAdd", {"StridedScatterAdd"})
def strided_scatter_add(ctx, op) -> None:
    d, out = op.inputs[0], op.outputs[0]
    fill(ctx, out, 0.0)
    emit_map(ctx, d.shape, [dense_view(d)], [attribute_view(op, out)], _identity, accumulate=True)


def _inside(size: int, kernel: int, stride: int, padding: int, outputs: int) -> tuple[int, int]:
    """The outputs [first, last) whose windows lie wholly inside an axis of `size`."""
    first = min(outputs, -(-padding // stride))
    return first, max(first, min(outputs, (size - kernel + padding) // stride + 1))


def _taps(ctx, x, at: Value, count: int, kernel: tuple[int, int], stride: int,
          width: int | None = None) -> list[Value]:
    """Each tap's element of `count` windows side by side along a row of x, from element
    `at` of the first window's top-left, the taps row by row: one load of the lanes'
    elements a tap (with stride s, s·count contiguous elements and a shuffle of every s-th,
    reaching s - 1 elements past the last window's tap); rows `width` elements apart (by
    default x's last axis)."""
    kh, kw = kernel
    width = width or x.shape[-1]
    if count == 1 or stride == 1:
        return [ctx.load(x, at + i * width + j, count) for i in range(kh) for j in range(kw)]
    picks = ir.Constant(ir.VectorType(ir.IntType(32), count), [e * stride for e in range(count)])
    spans = [ctx.load(x, at + i * width + j, count * stride) for i in range(kh) for j in range(kw)]
    return [Value(ctx.b, ctx.b.shuffle_vector(v.ir, v.ir, picks), v.dtype) for v in spans]


@dataclass(frozen=True)
class PoolRows:
    """Where a max pooling's planes lie: its input's planes `height` × `width`, `in_plane`
    elements apart from element `x_at`; its outputs' `rows` × `columns` of each plane,
    `out_plane` elements apart from element `y_at` (a band of a plane's rows, or all)."""

    height: int
    width: int
    in_plane: int
    rows: int
    columns: int
    out_plane: int
    x_at: Value | int = 0
    y_at: Value | int = 0


def emit_max_pool(ctx, x: Variable, y: Variable, pooling: tuple, at: PoolRows, planes: int,
                  share: Callable[..., None] | None = None) -> None:
    """Each output of `planes` planes the maximum of its window, read in place from `x`
    (`pooling`: pool_params' (ksize, strides, padding), the rows' padding counted from `at`'s
    first input row). Along a row, windows wholly inside the image go a vector of outputs at a
    time, a tap one load of the lanes' elements (with stride s, s·L contiguous elements and a
    shuffle of every s-th); windows over the border loop over the part inside (padding never
    exceeds half the window, so none is empty). A NaN in a window is its maximum, as numpy's.
    `share(ctx, rows, body)` runs `body(ctx, first, last)` over the rows of outputs (all
    planes'), by default on this thread."""
    (kh, kw), (sh, sw), (ph, pw) = pooling
    height, width, ho, wo = at.height, at.width, at.rows, at.columns
    rows_inside, (inside_first, inside_last) = _inside(height, kh, sh, ph, ho), _inside(width, kw, sw, pw, wo)
    lanes = ctx.lanes_for([y.dtype])
    while lanes > 1 and lanes > inside_last - inside_first:  # a short row (7 outputs) in narrower vectors
        lanes //= 2
    # a vector's loads reach s - 1 elements past its last window: keep them inside the row
    loads_inside = max(inside_first, min(inside_last, (width - kw - sw + 1 + pw) // sw + 1))
    vectors_last = inside_first + (loads_inside - inside_first) // lanes * lanes
    rows = planes * ho

    def whole(ctx, plane, top, left, count: int):
        values = _taps(ctx, x, at.x_at + plane * at.in_plane + top * width + left, count, (kh, kw), sw, width)
        best = values[0]
        for value in values[1:]:
            best = best.maximum(value)
        return best

    def clipped(ctx, plane, top, left):
        best = ctx.local(y.dtype, initial=-float("inf"))
        with ctx.loop(top.maximum(0), (top + kh).minimum(height), name="wy") as iy, \
                ctx.loop(left.maximum(0), (left + kw).minimum(width), name="wx") as ix:
            best.set(best.value.maximum(ctx.load(x, at.x_at + plane * at.in_plane + iy * width + ix)))
        return best.value

    def columns(ctx, plane, yo, top, first: int, last: int, count: int = 0):
        """Outputs [first, last) of a row: `count` at a time of whole windows, else clipped."""
        with ctx.loop(first, last, step=max(count, 1), name="xo") as xo:
            left = xo * sw - pw
            value = whole(ctx, plane, top, left, count) if count else clipped(ctx, plane, top, left)
            ctx.store(y, at.y_at + plane * at.out_plane + yo * wo + xo, value)

    def tail(ctx, row, plane, yo, top) -> None:
        """The whole windows after the last vector: one more vector ending at the last of
        them where it can overlap the ones before, else one at a time. Its loads pass the
        row's end by up to s - 1 elements, which belong to the next row: only the last row
        of outputs (whose next row may not exist) goes one at a time."""
        if vectors_last == inside_last:
            return
        if inside_last - inside_first < lanes or lanes == 1:
            columns(ctx, plane, yo, top, vectors_last, inside_last, 1)
            return
        with ctx.b.if_else((row < rows - 1).ir) as (overlapping, last_row):
            with overlapping:
                columns(ctx, plane, yo, top, inside_last - lanes, inside_last, lanes)
            with last_row:
                columns(ctx, plane, yo, top, vectors_last, inside_last, 1)

    def body(ctx, first: int | Value, last: int | Value) -> None:
        with ctx.loop(first, last, name="row") as row:
            plane, yo = row // ho, row % ho
            top = yo * sh - ph
            inside = (yo >= rows_inside[0]) & (yo < rows_inside[1])
            with ctx.b.if_else(inside.ir) as (interior, border):
                with interior:
                    columns(ctx, plane, yo, top, 0, inside_first)
                    columns(ctx, plane, yo, top, inside_first, vectors_last, lanes)
                    tail(ctx, row, plane, yo, top)
                    columns(ctx, plane, yo, top, inside_last, wo)
                with border:
                    columns(ctx, plane, yo, top, 0, wo)

    if rows and wo:
        if share is None:
            body(ctx, 0, rows)
        else:
            share(ctx, rows, body)


@kernel("WindowMax", {"MaxPool"}, supports=lambda op: dtypes.is_float(op.inputs[0].dtype))
def max_pool(ctx, op) -> None:
    """Each output the maximum of its window, read in place (`emit_max_pool`): the
    decomposition's padded copy and windows copy (for a ResNet stem, 1.5 ms of 1.9) are
    never made. Rows of outputs are shared out over the cores."""
    x, y = op.inputs[0], op.outputs[0]
    _, _, height, width = x.shape
    ho, wo = y.shape[2], y.shape[3]
    threads = thread_count() if worth_splitting(nbytes=x.nbytes + y.nbytes) else 1
    emit_max_pool(ctx, x, y, pool_params(attrs_of(op)), PoolRows(height, width, height * width, ho, wo, ho * wo),
                  x.shape[0] * x.shape[1], lambda ctx, rows, body: share_out(ctx, rows, threads, body))


def _pool_gradient(op) -> tuple:
    """(x, dy, dx's dtype, the epilogue's further inputs and outputs and its program) of a
    MaxPoolGrad (no epilogue: its own output, no program) or a MaxPoolGradCalculate."""
    if op.type == "MaxPoolGrad":
        return *op.inputs, op.outputs[0].dtype, [], op.outputs, None
    attrs, (x, dy), further, outputs, _ = row_split(op.type, op.attrs, op.inputs, op.outputs)
    (dx,) = op_def(product_type(op.type)).infer_types(op.name, [x, dy], attrs)
    return x, dy, dx.dtype, further, outputs, program_body(program_of(op), len(outputs))


def _supported_gradient(op) -> bool:
    """dx in float32 or float64: overlapping windows add into dx, which half precision would
    round at each add where the reference rounds once. With an epilogue, they add up in the
    program's first output (`ranvier.compiler.epilogue` puts one of dx's dtype first)."""
    _, _, dtype, _, outputs, _ = _pool_gradient(op)
    return dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64) and outputs[0].dtype == dtype


@kernel("WindowMaxGrad", {"MaxPoolGrad", "MaxPoolGradCalculate"}, supports=_supported_gradient)
def max_pool_grad(ctx, op) -> None:
    """Each window's gradient added where its first maximum lies, the window read in place:
    the decomposition's windows copy, arg-max, one-hot mask and scatter (8 of the MNIST CNN's
    38 ms training step) are one pass. A NaN is its window's maximum, as numpy's arg-max
    has it. Planes are shared out over the cores: a plane's windows touch only it, so a
    part zeroes its planes one at a time and adds into each while it is in cache.

    Along a row of outputs, windows wholly inside the image go a vector at a time (as
    MaxPool's do): each tap one load of the lanes' elements, the first maximum kept lane
    by lane, then each tap's share of the gradient (the lanes whose maximum it is, zero
    elsewhere) placed where the tap lies, lanes s apart, and a row of taps' shares summed
    in registers and added to dx with one load and store. Lanes of one tap never meet, so
    overlapping windows add up however they fall in the vector; the loads' s - 1 elements
    past the last window stay inside the row (a row of another plane may be another
    part's), narrower vectors and single windows taking the rest. Windows over the border
    loop over the part inside.

    With an epilogue (MaxPoolGradCalculate: a CNN's ReLU gradient), tiled windows hand each
    element of dx to the program as they write it, and dx is never stored; overlapping
    ones add up a plane in the program's first output, then run the program over the plane
    in place while it is in cache."""
    x, dy, dtype, further, outputs, program = _pool_gradient(op)
    (kh, kw), (sh, sw), (ph, pw) = pool_params(attrs_of(op))
    _, _, height, width = x.shape
    planes, ho, wo = x.shape[0] * x.shape[1], dy.shape[2], dy.shape[3]
    area = height * width
    unstored = Unstored(f"{op.name}:dx", dtype, tuple(x.shape))
    rows_inside, (inside_first, inside_last) = _inside(height, kh, sh, ph, ho), _inside(width, kw, sw, pw, wo)
    loads_inside = max(inside_first, min(inside_last, (width - kw - sw + 1 + pw) // sw + 1))
    runs, singles_first = _vector_runs(inside_first, loads_inside, ctx.lanes_for([dtype]))

    def epilogue(ctx):
        """The part's context: its stores of `unstored` run the program."""
        return StoreEpilogue(ctx, unstored, further, outputs, program) if program else ctx

    dx = outputs[0]

    def whole(ctx, plane: Value, yo: Value, xo: Value, count: int) -> None:
        """The gradients of `count` windows side by side, every tap in the image."""
        corner = plane * area + (yo * sh - ph) * width + xo * sw - pw
        offsets = [i * width + j for i in range(kh) for j in range(kw)]  # each tap's, from the corner
        values = _taps(ctx, x, corner, count, (kh, kw), sw)
        best, where = values[0], ctx.constant(dtypes.DT_INT32, 0, count)
        for value, offset in zip(values[1:], offsets[1:]):
            # the first maximum, a NaN counting as one (it stays once found)
            better = best.equal(best) & ((value > best) | value.not_equal(value))
            best, where = better.where(value, best), better.where(ctx.constant(dtypes.DT_INT32, offset, count), where)
        gradient = ctx.load(dy, (plane * ho + yo) * wo + xo, count)
        if count == 1:
            at = corner + where.cast(dtypes.DT_INT64)
            ctx.store(dx, at, ctx.load(dx, at) + gradient)
            return
        zero = ctx.constant(dx.dtype, 0.0, count)
        span, spill = count * sw, max(0, kw - sw)
        for i in range(kh):
            # the row of taps' shares summed in registers, then added to dx with one load and
            # store, and the last windows' taps past the span with one more: a load of each
            # tap's lanes after the store of the tap beside it would wait for that store
            row = [where.equal(ctx.constant(dtypes.DT_INT32, i * width + j, count)).where(gradient, zero) for j in range(kw)]
            at = corner + i * width
            ctx.store(dx, at, ctx.load(dx, at, span) + _placed(row, sw, 0, span))
            if spill:
                ctx.store(dx, at + span, ctx.load(dx, at + span, spill) + _placed(row, sw, span, spill))

    def clipped(ctx, plane: Value, yo: Value, xo: Value) -> None:
        """A window's gradient, over the part of it inside the image."""
        top, left = yo * sh - ph, xo * sw - pw
        best = ctx.local(dx.dtype, initial=-float("inf"))
        where = ctx.local(dtypes.DT_INT64, initial=-1)
        with ctx.loop(top.maximum(0), (top + kh).minimum(height), name="wy") as iy, \
                ctx.loop(left.maximum(0), (left + kw).minimum(width), name="wx") as ix:
            at = plane * area + iy * width + ix
            value, current = ctx.load(x, at), best.value
            better = (where.value < 0) | (current.equal(current) & ((value > current) | value.not_equal(value)))
            best.set(better.where(value, current))
            where.set(better.where(at, where.value))
        with ctx.when(where.value >= 0):
            ctx.store(dx, where.value, ctx.load(dx, where.value) + ctx.load(dy, (plane * ho + yo) * wo + xo))

    def columns(ctx, plane: Value, yo: Value, first: int, last: int, count: int = 0) -> None:
        """Outputs [first, last) of a row: `count` at a time of whole windows, else clipped."""
        with ctx.loop(first, last, step=max(count, 1), name="xo") as xo:
            if count:
                whole(ctx, plane, yo, xo, count)
            else:
                clipped(ctx, plane, yo, xo)

    def share(ctx, first: int | Value, last: int | Value) -> None:
        lanes = ctx.lanes_for([dx.dtype])
        with ctx.loop(first, last, name="plane") as plane:
            for_vectors(ctx, plane * area, area, lanes, lambda i, w: ctx.store(dx, i, ctx.constant(dx.dtype, 0.0, w)))
            with ctx.loop(0, ho, name="yo") as yo:
                inside = (yo >= rows_inside[0]) & (yo < rows_inside[1])
                with ctx.b.if_else(inside.ir) as (interior, border):
                    with interior:
                        columns(ctx, plane, yo, 0, inside_first)
                        for run_first, run_last, count in runs:
                            columns(ctx, plane, yo, run_first, run_last, count)
                        columns(ctx, plane, yo, singles_first, inside_last, 1)
                        columns(ctx, plane, yo, inside_last, wo)
                    with border:
                        columns(ctx, plane, yo, 0, wo)
            if program:
                running = epilogue(ctx)
                for_vectors(ctx, plane * area, area, lanes, lambda i, w: running.store(unstored, i, ctx.load(dx, i, w)))

    if not planes:
        return
    threads = thread_count() if worth_splitting(nbytes=sum(v.nbytes for v in (*op.inputs, *op.outputs))) else 1
    if _tiled_pairs(op):
        tiled = _tiled_pairs_share(x, dy, unstored if program else dx, kh)
        share_out(ctx, planes, threads, lambda ctx, first, last: tiled(epilogue(ctx), first, last))
    else:
        share_out(ctx, planes, threads, share)


def _placed(shares: list[Value], stride: int, first: int, count: int) -> Value:
    """Elements [first, first + count) of a row of taps (tap j's share of window k lying
    at k·stride + j), the shares of a tap row added where they fall."""
    lanes, zero = shares[0].lanes, shares[0].zeros()
    total = None
    for j, share in enumerate(shares):
        picks = [(p - j) // stride if p >= j and (p - j) % stride == 0 and (p - j) // stride < lanes else lanes
                 for p in range(first, first + count)]
        if all(pick == lanes for pick in picks):
            continue
        placed = share if picks == list(range(lanes)) else share.shuffle(picks, zero)
        total = placed if total is None else total + placed
    assert total is not None
    return total.lane(0) if count == 1 else total


def _vector_runs(first: int, last: int, lanes: int) -> tuple[list[tuple[int, int, int]], int]:
    """[first, last) as runs (start, stop, width) of whole vectors, `lanes` wide then each
    narrower power of two, and where the single elements left after them start."""
    runs = []
    width = lanes
    while width > 1:
        stop = first + (last - first) // width * width
        if stop > first:
            runs.append((first, stop, width))
            first = stop
        width //= 2
    return runs, first


def _tiled_pairs(op) -> bool:
    """Windows two columns wide that tile the image (stride the window, no padding, the
    image a whole number of windows, at least two across): a CNN's 2 × 2 pooling."""
    (kh, kw), strides, padding = pool_params(attrs_of(op))
    _, _, height, width = op.inputs[0].shape
    return kw == 2 and tuple(strides) == (kh, kw) and tuple(padding) == (0, 0) and height % kh == 0 and width % 2 == 0 and width >= 4


def _tiled_pairs_share(x, dy, dx, kh: int):
    """MaxPoolGrad over planes [first, last) of tiled two-column windows `kh` rows high, a
    vector of w windows along an output row at a time: each row of taps is two vectors of
    the input split into its even and odd columns, the first maximum (a NaN counting as
    one) kept lane by lane as the scalar windows keep it, and every element of dx written
    once, the window's gradient where its maximum lies and zero elsewhere (no zeroing pass,
    no scattered adds). A row of windows not a multiple of w ends with a vector overlapping
    the one before, which writes the same values again."""
    _, _, height, width = x.shape
    ho, wo = dy.shape[2], dy.shape[3]

    def windows(ctx, w: int, plane: Value, yo: Value, xo: Value | int) -> None:
        evens, odds = [2 * lane for lane in range(w)], [2 * lane + 1 for lane in range(w)]
        interleaved = [lane // 2 + (lane % 2) * w for lane in range(2 * w)]
        rows = [(plane * height + yo * kh + i) * width + xo * 2 for i in range(kh)]  # each tap row's first element
        taps = []  # (the tap's values, its number)
        for i, row in enumerate(rows):
            left, right = ctx.load(x, row, w), ctx.load(x, row + w, w)
            taps += [(left.shuffle(lanes, right), ctx.constant(dtypes.DT_INT32, 2 * i + j, w)) for j, lanes in enumerate((evens, odds))]
        best, where = taps[0]
        for value, tap in taps[1:]:
            better = best.equal(best) & ((value > best) | value.not_equal(value))
            best, where = better.where(value, best), better.where(tap, where)
        gradient, zero = ctx.load(dy, (plane * ho + yo) * wo + xo, w), ctx.constant(dx.dtype, 0.0, w)
        for i, row in enumerate(rows):
            even, odd = (where.equal(ctx.constant(dtypes.DT_INT32, 2 * i + j, w)).where(gradient, zero) for j in (0, 1))
            ctx.store(dx, row, even.shuffle(interleaved[:w], odd))
            ctx.store(dx, row + w, even.shuffle(interleaved[w:], odd))

    def share(ctx, first: int | Value, last: int | Value) -> None:
        w = 1 << (min(ctx.lanes_for([dx.dtype]), wo).bit_length() - 1)
        with ctx.loop(first, last, name="plane") as plane, ctx.loop(0, ho, name="yo") as yo:
            with ctx.loop(0, wo - w + 1, step=w, name="xo") as xo:
                windows(ctx, w, plane, yo, xo)
            if wo % w:
                windows(ctx, w, plane, yo, wo - w)

    return share
