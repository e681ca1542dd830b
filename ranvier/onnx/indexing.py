"""Converters of ONNX's indexing and tensor-building operators: GatherElements, GatherND,
ScatterElements (and the older Scatter), ScatterND, TensorScatter, CenterCropPad, OneHot,
TopK, ReverseSequence, Compress, Tile and EyeLike; and the operators that need
their inputs known at load (Range, ConstantOfShape, MelWeightMatrix, NonZero, Unique,
NonMaxSuppression, ImageDecoder).

The gathers and scatters become ranvier's Gather and ScatterAdd on flattened tensors:
each element's position in the flattened input (its linear index) is computed from the
ONNX indices with a few elementwise ops and constants, so one row gather or scatter serves
every axis and every batch layout.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from .node import Node, converts, onnx_dtype


def _strides(shape: list[int]) -> list[int]:
    """Elements between neighbours along each axis of a C-ordered tensor of `shape`."""
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def from_end(node: Node, indices, size):
    """ONNX's indices as int64, negative ones counted from the end: `size` (a number, or
    sizes broadcasting with the indices) is added to those below 0."""
    indices = indices if indices.dtype == dtypes.DT_INT64 else node.b.cast(indices, dtypes.DT_INT64)
    size = node.b.const(np.asarray(size, np.int64))
    return node.b.cond(indices < node.b.const(np.int64(0)), indices + size, indices)


def _positions(shape: list[int], axis: int | None, strides: list[int]) -> np.ndarray:
    """The linear index each element of a tensor of `shape` contributes by its coordinates
    along every axis but `axis`, for a tensor of `strides` (int64)."""
    coordinates = np.indices(shape, dtype=np.int64) if shape else np.zeros((0,), np.int64)
    return sum((coordinates[d] * strides[d] for d in range(len(shape)) if d != axis),
               np.zeros(shape, np.int64))


def gather_elements(node: Node, data, indices, axis: int):
    """data[i_0, ..., indices[i], ..., i_n] for each position i of `indices` (int64, not
    negative), as a row gather from the flattened data."""
    strides = _strides(data.shape)
    linear = indices * node.b.const(np.int64(strides[axis])) + node.b.const(_positions(indices.shape, axis, strides))
    return node.b.gather(data.reshape([data.size]), linear)


def take(node: Node, x, indices: np.ndarray, axis: int):
    """numpy's take(x, indices, axis) for a known vector of non-negative indices."""
    shape = [*x.shape[:axis], indices.size, *x.shape[axis + 1:]]
    spread = indices.reshape([1] * axis + [indices.size] + [1] * (x.rank - axis - 1))
    return gather_elements(node, x, node.b.const(np.broadcast_to(spread, shape).astype(np.int64)), axis)


@converts("GatherElements")
def gather_elements_(node: Node):
    data = node.tensor(0)
    axis = node.axis(node.attr("axis", 0), data.rank)
    indices = from_end(node, node.tensor(1), data.shape[axis])
    return gather_elements(node, data, indices, axis)


def _nd_rows(node: Node, data, indices, batch_dims: int):
    """For GatherND and ScatterND: the data as rows [batch · indexed positions, the rest]
    and the row each index tuple of `indices` ([batch..., ..., q]) picks in it."""
    q = indices.shape[-1]
    batch, indexed = data.shape[:batch_dims], data.shape[batch_dims:batch_dims + q]
    if q > data.rank - batch_dims or indices.shape[:batch_dims] != batch:
        raise node.error(f"indices of shape {indices.shape} do not index data of shape {data.shape} "
                         f"with batch_dims={batch_dims}")
    indices = from_end(node, indices, indexed)
    linear = (indices * node.b.const(np.asarray(_strides(indexed), np.int64))).sum(axis=[indices.rank - 1])
    if batch_dims:
        batch_of = np.indices(indices.shape[:-1], dtype=np.int64)[:batch_dims]
        first = sum(batch_of[d] * _strides(batch)[d] for d in range(batch_dims)) * math.prod(indexed)
        linear = linear + node.b.const(first)
    rest = data.shape[batch_dims + q:]
    return data.reshape([math.prod(batch) * math.prod(indexed), math.prod(rest)]), linear, rest


