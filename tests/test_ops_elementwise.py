"""Elementwise ops: unary math, Gelu, Cast, binary arithmetic, comparisons, logic, Cond/Select,
and the Python operators of Tensor handles. Expectations are computed here, in float64,
independently of the ops' own numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (
    ALL,
    FLOATS,
    INTS,
    NUMERIC,
    SIGNED_INTS,
    UNSIGNED_INTS,
    as_f64,
    assert_mentions,
    check,
    np_dtype,
    random_array,
    run1,
    run_flow,
    shape_error,
)

import ranvier

pytestmark = pytest.mark.filterwarnings("error")

TESTED_OPS = {
    "Neg", "Abs", "Sign", "Square", "Relu", "Identity", "Exp", "Log", "Sqrt", "Rsqrt", "Reciprocal",
    "Sin", "Cos", "Tanh", "Sigmoid", "Erf", "Silu", "Softplus", "Floor", "Ceil", "Round", "Not", "Gelu", "Cast",
    "Add", "Sub", "Mul", "Div", "Pow", "Minimum", "Maximum", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "And", "Or", "Xor", "Cond", "Select",
    "Trunc", "Tan", "Cot", "Sec", "Csc", "Asin", "Acos", "Atan", "Acot", "Asec", "Acsc", "Sinh", "Cosh", "Coth", "Sech",
    "Csch", "Asinh", "Acosh", "Atanh", "Acoth", "Asech", "Acsch", "Softsign", "LogSigmoid", "AndNot", "FMod", "Mod",
    "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "ShiftLeft", "ShiftRight", "Bitcast",
}

try:  # scipy is an independent erf; math.erf is the fallback
    from scipy.special import erf as _scipy_erf

    def erf64(x):
        return _scipy_erf(as_f64(x))
except ImportError:  # pragma: no cover
    def erf64(x):
        return np.vectorize(math.erf, otypes=[np.float64])(as_f64(x))


def wrap(values: np.ndarray, dtype: str) -> np.ndarray:
    """Python-integer results reduced into a dtype's range, as two's complement hardware does."""
    info = np.iinfo(np_dtype(dtype))
    span = int(info.max) - int(info.min) + 1
    v = np.asarray(values, dtype=object)
    wrapped = np.vectorize(lambda e: (int(e) - int(info.min)) % span + int(info.min), otypes=[object])(v)
    return wrapped.astype(np_dtype(dtype))  # object to the dtype itself: uint64's range passes int64's


def ints_of(a) -> np.ndarray:
    return np.asarray(a).astype(np.int64)


# ---- unary ops -----------------------------------------------------------------------------


def _sign(x):
    return np.where(x > 0, 1, np.where(x < 0, -1, 0))


def _round_half_even(x):
    return np.vectorize(lambda v: float(round(v)), otypes=[np.float64])(x)


# op: (builder method, expected(x as float64 / int64), dtypes, (low, high) input range)
UNARY = {
    "Neg": ("neg", lambda x: -x, NUMERIC, (-9, 9)),
    "Abs": ("abs", np.abs, NUMERIC, (-9, 9)),
    "Sign": ("sign", _sign, NUMERIC, (-9, 9)),
    "Square": ("square", lambda x: x * x, NUMERIC, (-9, 9)),
    "Relu": ("relu", lambda x: np.where(x > 0, x, 0), NUMERIC, (-9, 9)),
    "Identity": ("identity", lambda x: x, ALL, (-9, 9)),
    "Exp": ("exp", lambda x: np.array([math.exp(v) for v in x.reshape(-1)]).reshape(x.shape), FLOATS, (-4, 4)),
    "Log": ("log", lambda x: np.array([math.log(v) for v in x.reshape(-1)]).reshape(x.shape), FLOATS, (0.05, 9)),
    "Sqrt": ("sqrt", lambda x: x**0.5, FLOATS, (0.01, 9)),
    "Rsqrt": ("rsqrt", lambda x: x**-0.5, FLOATS, (0.05, 9)),
    "Reciprocal": ("rcp", lambda x: 1.0 / x, FLOATS, (-9, 9)),
    "Sin": ("sin", lambda x: np.vectorize(math.sin)(x), FLOATS, (-6, 6)),
    "Cos": ("cos", lambda x: np.vectorize(math.cos)(x), FLOATS, (-6, 6)),
    "Tanh": ("tanh", lambda x: (np.exp(2 * x) - 1) / (np.exp(2 * x) + 1), FLOATS, (-5, 5)),
    "Sigmoid": ("sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x)), FLOATS, (-8, 8)),
    "Erf": ("erf", erf64, FLOATS, (-3, 3)),
    "Silu": ("silu", lambda x: x / (1.0 + np.exp(-x)), FLOATS, (-8, 8)),
    "Floor": ("floor", lambda x: np.vectorize(math.floor, otypes=[np.float64])(x), FLOATS, (-9, 9)),
    "Ceil": ("ceil", lambda x: np.vectorize(math.ceil, otypes=[np.float64])(x), FLOATS, (-9, 9)),
    "Round": ("round", _round_half_even, FLOATS, (-9, 9)),
    "Softplus": ("softplus", lambda x: np.vectorize(lambda v: math.log1p(math.exp(-abs(v))) + max(v, 0.0))(x), FLOATS, (-30, 30)),
    "Trunc": ("trunc", lambda x: np.vectorize(math.trunc, otypes=[np.float64])(x), FLOATS, (-9, 9)),
}


def _by_math(function):
    """A unary expectation from Python's math module, element by element."""
    return lambda x: np.vectorize(function, otypes=[np.float64])(x)


