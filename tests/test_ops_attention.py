"""Fused attention (Attention, AttentionGrad) against a per-head numpy loop, on every backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (
    assert_mentions,
    assert_within_bound,
    attention_with_gradient,
    check,
    random_array,
    run_flow,
    shape_error,
)

TESTED_OPS = {"Attention", "AttentionGrad"}

SHAPES = [  # (B, H, KV, T, S, hd)
    (2, 4, 2, 5, 5, 8),
    (1, 3, 1, 4, 7, 6),  # multi-query, queries are the last 4 of 7 positions
    (2, 2, 2, 9, 9, 19),
    (1, 4, 2, 6, 6, 37),  # a head size the CPU backend runs through its fused kernels
    (1, 2, 1, 3, 5, 32),
    (1, 3, 1, 100, 130, 16),  # two blocks of query rows; causal rows of 31 to 130 keys, in whole vectors and a tail
]


def naive(q, k, v, dout, causal, scale, bias=None):
    """Loops over heads and queries, float64: the output, the three gradients and each
    query's log-sum-exp of its scores (the forward's statistics)."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    b, h, t, _ = q.shape
    kv, s = k.shape[1], k.shape[2]
    bias = np.broadcast_to(np.zeros(()) if bias is None else np.asarray(bias, np.float64), (b, h, t, s))
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    lse = np.zeros((b, h, t))
    for n in range(b):
        for head in range(h):
            g = head // (h // kv)
            for i in range(t):
                visible = i + s - t + 1 if causal else s
                scores = np.array([scale * q[n, head, i] @ k[n, g, j] + bias[n, head, i, j] for j in range(visible)])
                p = np.exp(scores - scores.max())
                lse[n, head, i] = scores.max() + np.log(p.sum())
                p /= p.sum()
                out[n, head, i] = p @ v[n, g, :visible]
                dp = np.array([dout[n, head, i] @ v[n, g, j] for j in range(visible)])
                ds = p * (dp - p @ dp)
                dq[n, head, i] = scale * ds @ k[n, g, :visible]
                dk[n, g, :visible] += scale * np.outer(ds, q[n, head, i])
                dv[n, g, :visible] += np.outer(p, dout[n, head, i])
    return out, dq, dk, dv, lse


@pytest.fixture(params=["decomposed", "fused"])
def cpu_attention(request, monkeypatch):
    """The cpu backend decomposes attention unless its scores exceed a budget (none on
    AVX-512): an unbounded budget makes every case decompose, a zero one run fused."""
    import ranvier.backends.cpu.kernels.attention as cpu

    monkeypatch.setattr(cpu, "SCORES_BUDGET", 0 if request.param == "fused" else 1 << 62)
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_and_its_gradient(dtype, shape, causal, cpu_attention):
    b, h, kv, t, s, hd = shape
    q, k, v, dout = (random_array(x, dtype, seed=i) for i, x in enumerate([(b, h, t, hd), (b, kv, s, hd), (b, kv, s, hd), (b, h, t, hd)]))
    attrs = {"causal": causal}
    outputs = run_flow(lambda f, *x: attention_with_gradient(f, *x, **attrs), [q, k, v, dout])
    for got, want in zip(outputs, naive(q, k, v, dout, causal, 1.0 / math.sqrt(hd))):
        check(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[5]])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_tokens_first(dtype, shape, causal, cpu_attention):
    """heads_first false: q, k, v, the output and the gradients [B, T, heads, hd], as a
    model's projections give them; read and written in place by the fused kernels (rows of
    a head heads · hd apart), transposed around the op elsewhere."""
    b, h, kv, t, s, hd = shape
    q, k, v, dout = (random_array(x, dtype, seed=i) for i, x in enumerate([(b, t, h, hd), (b, s, kv, hd), (b, s, kv, hd), (b, t, h, hd)]))
    attrs = {"causal": causal, "heads_first": False}
    outputs = run_flow(lambda f, *x: attention_with_gradient(f, *x, **attrs), [q, k, v, dout])
    wanted = naive(*(np.swapaxes(x, 1, 2) for x in (q, k, v, dout)), causal, 1.0 / math.sqrt(hd))
    for got, want in zip(outputs, wanted):
        check(got, want if want.ndim == 3 else np.swapaxes(want, 1, 2), dtype)


