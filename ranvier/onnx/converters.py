"""One converter per ONNX operator: the ranvier ops that compute a node.

A converter gets the node (its inputs' values, attributes, the builder) and returns the
values of its outputs. Inputs known at load time are numpy arrays; a node whose inputs
are all known never reaches a converter (the importer folds it), so converters only
deal with nodes that read the model's inputs.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from . import training
from .indexing import take
from .node import Node, converts, onnx_dtype

# ---- elementwise -----------------------------------------------------------------------------

_UNARY = {
    "Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Exp": "exp", "Log": "log", "Sqrt": "sqrt",
    "Reciprocal": "rcp", "Neg": "neg", "Abs": "abs", "Erf": "erf", "Floor": "floor", "Ceil": "ceil",
    "Round": "round", "Sin": "sin", "Cos": "cos", "Tan": "tan", "Asin": "asin", "Acos": "acos", "Atan": "atan",
    "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Sign": "sign",
    "Not": "logical_not", "Softplus": "softplus", "Softsign": "softsign", "Identity": "identity",
}
_BINARY = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Equal": "equal", "Less": "less",
    "Greater": "greater", "LessOrEqual": "less_equal", "GreaterOrEqual": "greater_equal",
    "And": "logical_and", "Or": "logical_or", "Xor": "logical_xor",
}


@converts(*_UNARY)
def unary(node: Node):
    return getattr(node.b, _UNARY[node.proto.op_type])(node.tensor(0))


@converts(*_BINARY)
def binary(node: Node):
    return getattr(node.b, _BINARY[node.proto.op_type])(node.tensor(0), node.tensor(1))


@converts("Pow")
def pow_(node: Node):
    """x ** y in x's dtype: a float base takes an exponent of any dtype; an integer base
    is raised in float64 and truncated back, as ONNX Runtime's std::pow and cast do.
    ranvier's pow, exp(y · log x), lands within a few ulps of the power (3^6 as
    728.9999999999994), so a power that close to a whole number is taken as it."""
    x, y = node.tensor(0), node.tensor(1)
    if x.dtype in dtypes.FLOAT_DTYPES:
        return node.b.pow(x, y if y.dtype == x.dtype else node.b.cast(y, x.dtype))
    wide = node.b.pow(node.b.cast(x, dtypes.DT_FLOAT64), y if y.dtype == dtypes.DT_FLOAT64 else node.b.cast(y, dtypes.DT_FLOAT64))
    whole = wide.round()
    return node.b.cast(node.b.cond((wide - whole).abs() <= whole.abs() * 1e-12, whole, wide), x.dtype)


@converts("Max", "Min", "Sum", "Mean")
def variadic(node: Node):
    combine = {"Max": node.b.maximum, "Min": node.b.minimum, "Sum": node.b.add, "Mean": node.b.add}[node.proto.op_type]
    result = node.tensor(0)
    for index in range(1, len(node.inputs)):
        result = combine(result, node.tensor(index))
    return result / float(len(node.inputs)) if node.proto.op_type == "Mean" else result


@converts("Where")
def where(node: Node):
    return node.b.cond(node.tensor(0), node.tensor(1), node.tensor(2))


@converts("Dropout")
def dropout(node: Node):
    """Dropout as inference computes it, the identity, and its mask all true; training
    mode is refused, unless its ratio is 0 (random draws ranvier does not make as ONNX
    Runtime makes them). A trainable import drops (`training.dropout`)."""
    if node.importer.training:
        return training.dropout(node)
    node.attr("seed")  # draws nothing in inference
    if node.opset < 7:
        training_mode = not node.attr("is_test", 0)
        ratio = float(node.attr("ratio", 0.5))
    elif node.opset < 12:
        training_mode, ratio = False, float(node.attr("ratio", 0.5))
    else:
        training_mode = node.optional(2) is not None and bool(node.constant(2, "training_mode"))
        ratio = float(node.constant(1, "ratio")) if node.optional(1) is not None else 0.5
    if training_mode and ratio:
        raise node.error(f"training_mode with ratio {ratio} (random dropout) is not supported")
    x = node.tensor(0)
    kept = np.ones(x.shape, bool if node.opset >= 10 else dtypes.to_numpy(x.dtype))  # a bool mask since opset 10
    return [node.b.identity(x), kept]


@converts("LeakyRelu")
def leaky_relu(node: Node):
    x = node.tensor(0)
    return node.b.cond(x < 0.0, x * float(node.attr("alpha", 0.01)), x)


@converts("Clip")
def clip(node: Node):
    x = node.tensor(0)
    if node.opset < 11:  # the bounds were attributes then
        low, high = node.attr("min"), node.attr("max")
        return node.b.minimum(node.b.maximum(x, float(low if low is not None else -math.inf)),
                              float(high if high is not None else math.inf))
    if node.optional(1) is not None:
        x = node.b.maximum(x, node.tensor(1))
    if node.optional(2) is not None:
        x = node.b.minimum(x, node.tensor(2))
    return x


@converts("Gelu")
def gelu(node: Node):
    return node.b.gelu(node.tensor(0), approximate=node.attr("approximate", "none"))


@converts("Cast", "CastLike")
def cast(node: Node):
    node.attr("saturate"), node.attr("round_mode")  # conversions to float8 types only, which ranvier has not
    if node.proto.op_type == "Cast":
        target = onnx_dtype(node.attr("to"), f"Cast node {node.name!r}")
    else:
        like = node.inputs[1]
        target = dtypes.from_numpy(like.dtype) if isinstance(like, np.ndarray) else like.dtype
    if isinstance(node.inputs[0], np.ndarray):  # known like a model input: stays known, to fold what follows
        return node.inputs[0].astype(dtypes.to_numpy(target))
    x = node.tensor(0)
    return x if x.dtype == target else node.b.cast(x, target)


# ---- matrix products and normalisation ---------------------------------------------------------


@converts("MatMul")
def matmul(node: Node):
    a, b = node.tensor(0), node.tensor(1)
    # numpy's rule for 1-D operands: a vector is a row (left) or a column (right), then dropped.
    a2 = a.reshape([1, *a.shape]) if a.rank == 1 else a
    b2 = b.reshape([*b.shape, 1]) if b.rank == 1 else b
    result = node.b.matmul(a2, b2)
    if a.rank == 1 or b.rank == 1:
        shape = list(result.shape)
        if a.rank == 1:
            del shape[-2]
        if b.rank == 1:
            del shape[-1]
        result = result.reshape(shape)
    return result


@converts("Gemm")
def gemm(node: Node):
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    result = node.b.matmul(node.tensor(0), node.tensor(1), transpose_a=bool(node.attr("transA", 0)),
                           transpose_b=bool(node.attr("transB", 0)))
    if alpha != 1.0:
        result = result * alpha
    if node.optional(2) is not None:
        bias = node.tensor(2)
        # ONNX broadcasts C one way only, to the product's [M, N]: a C of [2, 1, N] is refused, not grown to [2, M, N].
        if bias.rank > 2 or any(c not in (1, d) for c, d in zip(reversed(bias.shape), reversed(result.shape))):
            raise node.error(f"its C of shape {bias.shape} does not broadcast to the product's {result.shape}")
        if beta != 0.0:
            result = result + (bias * beta if beta != 1.0 else bias)
    return result


def _over_trailing_axes(x, axis: int, normalise):
    """Apply a last-axis op over the axes from `axis` (counted from 0) on (ONNX's
    LayerNormalization and the opset < 13 softmax flatten them), reshaping around it."""
    if axis == x.rank - 1:
        return normalise(x)
    flat = x.reshape([*x.shape[:axis], math.prod(x.shape[axis:])])
    return normalise(flat).reshape(x.shape)


@converts("Softmax", "LogSoftmax")
def softmax(node: Node):
    x = node.tensor(0)
    method = node.b.softmax if node.proto.op_type == "Softmax" else node.b.log_softmax
    if node.opset >= 13:
        return method(x, axis=node.axis(node.attr("axis", -1), x.rank))
    return _over_trailing_axes(x, node.axis(node.attr("axis", 1), x.rank), lambda flat: method(flat, axis=-1))




@converts("SkipLayerNormalization", domain="com.microsoft")
def skip_layer_norm(node: Node):
    """ONNX Runtime's fused residual + LayerNorm: LN(x + skip + bias); output 3 is the sum."""
    total = node.tensor(0) + node.tensor(1)
    if node.optional(4) is not None:
        total = total + node.tensor(4)
    beta = node.tensor(3) if node.optional(3) is not None else None
    normed = node.b.layer_norm(total, node.tensor(2), beta, eps=float(node.attr("epsilon", 1e-12)))
    if any(node.proto.output[1:3]):
        raise node.error("its mean and inverse standard deviation outputs are not supported")
    return [normed, None, None, total]


