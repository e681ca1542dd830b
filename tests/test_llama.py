"""The Llama model against an independent PyTorch implementation (llama2.c's model.py).

Each case builds the ranvier model's forward pass, softmax cross-entropy loss and every
parameter gradient in one function, compiles it on each backend, and compares logits,
loss and gradients with the same architecture written here in PyTorch (float64, so the
comparison measures ranvier's float32 error alone) on identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ranvier as rv
from ranvier.autodiff import gradient
from ranvier.models.llama import PRESETS, Llama, LlamaConfig, rope_tables
from ranvier.train.losses import softmax_cross_entropy

BACKENDS = ("cpu", "reference")


# ---- the PyTorch reference: llama2.c's model.py, trimmed to what the tests need ----------


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    max_seq_len: int
    norm_eps: float
    rope_theta: float
    shared_classifier: bool


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float):
    """llama2.c's tables (in float64): cos and sin of t · θ^(−2i/dim)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float64), freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    """Rotate the pairs (2i, 2i+1) of each head, as llama2.c does."""
    xq_r, xq_i = xq.reshape((*xq.shape[:-1], -1, 2)).unbind(-1)
    xk_r, xk_i = xk.reshape((*xk.shape[:-1], -1, 2)).unbind(-1)
    cos = freqs_cos.view(1, freqs_cos.shape[0], 1, freqs_cos.shape[1])
    sin = freqs_sin.view(1, freqs_sin.shape[0], 1, freqs_sin.shape[1])
    xq_out = torch.stack([xq_r * cos - xq_i * sin, xq_r * sin + xq_i * cos], dim=-1).flatten(3)
    xk_out = torch.stack([xk_r * cos - xk_i * sin, xk_r * sin + xk_i * cos], dim=-1).flatten(3)
    return xq_out, xk_out


def repeat_kv(x, n_rep: int):
    """torch.repeat_interleave(x, dim=2, repeats=n_rep): query head h reads KV head h // n_rep."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        mask = torch.full((1, 1, args.max_seq_len, args.max_seq_len), float("-inf"))
        self.register_buffer("mask", torch.triu(mask, diagonal=1))

    def forward(self, x, freqs_cos, freqs_sin):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + self.mask[:, :, :seqlen, :seqlen]
        output = torch.matmul(F.softmax(scores, dim=-1), xv)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, freqs_cos, freqs_sin):
        h = x + self.attention(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.shared_classifier:
            self.output.weight = self.tok_embeddings.weight  # weight tying, as llama2.c
        head_dim = args.dim // args.n_heads
        freqs_cos, freqs_sin = precompute_freqs_cis(head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)

    def forward(self, tokens, freqs=None):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        if freqs is None:
            freqs = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, *freqs)
        return self.output(self.norm(h))


def torch_args(config: LlamaConfig) -> ModelArgs:
    return ModelArgs(**{name: getattr(config, name) for name in ModelArgs.__dataclass_fields__})


def torch_name(key: str, config: LlamaConfig) -> str:
    """The llama2.c parameter holding ranvier's parameter `key`."""
    if key == "tok_embeddings" or key.endswith("norm"):
        return f"{key}.weight"
    if key == "output":
        return "output.weight"
    _, i, w = key.split(".")
    block = "attention" if w in ("wq", "wk", "wv", "wo") else "feed_forward"
    return f"layers.{i}.{block}.{w}.weight"


def is_linear(key: str) -> bool:
    """ranvier stores these [in, out]; torch's Linear holds [out, in]."""
    return key != "tok_embeddings" and not key.endswith("norm")


def torch_model(model: Llama, dtype=torch.float64) -> Transformer:
    config = model.config
    net = Transformer(torch_args(config)).to(dtype)
    named = dict(net.named_parameters())
    with torch.no_grad():
        for key, value in model.initial.items():
            t = torch.from_numpy(value.T.copy() if is_linear(key) else value).to(dtype)
            named[torch_name(key, config)].copy_(t)
    return net


# ---- the cases --------------------------------------------------------------------------


