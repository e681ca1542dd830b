"""Crash safety of the training jobs, tried from outside as a user meets it: a run killed with
SIGKILL at random moments (inside checkpoint writes too) and resumed each time ends
bit-identical to a run never interrupted; a full disk is one clear error that keeps the last
good checkpoint; a read-only run directory is refused before any work.

The jobs run as subprocesses of `python -m ranvier.cli`. The full disk is a small tmpfs and the
read-only directory a read-only tmpfs, both mounted in a user and mount namespace (`unshare`),
which needs no privileges where the kernel allows unprivileged user namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ranvier.cli import main
from ranvier.data.corpus import read_corpus
from ranvier.errors import RanvierError
from ranvier.jobs import rundir
from ranvier.jobs.llama import remove_abandoned
from ranvier.train.checkpoint import load_checkpoint
from ranvier.train.runlock import LOCK

RANVIER = [sys.executable, "-m", "ranvier.cli"]
MNIST = ["train", "mnist", "--batch", "8", "--quiet"]
# Metric fields that measure time: they differ between any two runs.
TIMINGS = {"elapsed", "ms", "tokens_per_s", "gflops"}


def ranvier(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*RANVIER, *map(str, args)], check=False, capture_output=True, text=True)


def history(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{key: value for key, value in json.loads(line).items() if key not in TIMINGS} for line in lines]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """The two runs' final checkpoints hold the same bits, and their metrics the same history."""
    arrays, metadata = load_checkpoint(run_dir / "checkpoint")
    expected, expected_metadata = load_checkpoint(reference / "checkpoint")
    assert sorted(arrays) == sorted(expected)
    assert [name for name in expected if not np.array_equal(arrays[name], expected[name])] == []
    for key in ("step", "sampler", "rng", "schedule"):
        assert metadata.get(key) == expected_metadata.get(key), key
    assert history(run_dir) == history(reference)


def litter(run_dir: Path) -> list[str]:
    """What an interrupted checkpoint save leaves: temporary files, and weights that no
    checkpoint.json names (written, but the save was killed before its commit)."""
    folder = run_dir / "checkpoint"
    if not folder.is_dir():
        return []
    names = os.listdir(folder)
    committed = json.loads((folder / "checkpoint.json").read_text())["weights"] if "checkpoint.json" in names else None
    return sorted(n for n in names if n.endswith(".tmp") or (n.startswith("weights-") and n != committed))


def checkpoint_step(run_dir: Path) -> int:
    """The committed checkpoint's step; -1 before the first (so steps compare)."""
    step = rundir.checkpoint_step(run_dir)
    return -1 if step is None else step


# ---- killed at random moments, resumed, bit-identical ---------------------------------------


@dataclass
class Kills:
    total: int = 0
    in_write: int = 0  # landed inside a checkpoint save: it left a new temporary or uncommitted file
    with_progress: int = 0  # landed after the run had checkpointed past where that launch began
    before_checkpoint: int = 0  # left a run with its config.json but no checkpoint yet to resume from


def wait_for_moment(process: subprocess.Popen, run_dir: Path, moment: str, rng: np.random.Generator) -> None:
    """Return at the moment to kill `process`: "startup" a random time after its launch
    (importing, compiling, loading); "configured" as its config.json appears; "training" a
    random time after it checkpoints for the first time; "write" as the n-th temporary file
    of a checkpoint save appears."""
    if moment == "startup":
        time.sleep(rng.uniform(0.0, 1.0))
        return
    if moment == "configured":
        while process.poll() is None and not (run_dir / "config.json").exists():
            time.sleep(0.001)
        return
    if moment == "training":
        began = checkpoint_step(run_dir)
        while process.poll() is None and checkpoint_step(run_dir) <= began:
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.4))
        return
    folder, seen, wanted = run_dir / "checkpoint", set(), int(rng.integers(1, 8))
    # Polled without sleeping: a save's temporary file lives for milliseconds.
    while process.poll() is None and len(seen) < wanted:
        with contextlib.suppress(FileNotFoundError):
            seen |= {name for name in os.listdir(folder) if name.endswith(".tmp")}


