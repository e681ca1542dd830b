"""The CPU backend against the reference backend: every CPU-feature variant, fused
patterns, training steps, the compile cache, the Python fallback and runtime errors.

Every op test in test_ops_* already runs on the cpu backend with the host's features;
this file forces the lesser variants (`cpu="-avx512"`, `cpu="-avx512,-avx2"`), checks
that the masked target is really what the code is generated for, and covers what the
op tests do not: fusion, whole training steps, the cache and failure paths.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from helpers import TOLERANCES, as_f64, random_array

import ranvier as rv
from ranvier.backends.cpu.target import host_target

MASKS = ["", "-avx512", "-avx512,-avx2"]  # each variant: avx512, avx2, sse (on a host that has them)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Generated code goes to a cache of this test session, never the user's."""
    monkeypatch.setenv("RANVIER_CACHE", str(tmp_path_factory.getbasetemp() / "ranvier-cache"))


# ---- helpers -----------------------------------------------------------------------------


def expected_variant(mask: str) -> str:
    """What the kernels of a masked host must print: the host's variant, capped by the mask."""
    host = host_target("").variant
    order = ["sse", "avx2", "avx512"]
    cap = {"": "avx512", "-avx512": "avx2", "-avx512,-avx2": "sse"}[mask]
    return order[min(order.index(host), order.index(cap))]


def build_flow(build, inputs):
    """A flow with function "f" whose inputs are the arrays of `inputs` (a name → array dict)."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(name, rv.dtypes.from_numpy(a.dtype), a.shape) for name, a in inputs.items()]
    built = build(f, *handles)
    outputs = list(built) if isinstance(built, (tuple, list)) else [built]
    for t in outputs:
        t.var.out = True
    return flow, handles, outputs


_STEP_LINE = re.compile(r"^\s+(?:\S.* = )?(\w+)\[(\w+)\]\(", re.MULTILINE)


def printed_steps(cell) -> list[tuple[str, str]]:
    """(kernel, variant) of every step line of the printed cell, e.g. ("Calculate", "avx2")."""
    return _STEP_LINE.findall(str(cell))


def compute(network, handles, outputs, arrays):
    instance = network.cell("f").instance()
    for h, a in zip(handles, arrays):
        if h.var.consumers:
            instance[h] = a
    instance.compute()
    return [np.array(instance[t]) for t in outputs]


def assert_close(actual, expected, dtype, what, scale=4.0):
    if rv.dtypes.is_float(dtype):
        rtol, atol = TOLERANCES[dtype]
        np.testing.assert_allclose(as_f64(actual), as_f64(expected), rtol=scale * rtol, atol=scale * atol, equal_nan=True, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def on_cpu(build, inputs: dict, mask: str = "", scale: float = 4.0, cache: bool = True):
    """Compile `build` for the masked cpu and the reference, compare every output, and check
    that every step runs natively in the mask's variant. Returns the cpu cell."""
    flow, handles, outputs = build_flow(build, inputs)
    arrays = list(inputs.values())
    reference = compute(rv.Compiler("reference").compile(flow), handles, outputs, arrays)
    network = rv.Compiler("cpu", cpu=mask, cache=cache).compile(flow)
    got = compute(network, handles, outputs, arrays)
    for t, g, want in zip(outputs, got, reference):
        assert g.dtype == want.dtype and g.shape == want.shape, t.name
        assert_close(g, want, t.dtype, f"{t.name} with cpu={mask!r}", scale)
    cell = network.cell("f")
    variant = expected_variant(mask)
    for step in cell.steps:
        assert step.variant != "python", f"{step} fell back to Python with cpu={mask!r}"
        assert step.variant == variant, f"{step}: expected [{variant}] with cpu={mask!r}"
    printed = printed_steps(cell)
    assert len(printed) == len(cell.steps) and {v for _, v in printed} == {variant}, str(cell)
    return cell


def data(shape, dtype="float32", seed=0, low=-3.0, high=3.0):
    return random_array(shape, dtype, seed=seed, low=low, high=high)


# ---- 1. every CPU variant ----------------------------------------------------------------------

@pytest.mark.parametrize("mask", MASKS)
def test_masks_pick_the_variant(mask):
    target = host_target(mask)
    assert target.variant == expected_variant(mask)
    if mask:
        assert not {f for f in target.feature_set if f.startswith("avx512")}
    if "-avx2" in mask:
        assert not {"avx2", "fma", "avxvnni", "avxifma"} & target.feature_set


@pytest.mark.parametrize("mask", MASKS)
def test_fused_broadcast_chain_is_one_calculate(mask):
    def build(f, x, row, col, s):
        return f.sigmoid(((x * row + col) * s - row).tanh() * x + 1.25) / (f.exp(x) + col)

    inputs = {"x": data([37, 13]), "row": data([13], seed=1), "col": data([37, 1], seed=2, low=0.5, high=2), "s": np.array(0.75, np.float32)}
    cell = on_cpu(build, inputs, mask)
    assert [s.kernel for s in cell.steps] == ["Calculate"], str(cell)