def test_attention_tokens_first_checks_its_layout():
    message = shape_error(lambda f, q, k, v: f.attention(q, k, v, heads_first=False),
                          [("q", "float32", [2, 5, 4, 8]), ("k", "float32", [2, 4, 5, 8]), ("v", "float32", [2, 4, 5, 8])])
    assert_mentions(message, "Attention", "heads H a multiple of key/value heads KV")


def score_bias(kind, b, h, t, s, dtype):
    """A padding mask [B, 1, 1, S] of 0 and −∞ (the last key always seen, the first
    image's first keys hidden: left padding) or a learned position bias [H, T, S]."""
    rng = np.random.default_rng(3)
    if kind == "position":
        return rng.standard_normal((h, t, s)).astype(dtype)
    hidden = rng.random((b, 1, 1, s)) < 0.3
    hidden[0, ..., :2], hidden[..., -1] = True, False
    return np.where(hidden, -np.inf, 0.0).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[3]])
@pytest.mark.parametrize("kind", ["padding", "position"])
def test_attention_adds_a_score_bias(dtype, shape, kind, cpu_attention):
    b, h, kv, t, s, hd = shape
    q, k, v, dout = (random_array(x, dtype, seed=i) for i, x in enumerate([(b, h, t, hd), (b, kv, s, hd), (b, kv, s, hd), (b, h, t, hd)]))
    bias = score_bias(kind, b, h, t, s, dtype)
    attrs = {"causal": False}
    outputs = run_flow(lambda f, q, k, v, d, bias: attention_with_gradient(f, q, k, v, d, bias, **attrs), [q, k, v, dout, bias])
    for got, want in zip(outputs, naive(q, k, v, dout, False, 1.0 / math.sqrt(hd), bias)):
        check(got, want, dtype)


def unseen_mask(b, t, s, causal):
    """Padding masks [B, 1, 1, S] under which some queries see no key: with `causal`, left
    padding (the second image's first keys hidden, so its first queries see only padding);
    without, a batch image whose every key is hidden."""
    hidden = np.zeros((b, 1, 1, s), bool)
    if causal:
        hidden[1, ..., : s - t + 2] = True
    else:
        hidden[1] = True
    hidden[0, ..., 1] = True
    return np.where(hidden, -np.inf, 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_query_that_sees_no_key_attends_to_nothing(dtype, causal, cpu_attention):
    """Its output row and every gradient it contributes are 0 — what PyTorch's
    scaled_dot_product_attention gives and ONNX's Attention specifies — not the softmax's
    0/0; the other queries are as without it. PyTorch, float64, is the oracle."""
    b, h, kv, t, s, hd = 2, 4, 2, 6, 8, 8
    q, k, v, dout = (random_array(x, dtype, seed=i) for i, x in enumerate([(b, h, t, hd), (b, kv, s, hd), (b, kv, s, hd), (b, h, t, hd)]))
    mask = unseen_mask(b, t, s, causal).astype(dtype)
    attrs = {"causal": causal}
    outputs = run_flow(lambda f, q, k, v, d, mask: attention_with_gradient(f, q, k, v, d, mask, **attrs), [q, k, v, dout, mask])
    wanted, unseen = masked_sdpa(q, k, v, dout, mask, causal)
    assert unseen.any() and not unseen.all()
    assert np.all(wanted[0][unseen] == 0)
    for got, want in zip(outputs, wanted):
        check(got, want, dtype)


def masked_sdpa(q, k, v, dout, mask, causal):
    """PyTorch's scaled_dot_product_attention in float64 under `mask` (heads first, key/value
    heads repeated for their groups): the output, the three gradients and the scores'
    log-sum-exp (+∞ where a query sees no key), and which (batch, head, query) see no key."""
    import torch

    (b, h, t, _), (kv, s) = q.shape, k.shape[1:3]
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    visible = torch.tensor(mask, dtype=torch.float64)
    if causal:
        visible = visible + torch.triu(torch.full((t, s), -torch.inf, dtype=torch.float64), diagonal=s - t + 1)
    groups = h // kv
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk.repeat_interleave(groups, 1), tv.repeat_interleave(groups, 1),
                                                           attn_mask=visible)
    out.backward(torch.tensor(dout, dtype=torch.float64))
    unseen = np.broadcast_to(np.isneginf(visible.numpy().max(axis=-1)), (b, h, t))
    scores = tq @ tk.repeat_interleave(groups, 1).transpose(-1, -2) / math.sqrt(q.shape[-1]) + visible
    lse = torch.logsumexp(scores, dim=-1).detach().numpy()
    return [*(x.detach().numpy() for x in (out, tq.grad, tk.grad, tv.grad)), np.where(unseen, np.inf, lse)], unseen