CASES = {
    # Grouped-query attention: 2 query heads per KV head, shared classifier.
    "gqa": (LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=67, hidden_dim=88, max_seq_len=16), 2, 12),
    # Multi-query attention with a separate classifier, non-default eps and θ.
    "mqa_separate": (
        LlamaConfig(
            dim=32, n_layers=1, n_heads=4, n_kv_heads=1, vocab_size=53, hidden_dim=64, max_seq_len=16,
            norm_eps=1e-2, rope_theta=500.0, shared_classifier=False,
        ),
        2, 16,
    ),
    # Plain multi-head attention, shared and separate classifier; seq shorter than max_seq_len.
    "mha_shared": (LlamaConfig(dim=24, n_layers=2, n_heads=3, n_kv_heads=3, vocab_size=41, hidden_dim=64, max_seq_len=32), 3, 8),
    "mha_separate": (
        LlamaConfig(dim=24, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=41, hidden_dim=48, max_seq_len=16, shared_classifier=False),
        2, 10,
    ),
}


def randomize(model: Llama, seed: int) -> None:
    """Replace the initial weights by ones that make every part of the model matter: the
    default initialization (N(0, 0.02), unit norm weights) leaves attention nearly uniform
    (and a MoE's router nearly uniform). Fan-in is the second-last axis (a MoE's experts
    are stacked on the first)."""
    rng = np.random.default_rng(seed)
    for key, value in model.initial.items():
        if key.endswith("norm"):
            new = 1.0 + 0.3 * rng.standard_normal(value.shape)
        elif key == "tok_embeddings":
            new = 0.7 * rng.standard_normal(value.shape)
        else:
            new = rng.standard_normal(value.shape) * (1.2 / math.sqrt(value.shape[-2]))
        model.initial[key] = new.astype(np.float32)


@dataclass
class Result:
    logits: np.ndarray
    loss: float
    grads: dict
    torch_logits: np.ndarray
    torch_loss: float
    torch_grads: dict


def run_case(case: str, backend: str) -> Result:
    config, batch, seq = CASES[case]
    model = Llama(config, seed=7)
    randomize(model, seed=list(CASES).index(case))
    rng = np.random.default_rng(11)
    token_values = rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32)
    target_values = rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32)

    logits, loss, ours = ranvier_step(model, token_values, target_values, backend)

    net_t = torch_model(model)
    out = net_t(torch.from_numpy(token_values).long())
    loss_t = F.cross_entropy(out.reshape(-1, config.vocab_size), torch.from_numpy(target_values).long().reshape(-1))
    loss_t.backward()
    named = dict(net_t.named_parameters(remove_duplicate=False))
    theirs = {}
    for key in model.initial:
        g = named[torch_name(key, config)].grad.numpy()
        theirs[key] = g.T if is_linear(key) else g
    return Result(logits, loss, ours, out.detach().numpy(), float(loss_t.detach()), theirs)


def ranvier_step(model: Llama, token_values: np.ndarray, target_values: np.ndarray, backend: str) -> tuple[np.ndarray, float, dict]:
    """Logits, loss (cross-entropy plus the model's auxiliary losses) and the gradient of
    every parameter, as ranvier computes them in a training step."""
    batch, seq = token_values.shape
    vocab = model.config.vocab_size
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.func.training = True  # a training step: a MoE's experts drop tokens at capacity
    tokens = f.var("tokens", rv.DT_INT32, [batch, seq])
    targets = f.var("targets", rv.DT_INT32, [batch, seq])
    params = model.parameters(f)
    logits = model(f, tokens, params)
    logits.var.out = True
    loss = softmax_cross_entropy(logits.reshape([batch * seq, vocab]), targets.reshape([batch * seq]), name="loss")
    aux = model.auxiliary_loss(f)
    if aux is not None:
        loss = loss + aux
    grads = gradient(flow, "f", list(params.values()), loss=loss)
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    data[tokens][...] = token_values
    data[targets][...] = target_values
    data.compute()
    ours = {key: np.array(data[grads[f"{model.name}/{key}"]]) for key in model.initial}
    return np.array(data[logits]), float(data[loss]), ours