UNARY = ["exp", "log", "tanh", "sigmoid", "erf", "sin", "cos", "silu", "gelu", "gelu_tanh", "sqrt", "rsqrt", "rcp"]
POSITIVE = {"log", "sqrt", "rsqrt"}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_unary_math(mask, dtype):
    """One cell per op (one function each), so each stays its own kernel."""
    flow = rv.Flow()
    cases = []
    for k, name in enumerate(UNARY):
        f = rv.Builder(flow, f"f{k}")
        low, high = (0.05, 9.0) if name in POSITIVE else (-8.0, 8.0)
        array = data([67], dtype, seed=k, low=low, high=high)
        x = f.var("x", dtype, array.shape)
        if name == "gelu":
            y = f.gelu(x)
        elif name == "gelu_tanh":
            y = f.gelu(x, approximate="tanh")
        else:
            y = getattr(f, name)(x)
        y.var.out = True
        cases.append((f"f{k}", name, x, y, array))
    networks = {b: rv.Compiler(b, cpu=mask) if b == "cpu" else rv.Compiler(b) for b in ("cpu", "reference")}
    compiled = {b: c.compile(flow) for b, c in networks.items()}
    variant = expected_variant(mask)
    for func, name, x, y, array in cases:
        results = {}
        for backend, network in compiled.items():
            instance = network.cell(func).instance()
            instance[x] = array
            instance.compute()
            results[backend] = np.array(instance[y])
        assert_close(results["cpu"], results["reference"], dtype, f"{name} {dtype} cpu={mask!r}")
        steps = compiled["cpu"].cell(func).steps
        assert len(steps) == 1 and steps[0].variant == variant and steps[0].kernel == "Elementwise", f"{name}: {steps[0]}"


BINARY = ["add", "sub", "mul", "div", "pow", "minimum", "maximum"]


@pytest.mark.parametrize("mask", MASKS)
def test_binary_ops_broadcast(mask):
    def build(f, x, row, col, n, m):
        outs = [getattr(f, op)(x, row) for op in BINARY[:4]]
        outs.append(f.pow(f.abs(x) + 0.5, col))
        outs += [f.minimum(x, col), f.maximum(row, x)]
        outs += [f.less(x, row), f.greater_equal(col, x), f.equal(n, m), f.div(n, m), f.maximum(n, m) - m]
        return outs

    inputs = {
        "x": data([37, 13]), "row": data([13], seed=1), "col": data([37, 1], seed=2),
        "n": data([7, 13], "int32", seed=3, low=-50, high=50), "m": data([13], "int32", seed=4, low=-7, high=7),
    }
    cell = on_cpu(build, inputs, mask)
    assert "Elementwise" in {s.kernel for s in cell.steps}


@pytest.mark.parametrize("mask", MASKS)
def test_casts(mask):
    types = ["float32", "float16", "bfloat16", "int32", "bool"]

    def build(f, x, n, p):
        outs = []
        for source in (x, n, p):
            for target in types:
                if target != source.dtype:
                    outs.append(f.cast(source, target))
        return outs

    inputs = {"x": data([67], "float32", low=-40, high=40), "n": data([67], "int32", seed=1, low=-300, high=300), "p": data([67], "bool", seed=2)}
    on_cpu(build, inputs, mask)
    # Half precision in, everything else out.
    halves = {"h": data([37], "float16", seed=3, low=-40, high=40), "g": data([37], "bfloat16", seed=4, low=-40, high=40)}
    on_cpu(lambda f, h, g: [f.cast(h, t) for t in types if t != "float16"] + [f.cast(g, t) for t in types if t != "bfloat16"], halves, mask)


@pytest.mark.parametrize("mask", MASKS)
def test_reductions(mask):
    def build(f, x, y):
        outs = []
        for op in ("sum", "mean", "max", "min"):
            reduce = getattr(f, op)
            outs += [reduce(x, axis=0), reduce(x, axis=2), reduce(x, axis=1, keepdims=True), reduce(x), reduce(y, axis=-1, keepdims=True)]
        outs += [f.argmax(x, axis=-1), f.argmax(x, axis=1), f.argmax(y, axis=0)]
        return outs

    cell = on_cpu(build, {"x": data([7, 13, 37]), "y": data([37, 67], "float64", seed=1)}, mask)
    assert {s.kernel for s in cell.steps} == {"Reduce", "ArgReduce"}


@pytest.mark.parametrize("mask", MASKS)
def test_row_kernels(mask):
    def build(f, x, gamma, beta, labels, probs):
        return [
            f.softmax(x), f.log_softmax(x), f.softmax(x, axis=0), f.log_softmax(x, axis=0),
            f.layer_norm(x, gamma, beta), f.rms_norm(x, gamma),
            f.softmax_cross_entropy(x, labels), f.softmax_cross_entropy(x, labels, label_smoothing=0.1),
            f.softmax_cross_entropy(x, probs), f.softmax_cross_entropy(x, probs, label_smoothing=0.2),
        ]

    rows, n = 13, 37
    probs = np.random.default_rng(5).random((rows, n)).astype(np.float32)
    probs /= probs.sum(-1, keepdims=True)
    inputs = {
        "x": data([rows, n], low=-6, high=6), "gamma": data([n], seed=1), "beta": data([n], seed=2),
        "labels": np.random.default_rng(3).integers(0, n, rows).astype(np.int32), "probs": probs,
    }
    cell = on_cpu(build, inputs, mask)
    kernels = {s.kernel for s in cell.steps}
    assert {"SoftmaxRow", "LogSoftmaxRow", "LayerNormRow", "RMSNormRow", "CrossEntropyRow"} <= kernels