def fused_over_two_parts(monkeypatch) -> None:
    """The CPU's fused attention kernels for every size, their items over two parts."""
    import ranvier.backends.cpu.kernels.attention as cpu

    monkeypatch.setattr(cpu, "SCORES_BUDGET", 0)
    monkeypatch.setattr(cpu, "thread_count", lambda: 2)
    monkeypatch.setattr(cpu, "worth_splitting", lambda *args, **kwargs: True)


def operands(b, h, kv, t, s, hd):
    """Random q, k, v and d out, heads first."""
    return [random_array(shape, "float32", seed=i) for i, shape in enumerate([(b, h, t, hd), (b, kv, s, hd), (b, kv, s, hd), (b, h, t, hd)])]


def _layout(heads_first: bool, x):
    """x [B, H, T, hd] as a test feeds it: as it is, or [B, T, H, hd] where heads come second."""
    return x if heads_first or x.ndim != 4 else np.swapaxes(x, 1, 2)


def _grad_op(b, h, kv, t, s, hd):
    import ranvier as rv

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    q, d = (f.var(n, "float32", [b, h, t, hd]) for n in "qd")
    k, v = (f.var(n, "float32", [b, kv, s, hd]) for n in "kv")
    attention_with_gradient(f, q, k, v, d)
    return flow.ops["f/AttentionGrad"]


def test_attention_bias_errors():
    inputs = [("q", "float32", [2, 3, 4, 8]), ("k", "float32", [2, 3, 5, 8]), ("v", "float32", [2, 3, 5, 8])]
    for shape in ([2, 3, 4, 4], [3, 1, 1, 5], [1, 2, 3, 4, 5]):
        message = shape_error(lambda f, q, k, v, bias: f.attention(q, k, v, bias), [*inputs, ("bias", "float32", shape)])
        assert_mentions(message, "Attention", "broadcasts to the scores' shape [B, H, T, S] = [2, 3, 4, 5]")


def test_attention_shape_errors():
    message = shape_error(lambda f, q, k, v: f.op("Attention", [q, k, v]), [("q", "float32", [1, 3, 4, 8]), ("k", "float32", [1, 2, 4, 8]), ("v", "float32", [1, 2, 4, 8])])
    assert_mentions(message, "Attention", "q: float32[1x3x4x8]", "multiple of key/value heads")
    message = shape_error(lambda f, q, k, v: f.op("Attention", [q, k, v]), [("q", "float32", [1, 2, 6, 8]), ("k", "float32", [1, 2, 4, 8]), ("v", "float32", [1, 2, 4, 8])])
    assert_mentions(message, "no more queries than keys")


@pytest.mark.parametrize("dtype, forward, backward", [("float32", "AttentionGemm", "AttentionGradGemm"),
                                                     ("float64", "AttentionRow", "AttentionGradRow")])
def test_cpu_fuses_attention_only_when_its_scores_are_too_big_to_store(cpu_attention, dtype, forward, backward):
    """float32 goes through the generated GEMM a block of query rows at a time."""
    import ranvier as rv

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    q, k, v, d = (f.var(n, dtype, [1, 2, 4, 32]) for n in "qkvd")
    attention_with_gradient(f, q, k, v, d)
    kernels = {s.kernel for s in rv.Compiler("cpu").compile(flow).cell("f").steps}
    fused = cpu_attention == "fused"
    assert ({forward, backward} <= kernels) == fused
    assert bool(kernels & {"BlasGemm", "Gemm"}) != fused