@converts("FastGelu", "BiasGelu", domain="com.microsoft")
def fast_gelu(node: Node):
    x = node.tensor(0) + node.tensor(1) if node.optional(1) is not None else node.tensor(0)
    return node.b.gelu(x, approximate="tanh" if node.proto.op_type == "FastGelu" else "none")


# ---- shapes -------------------------------------------------------------------------------------


@converts("Reshape")
def reshape(node: Node):
    x = node.tensor(0)
    target = node.ints(1, "target shape")
    if not node.attr("allowzero", 0):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        target[target.index(-1)] = x.size // known if known else 0
    if min(target, default=0) < 0 or math.prod(target) != x.size:
        raise node.error(f"target shape {target} does not hold the {x.size} elements of shape {x.shape}")
    return x.reshape(target)


@converts("Flatten")
def flatten(node: Node):
    x = node.tensor(0)
    axis = int(node.attr("axis", 1))
    if not -x.rank <= axis <= x.rank:
        raise node.error(f"axis {axis} is outside [-{x.rank}, {x.rank}] for its rank-{x.rank} input")
    axis += x.rank if axis < 0 else 0  # a negative axis counts from the end, in [-rank, rank]
    return x.reshape([math.prod(x.shape[:axis]), math.prod(x.shape[axis:])])