# Myelin's trigonometric and hyperbolic families, as Myelin's C++ defines them, over ranges like
# its opcheck's (each function's whole domain where that is bounded).
UNARY |= {
    "Tan": ("tan", _by_math(math.tan), FLOATS, (-1.5, 1.5)),
    "Cot": ("cot", _by_math(lambda v: 1 / math.tan(v)), FLOATS, (-3, 3)),
    "Sec": ("sec", _by_math(lambda v: 1 / math.cos(v)), FLOATS, (-1.5, 1.5)),
    "Csc": ("csc", _by_math(lambda v: 1 / math.sin(v)), FLOATS, (-3, 3)),
    "Asin": ("asin", _by_math(math.asin), FLOATS, (-1, 1)),
    "Acos": ("acos", _by_math(math.acos), FLOATS, (-1, 1)),
    "Atan": ("atan", _by_math(math.atan), FLOATS, (-10, 10)),
    "Acot": ("acot", _by_math(lambda v: math.pi / 2 - math.atan(v)), FLOATS, (-10, 10)),
    "Sinh": ("sinh", _by_math(math.sinh), FLOATS, (-10, 10)),
    "Cosh": ("cosh", _by_math(math.cosh), FLOATS, (-10, 10)),
    "Coth": ("coth", _by_math(lambda v: 1 / math.tanh(v)), FLOATS, (-5, 5)),
    "Sech": ("sech", _by_math(lambda v: 1 / math.cosh(v)), FLOATS, (-10, 10)),
    "Csch": ("csch", _by_math(lambda v: 1 / math.sinh(v)), FLOATS, (-5, 5)),
    "Asinh": ("asinh", _by_math(math.asinh), FLOATS, (-10, 10)),
    "Atanh": ("atanh", _by_math(math.atanh), FLOATS, (-0.99, 0.99)),
    "Asech": ("asech", _by_math(lambda v: math.acosh(1 / v)), FLOATS, (0.01, 1)),
    "Acsch": ("acsch", _by_math(lambda v: math.asinh(1 / v)), FLOATS, (-5, 5)),
    "Softsign": ("softsign", lambda x: x / (1 + np.abs(x)), FLOATS, (-10, 10)),
    "LogSigmoid": ("log_sigmoid", _by_math(lambda v: -(math.log1p(math.exp(-abs(v))) + max(-v, 0.0))), FLOATS, (-30, 30)),
}
# Defined for x >= 1 (Acosh) or |x| >= 1: drawn from [1, 10] with random signs where both are allowed.
BEYOND_ONE = {
    "Acosh": ("acosh", _by_math(math.acosh), False),
    "Asec": ("asec", _by_math(lambda v: math.acos(1 / v)), True),
    "Acsc": ("acsc", _by_math(lambda v: math.asin(1 / v)), True),
    "Acoth": ("acoth", _by_math(lambda v: math.atanh(1 / v)), True),
}

UNARY_CASES = [(op, dt) for op, (_, _, allowed, _) in UNARY.items() for dt in allowed]


def _unary_input(op, dtype, shape, seed=1):
    _, _, _, (low, high) = UNARY[op]
    if dtype in UNSIGNED_INTS:
        low = 1
    x = random_array(shape, dtype, seed=seed, low=low, high=high)
    if op == "Round" and x.size >= 8:
        # Exact halves: numpy, LLVM's roundeven and Python all round them to even.
        flat = x.reshape(-1)
        flat[:8] = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -3.5]).astype(flat.dtype)
    return x


@pytest.mark.parametrize("op,dtype", UNARY_CASES, ids=[f"{o}-{d}" for o, d in UNARY_CASES])
def test_unary(op, dtype):
    method, expected_fn, _, _ = UNARY[op]
    x = _unary_input(op, dtype, (7, 13))
    out = run1(lambda f, a: getattr(f, method)(a), x)
    if dtype in INTS:
        check(out, wrap(expected_fn(ints_of(x)), dtype), dtype)
    elif dtype == "bool":
        check(out, x, dtype)
    else:
        check(out, expected_fn(as_f64(x)), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", list(BEYOND_ONE))
def test_unary_beyond_one(op, dtype):
    method, expected_fn, both_signs = BEYOND_ONE[op]
    x = random_array((7, 13), dtype, seed=4, low=1, high=10)
    if both_signs:
        x = x * np.where(random_array((7, 13), "bool", seed=5), 1, -1).astype(x.dtype)
    check(run1(lambda f, a: getattr(f, method)(a), x), expected_fn(as_f64(x)), dtype)


def test_myelin_functions_at_the_edges_of_their_domains():
    """Where the values hang on 1 - |x| or |x| - 1, or come near a pole or an overflow."""
    near_one = np.array([1.0, 1.0 + 2**-20, 1.0 + 1e-3, 2.0, 1e30], np.float64)
    inside = np.array([0.0, 1e-30, 1e-3, 0.5, 1.0 - 2**-40, 1.0], np.float64)
    cases = [
        ("acosh", near_one, np.arccosh), ("asec", near_one, lambda v: np.arccos(1 / v)),
        ("acsc", -near_one, lambda v: np.arcsin(1 / v)), ("asin", -inside, np.arcsin), ("acos", inside, np.arccos),
        ("atanh", inside[:-1], np.arctanh), ("asech", inside[1:], lambda v: np.arccosh(1 / v)),
        ("acoth", near_one[1:], lambda v: np.arctanh(1 / v)), ("sinh", np.array([1e-20, 0.3, 700.0]), np.sinh),
        ("sech", np.array([1e-20, 30.0, 700.0]), lambda v: 1 / np.cosh(v)), ("tan", np.array([1.5707963267948966]), np.tan),
        ("acot", np.array([-1e30, -1.0, 0.0, 1e-3, 1e30]), lambda v: np.pi / 2 - np.arctan(v)),
    ]
    for method, x, expected in cases:
        check(run1(lambda f, a, method=method: getattr(f, method)(a), x), expected(x), "float64", rtol=1e-14, atol=0)


def test_trunc_rounds_toward_zero():
    x = np.array([-2.7, -2.5, -0.5, -0.0, 0.5, 2.5, 2.7, 1e20], np.float32)
    check(run1(lambda f, a: f.trunc(a), x), np.array([-2, -2, 0, 0, 0, 2, 2, np.float32(1e20)]), "float32", rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (33,), (2, 3, 5), (1, 1, 13)])