def kill_and_resume(start: list, resume: list, run_dir: Path, moments: list[str], seed: int) -> Kills:
    """Launch `start`, kill it at each of `moments` in turn, relaunching after each kill (with
    `resume` once the run has a config.json, as a user would), then let it finish."""
    rng = np.random.default_rng(seed)
    kills = Kills()
    command = start
    for moment in moments:
        process = subprocess.Popen([*RANVIER, *map(str, command)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        began, left = checkpoint_step(run_dir), set(litter(run_dir))
        wait_for_moment(process, run_dir, moment, rng)
        process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate()
        assert process.returncode == -signal.SIGKILL, f"the run ended (exit {process.returncode}) before its kill at {moment}: {stderr}"
        kills.total += 1
        kills.in_write += bool(set(litter(run_dir)) - left)
        kills.with_progress += checkpoint_step(run_dir) > max(began, 0)
        kills.before_checkpoint += (run_dir / "config.json").exists() and checkpoint_step(run_dir) < 0
        command = resume if (run_dir / "config.json").exists() else start
    finished = ranvier(*command)
    assert finished.returncode == 0, finished.stderr
    assert litter(run_dir) == []  # the saves after the kills cleared what the killed ones left
    return kills


def test_run_killed_as_its_last_checkpoint_commits_keeps_its_final_metrics(tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen([*RANVIER, *MNIST, "--steps", "20", "--checkpoint-every", "5", "--run-dir", run],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None and checkpoint_step(run) < 20:
        pass
    process.kill()
    process.wait()
    # Finished (the checkpoint says so), so a resume trains nothing: the history is whole already.
    assert history(run)[-1] == {"step": 20, "test_accuracy": history(run)[-1].get("test_accuracy")}
    assert ranvier("train", "mnist", "--resume", run, "--quiet").stdout.startswith(f"run {run} finished at step 20")


MOMENTS = ["startup"] * 2 + ["training"] * 4 + ["write"] * 5


@pytest.mark.slow
def test_mnist_run_killed_and_resumed_ends_bit_identical(tmp_path):
    train = [*MNIST, "--steps", "250", "--checkpoint-every", "1"]
    reference = tmp_path / "reference"
    assert ranvier(*train, "--run-dir", reference).returncode == 0
    run = tmp_path / "run"
    moments = list(np.random.default_rng(19).permutation(MOMENTS))
    kills = kill_and_resume([*train, "--run-dir", run], ["train", "mnist", "--resume", run, "--quiet"], run, moments, seed=19)
    assert kills.total == len(MOMENTS) and kills.in_write >= 2 and kills.with_progress >= 4, kills
    assert_same_run(run, reference)


@pytest.mark.slow
def test_llama_run_killed_and_resumed_ends_bit_identical(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(read_corpus(max_bytes=100_000))
    train = ["train", "llama", "--preset", "stories260K", "--batch", "2", "--seq", "16", "--corpus", corpus,
             "--steps", "100", "--checkpoint-every", "1", "--quiet"]
    reference = tmp_path / "reference"
    assert ranvier(*train, "--run-dir", reference).returncode == 0
    run = tmp_path / "run"
    # Killed first while it tokenizes and compiles, its config.json written: resumed from no checkpoint.
    moments = ["configured", "training", "write", "startup", "write", "training", "write"]
    kills = kill_and_resume([*train, "--run-dir", run], ["train", "llama", "--resume", run, "--quiet"], run, moments, seed=20)
    assert kills.total == len(moments) and kills.before_checkpoint >= 1 and kills.in_write >= 1 and kills.with_progress >= 2, kills
    assert_same_run(run, reference)


# ---- full disk and read-only file system ------------------------------------------------------


def in_namespace(script: str, *args) -> subprocess.CompletedProcess:
    """Run a shell `script` (its arguments `args`) as root of a new user and mount namespace,
    where it may mount file systems that no other process sees."""
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *map(str, args)],
                          check=False, capture_output=True, text=True)


@pytest.fixture(scope="module")
def mounts(tmp_path_factory) -> None:
    """Skips, saying why, where a user namespace cannot mount a tmpfs and remount it read-only."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs in a user namespace")
    probe = in_namespace('mount -t tmpfs -o size=64k none "$1" && mount -o remount,ro "$1"', tmp_path_factory.mktemp("probe"))
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one error line a failed command prints last on stderr (a compile over a second
    may announce itself before it, and nothing else)."""
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and [line for line in lines if line.startswith("ranvier: error:")] == lines[-1:], result.stderr
    return lines[-1]


def test_full_disk_is_one_clear_error_and_keeps_the_last_checkpoint(tmp_path, mounts):
    train = [*MNIST, "--steps", "6", "--checkpoint-every", "2"]
    reference = tmp_path / "reference"
    assert ranvier(*train, "--run-dir", reference).returncode == 0
    (weights,) = (reference / "checkpoint").glob("weights-*")
    # Room for the step-2 checkpoint but not for the step-4 one's weights beside it.
    size_k = (weights.stat().st_size + 64 * 1024) // 1024
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    script = 'size=$1 disk=$2 kept=$3; shift 3; mount -t tmpfs -o size=${size}k none "$disk" || exit 99; ' \
             '"$@"; status=$?; cp -a "$disk/run" "$kept"; exit $status'
    result = in_namespace(script, size_k, disk, kept, *RANVIER, *train, "--run-dir", disk / "run")
    line = error_line(result)
    assert "No space left on device (ENOSPC)" in line and str(disk / "run" / "checkpoint") in line
    assert "step 2 checkpoint" in line  # what a resume would continue from
    hidden = sorted(path.name for path in kept.rglob("*") if path.name.startswith("."))
    assert hidden == [LOCK]  # no temporary files, only the lock the run held
    assert checkpoint_step(kept) == 2 and litter(kept) == []
    # The checkpoint kept is whole: resumed on a disk with room, the run ends as one never stopped.
    assert ranvier("train", "mnist", "--resume", kept, "--quiet").returncode == 0
    assert_same_run(kept, reference)


def read_only(source: Path, *command) -> subprocess.CompletedProcess:
    """`command` run with a read-only tmpfs at `source`, holding what `source` held."""
    copy = source.with_name(source.name + "-contents")
    shutil.copytree(source, copy)
    return in_namespace('src=$1 copy=$2; shift 2; mount -t tmpfs none "$src" && cp -a "$copy/." "$src" && '
                        'mount -o remount,ro "$src" && exec "$@"', source, copy, *RANVIER, *command)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    main([*MNIST, "--steps", "2", "--checkpoint-every", "1", "--run-dir", str(run)])
    return run


@pytest.mark.parametrize("task", ["mnist", "llama"])
def test_new_run_in_a_read_only_folder_is_refused_before_any_work(tmp_path, mounts, task):
    folder = tmp_path / "folder"
    folder.mkdir()
    result = read_only(folder, "train", task, "--steps", "2", "--quiet", "--run-dir", folder / "run")
    line = error_line(result)
    assert f"run directory {folder / 'run'} is not writable" in line and "Read-only file system (EROFS)" in line
    assert result.stdout.splitlines() == [f"run directory: {folder / 'run'}"]  # no corpus, no compile


def test_resume_in_a_read_only_run_directory_is_refused_before_any_work(mounts, finished_run):
    result = read_only(finished_run.parent, "train", "mnist", "--resume", finished_run, "--steps", "4", "--quiet")
    line = error_line(result)
    assert f"run directory {finished_run} is not writable" in line and "Read-only file system (EROFS)" in line
    assert result.stdout == ""  # nothing compiled, nothing trained


def test_unwritable_run_directory_is_refused_before_compiling(tmp_path, finished_run, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes through chmod 0o555 (the read-only tmpfs test covers root)")
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    monkeypatch.setattr("ranvier.jobs.mnist.make_trainer", lambda config: pytest.fail("compiled before refusing"))
    run.chmod(0o555)
    try:
        with pytest.raises(RanvierError, match=f"run directory {run} is not writable: Permission denied"):
            main(["train", "mnist", "--resume", str(run), "--steps", "4", "--quiet"])
    finally:
        run.chmod(0o755)


def test_half_built_corpora_of_killed_processes_are_removed(tmp_path):
    """Tokenizing builds `.<folder>.<pid>` and renames it into place; a build whose process
    was killed is removed by the next one, a live process's is left to it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    folder = tmp_path / "corpora" / "corpus-64-0123abcd"
    abandoned = folder.with_name(f".{folder.name}.{dead.stdout.strip()}")
    abandoned.mkdir(parents=True)
    (abandoned / "shard-00000.bin").write_bytes(b"\0" * 64)
    building = folder.with_name(f".{folder.name}.{os.getpid()}")
    building.mkdir()
    other = folder.with_name(f".stories-64-0123abcd.{dead.stdout.strip()}")
    other.mkdir()
    remove_abandoned(folder)
    assert not abandoned.exists() and building.exists() and other.exists()
