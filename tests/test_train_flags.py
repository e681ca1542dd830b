"""Training flags mean what they say: --minutes plans the run, --resume keeps the run's
settings, --data trains on pretokenized shards where they lie, --matmul records what ran,
--precision stores activations in bfloat16 where the backend can."""

from __future__ import annotations

import json

import pytest

from ranvier.backends.cpu.backend import bf16_gemm
from ranvier.backends.cpu.target import host_target
from ranvier.cli import main
from ranvier.errors import RanvierError
from ranvier.progress import training_progress

TINY_MNIST = ["--batch", "8", "--quiet"]
TINY_LM = ["--preset", "stories260K", "--batch", "2", "--seq", "16", "--quiet"]


def config_of(run_dir) -> dict:
    return json.loads((run_dir / "config.json").read_text())


def metrics_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def mnist_run(tmp_path):
    """A finished 4-step MNIST run."""
    run = tmp_path / "run"
    main(["train", "mnist", "--steps", "4", "--run-dir", str(run), *TINY_MNIST])
    return run


def test_resume_refuses_changed_settings_naming_them(mnist_run):
    before = (mnist_run / "config.json").read_text()
    with pytest.raises(RanvierError, match=r"cannot change --batch 16, --lr 0.01 on resume: .* --batch 8, --lr 0.001"):
        main(["train", "mnist", "--resume", str(mnist_run), "--batch", "16", "--lr", "0.01", "--steps", "8", "--quiet"])
    assert (mnist_run / "config.json").read_text() == before
    # Settings given as the run has them, and those a resume may change, are accepted.
    main(["train", "mnist", "--resume", str(mnist_run), "--batch", "8", "--steps", "6", "--checkpoint-every", "2", "--quiet"])
    assert config_of(mnist_run)["steps"] == 6 and config_of(mnist_run)["checkpoint_every"] == 2
    assert metrics_of(mnist_run)[-1] == {"step": 6, "test_accuracy": metrics_of(mnist_run)[-1]["test_accuracy"]}


def test_resuming_a_finished_run_says_so_and_trains_nothing(mnist_run, capsys):
    metrics = (mnist_run / "metrics.jsonl").read_text()
    assert main(["train", "mnist", "--resume", str(mnist_run), "--quiet"]) == 0
    assert "finished at step 4 of 4; pass --steps N > 4 to train further" in capsys.readouterr().out
    assert (mnist_run / "metrics.jsonl").read_text() == metrics


def test_resume_with_fewer_steps_than_done_is_refused(mnist_run):
    with pytest.raises(RanvierError, match="already at step 4: --steps 2 is fewer"):
        main(["train", "mnist", "--resume", str(mnist_run), "--steps", "2", "--quiet"])
    assert config_of(mnist_run)["steps"] == 4


def test_minutes_plans_the_steps_and_records_them(tmp_path, capsys):
    run = tmp_path / "run"
    main(["train", "mnist", "--minutes", "0.02", "--run-dir", str(run), *TINY_MNIST])
    out = capsys.readouterr().out
    planned = config_of(run)["steps"]
    assert f"steps/s measured over 10 warm-up steps, planning {planned:,} steps" in out
    assert planned > 11 and metrics_of(run)[-1]["step"] == planned
    # Resumed without a budget, the run has finished its plan; with one, it plans more.
    main(["train", "mnist", "--resume", str(run), "--quiet"])
    assert f"finished at step {planned} of {planned}" in capsys.readouterr().out
    main(["train", "mnist", "--resume", str(run), "--minutes", "0.01", "--steps", str(planned + 12), "--quiet"])
    assert f"(to step {planned + 12:,})" in capsys.readouterr().out


def test_matmul_bfloat16_without_amx_records_float32(tmp_path, capsys):
    if bf16_gemm(host_target("-avx512")):
        pytest.skip("masking AVX-512 leaves a bf16 GEMM here")
    run = tmp_path / "run"
    main(["train", "mnist", "--steps", "2", "--matmul", "bfloat16", "--cpu=-avx512", "--run-dir", str(run), *TINY_MNIST])
    assert "--matmul bfloat16: this CPU (masked with --cpu=-avx512) has no usable AMX-BF16 or AVX512-BF16: matrix products run in float32" \
        in capsys.readouterr().out
    assert config_of(run)["matmul"] == "float32" and config_of(run)["matmul_requested"] == "bfloat16"
    # What the run asked for is what a resume compares with.
    main(["train", "mnist", "--resume", str(run), "--matmul", "bfloat16", "--steps", "3", "--quiet"])
    with pytest.raises(RanvierError, match="cannot change --matmul float32"):
        main(["train", "mnist", "--resume", str(run), "--matmul", "float32", "--steps", "4", "--quiet"])