@pytest.mark.parametrize("op", ["Exp", "Tanh", "Relu", "Neg", "Round"])
def test_unary_shapes(op, shape):
    method, expected_fn, _, _ = UNARY[op]
    x = _unary_input(op, "float32", shape, seed=5)
    out = run1(lambda f, a: getattr(f, method)(a), x)
    check(out, expected_fn(as_f64(x)), "float32")


def test_unary_unsigned_negation_wraps():
    x = np.array([1, 2, 200, 255], np.uint8)
    check(run1(lambda f, a: -a, x), np.array([255, 254, 56, 1]), "uint8")


def test_sign_of_zero_and_round_edge_values():
    x = np.array([0.0, -0.0, 1e-30, -1e-30, 0.49999997, -0.49999997, 1e20], np.float32)
    check(run1(lambda f, a: f.sign(a), x), np.array([0, 0, 1, -1, 1, -1, 1]), "float32")
    check(run1(lambda f, a: f.round(a), x), np.array([0, 0, 0, 0, 0, 0, 1e20]), "float32")


def test_softplus_tails_keep_their_relative_accuracy():
    """Far below zero softplus(x) ≈ exp(x), a tiny number 1 + exp(x) would round to 1;
    far above, it is x itself, with no exp overflow on the way."""
    x = np.array([-80.0, -30.0, -12.0, -1e-3, 0.0, 1e-3, 12.0, 30.0, 80.0, 1e4], np.float32)
    out = run1(lambda f, a: a.softplus(), x)
    expected = np.array([math.log1p(math.exp(-abs(v))) + max(v, 0.0) for v in x.astype(np.float64)])
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=3e-6, atol=0)


def test_not():
    x = random_array((5, 13), "bool", seed=2)
    check(run1(lambda f, a: f.logical_not(a), x), x == False, "bool")  # noqa: E712
    check(run1(lambda f, a: ~a, x), x == False, "bool")  # noqa: E712


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(dtype, approximate):
    x = random_array((9, 13), dtype, seed=3, low=-5, high=5)
    xf = as_f64(x)
    if approximate == "tanh":
        expected = 0.5 * xf * (1 + np.tanh(math.sqrt(2 / math.pi) * (xf + 0.044715 * xf**3)))
    else:
        expected = xf * 0.5 * (1 + erf64(xf / math.sqrt(2)))
    out = run1(lambda f, a: f.gelu(a, approximate=approximate), x)
    check(out, expected, dtype)


def test_gelu_forms_differ():
    """The two forms are close but not identical: the attribute must reach the kernel."""
    x = np.linspace(-3, 3, 13)
    exact = run1(lambda f, a: f.gelu(a), x)
    approx = run1(lambda f, a: f.gelu(a, approximate="tanh"), x)
    assert 1e-6 < np.max(np.abs(exact - approx)) < 1e-2


# ---- Cast ------------------------------------------------------------------------------------

CAST_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "bfloat16",
               "float32", "float64"]


def _cast_source(src: str, dst: str) -> np.ndarray:
    g = np.random.default_rng(7)
    unsigned = src in UNSIGNED_INTS or dst in UNSIGNED_INTS or src == "bool"
    if src == "bool":
        return random_array((5, 7), "bool", seed=7)
    if src in INTS:
        v = g.integers(0 if unsigned else -100, 101, (5, 7))
    else:
        v = g.uniform(0 if unsigned else -100, 100, (5, 7))
    v.reshape(-1)[:3] = 0  # zeros matter for casts to bool
    return v.astype(np_dtype(src))


@pytest.mark.parametrize("dst", CAST_DTYPES)
@pytest.mark.parametrize("src", CAST_DTYPES)
def test_cast(src, dst):
    x = _cast_source(src, dst)
    out = run1(lambda f, a: f.cast(a, dst), x)
    v = as_f64(x)
    if dst == "bool":
        expected = v != 0
    elif dst in INTS:
        expected = np.trunc(v).astype(np.int64)  # toward zero, as C casts
    else:
        expected = v
    check(out, expected, dst)


def test_cast_float_to_int_truncates_toward_zero():
    x = np.array([-2.9, -2.5, -0.7, 0.7, 2.5, 2.9], np.float32)
    check(run1(lambda f, a: f.cast(a, "int32"), x), [-2, -2, 0, 0, 2, 2], "int32")


@pytest.mark.parametrize("src", ["float32", "float64"])
def test_cast_to_uint64_past_int64s_range(src):
    """Floats from 2^63 up convert to uint64 as numpy converts them, not through int64."""
    x = np.array([3e18, 1.5, 1.7e19, 2.0**63, 2.0**63 - 2**40, 0.0, 1.8e19], src)
    np.testing.assert_array_equal(run1(lambda f, a: f.cast(a, "uint64"), x), x.astype(np.uint64))


def test_cast_accepts_numpy_dtypes():
    x = random_array((3, 5), "float32", seed=8)
    out = run1(lambda f, a: f.cast(a, np.float64), x)
    check(out, as_f64(x), "float64", rtol=0, atol=0)


# ---- binary arithmetic -----------------------------------------------------------------------

BROADCAST_SHAPES = [
    ((), ()),
    ((), (7,)),
    ((13,), ()),
    ((33,), (33,)),
    ((5, 1), (1, 13)),
    ((2, 3, 7), (7,)),
    ((3, 1, 7), (1, 5, 1)),
    ((4, 1), (4, 9)),
]
SHAPE_IDS = [f"{'x'.join(map(str, a)) or 's'}-{'x'.join(map(str, b)) or 's'}" for a, b in BROADCAST_SHAPES]


