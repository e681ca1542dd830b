"""compiler/column_products.py: a product by a constant matrix (and its bias row) whose result
is read only as blocks of its columns (QKV's q, k and v) is one product per block, each block
then read as it is: no copy out of the product's rows. Compiled against the numpy reference
(outputs filled with NaN first), float32 and with its products in bf16; left alone where the
product is also read whole, or by a matrix that is no constant."""

from __future__ import annotations

import pytest
from helpers import cpu_steps_against_reference, random_array

import ranvier as rv

BATCH, STEPS, FEATURES = 2, 5, 12


def _run(build, matmul: str = "float32"):
    """What `build` makes of x [B, T, 8] on the CPU against the reference; the CPU cell's op types."""
    return [step.op.type for step in cpu_steps_against_reference(build, [BATCH, STEPS, 8], matmul=matmul, seed=9)]


def _qkv(f, x, transposed: bool = False):
    """x · W + b [B, T, 3·D], split into q, k and v [B, T, D] and each into heads [B, T, 3, D/3]."""
    weights = random_array([3 * FEATURES, 8] if transposed else [8, 3 * FEATURES], "float32", seed=10)
    product = f.op("MatMul", [x, f.const(weights)], None, {"transpose_b": transposed})
    qkv = product + f.const(random_array([3 * FEATURES], "float32", seed=11))
    return [part.reshape([BATCH, STEPS, 3, FEATURES // 3]).exp() for part in f.split(qkv, [FEATURES] * 3, axis=-1)]


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_product_read_as_blocks_of_columns_is_a_product_a_block(matmul, transposed):
    types = _run(lambda f, x: _qkv(f, x, transposed), matmul)
    products = [t for t in types if t.startswith("MatMul")]
    assert len(products) == 3 and "StridedView" not in types and "Split" not in types


def test_a_product_also_read_whole_stays_one():
    def build(f, x):
        product = f.matmul(x, f.const(random_array([8, 3 * FEATURES], "float32", seed=12)))
        return [*(part.exp() for part in f.split(product, [FEATURES] * 3, axis=-1)), product]

    types = _run(build)
    assert len([t for t in types if t.startswith("MatMul")]) == 1


def test_a_product_by_a_variable_stays_one():
    def build(f, x):
        matrix = f.var("w", "float32", [8, 3 * FEATURES])
        return [part.reshape([BATCH, STEPS, 3, FEATURES // 3]).exp() for part in f.split(f.matmul(x, matrix), [FEATURES] * 3, axis=-1)]

    flow_types = _types_with_variable(build)
    assert len([t for t in flow_types if t.startswith("MatMul")]) == 1


def _types_with_variable(build):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [BATCH, STEPS, 8])
    for y in build(f, x):
        y.var.out = True
    return [step.op.type for step in rv.Compiler("cpu", cache=False).compile(flow).cell("f").steps]
