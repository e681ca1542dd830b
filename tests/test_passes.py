"""The compiler's passes, each on its own: decompose, fold, CSE, elementwise fusion, loss
fusion, mixed precision, scheduling, the rewrite helpers, the memory planner and the
pipeline that runs them.

Each test builds a small flow, runs one pass directly on it (as the pipeline would),
and checks the rewritten function: its ops, its variables and, where meaning could
change, its numbers on the reference backend (which runs a flow as built, no passes).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

import ranvier as rv
from ranvier import CompileError
from ranvier.backends import Capabilities, CompileOptions, create_backend
from ranvier.backends.reference import ReferenceBackend
from ranvier.compiler.decompose import decompose
from ranvier.compiler.fuse import fuse_elementwise
from ranvier.compiler.loss import fuse_loss_with_gradient
from ranvier.compiler.memory import live_ranges, plan_memory
from ranvier.compiler.pipeline import PassContext, run_pipeline
from ranvier.compiler.precision import use_matmul_precision
from ranvier.compiler.rewrite import depends_on, fuse, replace_uses, splice
from ranvier.compiler.schedule import readers, schedule, write_after_read
from ranvier.compiler.simplify import FOLD_LIMIT, eliminate_common_subexpressions, fold_constants
from ranvier.ops.expression import parse

# ---- helpers ----------------------------------------------------------------------------------


def new_flow(name: str = "f"):
    flow = rv.Flow()
    return flow, rv.Builder(flow, name)


def rand(shape, dtype=np.float32, seed=0) -> np.ndarray:
    """Random values away from zero (a zero hides wrong operands in products)."""
    a = np.random.default_rng(seed).uniform(0.5, 1.5, shape) * np.random.default_rng(seed + 1).choice([-1, 1], shape)
    return a.astype(dtype)


def run_reference(flow, feeds: dict, outputs: list, func: str = "f") -> list[np.ndarray]:
    """Compile with the reference backend (no passes), feed `feeds`, return the outputs."""
    net = rv.Compiler("reference").compile(flow)
    data = net.cell(func).instance()
    for name, value in feeds.items():
        data[name] = value
    data.compute()
    return [np.array(data[name]) for name in outputs]


def still_computes(flow, feeds: dict, outputs: list, expected: list, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """The rewritten flow's outputs, on the reference backend, are the original's."""
    for got, want in zip(run_reference(flow, feeds, outputs), expected):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def op_types(func) -> list[str]:
    return [op.type for op in func.ops]


def calculates(func) -> list:
    return [op for op in func.ops if op.type == "Calculate"]


# ---- fold_constants ---------------------------------------------------------------------------


def test_fold_replaces_ops_of_constants_by_their_value():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    c1 = f.array("c1", rand([3, 4], seed=1))
    c2 = f.array("c2", rand([4], seed=2))
    k = (c1 * c2).exp()  # constant: folds
    y = x + k  # reads an input: stays
    y.var.out = True
    xv = rand([3, 4], seed=3)
    (expected,) = run_reference(flow, {"f/x": xv}, [y.name])

    fold_constants(flow, flow.func("f"), keep={y.name})

    assert op_types(flow.func("f")) == ["Add"]
    assert k.var.constant and k.var.producer is None and k.var.dtype == "float32"
    np.testing.assert_allclose(k.var.data, np.exp(c1.var.data * c2.var.data), rtol=1e-6)
    assert flow.vars["f/Mul:0"].constant  # the intermediate product is a constant too
    (got,) = run_reference(flow, {"f/x": xv}, [y.name])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _param_input(f, x):
    p = f.parameter("p", rand([4], seed=4))
    return p.exp() + x


def _assign_target_same_function(f, x):
    c = f.array("c", rand([4], seed=5))
    f.assign(c, x.sum(axis=0))
    return c.exp() + x


def _assign_target_other_function(f, x):
    c = f.array("c", rand([4], seed=5))
    g = rv.Builder(f.flow, "g")
    g.assign(c, g.var("v", rv.DT_FLOAT, [4]))  # state g updates, f reads: not a constant of f
    return c.exp() + x


@pytest.mark.parametrize(
    "build",
    [_param_input, _assign_target_same_function, _assign_target_other_function],
    ids=["learnable", "assign-target", "assign-target-in-other-function"],
)
def test_fold_leaves_ops_whose_inputs_can_change(build):
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    y = build(f, x)
    before = list(flow.func("f").ops)
    fold_constants(flow, flow.func("f"), keep={y.name})
    assert flow.func("f").ops == before
    assert "Exp" in op_types(flow.func("f"))


def test_fold_leaves_kept_outputs():
    flow, f = new_flow()
    c = f.array("c", rand([4], seed=6))
    y = c.exp()
    fold_constants(flow, flow.func("f"), keep={y.name})
    assert op_types(flow.func("f")) == ["Exp"] and y.var.data is None


def test_fold_limit_keeps_big_results_as_computations():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [1])
    at_limit = f.array("a", rand([FOLD_LIMIT], seed=7)).exp()  # exactly the limit: folds
    over = f.array("b", rand([FOLD_LIMIT + 1], seed=8)).exp()  # one more: stays
    ys = [at_limit.sum() + x, over.sum() + x]
    fold_constants(flow, flow.func("f"), keep={y.name for y in ys})
    assert at_limit.var.data is not None and at_limit.var.producer is None
    assert over.var.data is None and over.var.producer.type == "Exp"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fold_half_precision_through_float32(dtype):
    flow, f = new_flow()
    x = f.var("x", dtype, [8])
    c = f.array("c", rand([8], seed=9).astype(rv.dtypes.to_numpy(dtype)))
    k = (c * c).exp()  # the exact numbers of the reference: float32 math, one rounding per op
    y = x + k
    y.var.out = True
    k.var.out = True
    xv = rand([8], seed=10).astype(rv.dtypes.to_numpy(dtype))
    (expected,) = run_reference(flow, {"f/x": xv}, [k.name])
    fold_constants(flow, flow.func("f"), keep={y.name})
    assert op_types(flow.func("f")) == ["Add"]
    assert k.var.data.dtype == rv.dtypes.to_numpy(dtype)
    np.testing.assert_array_equal(k.var.data.astype(np.float32), expected.astype(np.float32))
    wide = c.var.data.astype(np.float32)
    square = (wide * wide).astype(rv.dtypes.to_numpy(dtype)).astype(np.float32)
    np.testing.assert_array_equal(k.var.data, np.exp(square).astype(rv.dtypes.to_numpy(dtype)))


# ---- eliminate_common_subexpressions ----------------------------------------------------------


def test_cse_merges_identical_ops_and_redirects_readers():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    a1, a2 = x.exp(), x.exp()
    y = a1 * a2.tanh()
    y.var.out = True
    xv = rand([3, 4], seed=11)
    (expected,) = run_reference(flow, {"f/x": xv}, [y.name])

    eliminate_common_subexpressions(flow, flow.func("f"), keep={y.name})

    func = flow.func("f")
    assert op_types(func).count("Exp") == 1
    assert a2.name not in flow.vars and a2.producer is None
    tanh = next(op for op in func.ops if op.type == "Tanh")
    assert tanh.inputs == [a1.var] and tanh in a1.var.consumers
    (got,) = run_reference(flow, {"f/x": xv}, [y.name])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_cse_small_constants_equal_by_value_are_one_operand():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    value = rand([4], seed=12)
    c1, c2 = f.array("c1", value), f.array("c2", value.copy())  # two variables, one value
    y = (x * c1) + (x * c2)
    eliminate_common_subexpressions(flow, flow.func("f"), keep={y.name})
    assert op_types(flow.func("f")) == ["Mul", "Add"]
    add = flow.func("f").ops[-1]
    assert add.inputs[0] is add.inputs[1]


def test_cse_keeps_ops_on_different_operands():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 17])
    z = f.var("z", rv.DT_FLOAT, [3, 17])
    big = rand([17], seed=13)  # more than 16 elements: compared by variable, not value
    ys = [
        x.sum(axis=0), x.sum(axis=1),  # different attributes
        x.exp(), z.exp(),  # different inputs
        x * f.array("b1", big), x * f.array("b2", big.copy()),  # big constants, equal values
        x + 1.0, x + 2.0,  # small constants, different values
    ]
    before = list(flow.func("f").ops)
    eliminate_common_subexpressions(flow, flow.func("f"), keep={y.name for y in ys})
    assert flow.func("f").ops == before


def test_cse_does_not_merge_constants_written_in_place():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    value = rand([4], seed=14)
    c1, c2 = f.array("c1", value), f.array("c2", value.copy())
    g = rv.Builder(flow, "g")
    g.assign(c2, g.var("v", rv.DT_FLOAT, [4]))  # c2 is state another cell updates
    y = (x * c1) + (x * c2)
    eliminate_common_subexpressions(flow, flow.func("f"), keep={y.name})
    assert op_types(flow.func("f")) == ["Mul", "Mul", "Add"]


def test_cse_never_merges_ops_that_write_in_place():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    p = f.parameter("p", rand([3, 4], seed=15))
    expr = "@0=Exp(%0);%1=Add(%1,@0)"  # an output, and an in-place update of p
    u1 = f.op("Calculate", [x, p], attrs={"expr": expr})
    u2 = f.op("Calculate", [x, p], attrs={"expr": expr})
    f.assign(p, x)
    f.assign(p, x)
    y = u1 + u2
    eliminate_common_subexpressions(flow, flow.func("f"), keep={y.name})
    assert op_types(flow.func("f")).count("Calculate") == 2
    assert op_types(flow.func("f")).count("Assign") == 2


def test_cse_keeps_a_duplicate_whose_output_is_kept():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    a1, a2 = x.exp(), x.exp()
    y = a1 * 2.0
    eliminate_common_subexpressions(flow, flow.func("f"), keep={y.name, a2.name})
    assert op_types(flow.func("f")).count("Exp") == 2
    assert a2.name in flow.vars and a2.producer is not None


# ---- fuse_elementwise -------------------------------------------------------------------------


def test_fuse_chain_becomes_one_calculate():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    b = f.array("b", rand([4], seed=16))
    y = (x * 2.0 + b).tanh()
    y.var.out = True
    xv = rand([3, 4], seed=17)
    (expected,) = run_reference(flow, {"f/x": xv}, [y.name])
    func = flow.func("f")

    fuse_elementwise(flow, func, flow.op_order(func), keep={y.name})

    (calc,) = func.ops
    assert calc.type == "Calculate"
    assert calc.attrs["expr"] == "$0=Mul(%0,%1);$1=Add($0,%2);@0=Tanh($1)"
    assert [v.name for v in calc.inputs] == ["f/x", "f/const", "f/b"]
    assert calc.outputs == [y.var] and y.var.producer is calc
    assert "f/Mul:0" not in flow.vars and "f/Add:0" not in flow.vars  # temporaries are gone
    (got,) = run_reference(flow, {"f/x": xv}, [y.name])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_fuse_value_read_outside_the_group_is_an_output():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    h = x.exp()
    y = h.tanh()
    s = h.sum(axis=1)  # a reduction reads h: h must stay visible
    y.var.out = s.var.out = True
    xv = rand([3, 4], seed=18)
    expected = run_reference(flow, {"f/x": xv}, [y.name, s.name])
    func = flow.func("f")

    fuse_elementwise(flow, func, flow.op_order(func), keep={y.name, s.name})

    (calc,) = calculates(func)
    assert calc.attrs["expr"] == "@0=Exp(%0);@1=Tanh(@0)"
    assert calc.outputs == [h.var, y.var]
    assert s.producer.inputs[0] is h.var
    got = run_reference(flow, {"f/x": xv}, [y.name, s.name])
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_fuse_folds_assign_as_an_in_place_write():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    w = f.parameter("w", rand([3, 4], seed=19))
    f.assign(w, w - x * 0.1)  # an SGD step: one pass reads and writes w
    func = flow.func("f")
    xv = rand([3, 4], seed=20)
    net = rv.Compiler("reference").compile(flow)
    data = net.cell("f").instance()
    data["f/x"] = xv
    data.compute()
    expected = np.array(net["f/w"])

    fuse_elementwise(flow, func, flow.op_order(func), keep=set())

    (calc,) = func.ops
    assert calc.type == "Calculate" and calc.outputs == []
    program = parse(calc.attrs["expr"])
    written = [target for target, _ in program.statements if target.kind == "%"]
    assert len(written) == 1 and calc.inputs[written[0].index] is w.var
    assert str(program) == "$0=Mul(%0,%1);$1=Sub(%2,$0);%2=Identity($1)"
    net = rv.Compiler("reference").compile(flow)
    data = net.cell("f").instance()
    data["f/x"] = xv
    data.compute()
    np.testing.assert_allclose(net["f/w"], expected, rtol=1e-6)


def test_fuse_does_not_create_a_cycle_through_an_outside_op():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 4])
    W = f.array("W", rand([4, 4], seed=21))
    a = x.exp().tanh()
    m = a @ W  # same shape, not elementwise: a → m → c leaves the group and comes back
    c = (a + m).sigmoid()
    c.var.out = True
    xv = rand([4, 4], seed=22)
    (expected,) = run_reference(flow, {"f/x": xv}, [c.name])
    func = flow.func("f")

    fuse_elementwise(flow, func, flow.op_order(func), keep={c.name})

    assert sorted(op_types(func)) == ["Calculate", "Calculate", "MatMul"]
    order = flow.op_order(func)  # raises on a cycle
    assert [op.type for op in order] == ["Calculate", "MatMul", "Calculate"]
    assert order[0].outputs == [a.var] and order[2].outputs == [c.var]
    (got,) = run_reference(flow, {"f/x": xv}, [c.name])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_fuse_assigned_value_that_is_kept_stays_an_output():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    w = f.parameter("w", rand([3, 4], seed=23))
    z = (w - x * 0.5).tanh()
    z.var.out = True  # the function returns the new value, and stores it
    f.assign(w, z)
    func = flow.func("f")
    fuse_elementwise(flow, func, flow.op_order(func), keep={z.name})
    assert z.name in flow.vars and z.var.producer in func.ops


def test_fuse_assign_fold_respects_readers_through_views():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 5])
    w = f.parameter("w", rand([4, 5], seed=24))
    t = x.tanh()
    q = (w.reshape([20]) + t.reshape([20])).exp()  # reads w (through a view) and the group's t
    q.var.out = True
    f.assign(w, t * 2.0)
    func = flow.func("f")
    fuse_elementwise(flow, func, schedule(flow, func), keep={q.name})
    schedule(flow, func)  # RanvierError: function f has a cycle


def test_fuse_merges_groups_that_read_one_value_into_one_loop():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 6])
    W = f.array("W", rand([6, 6], seed=25))
    v = x @ W  # computed by an op the groups cannot hold
    p = (v * 2.0).tanh()
    q = (v + x).exp()  # a sibling of p: both read v, neither reads the other
    p.var.out = q.var.out = True
    xv = rand([4, 6], seed=26)
    expected = run_reference(flow, {"f/x": xv}, [p.name, q.name])
    func = flow.func("f")

    fuse_elementwise(flow, func, flow.op_order(func), keep={p.name, q.name})

    (calc,) = calculates(func)
    assert sorted(v_.name for v_ in calc.outputs) == sorted([p.name, q.name])
    assert [v_.name for v_ in calc.inputs].count(v.name) == 1  # v read once
    still_computes(flow, {"f/x": xv}, [p.name, q.name], expected)


def test_fuse_keeps_apart_groups_of_one_value_joined_by_a_path():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 4])
    W = f.array("W", rand([4, 4], seed=27))
    v = x @ W
    p = v.tanh()
    m = p @ W  # q reads v and, through this product, p: one loop would need m before it has it
    q = (v + m).exp()
    q.var.out = True
    xv = rand([4, 4], seed=28)
    expected = run_reference(flow, {"f/x": xv}, [q.name])
    func = flow.func("f")

    fuse_elementwise(flow, func, flow.op_order(func), keep={q.name})

    assert [op.type for op in flow.op_order(func)] == ["MatMul", "Tanh", "MatMul", "Calculate"]  # no cycle
    still_computes(flow, {"f/x": xv}, [q.name], expected)


def test_fuse_computes_again_a_value_whose_inputs_the_loop_reads():
    """A SwiGLU and the gradients of its inputs: the backward loop computes Silu(a) from
    the a it reads anyway, so the forward loop no longer stores it."""
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 6])
    W1, W3, W2 = (f.array(name, rand([6, 6], seed=seed)) for name, seed in (("W1", 29), ("W3", 30), ("W2", 31)))
    a, b = x @ W1, x @ W3
    s = a.silu()
    h = s * b
    y = h @ W2
    dh = y @ W2  # stands for the gradient reaching h
    db = dh * s
    da = dh * b * (a.sigmoid() * (1.0 + a * (1.0 - a.sigmoid())))
    db.var.out = da.var.out = True
    xv = rand([4, 6], seed=32)
    expected = run_reference(flow, {"f/x": xv}, [db.name, da.name])
    func = flow.func("f")

    fuse_elementwise(flow, func, flow.op_order(func), keep={db.name, da.name})

    forward, backward = calculates(func)
    assert [v_.name for v_ in forward.outputs] == [h.name]  # Silu(a) is not stored
    assert "Silu" in backward.attrs["expr"] and s.name not in [v_.name for v_ in backward.inputs]
    assert sorted(v_.name for v_ in backward.outputs) == sorted([db.name, da.name])
    # one loop rounds its float32 steps where the ops did apart
    still_computes(flow, {"f/x": xv}, [db.name, da.name], expected, rtol=1e-5, atol=1e-6)


def test_fuse_does_not_compute_again_a_value_broadcast_into_the_loop():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4])
    c = x.sum(axis=0)  # [4], computed
    e = c.exp()
    m = e.reshape([1, 4]) * 1.0  # e is read by another op: it is stored either way
    y = (x * e + c).tanh()  # e broadcast over 3 rows: computing it again would triple its exponentials
    y.var.out = m.var.out = True
    func = flow.func("f")
    fuse_elementwise(flow, func, flow.op_order(func), keep={y.name, m.name})
    loop = next(op for op in calculates(func) if y.var in op.outputs)
    assert "Exp" not in loop.attrs["expr"] and e.name in [v_.name for v_ in loop.inputs]


# ---- decompose --------------------------------------------------------------------------------


def _conv(f):
    x = f.var("x", rv.DT_FLOAT, [2, 3, 6, 6])
    w = f.array("w", rand([4, 3, 3, 3], seed=30))
    return [x], f.conv2d(x, w, strides=[1, 1], padding=[1, 1], name="y")


def _conv_strided(f):
    x = f.var("x", rv.DT_FLOAT, [2, 3, 7, 7])
    w = f.array("w", rand([4, 3, 3, 2], seed=31))
    return [x], f.conv2d(x, w, strides=[2, 2], padding=[0, 1], name="y")


def _max_pool(f):
    x = f.var("x", rv.DT_FLOAT, [2, 3, 6, 6])
    return [x], f.max_pool(x, ksize=[2, 2], name="y")


def _avg_pool(f):
    x = f.var("x", rv.DT_FLOAT, [2, 3, 7, 7])
    return [x], f.avg_pool(x, ksize=[3, 3], strides=[2, 2], padding=[1, 1], name="y")


def _softmax_axis0(f):
    x = f.var("x", rv.DT_FLOAT, [4, 5])
    return [x], f.softmax(x, axis=0, name="y")


def _log_softmax_middle(f):
    x = f.var("x", rv.DT_FLOAT, [3, 4, 5])
    return [x], f.log_softmax(x, axis=1, name="y")


def _sum_split(f):
    x = f.var("x", rv.DT_FLOAT, [3, 4, 5])
    return [x], f.sum(x, axis=[0, 2], name="y")


def _max_split_keepdims(f):
    x = f.var("x", rv.DT_FLOAT, [3, 4, 5, 2])
    return [x], f.max(x, axis=[0, 2, 3], keepdims=True, name="y")


def _mean_split(f):
    x = f.var("x", rv.DT_FLOAT, [3, 4, 5])
    return [x], f.mean(x, axis=[-1, 0], name="y")


def _sum_squares_staged(f):
    """Every axis, 10,240 elements: ten pieces of 1,024, then the pieces' sum."""
    x = f.var("x", rv.DT_FLOAT, [5, 2048])
    return [x], f.sum_squares(x, name="y")


