"""The MoE transformer against a PyTorch implementation of the same architecture written
here: logits, the loss (cross-entropy + α · load balancing + β · z-loss) and every
parameter's gradient, on the CPU and the reference backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_llama import Attention, FeedForward, ModelArgs, Result, RMSNorm, precompute_freqs_cis, randomize, ranvier_step
from torch import nn

import ranvier as rv
from ranvier.autodiff import gradient
from ranvier.models.moe import PRESETS, MoE, MoEConfig
from ranvier.train.losses import softmax_cross_entropy


class TorchMoELayer(nn.Module):
    """Softmax router, top-k, each expert on its tokens (index_add back, weighted)."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.c = c
        self.gate = nn.Linear(c.dim, c.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(c.dim, c.hidden_dim) for _ in range(c.n_experts))
        self.shared = FeedForward(c.dim, c.shared_hidden) if c.shared_hidden else None

    def forward(self, x):
        c = self.c
        rows = x.reshape(-1, c.dim)
        tokens = rows.shape[0]
        logits = self.gate(rows)
        probs = F.softmax(logits, dim=-1)
        weights, choices = torch.topk(probs, c.top_k)
        if c.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = torch.ones_like(choices, dtype=torch.bool)
        capacity = c.capacity(tokens)
        if capacity:  # the first `capacity` choices of each expert, in token order, are kept
            taken = [0] * c.n_experts
            for flat, e in enumerate(choices.reshape(-1).tolist()):
                keep.view(-1)[flat] = taken[e] < capacity
                taken[e] += 1
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where((choices == e) & keep)
            if token.numel():
                out = out.index_add(0, token, expert(rows[token]) * weights[token, slot, None])
        if self.shared is not None:
            out = out + self.shared(rows)
        counts = torch.bincount(choices.reshape(-1), minlength=c.n_experts).to(rows.dtype)
        aux = c.aux_loss_weight * c.n_experts * (counts / tokens * probs.mean(0)).sum()
        aux = aux + c.z_loss_weight * (torch.logsumexp(logits, -1) ** 2).mean()
        return out.reshape(x.shape), aux


class TorchBlock(nn.Module):
    def __init__(self, c: MoEConfig, moe: bool):
        super().__init__()
        args = ModelArgs(**{name: getattr(c, name) for name in ModelArgs.__dataclass_fields__})
        self.attention = Attention(args)
        self.attention_norm, self.ffn_norm = RMSNorm(c.dim, c.norm_eps), RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = TorchMoELayer(c) if moe else FeedForward(c.dim, c.dense_hidden or c.hidden_dim)
        self.moe = moe

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        if self.moe:
            y, aux = self.feed_forward(self.ffn_norm(h))
            return h + y, aux
        return h + self.feed_forward(self.ffn_norm(h)), 0.0


