"""Elementwise ops: unary math, binary arithmetic with numpy broadcasting, comparisons, logic.

Each op is one line of a table: its numpy reference (the oracle), the dtypes it takes,
its gradient and its formula. A gradient rule gets Tensors (x the input, y the output,
g the output's gradient) and builds the input's gradient with ordinary ops; a formula
gets a code generator's IR values and computes the result with the same vocabulary
(`x.exp()`, `x * y`, `c.where(x, y)`), so every backend can generate the op.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes
from .registry import Attr, TensorType, decomposition, define, zero_gradient
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


def _infer_unary(allowed):
    def infer(ctx):
        dtype = same_dtype(ctx, allowed, f"a dtype in ({', '.join(allowed)})")
        return [TensorType(dtype, ctx.inputs[0].shape)]

    return infer


def _unary_vjp(rule):
    """A VJP rule from `rule(x, y, g) -> dx`."""
    if rule is None:
        return zero_gradient
    return lambda ctx, grads: [rule(ctx.inputs[0], ctx.outputs[0], grads[0])]


def unary(type: str, reference, allowed, method, vjp, formula, doc: str = "", attrs=(), infer=None):
    """Define an elementwise op of one input; `vjp=None` declares a zero gradient."""
    takes_attrs = bool(attrs)
    return define(
        type,
        infer or _infer_unary(allowed),
        (lambda a, args, outs: [reference(args[0], **a.values())]) if takes_attrs else (lambda a, args, outs: [reference(args[0])]),
        1,
        "elementwise",
        doc,
        attrs=attrs,
        vjp=_unary_vjp(vjp) if not takes_attrs else vjp,
        formula=formula,
        method=method,
    )


def _sign_formula(x):
    """-1, 0 or 1 by the sign of x; NaN stays NaN (x ≠ x only for NaN)."""
    one, zero = x.constant(1), x.constant(0)
    signed = (x < 0).where(-one, (x > 0).where(one, zero))
    return x.not_equal(x).where(x, signed) if dtypes.is_float(x.dtype) else signed


def _softplus_formula(x):
    """max(x, 0) + log(1 + e) with e = exp(−|x|) ≤ 1, which never overflows; for tiny e,
    log(1 + e) ≈ e·(1 − e/2) keeps the relative accuracy 1 + e would round away."""
    e = (-x.abs()).exp()
    return x.maximum(0) + (e < 1e-4).where(e * (1.0 - 0.5 * e), (e + 1.0).log())


def _silu_vjp(x, y, g):
    s = x.sigmoid()
    return g * (s * (1.0 + x * (1.0 - s)))


unary("Neg", np.negative, NUMERIC, "neg", lambda x, y, g: -g, lambda x: -x)
unary("Abs", np.abs, NUMERIC, "abs", lambda x, y, g: g * x.sign(), lambda x: x.abs())
unary("Sign", _sign, NUMERIC, "sign", None, _sign_formula)
unary("Square", np.square, NUMERIC, "square", lambda x, y, g: g * (x * 2.0), lambda x: x * x)
# ReLU's gradient reads its output (y > 0 exactly where x > 0), which the layer after it
# keeps anyway, so x need not stay alive for the backward pass (and a batch norm before it
# can run the ReLU as it writes, its own output never stored)
unary("Relu", _relu, NUMERIC, "relu", lambda x, y, g: (y > 0.0).select(g), lambda x: (x < 0).where(0, x),
      "max(x, 0); NaN stays NaN, as np.maximum")
unary("Identity", lambda x: x, dtypes.ALL_DTYPES, "identity", lambda x, y, g: g, lambda x: x)
unary("Exp", np.exp, FLOATS, "exp", lambda x, y, g: g * y, lambda x: x.exp())
unary("Log", np.log, FLOATS, "log", lambda x, y, g: g / x, lambda x: x.log())
unary("Sqrt", np.sqrt, FLOATS, "sqrt", lambda x, y, g: g * 0.5 / y, lambda x: x.sqrt())
unary("Rsqrt", lambda x: 1.0 / np.sqrt(x), FLOATS, "rsqrt", lambda x, y, g: g * (y * y * y) * -0.5, lambda x: 1.0 / x.sqrt())
unary("Reciprocal", lambda x: 1.0 / x, FLOATS, ("rcp", "reciprocal"), lambda x, y, g: -(g * (y * y)), lambda x: 1.0 / x)
unary("Sin", np.sin, FLOATS, "sin", lambda x, y, g: g * x.cos(), lambda x: x.sin())
unary("Cos", np.cos, FLOATS, "cos", lambda x, y, g: -(g * x.sin()), lambda x: x.cos())
unary("Tanh", np.tanh, FLOATS, "tanh", lambda x, y, g: g * (1.0 - y * y), lambda x: x.tanh())
unary("Sigmoid", sigmoid, FLOATS, "sigmoid", lambda x, y, g: g * (y * (1.0 - y)), lambda x: x.sigmoid())
unary("Erf", erf, FLOATS, "erf", lambda x, y, g: g * ((-(x * x)).exp() * (2.0 / math.sqrt(math.pi))), lambda x: x.erf())

unary("Silu", lambda x: np.asarray(x, np.float64) * sigmoid(x), FLOATS, "silu", _silu_vjp, lambda x: x.silu(), "x · sigmoid(x)")
unary("Softplus", lambda x: np.logaddexp(0.0, np.asarray(x, np.float64)), FLOATS, "softplus",
      lambda x, y, g: g * x.sigmoid(), _softplus_formula, "log(1 + exp(x)), a smooth relu")
unary("Floor", np.floor, FLOATS, "floor", None, lambda x: x.floor())
unary("Ceil", np.ceil, FLOATS, "ceil", None, lambda x: x.ceil())
unary("Round", np.round, FLOATS, "round", None, lambda x: x.round(), "half to even, as numpy and llvm.roundeven")
unary("Not", np.logical_not, (dtypes.DT_BOOL,), "logical_not", None, lambda x: ~x)
unary("Trunc", np.trunc, FLOATS, "trunc", None, lambda x: x.trunc(), "toward zero")


# ---- Myelin's trigonometric and hyperbolic families ------------------------------------------------
# Definitions and gradients as Myelin's C++ compiler has them (express.h, gradients.cc);
# references in float64. acot(x) is pi/2 - atan(x), in (0, pi), as Myelin defines it.

def _f64(function):
    return lambda x: function(np.asarray(x, dtype=np.float64))


def _acot_formula(x):
    """pi/2 - atan(x), as atan(1/x) for x > 0, where the subtraction would cancel."""
    return (x > 0).where((1.0 / x).atan(), math.pi / 2 - x.atan())


def _beyond_one(x):
    """|x| · sqrt(x² − 1), the denominator of asec's and acsc's gradients."""
    return (x * x - 1.0).sqrt() * abs(x)


unary("Tan", _f64(np.tan), FLOATS, "tan", lambda x, y, g: g * (1.0 + y * y), lambda x: x.tan())
unary("Cot", _f64(lambda x: 1 / np.tan(x)), FLOATS, "cot", lambda x, y, g: -(g * (1.0 + y * y)), lambda x: x.cot(), "1 / tan(x)")
unary("Sec", _f64(lambda x: 1 / np.cos(x)), FLOATS, "sec", lambda x, y, g: g * x.tan() * y, lambda x: 1.0 / x.cos(), "1 / cos(x)")
unary("Csc", _f64(lambda x: 1 / np.sin(x)), FLOATS, "csc", lambda x, y, g: -(g * x.cot() * y), lambda x: 1.0 / x.sin(), "1 / sin(x)")
unary("Asin", _f64(np.arcsin), FLOATS, "asin", lambda x, y, g: g * (1.0 - x * x).rsqrt(), lambda x: x.asin())
unary("Acos", _f64(np.arccos), FLOATS, "acos", lambda x, y, g: -(g * (1.0 - x * x).rsqrt()), lambda x: x.acos())
unary("Atan", _f64(np.arctan), FLOATS, "atan", lambda x, y, g: g / (1.0 + x * x), lambda x: x.atan())
unary("Acot", _f64(lambda x: np.pi / 2 - np.arctan(x)), FLOATS, "acot", lambda x, y, g: -(g / (1.0 + x * x)), _acot_formula,
      "pi/2 - atan(x), in (0, pi)")
unary("Asec", _f64(lambda x: np.arccos(1 / x)), FLOATS, "asec", lambda x, y, g: g / _beyond_one(x), lambda x: x.asec(),
      "acos(1 / x)")
unary("Acsc", _f64(lambda x: np.arcsin(1 / x)), FLOATS, "acsc", lambda x, y, g: -(g / _beyond_one(x)), lambda x: x.acsc(),
      "asin(1 / x)")
unary("Sinh", _f64(np.sinh), FLOATS, "sinh", lambda x, y, g: g * x.cosh(), lambda x: x.sinh())
unary("Cosh", _f64(np.cosh), FLOATS, "cosh", lambda x, y, g: g * x.sinh(), lambda x: x.cosh())
unary("Coth", _f64(lambda x: 1 / np.tanh(x)), FLOATS, "coth", lambda x, y, g: g * (1.0 - y * y), lambda x: 1.0 / x.tanh(),
      "1 / tanh(x)")
unary("Sech", _f64(lambda x: 1 / np.cosh(x)), FLOATS, "sech", lambda x, y, g: -(g * x.tanh() * y), lambda x: x.sech(),
      "1 / cosh(x)")
unary("Csch", _f64(lambda x: 1 / np.sinh(x)), FLOATS, "csch", lambda x, y, g: -(g * x.coth() * y), lambda x: x.csch(),
      "1 / sinh(x)")
unary("Asinh", _f64(np.arcsinh), FLOATS, "asinh", lambda x, y, g: g * (x * x + 1.0).rsqrt(), lambda x: x.asinh())
unary("Acosh", _f64(np.arccosh), FLOATS, "acosh", lambda x, y, g: g * (x * x - 1.0).rsqrt(), lambda x: x.acosh())
unary("Atanh", _f64(np.arctanh), FLOATS, "atanh", lambda x, y, g: g / (1.0 - x * x), lambda x: x.atanh())
unary("Acoth", _f64(lambda x: np.arctanh(1 / x)), FLOATS, "acoth", lambda x, y, g: g / (1.0 - x * x), lambda x: x.acoth(),
      "atanh(1 / x)")
unary("Asech", _f64(lambda x: np.arccosh(1 / x)), FLOATS, "asech", lambda x, y, g: -(g / ((1.0 - x * x).sqrt() * x)),
      lambda x: x.asech(), "acosh(1 / x)")
unary("Acsch", _f64(lambda x: np.arcsinh(1 / x)), FLOATS, "acsch", lambda x, y, g: -(g / ((x * x + 1.0).sqrt() * abs(x))),
      lambda x: (1.0 / x).asinh(), "asinh(1 / x)")
unary("Softsign", _f64(lambda x: x / (1 + np.abs(x))), FLOATS, "softsign", lambda x, y, g: g / (1.0 + abs(x)).square(),
      lambda x: x / (1.0 + x.abs()), "x / (1 + |x|)")
unary("LogSigmoid", _f64(lambda x: -np.logaddexp(0.0, -x)), FLOATS, "log_sigmoid", lambda x, y, g: g * (-x).sigmoid(),
      lambda x: -_softplus_formula(-x), "log(sigmoid(x)) = -softplus(-x)")


# ---- GELU -----------------------------------------------------------------------------------------

APPROXIMATE = Attr("approximate", "str", "none", "'none' for the exact erf form, 'tanh' for the tanh form")


def _infer_gelu(ctx):
    if ctx.attrs["approximate"] not in ("none", "tanh"):
        raise ctx.fail("attribute approximate to be 'none' (erf form) or 'tanh'")
    dtype = same_dtype(ctx, FLOATS, "a floating-point input")
    return [TensorType(dtype, ctx.inputs[0].shape)]


def gelu_gate(x, approximate: str):
    """GELU's gate Φ (gelu(x) = x·Φ(x)) and, for the tanh form, its tanh, or for the erf
    form the erf's argument u = x/√2. The gradient and the training-step decomposition both
    build them here, op for op, so the compiler's CSE computes the erf (or tanh) once for
    the forward and the backward pass."""
    if approximate == "tanh":
        t = ((x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)).tanh()
        return 0.5 * (1.0 + t), t
    u = x * (1.0 / math.sqrt(2.0))
    return 0.5 * (1.0 + u.erf()), u


def _gelu_vjp(ctx, grads):
    (x,) = ctx.inputs
    approximate = ctx.attrs["approximate"]
    gate, inner = gelu_gate(x, approximate)
    if approximate == "tanh":
        dinner = (1.0 + x * x * (3 * 0.044715)) * math.sqrt(2.0 / math.pi)
        return [grads[0] * (gate + x * 0.5 * (1.0 - inner * inner) * dinner)]
    # the density φ(x) = exp(-u²)/√(2π): the float32 erf of u computes exp(-u²) too, so the
    # CPU's program computes it once for both
    pdf = (-(inner * inner)).exp() * (1.0 / math.sqrt(2.0 * math.pi))
    return [grads[0] * (gate + x * pdf)]


GELU = unary(
    "Gelu", lambda x, approximate: gelu_tanh(x) if approximate == "tanh" else gelu_erf(x), FLOATS, "gelu", _gelu_vjp,
    lambda x, approximate: x.gelu(approximate), "GELU; attribute approximate='tanh' selects the tanh form",
    attrs=[APPROXIMATE], infer=_infer_gelu,
)


@decomposition("Gelu", prefer=lambda op: op.func is not None and op.func.training)
def _gelu_from_its_gate(b, op):
    """In a training step, x·Φ(x) from the primitives the gradient builds Φ from, so the
    erf (or tanh) is computed once for both passes. Inference keeps the whole op, whose
    negative tail keeps its relative accuracy (1 + erf cancels there)."""
    x = b.wrap(op.inputs[0])
    gate, _ = gelu_gate(x, GELU.attrs_of(op)["approximate"])
    return x * gate


# ---- Cast -----------------------------------------------------------------------------------------

def _infer_cast(ctx):
    target = ctx.attrs.str("dtype")
    if target not in dtypes.ALL_DTYPES:
        raise ctx.fail(f"attribute dtype naming one of {', '.join(dtypes.ALL_DTYPES)}")
    return [TensorType(target, ctx.inputs[0].shape)]


define(
    "Cast", _infer_cast, lambda attrs, args, outs: [args[0].astype(dtypes.to_numpy(outs[0].dtype))], 1, "elementwise",
    "x converted to attribute dtype, as numpy's astype",
    attrs=[Attr("dtype", "str", None, "the target dtype")],
    vjp=lambda ctx, grads: [grads[0].cast(ctx.inputs[0].dtype)],
    formula=lambda x, dtype: x.cast(dtype),
    method="cast",
    build=lambda b, x, dtype, name=None: b.op("Cast", [x], name, {"dtype": dtypes.normalize(dtype)}),
)


def _infer_bitcast(ctx):
    """A dtype of the input's width; float16 and bfloat16, which kernels hold in float32,
    and bool targets (whose other bit patterns numpy has no value for) are refused."""
    source, target = ctx.inputs[0].dtype, ctx.attrs.str("dtype")
    halves, allowed = (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16), [d for d in dtypes.ALL_DTYPES if d != dtypes.DT_BOOL]
    if target not in allowed or source in halves or target in halves or \
            dtypes.itemsize(source) != dtypes.itemsize(target):
        raise ctx.fail("an input and attribute dtype of one width, neither float16 nor bfloat16, the dtype not bool")
    return [TensorType(target, ctx.inputs[0].shape)]


define(
    "Bitcast", _infer_bitcast,
    lambda attrs, args, outs: [np.ascontiguousarray(args[0]).view(dtypes.to_numpy(outs[0].dtype))], 1, "elementwise",
    "x's bits read as attribute dtype (of the same width), as numpy's view",
    attrs=[Attr("dtype", "str", None, "the target dtype")],
    vjp=zero_gradient,
    # A bool is held as the one-byte 0 or 1 its view reads, where kernels compute it as a 1-bit value.
    formula=lambda x, dtype: x.cast(dtype) if x.dtype == dtypes.DT_BOOL else x.bitcast(dtype),
    method="bitcast",
    build=lambda b, x, dtype, name=None: b.op("Bitcast", [x], name, {"dtype": dtypes.normalize(dtype)}),
)


# ---- binary -----------------------------------------------------------------------------------------

def _int_div(a, b):
    """Integer division truncating toward zero, as C and LLVM's sdiv/udiv do."""
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(a.dtype)


