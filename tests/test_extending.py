"""Extending ranvier from outside its source: a user's op gets its Builder method, its
gradient, a native kernel from its formula or a hand-written one, and the compiler shows
what it did (RANVIER_DEBUG, cell.llvm_ir(), cell.asm())."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import ranvier as rv
from ranvier import dtypes
from ranvier.autodiff import gradient
from ranvier.backends.cpu.kernels import LIBRARY, kernel
from ranvier.ops import TensorType, define, has_op

RNG = np.random.default_rng(11)


def _same_shape(ctx):
    return [TensorType(ctx.inputs[0].dtype, ctx.inputs[0].shape)]


if not has_op("ExtSquarePlus"):
    # x² + x, from its definition alone: reference, gradient, formula and method.
    define(
        "ExtSquarePlus", _same_shape, lambda attrs, args, outs: [np.square(np.asarray(args[0], np.float64)) + args[0]],
        1, "elementwise", "x² + x",
        vjp=lambda ctx, g: [g[0] * (ctx.inputs[0] * 2.0 + 1.0)],
        formula=lambda x: x * x + x,
        method="ext_square_plus",
    )
    # Elementwise, but with no formula: no generated code for it.
    define("ExtOpaque", _same_shape, lambda attrs, args, outs: [np.asarray(args[0], np.float64) * 3.0], 1, "elementwise")
    # A row op with a native kernel written by hand against the CPU kernel API.
    define(
        "ExtRowSum", lambda ctx: [TensorType(ctx.inputs[0].dtype, ctx.inputs[0].shape[:-1])],
        lambda attrs, args, outs: [np.asarray(args[0], np.float64).sum(axis=-1)], 1, "test",
        flops=lambda op: op.inputs[0].size,
    )

    @kernel("ExtRowSumLoop", {"ExtRowSum"}, supports=lambda op: op.inputs[0].dtype == dtypes.DT_FLOAT32)
    def _row_sum(ctx, op):
        x, out = op.inputs[0], op.outputs[0]
        n = x.shape[-1]
        total = ctx.local(x.dtype)
        with ctx.loop(0, out.size, name="row") as r:
            total.set(ctx.constant(x.dtype, 0.0))
            with ctx.loop(0, n, name="i") as i:
                total.set(total.value + ctx.load(x, r * n + i))
            ctx.store(out, r, total.value)


def _compile(build, shape, backend="cpu", dtype="float32", training=False):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.func.training = training
    x = f.var("x", dtype, shape)
    y = build(f, x)
    y.var.out = True
    network = rv.Compiler(backend).compile(flow)
    return flow, network.cell("f"), x, y


def _run(cell, x, y, value):
    data = cell.instance()
    data[y][...] = np.nan
    data[x] = value
    data.compute()
    return data[y].copy()


def test_a_user_elementwise_op_gets_a_method_a_native_kernel_and_fuses():
    value = RNG.uniform(-2, 2, (3, 37)).astype(np.float32)
    _, cell, x, y = _compile(lambda f, x: f.ext_square_plus(x.tanh()) * 0.5, [3, 37])
    text = str(cell)
    assert "ExtSquarePlus" in text and "Calculate[" in text and "[python]" not in text, text
    expected = 0.5 * (np.tanh(value.astype(np.float64)) ** 2 + np.tanh(value.astype(np.float64)))
    np.testing.assert_allclose(_run(cell, x, y, value), expected, rtol=2e-6, atol=1e-6)


def test_a_user_elementwise_op_runs_alone_as_an_elementwise_kernel():
    value = RNG.uniform(-2, 2, (5, 9)).astype(np.float64)
    _, cell, x, y = _compile(lambda f, x: x.ext_square_plus(), [5, 9], dtype="float64")
    assert [s.kernel for s in cell.steps] == ["Elementwise"]
    np.testing.assert_allclose(_run(cell, x, y, value), value * value + value, rtol=1e-14)


def test_a_user_ops_gradient_comes_from_its_definition():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float64", [4, 3])
    loss = f.ext_square_plus(x.sin()).sum()
    grads = gradient(flow, "f", [x], loss=loss)
    value = RNG.standard_normal((4, 3))
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    data[x] = value
    data.compute()
    np.testing.assert_allclose(data[grads["f/x"]], (2 * np.sin(value) + 1) * np.cos(value), rtol=1e-12)


def test_an_elementwise_op_without_a_formula_is_not_fused_and_runs_its_reference():
    value = RNG.uniform(-2, 2, (6,)).astype(np.float32)
    _, cell, x, y = _compile(lambda f, x: f.op("ExtOpaque", [x.exp()]) + 1.0, [6])
    assert [(s.op.type, s.label) for s in cell.steps] == [
        ("Exp", "Elementwise[" + cell.backend.target.variant + "]"),
        ("ExtOpaque", "Python[python]"),
        ("Add", "Elementwise[" + cell.backend.target.variant + "]"),
    ]
    np.testing.assert_allclose(_run(cell, x, y, value), np.exp(value.astype(np.float64)) * 3 + 1, rtol=2e-6)


def test_a_hand_written_kernel_registers_in_the_library_and_runs_natively():
    value = RNG.uniform(-1, 1, (4, 33)).astype(np.float32)
    _, cell, x, y = _compile(lambda f, x: f.op("ExtRowSum", [x]), [4, 33])
    (step,) = cell.steps
    assert step.kernel == "ExtRowSumLoop" and step.variant != "python"
    assert step.flops == value.size
    np.testing.assert_allclose(_run(cell, x, y, value), value.astype(np.float64).sum(axis=-1), rtol=1e-5)
    # What the kernel does not support falls back to the op's reference.
    _, cell64, x64, y64 = _compile(lambda f, x: f.op("ExtRowSum", [x]), [4, 33], dtype="float64")
    assert [s.label for s in cell64.steps] == ["Python[python]"]
    np.testing.assert_allclose(_run(cell64, x64, y64, value.astype(np.float64)), value.astype(np.float64).sum(axis=-1))


def test_a_kernel_of_a_lower_rank_is_tried_first_whenever_it_registers():
    library = type(LIBRARY)("test", LIBRARY.fallback)
    library.kernel("General", {"Relu"}, rank=10)(lambda ctx, op: None)
    library.kernel("Special", {"Relu"})(lambda ctx, op: None)
    flow = rv.Flow()
    relu = rv.Builder(flow, "f").var("x", "float32", [2]).relu()
    assert library.choose(relu.producer).name == "Special"
    with pytest.raises(ValueError, match="registered twice"):
        library.kernel("General", {"Relu"}, rank=20)(lambda ctx, op: None)
    with pytest.raises(ValueError, match="Special and Other may take the same ops and have the same rank 0"):
        library.kernel("Other", None)(lambda ctx, op: None)


def test_debug_passes_prints_the_function_after_each_pass(monkeypatch, capsys):
    monkeypatch.setenv("RANVIER_DEBUG", "passes")
    _compile(lambda f, x: (x * 2.0).exp().sum(axis=1), [3, 4])
    err = capsys.readouterr().err
    for name in ("fuse-attention", "decompose", "fold", "cse", "fuse", "fuse-loss", "fuse-router"):
        assert f"==== f after {name} ====" in err
    assert "Calculate(" in err.split("f after fuse ====")[1]


def test_debug_llvm_and_asm_print_the_generated_code(monkeypatch, capsys):
    monkeypatch.setenv("RANVIER_DEBUG", "llvm,asm")
    _, cell, _, _ = _compile(lambda f, x: (x * 2.0).exp(), [3, 4])
    err = capsys.readouterr().err
    assert "==== cell f: LLVM IR ====" in err and re.search(r'define void @"?cell"?', err)
    assert "==== cell f: machine code ====" in err and "ret" in err
    # The same text on demand, cached or not.
    assert re.search(r'define void @"?cell"?', cell.llvm_ir()) and "step0" in cell.llvm_ir()
    assert re.search(r"\bret[lq]?\b", cell.asm())


def test_nothing_is_printed_without_debug(monkeypatch, capsys):
    monkeypatch.delenv("RANVIER_DEBUG", raising=False)
    _compile(lambda f, x: x.exp(), [2])
    assert capsys.readouterr().err == ""


def test_the_reference_backend_says_it_generates_no_code():
    _, cell, _, _ = _compile(lambda f, x: x.exp(), [2], backend="reference")
    with pytest.raises(rv.RanvierError, match="generates no code"):
        cell.llvm_ir()


def test_builder_methods_and_attribute_defaults_come_from_the_definitions():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [2, 3])
    ln = f.layer_norm(x, eps=1e-5)
    assert ln.producer.attrs == {}  # the declared default is left out
    ln2 = x.layer_norm(eps=1e-3)
    assert ln2.producer.attrs == {"eps": "0.001"}
    assert rv.ops.attrs_of(ln.producer)["eps"] == 1e-5
    with pytest.raises(AttributeError, match="no_such_op"):
        f.no_such_op(x)
    with pytest.raises(rv.RanvierError, match="no attribute"):
        x.softmax(axes=1)
    assert math.isclose(rv.ops.op_def("LayerNorm").attrs["eps"].default, 1e-5)


def test_a_backend_plugs_in_without_touching_the_compiler():
    """A backend registered by name: here the numpy oracle, but asking for the rewriting
    passes (so its steps are the fused, decomposed ones the CPU backend would run)."""
    import dataclasses

    from ranvier.backends import register_backend
    from ranvier.backends.reference import ReferenceBackend

    class RewritingReference(ReferenceBackend):
        name = "rewriting-reference"
        capabilities = dataclasses.replace(ReferenceBackend.capabilities, rewrites=True)

        def runs_whole(self, op):
            return op.type != "Conv2D"  # as if it had no convolution kernel

    register_backend("rewriting-reference", RewritingReference)
    value = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    weights = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    results = {}
    for backend in ("reference", "rewriting-reference"):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        x = f.var("x", "float32", value.shape)
        y = (f.conv2d(x, f.array("w", weights), padding=1) * 2.0).tanh() + 1.0
        y.var.out = True
        cell = rv.Compiler(backend).compile(flow).cell("f")
        results[backend] = (_run(cell, x, y, value), [s.op.type for s in cell.steps])
    assert "Conv2D" in results["reference"][1] and "Calculate" not in results["reference"][1]
    assert "Conv2D" not in results["rewriting-reference"][1] and "Calculate" in results["rewriting-reference"][1]
    np.testing.assert_allclose(results["rewriting-reference"][0], results["reference"][0], rtol=1e-5, atol=1e-6)