def test_work_is_cut_into_near_equal_aligned_shares():
    from ranvier.backends.cpu.parallel import shares

    assert shares(10, 2) == [(0, 5), (5, 10)]
    assert shares(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert shares(100, 2, 16) == [(0, 64), (64, 100)]
    assert shares(5, 4, 16) == [(0, 5)]
    assert shares(1, 8) == [(0, 1)]


def test_split_thresholds_survive_a_spinning_job_measured_as_free(monkeypatch):
    """A job with the workers spinning costs ~0.1 µs, near the timer's noise: a
    measurement of 0 must not make every tiny kernel split (it was once kept at 8 KiB)."""
    from ranvier.backends.cpu import parallel
    from ranvier.backends.cpu.pool import pool

    monkeypatch.setattr(type(pool()), "job_seconds", lambda self, parts, asleep: 10e-6 if asleep else 0.0)
    measured = parallel._measure(2)
    assert measured.spin_seconds == 50e-9
    work = parallel.SPLIT_FACTOR * (10e-6 * 50e-9) ** 0.5
    assert measured.nbytes == parallel._power_of_two(work * measured.core_bytes_per_second)


@pytest.mark.parametrize("mask", MASKS)
def test_row_kernels_shared_out_over_threads(mask):
    """Rows of a large op run on several threads; each row is still computed whole."""
    from ranvier.backends.cpu.parallel import split_thresholds, thread_count

    def build(f, x, gamma, labels):
        return [f.softmax(x), f.rms_norm(x, gamma), f.softmax_cross_entropy(x, labels)]

    rows, n = 257, split_thresholds().nbytes // 4 // 256 + 3
    inputs = {
        "x": data([rows, n], low=-6, high=6), "gamma": data([n], seed=1),
        "labels": np.random.default_rng(3).integers(0, n, rows).astype(np.int32),
    }
    cell = on_cpu(build, inputs, mask, cache=False)
    if thread_count() > 1:
        assert re.search(r"^step\d+_part\d*:", cell.asm(), re.MULTILINE)


@pytest.mark.parametrize("mask", MASKS)
def test_cross_entropy_and_its_gradient_fuse_into_one_kernel(mask):
    """The loss and its gradient on the same logits: one kernel writes both."""
    def build(f, x, labels, probs, upstream):
        results = []
        for target in (labels, probs):
            for smoothing in (0.0, 0.1):
                attrs = {"label_smoothing": smoothing or None}
                results.append(f.op("SoftmaxCrossEntropy", [x, target], None, attrs))
                results.append(f.op("SoftmaxCrossEntropyGrad", [x, target, upstream], None, attrs))
        return results

    rows, n = 13, 37
    probs = np.random.default_rng(5).random((rows, n)).astype(np.float32)
    probs /= probs.sum(-1, keepdims=True)
    inputs = {
        "x": data([rows, n], low=-6, high=6), "labels": np.random.default_rng(3).integers(0, n, rows).astype(np.int32),
        "probs": probs, "upstream": data([rows], seed=4),
    }
    cell = on_cpu(build, inputs, mask)
    assert [s.kernel for s in cell.steps] == ["CrossEntropyGradRow"] * 4
    assert all(len(s.op.outputs) == 2 for s in cell.steps)


@pytest.mark.parametrize("mask", MASKS)
def test_large_maps_shared_out_over_threads(mask):
    """Elementwise maps over many bytes run on several threads, split by their outermost
    dimension (a flat one on vector boundaries): broadcasts, transposes and odd tails."""
    from ranvier.backends.cpu.parallel import split_thresholds, thread_count

    def build(f, x, flat, row):
        return [f.tanh(x * row + 1.5), f.transpose(x, [1, 0]), f.sigmoid(flat) * flat]

    # the transpose's output has n rows, shared out a vector's lanes (16 at most) at a time:
    # at least two parts' worth, whatever threshold this machine measured
    rows, n = 1031, max(2 * 16 + 5, split_thresholds().nbytes // 4 // 1024 + 5)
    inputs = {"x": data([rows, n]), "flat": data([rows * n + 7], seed=1), "row": data([n], seed=2)}
    cell = on_cpu(build, inputs, mask, cache=False)
    if thread_count() > 1:
        assert len(re.findall(r"^step\d+_part\d*:", cell.asm(), re.MULTILINE)) >= 3


@pytest.mark.parametrize("denormals", ["keep", "flush"])
def test_denormals_kept_or_flushed_on_every_thread(denormals):
    """A map large enough to be shared out over the pool, on values that are or become
    subnormal: kept, every element is numpy's; flushed, every subnormal input counts as 0
    and every subnormal result is 0, in the parts the workers ran too. The calling
    thread's own mode is as it was after the compute: numpy still makes subnormals."""
    from ranvier.backends.cpu.parallel import split_thresholds

    n = split_thresholds().nbytes // 4 + 4099
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(n) * np.where(np.arange(n) % 2, 1e-39, 1.0)).astype(np.float32)  # every other one subnormal
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    xv = f.var("x", "float32", [n])
    y = f.add(xv * 1e-3, xv, name="y")
    instance = rv.Compiler("cpu", denormals=denormals).compile(flow).cell("f").instance()
    instance[xv] = x
    instance.compute()
    got = np.asarray(instance[y])
    tiny = np.abs(x) < np.finfo(np.float32).tiny
    if denormals == "keep":
        np.testing.assert_array_equal(got, x * np.float32(1e-3) + x)
        assert np.count_nonzero(got[tiny]) == np.count_nonzero(x[tiny])
    else:
        assert not np.any(got[tiny]), "a subnormal input was read as itself"
        np.testing.assert_array_equal(got[~tiny], x[~tiny] * np.float32(1e-3) + x[~tiny])
    assert np.float32(1e-39) * np.float32(1.0) != 0, "the compute left the calling thread flushing denormals"


def test_unknown_denormals_mode_is_named():
    with pytest.raises(rv.RanvierError, match="unknown denormals mode 'zero'; available: keep, flush"):
        rv.Compiler("cpu", denormals="zero")


@pytest.mark.parametrize("mask", MASKS)
def test_matmul(mask):
    def build(f, a, b, at, bt, batch, other, d, e, h, g):
        return [
            f.matmul(a, b), f.matmul(at, b, transpose_a=True), f.matmul(a, bt, transpose_b=True),
            f.matmul(at, bt, transpose_a=True, transpose_b=True), f.matmul(batch, b), f.matmul(batch, other),
            f.matmul(other, batch, transpose_a=True, transpose_b=True), f.matmul(d, e), f.matmul(h, g, transpose_b=True),
        ]

    inputs = {
        "a": data([7, 13]), "b": data([13, 37], seed=1), "at": data([13, 7], seed=2), "bt": data([37, 13], seed=3),
        "batch": data([3, 1, 7, 13], seed=4), "other": data([4, 13, 7], seed=11),
        "d": data([2, 7, 13], "float64", seed=5), "e": data([13, 5], "float64", seed=6),
        "h": data([3, 7, 13], "int32", seed=7, low=-9, high=9), "g": data([3, 5, 13], "int32", seed=8, low=-9, high=9),
    }
    cell = on_cpu(build, inputs, mask)
    assert {"BlasGemm", "LoopMatMul"} <= {s.kernel for s in cell.steps}
    half = {"p": data([7, 13], "float16", seed=9), "q": data([13, 5], "float16", seed=10)}
    cell = on_cpu(lambda f, p, q: f.matmul(p, q), half, mask, scale=8.0)
    assert [s.kernel for s in cell.steps] == ["LoopMatMul"]


@pytest.mark.parametrize("mask", MASKS)
def test_indexing(mask):
    def build(f, table, ids, rows, updates):
        return [f.gather(table, ids), f.scatter_add(rows, updates, 11), f.one_hot(ids, 13), f.one_hot(rows, 11, dtype="float64")]

    rng = np.random.default_rng(7)
    inputs = {
        "table": data([13, 37]), "ids": rng.integers(0, 13, [5, 3]).astype(np.int32),
        "rows": rng.integers(0, 11, [67]).astype(np.int64), "updates": data([67, 7], seed=1),
    }
    cell = on_cpu(build, inputs, mask)
    assert {"Gather", "ScatterAdd", "OneHot"} <= {s.kernel for s in cell.steps}


@pytest.mark.parametrize("mask", MASKS)
def test_data_movement(mask):
    def build(f, x, y, z):
        t = f.transpose(x, [2, 0, 1])
        s = f.slice(x, [1, 2, 3], [5, 9, 30])
        c = f.concat([x, y], axis=1)
        parts = f.split(z, [3, 4], axis=-1)
        return [t, s, c, *parts, f.broadcast_to(f.reshape(z, [7, 1, 7]), [7, 13, 7]), f.transpose(y)]

    on_cpu(build, {"x": data([7, 13, 37]), "y": data([7, 5, 37], seed=1), "z": data([7, 7], "float64", seed=2)}, mask)


def _halfway_values():
    """Every half, and floats at, just above and just below every point halfway between two halves."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = np.sort(halves[np.isfinite(halves)].astype(np.float64))
    midpoints = (finite[1:] + finite[:-1]) / 2
    with np.errstate(all="ignore"):
        doubles = np.concatenate([
            halves.astype(np.float64), midpoints, midpoints * (1 + 2.0**-40), midpoints * (1 - 2.0**-40),
            [65519.99, 65520, 1e30, -1e30, 1e300, 2.0**-25, 2.0**-26, 1e-40, 1e-300, 0.0, -0.0],
            np.random.default_rng(0).standard_normal(4099) * 10.0 ** np.random.default_rng(1).integers(-9, 6, 4099),
        ])
        singles = doubles.astype(np.float32)
        singles = np.concatenate([singles, np.nextafter(midpoints.astype(np.float32), np.float32(np.inf)),
                                  np.nextafter(midpoints.astype(np.float32), -np.float32(np.inf))])
    return halves, singles, doubles


@pytest.mark.parametrize("mask", MASKS)
def test_half_conversions_round_exactly(mask):
    """float16 conversions round exactly as numpy does: in integer code without F16C (the
    sse variant), and from float64 without rounding twice through float32."""
    halves, singles, doubles = _halfway_values()
    for source, target, values in (("float16", "float32", halves), ("float32", "float16", singles), ("float64", "float16", doubles)):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        x = f.var("x", source, [values.size])
        y = f.cast(x, target)
        y.var.out = True
        cell = rv.Compiler("cpu", cpu=mask).compile(flow).cell("f")
        assert cell.steps[0].variant == expected_variant(mask)
        instance = cell.instance()
        instance[x] = values
        instance.compute()
        with np.errstate(all="ignore"):
            want = values.astype(target)
        got = np.array(instance[y])
        bits = np.uint16 if target == "float16" else np.uint32
        same = (got.view(bits) == want.view(bits)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), f"{source}→{target}: {values[~same][:5]} gave {got[~same][:5]}, numpy {want[~same][:5]}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_scatter_add_sums_in_float32(dtype):
    """Many updates of one row: rounding after every add would stall a bfloat16 sum at 256."""
    rng = np.random.default_rng(0)
    inputs = {"rows": rng.integers(0, 3, [2000]).astype(np.int32), "updates": data([2000, 5], dtype, seed=2, low=0.1, high=1)}
    flow, handles, outputs = build_flow(lambda f, i, u: f.scatter_add(i, u, 3), inputs)
    got = compute(rv.Compiler("cpu").compile(flow), handles, outputs, list(inputs.values()))[0]
    want = np.zeros((3, 5), np.float64)
    np.add.at(want, inputs["rows"], inputs["updates"].astype(np.float64))
    assert_close(got, want.astype(got.dtype), dtype, "ScatterAdd")


def test_integer_division_by_zero_does_not_trap():
    """x/0 is 0 and MIN/−1 wraps, as the reference computes; native sdiv would raise SIGFPE."""

    def build(f, a, b, c, d):
        return [f.div(a, b), f.div(c, d)]

    inputs = {
        "a": np.array([7, -7, 5, -(2**31), 3, 0, -(2**31)] * 3, np.int32),
        "b": np.array([2, 2, 0, -1, -1, 0, 1] * 3, np.int32),
        "c": np.array([7, 0, 255, 9] * 5, np.uint8),
        "d": np.array([2, 0, 0, 3] * 5, np.uint8),
    }
    for mask in MASKS:
        on_cpu(build, inputs, mask)


def _representative_cell(mask):
    def build(f, x, row, n, m, ids, table):
        return [
            (f.exp(x * row) + f.erf(x)).tanh(), f.cast(n, "float32") * row, n * m + m, f.sum(x, axis=0),
            f.softmax(x), f.gather(table, ids), f.cast(f.cast(x, "float16"), "float32"), f.cast(x, "int32") + n,
            f.matmul(x, table, transpose_b=True), f.div(n, m),
        ]

    inputs = {
        "x": data([37, 67]), "row": data([67], seed=1), "n": data([37, 67], "int32", seed=2, low=-100, high=100),
        "m": data([67], "int32", seed=3, low=-100, high=100), "ids": np.arange(0, 13, 2, dtype=np.int32),
        "table": data([13, 67], seed=4),
    }
    return on_cpu(build, inputs, mask)


@pytest.mark.parametrize("mask", MASKS)
def test_generated_code_calls_no_runtime_library(mask):
    """Every call the generated code makes goes through the pointer table (BLAS, the
    fallback, the worker pool): a libcall such as __extendhfsf2 would resolve to
    nothing and crash."""
    asm = _representative_cell(mask).asm()
    symbols = set(re.findall(r"(?:movabsq\s+\$|call[lq]?\s+)([A-Za-z_][\w.@]*)", asm))
    external = sorted(s for s in symbols if not re.fullmatch(r"step\d+(_part\d*)?", s))
    assert not external, f"cpu={mask!r} code references {external}"


# Instructions that need AVX2 or FMA: FMA, integer ops on ymm, AVX2 permutes and broadcasts, gathers.
_AVX2_ONLY = re.compile(
    r"^\s*(vfn?m(add|sub)\w*|vpbroadcast\w*|vpermd|vpermq|vperm2i128|vinserti128|vextracti128|vp?gather\w*"
    r"|vp(?!ermil|test)\w+\s[^\n]*%ymm)",
    re.MULTILINE,
)


@pytest.mark.parametrize("mask", [
    "-avx512",
    "-avx512,-avx2",
])
def test_masked_code_uses_no_masked_instructions(mask):
    """The machine code itself: no zmm registers without AVX-512, no AVX2/FMA instructions without AVX2."""
    asm = _representative_cell(mask).asm()
    assert "%zmm" not in asm, f"AVX-512 registers in code generated for cpu={mask!r}"
    if mask == "-avx512,-avx2":
        found = sorted({m.group(0).strip() for m in _AVX2_ONLY.finditer(asm)})
        assert not found, f"AVX2/FMA instructions in code generated for cpu={mask!r}: {found[:5]}"


# ---- 2. fused patterns ----------------------------------------------------------------------------


def test_fused_chain_prints_one_calculate():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [37, 13])
    b = f.var("b", "float32", [13])
    y = ((x * 2 + b).tanh() - x).exp()
    y.var.out = True
    cell = rv.Compiler("cpu").compile(flow).cell("f")
    text = str(cell)
    assert printed_steps(cell) == [("Calculate", expected_variant(""))], text
    assert len(cell.steps) == 1
    (line,) = [line for line in text.splitlines() if "Calculate[" in line]
    for op in ("Mul", "Add", "Tanh", "Sub", "Exp"):  # the whole chain, in one loop
        assert f"{op}(" in line, line
    instance = cell.instance()
    xs, bs = data([37, 13], seed=1, low=-1, high=1), data([13], seed=2, low=-1, high=1)
    instance[x], instance[b] = xs, bs
    instance.compute()
    np.testing.assert_allclose(instance[y], np.exp(np.tanh(xs * 2 + bs) - xs), rtol=2e-6, atol=1e-6)


def _classifier(model, example_shape, backend, batch=16, lr=0.01, mask=None, monkeypatch=None):
    from ranvier.train import trainer as trainer_module
    from ranvier.train.classifier import build_classifier
    from ranvier.train.optimizers import Adam

    options = {}
    if mask:
        if "cpu" in inspect.signature(trainer_module.Trainer).parameters:
            options["cpu"] = mask
        else:
            monkeypatch.setattr(trainer_module, "Compiler", lambda name, **kw: rv.Compiler(name, **{**kw, "cpu": mask}))
    setup = build_classifier(model, example_shape, batch, eval_batch=batch)
    return trainer_module.Trainer(setup.loss, setup.params, Adam(lr=lr), inputs=[setup.x, setup.labels], backend=backend, **options)


def _batches(example_shape, classes, steps, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, *example_shape)).astype(np.float32), rng.integers(0, classes, batch).astype(np.int32))
        for _ in range(steps)
    ]


def _train_both(make_model, example_shape, classes, steps, mask=None, monkeypatch=None):
    batches = _batches(example_shape, classes, steps)
    runs = {}
    for backend in ("reference", "cpu"):
        trainer = _classifier(make_model(), example_shape, backend, mask=mask if backend == "cpu" else None, monkeypatch=monkeypatch)
        losses = [trainer.step(list(batch)) for batch in batches]
        runs[backend] = (trainer, losses, {k: np.array(v) for k, v in trainer.network.parameters().items()})
    (_, ref_losses, ref_params), (trainer, losses, params) = runs["reference"], runs["cpu"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    assert params.keys() == ref_params.keys() and params
    for name in params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-4, atol=1e-5, err_msg=name)
    initial = make_model().initial
    moved = [name for name in params if not np.allclose(params[name], initial[name.split("/", 1)[1]])]
    assert moved == sorted(params) or set(moved) == set(params), "some parameters were never updated"
    return trainer


def test_adam_update_folds_into_calculate():
    from ranvier.models import MLP
    from ranvier.ops import written_inputs

    trainer = _train_both(lambda: MLP([7, 13, 3], activation="gelu"), [7], 3, 3)
    cell = trainer.cell
    assert not [s for s in cell.steps if s.kernel == "Assign"], str(cell)
    written = {v.name for s in cell.steps if s.kernel == "Calculate" for v in written_inputs(s.op)}
    params = set(trainer.network.parameters())
    assert params <= written, f"parameters not updated in place by a Calculate: {sorted(params - written)}"
    kernels = [kernel for kernel, _ in printed_steps(cell)]
    assert "Calculate" in kernels and "Assign" not in kernels


def test_gelu_and_its_gradient_share_one_erf():
    """In a training step the forward GELU is built from the gradient's own Φ (constants
    equal by value are one constant to CSE), so the fused kernel evaluates erf once."""
    from ranvier.models import MLP

    trainer = _train_both(lambda: MLP([7, 13, 3], activation="gelu"), [7], 3, 3)
    expressions = [s.op.attrs.get("expr", "") for s in trainer.cell.steps]
    assert sum(e.count("Erf(") + e.count("Gelu(") for e in expressions) == 1, str(trainer.cell)


# ---- 3. training steps of each model ------------------------------------------------------------


@pytest.mark.parametrize("mask", MASKS)
def test_mlp_training_step_matches_reference(mask, monkeypatch):
    from ranvier.models import MLP

    trainer = _train_both(lambda: MLP([37, 13, 7], activation="gelu"), [37], 7, 5, mask=mask, monkeypatch=monkeypatch)
    variant = expected_variant(mask)
    assert {s.variant for s in trainer.cell.steps} <= {variant, "python"}
    assert variant in {s.variant for s in trainer.cell.steps}


def test_cnn_training_step_matches_reference():
    from ranvier.models import CNN

    trainer = _train_both(lambda: CNN(input_shape=(1, 12, 12), channels=(4,), kernel=3, classes=3), [1, 12, 12], 3, 5)
    assert all(s.variant != "python" for s in trainer.cell.steps), str(trainer.cell)  # one native function


# ---- 4. compile cache ---------------------------------------------------------------------------

_CACHE_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ranvier as rv

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [37, 13])
    y = (x * 2.0).tanh() + f.sigmoid(x)
    y.var.out = True
    cell = rv.Compiler("cpu", cpu=sys.argv[1]).compile(flow).cell("f")
    instance = cell.instance()
    a = np.linspace(-3, 3, 37 * 13, dtype=np.float32).reshape(37, 13)
    instance[x] = a
    instance.compute()
    assert np.allclose(instance[y], np.tanh(2 * a) + 1 / (1 + np.exp(-a)), rtol=1e-5, atol=1e-6)
    print(cell.native.origin)
    """
)


