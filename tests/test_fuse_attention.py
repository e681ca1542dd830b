"""The fuse-attention pass: softmax(scale · Q Kᵀ + mask) V written out op by op becomes
one Attention op, in exported models and in flows built by hand, and only where that is
exact. The CPU backend's score budget is set to 0 here, so a fused op runs the fused
kernel (AttentionGemm) and its presence in the steps shows the pass fired."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check, random_array, run_flow
from test_onnx_import import check as check_against_ort
from test_onnx_import import export, family, graph_inputs

import ranvier as rv
import ranvier.onnx
from ranvier.compiler.attention import fuse_attention


@pytest.fixture(autouse=True)
def fused_kernels(monkeypatch):
    import ranvier.backends.cpu.kernels.attention as cpu

    monkeypatch.setattr(cpu, "SCORES_BUDGET", 0)


def kernels(flow: rv.Flow) -> set[str]:
    return {s.kernel for s in rv.Compiler("cpu").compile(flow).cell("f").steps}


def built(build, inputs):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", str(a.dtype), a.shape) for i, a in enumerate(inputs)]
    outputs = build(f, *handles)
    for out in outputs if isinstance(outputs, list) else [outputs]:
        out.var.out = True
    return flow


def causal_mask(queries, keys, dtype="float32"):
    hidden = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
    return np.where(hidden, -np.inf, 0.0).astype(dtype)


def reference(q, k, v, scale, bias=None):
    scores = np.einsum("...td,...sd->...ts", q.astype(np.float64), k.astype(np.float64)) * scale
    if bias is not None:
        scores = scores + bias
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("name", ["bert", "gpt"])
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_exported_attention_becomes_one_op(name, dynamo):
    """Both of PyTorch's exporters: a BERT-style encoder's padding mask becomes the op's
    bias, a GPT-2-style decoder's causal mask its causal flag; ORT agrees."""
    module, inputs = family(name)
    model = export(module, inputs, dynamo)
    flow = ranvier.onnx.load(model)
    func = flow.funcs["main"]
    fuse_attention(flow, func, {v.name for v in flow.vars.values() if v.out})
    fused = [op for op in func.ops if op.type == "Attention"]
    assert len(fused) == 2 and not any(op.type == "Softmax" for op in func.ops)
    for op in fused:
        assert (len(op.inputs) == 4) == (name == "bert")
        assert op.attrs.get("causal", "1") == ("0" if name == "bert" else "1")
    steps = {s.kernel for s in rv.Compiler("cpu").compile(ranvier.onnx.load(model)).cell("main").steps}
    assert "AttentionGemm" in steps
    check_against_ort(model, {n: t.numpy() for n, t in zip(graph_inputs(model), inputs)})


def test_scaled_scores_of_rank_3_with_a_transposed_product():
    """[B·H, T, hd] queries, Kᵀ as the product's transpose_b, the scores divided."""
    q, k, v = (random_array(s, "float32", seed=i) for i, s in enumerate([(6, 5, 8), (6, 7, 8), (6, 7, 8)]))

    def build(f, q, k, v):
        return (q.matmul(k, transpose_b=True) / 4.0).softmax() @ v

    assert "AttentionGemm" in kernels(built(build, [q, k, v]))
    check(run_flow(build, [q, k, v])[0], reference(q, k, v, 0.25))


def test_factors_on_both_sides_and_a_plain_transposed_key():
    """√scale on Q and on Kᵀ (as the dynamo exporter writes), Kᵀ an input of its own: the
    fused op transposes it."""
    q, kt, v = (random_array(s, "float32", seed=i) for i, s in enumerate([(2, 3, 4, 8), (2, 3, 8, 6), (2, 3, 6, 8)]))

    def build(f, q, kt, v):
        return ((q * 0.5) @ (kt * 0.5)).softmax() @ v

    assert "AttentionGemm" in kernels(built(build, [q, kt, v]))
    check(run_flow(build, [q, kt, v])[0], reference(q, kt.swapaxes(-1, -2), v, 0.25))


