"""Elementwise ops: unary math, binary arithmetic with numpy broadcasting, comparisons, logic."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from .registry import TensorType, define
from .rules import FLOATS, NUMERIC, broadcast_shapes, same_dtype

_erf = np.vectorize(math.erf, otypes=[np.float64])


def erf(x: np.ndarray) -> np.ndarray:
    """Error function in float64 (numpy has none); the oracle for every erf kernel."""
    return _erf(np.asarray(x, dtype=np.float64)) if np.size(x) else np.zeros(np.shape(x))


def gelu_erf(x):
    x64 = np.asarray(x, dtype=np.float64)
    return 0.5 * x64 * (1.0 + erf(x64 / math.sqrt(2.0)))


def gelu_tanh(x):
    x64 = np.asarray(x, dtype=np.float64)
    return 0.5 * x64 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)))


def sigmoid(x):
    x64 = np.asarray(x, dtype=np.float64)
    return np.exp(-np.logaddexp(0.0, -x64))


def _sign(x):
    return np.sign(x).astype(x.dtype)


def _relu(x):
    return np.maximum(x, np.zeros((), x.dtype))


def _unary(fn):
    return lambda attrs, args, outs: [fn(args[0])]


# type: (numpy function, dtypes accepted, description of what is accepted)
UNARY = {
    "Neg": (np.negative, NUMERIC),
    "Abs": (np.abs, NUMERIC),
    "Sign": (_sign, NUMERIC),
    "Square": (np.square, NUMERIC),
    "Relu": (_relu, NUMERIC),
    "Identity": (lambda x: x, dtypes.ALL_DTYPES),
    "Exp": (np.exp, FLOATS),
    "Log": (np.log, FLOATS),
    "Sqrt": (np.sqrt, FLOATS),
    "Rsqrt": (lambda x: 1.0 / np.sqrt(x), FLOATS),
    "Reciprocal": (lambda x: 1.0 / x, FLOATS),
    "Sin": (np.sin, FLOATS),
    "Cos": (np.cos, FLOATS),
    "Tanh": (np.tanh, FLOATS),
    "Sigmoid": (sigmoid, FLOATS),
    "Erf": (erf, FLOATS),
    "Silu": (lambda x: np.asarray(x, np.float64) * sigmoid(x), FLOATS),
    "Floor": (np.floor, FLOATS),
    "Ceil": (np.ceil, FLOATS),
    "Round": (np.round, FLOATS),  # half to even, as numpy and llvm.roundeven
    "Not": (np.logical_not, (dtypes.DT_BOOL,)),
}


def _infer_unary(allowed):
    def infer(ctx):
        dtype = same_dtype(ctx, allowed, f"a dtype in ({', '.join(allowed)})")
        return [TensorType(dtype, ctx.inputs[0].shape)]

    return infer


for _type, (_fn, _allowed) in UNARY.items():
    define(_type, _infer_unary(_allowed), _unary(_fn), 1, "elementwise")


def _infer_gelu(ctx):
    approximate = ctx.attrs.str("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ctx.fail("attribute approximate to be 'none' (erf form) or 'tanh'")
    dtype = same_dtype(ctx, FLOATS, "a floating-point input")
    return [TensorType(dtype, ctx.inputs[0].shape)]


def _gelu(attrs, args, outs):
    return [gelu_tanh(args[0]) if attrs.str("approximate", "none") == "tanh" else gelu_erf(args[0])]


define("Gelu", _infer_gelu, _gelu, 1, "elementwise", "GELU; attribute approximate='tanh' selects the tanh form")


def gelu_gate(b, x, approximate: str):
    """GELU's gate Φ (gelu(x) = x·Φ(x)) and, for the tanh form, its tanh, as ops of
    builder b. The gradient rule and the CPU decomposition both build them here, op for
    op, so the compiler's CSE computes the erf (or tanh) once for the forward and the
    backward pass."""
    if approximate == "tanh":
        t = b.tanh((x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi))
        return 0.5 * (1.0 + t), t
    return 0.5 * (1.0 + b.erf(x * (1.0 / math.sqrt(2.0)))), None


def _infer_cast(ctx):
    target = ctx.attrs.str("dtype")
    if target not in dtypes.ALL_DTYPES:
        raise ctx.fail(f"attribute dtype naming one of {', '.join(dtypes.ALL_DTYPES)}")
    return [TensorType(target, ctx.inputs[0].shape)]


define("Cast", _infer_cast, lambda attrs, args, outs: [args[0].astype(dtypes.to_numpy(outs[0].dtype))], 1, "elementwise")


def _int_div(a, b):
    """Integer division truncating toward zero, as C and LLVM's sdiv/udiv do."""
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(a.dtype)


def _div(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return _int_div(a, b)
    return a / b


def _pow(a, b):
    return np.power(a, b)


BINARY = {
    "Add": (np.add, NUMERIC, None),
    "Sub": (np.subtract, NUMERIC, None),
    "Mul": (np.multiply, NUMERIC, None),
    "Div": (_div, NUMERIC, None),
    "Pow": (_pow, FLOATS, None),
    "Minimum": (np.minimum, NUMERIC, None),
    "Maximum": (np.maximum, NUMERIC, None),
    "Equal": (np.equal, dtypes.ALL_DTYPES, dtypes.DT_BOOL),
    "NotEqual": (np.not_equal, dtypes.ALL_DTYPES, dtypes.DT_BOOL),
    "Less": (np.less, NUMERIC, dtypes.DT_BOOL),
    "LessEqual": (np.less_equal, NUMERIC, dtypes.DT_BOOL),
    "Greater": (np.greater, NUMERIC, dtypes.DT_BOOL),
    "GreaterEqual": (np.greater_equal, NUMERIC, dtypes.DT_BOOL),
    "And": (np.logical_and, (dtypes.DT_BOOL,), dtypes.DT_BOOL),
    "Or": (np.logical_or, (dtypes.DT_BOOL,), dtypes.DT_BOOL),
    "Xor": (np.logical_xor, (dtypes.DT_BOOL,), dtypes.DT_BOOL),
}


def _infer_binary(allowed, result_dtype):
    def infer(ctx):
        dtype = same_dtype(ctx, allowed, f"both inputs of one dtype in ({', '.join(allowed)})")
        shape = broadcast_shapes(ctx, [v.shape for v in ctx.inputs])
        return [TensorType(result_dtype or dtype, shape)]

    return infer


for _type, (_fn, _allowed, _result) in BINARY.items():
    define(_type, _infer_binary(_allowed, _result), (lambda fn: lambda attrs, args, outs: [fn(*args)])(_fn), 2, "elementwise")


def _infer_cond(ctx):
    cond, x, y = ctx.inputs
    if cond.dtype != dtypes.DT_BOOL or x.dtype != y.dtype:
        raise ctx.fail("a bool condition and two values of one dtype")
    return [TensorType(x.dtype, broadcast_shapes(ctx, [cond.shape, x.shape, y.shape]))]


define("Cond", _infer_cond, lambda attrs, args, outs: [np.where(*args)], 3, "elementwise", "c ? x : y")


def _infer_select(ctx):
    cond, x = ctx.inputs
    if cond.dtype != dtypes.DT_BOOL:
        raise ctx.fail("a bool condition and a value")
    return [TensorType(x.dtype, broadcast_shapes(ctx, [cond.shape, x.shape]))]


define(
    "Select",
    _infer_select,
    lambda attrs, args, outs: [np.where(args[0], args[1], np.zeros((), args[1].dtype))],
    2,
    "elementwise",
    "c ? x : 0",
)