def test_decomposed_backward_reuses_the_forward_probabilities(monkeypatch):
    import ranvier as rv
    import ranvier.backends.cpu.kernels.attention as cpu

    monkeypatch.setattr(cpu, "SCORES_BUDGET", 1 << 62)

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    q, k, v, d = (f.var(n, "float32", [2, 4, 16, 8]) for n in "qkvd")
    for result in attention_with_gradient(f, q, k, v, d):
        result.var.out = True
    kernels = [s.kernel for s in rv.Compiler("cpu").compile(flow).cell("f").steps]
    assert kernels.count("SoftmaxRow") == 1, kernels


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", [None, "padding", "position"])
@pytest.mark.parametrize("b, kv, threads", [(2, 2, 3), (1, 1, 3), (2, 1, 5)])
@pytest.mark.parametrize("heads_first", [True, False])
def test_attention_gemm_blocks_over_parts(causal, kind, b, kv, threads, heads_first, monkeypatch):
    """AttentionGemm and AttentionGradGemm with blocks of 8 query rows (the last one short),
    items shared out over parts, grouped heads, more keys than queries: every output and
    gradient equal to the per-head loop's. With fewer (batch, key/value head) items than
    parts (multi-query attention at batch 1 or 2), the gradient shares each item's blocks
    out and sums the parts' d keys and d values after (into rows kv · hd apart where the
    tensors are [B, T, heads, hd])."""
    import ranvier.backends.cpu.kernels.attention as cpu

    monkeypatch.setattr(cpu, "SCORES_BUDGET", 0)
    monkeypatch.setattr(cpu, "_BLOCK_BYTES", 4 * 8 * 45)
    monkeypatch.setattr(cpu, "thread_count", lambda: threads)
    monkeypatch.setattr(cpu, "worth_splitting", lambda *args, **kwargs: True)
    h, t, s, hd = 4, 37, 45, 12
    split = [part.pairs for part in cpu._grad_parts(_grad_op(b, h, kv, t, s, hd))]
    assert all(split) == (b * kv < threads) and (len(split) > b * kv or b * kv >= threads)
    q, k, v = (random_array(x, "float32", seed=i) for i, x in enumerate([(b, h, t, hd), (b, kv, s, hd), (b, kv, s, hd)]))
    inputs = [q, k, v] + ([] if kind is None else [score_bias(kind, b, h, t, s, "float32")])
    dout = random_array((b, h, t, hd), "float32", seed=7)
    bias = inputs[3:]

    def build(f, q, k, v, dout, *bias):
        return attention_with_gradient(f, q, k, v, dout, *bias, causal=causal, heads_first=heads_first)

    got = run_flow(build, [*(_layout(heads_first, x) for x in (q, k, v, dout)), *bias])
    for result, want in zip(got, naive(q, k, v, dout, causal, 1.0 / math.sqrt(hd), bias[0] if bias else None)):
        check(result, _layout(heads_first, want), "float32")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads_first", [True, False])
def test_attention_gemm_pads_score_rows_4_kib_apart(causal, heads_first, monkeypatch):
    """With 1,024 keys a block's rows of scores would lie 4 KiB apart, so the kernels keep
    them a cache line further apart: the forward's and the gradient's products, row passes
    and d keys / d values read them through that stride (over two parts) and every output
    equals the per-head loop's; the last rows of a causal block see all 1,024 keys."""
    import ranvier.backends.cpu.kernels.attention as cpu

    fused_over_two_parts(monkeypatch)
    b, h, kv, t, s, hd = 1, 2, 1, 11, 1024, 8
    assert cpu._score_stride(_grad_op(b, h, kv, t, s, hd)) == s + 16
    assert cpu._score_stride(_grad_op(b, h, kv, t, 1000, hd)) == 1000
    q, k, v, dout = operands(b, h, kv, t, s, hd)

    def build(f, q, k, v, dout):
        return attention_with_gradient(f, q, k, v, dout, causal=causal, heads_first=heads_first)

    got = run_flow(build, [_layout(heads_first, x) for x in (q, k, v, dout)])
    for result, want in zip(got, naive(q, k, v, dout, causal, 1.0 / math.sqrt(hd))):
        check(result, _layout(heads_first, want), "float32")


