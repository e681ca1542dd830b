"""AssignSlice: writing rows of a resident variable in place at a position known at run time."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_mentions, random_array, shape_error

import ranvier as rv

TESTED_OPS = {"AssignSlice"}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "float16"])
@pytest.mark.parametrize("axis,start", [(1, 0), (1, 3), (1, 6), (0, 2)])
def test_assign_slice_writes_only_its_rows(backend, dtype, axis, start):
    initial = random_array([4, 8, 5], dtype, seed=1)
    value_shape = [3, 8, 5] if axis == 0 else [4, 3, 5]
    value = random_array(value_shape, dtype, seed=2)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    target = f.parameter("target", initial)
    v = f.var("v", dtype, value_shape)
    position = f.var("position", "int32", [])
    f.op("AssignSlice", [target, v, position], None, {"axis": axis})
    network = rv.Compiler(backend).compile(flow)
    data = network.cell("f").instance()
    data[v], data[position] = value, start
    data.compute()
    expected = initial.copy()
    count = min(value.shape[axis], initial.shape[axis] - start)  # rows past the end are dropped
    index = [slice(None)] * 3
    index[axis] = slice(start, start + count)
    taken = [slice(None)] * 3
    taken[axis] = slice(0, count)
    expected[tuple(index)] = value[tuple(taken)]
    np.testing.assert_array_equal(network["f/target"], expected)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_assign_slice_start_out_of_range_is_an_error(backend):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    target = f.parameter("target", np.ones((2, 4), np.float32))
    position = f.var("position", "int32", [])
    f.op("AssignSlice", [target, f.const(np.zeros((2, 1), np.float32)), position], None, {"axis": 1})
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    data[position] = 4
    with pytest.raises(rv.RanvierError, match="AssignSlice"):
        data.compute()


def test_assign_slice_shape_errors():
    message = shape_error(lambda f, t, v, s: f.op("AssignSlice", [t, v, s], None, {"axis": 1}),
                          [("t", "float32", [2, 4]), ("v", "float32", [3, 1]), ("s", "int32", [])])
    assert_mentions(message, "AssignSlice", "shaped like the target except along axis 1")
