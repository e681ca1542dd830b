"""compiler/row_transposes.py: Transposes of leading axes moved below the products by a matrix
(and bias rows) that read them, or above the product whose result they read, into chains of
views that fold-views makes one copy of; left in place where they would not meet one. Each
compiled against the numpy reference (outputs filled with NaN first), with the ops left."""

from __future__ import annotations

import pytest
from helpers import cpu_steps_against_reference, random_array


def _run(build, shape, matmul: str = "float32"):
    """What `build` makes of x on the CPU against the reference; the CPU cell's op types."""
    return [step.op.type for step in cpu_steps_against_reference(build, shape, matmul=matmul, seed=5)]


def _weights(f, rows: int, columns: int, seed: int):
    return f.const(random_array([rows, columns], "float32", seed=seed))


def _sunk(f, x):
    """MultiheadAttention's [B, T, D] → [T, B, D] before its product and bias, then a head
    split of the product's features ([T, B·H, D/H] and the heads first)."""
    t = x.transpose([1, 0, 2])
    y = f.matmul(t, _weights(f, 8, 12, 1)) + f.const(random_array([12], "float32", seed=2))
    batch, steps = x.shape[0], x.shape[1]
    return [y.reshape([steps, batch * 3, 4]).transpose([1, 0, 2]).reshape([batch, 3, steps, 4])]


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_a_transpose_before_a_product_and_its_bias_joins_the_head_split_after_it(matmul):
    types = _run(_sunk, [2, 5, 8], matmul)
    assert "Transpose" not in types and types.count("StridedView") == 1


def _lifted(f, x):
    """Heads [B, H, T, hd] merged as MultiheadAttention does ([T, B, H, hd] → [T·B, D]),
    projected, and turned back into [B, T, D] after the product."""
    batch, heads, steps, size = x.shape
    rows = x.transpose([2, 0, 1, 3]).reshape([steps * batch, heads * size])
    y = f.matmul(rows, _weights(f, heads * size, 6, 3))
    return [y.reshape([steps, batch, 6]).transpose([1, 0, 2]).exp()]


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_a_transpose_after_a_product_joins_the_chain_before_it(matmul):
    """The head merge and the Transpose back are one StridedView (reshaped), not two copies."""
    types = _run(_lifted, [2, 3, 5, 4], matmul)
    assert "Transpose" not in types and types.count("StridedView") == 1


def test_a_transpose_that_meets_no_chain_stays():
    """Below the product it would land before an Exp: a copy of the wider rows. It stays."""
    types = _run(lambda f, x: [f.matmul(x.transpose([1, 0, 2]), _weights(f, 8, 12, 4)).exp()], [2, 5, 8])
    assert "Transpose" in types


def test_a_product_read_elsewhere_keeps_its_transpose():
    def build(f, x):
        y = f.matmul(x.transpose([1, 0, 2]), _weights(f, 8, 12, 6))
        return [y.reshape([5, 6, 4]).transpose([1, 0, 2]), y]

    types = _run(build, [2, 5, 8])
    assert "Transpose" in types
