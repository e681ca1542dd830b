"""Rotary position embedding (Rotary): each pair of a head's features turned by its
position's angle, forward and back, checked against a plain loop over pairs written here,
on every CPU variant; its decomposition; its shape checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import FLOATS, as_f64, assert_mentions, check, np_dtype, random_array, run_flow

import ranvier as rv

TESTED_OPS = {"Rotary"}


def _tables(positions: int, pairs: int, dtype: str, seed: int):
    """cos and sin of random angles, [positions, pairs] each."""
    angles = np.random.default_rng(seed).uniform(-math.pi, math.pi, (positions, pairs))
    return np.cos(angles).astype(np_dtype(dtype)), np.sin(angles).astype(np_dtype(dtype))


def expected_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool) -> np.ndarray:
    """Pair by pair: (a, b) at position t → (a·c − b·s, a·s + b·c), s negated turning back."""
    x, cos, sin = as_f64(x), as_f64(cos), as_f64(sin)
    positions, heads, features = x.shape[-3:]
    flat = x.reshape(-1, positions, heads, features)
    y = np.empty_like(flat)
    for n, t, h, i in np.ndindex(flat.shape[0], positions, heads, features // 2):
        a, b = flat[n, t, h, 2 * i], flat[n, t, h, 2 * i + 1]
        c, s = cos[t, i], -sin[t, i] if inverse else sin[t, i]
        y[n, t, h, 2 * i], y[n, t, h, 2 * i + 1] = a * c - b * s, a * s + b * c
    return y.reshape(x.shape)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2, 5, 3, 8), (7, 2, 2), (3, 4, 5, 100), (2, 6, 1, 48), (2, 1, 3, 2, 6)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotary(dtype, shape, inverse):
    """Heads of 1 to 50 pairs: whole vectors of pairs, a single pair, a ragged tail."""
    x = random_array(shape, dtype, seed=len(shape))
    cos, sin = _tables(shape[-3], shape[-1] // 2, dtype, seed=shape[-1])
    (y,) = run_flow(lambda f, a, c, s: [f.rotary(a, c, s, inverse=inverse)], [x, cos, sin])
    check(y, expected_rotary(x, cos, sin, inverse), dtype)


@pytest.mark.parametrize("cpu_mask", ["", "-avx512", "-avx512,-avx2"])
def test_rotary_on_every_cpu_variant(cpu_mask):
    """Turning forward then back gives x again, on each target's vector width; a row of
    x [4, 7, 3, 22] is 11 pairs: a vector of pairs and a tail on every target."""
    x = random_array((4, 7, 3, 22), "float32", seed=3)
    cos, sin = _tables(7, 11, "float32", seed=4)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(name, "float32", list(a.shape)) for name, a in zip("xcs", (x, cos, sin))]
    turned = f.rotary(*handles)
    back = f.rotary(turned, *handles[1:], inverse=True)
    for tensor in (turned, back):
        tensor.var.out = True
    cell = rv.Compiler("cpu", cpu=cpu_mask, cache=False).compile(flow).cell("f")
    assert [step.kernel.split("[")[0] for step in cell.steps] == ["RotaryRow", "RotaryRow"]
    data = cell.instance()
    for handle, a in zip(handles, (x, cos, sin)):
        data[handle] = a
    data.compute()
    check(data[turned], expected_rotary(x, cos, sin, False), "float32")
    check(data[back], x, "float32", atol=1e-5)


def test_rotary_decomposes_into_pairs():
    """A backend without its kernel (the CUDA one) runs Split, products and Concat: the same results."""
    from ranvier.compiler.decompose import decompose

    x = random_array((2, 5, 3, 8), "float64", seed=1)
    cos, sin = _tables(5, 4, "float64", seed=2)
    results = []
    for whole in (True, False):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        handles = [f.var(name, "float64", list(a.shape)) for name, a in zip("xcs", (x, cos, sin))]
        outputs = [f.rotary(*handles), f.rotary(*handles, inverse=True)]
        for t in outputs:
            t.var.out = True
        if not whole:
            decompose(flow, flow.func("f"), lambda op: False)
            assert "Rotary" not in {op.type for op in flow.func("f").ops}
        data = rv.Compiler("reference").compile(flow).cell("f").instance()
        for handle, a in zip(handles, (x, cos, sin)):
            data[handle] = a
        data.compute()
        results.append([np.array(data[t]) for t in outputs])
    for whole, parts in zip(*results):
        np.testing.assert_allclose(parts, whole, rtol=1e-12)


@pytest.mark.parametrize("shape,tables,wanted", [
    ((2, 5, 3, 7), (5, 3), "even D"),
    ((5, 8), (5, 4), "rank >= 3"),
    ((2, 5, 3, 8), (4, 4), "cos and sin tables float32[5, 4]"),
    ((2, 5, 3, 8), (5, 8), "cos and sin tables float32[5, 4]"),
])
def test_rotary_checks_shapes(shape, tables, wanted):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, c, s = f.var("x", "float32", list(shape)), f.var("c", "float32", list(tables)), f.var("s", "float32", list(tables))
    with pytest.raises(rv.ShapeError) as error:
        f.rotary(x, c, s)
    assert_mentions(str(error.value), "Rotary", wanted)


def test_rotary_checks_table_dtype():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, c, s = f.var("x", "float32", [1, 2, 1, 4]), f.var("c", "float64", [2, 2]), f.var("s", "float64", [2, 2])
    with pytest.raises(rv.ShapeError) as error:
        f.rotary(x, c, s)
    assert_mentions(str(error.value), "Rotary", "float32[2, 2]")