def _mean_staged(f):
    x = f.var("x", rv.DT_FLOAT, [3, 4096])
    return [x], f.mean(x, axis=[1], name="y")


def _max_staged_keepdims(f):
    x = f.var("x", rv.DT_FLOAT, [2, 1024, 2, 3])
    return [x], f.max(x, axis=[1, 2], keepdims=True, name="y")


DECOMPOSED = {
    "conv2d": _conv, "conv2d-strided": _conv_strided, "maxpool": _max_pool, "avgpool": _avg_pool,
    "softmax-axis0": _softmax_axis0, "logsoftmax-axis1": _log_softmax_middle, "sum-0-2": _sum_split,
    "max-0-2-3": _max_split_keepdims, "mean-2-0": _mean_split, "sumsquares-staged": _sum_squares_staged,
    "mean-staged": _mean_staged, "max-staged-keepdims": _max_staged_keepdims,
}


@pytest.mark.parametrize("reduced,chunk", [(9_216_000, 8192), (221_184, 1024), (82_944, 1024), (1 << 22, 16384),
                                           (4096, 1024), (1024, None), (3 * 5 * 7 * 11 * 13, None)])
def test_a_staged_reduction_cuts_its_axis_into_enough_equal_pieces(reduced, chunk):
    """The longest piece that leaves 256 or more pieces, else the shortest that divides the
    axis (a piece never the whole axis); None where no piece length divides it."""
    from ranvier.ops.reduce import staged_chunk

    assert staged_chunk(reduced) == chunk


