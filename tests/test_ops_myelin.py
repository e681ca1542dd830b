"""Myelin's ops that are not elementwise: Shape, Size, Rank, Count, the pooled lookups
GatherSum/GatherMax/GatherAvg and AssignAddScatter, on every backend against expectations
computed here (loops over Myelin's kernel semantics)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BACKENDS, as_f64, check, random_array, run_flow

import ranvier

TESTED_OPS = {"Shape", "Size", "Rank", "Count", "GatherSum", "GatherMax", "GatherAvg", "AssignAddScatter"}


@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 2)])
def test_shape_size_rank(shape):
    x = random_array(shape, "float32", seed=1)
    shp, size, rank = run_flow(lambda f, a: (f.shape(a), f.size(a), f.rank(a)), [x])
    check(shp, np.array(shape, dtype=np.int64).reshape(len(shape)), "int32")
    check(size, int(np.prod(shape)), "int32")
    check(rank, len(shape), "int32")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "bool"])
def test_count(dtype):
    x = random_array((4, 6, 5), "bool", seed=2) if dtype == "bool" else random_array((4, 6, 5), dtype, seed=2, low=-1, high=1)
    if dtype != "bool":
        x.reshape(-1)[::3] = 0  # zeros to leave out
    counted = x != 0
    outs = run_flow(
        lambda f, a: (f.count(a), f.count(a, 1), f.count(a, -1, "int32"), f.count(a, axis=[0, 2], keepdims=True)), [x]
    )
    check(outs[0], counted.sum(), "float32")
    check(outs[1], counted.sum(axis=1), "float32")
    check(outs[2], counted.sum(axis=-1), "int32")
    check(outs[3], counted.sum(axis=(0, 2), keepdims=True), "float32")


def _pooled_expectation(table, indices, kind):
    """Myelin's kernel: skip leading negatives, combine rows until the next negative index."""
    rows = []
    for index in indices.reshape(-1).tolist():
        if index < 0:
            if rows:
                break
            continue
        rows.append(as_f64(table[index]))
    if not rows:
        return np.zeros((1, table.shape[1]))
    stacked = np.stack(rows)
    return {"sum": stacked.sum(0), "max": stacked.max(0), "avg": stacked.mean(0)}[kind].reshape(1, -1)


INDEX_CASES = {
    "plain": [[4, 0, 2, 2, 7]],
    "padded": [[-1, -1, 3, 0, 3, -1, 5, 1]],
    "single": [[6]],
    "empty": [[-1, -1]],
    "batch": [[1, 2], [3, -1]],
}


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "float16"])
@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_pooled_gathers(case, dtype):
    table = random_array((8, 19), dtype, seed=3)
    indices = np.array(INDEX_CASES[case], np.int32)
    kinds = ["sum", "max"] + (["avg"] if dtype != "int32" else [])
    outs = run_flow(lambda f, t, i: [getattr(f, f"gather_{k}")(t, i) for k in kinds], [table, indices])
    for kind, out in zip(kinds, outs):
        check(out, _pooled_expectation(table, indices, kind), dtype)


def test_pooled_gather_out_of_range_index_is_an_error():
    for backend in BACKENDS:
        flow = ranvier.Flow()
        f = ranvier.Builder(flow, "f")
        t, i = f.var("t", "float32", [4, 3]), f.var("i", "int32", [1, 2])
        f.gather_sum(t, i).var.out = True
        data = ranvier.Compiler(backend).compile(flow).cell("f").instance()
        data[i][...] = [[1, 4]]
        with pytest.raises(ranvier.RanvierError):
            data.compute()


def _scatter_expectation(m, indices, v, oov=None):
    m = as_f64(m).copy()
    oov = None if oov is None else as_f64(oov).copy()
    for position, index in enumerate(indices.reshape(-1).tolist()):
        row = as_f64(v[position if v.shape[0] > 1 else 0])
        if index >= 0:
            m[index] += row
        elif oov is not None:
            oov += row.reshape(oov.shape)
        else:
            break
    return m, oov


SCATTER_CASES = {
    "rows": ([[2, 0, 2, 5]], 4),
    "one-value": ([[1, 3, 1]], 1),
    "ends-at-negative": ([[2, -1, 4]], 3),
    "oov": ([[2, -1, 4, -3]], 4),
}


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_assign_add_scatter(case, dtype):
    index_rows, value_rows = SCATTER_CASES[case]
    indices = np.array(index_rows, np.int32)
    m0 = random_array((6, 13), dtype, seed=5)
    v = random_array((value_rows, 13), dtype, seed=6)
    oov0 = random_array((1, 13), dtype, seed=7) if case == "oov" else None
    expected_m, expected_oov = _scatter_expectation(m0, indices, v, oov0)
    for backend in BACKENDS:
        flow = ranvier.Flow()
        f = ranvier.Builder(flow, "f")
        m, i, val = f.var("m", dtype, [6, 13]), f.var("i", "int32", list(indices.shape)), f.var("v", dtype, [value_rows, 13])
        if oov0 is None:
            f.assign_add_scatter(m, i, val)
        else:
            o = f.var("oov", dtype, [1, 13])
            f.op("AssignAddScatter", [m, i, val, o])
        data = ranvier.Compiler(backend).compile(flow).cell("f").instance()
        data[m][...], data[i][...], data[val][...] = m0, indices, v
        if oov0 is not None:
            data[o][...] = oov0
        data.compute()
        check(data[m], expected_m, dtype)
        if oov0 is not None:
            check(data[o], expected_oov, dtype)


def test_assign_add_scatter_refuses_a_reference_output():
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    m, i, v = f.var("m", "float32", [3, 2]), f.var("i", "int32", [1, 1]), f.var("v", "float32", [1, 2])
    with pytest.raises(ranvier.RanvierError, match="ref=True"):
        f.assign_add_scatter(m, i, v, True)