def _binary_inputs(op, dtype, sa, sb, seed=11):
    if op == "Pow":
        a = random_array(sa, dtype, seed=seed, low=0.2, high=3)
        b = random_array(sb, dtype, seed=seed + 1, low=-2, high=2)
    elif dtype in UNSIGNED_INTS:
        # Keep a - b >= 0 for unsigned Sub.
        a = random_array(sa, dtype, seed=seed, low=16 if op == "Sub" else 1, high=30 if op == "Sub" else 15)
        b = random_array(sb, dtype, seed=seed + 1, low=1, high=15)
    else:
        a = random_array(sa, dtype, seed=seed, low=-9, high=9)
        b = random_array(sb, dtype, seed=seed + 1, low=-9, high=9)
    return a, b


def _expected_binary(op, a, b, dtype):
    if dtype in INTS:
        x, y = ints_of(a), ints_of(b)
        if op == "Div":
            # Truncation toward zero (C and LLVM sdiv), not numpy's floor division.
            q = np.abs(x) // np.abs(y)
            return wrap(np.where((x < 0) ^ (y < 0), -q, q), dtype)
    else:
        x, y = as_f64(a), as_f64(b)
    return {
        "Add": lambda: x + y,
        "Sub": lambda: x - y,
        "Mul": lambda: x * y,
        "Div": lambda: x / y,
        "Pow": lambda: np.exp(y * np.log(x)),
        "Minimum": lambda: np.where(x < y, x, y),
        "Maximum": lambda: np.where(x > y, x, y),
    }[op]()


ARITH = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Minimum": "minimum", "Maximum": "maximum"}
ARITH_CASES = [(op, dt) for op in ARITH for dt in (FLOATS if op == "Pow" else NUMERIC)]