@converts("GatherND")
def gather_nd(node: Node):
    data, indices = node.tensor(0), node.tensor(1)
    rows, linear, rest = _nd_rows(node, data, indices, int(node.attr("batch_dims", 0)))
    return node.b.gather(rows, linear).reshape([*indices.shape[:-1], *rest])


# How ScatterElements and ScatterND combine an update with what is there, and the value
# that leaves the other side unchanged (None: only updates with no combining).
_COMBINE = {"mul": ("mul", 1), "max": ("maximum", -math.inf), "min": ("minimum", math.inf)}


def _scatter_rows(node: Node, rows, linear, updates):
    """rows [R, W] with updates [K, W] written at rows `linear` [K] by the node's reduction:
    none (duplicate rows are summed; ONNX leaves their order undefined) and add through
    ranvier's ScatterAdd; mul, max and min by comparing each index with every row, which
    costs K · R · W."""
    reduction = node.attr("reduction", "none")
    count = rows.shape[0]
    if reduction in ("none", "add"):
        added = node.b.scatter_add(linear, updates, rows=count)
        if reduction == "add":
            return rows + added
        ones = node.b.const(np.ones(linear.shape[0], dtypes.to_numpy(rows.dtype)))
        hit = node.b.scatter_add(linear, ones, rows=count).reshape([count, 1]) > node.b.const(0, rows.dtype)
        return node.b.cond(hit, added, rows)
    if reduction not in _COMBINE:
        raise node.error(f"reduction {reduction!r} is not one of none, add, mul, max, min")
    method, neutral = _COMBINE[reduction]
    if rows.dtype in dtypes.INT_DTYPES and neutral != 1:
        info = np.iinfo(dtypes.to_numpy(rows.dtype))
        neutral = info.min if neutral < 0 else info.max
    match = linear.reshape([linear.shape[0], 1, 1]).equal(node.b.const(np.arange(count, dtype=np.int64).reshape(1, count, 1)))
    spread = node.b.cond(match, updates.reshape([updates.shape[0], 1, updates.shape[1]]), node.b.const(neutral, rows.dtype))
    combined = {"mul": spread.product, "max": spread.max, "min": spread.min}[reduction](axis=[0])
    return getattr(node.b, method)(rows, combined)


@converts("ScatterElements", "Scatter")
def scatter_elements(node: Node):
    data, updates = node.tensor(0), node.tensor(2)
    axis = node.axis(node.attr("axis", 0), data.rank)
    indices = from_end(node, node.tensor(1), data.shape[axis])
    strides = _strides(data.shape)
    linear = indices * node.b.const(np.int64(strides[axis])) + node.b.const(_positions(indices.shape, axis, strides))
    rows = _scatter_rows(node, data.reshape([data.size, 1]), linear.reshape([indices.size]),
                         updates.reshape([updates.size, 1]))
    return rows.reshape(data.shape)


@converts("ScatterND")
def scatter_nd(node: Node):
    data, indices, updates = node.tensor(0), node.tensor(1), node.tensor(2)
    rows, linear, rest = _nd_rows(node, data, indices, 0)
    count = math.prod(indices.shape[:-1])
    if updates.shape != [*indices.shape[:-1], *rest]:
        raise node.error(f"updates of shape {updates.shape}; indices {indices.shape} into data {data.shape} "
                         f"need {[*indices.shape[:-1], *rest]}")
    scattered = _scatter_rows(node, rows, linear.reshape([count]), updates.reshape([count, rows.shape[1]]))
    return scattered.reshape(data.shape)


@converts("TensorScatter")
def tensor_scatter(node: Node):
    """A key/value cache [batch, ..., length, ...] with each batch entry's update written
    along the axis from its write index on (in circular mode, wrapping at the length)."""
    cache, update = node.tensor(0), node.tensor(1)
    axis = node.axis(node.attr("axis", -2), cache.rank)
    mode = node.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        raise node.error(f"mode {mode!r} is not linear or circular")
    if axis == 0 or update.rank != cache.rank or any(
            u != c for i, (u, c) in enumerate(zip(update.shape, cache.shape)) if i != axis) or \
            update.shape[axis] > cache.shape[axis]:
        raise node.error(f"update of shape {update.shape} does not fit cache {cache.shape} along axis {axis} "
                         "(after the batch axis)")
    length = cache.shape[axis]
    step = np.arange(update.shape[axis], dtype=np.int64).reshape([-1] + [1] * (cache.rank - axis - 1))
    if node.optional(2) is None:
        position = node.b.const(step)
    else:
        starts = node.b.cast(node.tensor(2), dtypes.DT_INT64).reshape([cache.shape[0]] + [1] * (cache.rank - 1))
        position = starts + node.b.const(step)
    if mode == "circular":
        position = node.b.mod(position, node.b.const(np.int64(length)))
    strides = _strides(cache.shape)
    linear = node.b.broadcast_to(position * node.b.const(np.int64(strides[axis])), update.shape) + \
        node.b.const(_positions(update.shape, axis, strides))
    rows = _scatter_rows(node, cache.reshape([cache.size, 1]), linear.reshape([update.size]),
                         update.reshape([update.size, 1]))
    return rows.reshape(cache.shape)