@pytest.mark.parametrize("reduced,inner,chunk", [(32768, 768, 32), (3000, 64, 30), (1009, 16, None), (16, 4, 8), (32, 2, 16)])
def test_columns_are_cut_into_pieces_of_up_to_32_rows(reduced, inner, chunk):
    """The most rows up to 32 that divide the axis (a piece never the whole axis), 8 at
    least; None where none does."""
    from ranvier.ops.reduce import staged_chunk

    assert staged_chunk(reduced, inner) == chunk


@pytest.mark.parametrize("case", sorted(DECOMPOSED))
def test_decompose_where_the_backend_cannot_run_the_op(case):
    flow, f = new_flow()
    inputs, y = DECOMPOSED[case](f)
    y.var.out = True
    original = y.var.producer
    feeds = {v.name: rand(v.shape, seed=40 + i) for i, v in enumerate(inputs)}
    (expected,) = run_reference(flow, feeds, [y.name])
    func = flow.func("f")

    decompose(flow, func, runs_whole=lambda op: False)

    assert original not in func.ops and original.name not in flow.ops
    assert flow.vars[y.name] is y.var  # the output keeps its variable and name
    assert y.var.producer in func.ops
    assert all(any(c in func.ops for c in v.var.consumers) for v in inputs)
    assert len(func.ops) > 1
    for op in flow.op_order(func):  # every op is well typed
        types_ = rv.ops.op_def(op.type).infer_types(op.name, op.inputs, op.attrs)
        assert [(t.dtype, list(t.shape)) for t in types_] == [(v.dtype, v.shape) for v in op.outputs]
    (got,) = run_reference(flow, feeds, [y.name])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(DECOMPOSED))