def _axes(node: Node, rank: int, attribute_until: int) -> list[int] | None:
    """Axes from the attribute (opsets before `attribute_until`) or the second input."""
    if node.opset < attribute_until:
        axes = node.attr("axes")
    else:
        axes = node.ints(1, "axes") if node.optional(1) is not None else None
    return None if axes is None else sorted(node.axis(a, rank) for a in axes)


@converts("Unsqueeze")
def unsqueeze(node: Node):
    x = node.tensor(0)
    rank = x.rank + len(node.attr("axes") if node.opset < 13 else node.ints(1, "axes"))
    shape = list(x.shape)
    for axis in _axes(node, rank, 13):
        shape.insert(axis, 1)
    return x.reshape(shape)


@converts("Squeeze")
def squeeze(node: Node):
    x = node.tensor(0)
    axes = _axes(node, x.rank, 13)
    axes = axes if axes is not None else [i for i, d in enumerate(x.shape) if d == 1]
    return x.reshape([d for i, d in enumerate(x.shape) if i not in axes])


@converts("Transpose")
def transpose(node: Node):
    x = node.tensor(0)
    perm = node.attr("perm")
    return node.b.transpose(x, perm=list(perm) if perm is not None else list(reversed(range(x.rank))))


@converts("Concat")
def concat(node: Node):
    parts = [node.tensor(i) for i, v in enumerate(node.inputs) if not (isinstance(v, np.ndarray) and v.size == 0)]
    axis = node.axis(node.attr("axis"), parts[0].rank)
    return parts[0] if len(parts) == 1 else node.b.concat(parts, axis)


