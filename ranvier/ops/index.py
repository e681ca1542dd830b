"""Indexing ops: Gather (embedding lookup), ScatterAdd (its transpose), OneHot, and Myelin's
pooled lookups GatherSum GatherMax GatherAvg and in-place AssignAddScatter."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from ..errors import RanvierError
from .registry import Attr, TensorType, define, zero_gradient
from .rules import FLOATS, INDEX, NUMERIC


def _infer_gather(ctx):
    params, indices, *oov = ctx.inputs
    if indices.dtype not in INDEX or params.rank < 1:
        raise ctx.fail("params of rank >= 1 and int32/int64 indices")
    if oov and (oov[0].dtype != params.dtype or oov[0].size != math.prod(params.shape[1:])):
        raise ctx.fail(f"an out-of-vocabulary row of {params.dtype} with {math.prod(params.shape[1:])} elements")
    return [TensorType(params.dtype, (*indices.shape, *params.shape[1:]))]


def check_range(indices, rows) -> None:
    """Raise, naming the first index outside [0, rows)."""
    if indices.size and (indices.min() < 0 or indices.max() >= rows):
        bad = indices[(indices < 0) | (indices >= rows)].reshape(-1)[0]
        raise IndexError(f"index {int(bad)} is outside [0, {rows})")


def _gather(attrs, args, outs):
    params, indices, *oov = args
    if not oov:
        check_range(indices, params.shape[0])
        return [params[indices]]
    valid = (indices >= 0) & (indices < params.shape[0])
    rows = params[np.where(valid, indices, 0)]
    return [np.where(valid.reshape(*valid.shape, *[1] * (params.ndim - 1)), rows, oov[0].reshape(params.shape[1:]))]


def _gather_vjp(ctx, g):
    params, indices, *oov = ctx.inputs
    rows = params.shape[0]
    if not oov:
        return [ctx.b.scatter_add(indices, g[0], rows=rows), None]
    # Rows looked up in the table get their gradient there; the others, the oov row's.
    valid = ((indices >= 0) & (indices < rows)).reshape([*indices.shape, *[1] * (params.rank - 1)])
    inside = ctx.b.scatter_add(valid.where(indices.reshape(valid.shape), 0).reshape(indices.shape), valid.select(g[0]), rows=rows)
    outside = (~valid).select(g[0]).reshape([indices.size, *params.shape[1:]]).sum(axis=0).reshape(oov[0].shape)
    return [inside, None, outside]


define(
    "Gather", _infer_gather, _gather, (2, 3), "index",
    "Gather(params, indices[, oov]) = params[indices] along axis 0; with Myelin's out-of-vocabulary row, "
    "an index outside the table reads that row",
    vjp=_gather_vjp,
    method="gather",
    # Python-number indices are int32, not converted to the params' dtype.
    build=lambda b, params, indices, oov=None, name=None: b.op(
        "Gather", [params, b.operand(indices), *([] if oov is None else [oov])], name
    ),
)


def _infer_scatter(ctx):
    indices, updates = ctx.inputs
    rows = ctx.attrs["rows"]
    if indices.dtype not in INDEX or rows is None or rows < 0:
        raise ctx.fail("int32/int64 indices, updates, and attribute rows (the output's first dimension)")
    if updates.dtype not in dtypes.NUMERIC_DTYPES:
        raise ctx.fail("numeric updates (they are added up)")
    if tuple(updates.shape[: indices.rank]) != tuple(indices.shape):
        raise ctx.fail(f"updates whose leading dimensions equal the indices' shape {list(indices.shape)}")
    return [TensorType(updates.dtype, (rows, *updates.shape[indices.rank :]))]


def _scatter_add(attrs, args, outs):
    indices, updates = args
    rows = attrs["rows"]
    check_range(indices, rows)
    result = np.zeros(outs[0].shape, dtype=np.float64 if updates.dtype.kind == "f" else updates.dtype)
    np.add.at(result, indices.reshape(-1), updates.reshape(-1, *outs[0].shape[1:]))
    return [result]


define(
    "ScatterAdd",
    _infer_scatter,
    _scatter_add,
    2,
    "index",
    "ScatterAdd(indices, updates): zeros[rows, ...] with updates added at the indexed rows",
    attrs=[Attr("rows", "int", None, "the output's first dimension")],
    vjp=lambda ctx, g: [None, g[0].gather(ctx.inputs[0])],
    flops=lambda op: op.inputs[1].size,
    method="scatter_add",
    build=lambda b, indices, updates, rows, name=None: b.op(
        "ScatterAdd", [b.operand(indices), b.operand(updates)], name, {"rows": rows}
    ),
)


def _infer_onehot(ctx):
    (indices,) = ctx.inputs
    depth = ctx.attrs["depth"]
    dtype = ctx.attrs["dtype"]
    if indices.dtype not in INDEX or depth is None or depth <= 0 or dtype not in dtypes.ALL_DTYPES:
        raise ctx.fail("int32/int64 indices, a positive attribute depth and an optional dtype")
    return [TensorType(dtype, (*indices.shape, depth))]


def _onehot(attrs, args, outs):
    (indices,) = args
    depth = attrs["depth"]
    # Out-of-range indices give an all-zero row, as TensorFlow's one_hot does.
    return [(indices[..., None] == np.arange(depth)).astype(dtypes.to_numpy(outs[0].dtype))]


define(
    "OneHot", _infer_onehot, _onehot, 1, "index", "rows of zeros with a one at each index",
    attrs=[Attr("depth", "int", None, "the number of classes"), Attr("dtype", "str", dtypes.DT_FLOAT32, "the output dtype")],
    vjp=zero_gradient,
    method="one_hot",
    build=lambda b, indices, depth, dtype=dtypes.DT_FLOAT32, name=None: b.op(
        "OneHot", [indices], name, {"depth": depth, "dtype": dtypes.normalize(dtype)}
    ),
)


# ---- pooled lookups: GatherSum, GatherMax, GatherAvg ---------------------------------------------------

def pooled_run(indices: np.ndarray) -> np.ndarray:
    """The indices a pooled lookup combines, as Myelin's kernel reads them: negative indices
    are padding, so leading ones are skipped and the next one after a valid index ends the list."""
    flat = np.asarray(indices).reshape(-1)
    valid = np.flatnonzero(flat >= 0)
    if not valid.size:
        return flat[:0]
    start = valid[0]
    after = np.flatnonzero(flat[start:] < 0)
    return flat[start : start + after[0]] if after.size else flat[start:]


POOLINGS = {
    "GatherSum": (lambda rows: rows.sum(axis=0), NUMERIC, "sum"),
    "GatherMax": (lambda rows: rows.max(axis=0), NUMERIC, "max"),
    "GatherAvg": (lambda rows: rows.mean(axis=0), FLOATS, "average"),
}


def _infer_pooled(allowed):
    def infer(ctx):
        table, indices = ctx.inputs
        if table.rank != 2 or table.dtype not in allowed or indices.dtype not in INDEX:
            raise ctx.fail(f"a [rows, width] table of ({', '.join(allowed)}) and int32/int64 indices")
        return [TensorType(table.dtype, (1, table.shape[1]))]

    return infer


def _pooled(pool):
    def reference(attrs, args, outs):
        table, indices = args
        run = pooled_run(indices)
        check_range(run, table.shape[0])
        wide = table.astype(np.float64) if table.dtype.kind == "f" else table
        if not run.size:
            return [np.zeros(outs[0].shape, wide.dtype)]
        return [pool(wide[run]).reshape(outs[0].shape)]

    return reference


def _pooled_vjp(ctx, grads):
    """Each combined row gets the gradient (divided by the count for GatherAvg; for GatherMax
    only where the row holds the maximum). The rows are found as the non-negative indices
    (Myelin's gradient does the same), padding is scattered to an extra row that is dropped."""
    b = ctx.b
    table, indices = ctx.inputs
    rows, width = table.shape
    flat = indices.reshape([indices.size])
    valid = (flat >= 0).expand_dims(-1)
    g = grads[0]
    if ctx.op.type == "GatherAvg":
        g = g / valid.cast(table.dtype).sum()
    taken = valid.select(g.broadcast_to([indices.size, width]))
    if ctx.op.type == "GatherMax":
        # Rows tied at the maximum (a repeated index, say) share its gradient equally.
        looked_up = table.gather(b.cond(flat >= 0, flat, 0))
        hits = (looked_up.equal(ctx.outputs[0].broadcast_to([indices.size, width])) & valid).cast(table.dtype)
        taken = taken * hits / hits.sum(axis=[0], keepdims=True)
    scattered = b.scatter_add(b.cond(flat >= 0, flat, rows), taken, rows=rows + 1)
    return [scattered.slice([0, 0], [rows, width]), None]


def _pooled_method(op_type: str):
    """Myelin's gather_sum(embedding, indices, name=None) and its siblings."""
    return lambda b, embedding, indices, name=None: b.op(op_type, [embedding, b.operand(indices)], name)


for _type, (_pool, _allowed, _what) in POOLINGS.items():
    define(
        _type, _infer_pooled(_allowed), _pooled(_pool), 2, "index",
        f"{_type}(table, indices): the {_what} of the looked-up rows, [1, width]; negative indices are padding "
        "(leading ones skipped, the first after a row ends the list); no rows gives zeros",
        vjp=_pooled_vjp, flops=lambda op: op.inputs[1].size * op.inputs[0].shape[1],
        method=_type.replace("Gather", "gather_").lower(),
        build=_pooled_method(_type),
    )


# ---- AssignAddScatter: m[indices] += v, in place ---------------------------------------------------------

def _infer_assign_add_scatter(ctx):
    target, indices, value, *oov = ctx.inputs
    if target.rank != 2 or target.dtype not in NUMERIC or indices.dtype not in INDEX:
        raise ctx.fail("a numeric [rows, width] target, int32/int64 indices, a value and an optional oov row")
    width = target.shape[1]
    if value.dtype != target.dtype or value.rank != 2 or value.shape[1] != width or value.shape[0] not in (1, indices.size):
        raise ctx.fail(f"a value of {target.dtype}[1x{width}] or [{indices.size}x{width}] (one row per index)")
    if oov and (oov[0].dtype != target.dtype or oov[0].size != width):
        raise ctx.fail(f"an oov row of {width} {target.dtype} elements")
    return []


def _assign_add_scatter(attrs, args, outs):
    """The updated target (and oov row): Myelin's kernel stops at the first negative index
    unless there is an oov row, which then takes the negative indices' rows."""
    target, indices, value, *oov = args
    target = np.array(target)
    oov = [np.array(row) for row in oov]
    flat = indices.reshape(-1)
    check_range(flat[flat >= 0], target.shape[0])
    for position, index in enumerate(flat):
        row = value[position if value.shape[0] > 1 else 0]
        if index >= 0:
            target[index] += row
        elif oov:
            oov[0] += row.reshape(oov[0].shape)
        else:
            break
    return [target, *oov]


define(
    "AssignAddScatter", _infer_assign_add_scatter, _assign_add_scatter, (3, 4), "state",
    "AssignAddScatter(m, indices, v[, oov]): m[indices] += v in place, v one row per index or one for all; a "
    "negative index ends the list, or with an oov row adds there",
    written=lambda op: [0, 3] if len(op.inputs) == 4 else [0],
    flops=lambda op: op.inputs[1].size * op.inputs[0].shape[1],
    method="assign_add_scatter",
    build=lambda b, m, f, v, ref=False, name=None: _build_assign_add_scatter(b, m, f, v, ref, name),
)


def _build_assign_add_scatter(b, m, f, v, ref, name):
    """Myelin's assign_add_scatter(m, f, v, ref=False); ranvier writes m in place and has no
    reference outputs, so ref=True is refused by name."""
    if ref:
        raise RanvierError("assign_add_scatter: ref=True (a reference output to m) is not supported; read m itself after the update")
    return b.op("AssignAddScatter", [m, b.operand(f), b.operand(v)], name)
