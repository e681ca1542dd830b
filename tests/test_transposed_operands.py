"""fold_transposed_operands: a MatMul reading a Transpose of its operand's last two axes
reads the operand itself with its transpose flag flipped, giving the same product, and
only where the transposed copy serves nothing else."""

from __future__ import annotations

import numpy as np
from helpers import as_f64, check, random_array

import ranvier as rv
from ranvier.compiler.transposed import fold_transposed_operands
from ranvier.ops import attrs_of


def folded(build, inputs):
    """The function's op types after the fold, its products' flags, and its outputs computed."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", "float32", a.shape) for i, a in enumerate(inputs)]
    outputs = build(f, *handles)
    for out in outputs:
        out.var.out = True
    func = flow.funcs["f"]
    fold_transposed_operands(flow, func, set())
    flags = [(attrs_of(op)["transpose_a"], attrs_of(op)["transpose_b"]) for op in func.ops if op.type == "MatMul"]
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    for handle, array in zip(handles, inputs):
        data[handle.var][...] = array
    data.compute()
    return [op.type for op in func.ops], flags, [np.array(data[out.var]) for out in outputs]


def test_a_product_reads_the_untransposed_matrices():
    """x @ Wᵀ (an LM head tied to its embedding) and Aᵀ @ B under a batch: no Transpose left."""
    x, w, a = random_array([2, 3, 5], "float32", seed=0), random_array([7, 5], "float32", seed=1), random_array([2, 3, 4], "float32", seed=2)
    types, flags, (head, batched) = folded(
        lambda f, x, w, a: [x @ w.transpose([1, 0]), a.transpose([0, 2, 1]) @ x], [x, w, a])
    assert "Transpose" not in types and flags == [(False, True), (True, False)]
    check(head, as_f64(x) @ as_f64(w).T, "float32")
    check(batched, as_f64(a).transpose(0, 2, 1) @ as_f64(x), "float32")


def test_a_transpose_read_elsewhere_or_of_other_axes_stays():
    x, a, v = (random_array(s, "float32", seed=i) for i, s in enumerate([[4, 5], [2, 4, 3], [4, 3, 6]]))

    def build(f, x, a, v):
        t = x.transpose([1, 0])
        return [x @ t, t * 2.0, a.transpose([1, 0, 2]) @ v]

    types, flags, (shared, kept, other) = folded(build, [x, a, v])
    assert types.count("Transpose") == 2 and flags == [(False, False), (False, False)]
    check(shared, as_f64(x) @ as_f64(x).T, "float32")
    check(kept, 2 * as_f64(x).T, "float32")
    check(other, as_f64(a).transpose(1, 0, 2) @ as_f64(v), "float32")