@pytest.mark.parametrize("cpu_mask", ["", "-avx512", "-avx512,-avx2"])
@pytest.mark.parametrize("hd", [64, 100])
def test_attention_gemm_heads_wider_than_a_panel(cpu_mask, hd, monkeypatch):
    """Key and value heads packed once into the GEMM's panels (48, 24 or 12 columns by
    target) where a head takes several, the last one partial: the forward's and the
    backward's products against float64 loops, on every CPU variant, items over two parts
    (the outputs are the same bits as the unpacked products': packing reorders no sum)."""
    import ranvier as rv

    fused_over_two_parts(monkeypatch)
    b, h, kv, t, s = 2, 4, 2, 21, 29
    q, k, v, dout = operands(b, h, kv, t, s, hd)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(name, "float32", list(x.shape)) for name, x in zip("qkvd", (q, k, v, dout))]
    outputs = attention_with_gradient(f, *handles, causal=True)
    for tensor in outputs:
        tensor.var.out = True
    cell = rv.Compiler("cpu", cpu=cpu_mask, cache=False).compile(flow).cell("f")
    assert {"AttentionGemm", "AttentionGradGemm"} <= {step.kernel.split("[")[0] for step in cell.steps}
    data = cell.instance()
    for handle, x in zip(handles, (q, k, v, dout)):
        data[handle] = x
    data.compute()
    for tensor, want in zip(outputs, naive(q, k, v, dout, True, 1.0 / math.sqrt(hd))):
        # sums over heads this wide round further than float32's element tolerance: errors
        # are bounded against the output's largest value instead
        check(data[tensor], want, "float32", atol=1e-5 * np.abs(want).max())