@converts("Split")
def split(node: Node):
    x = node.tensor(0)
    axis = node.axis(node.attr("axis", 0), x.rank)
    if node.opset >= 13 and node.optional(1) is not None:
        sizes = node.ints(1, "split sizes")
    elif node.attr("split") is not None:
        sizes = [int(s) for s in node.attr("split")]
    else:
        count = int(node.attr("num_outputs", len(node.proto.output)))
        step = -(-x.shape[axis] // count)  # ONNX: equal parts, the last one smaller
        sizes = [min(step, x.shape[axis] - i * step) for i in range(count)]
    parts = node.b.split(x, sizes, axis)
    return list(parts)


@converts("SplitToSequence")
def split_to_sequence(node: Node):
    """A sequence is a list of values: the parts along `axis`, of the sizes input 1 gives
    (one size: parts of it, the last smaller), or of 1 each (squeezed unless keepdims)."""
    x = node.inputs[0]
    rank = len(x.shape)
    axis = int(node.attr("axis", 0)) % rank
    length = x.shape[axis]
    split = node.optional(1)
    if split is None:
        sizes = [1] * length
    elif np.ndim(node.constant(1, "split")) == 0:
        step = int(split)
        sizes = [min(step, length - start) for start in range(0, length, step)]
    else:
        sizes = [int(s) for s in split]
    if sum(sizes) != length or min(sizes, default=1) < 1:
        raise node.error(f"split sizes {sizes} do not cover the {length} elements of axis {axis}")
    squeeze = split is None and not node.attr("keepdims", 1)
    if isinstance(x, np.ndarray):
        parts = np.split(x, np.cumsum(sizes)[:-1], axis)
        return [[np.squeeze(p, axis) if squeeze else p for p in parts]]
    parts = node.b.split(x, sizes, axis) if len(sizes) > 1 else [x]
    shape = [d for i, d in enumerate(x.shape) if i != axis]
    return [[p.reshape(shape) if squeeze else p for p in parts]]


@converts("SequenceAt")
def sequence_at(node: Node):
    sequence = node.inputs[0]
    position = int(node.constant(1, "position"))
    if not -len(sequence) <= position < len(sequence):
        raise node.error(f"position {position} is outside the sequence of {len(sequence)}")
    return sequence[position]


@converts("Slice")
def slice_(node: Node):
    x = node.tensor(0)
    starts, ends = node.ints(1, "starts"), node.ints(2, "ends")
    axes = [node.axis(a, x.rank) for a in node.ints(3, "axes")] if node.optional(3) is not None else list(range(len(starts)))
    steps = node.ints(4, "steps") if node.optional(4) is not None else [1] * len(starts)
    begin, size, stride = [0] * x.rank, list(x.shape), [1] * x.rank
    backwards = {}  # axis: the positions a negative step reads, gathered after the view
    for axis, start, end, step in zip(axes, starts, ends, steps):
        indices = range(x.shape[axis])[slice(start, end, step)]
        if step < 0:
            backwards[axis] = np.asarray(indices, np.int64)
            continue
        begin[axis], size[axis], stride[axis] = (indices.start if len(indices) else 0), len(indices), step
    if all(s == 1 for s in stride):
        y = node.b.slice(x, begin, size) if (begin, size) != ([0] * x.rank, x.shape) else x
    else:
        element_strides = [math.prod(x.shape[i + 1:]) for i in range(x.rank)]
        y = node.b.strided_view(x, offset=sum(b * e for b, e in zip(begin, element_strides)), shape=size,
                                strides=[s * e for s, e in zip(stride, element_strides)])
    for axis, positions in backwards.items():
        y = take(node, y, positions, axis)
    return y


@converts("Gather")
def gather(node: Node):
    params = node.tensor(0)
    axis = node.axis(node.attr("axis", 0), params.rank)
    indices = node.inputs[1]
    if isinstance(indices, np.ndarray):
        indices = np.where(indices < 0, indices + params.shape[axis], indices)  # ONNX counts negatives from the end
        if np.any((indices < 0) | (indices >= params.shape[axis])):
            raise node.error(f"an index is outside [0, {params.shape[axis]})")
        indices = node.b.const(indices.astype(np.int64 if indices.dtype == np.int64 else np.int32))
    else:
        # ONNX counts negative indices from the end, where ranvier's Gather reads them as out of range.
        indices = node.tensor(1)
        index_type = dtypes.to_numpy(indices.dtype)
        size = node.b.const(np.asarray(params.shape[axis], index_type))
        indices = node.b.cond(indices < node.b.const(np.asarray(0, index_type)), indices + size, indices)
    if axis == 0:
        return node.b.gather(params, indices)
    # Bring the axis first, gather rows, and put the gathered axes back where it was.
    perm = [axis, *[i for i in range(params.rank) if i != axis]]
    rows = node.b.gather(node.b.transpose(params, perm=perm), indices)
    k = indices.rank
    order = list(range(k, k + axis)) + list(range(k)) + list(range(k + axis, rows.rank))
    return node.b.transpose(rows, perm=order)


@converts("Expand")
def expand(node: Node):
    x = node.tensor(0)
    shape = node.ints(1, "shape")
    target = list(np.broadcast_shapes(tuple(x.shape), tuple(shape)))
    return x if target == x.shape else node.b.broadcast_to(x, target)


@converts("Shape")
def shape(node: Node):
    dims = np.asarray(node.shape(0), np.int64)
    start, end = node.attr("start", 0), node.attr("end")
    return dims[start:end]


@converts("Size")
def size(node: Node):
    return np.asarray(math.prod(node.shape(0)), np.int64)


@converts("Trilu")
def trilu(node: Node):
    x = node.tensor(0)
    k = int(node.constant(1, "diagonal")) if node.optional(1) is not None else 0
    rows, cols = x.shape[-2:]
    keep = np.triu(np.ones((rows, cols), bool), k) if node.attr("upper", 1) else np.tril(np.ones((rows, cols), bool), k)
    return node.b.select(node.b.const(keep), x)


# ---- reductions ---------------------------------------------------------------------------------

_REDUCE = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "product",
           "ReduceSumSquare": "sum_squares"}


