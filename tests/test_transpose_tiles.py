"""Transposes that move the innermost axis run in register tiles (kernels/transpose.py):
bit for bit numpy's, every element written, for each vector variant, for whole tiles and
the rows and columns past them, batched or not, and whatever axes merge into the pattern."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_array, run_flow

import ranvier as rv
from ranvier.backends.cpu.kernels.transpose import batched_transpose

CASES = [
    ((12, 128, 64), (0, 2, 1)),  # attention's Kᵀ: whole tiles
    ((17, 9), (1, 0)),  # smaller than one AVX-512 tile, edges on both sides
    ((64, 33), (1, 0)),
    ((2, 3, 20, 19), (0, 1, 3, 2)),  # two batch axes merge
    ((2, 8, 5, 7), (0, 2, 3, 1)),  # NCHW → NHWC: H and W merge
    ((3, 4, 5), (2, 0, 1)),  # the last axis moves to the front
    ((1, 16, 16), (0, 2, 1)),
]
MASKS = ["", "-avx512", "-avx512,-avx2"]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("shape,perm", CASES)
def test_tiled_transposes_match_numpy_bit_for_bit(shape, perm, dtype):
    x = random_array(shape, dtype, seed=len(shape) * 7 + shape[-1], low=-1000, high=1000)
    (out,) = run_flow(lambda f, a: f.transpose(a, list(perm)), [x])
    np.testing.assert_array_equal(out, x.transpose(perm))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape,perm", CASES)
def test_every_vector_variant_tiles(shape, perm, mask):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", list(shape))
    y = f.transpose(x, list(perm))
    y.var.out = True
    cell = rv.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f")
    assert [s.kernel for s in cell.steps] == ["TileTranspose"]
    data = cell.instance()
    value = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    data[x] = value
    data[y] = np.full(y.shape, np.nan, np.float32)
    data.compute()
    np.testing.assert_array_equal(data[y], value.transpose(perm))


def test_which_transposes_are_tiled():
    """Only a transpose that moves the innermost axis is; one that keeps it copies whole
    rows already (the strided loop kernel), and bfloat16 goes through that kernel too."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    kept = f.transpose(f.var("a", "float32", [2, 3, 4, 5]), [0, 2, 1, 3])
    half = f.transpose(f.var("b", "bfloat16", [8, 8]), [1, 0])
    moved = f.transpose(f.var("c", "float32", [6, 4, 5]), [2, 1, 0])
    assert batched_transpose(kept.var.producer) is None
    assert batched_transpose(moved.var.producer) is None  # [6, 4, 5] → [5, 4, 6]: two axes swap around a third
    for t in (kept, half, moved):
        t.var.out = True
    cell = rv.Compiler("cpu", cache=False).compile(flow).cell("f")
    assert [s.kernel for s in cell.steps] == ["Transpose"] * 3
