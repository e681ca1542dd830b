"""Mixtral checkpoints (Hugging Face's MixtralForCausalLM layout) in and out of ranvier's MoE:
a model exported by ranvier loads in transformers with the same logits, a checkpoint
made by transformers imports with the same logits, and greedy generation agrees."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import ranvier as rv
from ranvier.generate import Generator, Sampling
from ranvier.interop import InteropError, export_hf, import_hf
from ranvier.models.moe import MoE, MoEConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=59, hidden_dim=24, max_seq_len=32,
                   n_experts=4, top_k=2, rope_theta=1e4, shared_classifier=False, aux_loss_weight=0.02)
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 11)).astype(np.int32)


def spread(model: MoE, seed: int) -> dict[str, np.ndarray]:
    """Weights that route unevenly and make every part matter."""
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(v.shape) * (0.9 / math.sqrt(v.shape[-2]) if v.ndim > 1 else 0.3) + (v.ndim == 1))
            .astype(np.float32) for k, v in model.initial.items()}


def ranvier_logits(config: MoEConfig, weights: dict, tokens: np.ndarray) -> np.ndarray:
    model = MoE(config)
    model.initial = weights
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    t = f.var("tokens", rv.DT_INT32, list(tokens.shape))
    logits = model(f, t)
    logits.var.out = True
    data = rv.Compiler().compile(flow).cell("f").instance()
    data[t] = tokens
    data.compute()
    return np.array(data[logits])


def transformers_logits(folder, tokens: np.ndarray) -> np.ndarray:
    net = transformers.MixtralForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return net(torch.from_numpy(tokens).long()).logits.numpy()


def test_an_exported_moe_loads_in_transformers_with_the_same_logits(tmp_path):
    weights = spread(MoE(CONFIG), seed=1)
    export_hf(CONFIG, weights, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["MixtralForCausalLM"] and hf["num_local_experts"] == 4 and hf["num_experts_per_tok"] == 2
    np.testing.assert_allclose(ranvier_logits(CONFIG, weights, TOKENS), transformers_logits(tmp_path / "hf", TOKENS),
                               rtol=2e-4, atol=2e-5)


def test_a_transformers_checkpoint_imports_with_the_same_logits_and_greedy_text(tmp_path):
    torch.manual_seed(3)
    hf_config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        vocab_size=61, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, rope_theta=5e3,
        tie_word_embeddings=False, initializer_range=0.2,
    )
    net = transformers.MixtralForCausalLM(hf_config).eval()
    net.save_pretrained(tmp_path / "hf")
    config, weights = import_hf(tmp_path / "hf")
    assert isinstance(config, MoEConfig) and (config.n_experts, config.top_k, config.n_kv_heads) == (4, 2, 1)
    tokens = np.random.default_rng(1).integers(0, 61, (1, 9)).astype(np.int32)
    with torch.no_grad():
        expected = net(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(ranvier_logits(config, weights, tokens), expected, rtol=2e-4, atol=2e-5)

    prompt = [int(t) for t in tokens[0]]
    with torch.no_grad():
        greedy = net.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):]
    generator = Generator(MoE(config), weights, prefill=4)
    assert list(generator.stream(prompt, 6, Sampling(temperature=0))) == greedy.tolist()


def test_export_import_round_trip(tmp_path):
    weights = spread(MoE(CONFIG), seed=2)
    export_hf(CONFIG, weights, tmp_path / "hf")
    config, imported = import_hf(tmp_path / "hf")
    assert (config.n_experts, config.top_k, config.hidden_dim, config.aux_loss_weight) == (4, 2, 24, 0.02)
    assert sorted(imported) == sorted(weights)
    for key, value in weights.items():
        np.testing.assert_array_equal(imported[key], value, err_msg=key)


def test_what_mixtral_cannot_hold_is_refused(tmp_path):
    shared = MoEConfig(**{**CONFIG.__dict__, "shared_hidden": 8})
    with pytest.raises(InteropError, match="shared expert"):
        export_hf(shared, spread(MoE(shared), seed=0), tmp_path / "hf")
    weights = spread(MoE(CONFIG), seed=2)
    export_hf(CONFIG, weights, tmp_path / "ok")
    hf = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**hf, "num_local_experts": 5}))
    with pytest.raises(InteropError, match="do not fit config.json"):
        import_hf(tmp_path / "ok")