@pytest.mark.parametrize("shapes", BROADCAST_SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("op,dtype", ARITH_CASES, ids=[f"{o}-{d}" for o, d in ARITH_CASES])
def test_binary_arithmetic(op, dtype, shapes):
    sa, sb = shapes
    a, b = _binary_inputs(op, dtype, sa, sb)
    out = run1(lambda f, x, y: getattr(f, ARITH[op])(x, y), a, b)
    check(out, _expected_binary(op, a, b, dtype), dtype)


@pytest.mark.parametrize("dtype", SIGNED_INTS)
def test_integer_division_truncates_toward_zero(dtype):
    a = np.array([7, -7, 7, -7, 6, -6, 1, -1, 0, 100], np_dtype(dtype))
    b = np.array([2, 2, -2, -2, 3, 3, 7, 7, -5, -9], np_dtype(dtype))
    check(run1(lambda f, x, y: f.div(x, y), a, b), [3, -3, -3, 3, 2, -2, 0, 0, 0, -11], dtype)


def test_unsigned_division():
    a = np.array([255, 254, 7, 9], np.uint8)
    b = np.array([2, 255, 8, 3], np.uint8)
    check(run1(lambda f, x, y: x / y, a, b), [127, 0, 0, 3], "uint8")


def test_pow_integer_exponents_of_negative_bases():
    x = np.array([-3.0, -2.0, -0.5, 0.5, 2.0], np.float32)
    check(run1(lambda f, a: a**2, x), as_f64(x) ** 2, "float32")
    check(run1(lambda f, a: a**3, x), as_f64(x) ** 3, "float32")


def test_a_constant_square_or_cube_compiles_to_products():
    """x² and x³ (the tanh GELU's cube) and the cube's gradient 3x² are products, not
    exp(n·log|x|): no Pow is left to compile, and the values are the float64 ones."""
    from ranvier.autodiff import gradient

    x = random_array([100], "float32")
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    w = f.parameter("w", x)
    cube = w**3.0
    square = (w**2.0).sum()
    d_cube = gradient(flow, f.func, [w], loss=cube.sum())["f/w"]
    for t in (cube, square, d_cube):
        t.var.out = True
    network = ranvier.Compiler("cpu").compile(flow)
    programs = [op.type + op.attrs.get("expr", "") for op in network.flow.funcs["f"].ops]
    assert not [p for p in programs if "Pow" in p], programs
    data = network.cell("f").instance()
    data.compute()
    check(data[cube.var], as_f64(x) ** 3, "float32")
    check(data[square.var], (as_f64(x) ** 2).sum(), "float32")
    check(data[d_cube.var], 3 * as_f64(x) ** 2, "float32")


def _remainder_of(a, b, dtype: str, floored: bool):
    """Element by element in Python: math.fmod or % for floats; for integers the truncated
    remainder (|a| % |b| with a's sign) or the floored one (%), x % 0 being 0."""

    def one(x, y):
        if isinstance(x, float):
            if floored:
                return x % y if y else math.nan
            return math.fmod(x, y) if y else math.nan
        if y == 0:
            return 0
        if floored:
            return x % y
        return -(abs(x) % abs(y)) if x < 0 else abs(x) % abs(y)

    kind = float if dtype in FLOATS else int
    pairs = np.broadcast_arrays(as_f64(a), as_f64(b)) if kind is float else np.broadcast_arrays(ints_of(a), ints_of(b))
    return np.vectorize(lambda x, y: one(kind(x), kind(y)), otypes=[np.float64 if kind is float else object])(*pairs)


@pytest.mark.parametrize("shapes", BROADCAST_SHAPES[3:6], ids=SHAPE_IDS[3:6])
@pytest.mark.parametrize("op", ["FMod", "Mod"])
@pytest.mark.parametrize("dtype", NUMERIC)
def test_remainders(op, dtype, shapes):
    """fmod (the dividend's sign) and mod (the divisor's), mixed signs and divisors of 0."""
    sa, sb = shapes
    low = 0 if dtype in UNSIGNED_INTS else -40
    a = random_array(sa, dtype, seed=5, low=low, high=40)
    b = random_array(sb, dtype, seed=6, low=low / 4, high=9)
    b.flat[0] = 0
    expected = _remainder_of(a, b, dtype, floored=op == "Mod")
    if dtype in INTS:
        expected = expected.astype(np.int64)
    check(run1(lambda f, x, y: getattr(f, op.lower())(x, y), a, b), expected, dtype)


@pytest.mark.parametrize("dtype", SIGNED_INTS)
def test_remainders_of_the_most_negative_integer(dtype):
    """MIN % −1 is 0 (the hardware's srem traps there), and MIN % 3 its true remainder."""
    low = np.iinfo(np_dtype(dtype)).min
    a = np.array([low, low, low, 7], np_dtype(dtype))
    b = np.array([-1, 3, -3, -1], np_dtype(dtype))
    for method, floored in (("fmod", False), ("mod", True)):
        expected = [0, *(low % d if floored else -(-low % abs(d)) for d in (3, -3)), 0]
        check(run1(lambda f, x, y, m=method: getattr(f, m)(x, y), a, b), expected, dtype)


def _whole_range(dtype: str) -> dict:
    """random_array's bounds for integers over the dtype's range (within int64's, which it
    draws from)."""
    info = np.iinfo(np_dtype(dtype))
    return {"low": max(int(info.min), -2**63), "high": min(int(info.max), 2**63 - 1)}


def _bits(values, dtype: str) -> list[int]:
    """Each integer's two's complement bits as a Python int of the dtype's width."""
    width = np.dtype(np_dtype(dtype)).itemsize * 8
    return [int(v) % (1 << width) for v in np.asarray(values).reshape(-1)]


def _from_bits(bits: list[int], dtype: str, shape) -> np.ndarray:
    width = np.dtype(np_dtype(dtype)).itemsize * 8
    signed = np.issubdtype(np_dtype(dtype), np.signedinteger)
    return np.array([b - (1 << width) if signed and b >> (width - 1) else b for b in bits], np_dtype(dtype)).reshape(shape)


@pytest.mark.parametrize("shapes", BROADCAST_SHAPES[3:6], ids=SHAPE_IDS[3:6])
@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dtype", INTS)
def test_bitwise_logic(op, dtype, shapes):
    """Bit by bit on the two's complement patterns of random integers over the dtype's range."""
    a = random_array(shapes[0], dtype, seed=7, **_whole_range(dtype))
    b = random_array(shapes[1], dtype, seed=8, **_whole_range(dtype))
    a_b, b_b = np.broadcast_arrays(a, b)
    combine = {"BitwiseAnd": lambda x, y: x & y, "BitwiseOr": lambda x, y: x | y, "BitwiseXor": lambda x, y: x ^ y}[op]
    expected = _from_bits([combine(x, y) for x, y in zip(_bits(a_b, dtype), _bits(b_b, dtype))], dtype, a_b.shape)
    method = {"BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor"}[op]
    check(run1(lambda f, x, y: getattr(f, method)(x, y), a, b), expected, dtype)


@pytest.mark.parametrize("dtype", INTS)
def test_bitwise_not(dtype):
    x = random_array((5, 7), dtype, seed=9, **_whole_range(dtype))
    width = np.dtype(np_dtype(dtype)).itemsize * 8
    expected = _from_bits([(1 << width) - 1 - v for v in _bits(x, dtype)], dtype, x.shape)
    check(run1(lambda f, t: f.bitwise_not(t), x), expected, dtype)


@pytest.mark.parametrize("op", ["ShiftLeft", "ShiftRight"])
@pytest.mark.parametrize("dtype", INTS)
def test_shifts(op, dtype):
    """Shifts by every amount from −2 to the width + 1 of random integers over the dtype's
    range: a left shift drops the bits moved past the top, a right shift copies the sign
    in (signed) or zeros (unsigned); amounts outside [0, width) shift every bit out."""
    info = np.iinfo(np_dtype(dtype))
    width = np.dtype(np_dtype(dtype)).itemsize * 8
    low = -2 if dtype in SIGNED_INTS else 0
    amounts = np.arange(low, width + 2).astype(np_dtype(dtype))
    x = random_array((3, 1), dtype, seed=10, **_whole_range(dtype))
    x[0, 0] = info.min
    pairs = np.broadcast_arrays(x, amounts)
    expected = []
    for value, amount in zip(pairs[0].reshape(-1).tolist(), pairs[1].reshape(-1).tolist()):
        inside = 0 <= amount < width
        if op == "ShiftLeft":
            expected.append((value << amount) % (1 << width) if inside else 0)
        else:
            expected.append(value >> amount if inside else (-1 if value < 0 else 0))
    expected = np.array(expected, dtype=object).reshape(pairs[0].shape)
    if op == "ShiftLeft":
        expected = _from_bits(expected.reshape(-1).tolist(), dtype, pairs[0].shape)
    method = "shift_left" if op == "ShiftLeft" else "shift_right"
    check(run1(lambda f, a, b: getattr(f, method)(a, b), x, amounts), expected.astype(np_dtype(dtype)), dtype)


BITCASTS = [("float32", "int32", "f", "i"), ("int32", "float32", "i", "f"), ("float64", "int64", "d", "q"),
            ("int64", "float64", "q", "d"), ("int8", "uint8", "b", "B"), ("uint16", "int16", "H", "h"),
            ("bool", "uint8", "?", "B"), ("bool", "int8", "?", "b")]


@pytest.mark.parametrize("source, target, packs, unpacks", BITCASTS, ids=[f"{s}-{t}" for s, t, _, _ in BITCASTS])
def test_bitcast(source, target, packs, unpacks):
    """Each element's bytes read as the target dtype, as Python's struct packs and unpacks
    them; integers over their whole range, floats with infinities, NaN and -0."""
    import struct

    if source in FLOATS:
        x = random_array((4, 5), source, seed=12, low=-1e6, high=1e6)
        x.flat[:4] = [np.inf, -np.inf, np.nan, -0.0]
    elif source == "bool":
        x = random_array((4, 5), source, seed=12)
    else:
        x = random_array((4, 5), source, seed=12, **_whole_range(source))
    expected = np.array([struct.unpack(f"<{unpacks}", struct.pack(f"<{packs}", v))[0] for v in x.reshape(-1).tolist()])
    actual = run1(lambda f, t: f.bitcast(t, target), x)
    assert actual.dtype == np_dtype(target)
    if target in FLOATS:  # compare the bits: NaN payloads and -0 included
        np.testing.assert_array_equal(actual.view(f"u{actual.itemsize}"),
                                      expected.astype(np_dtype(target)).reshape(x.shape).view(f"u{actual.itemsize}"))
    else:
        np.testing.assert_array_equal(actual, expected.reshape(x.shape).astype(np_dtype(target)))


@pytest.mark.parametrize("source, target", [("float32", "int16"), ("float16", "int16"), ("int16", "bfloat16"),
                                            ("uint8", "bool")])
def test_bitcast_refuses(source, target):
    with pytest.raises(ranvier.errors.ShapeError, match="one width, neither float16 nor bfloat16"):
        run1(lambda f, t: f.bitcast(t, target), random_array((3,), source))


def test_minimum_maximum_nan_free_ties():
    a = np.array([1.0, 2.0, -0.5, 3.0], np.float32)
    b = np.array([1.0, -2.0, -0.5, 4.0], np.float32)
    check(run1(lambda f, x, y: f.minimum(x, y), a, b), [1, -2, -0.5, 3], "float32")
    check(run1(lambda f, x, y: f.maximum(x, y), a, b), [1, 2, -0.5, 4], "float32")


# ---- comparisons -------------------------------------------------------------------------------

COMPARE = {
    "Equal": ("equal", lambda x, y: x == y, ALL),
    "NotEqual": ("not_equal", lambda x, y: x != y, ALL),
    "Less": ("less", lambda x, y: x < y, NUMERIC),
    "LessEqual": ("less_equal", lambda x, y: x <= y, NUMERIC),
    "Greater": ("greater", lambda x, y: x > y, NUMERIC),
    "GreaterEqual": ("greater_equal", lambda x, y: x >= y, NUMERIC),
}
COMPARE_CASES = [(op, dt) for op, (_, _, allowed) in COMPARE.items() for dt in allowed]


def _small_values(shape, dtype, seed):
    """Values from a small set, so ties (and Equal results of True) are common."""
    if dtype == "bool":
        return random_array(shape, "bool", seed=seed)
    g = np.random.default_rng(seed)
    low = 0 if dtype in UNSIGNED_INTS else -3
    return g.integers(low, low + 7, shape).astype(np_dtype(dtype))


@pytest.mark.parametrize("shapes", [((7, 13), (7, 13)), ((), (13,)), ((5, 1), (1, 7)), ((2, 3, 7), (7,))], ids=["same", "scalar", "outer", "rank3"])
@pytest.mark.parametrize("op,dtype", COMPARE_CASES, ids=[f"{o}-{d}" for o, d in COMPARE_CASES])
def test_compare(op, dtype, shapes):
    method, fn, _ = COMPARE[op]
    a = _small_values(shapes[0], dtype, 21)
    b = _small_values(shapes[1], dtype, 22)
    out = run1(lambda f, x, y: getattr(f, method)(x, y), a, b)
    x, y = (a, b) if dtype == "bool" else (as_f64(a), as_f64(b))
    expected = fn(x, y)
    check(out, expected, "bool")
    if out.size > 4:
        assert out.any() and not out.all(), "inputs should give both results"


def test_compare_nan():
    a = np.array([np.nan, 1.0, np.nan], np.float32)
    b = np.array([np.nan, np.nan, 1.0], np.float32)
    check(run1(lambda f, x, y: f.equal(x, y), a, b), [False, False, False], "bool")
    check(run1(lambda f, x, y: f.not_equal(x, y), a, b), [True, True, True], "bool")
    check(run1(lambda f, x, y: f.less(x, y), a, b), [False, False, False], "bool")


LOGIC = {
    "And": ("logical_and", np.bitwise_and), "Or": ("logical_or", np.bitwise_or), "Xor": ("logical_xor", np.not_equal),
    "AndNot": ("logical_and_not", lambda a, b: ~a & b),
}


@pytest.mark.parametrize("shapes", [((7, 13), (7, 13)), ((), (13,)), ((5, 1), (1, 7))], ids=["same", "scalar", "outer"])
@pytest.mark.parametrize("op", list(LOGIC))
def test_logic(op, shapes):
    method, fn = LOGIC[op]
    a = random_array(shapes[0], "bool", seed=31)
    b = random_array(shapes[1], "bool", seed=32)
    out = run1(lambda f, x, y: getattr(f, method)(x, y), a, b)
    check(out, fn(a, b), "bool")


def test_logic_operators():
    a = random_array((4, 9), "bool", seed=33)
    b = random_array((4, 9), "bool", seed=34)
    outs = run_flow(lambda f, x, y: (x & y, x | y, x ^ y, ~x), [a, b])
    for out, expected in zip(outs, [a & b, a | b, a != b, ~a]):
        check(out, expected, "bool")


# ---- Cond / Select -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shapes", [((7, 13), (7, 13), (7, 13)), ((5, 1), (1, 7), ()), ((13,), (3, 13), (3, 1))], ids=["same", "bcast", "bcast2"])
def test_cond(dtype, shapes):
    c = random_array(shapes[0], "bool", seed=41)
    x = random_array(shapes[1], dtype, seed=42, low=1, high=9)
    y = random_array(shapes[2], dtype, seed=43, low=1, high=9)
    out = run1(lambda f, cc, a, b: f.cond(cc, a, b), c, x, y)
    shape = np.broadcast_shapes(c.shape, x.shape, y.shape)
    cb, xb, yb = (np.broadcast_to(v, shape) for v in (c, x, y))
    expected = np.array([xv if cv else yv for cv, xv, yv in zip(cb.reshape(-1), xb.reshape(-1), yb.reshape(-1))]).reshape(shape)
    check(out, expected, dtype, rtol=0, atol=0)


@pytest.mark.parametrize("flag", [True, False])
def test_cond_on_one_flag_chooses_whole_rows(flag):
    """A scalar condition (an optimizer's skip flag) is read once and chooses whole vectors:
    every element of a row longer than a vector, and of its tail, follows it."""
    x = random_array((3, 37), "float32", seed=46)
    y = random_array((3, 37), "float32", seed=47)
    out = run1(lambda f, cc, a, b: f.cond(cc, a * 2, b - 1), np.array(flag), x, y)
    check(out, 2 * as_f64(x) if flag else as_f64(y) - 1, "float32")


def test_cond_with_python_numbers():
    c = random_array((3, 7), "bool", seed=44)
    x = random_array((3, 7), "float16", seed=45)
    check(run1(lambda f, cc, a: f.cond(cc, a, 0.5), c, x), np.where(c, as_f64(x), 0.5), "float16")
    check(run1(lambda f, cc, a: f.where(cc, -1, a), c, x), np.where(c, -1.0, as_f64(x)), "float16")


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shapes", [((7, 13), (7, 13)), ((5, 1), (1, 7)), ((), (13,)), ((13,), ())], ids=["same", "outer", "scalar-c", "scalar-x"])
def test_select(dtype, shapes):
    c = random_array(shapes[0], "bool", seed=51)
    x = random_array(shapes[1], dtype, seed=52, low=1, high=9)
    out = run1(lambda f, cc, a: f.select(cc, a), c, x)
    shape = np.broadcast_shapes(c.shape, x.shape)
    cb, xb = np.broadcast_to(c, shape), np.broadcast_to(x, shape)
    expected = np.array([xv if cv else 0 for cv, xv in zip(cb.reshape(-1), xb.reshape(-1))], dtype=np_dtype(dtype)).reshape(shape)
    check(out, expected, dtype, rtol=0, atol=0)


# ---- Python operators on Tensor handles ------------------------------------------------------------


def test_operators_float():
    x = random_array((3, 7), "float32", seed=61, low=0.5, high=3)
    w = random_array((7, 5), "float32", seed=62)
    y = random_array((3, 7), "float32", seed=63)
    builds = [
        (lambda f, a, m, b: a + 1, lambda a, m, b: a + 1),
        (lambda f, a, m, b: 1 + a, lambda a, m, b: 1 + a),
        (lambda f, a, m, b: a - 2.5, lambda a, m, b: a - 2.5),
        (lambda f, a, m, b: 3 - a, lambda a, m, b: 3 - a),
        (lambda f, a, m, b: 2 * a, lambda a, m, b: 2 * a),
        (lambda f, a, m, b: a * b, lambda a, m, b: a * b),
        (lambda f, a, m, b: a / 4, lambda a, m, b: a / 4),
        (lambda f, a, m, b: 1 / a, lambda a, m, b: 1 / a),
        (lambda f, a, m, b: a @ m, lambda a, m, b: np.einsum("ik,kj->ij", a, m)),
        (lambda f, a, m, b: -a, lambda a, m, b: -a),
        (lambda f, a, m, b: a**2, lambda a, m, b: a * a),
        (lambda f, a, m, b: 2**a, lambda a, m, b: np.exp2(a)),
        (lambda f, a, m, b: abs(b), lambda a, m, b: np.abs(b)),
        (lambda f, a, m, b: b.relu(), lambda a, m, b: np.where(b > 0, b, 0)),
        (lambda f, a, m, b: a.sum(axis=1), lambda a, m, b: a.sum(axis=1)),
        (lambda f, a, m, b: a.T, lambda a, m, b: a.transpose()),
        (lambda f, a, m, b: a.reshape([7, 3]), lambda a, m, b: a.reshape(7, 3)),
        (lambda f, a, m, b: (a @ m + 1).relu().sum(axis=0), lambda a, m, b: np.maximum(a @ m + 1, 0).sum(axis=0)),
        (lambda f, a, m, b: a.exp().log(), lambda a, m, b: a),
        (lambda f, a, m, b: a.softmax(), lambda a, m, b: np.exp(a) / np.exp(a).sum(-1, keepdims=True)),
    ]
    outs = run_flow(lambda f, a, m, b: [build(f, a, m, b) for build, _ in builds], [x, w, y])
    for out, (_, expected) in zip(outs, builds):
        check(out, expected(as_f64(x), as_f64(w), as_f64(y)), "float32")


def test_operators_compare():
    a = _small_values((4, 7), "int32", 64)
    b = _small_values((4, 7), "int32", 65)
    outs = run_flow(lambda f, x, y: (x < y, x <= 0, x > y, x >= 1), [a, b])
    for out, expected in zip(outs, [a < b, a <= 0, a > b, a >= 1]):
        check(out, expected, "bool")


def test_operators_keep_the_tensor_dtype():
    for dtype in ("float16", "bfloat16", "float64", "int8", "uint16"):
        x = random_array((2, 5), dtype, seed=66, low=1, high=9)
        (out,) = run_flow(lambda f, a: 2 * a + 1, [x])
        check(out, 2 * as_f64(x) + 1, dtype)


def test_numpy_arrays_on_the_left_of_operators():
    x = random_array((2, 3), "float32", seed=67)
    c = np.arange(3, dtype=np.float32)
    outs = run_flow(lambda f, a: (c + a, c * a, c - a, np.float32(2) * a), [x])
    for out, expected in zip(outs, [c + x, c * x, c - x, 2 * x]):
        check(out, as_f64(expected), "float32")


def test_python_numbers_in_cond_and_select():
    c = random_array((2, 7), "bool", seed=68)
    outs = run_flow(lambda f, cc: (f.cond(cc, 1, 2), f.select(cc, 2.5), f.cond(cc, 1.5, -0.5)), [c])
    check(outs[0], np.where(c, 1, 2), "int32")
    check(outs[1], np.where(c, 2.5, 0.0), "float32")
    check(outs[2], np.where(c, 1.5, -0.5), "float32")


def test_numpy_array_on_the_left_of_matmul():
    w = random_array((7, 3), "float32", seed=69)
    m = random_array((2, 7), "float32", seed=70)
    check(run1(lambda f, b: m @ b, w), as_f64(m) @ as_f64(w), "float32")


def test_tensor_equality_is_identity_not_the_equal_op():
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    x = f.var("x", "float32", [3])
    assert x == x and x != f.neg(x)
    assert len({x, x}) == 1


def test_python_numbers_that_do_not_fit_the_tensor_dtype_are_rejected():
    message = shape_error(lambda f, i: i + 0.5, [("i", "int32", [3])])
    assert_mentions(message, "f/Add", "f/i: int32[3]", "float32", "one dtype")
    message = shape_error(lambda f, i: i * 300, [("u", "uint8", [3])])
    assert_mentions(message, "f/Mul", "f/u: uint8[3]")
    message = shape_error(lambda f, i: i + (-1), [("u", "uint8", [3])])
    assert_mentions(message, "f/Add", "uint8[3]")
    # Whole floats and in-range integers are fine.
    i = np.array([1, 2, 3], np.int32)
    check(run1(lambda f, a: a * 2.0 + 1, i), [3, 5, 7], "int32")


# ---- shape and dtype errors -----------------------------------------------------------------------


def test_add_shape_mismatch_error():
    message = shape_error(lambda f, a, b: f.add(a, b), [("a", "float32", [2, 3]), ("b", "float32", [4])])
    assert_mentions(message, "f/Add", "f/a: float32[2x3]", "f/b: float32[4]", "broadcast")


def test_add_dtype_mismatch_error():
    message = shape_error(lambda f, a, b: a + b, [("a", "float32", [2, 3]), ("b", "int32", [2, 3])])
    assert_mentions(message, "f/Add", "f/a: float32[2x3]", "f/b: int32[2x3]", "one dtype")


def test_exp_of_int_error():
    message = shape_error(lambda f, a: f.exp(a), [("a", "int32", [7])])
    assert_mentions(message, "f/Exp", "f/a: int32[7]", "float32")


@pytest.mark.parametrize("method,dtype", [("neg", "bool"), ("relu", "bool"), ("logical_not", "float32"), ("sqrt", "int8"), ("gelu", "int32")])
def test_unary_dtype_errors(method, dtype):
    message = shape_error(lambda f, a: getattr(f, method)(a), [("a", dtype, [3, 5])])
    assert_mentions(message, f"a: {dtype}[3x5]", "expected")


@pytest.mark.parametrize("method,dtype", [("logical_and", "int32"), ("less", "bool"), ("pow", "int32"), ("sub", "bool")])
def test_binary_dtype_errors(method, dtype):
    message = shape_error(lambda f, a, b: getattr(f, method)(a, b), [("a", dtype, [3]), ("b", dtype, [3])])
    assert_mentions(message, f"f/a: {dtype}[3]", f"f/b: {dtype}[3]", "expected")


def test_gelu_bad_form_error():
    message = shape_error(lambda f, a: f.gelu(a, approximate="sigmoid"), [("a", "float32", [3])])
    assert_mentions(message, "f/Gelu", "approximate", "tanh")


def test_cast_to_unknown_dtype_error():
    message = shape_error(lambda f, a: f.op("Cast", [a], attrs={"dtype": "float8"}), [("a", "float32", [3])])
    assert_mentions(message, "f/Cast", "f/a: float32[3]", "dtype")


def test_cond_errors():
    message = shape_error(lambda f, c, a, b: f.cond(c, a, b), [("c", "int32", [3]), ("a", "float32", [3]), ("b", "float32", [3])])
    assert_mentions(message, "f/Cond", "f/c: int32[3]", "bool condition")
    message = shape_error(lambda f, c, a, b: f.cond(c, a, b), [("c", "bool", [3]), ("a", "float32", [3]), ("b", "float64", [3])])
    assert_mentions(message, "f/Cond", "f/b: float64[3]", "one dtype")
    message = shape_error(lambda f, c, a: f.select(c, a), [("c", "bool", [4]), ("a", "float32", [3])])
    assert_mentions(message, "f/Select", "f/c: bool[4]", "f/a: float32[3]", "broadcast")


def test_named_ops_are_named_in_errors():
    message = shape_error(lambda f, a, b: f.mul(a, b, name="scale"), [("a", "float32", [2]), ("b", "float32", [3])])
    assert_mentions(message, "Mul op f/scale", "f/a: float32[2]", "f/b: float32[3]")


# ---- the test harness itself ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
def test_harness_catches_unwritten_output_elements(dtype, monkeypatch):
    """run_flow must fail when a kernel leaves an output element unwritten."""
    from ranvier.backends import reference

    real_copyto = np.copyto

    def copy_all_but_first(dst, src, **kwargs):
        real_copyto(dst.reshape(-1)[1:], np.asarray(src).reshape(-1)[1:], **kwargs)

    monkeypatch.setattr(reference.np, "copyto", copy_all_but_first)
    x = random_array((3, 5), dtype, seed=71, low=1, high=9)
    with pytest.raises(AssertionError, match="not written"):
        run1(lambda f, a: f.identity(a), x)