def _bf16(x):
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def naive_on_bf16_products(q, k, v, dout, causal, scale):
    """`naive` with every product's inputs rounded to bf16, as the kernels on bf16 pairs
    round them (the scores' softmax and its gradient in between unrounded, the gradient's
    row term D = d out · out from that output, as the gradient kernel takes it): the output
    and the three gradients, and bounds on each one's error (the sums of its products'
    magnitudes)."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    b, h, t, _ = q.shape
    kv, s = k.shape[1], k.shape[2]
    results = [np.zeros_like(x) for x in (q, q, k, v)]
    bounds = [np.zeros_like(x) for x in (q, q, k, v)]
    for n in range(b):
        for head in range(h):
            g = head // (h // kv)
            for i in range(t):
                seen = i + s - t + 1 if causal else s
                qi, keys, values, di = _bf16(q[n, head, i]), _bf16(k[n, g, :seen]), _bf16(v[n, g, :seen]), _bf16(dout[n, head, i])
                scores = scale * (keys @ qi)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                dp = values @ di
                ds = scale * p * (dp - dout[n, head, i] @ (_bf16(p) @ values))
                for into, row, value, magnitude in [
                        (0, (n, head, i), _bf16(p) @ values, np.abs(_bf16(p)) @ np.abs(values)),
                        (1, (n, head, i), _bf16(ds) @ keys, np.abs(_bf16(ds)) @ np.abs(keys)),
                        (2, (n, g, slice(0, seen)), np.outer(_bf16(ds), qi), np.abs(np.outer(_bf16(ds), qi))),
                        (3, (n, g, slice(0, seen)), np.outer(_bf16(p), di), np.abs(np.outer(_bf16(p), di)))]:
                    results[into][row] += value
                    bounds[into][row] += magnitude
    return results, bounds


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("hd", [12, 64])
def test_attention_on_bf16_pairs_rounds_each_products_inputs(causal, heads_first, hd, monkeypatch):
    """matmul="bfloat16" where the CPU has AVX512-BF16 and no AMX tiles: AttentionGemmDpbf16
    and AttentionGradGemmDpbf16 run every product on the GEMM on bf16 pairs (45 keys: odd
    causal rows' last pair of keys; 64-wide heads: two panels), items over two parts; each
    output against float64 on the inputs each product rounds, within float32 sums and the
    odd probability that the float32 softmax rounds to the bf16 neighbour of float64's."""
    import ranvier as rv
    import ranvier.backends.cpu.kernels.attention as cpu
    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.target import host_target

    if bf16_gemm(host_target()) != "avx512bf16":
        pytest.skip("the products run on bf16 pairs where the CPU has AVX512-BF16 and no usable AMX tiles")
    fused_over_two_parts(monkeypatch)
    monkeypatch.setattr(cpu, "_BLOCK_BYTES", 4 * 8 * 45)
    b, h, kv, t, s = 2, 4, 2, 37, 45
    q, k, v, dout = operands(b, h, kv, t, s, hd)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(name, "float32", list(_layout(heads_first, x).shape)) for name, x in zip("qkvd", (q, k, v, dout))]
    outputs = attention_with_gradient(f, *handles, causal=causal, heads_first=heads_first)
    for tensor in outputs:
        tensor.var.out = True
    cell = rv.Compiler("cpu", matmul="bfloat16", cache=False).compile(flow).cell("f")
    assert [step.kernel for step in cell.steps] == ["AttentionGemmDpbf16", "AttentionGradGemmDpbf16"]
    data = cell.instance()
    for handle, x in zip(handles, (q, k, v, dout)):
        data[handle] = _layout(heads_first, x)
    for tensor in outputs:
        data[tensor] = np.full(tensor.shape, np.nan, np.float32)
    data.compute()
    wanted, bounds = naive_on_bf16_products(q, k, v, dout, causal, 1.0 / math.sqrt(hd))
    for tensor, want, bound in zip(outputs, wanted, bounds):
        got = _layout(heads_first, np.asarray(data[tensor], np.float64))
        assert np.isfinite(got).all(), "every element written"
        assert_within_bound(got, want, bound, 1e-4, slack=1e-6, what=tensor.name)