def test_decompose_keeps_ops_the_backend_runs_whole(case):
    flow, f = new_flow()
    DECOMPOSED[case](f)
    before = list(flow.func("f").ops)
    decompose(flow, flow.func("f"), runs_whole=lambda op: True)
    assert flow.func("f").ops == before


def test_decompose_leaves_ops_whose_rule_does_not_apply():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3, 4, 5])
    f.softmax(x)  # the last axis
    f.sum(x, axis=[1, 2])  # adjacent axes
    f.max(x)  # every axis
    before = list(flow.func("f").ops)
    decompose(flow, flow.func("f"), runs_whole=lambda op: False)
    assert flow.func("f").ops == before


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_decompose_gelu_only_in_training(approximate):
    xv = rand([4, 6], seed=50) * 2
    results = {}
    for training in (False, True):
        flow, f = new_flow()
        x = f.var("x", rv.DT_FLOAT, [4, 6])
        y = f.gelu(x, approximate=approximate, name="y")
        y.var.out = True
        func = flow.func("f")
        func.training = training
        (expected,) = run_reference(flow, {"f/x": xv}, [y.name])
        decompose(flow, func, runs_whole=lambda op: True)
        assert ("Gelu" in op_types(func)) is not training
        assert flow.vars[y.name] is y.var and y.var.producer in func.ops
        (results[training],) = run_reference(flow, {"f/x": xv}, [y.name])
        np.testing.assert_allclose(results[training], expected, rtol=1e-5, atol=1e-6)
    assert "Erf" in op_types(func) or "Tanh" in op_types(func)


# ---- fuse_loss_with_gradient ------------------------------------------------------------------


def _cross_entropy(smoothing=0.0, grad_smoothing=None, dloss_from_loss=False):
    flow, f = new_flow()
    logits = f.var("logits", rv.DT_FLOAT, [3, 5])
    labels = f.var("labels", rv.DT_INT32, [3])
    loss = f.softmax_cross_entropy(logits, labels, label_smoothing=smoothing)
    if dloss_from_loss:
        dloss = loss * 0.5  # the upstream value needs the loss first
    else:
        dloss = f.var("dloss", rv.DT_FLOAT, [3])
    smoothing = smoothing if grad_smoothing is None else grad_smoothing
    grad = f.op("SoftmaxCrossEntropyGrad", [logits, labels, dloss], attrs={"label_smoothing": smoothing})
    loss.var.out = grad.var.out = True
    feeds = {"f/logits": rand([3, 5], seed=60), "f/labels": np.array([4, 0, 2], np.int32)}
    if not dloss_from_loss:
        feeds["f/dloss"] = rand([3], seed=61)
    return flow, loss, grad, feeds


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fuse_loss_into_its_gradient(smoothing):
    flow, loss, grad, feeds = _cross_entropy(smoothing)
    expected = run_reference(flow, feeds, [loss.name, grad.name])
    func = flow.func("f")

    fuse_loss_with_gradient(flow, func)

    assert op_types(func) == ["SoftmaxCrossEntropyGrad"]
    (op,) = func.ops
    assert rv.ops.attrs_of(op)["with_loss"] is True
    assert op.outputs == [grad.var, loss.var] and loss.var.producer is op
    got = run_reference(flow, feeds, [loss.name, grad.name])
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_fuse_loss_not_when_the_upstream_gradient_needs_the_loss():
    flow, _, grad, _ = _cross_entropy(dloss_from_loss=True)
    before = list(flow.func("f").ops)
    fuse_loss_with_gradient(flow, flow.func("f"))
    assert flow.func("f").ops == before
    assert len(grad.producer.outputs) == 1 and "with_loss" not in grad.producer.attrs