class TorchMoE(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(TorchBlock(c, c.is_moe(i)) for i in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.shared_classifier:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = precompute_freqs_cis(c.dim // c.n_heads, c.max_seq_len, c.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        seq = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        total_aux = 0.0
        for layer in self.layers:
            h, aux = layer(h, self.cos[:seq], self.sin[:seq])
            total_aux = total_aux + aux
        return self.output(self.norm(h)), total_aux


def torch_parameter(net: TorchMoE, key: str) -> tuple[torch.Tensor, bool, int | None]:
    """The torch parameter behind ranvier's `key`, whether it is a transposed Linear, and the expert."""
    named = dict(net.named_parameters(remove_duplicate=False))
    if key == "tok_embeddings" or key.endswith("norm"):
        return named[f"{key}.weight"], False, None
    if key == "output":
        return named["output.weight"], True, None
    parts = key.split(".")
    i, rest = parts[1], parts[2:]
    if rest[0] in ("wq", "wk", "wv", "wo"):
        return named[f"layers.{i}.attention.{rest[0]}.weight"], True, None
    if rest == ["router"]:
        return named[f"layers.{i}.feed_forward.gate.weight"], True, None
    if rest[0] == "experts":
        return named[f"layers.{i}.feed_forward.experts.0.{rest[1]}.weight"], True, -1  # all experts, below
    if rest[0] == "shared":
        return named[f"layers.{i}.feed_forward.shared.{rest[1]}.weight"], True, None
    return named[f"layers.{i}.feed_forward.{rest[0]}.weight"], True, None


def torch_model(model: MoE) -> TorchMoE:
    net = TorchMoE(model.config).double()
    named = dict(net.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, value in model.initial.items():
            parameter, linear, expert = torch_parameter(net, key)
            if expert is not None:
                i, name = key.split(".")[1], key.split(".")[-1]
                for e in range(value.shape[0]):
                    named[f"layers.{i}.feed_forward.experts.{e}.{name}.weight"].copy_(torch.from_numpy(value[e].T.copy()))
            else:
                parameter.copy_(torch.from_numpy(value.T.copy() if linear else value))
    return net


def torch_gradient(net: TorchMoE, key: str, shape) -> np.ndarray:
    parameter, linear, expert = torch_parameter(net, key)
    if expert is not None:
        named = dict(net.named_parameters(remove_duplicate=False))
        i, name = key.split(".")[1], key.rsplit(".", maxsplit=1)[-1]
        return np.stack([named[f"layers.{i}.feed_forward.experts.{e}.{name}.weight"].grad.numpy().T for e in range(shape[0])])
    g = parameter.grad.numpy()
    return g.T if linear else g


CASES = {
    # MQA, four experts top-2, every layer MoE.
    "mqa": (MoEConfig(dim=24, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=37, hidden_dim=20, max_seq_len=16,
                      n_experts=4, top_k=2, aux_loss_weight=0.1), 2, 9),
    # GQA, a shared expert, dense layers interleaved, NTK-scaled RoPE, z-loss, separate classifier.
    "shared-dense": (MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=41, hidden_dim=16, max_seq_len=16,
                               n_experts=5, top_k=2, moe_every=2, dense_hidden=40, shared_hidden=12, rope_scaling=4.0,
                               z_loss_weight=0.01, shared_classifier=False), 2, 8),
    # Top-1 routing with a capacity that drops tokens, no renormalization.
    "capacity": (MoEConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=29, hidden_dim=24, max_seq_len=32,
                           n_experts=3, top_k=1, capacity_factor=0.6, normalize_top_k=False, aux_loss_weight=0.05), 2, 12),
}


def run_case(case: str, backend: str) -> Result:
    config, batch, seq = CASES[case]
    model = MoE(config, seed=3)
    randomize(model, seed=list(CASES).index(case))
    rng = np.random.default_rng(17)
    token_values = rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32)
    target_values = rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32)

    logits, loss, ours = ranvier_step(model, token_values, target_values, backend)

    net = torch_model(model)
    out, aux = net(torch.from_numpy(token_values).long())
    loss_t = F.cross_entropy(out.reshape(-1, config.vocab_size), torch.from_numpy(target_values).long().reshape(-1)) + aux
    loss_t.backward()
    theirs = {key: torch_gradient(net, key, value.shape) for key, value in model.initial.items()}
    return Result(logits, loss, ours, out.detach().numpy(), loss_t.item(), theirs)


_RESULTS: dict = {}


@pytest.fixture(params=[(c, b) for c in CASES for b in ("cpu", "reference")], ids=lambda p: f"{p[0]}-{p[1]}")
def result(request) -> Result:
    if request.param not in _RESULTS:
        _RESULTS[request.param] = run_case(*request.param)
    return _RESULTS[request.param]


def test_logits_match_torch(result: Result):
    np.testing.assert_allclose(result.logits, result.torch_logits, rtol=1e-4, atol=3e-5)


def test_loss_matches_torch(result: Result):
    assert result.loss == pytest.approx(result.torch_loss, rel=2e-5, abs=1e-6)


def test_gradients_match_torch(result: Result):
    assert set(result.grads) == set(result.torch_grads)
    for key, ours in result.grads.items():
        theirs = result.torch_grads[key]
        assert ours.shape == theirs.shape, key
        np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=2e-5 * max(1.0, np.abs(theirs).max()), err_msg=key)


def test_the_router_gets_the_load_balancing_gradient():
    """With α = 0 the router's gradient differs: the auxiliary loss reaches it."""
    config, batch, seq = CASES["mqa"]
    with_aux = run_case("mqa", "cpu").grads["layers.0.router"]
    CASES["mqa"] = (MoEConfig(**{**config.__dict__, "aux_loss_weight": 0.0}), batch, seq)
    try:
        without = run_case("mqa", "cpu").grads["layers.0.router"]
    finally:
        CASES["mqa"] = (config, batch, seq)
    assert not np.allclose(with_aux, without)


def test_counts_match_the_model_it_builds():
    for name in ("moe-tiny", "moe-15M"):
        config = PRESETS[name]
        model = MoE(config, allocate=False)
        assert model.parameter_count() == config.counts()["parameters"], name
    counts = PRESETS["moe-5.9B"].counts()
    assert 5.85e9 < counts["parameters"] < 6.05e9 and 1.75e9 < counts["active"] < 1.95e9


def test_a_preset_builds_its_flow_without_allocating_weights():
    model = MoE(PRESETS["moe-5.9B"], allocate=False)
    assert not model.initial
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    logits = model(f, f.var("tokens", rv.DT_INT32, [1, 8]))
    assert logits.shape == [1, 8, 32000]
    learnable = sum(v.size for v in flow.vars.values() if v.learnable)
    assert learnable == PRESETS["moe-5.9B"].counts()["parameters"]
    assert all(v.data is None for v in flow.vars.values() if v.learnable)