@pytest.mark.parametrize("cpu", ["", "-avx512bf16", "-avx512"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_in_bfloat16_attends_to_no_hidden_key(cpu, causal, monkeypatch):
    """matmul="bfloat16": where the products run on bf16 pairs the softmax's exponentials
    are mathlib.exp_nonpositive's (masked, the kernels and exp are float32's), and a query
    that sees no key still attends to nothing (its exp(−∞) are 0, not 2^-127), the rest as
    float64 (PyTorch) to within bf16's rounding; every element written."""
    import ranvier as rv

    fused_over_two_parts(monkeypatch)
    b, h, kv, t, s, hd = 2, 4, 2, 6, 40, 16
    q, k, v, dout = operands(b, h, kv, t, s, hd)
    mask = unseen_mask(b, t, s, causal).astype(np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(name, "float32", list(x.shape)) for name, x in zip("qkvdm", (q, k, v, dout, mask))]
    outputs = attention_with_gradient(f, *handles, causal=causal)
    for tensor in outputs:
        tensor.var.out = True
    cell = rv.Compiler("cpu", cpu=cpu, matmul="bfloat16", cache=False).compile(flow).cell("f")
    assert [step.kernel.split("[")[0].removesuffix("Dpbf16") for step in cell.steps] == ["AttentionGemm", "AttentionGradGemm"]
    data = cell.instance()
    for handle, x in zip(handles, (q, k, v, dout, mask)):
        data[handle] = x
    for tensor in outputs:
        data[tensor] = np.full(tensor.shape, np.nan, np.float32)
    data.compute()
    wanted, unseen = masked_sdpa(q, k, v, dout, mask, causal)
    assert unseen.any() and np.all(np.asarray(data[outputs[0]])[unseen] == 0)
    assert np.all(np.asarray(data[outputs[1]])[unseen] == 0)
    for tensor, want in zip(outputs[:4], wanted):
        got = np.asarray(data[tensor], np.float64)
        assert np.isfinite(got).all(), "every element written"
        assert_within_bound(got, want, np.abs(want).max(), 2e-2, slack=0.0, what=tensor.name)
    np.testing.assert_allclose(data[outputs[4]], wanted[4], atol=5e-2)  # scores of bf16 q and k; +∞ where a query sees no key


# Each CPU gradient kernel: (its name, the operands' dtype, the products' precision)
GRADIENT_KERNELS = [("AttentionGradGemm", "float32", "float32"), ("AttentionGradGemmDpbf16", "float32", "bfloat16"),
                    ("AttentionGradRow", "float64", "float32")]


@pytest.mark.parametrize(("kernel", "dtype", "matmul"), GRADIENT_KERNELS)
@pytest.mark.parametrize(("causal", "padding"), [(True, False), (False, True)])
def test_attention_gradient_takes_the_forwards_statistics(kernel, dtype, matmul, causal, padding, monkeypatch):
    """A gradient kernel takes each row's log-sum-exp L and the output from its inputs, as
    the op defines them: with L raised by c, every probability exp(score − L − c) is e^−c of
    the forward's and, D = d out · out unchanged, so is every gradient; an output not the
    forward's changes D (the reference's result). A kernel that found each row's maximum and
    sum again, or took Σ p·dp for D, gives neither. Blocks over two parts; every element written."""
    import ranvier as rv
    import ranvier.backends.cpu.kernels.attention as cpu
    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.target import host_target
    from ranvier.ops.attention import attention_grad

    if matmul == "bfloat16" and bf16_gemm(host_target()) != "avx512bf16":
        pytest.skip("the products run on bf16 pairs where the CPU has AVX512-BF16 and no usable AMX tiles")
    fused_over_two_parts(monkeypatch)
    monkeypatch.setattr(cpu, "_BLOCK_BYTES", 4 * 8 * 45)
    b, h, kv, t, s, hd = 2, 4, 2, 37, 45, 12
    scale = 1.0 / math.sqrt(hd)
    q, k, v, dout = (x.astype(dtype) for x in operands(b, h, kv, t, s, hd))
    bias = [score_bias("padding", b, h, t, s, dtype)] if padding else []
    out, *_, lse = naive(q, k, v, dout, causal, scale, *bias)
    out = out + 0.25 * random_array(out.shape, "float64", seed=7)  # not the forward's output
    arrays = [q, k, v, out.astype(dtype), lse.astype(dtype), dout, *bias]
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(name, dtype, list(x.shape)) for name, x in zip(["q", "k", "v", "out", "lse", "dout", "bias"], arrays)]
    grads = f.op("AttentionGrad", handles, None, {"causal": causal})
    for tensor in grads:
        tensor.var.out = True
    cell = rv.Compiler("cpu", matmul=matmul, cache=False).compile(flow).cell("f")
    assert [step.kernel.split("[")[0] for step in cell.steps] == [kernel]

    def gradients(shift: float) -> list[np.ndarray]:
        data = cell.instance()
        for handle, x in zip(handles, arrays):
            data[handle] = x
        data[handles[4]] = arrays[4] + shift
        for tensor in grads:
            data[tensor] = np.full(tensor.shape, np.nan, dtype)
        data.compute()
        return [np.asarray(data[tensor], np.float64) for tensor in grads]

    c = 1.5
    plain, shifted = gradients(0.0), gradients(c)
    tolerance = {"float64": 1e-10, "float32": 1e-5}[dtype] if matmul == "float32" else 2e-2
    for tensor, got, moved, want in zip(grads, plain, shifted, attention_grad(*arrays, causal=causal, scale=scale)):
        assert np.isfinite(got).all() and np.isfinite(moved).all(), "every element written"
        assert_within_bound(got, want, np.abs(want).max(), tolerance, slack=0.0, what=tensor.name)
        assert_within_bound(moved, math.exp(-c) * got, np.abs(got).max(), tolerance, slack=0.0, what=f"{tensor.name}, L + {c}")
