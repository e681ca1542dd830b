"""Indexing ops: Gather (embedding lookup), ScatterAdd (its transpose) and OneHot."""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .registry import Attr, TensorType, define, zero_gradient
from .rules import INDEX


def _infer_gather(ctx):
    params, indices = ctx.inputs
    if indices.dtype not in INDEX or params.rank < 1:
        raise ctx.fail("params of rank >= 1 and int32/int64 indices")
    return [TensorType(params.dtype, (*indices.shape, *params.shape[1:]))]


def _check_range(indices, rows):
    if indices.size and (indices.min() < 0 or indices.max() >= rows):
        bad = indices[(indices < 0) | (indices >= rows)].reshape(-1)[0]
        raise IndexError(f"index {int(bad)} is outside [0, {rows})")


def _gather(attrs, args, outs):
    params, indices = args
    _check_range(indices, params.shape[0])
    return [params[indices]]


define(
    "Gather", _infer_gather, _gather, 2, "index", "Gather(params, indices) = params[indices] along axis 0",
    vjp=lambda ctx, g: [ctx.b.scatter_add(ctx.inputs[1], g[0], rows=ctx.inputs[0].shape[0]), None],
    method="gather",
    # Python-number indices are int32, not converted to the params' dtype.
    build=lambda b, params, indices, name=None: b.op("Gather", [params, b.operand(indices)], name),
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
    _check_range(indices, rows)
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