def _compile_in_subprocess(cache: Path, mask: str = "") -> str:
    env = dict(os.environ, RANVIER_CACHE=str(cache), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, mask], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_compile_cache_across_processes(tmp_path):
    cache = tmp_path / "cache"
    assert _compile_in_subprocess(cache) == "compiled"
    files = set(cache.glob("*"))  # the cell's code, this machine's split thresholds and their lock
    assert all(file.stat().st_size > 0 for file in files if file.suffix != ".lock")
    assert len(list(cache.glob("*.o"))) == 1 and len(list(cache.glob("*.lock"))) == 1
    assert _compile_in_subprocess(cache) == "disk"
    assert set(cache.glob("*")) == files
    assert _compile_in_subprocess(cache, "-avx512") == "compiled"  # other CPU features, other code
    assert len(set(cache.glob("*")) - files) == 1


def test_compile_cache_in_memory(tmp_path, monkeypatch):
    from ranvier.backends import compile_cache

    monkeypatch.setenv("RANVIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_cache, "_MEMORY_CACHE", OrderedDict())  # what earlier tests compiled does not count
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [13, 7])
    y = f.softmax(x * 3.0 + 0.25)
    y.var.out = True
    first = rv.Compiler("cpu", cpu="-avx512").compile(flow).cell("f")
    second = rv.Compiler("cpu", cpu="-avx512").compile(flow).cell("f")
    assert first.native.origin == "compiled" and second.native.origin == "memory"
    for cell in (first, second):
        instance = cell.instance()
        instance[x] = data([13, 7])
        instance.compute()
        np.testing.assert_allclose(instance[y].sum(-1), 1.0, rtol=1e-5)


