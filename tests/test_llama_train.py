"""The `ranvier train llama` job: it learns, and an interrupted run resumes exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ranvier.cli import console, main
from ranvier.data.corpus import read_corpus
from ranvier.jobs.llama import resume_llama, train_llama
from ranvier.train.runs import LlamaRunConfig


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records]


def interrupted_and_resumed(tmp_path, straight, config: dict, pause: int):
    """The history of the same run paused after step `pause` and resumed, with the straight
    run's tokenizer and shards (the same corpus's, from the cache, so only the interruption
    differs); the pause's own final evaluation is left out, step for step comparable with
    the straight run's."""
    interrupted = tmp_path / "interrupted"
    train_llama(LlamaRunConfig(**config), interrupted, progress=False, stop_at=pause)
    resume_llama(interrupted, progress=False)
    return [r for r in losses(interrupted) if r[1] is not None or r[0] == config["steps"]]


@pytest.mark.slow
def test_llama_run_learns_and_resumes_exactly(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(read_corpus(max_bytes=300_000))
    config = {"corpus": str(corpus), "steps": 12, "batch": 4, "seq": 32, "warmup": 2, "eval_every": 6, "checkpoint_every": 6, "eval_batches": 2}

    straight = tmp_path / "straight"
    final = train_llama(LlamaRunConfig(**config), straight, progress=False)
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("validation_loss=") and "unigram_entropy=" in out
    history = losses(straight)
    assert history[-2][1] < history[0][1]  # the loss went down
    assert final == history[-1][2]

    assert interrupted_and_resumed(tmp_path, straight, config, pause=6) == [r for r in history if r[1] is not None or r[0] == 12]

    capsys.readouterr()
    main(["plot", str(straight)])
    png = (straight / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert capsys.readouterr().out.strip() == str(straight / "curves.png")

    main(["generate", str(straight), "--prompt", "def ", "--max-tokens", "6", "--temperature", "0"])
    printed = capsys.readouterr()
    assert printed.out.startswith("def ") and printed.err.strip().endswith("tokens/s")  # statistics apart from the text


@pytest.mark.slow
def test_checkpointed_llama_run_trains_and_resumes_exactly(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(read_corpus(max_bytes=200_000))
    config = {"corpus": str(corpus), "steps": 6, "batch": 4, "seq": 32, "warmup": 2, "eval_every": 3, "checkpoint_every": 3, "eval_batches": 2, "checkpointed": True}
    straight = tmp_path / "straight"
    train_llama(LlamaRunConfig(**config), straight, progress=False)
    history = losses(straight)
    assert history[-2][1] < history[0][1]

    assert interrupted_and_resumed(tmp_path, straight, config, pause=3) == [r for r in history if r[1] is not None or r[0] == 6]


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_llama_job_accumulates_micro_batches(tmp_path, checkpointed):
    from ranvier.jobs.llama import build

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(read_corpus(max_bytes=100_000))
    config = LlamaRunConfig(corpus=str(corpus), steps=2, batch=2, seq=16, accumulate=3, checkpointed=checkpointed)
    run = build(config, tmp_path / "run")
    assert run.trainer.batch_rows == 6
    x, y = run.train.sample(6, 16, np.random.default_rng(0))
    assert np.isfinite(run.trainer.step([x, y]))


def test_llama_command_refuses_unknown_preset(tmp_path, capsys, monkeypatch):
    import pytest

    from ranvier import RanvierError

    with pytest.raises(RanvierError, match="unknown Llama preset 'stories1B'"):
        main(["train", "llama", "--preset", "stories1B", "--corpus", str(tmp_path), "--run-dir", str(tmp_path / "run"), "--quiet"])
    # The command itself says so in one line, no traceback, and fails.
    monkeypatch.setattr("sys.argv", ["ranvier", "train", "llama", "--preset", "stories1B", "--corpus", str(tmp_path), "--quiet"])
    assert console() == 1
    assert capsys.readouterr().err == "ranvier: error: unknown Llama preset 'stories1B'; choose one of stories260K, stories15M, stories42M, stories110M\n"