_RESULTS: dict = {}


@pytest.fixture(params=[(c, b) for c in CASES for b in BACKENDS], ids=lambda p: f"{p[0]}-{p[1]}")
def result(request) -> Result:
    if request.param not in _RESULTS:
        _RESULTS[request.param] = run_case(*request.param)
    return _RESULTS[request.param]


def test_logits_match_torch(result: Result):
    assert result.logits.dtype == np.float32
    assert result.logits.shape == result.torch_logits.shape
    np.testing.assert_allclose(result.logits, result.torch_logits, rtol=1e-4, atol=2e-5)


def test_loss_matches_torch(result: Result):
    assert math.isfinite(result.loss)
    assert result.loss == pytest.approx(result.torch_loss, rel=1e-5, abs=1e-6)


def test_gradients_match_torch(result: Result):
    assert set(result.grads) == set(result.torch_grads)
    for key, ours in result.grads.items():
        theirs = result.torch_grads[key]
        assert ours.shape == theirs.shape, key
        assert np.abs(theirs).max() > 0, key  # every parameter takes part
        scale = np.abs(theirs).max()
        np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=1e-4 * scale, err_msg=key)
        error = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
        assert error < 1e-4, (key, error)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_initialization_matches_torch(backend):
    """The model as initialized (no randomized weights): forward logits and loss agree."""
    config = LlamaConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=29, hidden_dim=40, max_seq_len=8)
    model = Llama(config, seed=3)
    rng = np.random.default_rng(5)
    token_values = rng.integers(0, 29, (2, 8)).astype(np.int32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    tokens = f.var("tokens", rv.DT_INT32, [2, 8])
    logits = model(f, tokens)
    logits.var.out = True
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    data[tokens][...] = token_values
    data.compute()
    expected = torch_model(model)(torch.from_numpy(token_values).long()).detach().numpy()
    np.testing.assert_allclose(data[logits], expected, rtol=1e-4, atol=1e-6)


# ---- configuration, presets, initialization ---------------------------------------------


def test_rope_tables_match_llama2c():
    for head_dim, seq, theta in [(8, 16, 10000.0), (48, 512, 10000.0), (64, 64, 500000.0)]:
        cos, sin = rope_tables(head_dim, seq, theta)
        assert cos.shape == sin.shape == (seq, head_dim // 2)
        assert cos.dtype == sin.dtype == np.float32
        cos_t, sin_t = precompute_freqs_cis(head_dim, seq, theta)
        np.testing.assert_allclose(cos, cos_t.numpy(), atol=1e-6)
        np.testing.assert_allclose(sin, sin_t.numpy(), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dim": 30, "n_heads": 4, "n_kv_heads": 2},  # dim not divisible by n_heads
        {"dim": 32, "n_heads": 4, "n_kv_heads": 3},  # n_heads not divisible by n_kv_heads
        {"dim": 32, "n_heads": 4, "n_kv_heads": 8},  # more KV heads than query heads
        {"dim": 24, "n_heads": 8, "n_kv_heads": 4},  # odd head size 3
        {"dim": 20, "n_heads": 4, "n_kv_heads": 4},  # odd head size 5
        {"dim": 32, "n_heads": 0, "n_kv_heads": 1},
        {"dim": 32, "n_heads": 4, "n_kv_heads": 0},
        {"dim": 0, "n_heads": 4, "n_kv_heads": 4},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(rv.RanvierError):
        LlamaConfig(n_layers=1, vocab_size=10, hidden_dim=16, **kwargs)


@pytest.mark.parametrize("kwargs", [{"n_layers": 0}, {"vocab_size": 0}, {"hidden_dim": 0}, {"max_seq_len": 0}, {"norm_eps": -1.0}])
def test_config_validation_sizes(kwargs):
    base = {"dim": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 10, "hidden_dim": 16, "max_seq_len": 8}
    with pytest.raises(rv.RanvierError):
        LlamaConfig(**{**base, **kwargs})


def test_presets_hold_llama2c_stories_shapes():
    expected = {
        "stories260K": (64, 5, 8, 4, 512, 172),
        "stories15M": (288, 6, 6, 6, 32000, 768),
        "stories42M": (512, 8, 8, 8, 32000, 1376),
        "stories110M": (768, 12, 12, 12, 32000, 2048),
    }
    assert set(PRESETS) == set(expected)
    for name, shape in expected.items():
        c = PRESETS[name]
        assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.hidden_dim) == shape, name
        assert c.shared_classifier and c.norm_eps == 1e-5 and c.rope_theta == 10000.0, name


@pytest.mark.parametrize(
    "config",
    [*PRESETS.values(), CASES["mqa_separate"][0], CASES["gqa"][0], replace(PRESETS["stories260K"], shared_classifier=False)],
    ids=[*PRESETS, "mqa_separate", "gqa", "stories260K-separate"],
)
def test_parameter_count_matches_torch(config):
    with torch.device("meta"):
        net = Transformer(torch_args(config))
    assert config.parameter_count() == sum(p.numel() for p in net.parameters())  # tied weights counted once


def test_parameter_count_matches_initial_weights():
    for config in (CASES["gqa"][0], CASES["mqa_separate"][0], PRESETS["stories260K"]):
        model = Llama(config)
        assert sum(v.size for v in model.initial.values()) == config.parameter_count()


def test_stories_parameter_counts():
    # llama2.c's README: 15M, 42M and 110M parameters (the 260K model has 260K).
    assert round(PRESETS["stories260K"].parameter_count() / 1e3) in range(250, 275)
    assert round(PRESETS["stories15M"].parameter_count() / 1e6) == 15
    assert round(PRESETS["stories42M"].parameter_count() / 1e6) == 42
    assert round(PRESETS["stories110M"].parameter_count() / 1e6) == 110


def test_initial_weights_shapes_and_names():
    config = CASES["mqa_separate"][0]
    model = Llama(config, seed=0)
    with torch.device("meta"):
        net = Transformer(torch_args(config))
    named = dict(net.named_parameters())
    assert {torch_name(key, config) for key in model.initial} == set(named)
    for key, value in model.initial.items():
        assert value.dtype == np.float32
        shape = tuple(named[torch_name(key, config)].shape)
        assert value.shape == (shape[::-1] if is_linear(key) else shape), key
        if key.endswith("norm"):
            assert np.all(value == 1.0), key
    # llama2.c's initialization: N(0, 0.02), residual projections N(0, 0.02/√(2·layers)).
    big = Llama(replace(PRESETS["stories260K"], n_layers=2), seed=0)
    assert np.std(big.initial["tok_embeddings"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(big.initial["layers.0.w1"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(big.initial["layers.1.wo"]) == pytest.approx(0.02 / 2, rel=0.05)
    assert np.std(big.initial["layers.1.w2"]) == pytest.approx(0.02 / 2, rel=0.05)
    # Seeds are reproducible and distinct.
    again, other = Llama(config, seed=0), Llama(config, seed=1)
    assert all(np.array_equal(model.initial[k], again.initial[k]) for k in model.initial)
    assert not np.array_equal(model.initial["layers.0.wq"], other.initial["layers.0.wq"])


def test_model_description():
    model = Llama(PRESETS["stories15M"])
    assert model.config.dim == 288
    description = model.describe()
    assert description["model"] == "llama"
    assert description["dim"] == 288 and description["n_kv_heads"] == 6 and description["shared_classifier"] is True
    assert LlamaConfig(**{k: v for k, v in description.items() if k != "model"}) == PRESETS["stories15M"]


def test_sequence_longer_than_max_seq_len_raises():
    config = LlamaConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=10, hidden_dim=16, max_seq_len=8)
    model = Llama(config)
    f = rv.Builder(rv.Flow(), "f")
    model(f, f.var("ok", rv.DT_INT32, [1, 8]))  # exactly max_seq_len is fine
    with pytest.raises(rv.RanvierError, match="max_seq_len"):
        model(f, f.var("tokens", rv.DT_INT32, [1, 9]))