@pytest.mark.slow
def test_empty_cache_file_is_regenerated(tmp_path):
    cache = tmp_path / "cache"
    assert _compile_in_subprocess(cache) == "compiled"
    (entry,) = cache.glob("*.o")
    entry.write_bytes(b"")
    assert _compile_in_subprocess(cache) == "compiled"
    assert entry.stat().st_size > 0
    assert _compile_in_subprocess(cache) == "disk"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_cache_file_is_regenerated(tmp_path, damage):
    cache = tmp_path / "cache"
    assert _compile_in_subprocess(cache) == "compiled"
    (entry,) = cache.glob("*.o")
    code = entry.read_bytes()
    entry.write_bytes(b"not an object file\n" * 3 if damage == "garbage" else code[: len(code) // 3])
    assert _compile_in_subprocess(cache) == "compiled"
    assert _compile_in_subprocess(cache) == "disk"


# ---- 5. the Python fallback -------------------------------------------------------------------------


def test_fallback_is_visible_and_correct():
    """An op without a native kernel (ScatterAdd into bfloat16, whose sums must build up
    in float32) runs its numpy reference, marked [python]; convolution and max pooling
    run whole, reductions over non-adjacent axes and a softmax over a middle axis are
    decomposed into native primitives."""
    def build(f, x, w, rows, updates):
        conv = f.relu(f.conv2d(x, w, padding=1))
        return [f.max_pool(conv, 2), f.sum(conv, axis=[0, 2]), f.softmax(x, axis=1), f.scatter_add(rows, updates, 4)]

    inputs = {
        "x": data([2, 3, 7, 7]), "w": data([4, 3, 3, 3], seed=1),
        "rows": np.random.default_rng(2).integers(0, 4, 9).astype(np.int32), "updates": data([9, 5], "bfloat16", seed=3),
    }
    flow, handles, outputs = build_flow(build, inputs)
    arrays = list(inputs.values())
    cell = rv.Compiler("cpu").compile(flow).cell("f")
    python = [s for s in cell.steps if s.variant == "python"]
    assert {s.op.type for s in python} == {"ScatterAdd"}
    assert sum(variant == "python" for _, variant in printed_steps(cell)) == len(python), str(cell)
    native = [s for s in cell.steps if s.variant != "python"]
    assert {"ConvTiles", "WindowMax", "SoftmaxRow", "TileTranspose"} <= {s.kernel for s in native}
    assert all(s.variant == expected_variant("") for s in native)
    got = compute(cell.network, handles, outputs, arrays)
    want = compute(rv.Compiler("reference").compile(flow), handles, outputs, arrays)
    for t, g, w in zip(outputs, got, want):
        assert_close(g, w, t.dtype, t.name)


@pytest.mark.parametrize("error", [
    ValueError,
    RuntimeError,
])
def test_error_in_fallback_names_the_op(error, monkeypatch):
    from ranvier.ops import op_def

    definition = op_def("ScatterAdd")
    working = definition.reference
    inputs = {"rows": np.array([0, 2, 2, 1], np.int32), "updates": data([4, 6], "bfloat16")}
    flow, handles, outputs = build_flow(lambda f, i, u: f.cast(f.scatter_add(i, u, 3), "float32") * 2.0, inputs)
    cell = rv.Compiler("cpu").compile(flow).cell("f")
    scatter = next(s.op for s in cell.steps if s.op.type == "ScatterAdd")
    assert next(s for s in cell.steps if s.op is scatter).variant == "python"
    instance = cell.instance()
    for handle, array in zip(handles, inputs.values()):
        instance[handle] = array

    def broken(*args):
        raise error("the scatter is broken")

    monkeypatch.setattr(definition, "reference", broken)
    with pytest.raises(rv.RanvierError) as info:
        instance.compute()
    assert "ScatterAdd" in str(info.value) and scatter.name in str(info.value) and "the scatter is broken" in str(info.value)
    monkeypatch.setattr(definition, "reference", working)
    instance.compute()  # the instance is usable again
    want = compute(rv.Compiler("reference").compile(flow), handles, outputs, list(inputs.values()))
    assert_close(instance[outputs[0]], want[0], "float32", "after the error")


# ---- 6. runtime errors of native kernels ----------------------------------------------------------


@pytest.mark.parametrize("mask", MASKS)
def test_gather_out_of_range_raises_and_recovers(mask):
    flow, handles, outputs = build_flow(lambda f, t, i: f.gather(t, i) * 2.0 + 1.0, {"t": data([13, 37]), "i": np.zeros(7, np.int32)})
    table, ids = handles
    cell = rv.Compiler("cpu", cpu=mask).compile(flow).cell("f")
    assert any(s.kernel == "Gather" and s.variant == expected_variant(mask) for s in cell.steps)
    gather = next(s.op for s in cell.steps if s.kernel == "Gather")
    instance = cell.instance()
    values = data([13, 37])
    instance[table] = values
    for bad in (13, -1, 1000):
        positions = np.array([0, 3, 12, bad, 5, 1, 2], np.int32)
        instance[ids] = positions
        with pytest.raises(rv.RanvierError) as info:
            instance.compute()
        message = str(info.value)
        assert "Gather" in message and gather.name in message and f"index {bad} " in message, message
    good = np.array([12, 0, 5, 5, 3, 11, 1], np.int32)
    instance[ids] = good
    instance.compute()
    np.testing.assert_allclose(instance[outputs[0]], values[good] * 2 + 1, rtol=1e-6)


def test_cross_entropy_label_out_of_range_raises():
    flow, handles, outputs = build_flow(lambda f, x, l: f.softmax_cross_entropy(x, l), {"x": data([5, 7]), "l": np.zeros(5, np.int32)})
    cell = rv.Compiler("cpu").compile(flow).cell("f")
    assert cell.steps[0].kernel == "CrossEntropyRow"
    instance = cell.instance()
    instance[handles[0]] = data([5, 7])
    instance[handles[1]] = np.array([0, 6, 7, 1, 2], np.int32)
    with pytest.raises(rv.RanvierError, match="SoftmaxCrossEntropy"):
        instance.compute()
    instance[handles[1]] = np.array([0, 6, 3, 1, 2], np.int32)
    instance.compute()
    assert np.isfinite(instance[outputs[0]]).all()


# ---- 7. vector-matrix products (GEMV) ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("batch", [(), (3,)])
@pytest.mark.parametrize("parts", ["one", "every core"])
@pytest.mark.parametrize(("k", "n"), [(37, 29), (130, 203)])
def test_vector_matrix_products_use_gemv_correctly(dtype, transpose_a, transpose_b, batch, parts, k, n, monkeypatch):
    """A one-row product (a decode step): a single float32 one streams its matrix in place
    (`Gemv`: B cut along k, each part's rows into a partial product; Bᵀ's rows shared out),
    others go to BLAS's GEMV; on one part and on every core (k not a multiple of the rows
    it adds at once, nor of a part's share), with a scale and a bias as the epilogue;
    every layout must agree with numpy."""
    if parts == "every core":
        monkeypatch.setenv("RANVIER_SPLIT_BYTES", "1")
    a_shape = (*batch, k, 1) if transpose_a else (*batch, 1, k)
    b_shape = (*batch, n, k) if transpose_b else (*batch, k, n)
    rng = np.random.default_rng(11)
    a_value, b_value = rng.standard_normal(a_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)
    bias_value = rng.standard_normal(n).astype(dtype)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    a, b, bias = f.var("a", dtype, a_shape), f.var("b", dtype, b_shape), f.var("bias", dtype, [n])
    y = f.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b, name="y") * 0.5 + bias
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    (product,) = [step for step in data.cell.steps if step.op.type.startswith("MatMul")]
    assert product.op.type == "MatMulCalculate"
    assert product.kernel == ("Gemv" if dtype == "float32" and not batch else "BlasGemm")
    data[y][...] = np.nan
    data[a], data[b], data[bias] = a_value, b_value, bias_value
    data.compute()
    left = np.swapaxes(a_value, -1, -2) if transpose_a else a_value
    right = np.swapaxes(b_value, -1, -2) if transpose_b else b_value
    tolerance = 1e-5 if dtype == "float32" else 1e-12
    want = (left.astype(np.float64) @ right.astype(np.float64)) * 0.5 + bias_value
    np.testing.assert_allclose(data[y], want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("parts", ["one", "every core"])
def test_gemv_on_every_variant(mask, transpose_b, parts, monkeypatch):
    """The streamed vector-matrix product in AVX-512, AVX2 and SSE vectors, over a ragged
    row of 203 columns and 130 steps of k."""
    if parts == "every core":
        monkeypatch.setenv("RANVIER_SPLIT_BYTES", "1")
    k, n = 130, 203
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((1, k)).astype(np.float32), rng.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    a, b = f.var("a", "float32", [1, k]), f.var("b", "float32", list(w.shape))
    y = f.matmul(a, b, transpose_b=transpose_b, name="y")
    data = rv.Compiler("cpu", cpu=mask).compile(flow).cell("f").instance()
    assert [step.kernel for step in data.cell.steps] == ["Gemv"]
    data[y][...] = np.nan
    data[a], data[b] = x, w
    data.compute()
    want = x.astype(np.float64) @ (w.T if transpose_b else w).astype(np.float64)
    np.testing.assert_allclose(data[y], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", [(37, 131, 10), (133, 9, 70), (21, 300, 1), (2, 12, 12)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("transposes", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thin_products_on_every_variant_and_thread_count(mask, shape, transposes, threads, monkeypatch):
    """A product with n ≤ THIN (a dot product per element of C along k, or vectors of C's
    rows where A is transposed) or k ≤ THIN (C's rows from k factors each) runs ThinGemm,
    in AVX-512, AVX2 and SSE vectors, its rows shared out over 1 to 3 parts (ragged: rows,
    k and n not multiples of a vector), with a scale, a bias and a ReLU as its epilogue;
    every element written, as float64 numpy computes it."""
    from ranvier.backends.cpu.kernels import matmul

    monkeypatch.setattr(matmul, "thread_count", lambda: threads)
    monkeypatch.setattr(matmul, "worth_splitting", lambda flops=0, nbytes=0: threads > 1)
    m, k, n = shape
    ta, tb = transposes[0] == "T", transposes[1] == "T"
    rng = np.random.default_rng(13)
    a_value = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b_value = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    bias_value = rng.standard_normal(n).astype(np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    a, b, bias = f.var("a", "float32", list(a_value.shape)), f.var("b", "float32", list(b_value.shape)), f.var("bias", "float32", [n])
    y = f.relu(f.matmul(a, b, transpose_a=ta, transpose_b=tb) * 0.5 + bias, name="y")
    data = rv.Compiler("cpu", cpu=mask).compile(flow).cell("f").instance()
    assert [(step.kernel, step.op.type) for step in data.cell.steps] == [("ThinGemm", "MatMulCalculate")]
    unit = host_target().lanes(4) if ta else 1  # "across" shares whole vectors of rows
    assert len(matmul._thin_parts(data.cell.steps[0].op)) == min(threads, -(-m // unit))
    data[y][...] = np.nan
    data[a], data[b], data[bias] = a_value, b_value, bias_value
    data.compute()
    left, right = (a_value.T if ta else a_value).astype(np.float64), (b_value.T if tb else b_value).astype(np.float64)
    np.testing.assert_allclose(data[y], np.maximum(left @ right * 0.5 + bias_value, 0), rtol=1e-5, atol=1e-5)


def test_a_split_written_in_parallel_parts_compiles():
    """Each output of a large Split is a parallel loop: one step, several part functions."""
    from ranvier.backends.cpu.parallel import split_thresholds

    rows = split_thresholds().nbytes // (4 * 3 * 64) + 1  # each output at least the parallel threshold's third
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [rows, 3 * 64])
    parts = f.split(x, 3, 1)
    data = rv.Compiler(cache=False).compile(flow).cell("f").instance()
    value = np.random.default_rng(6).standard_normal((rows, 3 * 64)).astype(np.float32)
    data[x] = value
    data.compute()
    for part, expected in zip(parts, np.split(value, 3, 1)):
        np.testing.assert_array_equal(data[part], expected)