def test_fuse_loss_not_across_different_attributes():
    flow, loss, _, _ = _cross_entropy(smoothing=0.1, grad_smoothing=0.2)
    before = list(flow.func("f").ops)
    fuse_loss_with_gradient(flow, flow.func("f"))
    assert flow.func("f").ops == before and loss.var.producer.type == "SoftmaxCrossEntropy"


def test_fuse_loss_with_two_gradients_of_one_loss():
    flow, *_ = _cross_entropy()
    f = rv.Builder(flow, "f")
    other = f.op("SoftmaxCrossEntropyGrad", [flow.var("f/logits"), flow.var("f/labels"), f.var("d2", rv.DT_FLOAT, [3])])
    other.var.out = True
    func = flow.func("f")
    fuse_loss_with_gradient(flow, func)
    assert op_types(func) == ["SoftmaxCrossEntropyGrad", "SoftmaxCrossEntropyGrad"]
    assert sorted(len(op.outputs) for op in func.ops) == [1, 2]
    assert all(len(op.outputs) == len(rv.ops.op_def(op.type).infer_types(op.name, op.inputs, op.attrs)) for op in func.ops)


# ---- use_matmul_precision ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "dtype", "attrs", "bf16"),
    [
        ([8, 16], [16, 4], "float32", {}, True),
        ([2, 8, 16], [2, 16, 4], "float32", {}, True),
        ([3, 1, 16], [16, 4], "float32", {}, True),  # B rows together against one matrix
        ([16, 8], [4, 16], "float32", {"transpose_a": True, "transpose_b": True}, True),
        ([8, 16], [16, 4], "float64", {}, False),
        ([1, 16], [16, 4], "float32", {}, False),  # vector-matrix
        ([1, 1, 16], [16, 4], "float32", {}, False),
        ([3, 1, 16], [3, 16, 4], "float32", {}, False),  # a batch of vector-matrix products
        ([16, 1], [16, 4], "float32", {"transpose_a": True}, False),
    ],
)
def test_bfloat16_matmul_marks_float32_products_with_rows(a_shape, b_shape, dtype, attrs, bf16):
    flow, f = new_flow()
    a = f.var("a", dtype, a_shape)
    b = f.var("b", dtype, b_shape)
    y = f.matmul(a, b, **attrs)
    use_matmul_precision(flow.func("f"), "bfloat16", Capabilities(matmul_precisions=("float32", "bfloat16")))
    assert y.producer.attrs.get("precision") == ("bfloat16" if bf16 else None)
    assert rv.ops.attrs_of(y.producer)["precision"] == ("bfloat16" if bf16 else "float32")


@pytest.mark.parametrize(("dtype", "products", "bf16"), [("float32", True, True), ("float32", False, False),
                                                      ("float64", True, False)])
def test_bfloat16_matmul_marks_float32_convolutions(dtype, products, bf16):
    """A convolution is a product of filters by windows: marked where the backend computes
    products in bf16 (not where it only keeps constant matrices so)."""
    flow, f = new_flow()
    y = f.conv2d(f.var("x", dtype, [2, 3, 8, 8]), f.var("w", dtype, [4, 3, 3, 3]), padding=1)
    precisions = ("float32", "bfloat16") if products else ("float32",)
    use_matmul_precision(flow.func("f"), "bfloat16", Capabilities(matmul_precisions=precisions, narrow_weights=("bfloat16",)))
    assert rv.ops.attrs_of(y.producer)["precision"] == ("bfloat16" if bf16 else "float32")


def test_bfloat16_matmul_leaves_other_ops():
    flow, f = new_flow()
    a = f.var("a", rv.DT_FLOAT, [8, 16])
    f.sum(a.exp(), axis=0)
    use_matmul_precision(flow.func("f"), "bfloat16", Capabilities(matmul_precisions=("float32", "bfloat16"),
                                                                   narrow_weights=("bfloat16",)))
    assert all("precision" not in op.attrs for op in flow.func("f").ops)


@pytest.mark.parametrize("weights", ["const", "learnable", "input", "assigned"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("products", [False, True])
def test_narrow_weights_mark_vector_products_by_unchanging_constants(weights, rows, products):
    """A backend keeping constant matrices in bf16 gets the products by them marked, a
    decode step's vector-matrix ones too, not those by a parameter, an input, or a constant
    some op writes (a cache); other products with rows where it computes in bf16."""
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [1, rows, 16])
    if weights == "input":
        w = f.var("w", rv.DT_FLOAT, [16, 4])
    elif weights == "learnable":
        w = f.parameter("w", rand([16, 4], seed=3))
    else:
        w = f.const(rand([16, 4], seed=3))
        if weights == "assigned":
            f.assign(w, w * 2.0)
    y = f.matmul(x, w)
    precisions = ("float32", "bfloat16") if products else ("float32",)
    use_matmul_precision(flow.func("f"), "bfloat16", Capabilities(matmul_precisions=precisions, narrow_weights=("bfloat16",)))
    marked = (products and rows > 1) or weights == "const"
    assert y.producer.attrs.get("precision") == ("bfloat16" if marked else None)


# ---- schedule ---------------------------------------------------------------------------------


def test_readers_include_readers_through_views():
    _, f = new_flow()
    w = f.parameter("w", rand([4, 5], seed=70))
    v = w.reshape([20])
    vv = v.reshape([2, 10])
    direct, through_view, through_two = w.tanh(), v.exp(), vv.sum()
    found = readers(w.var)
    for t in (v, vv, direct, through_view, through_two):
        assert t.producer in found


def test_assign_runs_after_every_reader_of_its_target():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 5])
    w = f.parameter("w", rand([4, 5], seed=71))
    f.assign(w, x * 2.0)  # built first
    direct = w.tanh()
    through_view = w.reshape([20]).exp()
    func = flow.func("f")
    assign = next(op for op in func.ops if op.type == "Assign")

    after = write_after_read(func)
    assert set(after) == {assign}
    assert {direct.producer, through_view.producer, through_view.producer.inputs[0].producer} <= set(after[assign])

    plain = flow.op_order(func)
    assert plain.index(assign) < plain.index(direct.producer)  # data flow alone would run it early
    order = schedule(flow, func)
    assert order[-1] is assign and len(order) == len(func.ops)

    net = rv.Compiler("reference").compile(flow)
    data = net.cell("f").instance()
    xv = rand([4, 5], seed=72)
    w0 = np.array(net["f/w"])
    data["f/x"] = xv
    data.compute()
    np.testing.assert_allclose(data[direct], np.tanh(w0), rtol=1e-6)
    np.testing.assert_allclose(data[through_view], np.exp(w0.reshape(20)), rtol=1e-6)
    np.testing.assert_allclose(net["f/w"], xv * 2, rtol=1e-6)


