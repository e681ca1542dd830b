"""Calculate expressions, the Calculate op, and the elementwise fusion pass."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ranvier as rv
from ranvier.compiler.fuse import fuse_elementwise
from ranvier.ops import expression
from ranvier.ops.expression import ExpressionError, parse, program_of

TESTED_OPS = {"Calculate"}


def test_expression_round_trip():
    text = "$0=Mul(%0,%1);$1=Add($0,%2);@0=Gelu[approximate=tanh]($1);%3=Sub(%3,@0)"
    assert str(parse(text)) == text
    with pytest.raises(ExpressionError):
        parse("$0=Mul(%0,")
    with pytest.raises(ExpressionError):
        parse("Mul(%0,%1)")
    with pytest.raises(ExpressionError):
        parse("$0=Mul(%0,%1) junk")


def test_calculate_op_evaluates_its_program_and_writes_in_place():
    rng = np.random.default_rng(0)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [4, 5])
    y = f.var("y", rv.DT_FLOAT, [5])
    p = f.parameter("p", rng.standard_normal((4, 5)).astype(np.float32))
    out = f.op("Calculate", [x, y, p], attrs={"expr": "$0=Mul(%0,%1);@0=Tanh($0);%2=Sub(%2,@0)"})
    net = rv.Compiler().compile(flow)
    data = net.cell("f").instance()
    xv, yv = rng.standard_normal((4, 5)), rng.standard_normal(5)
    data[x], data[y] = xv, yv
    before = net[p].copy()
    data.compute()
    expected = np.tanh(xv * yv)
    np.testing.assert_allclose(data[out], expected, rtol=1e-6)
    np.testing.assert_allclose(net[p], before - expected, rtol=1e-5)


def test_a_program_is_parsed_once_and_follows_its_expression(monkeypatch):
    texts = []
    monkeypatch.setattr(expression, "parse", lambda text: texts.append(text) or parse(text))
    expression.parsed.cache_clear()
    flow, x, _s, z = build_chain()
    z.var.out = True
    net = rv.Compiler().compile(flow)
    data = net.cell("f").instance()
    data[x] = np.random.default_rng(3).standard_normal((6, 7)).astype(np.float32)
    data.compute()
    programs = [op for op in net.flow.funcs["f"].ops if "expr" in op.attrs]
    assert len(programs) == 2 and sorted(texts) == sorted(op.attrs["expr"] for op in programs)  # each text once
    op = programs[0]
    assert program_of(op) is program_of(op) and str(program_of(op)) == op.attrs["expr"]
    op.attrs["expr"] = "@0=Neg(%0)"  # a pass rewrites the program: it is read anew
    assert str(program_of(op)) == "@0=Neg(%0)" and program_of(op).writes == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        program_of(op).statements = ()  # shared between ops: it cannot change under one of them


def test_calculate_rejects_mistyped_in_place_write():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [4, 5])
    q = f.parameter("q", np.ones(5, np.float32))
    with pytest.raises(rv.ShapeError, match="in place"):
        f.op("Calculate", [x, q], attrs={"expr": "%1=Exp(%0)"})


def build_chain():
    rng = np.random.default_rng(1)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [6, 7])
    b = f.array("b", rng.standard_normal(7).astype(np.float32))
    w = f.parameter("w", rng.standard_normal((6, 7)).astype(np.float32))
    h = ((x * 2.0 + b).tanh() - x).exp()  # one group
    s = h.sum(axis=1, name="s")  # a reduction ends it
    z = (h * s.expand_dims(1)).sigmoid()  # a second group reading the first's output
    f.op("Assign", [w, w - z * 0.1])  # folds into the second group as an in-place write
    return flow, x, s, z


def test_fusion_groups_chains_and_folds_assign():
    flow, _x, s, z = build_chain()
    z.var.out = True
    func = flow.funcs["f"]
    before = [op.type for op in flow.op_order(func)]
    fuse_elementwise(flow, func, flow.op_order(func), keep={s.name, z.name})
    fused = flow.op_order(func)
    types = [op.type for op in fused]
    assert types == ["Calculate", "Sum", "ExpandDims", "Calculate"], before
    second = parse(fused[-1].attrs["expr"])
    written = [target for target, _ in second.statements if target.kind == "%"]
    assert len(written) == 1 and fused[-1].inputs[written[0].index].name == "f/w"
    assert fused[-1].outputs[0].name == z.name  # kept: the cell must still show z


def test_fused_flow_computes_what_the_original_did():
    rng = np.random.default_rng(2)
    xv = rng.standard_normal((6, 7)).astype(np.float32)
    results = []
    for fuse in (False, True):
        flow, x, s, z = build_chain()
        z.var.out = True
        if fuse:
            func = flow.funcs["f"]
            fuse_elementwise(flow, func, flow.op_order(func), keep={s.name, z.name})
        net = rv.Compiler().compile(flow)
        data = net.cell("f").instance()
        data[x] = xv
        data.compute()
        results.append((np.array(data[s]), np.array(data[z]), np.array(net["f/w"])))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6)