def test_ntk_scaling_stretches_the_rotary_base():
    base = MoEConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=1, vocab_size=10, hidden_dim=8)
    scaled = MoEConfig(**{**base.__dict__, "rope_scaling": 8.0})
    assert base.rope_base == base.rope_theta
    assert scaled.rope_base == pytest.approx(10000.0 * 8.0 ** (8 / 6))


def test_bad_configs_are_refused():
    with pytest.raises(rv.RanvierError, match="top_k"):
        MoEConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=1, vocab_size=10, hidden_dim=8, n_experts=2, top_k=3)


def _lm_loss(vocab: int, rows: int):
    def loss(b, logits, targets):
        return softmax_cross_entropy(logits.reshape([rows, vocab]), targets.reshape([rows]))

    return loss


def test_checkpointed_stack_gives_the_monolithic_gradients_with_the_auxiliary_loss():
    """Each layer's load-balancing term joins the loss and seeds its backward: the streamed
    gradients equal the whole model's backward of cross-entropy + α · aux."""
    from ranvier.train.stack import CheckpointedStack

    config = MoEConfig(dim=24, n_layers=3, n_heads=4, n_kv_heads=1, vocab_size=31, hidden_dim=16, max_seq_len=16,
                       n_experts=4, top_k=2, aux_loss_weight=0.2)
    batch, seq = 2, 8
    rng = np.random.default_rng(4)
    x, y = (rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32) for _ in range(2))
    model = MoE(config, seed=2)
    randomize(model, seed=5)
    loss_fn = _lm_loss(config.vocab_size, batch * seq)
    stack = CheckpointedStack(model, ("int32", [batch, seq]), ("int32", [batch, seq]), loss_fn)
    streamed_loss, streamed = stack.gradients([x, y])

    flow = rv.Flow()
    f = rv.Builder(flow, "whole")
    tokens, targets = f.var("tokens", "int32", [batch, seq]), f.var("targets", "int32", [batch, seq])
    params = model.parameters(f)
    loss = loss_fn(f, model(f, tokens, params), targets) + model.auxiliary_loss(f)
    loss.var.out = True
    loads = model.expert_loads(f)
    for t in loads:
        t.var.out = True
    grads = gradient(flow, f.func, list(params.values()), loss=loss)
    data = rv.Compiler().compile(flow).cell("whole").instance()
    data[tokens], data[targets] = x, y
    data.compute()
    assert streamed_loss == pytest.approx(float(data[loss]), rel=1e-6)
    for name, g in grads.items():
        np.testing.assert_allclose(streamed[name], data[g], rtol=1e-5, atol=1e-6 * np.abs(data[g]).max(), err_msg=name)
    for i, t in enumerate(loads):
        np.testing.assert_array_equal(stack.watched[f"load.{i}"], data[t])
        assert stack.watched[f"load.{i}"].sum() == batch * seq * config.top_k
    assert stack.watched["aux_loss"] > 0


def test_the_trainer_watches_values_of_its_step():
    from ranvier.train.trainer import Trainer

    config = PRESETS["moe-tiny"]
    batch, seq = 2, 8
    model = MoE(config)
    flow = rv.Flow()
    f = rv.Builder(flow, "train")
    tokens, targets = f.var("tokens", "int32", [batch, seq]), f.var("targets", "int32", [batch, seq])
    params = model.parameters(f)
    loss = _lm_loss(config.vocab_size, batch * seq)(f, model(f, tokens, params), targets)
    aux = model.auxiliary_loss(f)
    watch = {"aux_loss": aux, **{f"load.{i}": t for i, t in enumerate(model.expert_loads(f))}}
    trainer = Trainer(loss + aux, list(params.values()), inputs=[tokens, targets], watch=watch, accumulate=2)
    rng = np.random.default_rng(0)
    trainer.step([rng.integers(0, config.vocab_size, (2 * batch, seq)).astype(np.int32) for _ in range(2)])
    assert set(trainer.watched) == {"aux_loss"} | {f"load.{i}" for i in range(config.n_layers)}
    assert trainer.watched["load.0"].sum() == pytest.approx(batch * seq * config.top_k)  # the mean of two micro-batches
    with pytest.raises(rv.RanvierError, match="watch"):
        other = rv.Builder(flow, "other").var("z", "float32", [])
        Trainer(loss, list(params.values()), inputs=[tokens, targets], watch={"z": other})


def test_summary_counts_the_founding_design_without_its_weights(capsys):
    from ranvier.cli import main

    main(["summary", "--preset", "moe-5.9B"])
    out = capsys.readouterr().out
    assert "13 of hidden 6144, top-4" in out and "parameters         5,979.2M" in out
    assert "active per token   1,902.4M" in out and "built without weights" in out
    with pytest.raises(rv.RanvierError, match="unknown preset"):
        main(["summary", "--preset", "moe-nope"])