# ---- rewrite helpers --------------------------------------------------------------------------


def test_replace_uses_within_a_function_or_everywhere():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3])
    z = f.var("z", rv.DT_FLOAT, [3])
    a = x.exp()
    b, c = a.tanh(), a + a
    g = rv.Builder(flow, "g")
    d = g.sigmoid(a)  # another function reads a
    replace_uses(a.var, z.var, within=flow.func("f"))
    assert b.producer.inputs == [z.var] and c.producer.inputs == [z.var, z.var]
    assert d.producer.inputs == [a.var] and a.var.consumers == [d.producer]
    assert z.var.consumers.count(c.producer) == 2
    replace_uses(a.var, z.var)
    assert d.producer.inputs == [z.var] and a.var.consumers == []


def test_splice_keeps_the_names_the_flow_reads():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 5])
    y = f.softmax(x, axis=0, name="y")
    z = y.exp()
    y.var.out = z.var.out = True
    xv = rand([4, 5], seed=80)
    expected = run_reference(flow, {"f/x": xv}, [y.name, z.name])
    func = flow.func("f")
    op = y.producer
    b = rv.Builder(flow, func)
    replacement = b.wrap(x.var).transpose([1, 0]).softmax().transpose([1, 0])
    temporary = replacement.var

    splice(flow, op, [replacement])

    assert op not in func.ops and op.name not in flow.ops
    assert temporary.name not in flow.vars and flow.vars[y.name] is y.var
    assert y.var.producer.type == "Transpose" and y.var.producer in func.ops
    assert z.producer.inputs == [y.var]
    got = run_reference(flow, {"f/x": xv}, [y.name, z.name])
    for a_, b_ in zip(got, expected):
        np.testing.assert_allclose(a_, b_, rtol=1e-6)


def _exp_tanh_neg():
    """f: e = exp(x), a = tanh(e) (an output), c = neg(a), and the group [exp, tanh]."""
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 5])
    e = x.exp()
    a = f.tanh(e, name="a")
    c = a.neg()
    a.var.out = c.var.out = True
    return flow, x.var, e.var, a.var, c.var


@pytest.mark.parametrize("keep_place", [False, True])
def test_fuse_puts_one_op_in_place_of_a_group(keep_place):
    flow, x, e, a, c = _exp_tanh_neg()
    xv = rand([4, 5], seed=81)
    expected = run_reference(flow, {"f/x": xv}, [a.name, c.name])
    func = flow.func("f")
    group = [e.producer, a.producer]

    fused = fuse(flow, func, group, "Calculate", [x], [a], {"expr": "$0=Exp(%0);@0=Tanh($0)"}, dropped=[e],
                 keep_place=keep_place)

    assert fused.name == "f/Calculate" and fused.attrs == {"expr": "$0=Exp(%0);@0=Tanh($0)"}
    assert fused.inputs == [x] and fused.outputs == [a] and a.producer is fused and fused.func is func
    assert [op.type for op in func.ops] == (["Calculate", "Neg"] if keep_place else ["Neg", "Calculate"])
    assert all(op.name not in flow.ops for op in group) and e.name not in flow.vars
    assert x.consumers == [fused] and a.consumers == [c.producer]
    got = run_reference(flow, {"f/x": xv}, [a.name, c.name])
    for a_, b_ in zip(got, expected):
        np.testing.assert_allclose(a_, b_, rtol=1e-6)


def test_fuse_refuses_a_group_whose_value_would_be_lost():
    flow, x, e, a, _ = _exp_tanh_neg()
    func = flow.func("f")
    ops = list(func.ops)
    with pytest.raises(CompileError, match=f"would lose {e.name}: each value"):
        fuse(flow, func, [e.producer, a.producer], "Calculate", [x], [a], {"expr": "$0=Exp(%0);@0=Tanh($0)"})
    assert func.ops == ops and e.producer in ops  # nothing changed


def test_depends_on_follows_producers_within_the_function():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [3])
    z = f.var("z", rv.DT_FLOAT, [3])
    a = x.exp()
    b = (a * z).tanh()
    c = z.sigmoid()
    func = flow.func("f")
    assert depends_on(b.var, x.var, func) and depends_on(b.var, a.var, func) and depends_on(b.var, z.var, func)
    assert depends_on(b.var, b.var, func)
    assert not depends_on(c.var, x.var, func) and not depends_on(a.var, b.var, func)
    g = rv.Builder(flow, "g")
    d = g.neg(b)  # g reads f's b: f's ops are outside g
    assert depends_on(d.var, b.var, flow.func("g"))
    assert not depends_on(d.var, x.var, flow.func("g"))


# ---- plan_memory ------------------------------------------------------------------------------


def _overlap(s, t) -> bool:
    return s.offset < t.offset + t.size and t.offset < s.offset + s.size


def assert_sound(slots, steps) -> None:
    """Slots live at the same time never share a byte, except where an op writes its
    output exactly over an input it reads for the last time (in place)."""
    for i, s in enumerate(slots):
        assert s.offset % s.alignment == 0
        for t in slots[i + 1:]:
            if s.last < t.first or t.last < s.first or not _overlap(s, t):
                continue
            later, earlier = (s, t) if s.first >= t.first else (t, s)
            assert later.first >= 0 and earlier.last == later.first, (s.var.name, t.var.name)
            op = steps[later.first]
            assert earlier.var in op.inputs and later.var in op.outputs, (s.var.name, t.var.name)
            assert later.offset == earlier.offset


def _chain(length: int = 4, shape=(4, 4)):
    """x → Exp → Tanh → Sigmoid → ... → y: each value dies at the next step."""
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, list(shape))
    values = [x]
    for name in ["exp", "tanh", "sigmoid", "neg", "abs", "relu"][:length]:
        values.append(getattr(values[-1], name)())
    func = flow.func("f")
    return flow.op_order(func), [v.var for v in values]


def test_live_ranges_from_first_write_to_last_read():
    steps, values = _chain(3)
    x, a, b, y = values
    ranges = live_ranges(steps, values, pinned={x.name})
    assert ranges == {x.name: (-1, 3), a.name: (0, 1), b.name: (1, 2), y.name: (2, 2)}


