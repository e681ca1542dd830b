"""Window primitives (Pad, StridedView, StridedScatterAdd) against numpy, on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FLOATS, NUMERIC, assert_mentions, check, random_array, run1, shape_error

import ranvier as rv
from ranvier.backends.cpu import views

TESTED_OPS = {"Pad", "StridedView", "StridedScatterAdd"}


@pytest.mark.parametrize("dtype", NUMERIC)
def test_pad(dtype):
    x = random_array([3, 5, 2], dtype, seed=1)
    got = run1(lambda f, t: f.op("Pad", [t], None, {"before": [1, 0, 2], "after": [2, 3, 0], "value": 7}), x)
    expected = np.full((6, 8, 4), 7, dtype=x.dtype)
    expected[1:4, 0:5, 2:4] = x
    check(got, expected, dtype)


@pytest.mark.parametrize("dtype", (*FLOATS, "int32"))
def test_strided_view_reads_overlapping_windows(dtype):
    x = random_array([3, 11], dtype, seed=2)
    got = run1(lambda f, t: f.op("StridedView", [t], None, {"offset": 2, "shape": [2, 4, 3], "strides": [11, 2, 1]}), x)
    flat = x.reshape(-1)
    expected = np.array([[[flat[2 + r * 11 + w * 2 + k] for k in range(3)] for w in range(4)] for r in range(2)])
    check(got, expected, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_strided_scatter_add_sums_overlaps(dtype):
    d = random_array([2, 4, 3], dtype, seed=3)
    got = run1(lambda f, t: f.op("StridedScatterAdd", [t], None, {"offset": 2, "shape": [2, 4, 3], "strides": [11, 2, 1], "target_shape": [3, 11]}), d)
    expected = np.zeros(33, dtype=np.float64)
    for r in range(2):
        for w in range(4):
            for k in range(3):
                expected[2 + r * 11 + w * 2 + k] += d[r, w, k]
    check(got, expected.reshape(3, 11).astype(d.dtype), dtype)


def test_window_shape_errors():
    message = shape_error(lambda f, x: f.op("StridedView", [x], None, {"offset": 5, "shape": [2, 3], "strides": [4, 1]}), [("x", "float32", [2, 4])])
    assert_mentions(message, "StridedView", "f/StridedView", "x: float32[2x4]", "inside the 8 elements")
    message = shape_error(lambda f, x: f.op("Pad", [x], None, {"before": [1], "after": [0, 0]}), [("x", "float32", [2, 4])])
    assert_mentions(message, "Pad", "attribute before with 2 integers")
    message = shape_error(
        lambda f, d: f.op("StridedScatterAdd", [d], None, {"shape": [2, 2], "strides": [4, 1], "target_shape": [2, 4]}),
        [("d", "float32", [3, 2])],
    )
    assert_mentions(message, "StridedScatterAdd", "updates of the view's shape [2, 2]")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape,strides,target", [
    ([3, 2, 2, 3, 3, 3], [98, 49, 7, 1, 14, 2], [3, 2, 7, 7]),  # a convolution's taps onto its images: each image a part's
    ([4, 5], [3, 1], [14]),  # rows that overlap one another: one part adds them all
], ids=["images apart", "rows overlapping"])
def test_strided_scatter_add_shared_over_parts(shape, strides, target, dtype, monkeypatch):
    """A scatter is shared out over the cores by its outermost dimension only where the
    slices along it lie apart; overlaps within a slice add up as on one core."""
    monkeypatch.setattr(views, "thread_count", lambda: 2)
    monkeypatch.setattr(views, "worth_splitting", lambda flops=0, nbytes=0: True)
    assert views._slices_apart(shape, strides) == (len(shape) > 2)
    d = random_array(shape, dtype, seed=4)
    attrs = {"offset": 0, "shape": shape, "strides": strides, "target_shape": target}
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    updates = f.var("d", dtype, shape)
    out = f.op("StridedScatterAdd", [updates], None, attrs)
    out.var.out = True
    data = rv.Compiler("cpu", cache=False).compile(flow).cell("f").instance()
    data[updates], data[out] = d, np.full(target, np.nan, dtype)
    data.compute()
    expected = np.zeros(int(np.prod(target)))
    index = np.lib.stride_tricks.as_strided(np.arange(expected.size), shape, [s * 8 for s in strides])
    np.add.at(expected, index.reshape(-1), d.reshape(-1).astype(np.float64))
    check(np.array(data[out]), expected.reshape(target).astype(dtype), dtype)