def test_a_causal_mask_beside_a_padding_mask():
    """A constant causal mask with fewer queries than keys becomes the flag; the padding
    mask stays as the bias."""
    q, k, v = (random_array(s, "float32", seed=i) for i, s in enumerate([(2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4)]))
    padding = np.where(np.arange(5)[None, None, None, :] < np.array([5, 3])[:, None, None, None], 0.0, -np.inf).astype(np.float32)

    def build(f, q, k, v, pad):
        scores = q.matmul(k, transpose_b=True) * 0.5 + f.array("causal", causal_mask(3, 5))
        return (scores + pad).softmax() @ v

    flow = built(build, [q, k, v, padding])
    fuse_attention(flow, flow.funcs["f"], set())
    (op,) = [op for op in flow.funcs["f"].ops if op.type == "Attention"]
    assert op.attrs.get("causal", "1") == "1" and len(op.inputs) == 4
    check(run_flow(build, [q, k, v, padding])[0], reference(q, k, v, 0.5, causal_mask(3, 5) + padding))


def test_a_mask_that_is_not_causal_is_a_bias():
    q, k, v = (random_array(s, "float32", seed=i) for i, s in enumerate([(1, 2, 4, 4), (1, 2, 4, 4), (1, 2, 4, 4)]))
    almost = causal_mask(4, 4)
    almost[1, 2] = 0.0  # query 1 also sees key 2

    def build(f, q, k, v):
        return (q.matmul(k, transpose_b=True) + f.array("almost", almost)).softmax() @ v

    flow = built(build, [q, k, v])
    fuse_attention(flow, flow.funcs["f"], set())
    (op,) = [op for op in flow.funcs["f"].ops if op.type == "Attention"]
    assert op.attrs.get("causal") == "0" and len(op.inputs) == 4
    check(run_flow(build, [q, k, v])[0], reference(q, k, v, 1.0, almost))


def test_the_guard_against_rows_of_masked_keys_is_seen_through():
    """PyTorch's SDPA exported in training mode zeroes NaN probabilities (a query whose
    every key is masked), where(p != p, 0, p): the fused op gives such rows zeros itself."""
    q, k, v = (random_array(s, "float32", seed=i) for i, s in enumerate([(2, 2, 4, 8), (2, 2, 4, 8), (2, 2, 4, 8)]))

    def build(f, q, k, v):
        p = (q.matmul(k, transpose_b=True) * 0.5 + f.array("causal", causal_mask(4, 4))).softmax()
        return f.cond(p.not_equal(p), f.const(0.0), p) @ v

    flow = built(build, [q, k, v])
    fuse_attention(flow, flow.funcs["f"], set())
    assert [op.type for op in flow.funcs["f"].ops] == ["Attention"]
    check(run_flow(build, [q, k, v])[0], reference(q, k, v, 0.5, causal_mask(4, 4)))


@pytest.mark.parametrize("pattern", ["probabilities read elsewhere", "mask added before the scale", "softmax over keys' axis 2"])
def test_patterns_that_are_not_attention_stay_as_written(pattern):
    q, k, v = (random_array(s, "float32", seed=i) for i, s in enumerate([(1, 2, 4, 4), (1, 2, 4, 4), (1, 2, 4, 4)]))
    mask = random_array((4, 4), "float32", seed=9)

    def build(f, q, k, v):
        scores = q.matmul(k, transpose_b=True)
        if pattern == "probabilities read elsewhere":
            p = scores.softmax()
            return [p @ v, p]
        if pattern == "mask added before the scale":
            return ((scores + f.array("mask", mask)) * 0.5).softmax() @ v
        return scores.softmax(axis=2) @ v

    assert "AttentionGemm" not in kernels(built(build, [q, k, v]))
    got = run_flow(build, [q, k, v])
    want = {"probabilities read elsewhere": reference(q, k, v, 1.0),
            "mask added before the scale": reference(q, k, v, 0.5, 0.5 * mask)}.get(pattern)
    if want is not None:
        check(got[0], want)