def test_plan_memory_reuses_dead_storage():
    steps, values = _chain(5)
    pinned = {values[0].name, values[-1].name}
    slots, size = plan_memory(steps, values, pinned)
    assert_sound(slots, steps)
    by_name = {s.var.name: s for s in slots}
    assert len(by_name) == len(values)
    a, _, c = (by_name[v.name] for v in values[1:4])
    assert c.offset == a.offset  # a died at step 1, c is written at step 2: a union
    assert size < sum(s.size for s in slots)
    assert size == 4 * 64  # x, y, and two temporaries taking turns


def test_plan_memory_never_overlaps_live_variables():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [8, 8])
    W = f.array("W", rand([8, 3], seed=90))
    a = x.exp()
    b = a @ W
    c = (b.tanh() * 2.0).sum(axis=0)
    d = a.sum(axis=1)  # a stays live across the matmul and the tanh
    y = d.sum() + c.sum()
    func = flow.func("f")
    steps = flow.op_order(func)
    local = [v for op in steps for v in [*op.inputs, *op.outputs] if not v.is_global]
    local = list({v.name: v for v in local}.values())
    slots, _ = plan_memory(steps, local, {x.name, y.name})
    assert_sound(slots, steps)
    ranges = live_ranges(steps, local, {x.name, y.name})
    assert {s.var.name: (s.first, s.last) for s in slots} == ranges


def test_plan_memory_pinned_variables_keep_their_own_bytes():
    steps, values = _chain(4)
    x, _, b, _, y = values
    pinned = {x.name, b.name, y.name}  # b is, say, an output read after compute
    slots, _ = plan_memory(steps, values, pinned, in_place=lambda op, s, t: True)
    assert_sound(slots, steps)
    by_name = {s.var.name: s for s in slots}
    for name in pinned:
        assert (by_name[name].first, by_name[name].last) == (-1, len(steps))
        others = [s for s in slots if s.var.name != name]
        assert not any(_overlap(by_name[name], s) for s in others), name


def test_plan_memory_workspace_lives_during_its_step_only():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 4])
    a = x.exp()  # step 0
    s = a.sum(axis=1)  # step 1: a dies here
    y = s * 2.0  # step 2, with a workspace
    func = flow.func("f")
    steps = flow.op_order(func)
    workspace = rv.Variable("ws", rv.DT_UINT8, [a.var.nbytes])
    local = [x.var, y.var, a.var, s.var, workspace]
    slots, _ = plan_memory(steps, local, {x.name, y.name}, workspaces={2: workspace})
    assert_sound(slots, steps)
    by_name = {slot.var.name: slot for slot in slots}
    ws = by_name["ws"]
    assert (ws.first, ws.last) == (2, 2) and ws.size == a.var.nbytes
    assert ws.offset == by_name[a.name].offset  # a is dead by step 2: its bytes are free
    for name in (x.name, y.name, s.name):  # live during step 2
        assert not _overlap(ws, by_name[name])


def test_plan_memory_workspace_never_takes_an_input_of_its_step():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 4])
    W = f.array("W", rand([4, 8], seed=91))
    a = x.exp()  # step 0
    m = a @ W  # step 1: reads a for the last time, with a workspace of a's size
    y = m.tanh()  # step 2
    steps = flow.op_order(flow.func("f"))
    workspace = rv.Variable("ws", rv.DT_UINT8, [a.var.nbytes])
    local = [x.var, a.var, m.var, y.var, workspace]
    slots, _ = plan_memory(steps, local, {x.name, y.name}, ReferenceBackend().in_place, workspaces={1: workspace})
    by_name = {slot.var.name: slot for slot in slots}
    assert not _overlap(by_name["ws"], by_name[a.name])


def test_plan_memory_in_place_writes_over_a_dying_input():
    steps, values = _chain(2)
    x, a, y = values
    calls = []

    def in_place(op, source, target):
        calls.append((op.type, source.name, target.name))
        return True

    slots, _ = plan_memory(steps, values, {x.name, y.name}, in_place)
    by_name = {s.var.name: s for s in slots}
    assert_sound(slots, steps)
    assert by_name[y.name].offset != by_name[a.name].offset  # y is pinned: no in-place write
    assert ("Tanh", a.name, y.name) not in calls

    steps, values = _chain(3)
    x, a, b, y = values
    slots, _ = plan_memory(steps, values, {x.name, y.name}, lambda op, s, t: True)
    by_name = {s.var.name: s for s in slots}
    assert_sound(slots, steps)
    assert by_name[b.name].offset == by_name[a.name].offset  # Tanh writes b over a, which dies there
    slots, _ = plan_memory(steps, values, {x.name, y.name}, lambda op, s, t: False)
    by_name = {s.var.name: s for s in slots}
    assert_sound(slots, steps)
    assert by_name[b.name].offset != by_name[a.name].offset


def test_plan_memory_in_place_only_where_the_input_dies():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 4])
    a = x.exp()  # step 0
    b = a.tanh()  # step 1: a is read again at step 2
    y = a + b  # step 2
    steps = flow.op_order(flow.func("f"))
    slots, _ = plan_memory(steps, [x.var, a.var, b.var, y.var], {x.name, y.name}, lambda op, s, t: True)
    by_name = {s.var.name: s for s in slots}
    assert_sound(slots, steps)
    assert not _overlap(by_name[a.name], by_name[b.name])


class _WorkspaceBackend(ReferenceBackend):
    """The reference backend, with kernels that ask for working memory on MatMul steps."""

    def workspace_bytes(self, step) -> int:
        return 200 if step.op.type == "MatMul" else 0

    def in_place(self, op, source, target) -> bool:
        return False


def test_compiler_plans_a_workspace_for_each_step_that_asks():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [4, 8])
    W = f.array("W", rand([8, 8], seed=95))
    a = x.exp()
    m = a @ W
    y = (m.tanh() @ W).sum(axis=1)
    y.var.out = True
    compiler = rv.Compiler("reference")
    compiler.backend = _WorkspaceBackend()
    net = compiler.compile(flow)
    cell = net.cell("f")
    slots = {s.var.name: s for s in cell.slots}
    with_workspace = [i for i, step in enumerate(cell.steps) if step.workspace is not None]
    assert [cell.steps[i].op.type for i in with_workspace] == ["MatMul", "MatMul"]
    for i in with_workspace:
        workspace = cell.steps[i].workspace
        assert workspace.dtype == "uint8" and workspace.shape == [200]
        slot = slots[workspace.name]
        assert (slot.first, slot.last) == (i, i)
        live = [s for s in cell.slots if s is not slot and s.first <= i <= s.last]
        assert not any(_overlap(slot, s) for s in live)
    assert_sound(cell.slots, [step.op for step in cell.steps])
    xv = rand([4, 8], seed=96)
    data = cell.instance()
    data["f/x"] = xv
    data.compute()
    expected = (np.tanh(np.exp(xv) @ W.var.data) @ W.var.data).sum(axis=1)
    np.testing.assert_allclose(data[y], expected, rtol=1e-5)


