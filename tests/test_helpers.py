"""The test helpers themselves (tests/helpers.py): an assertion that passes everything
proves nothing, so each is shown failing where it must, with the message it promises."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_within_bound, cell_against_pytorch, random_array

import ranvier as rv


def test_within_the_bound_passes():
    want = np.array([[1.0, -2.0], [0.0, 4.0]])
    bound = np.array([[1.0, 2.0], [0.0, 4.0]])
    got = want + np.array([[1e-6, -2e-6], [0.0, 4e-6]])  # each at tol x bound
    assert_within_bound(got.astype(np.float32), want, bound, 1e-6 * (1 + 1e-9))
    assert_within_bound(np.float64(1.0 + 1e-40), 1.0, 0.0)  # the slack alone covers a tiny error


def test_beyond_the_bound_names_the_worst_element():
    want = np.zeros((3, 4))
    bound = np.ones((3, 4))
    got = want.copy()
    got[0, 1] = 2e-5  # out by 2x
    got[2, 3] = -3e-5  # out by 3x: the worst
    with pytest.raises(AssertionError) as info:
        assert_within_bound(got, want, bound, 1e-5, what="C")
    message = str(info.value)
    for part in ("C: 2 of 12 elements", "(2, 3)", "got -3e-05", "expected 0.0", "bound 1"):
        assert part in message, message


def test_a_nan_fails_however_loose_the_bound():
    got = np.array([1.0, np.nan, 3.0])
    with pytest.raises(AssertionError, match=r"1 of 3 elements.*at \(1,\): got nan"):
        assert_within_bound(got, np.array([1.0, 2.0, 3.0]), np.full(3, 1e30))


def test_a_zero_bound_allows_only_the_slack():
    with pytest.raises(AssertionError, match="the worst at"):
        assert_within_bound(np.array([1e-20]), np.array([0.0]), np.array([0.0]), 1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_within_bound(np.zeros(3), np.zeros((1, 3)), 1.0)


def _doubling_cell():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.var("x", "float32", [3, 5]) * 2.0
    y.var.out = True
    return rv.Compiler("reference").compile(flow).cell("f"), y


def test_a_cell_against_pytorch_passes_its_own_function_and_fails_another():
    cell, y = _doubling_cell()
    values = {"x": random_array([3, 5], "float32", seed=1)}
    cell_against_pytorch(cell, y, values, lambda x: 2 * x)
    with pytest.raises(AssertionError, match="15 of 15 elements"):
        cell_against_pytorch(cell, y, values, lambda x: 2.001 * x)
    with pytest.raises(AssertionError, match="elements off by more than"):  # x rounded to bf16 first: not what ran
        cell_against_pytorch(cell, y, values, lambda x: 2 * x, bf16=["x"])
