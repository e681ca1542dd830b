"""Random numbers inside a compiled step: a counter-based generator and dropout.

`RandomUniform(counter, seed)` hashes each element's counter with the seed into a
uniform number in [0, 1): a pure function of its inputs, so every backend computes the
same bits (integer multiplies, xors and shifts; no state, no order), a kernel may run
its elements in any order or any number of threads, and the backward pass can compute
a forward mask again instead of storing it. The hash is Chris Wellons' "lowbias32"
(an invertible 32-bit mix: distinct counters under one seed never collide).

`Dropout(x, seed)` zeroes each element with probability `rate` and scales the kept
ones by 1 / (1 − rate), as PyTorch's does in training; its mask is `RandomUniform` of
the element's position, the step's `seed` and the op's `stream` (each dropout of a
model its own stream). Its gradient is the same dropout of the output's gradient: the
same seed, stream and positions give the same mask. The compiler rewrites it into the
counter, the hash and a select, which fuse with the elementwise work around them.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .registry import Attr, TensorType, decomposition, define, zero_gradient
from .rules import broadcast_shapes

_GOLDEN = 0x9E3779B9  # 2³² / φ: spreads the streams' seeds over the 32-bit range
_MIX = (0x7FEB352D, 0x846CA68B)  # lowbias32's multipliers
_SHIFTS = (16, 15, 16)
_UNIT = 2.0**-24  # a uniform number takes the hash's top 24 bits, exact in float32

STREAM = Attr("stream", "int", 0, "which independent sequence of numbers (each dropout of a model its own)")
RATE = Attr("rate", "float", 0.5, "the probability of zeroing an element")


def _signed(value: int) -> int:
    """A 32-bit pattern as the int32 holding it (IR constants of int32 are signed)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _lowbias32(x, shift_right):
    """The mix on uint32 numpy arrays or on int32 IR values (`shift_right` is each's >>)."""
    for multiplier, shift in zip(_MIX, _SHIFTS[:2]):
        x = x ^ shift_right(x, shift)
        x = x * multiplier
    return x ^ shift_right(x, _SHIFTS[2])


def uniform(counter: np.ndarray, seed: np.ndarray, stream: int) -> np.ndarray:
    """The oracle: float32 numbers in [0, 1) for int32 counters and seed."""
    with np.errstate(over="ignore"):
        counter = np.asarray(counter).astype(np.uint32)
        seed = np.asarray(seed).astype(np.uint32)
        key = _lowbias32(seed + np.uint32((stream * _GOLDEN) & 0xFFFFFFFF), lambda x, s: x >> np.uint32(s))
        mix = _lowbias32(counter ^ key, lambda x, s: x >> np.uint32(s))
    mix = np.asarray(mix, np.uint32) >> np.uint32(8)
    return (mix.astype(np.float64) * _UNIT).astype(np.float32)


def _uniform_formula(counter, seed, stream):
    """The same bits on IR values: int32 arithmetic wraps as uint32's does, and `//` by a
    power of two is a logical shift right."""
    def shift_right(x, s):
        return x // (1 << s)

    key = _lowbias32(seed + _signed((stream * _GOLDEN) & 0xFFFFFFFF), shift_right)
    mix = _lowbias32(counter ^ key.splat(counter.lanes), shift_right)
    return shift_right(mix, 8).cast(dtypes.DT_FLOAT) * _UNIT


def _infer_uniform(ctx):
    counter, seed = ctx.inputs
    if counter.dtype != dtypes.DT_INT32 or seed.dtype != dtypes.DT_INT32:
        raise ctx.fail("int32 counters and an int32 seed")
    return [TensorType(dtypes.DT_FLOAT, broadcast_shapes(ctx, [counter.shape, seed.shape]))]


define(
    "RandomUniform", _infer_uniform, lambda attrs, args, outs: [uniform(args[0], args[1], attrs["stream"])], 2, "elementwise",
    "numbers in [0, 1), a hash of each int32 counter with the int32 seed and attribute stream",
    attrs=[STREAM], vjp=zero_gradient, formula=_uniform_formula, method="random_uniform",
)


def positions(shape) -> np.ndarray:
    """Each element's index in row-major order, as int32 (what a dropout mask hashes)."""
    return np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).astype(np.int32).reshape(shape)


def _dropout(attrs, args, outs):
    x, seed = args
    kept = uniform(positions(x.shape), seed, attrs["stream"]) >= attrs["rate"]
    scale = 1.0 / (1.0 - attrs["rate"])
    return [np.where(kept, x * np.asarray(scale, x.dtype), np.zeros((), x.dtype)).astype(x.dtype)]


def _infer_dropout(ctx):
    x, seed = ctx.inputs
    rate = ctx.attrs["rate"]
    if not dtypes.is_float(x.dtype) or seed.dtype != dtypes.DT_INT32 or seed.shape:
        raise ctx.fail("a floating-point input and a scalar int32 seed")
    if not 0.0 <= rate < 1.0:
        raise ctx.fail(f"attribute rate in [0, 1), not {rate}")
    return [TensorType(x.dtype, x.shape)]


def _dropout_vjp(ctx, grads):
    attrs = ctx.attrs
    return [ctx.b.dropout(grads[0], ctx.inputs[1], attrs["rate"], attrs["stream"]), None]


DROPOUT = define(
    "Dropout", _infer_dropout, _dropout, 2, "elementwise",
    "x with each element zeroed with probability attribute rate and the rest scaled by 1 / (1 - rate); "
    "the mask is RandomUniform of the element's index, the seed and attribute stream",
    attrs=[RATE, STREAM], vjp=_dropout_vjp, method="dropout",
)


@decomposition("Dropout", prefer=lambda op: True)
def _dropout_as_a_select(b, op):
    """The mask from the elements' positions: the row-major index as a column of row
    offsets plus a row of column indices, two small constants that broadcast (a counter
    of every element's would be as large as the tensor)."""
    x, seed = b.wrap(op.inputs[0]), b.wrap(op.inputs[1])
    attrs = DROPOUT.attrs_of(op)
    rate, stream = attrs["rate"], attrs["stream"]
    if rate == 0.0:
        return b.identity(x)
    width = x.shape[-1] if x.rank else 1
    rows = x.size // width if width else 0
    offsets = b.const((np.arange(rows, dtype=np.int64) * width).astype(np.int32).reshape(rows, 1))
    columns = b.const(np.arange(width, dtype=np.int32).reshape(1, width))
    counter = (offsets + columns).reshape(x.shape)
    kept = b.random_uniform(counter, seed, stream) >= rate
    scale = b.const(1.0 / (1.0 - rate), x.dtype)
    return b.select(kept, x * scale)