# ---- run_pipeline -----------------------------------------------------------------------------


def _pipeline_flow():
    flow, f = new_flow()
    x = f.var("x", rv.DT_FLOAT, [8, 16])
    W = f.array("W", rand([16, 4], seed=100))
    y = ((x @ W) * 2.0 + 1.0).tanh()
    y.var.out = True
    return flow, y


def _fake_backend(precisions=("float32", "bfloat16"), narrow_weights=()):
    return types.SimpleNamespace(
        capabilities=Capabilities(rewrites=True, matmul_precisions=precisions, narrow_weights=narrow_weights),
        runs_whole=lambda op: True,
    )


def _context(flow, backend, options, keep):
    return PassContext(flow, flow.func("f"), backend, options, keep)


def test_pipeline_runs_nothing_for_the_reference_backend():
    flow, y = _pipeline_flow()
    before = list(flow.func("f").ops)
    assert run_pipeline(_context(flow, ReferenceBackend(), CompileOptions(), {y.name})) == []
    assert flow.func("f").ops == before


def test_pipeline_runs_the_rewrites_in_order_for_the_cpu_backend():
    flow, y = _pipeline_flow()
    backend = create_backend("cpu", CompileOptions())
    ran = run_pipeline(_context(flow, backend, CompileOptions(), {y.name}))
    assert ran == ["fuse-attention", "decompose", "fold", "cse", "row-transposes", "attention-layout", "fold-views", "column-products", "fuse", "chunk-lm-head", "fuse-loss", "fuse-router",
                   "fuse-epilogue", "fuse-conv-pool"]
    # the product's scale, shift and tanh run as its GEMM's epilogue
    assert op_types(flow.func("f")) == ["MatMulCalculate"]


@pytest.mark.parametrize(
    ("matmul", "precisions", "narrow", "runs", "mixed"),
    [
        ("bfloat16", ("float32", "bfloat16"), (), True, True),
        ("bfloat16", ("float32",), (), False, False),  # asked for, but the backend cannot
        ("float32", ("float32", "bfloat16"), ("bfloat16",), False, False),  # the backend can, but nobody asked
        ("bfloat16", ("float32",), ("bfloat16",), True, True),  # bf16 constants only: this product's matrix is one
    ],
)
def test_pipeline_mixed_precision_only_where_asked_and_possible(matmul, precisions, narrow, runs, mixed):
    flow, y = _pipeline_flow()
    options = dataclasses.replace(CompileOptions(), matmul=matmul)
    ran = run_pipeline(_context(flow, _fake_backend(precisions, narrow), options, {y.name}))
    expected = ["fuse-attention", "decompose", "fold", "cse", "row-transposes", "attention-layout", "fold-views", "column-products", "fuse", "chunk-lm-head", "fuse-loss", "fuse-router"] + (["mixed-precision"] if runs else [])
    assert ran == [*expected, "fuse-epilogue"]
    (matmul_op,) = [op for op in flow.func("f").ops if op.type == "MatMulCalculate"]
    assert matmul_op.attrs.get("precision") == ("bfloat16" if mixed else None)


@pytest.mark.parametrize(("precision", "stored", "applies"), [
    ("bfloat16", ("float32", "bfloat16"), True),
    ("bfloat16", ("float32",), False),  # asked for, but the backend cannot store bfloat16
    ("float32", ("float32", "bfloat16"), False),
])
def test_pipeline_activation_precision_only_where_asked_and_possible(precision, stored, applies):
    flow, y = _pipeline_flow()
    backend = types.SimpleNamespace(capabilities=Capabilities(activation_precisions=stored), runs_whole=lambda op: True)
    options = dataclasses.replace(CompileOptions(), precision=precision)
    ran = run_pipeline(_context(flow, backend, options, {y.name}))
    assert ("activation-precision" in ran) is applies
    assert ran.index("cse") < ran.index("fuse") and (not applies or ran.index("cse") < ran.index("activation-precision") < ran.index("fuse"))
    assert flow.vars[y.name].dtype == "float32"  # the function's output keeps its dtype


def test_pipeline_without_rewrites_skips_mixed_precision_too():
    flow, y = _pipeline_flow()
    backend = types.SimpleNamespace(
        capabilities=Capabilities(rewrites=False, matmul_precisions=("float32", "bfloat16")), runs_whole=lambda op: True,
    )
    options = dataclasses.replace(CompileOptions(), matmul="bfloat16")
    assert run_pipeline(_context(flow, backend, options, {y.name})) == []


def test_pipeline_debug_prints_the_function_after_each_pass(monkeypatch, capsys):
    flow, y = _pipeline_flow()
    monkeypatch.delenv("RANVIER_DEBUG", raising=False)
    run_pipeline(_context(flow, _fake_backend(), CompileOptions(), {y.name}))
    assert capsys.readouterr().err == ""

    flow, y = _pipeline_flow()
    monkeypatch.setenv("RANVIER_DEBUG", "passes")
    ran = run_pipeline(_context(flow, _fake_backend(), CompileOptions(), {y.name}))
    err = capsys.readouterr().err
    titles = [line for line in err.splitlines() if line.startswith("====")]
    assert titles == [f"==== f after {name} ====" for name in ran]
    assert err.count("func f {") == len(ran)
    last = err.rsplit("==== f after fuse-router ====", 1)[1]
    assert str(flow.func("f")) in last and "Calculate" in last
    first = err.split("==== f after fold ====", 1)[0]
    assert "Tanh" in first  # before fusion, the function still shows its elementwise ops


def test_fuse_sees_what_a_group_reads_through_members_it_takes_in_later():
    """Group A = {exp(x), A·m2} reads group C through m2 once its second member joins; C's
    second member reads A through m1. Merging both would make a cycle (A → m1 → C → m2 → A):
    the check must see A's new upstream from m1, whose dependence was recorded before."""
    flow, f = new_flow()
    x, y = f.var("x", rv.DT_FLOAT, [4, 4]), f.var("y", rv.DT_FLOAT, [4, 4])
    w1, w2 = f.array("w1", rand([4, 4], seed=1)), f.array("w2", rand([4, 4], seed=2))
    a = x.exp()
    m1 = a @ w1
    c = y.tanh()
    m2 = c @ w2
    a2 = a * m2
    c2 = c * m1
    for t in (a2, c2):
        t.var.out = True
    func = flow.func("f")
    feeds = {"f/x": rand([4, 4], seed=3), "f/y": rand([4, 4], seed=4)}
    expected = run_reference(flow, feeds, [a2.name, c2.name])
    fuse_elementwise(flow, func, flow.op_order(func), {a2.name, c2.name})
    flow.op_order(func)  # no cycle
    assert len(calculates(func)) == 1  # one of the two merges is refused
    for got, want in zip(run_reference(flow, feeds, [a2.name, c2.name]), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)