@converts("CenterCropPad")
def center_crop_pad(node: Node):
    """Each named axis cropped or zero-padded to its size in `shape`, centred (the odd
    element cropped from, or padded at, the end)."""
    x = node.tensor(0)
    sizes = node.ints(1, "shape")
    axes = [node.axis(a, x.rank) for a in node.attr("axes", range(x.rank))]
    if len(sizes) != len(axes):
        raise node.error(f"shape {sizes} does not give one size per axis of {axes}")
    begin, kept, before, after = [0] * x.rank, list(x.shape), [0] * x.rank, [0] * x.rank
    for axis, size in zip(axes, sizes):
        if size < x.shape[axis]:
            begin[axis], kept[axis] = (x.shape[axis] - size) // 2, size
        else:
            before[axis] = (size - x.shape[axis]) // 2
            after[axis] = size - x.shape[axis] - before[axis]
    if kept != x.shape:
        x = node.b.slice(x, begin, kept)
    return node.b.pad(x, before=before, after=after, value=0) if any(before + after) else x


@converts("OneHot")
def one_hot(node: Node):
    """values[1] where the index (negative ones counted from the end) is the position along
    the new axis, values[0] elsewhere; an index outside [-depth, depth) gives a row of
    values[0]."""
    depth = int(node.constant(1, "depth").item())
    indices, values = node.tensor(0), node.tensor(2)
    rank = indices.rank + 1
    axis = node.axis(node.attr("axis", -1), rank)
    if indices.dtype in dtypes.FLOAT_DTYPES:  # ONNX casts them to integers, toward zero
        indices = node.b.cast(indices, dtypes.DT_INT64)
    hot = from_end(node, indices, depth).one_hot(depth, dtypes.DT_BOOL)
    off, on = (values.slice([i], [1]).reshape([]) for i in (0, 1))
    result = node.b.cond(hot, on, off)
    if axis == rank - 1:
        return result
    return result.transpose([*range(axis), rank - 1, *range(axis, rank - 1)])


def last_axis(x, axis: int):
    """(x with `axis` moved last, the permutation that puts it back)."""
    if axis == x.rank - 1:
        return x, None
    order = [*range(axis), *range(axis + 1, x.rank), axis]
    return x.transpose(order), list(np.argsort(order))


@converts("TopK")
def top_k(node: Node):
    """The k largest (or smallest) values along the axis, in order, with their int64
    indices; ties keep the lower index first. The smallest are the largest of −x (of
    −1 − x for integers, which does not overflow), read back from x."""
    x = node.tensor(0)
    k = int(node.ints(1, "k")[0]) if node.opset >= 10 else int(node.attr("k"))
    axis = node.axis(node.attr("axis", -1), x.rank)
    if not 1 <= k <= x.shape[axis]:
        raise node.error(f"k={k} is outside [1, {x.shape[axis]}] (the size of axis {axis})")
    node.attr("sorted")  # the values come sorted either way, which sorted=0 allows
    moved, back = last_axis(x, axis)
    largest = bool(node.attr("largest", 1))
    if largest:
        values, indices = moved.top_k(k)
    else:
        key = -moved if x.dtype in dtypes.FLOAT_DTYPES else node.b.const(-1, x.dtype) - moved
        _, indices = key.top_k(k)
    indices = node.b.cast(indices, dtypes.DT_INT64)
    if not largest:
        values = gather_elements(node, moved, indices, moved.rank - 1)
    if back is None:
        return [values, indices]
    return [values.transpose(back), indices.transpose(back)]