def _div(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return _int_div(a, b)
    return a / b


def _infer_binary(allowed, result_dtype):
    def infer(ctx):
        dtype = same_dtype(ctx, allowed, f"both inputs of one dtype in ({', '.join(allowed)})")
        shape = broadcast_shapes(ctx, [v.shape for v in ctx.inputs])
        return [TensorType(result_dtype or dtype, shape)]

    return infer


def _binary_vjp(rule):
    """A VJP rule from `rule(a, b, y, g) -> (da, db)`; broadcast gradients are summed back."""
    if rule is None:
        return zero_gradient

    def vjp_rule(ctx, grads):
        a, b = ctx.inputs
        da, db = rule(a, b, ctx.outputs[0], grads[0])
        return [ctx.unbroadcast(da, a), ctx.unbroadcast(db, b)]

    return vjp_rule


def binary(type: str, reference, allowed, result_dtype, method, vjp, formula, doc: str = ""):
    """Define an elementwise op of two inputs (numpy broadcasting); `vjp=None`: zero gradient."""
    return define(
        type, _infer_binary(allowed, result_dtype), lambda attrs, args, outs: [reference(*args)], 2, "elementwise", doc,
        vjp=_binary_vjp(vjp), formula=formula, method=method,
    )


def _pow_formula(x, y):
    """x**y as exp(y·log|x|), with numpy's sign for negative x and integral y (NaN
    otherwise); x**0 is 1 for every x, NaN included; 0**y is 0 for y > 0 and inf for
    y < 0, through log(0) = -inf."""
    magnitude = (y * x.abs().log()).exp()
    integral = y.floor().equal(y)
    half = y * 0.5
    odd = half.floor().not_equal(half)
    signed = odd.where(-magnitude, magnitude)
    result = (x < 0).where(integral.where(signed, math.nan), magnitude)
    return y.equal(0).where(1, result)


def _pow_vjp(a, c, y, g):
    lower = c - 1.0
    if c.var.data is not None and c.var.size == 1:  # a constant one, as x³'s 3x² (products: see _power_as_products)
        lower = c.builder.const(float(np.asarray(c.var.data).reshape(-1)[0]) - 1.0, c.dtype)
    return g * c * a.pow(lower), g * y * a.log()


def _remainder(function):
    """np.fmod or np.mod, silent where numpy warns: an integer x % 0 is 0 there too."""

    def reference(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            return function(a, b)

    return reference


def _mod_formula(x, y):
    """fmod(x, y), moved by y where its sign differs from y's (as numpy's npy_divmod does)."""
    r = x.fmod(y)
    return (r.not_equal(0) & ((r < 0) ^ (y < 0))).where(r + y, r)


def _remainder_vjp(a, c, y, g):
    """y = a − q·c for the whole quotient q (truncated or floored): dy/da = 1, dy/dc = −q,
    and q = (a − y)/c up to rounding, which round() takes away."""
    return g, -(g * ((a - y) / c).round())


def _div_vjp(a, c, y, g):
    ga = g / c
    return ga, -(ga * y)


def _extreme_vjp(first_wins):
    def rule(a, c, y, g):
        take_a = first_wins(a, c)
        return take_a.select(g), (~take_a).select(g)

    return rule


binary("Add", np.add, NUMERIC, None, "add", lambda a, c, y, g: (g, g), lambda x, y: x + y)
binary("Sub", np.subtract, NUMERIC, None, "sub", lambda a, c, y, g: (g, -g), lambda x, y: x - y)
binary("Mul", np.multiply, NUMERIC, None, "mul", lambda a, c, y, g: (g * c, g * a), lambda x, y: x * y)
binary("Div", _div, NUMERIC, None, "div", _div_vjp, lambda x, y: x / y,
       "a / b; integers truncate toward zero (x / 0 is 0)")
binary("Pow", np.power, FLOATS, None, "pow", _pow_vjp, _pow_formula)
binary("FMod", _remainder(np.fmod), NUMERIC, None, "fmod", _remainder_vjp, lambda x, y: x.fmod(y),
       "the remainder of a / b truncated toward zero, of a's sign (C's fmod); an integer x % 0 is 0")
binary("Mod", _remainder(np.mod), NUMERIC, None, "mod", _remainder_vjp, _mod_formula,
       "the remainder of a / b floored, of b's sign (Python's %, np.mod); an integer x % 0 is 0")
binary("Minimum", np.minimum, NUMERIC, None, "minimum", _extreme_vjp(lambda a, c: a <= c), lambda x, y: x.minimum(y),
       "NaN propagates, as np.minimum")
binary("Maximum", np.maximum, NUMERIC, None, "maximum", _extreme_vjp(lambda a, c: a >= c), lambda x, y: x.maximum(y),
       "NaN propagates, as np.maximum")
binary("Equal", np.equal, dtypes.ALL_DTYPES, dtypes.DT_BOOL, "equal", None, lambda x, y: x.equal(y))
binary("NotEqual", np.not_equal, dtypes.ALL_DTYPES, dtypes.DT_BOOL, "not_equal", None, lambda x, y: x.not_equal(y))
binary("Less", np.less, NUMERIC, dtypes.DT_BOOL, "less", None, lambda x, y: x < y)
binary("LessEqual", np.less_equal, NUMERIC, dtypes.DT_BOOL, "less_equal", None, lambda x, y: x <= y)
binary("Greater", np.greater, NUMERIC, dtypes.DT_BOOL, "greater", None, lambda x, y: x > y)
binary("GreaterEqual", np.greater_equal, NUMERIC, dtypes.DT_BOOL, "greater_equal", None, lambda x, y: x >= y)
binary("And", np.logical_and, (dtypes.DT_BOOL,), dtypes.DT_BOOL, "logical_and", None, lambda x, y: x & y)
binary("Or", np.logical_or, (dtypes.DT_BOOL,), dtypes.DT_BOOL, "logical_or", None, lambda x, y: x | y)
binary("Xor", np.logical_xor, (dtypes.DT_BOOL,), dtypes.DT_BOOL, "logical_xor", None, lambda x, y: x ^ y)
binary("AndNot", lambda a, b: np.logical_and(np.logical_not(a), b), (dtypes.DT_BOOL,), dtypes.DT_BOOL, "logical_and_not", None,
       lambda x, y: ~x & y, "(not a) and b, as Myelin's AndNot")


def _small_power(op: Any) -> int | None:
    """The exponent of Pow(x, n) where n is a constant 2 or 3 and x has the result's shape."""
    exponent = op.inputs[1]
    if exponent.data is None or exponent.size != 1 or list(op.inputs[0].shape) != list(op.outputs[0].shape):
        return None
    value = float(np.asarray(exponent.data).reshape(-1)[0])
    return int(value) if value in (2.0, 3.0) else None


@decomposition("Pow", prefer=lambda op: _small_power(op) is not None)
def _power_as_products(b: Any, op: Any) -> Any:
    """x² and x³ (the tanh GELU's cube, its gradient's square) as products, as PyTorch
    computes them: exp(n·log|x|) costs two transcendentals an element and rounds worse."""
    n = _small_power(op)
    if n is None:
        return None
    x = b.wrap(op.inputs[0])
    return x * x if n == 2 else x * x * x


# ---- bitwise ops of integers --------------------------------------------------------------------------


def _shift_reference(left: bool):
    """ONNX's BitShift: a shift amount outside [0, width) shifts every bit out, leaving 0
    (or, shifting a negative number right, -1); left shifts wrap as two's complement."""

    def reference(a, b):
        a, b = np.broadcast_arrays(a, b)
        width = a.dtype.itemsize * 8
        inside = (b >= 0) & (b < width)
        amount = np.where(inside, b, 0).astype(a.dtype)
        if left:
            unsigned = np.dtype(f"u{a.dtype.itemsize}")
            return np.where(inside, np.left_shift(a.view(unsigned), amount.view(unsigned)).view(a.dtype), a.dtype.type(0))
        shifted_out = np.where(a < 0, a.dtype.type(-1), a.dtype.type(0)) if a.dtype.kind == "i" else np.zeros_like(a)
        return np.where(inside, np.right_shift(a, amount), shifted_out)

    return reference


binary("BitwiseAnd", np.bitwise_and, dtypes.INT_DTYPES, None, "bitwise_and", None, lambda x, y: x & y, "the bits set in both")
binary("BitwiseOr", np.bitwise_or, dtypes.INT_DTYPES, None, "bitwise_or", None, lambda x, y: x | y, "the bits set in either")
binary("BitwiseXor", np.bitwise_xor, dtypes.INT_DTYPES, None, "bitwise_xor", None, lambda x, y: x ^ y, "the bits set in one only")
unary("BitwiseNot", np.invert, dtypes.INT_DTYPES, "bitwise_not", None, lambda x: ~x, "every bit flipped")
binary("ShiftLeft", _shift_reference(True), dtypes.INT_DTYPES, None, "shift_left", None, lambda x, y: x.shift_left(y),
       "a's bits moved up by b, wrapping; b outside [0, width) gives 0")
binary("ShiftRight", _shift_reference(False), dtypes.INT_DTYPES, None, "shift_right", None, lambda x, y: x.shift_right(y),
       "a's bits moved down by b, the sign copied in for signed dtypes; b outside [0, width) shifts every bit out")


# ---- Cond and Select ------------------------------------------------------------------------------------

def _infer_cond(ctx):
    cond, x, y = ctx.inputs
    if cond.dtype != dtypes.DT_BOOL or x.dtype != y.dtype:
        raise ctx.fail("a bool condition and two values of one dtype")
    return [TensorType(x.dtype, broadcast_shapes(ctx, [cond.shape, x.shape, y.shape]))]


def _cond_vjp(ctx, grads):
    c, x, y = ctx.inputs
    g = grads[0]
    return [None, ctx.unbroadcast(c.select(g), x), ctx.unbroadcast((~c).select(g), y)]


def _build_cond(b, c, x, y, name=None):
    """c ? x : y (Myelin's Cond); a Python number takes the dtype of the other value."""
    return b.op("Cond", [c, *b.operands([x, y])], name)


define(
    "Cond", _infer_cond, lambda attrs, args, outs: [np.where(*args)], 3, "elementwise", "c ? x : y",
    vjp=_cond_vjp, formula=lambda c, x, y: c.where(x, y), method=("cond", "where"), build=_build_cond,
)


def _infer_select(ctx):
    cond, x = ctx.inputs
    if cond.dtype != dtypes.DT_BOOL:
        raise ctx.fail("a bool condition and a value")
    return [TensorType(x.dtype, broadcast_shapes(ctx, [cond.shape, x.shape]))]


def _build_select(b, c, x, name=None):
    """c ? x : 0 (Myelin's Select); a Python number keeps its own dtype (the bool
    condition is no model for it)."""
    return b.op("Select", [c, b.operand(x)], name)


define(
    "Select",
    _infer_select,
    lambda attrs, args, outs: [np.where(args[0], args[1], np.zeros((), args[1].dtype))],
    2,
    "elementwise",
    "c ? x : 0",
    vjp=lambda ctx, grads: [None, ctx.unbroadcast(ctx.inputs[0].select(grads[0]), ctx.inputs[1])],
    formula=lambda c, x: c.where(x, 0),
    method="select",
    build=_build_select,
)