def test_precision_bfloat16_stores_activations_in_bfloat16_on_the_gpu_and_says_where_it_cannot(tmp_path, capsys, monkeypatch):
    """On the CUDA backend (its emulator here) a run records bfloat16 activations and
    bfloat16 products, without a note, and float16 activations say how many steps loss
    scaling skipped; on the CPU it says activations stay float32; a checkpointed Llama
    refuses it, naming the clash."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    gpu = tmp_path / "gpu"
    main(["train", "mnist", "--steps", "2", "--backend", "cuda", "--precision", "bfloat16", "--run-dir", str(gpu), *TINY_MNIST])
    printed = capsys.readouterr().out
    assert "--precision" not in printed and "--matmul" not in printed
    assert config_of(gpu)["precision"] == "bfloat16" and config_of(gpu)["matmul"] == "bfloat16"
    main(["train", "mnist", "--steps", "2", "--backend", "cuda", "--precision", "float16", "--run-dir", str(tmp_path / "half"),
          *TINY_MNIST])
    assert "loss scaling skipped 0 of 2 steps" in capsys.readouterr().out  # float16 scales the loss
    main(["train", "mnist", "--steps", "2", "--precision", "bfloat16", "--run-dir", str(tmp_path / "cpu"), *TINY_MNIST])
    assert "--precision bfloat16: the cpu backend stores activations in float32" in capsys.readouterr().out
    with pytest.raises(RanvierError, match="--precision bfloat16 stores a whole step's activations in one cell; it does not "
                                           "combine with --checkpointed"):
        main(["train", "llama", "--steps", "1", "--checkpointed", "--precision", "bfloat16", "--run-dir",
              str(tmp_path / "lm"), *TINY_LM])


def test_progress_counts_a_resumed_runs_steps_from_where_it_stands(capsys):
    with training_progress(500, every=20, done=400) as report:
        for _ in range(20):
            report(1.0)
    assert "step 420/500 " in capsys.readouterr().err


@pytest.fixture
def shards(tmp_path):
    """Byte-token shards of a small corpus, as `ranvier data pretokenize` writes them."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    main(["data", "pretokenize", str(corpus), "--out", str(tmp_path / "shards")])
    return tmp_path / "shards"


@pytest.mark.slow
def test_llama_trains_on_pretokenized_shards_where_they_lie(tmp_path, shards, capsys):
    run = tmp_path / "run"
    main(["train", "llama", "--data", str(shards), "--steps", "3", "--run-dir", str(run), *TINY_LM])
    assert "validation_loss=" in capsys.readouterr().out
    recorded = config_of(run)["shards"]
    assert [entry["path"] for entry in recorded] == [str((shards / "data00.bin").resolve())]
    assert not list(run.rglob("*.bin")) and (run / "tokenizer.json").is_file()
    main(["generate", str(run), "--prompt", "def ", "--max-tokens", "3", "--temperature", "0"])

    with pytest.raises(RanvierError, match="cannot change --seq 8"):
        main(["train", "llama", "--resume", str(run), "--seq", "8", "--steps", "4", "--quiet"])
    with (shards / "data00.bin").open("ab") as shard:
        shard.write(b"\0\0")
    with pytest.raises(RanvierError, match="data00.bin has changed since"):
        main(["train", "llama", "--resume", str(run), "--steps", "4", "--quiet"])
    (shards / "data00.bin").unlink()
    with pytest.raises(RanvierError, match="data00.bin, which is missing"):
        main(["train", "llama", "--resume", str(run), "--steps", "4", "--quiet"])


@pytest.mark.slow
def test_minutes_fits_the_cosine_schedule_to_the_planned_steps(tmp_path, shards, capsys):
    run = tmp_path / "run"
    main(["train", "moe", "--preset", "moe-tiny", "--data", str(shards), "--minutes", "0.05", "--batch", "2", "--seq", "16",
          "--run-dir", str(run), "--quiet"])
    config = config_of(run)
    assert f"planning {config['steps']:,} steps" in capsys.readouterr().out
    steps = [record for record in metrics_of(run) if "loss" in record]
    assert steps[-1]["step"] == config["steps"] > 11
    # The schedule ends at its floor with the planned steps: it is not cut off mid-decay.
    assert steps[-1]["lr"] == pytest.approx(config["min_lr"], rel=0.05)
    assert max(record["lr"] for record in steps) > 2 * config["min_lr"]
