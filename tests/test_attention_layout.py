"""compiler/attention_layout.py: an Attention op whose q, k and v are heads split out of a
product's rows and whose result is merged back into rows runs in [B, T, heads, hd]
(`heads_first` false), so neither the split's Transposes nor the merge's remain as copies of
their own. Compiled against the numpy reference (outputs filled with NaN first), float32 and
with its products in bf16; left alone where its result is read as it is, or in a training step."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_array

import ranvier as rv

BATCH, STEPS, HEADS, SIZE = 2, 7, 3, 8
FEATURES = HEADS * SIZE


def _layer(f, x, merged: bool = True, mask=None):
    """GPT-2's attention on QKV [B, T, 3·D]: the parts split into heads first, attended, the
    heads merged back into [B, T, D] (or the result as it is, unless `merged`)."""
    parts = [part.reshape([BATCH, STEPS, HEADS, SIZE]).transpose([0, 2, 1, 3])
             for part in f.split(x, [FEATURES] * 3, axis=-1)]
    out = f.attention(*parts, mask, causal=mask is None)
    return out.transpose([0, 2, 1, 3]).reshape([BATCH, STEPS, FEATURES]) if merged else out


def _run(build, matmul: str, training: bool = False):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    if training:
        f.func.training = True
    x = f.var("x", "float32", [BATCH, STEPS, 3 * FEATURES])
    y = build(f, x)
    y.var.out = True
    value = random_array(x.shape, "float32", seed=7)
    results = []
    for backend in ("cpu", "reference"):
        cell = rv.Compiler(backend, cache=False, matmul=matmul if backend == "cpu" else "float32").compile(flow).cell("f")
        data = cell.instance()
        data[x] = value
        data[y] = np.full(y.shape, np.nan, np.float32)
        data.compute()
        results.append((np.array(data[y]), cell))
    (got, cell), (want, _) = results
    assert not np.isnan(got).any()
    tolerance = 2e-2 if matmul == "bfloat16" else 1e-5
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    attention = [step.op for step in cell.steps if step.op.type == "Attention"]
    return [step.op.type for step in cell.steps], attention[0].attrs.get("heads_first", "1")


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_heads_split_from_rows_and_merged_back_attend_in_rows(matmul):
    types, heads_first = _run(lambda f, x: _layer(f, x), matmul)
    assert heads_first == "0" and "Transpose" not in types and types.count("StridedView") == 3


def test_a_padding_mask_keeps_its_layout():
    mask = random_array([BATCH, 1, 1, STEPS], "float32", seed=8)
    types, heads_first = _run(lambda f, x: _layer(f, x, mask=f.const(mask)), "float32")
    assert heads_first == "0" and "Transpose" not in types


def test_a_result_read_as_it_is_stays_heads_first():
    _, heads_first = _run(lambda f, x: _layer(f, x, merged=False), "float32")
    assert heads_first == "1"


def test_a_training_step_stays_heads_first():
    _, heads_first = _run(lambda f, x: _layer(f, x).exp(), "float32", training=True)
    assert heads_first == "1"
