"""Reductions: Sum SumSquares Mean Max Min Product All Any ArgMax ArgMin over single, multiple,
negative and all axes, with and without keepdims, for every dtype each accepts."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    FLOATS,
    INTS,
    NUMERIC,
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

TESTED_OPS = {"Sum", "SumSquares", "Mean", "Max", "Min", "Product", "All", "Any", "ArgMax", "ArgMin"}

SHAPE = (3, 7, 5)
AXES = [None, [0], [1], [2], [-1], [-3], [0, 2], [-1, 0], [1, 2], [0, 1, 2], [2, 0, 1]]
AXES_IDS = ["all" if a is None else ",".join(map(str, a)) for a in AXES]


def _norm_axes(axes, rank):
    return tuple(range(rank)) if axes is None else tuple(sorted({a % rank for a in axes}))


def _reduce_loop(x, axes, keepdims, combine):
    """Reduce by moving the reduced axes last and combining each row (independent of numpy's axis=)."""
    axes = _norm_axes(axes, x.ndim)
    kept = [i for i in range(x.ndim) if i not in axes]
    moved = np.transpose(x, kept + list(axes))
    rows = moved.reshape(*[x.shape[i] for i in kept], -1)
    flat = rows.reshape(-1, rows.shape[-1])
    values = [combine(list(row)) for row in flat]
    out = np.array(values, dtype=object).reshape([x.shape[i] for i in kept])
    if keepdims:
        out = out.reshape([1 if i in axes else d for i, d in enumerate(x.shape)])
    return out


def _prod(values):
    result = 1
    for v in values:
        result = result * v
    return result


REDUCE = {
    # op: (method, combine over Python numbers, dtypes)
    "Sum": ("sum", lambda v: sum(v), NUMERIC),
    "SumSquares": ("sum_squares", lambda v: sum(x * x for x in v), FLOATS),
    "Mean": ("mean", lambda v: sum(v) / len(v), FLOATS),
    "Max": ("max", max, NUMERIC),
    "Min": ("min", min, NUMERIC),
    "Product": ("product", _prod, NUMERIC),
    "All": ("all", lambda v: all(v), ("bool",)),
    "Any": ("any", lambda v: any(v), ("bool",)),
}


def _reduce_input(op, dtype, shape, seed):
    if dtype == "bool":
        g = np.random.default_rng(seed)
        # Mostly True (for All) with a few False, so rows differ.
        return g.random(shape) < (0.85 if op == "All" else 0.15)
    if op == "Product":
        if dtype in FLOATS:
            return random_array(shape, dtype, seed=seed, low=0.6, high=1.6)
        low = 1 if dtype in UNSIGNED_INTS else -2
        return random_array(shape, dtype, seed=seed, low=low, high=2)
    low = 1 if dtype in UNSIGNED_INTS else -9
    return random_array(shape, dtype, seed=seed, low=low, high=9)


def _expected(op, x, axes, keepdims, dtype):
    _, combine, _ = REDUCE[op]
    if dtype == "bool":
        values = x
    elif dtype in INTS:
        values = x.astype(np.int64).astype(object)  # exact Python integers
    else:
        values = as_f64(x)
    out = _reduce_loop(values, axes, keepdims, combine)
    if dtype in INTS:
        info = np.iinfo(np_dtype(dtype))
        span = int(info.max) - int(info.min) + 1
        out = np.vectorize(lambda e: (int(e) - int(info.min)) % span + int(info.min), otypes=[np.int64])(out) if out.size else out
    return np.asarray(out, dtype=bool if dtype == "bool" else np.int64 if dtype in INTS else np.float64)


@pytest.mark.parametrize("keepdims", [False, True], ids=["drop", "keep"])
@pytest.mark.parametrize("axes", AXES, ids=AXES_IDS)
@pytest.mark.parametrize("op", list(REDUCE))
def test_reduce_axes(op, axes, keepdims):
    dtype = "bool" if op in ("All", "Any") else "float32"
    x = _reduce_input(op, dtype, SHAPE, seed=3)
    method = REDUCE[op][0]
    out = run1(lambda f, a: getattr(f, method)(a, axis=axes, keepdims=keepdims), x)
    check(out, _expected(op, x, axes, keepdims, dtype), dtype)


REDUCE_DTYPE_CASES = [(op, dt) for op, (_, _, allowed) in REDUCE.items() for dt in allowed]


@pytest.mark.parametrize("axes", [None, [1], [-1, 0]], ids=["all", "1", "-1,0"])
@pytest.mark.parametrize("op,dtype", REDUCE_DTYPE_CASES, ids=[f"{o}-{d}" for o, d in REDUCE_DTYPE_CASES])
def test_reduce_dtypes(op, dtype, axes):
    x = _reduce_input(op, dtype, (5, 13), seed=4)
    method = REDUCE[op][0]
    out = run1(lambda f, a: getattr(f, method)(a, axis=axes, keepdims=axes == [1]), x)
    check(out, _expected(op, x, axes, axes == [1], dtype), dtype)


@pytest.mark.parametrize("op", ["Sum", "Max", "Mean"])
@pytest.mark.parametrize("shape", [(33,), (1, 1), (1, 13), (2, 1, 3, 7)])
def test_reduce_shapes(op, shape):
    x = _reduce_input(op, "float64", shape, seed=5)
    method = REDUCE[op][0]
    out = run1(lambda f, a: getattr(f, method)(a, axis=-1), x)
    check(out, _expected(op, x, [-1], False, "float64"), "float64")


def test_reduce_scalar_axis_argument_and_duplicates():
    x = _reduce_input("Sum", "float32", SHAPE, seed=6)
    outs = run_flow(lambda f, a: (a.sum(axis=1), a.sum(axis=(0, -3)), a.sum(axis=[2, -1], keepdims=True), a.sum(axis=[])), [x])
    check(outs[0], _expected("Sum", x, [1], False, "float32"), "float32")
    check(outs[1], _expected("Sum", x, [0], False, "float32"), "float32")
    check(outs[2], _expected("Sum", x, [2], True, "float32"), "float32")
    check(outs[3], x, "float32")  # no axes: nothing is reduced


def test_reduce_of_a_scalar():
    x = np.array(2.5, np.float32)
    outs = run_flow(lambda f, a: (a.sum(), a.max(keepdims=True), a.mean()), [x])
    for out in outs:
        check(out, np.array(2.5), "float32")


def test_sum_of_large_float32_rows_is_accurate():
    """Sum accumulates wide enough that a long float32 row loses no more than one rounding."""
    g = np.random.default_rng(9)
    x = (g.uniform(0, 1, (2, 4099)) + 1000).astype(np.float32)
    out = run1(lambda f, a: a.sum(axis=1), x)
    check(out, as_f64(x).sum(axis=1), "float32", rtol=1e-7, atol=0)


def test_integer_sums_wrap_like_hardware():
    x = np.full((3, 40), 7, np.int8)  # 280 does not fit int8
    check(run1(lambda f, a: a.sum(axis=1), x), np.full(3, 280 - 256), "int8")


def test_mean_of_low_precision_is_exact_enough():
    x = random_array((4, 257), "bfloat16", seed=10, low=0, high=4)
    out = run1(lambda f, a: a.mean(axis=1), x)
    check(out, as_f64(x).sum(axis=1) / 257, "bfloat16")


# ---- ArgMax / ArgMin -----------------------------------------------------------------------------


def _arg_expected(x, axis, keepdims, pick_max):
    """Index of the first extreme element, by scanning (no np.argmax)."""
    v = x.astype(np.float64) if x.dtype.kind != "i" and x.dtype.kind != "u" else x.astype(np.int64)
    if axis is None:
        flat = v.reshape(-1)
        best = 0
        for i, e in enumerate(flat):
            if (e > flat[best]) if pick_max else (e < flat[best]):
                best = i
        result = np.array(best)
        return result.reshape((1,) * x.ndim) if keepdims else result
    moved = np.moveaxis(v, axis, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    picks = []
    for row in rows:
        extreme = row.max() if pick_max else row.min()
        picks.append(next(i for i, e in enumerate(row) if e == extreme))
    out = np.array(picks).reshape(moved.shape[:-1])
    if keepdims:
        out = np.expand_dims(out, axis % x.ndim)
    return out


ARG_AXES = [None, 0, 1, 2, -1, -2]


@pytest.mark.parametrize("keepdims", [False, True], ids=["drop", "keep"])
@pytest.mark.parametrize("axis", ARG_AXES, ids=[str(a) for a in ARG_AXES])
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_axes(op, axis, keepdims):
    # Small integers stored as floats: ties are common, and the first index must win.
    g = np.random.default_rng(12)
    x = g.integers(-3, 4, SHAPE).astype(np.float32)
    method = op.lower()
    out = run1(lambda f, a: getattr(f, method)(a, axis=axis, keepdims=keepdims), x)
    check(out, _arg_expected(x, axis, keepdims, op == "ArgMax"), "int32")


@pytest.mark.parametrize("dtype", NUMERIC)
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_dtypes(op, dtype):
    low = 0 if dtype in UNSIGNED_INTS else -20
    g = np.random.default_rng(13)
    x = g.integers(low, low + 40, (7, 13)).astype(np_dtype(dtype))
    outs = run_flow(lambda f, a: (getattr(f, op.lower())(a, axis=1), getattr(f, op.lower())(a)), [x])
    check(outs[0], _arg_expected(x, 1, False, op == "ArgMax"), "int32")
    check(outs[1], _arg_expected(x, None, False, op == "ArgMax"), "int32")


def test_argmax_output_type_int64():
    x = random_array((4, 9), "float32", seed=14)
    out = run1(lambda f, a: f.op("ArgMax", [a], attrs={"axis": 1, "output_type": "int64"}), x)
    check(out, _arg_expected(x, 1, False, True), "int64")


# ---- errors -----------------------------------------------------------------------------------------


def test_reduce_axis_out_of_range_error():
    message = shape_error(lambda f, a: f.sum(a, axis=3), [("x", "float32", [3, 7, 5])])
    assert_mentions(message, "f/Sum", "f/x: float32[3x7x5]", "axis in [-3, 3)", "got 3")
    message = shape_error(lambda f, a: f.max(a, axis=[0, -4]), [("x", "float32", [3, 7, 5])])
    assert_mentions(message, "f/Max", "got -4")


def test_reduce_axis_of_a_scalar_error():
    message = shape_error(lambda f, a: f.sum(a, axis=0), [("x", "float32", [])])
    assert_mentions(message, "f/Sum", "f/x: float32", "axis")
    message = shape_error(lambda f, a: f.argmax(a, axis=0), [("x", "float32", [])])
    assert_mentions(message, "f/ArgMax", "axis")


@pytest.mark.parametrize("method,dtype", [("mean", "int32"), ("sum", "bool"), ("all", "float32"), ("any", "int8"), ("argmax", "bool")])
def test_reduce_dtype_errors(method, dtype):
    message = shape_error(lambda f, a: getattr(f, method)(a), [("x", dtype, [2, 3])])
    assert_mentions(message, f"f/x: {dtype}[2x3]", "expected")


def test_max_over_empty_axis_error():
    message = shape_error(lambda f, a: f.max(a, axis=1), [("x", "float32", [3, 0])])
    assert_mentions(message, "f/Max", "f/x: float32[3x0]", "non-empty")
    message = shape_error(lambda f, a: f.argmin(a), [("x", "float32", [3, 0])])
    assert_mentions(message, "f/ArgMin", "f/x: float32[3x0]", "non-empty")


def test_argmax_bad_output_type_error():
    message = shape_error(lambda f, a: f.op("ArgMax", [a], attrs={"output_type": "float32"}), [("x", "float32", [3])])
    assert_mentions(message, "f/ArgMax", "output_type")


def test_sum_of_empty_axis_is_zero():
    x = np.zeros((3, 0), np.float32)
    outs = run_flow(lambda f, a: (a.sum(axis=1), a.product(axis=1)), [x])
    check(outs[0], np.zeros(3), "float32")
    check(outs[1], np.ones(3), "float32")


def test_reduce_error_is_a_shape_error_subclass_of_ranvier_error():
    assert issubclass(ranvier.ShapeError, ranvier.RanvierError)
