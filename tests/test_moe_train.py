"""`ranvier train moe`: a mixture-of-experts run learns, reports its auxiliary loss and
expert loads, resumes exactly (monolithic and checkpointed), and generates; greedy
decoding with the KV cache equals re-running the sequence."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_generate import full_forward_greedy
from test_llama_train import interrupted_and_resumed, losses

import ranvier as rv
from ranvier.cli import main
from ranvier.data.corpus import read_corpus
from ranvier.generate import Generator, Sampling
from ranvier.jobs.llama import train_llama
from ranvier.models.moe import MoE, MoEConfig
from ranvier.train.runs import LlamaRunConfig

STEPS = 10
RUN = {"model": "moe", "preset": "moe-tiny", "steps": STEPS, "batch": 4, "seq": 32, "warmup": 2, "eval_every": 5,
       "checkpoint_every": 5, "eval_batches": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(read_corpus(max_bytes=200_000))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_moe_run_learns_reports_its_experts_and_resumes_exactly(tmp_path, capsys, corpus, checkpointed):
    config = {**RUN, "corpus": corpus, "checkpointed": checkpointed}
    straight = tmp_path / "straight"
    final = train_llama(LlamaRunConfig(**config), straight, progress=False)
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[-2].startswith("validation_loss=") and lines[-1].startswith("expert_load_max_mean=")
    assert "4 experts top-2" in out
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss" in r]
    assert all(r["aux_loss"] > 0 and len(r["expert_load"]) == 4 and r["load_max_mean"] >= 1.0 for r in trained)
    assert sum(trained[-1]["expert_load"]) == pytest.approx(1.0, abs=1e-3)
    history = losses(straight)
    assert history[-2][1] < history[0][1]
    assert final == history[-1][2]
    assert interrupted_and_resumed(tmp_path, straight, config, pause=5) == [
        r for r in history if r[1] is not None or r[0] == STEPS
    ]
    capsys.readouterr()
    main(["generate", str(straight), "--prompt", "def ", "--max-tokens", "5", "--temperature", "0"])
    captured = capsys.readouterr()
    printed = captured.out
    assert printed.startswith("def ") and captured.err.strip().endswith("tokens/s")  # statistics apart from the text
    # Out as a Mixtral folder and back: the same greedy text.
    main(["export", "hf", str(straight), str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    capsys.readouterr()
    main(["generate", str(tmp_path / "hf"), "--prompt", "def ", "--max-tokens", "5", "--temperature", "0"])
    assert capsys.readouterr().out == printed


def test_moe_cli_refuses_a_llama_preset(tmp_path):
    with pytest.raises(rv.RanvierError, match="unknown MoE preset 'stories15M'"):
        train_llama(LlamaRunConfig(model="moe", preset="stories15M", steps=1), tmp_path / "run", progress=False)


CONFIG = MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=61, hidden_dim=24, max_seq_len=24,
                   n_experts=4, top_k=2, shared_hidden=16, rope_scaling=2.0, capacity_factor=1.0)


def test_moe_greedy_decoding_with_the_cache_matches_rerunning_the_sequence():
    """One KV head; capacity does not apply outside training, so padding never steals room."""
    r = np.random.default_rng(3)
    weights = {k: (r.standard_normal(v.shape) * (0.4 if v.ndim > 1 else 1.0) + (v.ndim == 1)).astype(np.float32)
               for k, v in MoE(CONFIG).initial.items()}
    prompt = [1, 5, 9, 13, 2, 7, 30, 4, 11, 3]
    expected, _ = full_forward_greedy(weights, prompt, 8, MoE(CONFIG))
    generator = Generator(MoE(CONFIG), weights, prefill=4)
    assert list(generator.stream(prompt, 8, Sampling(temperature=0))) == expected
    assert len(set(expected)) > 3