@converts("ReverseSequence")
def reverse_sequence(node: Node):
    """Each batch entry's first sequence_lens[b] steps reversed, the rest kept: step t
    reads step len − 1 − t below the length, itself above."""
    x = node.tensor(0)
    batch_axis, time_axis = int(node.attr("batch_axis", 1)), int(node.attr("time_axis", 0))
    if {batch_axis, time_axis} != {0, 1}:
        raise node.error(f"batch_axis {batch_axis} and time_axis {time_axis}: ONNX takes 0 and 1, one each")
    along = [1] * x.rank
    along[batch_axis] = x.shape[batch_axis]
    lengths = node.b.cast(node.tensor(1), dtypes.DT_INT64).reshape(along)
    along = [1] * x.rank
    along[time_axis] = x.shape[time_axis]
    step = node.b.const(np.arange(x.shape[time_axis], dtype=np.int64).reshape(along))
    source = node.b.cond(step < lengths, lengths - node.b.const(np.int64(1)) - step, step)
    return gather_elements(node, x, node.b.broadcast_to(source, x.shape), time_axis)


@converts("Compress")
def compress(node: Node):
    """The slices along the axis (of the flattened input without one) where the condition,
    which must be known at load (it sets the output's shape), is true."""
    x = node.tensor(0)
    condition = node.constant(1, "condition (it sets the output's shape)").astype(bool).reshape(-1)
    axis = node.attr("axis")
    if axis is None:
        x, axis = x.reshape([x.size]), 0
    axis = node.axis(axis, x.rank)
    if condition.size > x.shape[axis]:
        raise node.error(f"its condition has {condition.size} entries, more than axis {axis}'s {x.shape[axis]}")
    return take(node, x, np.flatnonzero(condition), axis)


@converts("Tile")
def tile(node: Node):
    x = node.tensor(0)
    repeats = node.ints(1, "repeats")
    if len(repeats) != x.rank or min(repeats, default=1) < 0:
        raise node.error(f"repeats {repeats}: one count of at least 0 per axis of its rank-{x.rank} input")
    spread = [d for r, size in zip(repeats, x.shape) for d in (r, size)]
    grown = node.b.broadcast_to(x.reshape([d for size in x.shape for d in (1, size)]), spread)
    return grown.reshape([r * size for r, size in zip(repeats, x.shape)])


@converts("EyeLike")
def eye_like(node: Node):
    """Ones on diagonal k of a matrix of its input's shape (only the shape is read)."""
    if len(node.shape(0)) != 2:
        raise node.error(f"its input has shape {node.shape(0)}; EyeLike takes a 2-D one")
    dtype = node.attr("dtype")
    dtype = node.tensor(0).dtype if dtype is None else onnx_dtype(dtype, f"{node.label}'s dtype")
    return np.eye(*node.shape(0), int(node.attr("k", 0)), dtype=dtypes.to_numpy(dtype))


# Operators whose inputs set their output's shape (Range's bounds, ConstantOfShape's shape,
# MelWeightMatrix's sizes) or whose output's shape depends on their inputs' values (NonZero,
# Unique, NonMaxSuppression, ImageDecoder): known at load, the importer folds them before
# any converter; read from the model's inputs, they cannot be compiled to static shapes,
# and these converters say which input must be known.
_VALUES_SET_SHAPE = "(its values set the output's shape)"
_KNOWN_INPUTS = {"Range": ("start", "limit", "delta"), "ConstantOfShape": ("shape",),
                 "MelWeightMatrix": ("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz",
                                     "upper_edge_hertz"),
                 "NonZero": (f"input {_VALUES_SET_SHAPE}",), "Unique": (f"input {_VALUES_SET_SHAPE}",),
                 "NonMaxSuppression": (f"boxes {_VALUES_SET_SHAPE}", f"scores {_VALUES_SET_SHAPE}",
                                       "max_output_boxes_per_class", "iou_threshold", "score_threshold"),
                 "ImageDecoder": (f"encoded stream {_VALUES_SET_SHAPE}",)}


@converts(*_KNOWN_INPUTS)
def known_inputs(node: Node):
    for index, what in enumerate(_KNOWN_INPUTS[node.proto.op_type]):
        if index == 0 or node.optional(index) is not None:  # the first input is never optional
            node.constant(index, what)
    return node.importer.fold(node)
