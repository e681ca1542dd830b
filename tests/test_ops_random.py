"""RandomUniform and Dropout: the same bits on every backend and CPU variant as the numpy
reference (every output element written), numbers uniform and independent across seeds
and streams, dropout at its rate with the kept elements scaled, its gradient the same
mask, and bad attributes and inputs refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import ranvier as rv
from ranvier.autodiff import gradient
from ranvier.errors import ShapeError
from ranvier.ops.random import positions, uniform

TESTED_OPS = {"RandomUniform", "Dropout"}

CPU_VARIANTS = [("reference", ""), ("cpu", ""), ("cpu", "-avx512"), ("cpu", "-avx512,-avx2")]


def _compute(flow: rv.Flow, backend: str, cpu: str, feeds: dict, fetch: list) -> list[np.ndarray]:
    data = rv.Compiler(backend, cpu=cpu).compile(flow).cell("f").instance()
    for var in fetch:
        data[var][...] = np.nan  # an element no kernel writes stays NaN
    for var, value in feeds.items():
        data[var] = value
    data.compute()
    return [np.array(data[var]) for var in fetch]


def _dropout_flow(shape, rate: float, stream: int, dtype: str = "float32"):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", dtype, shape)
    seed = f.var("seed", "int32", [])
    y = f.dropout(x, seed, rate, stream)
    counter = f.var("counter", "int32", [shape[0], 1])
    u = f.random_uniform(counter + f.const(np.arange(shape[-1], dtype=np.int32)), seed, stream)
    for out in (y, u):
        out.var.out = True
    return flow, x, seed, counter, y, u


@pytest.mark.parametrize("backend, cpu", CPU_VARIANTS, ids=[b + c for b, c in CPU_VARIANTS])
@pytest.mark.parametrize("shape", [[5, 37], [2, 3, 4, 16], [1, 1]])
def test_every_backend_draws_the_references_bits(backend, cpu, shape):
    rng = np.random.default_rng(3)
    flow, x, seed, counter, y, u = _dropout_flow(shape, 0.3, 5)
    feeds = {x: rng.standard_normal(shape).astype(np.float32), seed: np.int32(-7),
             counter: rng.integers(-2**31, 2**31 - 1, (shape[0], 1), dtype=np.int64).astype(np.int32)}
    got_y, got_u = _compute(flow, backend, cpu, feeds, [y, u])
    counters = feeds[counter] + np.arange(shape[-1], dtype=np.int32)
    expected_u = uniform(counters, feeds[seed], 5)
    kept = uniform(positions(shape), feeds[seed], 5) >= np.float32(0.3)
    expected_y = np.where(kept, feeds[x] * np.float32(1 / 0.7), np.float32(0))
    np.testing.assert_array_equal(got_u, expected_u)
    np.testing.assert_array_equal(got_y, expected_y)


def test_numbers_are_uniform_and_independent_across_seeds_and_streams():
    count = 1 << 18
    draws = {(seed, stream): uniform(positions([count]), np.int32(seed), stream)
             for seed, stream in [(0, 0), (1, 0), (0, 1), (2**31 - 1, 7)]}
    for u in draws.values():
        assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
        counts, _ = np.histogram(u, bins=64, range=(0.0, 1.0))
        expected = count / 64
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 120, f"chi-squared {chi2:.1f} over 63 degrees of freedom"  # p < 1e-4 for a fair generator
        assert abs(float(np.corrcoef(u[:-1], u[1:])[0, 1])) < 0.01  # neighbours
    values = list(draws.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert abs(float(np.corrcoef(values[i], values[j])[0, 1])) < 0.01


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_drops_at_its_rate_and_scales_what_it_keeps(rate):
    shape = [64, 1000]
    flow, x, seed, _, y, _ = _dropout_flow(shape, rate, 2)
    values = np.random.default_rng(1).uniform(0.5, 2.0, shape).astype(np.float32)
    masks = []
    for step_seed in (11, 12):
        (out,) = _compute(flow, "cpu", "", {x: values, seed: np.int32(step_seed)}, [y])
        dropped = out == 0
        n = out.size
        assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)  # five standard deviations
        np.testing.assert_allclose(out[~dropped], values[~dropped] / np.float32(1 - rate), rtol=1e-6)
        masks.append(dropped)
    assert (masks[0] != masks[1]).mean() > rate * (1 - rate)  # a new seed, a new mask


def test_the_gradient_passes_where_the_forward_kept():
    shape = [8, 33]
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", shape)
    seed = f.var("seed", "int32", [])
    weights = f.var("w", "float32", shape)
    y = f.dropout(x, seed, 0.4, 3)
    y.var.out = True
    (dx,) = gradient(flow, "f", [x], loss=f.sum(y * weights)).values()
    dx.var.out = True
    rng = np.random.default_rng(2)
    feeds = {x: rng.uniform(0.5, 2.0, shape).astype(np.float32), seed: np.int32(5),
             weights: rng.uniform(0.5, 2.0, shape).astype(np.float32)}
    for backend, cpu in CPU_VARIANTS:
        out, grad = _compute(flow, backend, cpu, feeds, [y, dx])
        kept = out != 0
        np.testing.assert_allclose(grad, np.where(kept, feeds[weights] / np.float32(0.6), 0), rtol=1e-6)


def test_rate_zero_is_the_identity():
    flow, x, seed, _, y, _ = _dropout_flow([3, 4], 0.0, 0)
    values = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    (out,) = _compute(flow, "cpu", "", {x: values, seed: np.int32(1)}, [y])
    np.testing.assert_array_equal(out, values)


@pytest.mark.parametrize("rate", [1.0, -0.1])
def test_a_rate_outside_zero_to_one_is_refused(rate):
    f = rv.Builder(rv.Flow(), "f")
    with pytest.raises(ShapeError, match=r"Dropout op f/Dropout.*attribute rate in \[0, 1\)"):
        f.dropout(f.var("x", "float32", [2]), f.var("seed", "int32", []), rate)


def test_integer_inputs_are_required():
    f = rv.Builder(rv.Flow(), "f")
    with pytest.raises(ShapeError, match="RandomUniform op .*int32 counters and an int32 seed"):
        f.random_uniform(f.var("c", "int64", [4]), f.var("s", "int32", []))
    with pytest.raises(ShapeError, match="Dropout op .*a floating-point input and a scalar int32 seed"):
        f.dropout(f.var("x", "float32", [4]), f.var("s2", "int32", [2]), 0.5)