@converts(*_REDUCE)
def reduce(node: Node):
    x = node.tensor(0)
    since = 13 if node.proto.op_type == "ReduceSum" else 18  # when axes became an input
    axes = _axes(node, x.rank, since)
    if not axes and node.attr("noop_with_empty_axes", 0):  # axes omitted or empty
        return node.b.identity(x)
    keepdims = bool(node.attr("keepdims", 1))
    axes = axes or list(range(x.rank))
    method = _REDUCE[node.proto.op_type]
    if method in ("max", "min") and x.dtype == dtypes.DT_BOOL:  # the largest of booleans is any, the smallest all
        method = "any" if method == "max" else "all"
    elif method in ("max", "min") and any(x.shape[a] == 0 for a in axes):
        # The extreme of nothing: the dtype's lowest value for a max, its highest for a min (as ONNX says).
        kind = dtypes.to_numpy(x.dtype)
        if x.dtype in dtypes.FLOAT_DTYPES:
            value = -np.inf if method == "max" else np.inf
        else:
            value = np.iinfo(kind).min if method == "max" else np.iinfo(kind).max
        shape = [1 if i in axes else d for i, d in enumerate(x.shape) if keepdims or i not in axes]
        return np.full(shape, value, kind)
    return getattr(node.b, method)(x, axis=axes, keepdims=keepdims)


@converts("ArgMax", "ArgMin")
def arg(node: Node):
    x = node.tensor(0)
    axis, keepdims = node.axis(node.attr("axis", 0), x.rank), bool(node.attr("keepdims", 1))
    if node.attr("select_last_index", 0):
        return _last_extreme_index(node, x, axis, keepdims)
    method = node.b.argmax if node.proto.op_type == "ArgMax" else node.b.argmin
    return method(x, axis=axis, keepdims=keepdims, output_type="int64")


def _last_extreme_index(node: Node, x, axis: int, keepdims: bool):
    """ArgMax/ArgMin with select_last_index: the greatest index holding the extreme (a NaN
    counts as one, as numpy's argmax finds it), by a max over the indices where it is."""
    extreme = x.max(axis=[axis], keepdims=True) if node.proto.op_type == "ArgMax" else x.min(axis=[axis], keepdims=True)
    at = x.equal(extreme) | x.not_equal(x)
    shape = [1] * x.rank
    shape[axis] = x.shape[axis]
    index = node.b.const(np.arange(x.shape[axis], dtype=np.int64).reshape(shape))
    return node.b.cond(at, index, node.b.const(np.int64(-1))).max(axis=[axis], keepdims=keepdims)


# ---- padding ------------------------------------------------------------------------------


@converts("Pad")
def pad(node: Node):
    x = node.tensor(0)
    mode = node.attr("mode", "constant")
    if mode not in ("constant", "edge", "reflect", "wrap"):
        raise node.error(f"mode {mode!r} is not one of constant, edge, reflect, wrap")
    pads = node.ints(1, "pads") if node.opset >= 11 else [int(p) for p in node.attr("pads")]
    value = node.optional(2) if node.opset >= 11 else node.attr("value", 0.0)
    if node.opset >= 11 and value is not None:
        given = np.asarray(node.constant(2, "constant value"))
        if given.size != 1:  # ONNX's functions pass it as one value of shape [1] as well as a scalar
            raise node.error(f"its constant value of shape {list(given.shape)} is not one value")
        value = float(given.reshape(()))
    else:
        value = float(value or 0.0)
    axes = [node.axis(a, x.rank) for a in node.ints(3, "axes")] if node.optional(3) is not None else list(range(x.rank))
    before, after = [0] * x.rank, [0] * x.rank
    for i, axis in enumerate(axes):
        before[axis], after[axis] = pads[i], pads[i + len(axes)]
    if mode != "constant":
        # Each output position reads the input position numpy's pad of the positions
        # gives (a negative pad crops), gathered along each padded axis.
        for axis in range(x.rank):
            if before[axis] or after[axis]:
                positions = np.pad(np.arange(x.shape[axis]), (max(before[axis], 0), max(after[axis], 0)), mode=mode)
                x = take(node, x, positions[max(-before[axis], 0):len(positions) - max(-after[axis], 0)], axis)
        return x
    if min(before + after) < 0:  # cropped first
        kept = [d + min(b, 0) + min(a, 0) for d, b, a in zip(x.shape, before, after)]
        x = node.b.slice(x, [max(-b, 0) for b in before], kept)
    return node.b.pad(x, before=[max(b, 0) for b in before], after=[max(a, 0) for a in after], value=value)
