"""compiler/attention_layout.py: an Attention op whose q, k and v are heads split out of a
product's rows and whose result is merged back into rows runs in [B, T, heads, hd]
(`heads_first` false), so neither the split's Transposes nor the merge's remain as copies of
their own. Compiled against the numpy reference (outputs filled with NaN first), float32 and
with its products in bf16; left alone where its result is read as it is, or in a training step."""

from __future__ import annotations

import pytest
from helpers import cpu_steps_against_reference, random_array

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
    """`build(f, x)` on QKV x on the CPU against the reference: the CPU cell's op types, and
    the Attention op's heads_first ("1" unless set)."""
    steps = cpu_steps_against_reference(lambda f, x: [build(f, x)], [BATCH, STEPS, 3 * FEATURES], matmul=matmul,
                                        training=training, seed=7)
    attention = [step.op for step in steps if step.op.type == "Attention"]
    return [step.op.type for step in steps], attention[0].attrs.get("heads_first", "1")


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
