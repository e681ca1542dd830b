"""A run directory is one training's: a second training in it is refused, naming the process
that holds its lock (released however the holder ends, `kill -9` included); a new run in a
folder holding a run is refused unless --resume continues it or --force replaces it; the
ranks of `--workers N` end with their launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ranvier.cli import main
from ranvier.distributed.launch import watch_launcher
from ranvier.errors import RanvierError
from ranvier.jobs import rundir
from ranvier.train.runlock import LOCK, RunDirLocked, lock_run_dir

RANVIER = [sys.executable, "-m", "ranvier.cli"]
MNIST = ["train", "mnist", "--batch", "8", "--quiet"]


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def finished(tmp_path) -> Path:
    """A finished 6-step MNIST run, checkpointed at step 6."""
    run = tmp_path / "run"
    main([*MNIST, "--steps", "6", "--run-dir", str(run)])
    return run


def test_a_new_run_in_a_folder_holding_a_run_is_refused(finished):
    before = {name: (finished / name).read_bytes() for name in ("config.json", "metrics.jsonl", "checkpoint/checkpoint.json")}
    with pytest.raises(RanvierError, match=rf"{finished} holds a run already \(config.json, checkpoint, metrics.jsonl\): "
                                           rf"pass --resume {finished} to continue it, --force"):
        main([*MNIST, "--steps", "2", "--lr", "0.01", "--seed", "3", "--run-dir", str(finished)])
    assert {name: (finished / name).read_bytes() for name in before} == before
    assert rundir.checkpoint_step(finished) == 6


@pytest.mark.parametrize("task", ["mnist", "llama", "moe"])
@pytest.mark.parametrize("left", ["config.json", "metrics.jsonl", "checkpoint"])
def test_any_part_of_a_run_is_enough_to_refuse(tmp_path, task, left):
    run = tmp_path / "run"
    run.mkdir()
    (run / left).mkdir() if left == "checkpoint" else (run / left).write_text("{}\n")
    with pytest.raises(RanvierError, match=f"holds a run already \\({left}\\)"):
        main(["train", task, "--steps", "1", "--run-dir", str(run), "--quiet"])
    assert sorted(p.name for p in run.iterdir()) == sorted([left, LOCK])  # refused before any work


def test_force_replaces_the_run_and_keeps_what_is_not_a_run(finished):
    (finished / "notes.txt").write_text("mine")
    main([*MNIST, "--steps", "2", "--seed", "3", "--run-dir", str(finished), "--force"])
    assert rundir.checkpoint_step(finished) == 2
    assert [record["step"] for record in metrics_of(finished)] == [2, 2]  # the old run's lines went with it
    assert json.loads((finished / "config.json").read_text())["seed"] == 3
    assert (finished / "notes.txt").read_text() == "mine"


def test_an_empty_folder_is_a_new_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    main([*MNIST, "--steps", "1", "--run-dir", str(run)])
    assert rundir.checkpoint_step(run) == 1


def test_force_and_resume_do_not_combine(finished, capsys):
    with pytest.raises(SystemExit):
        main([*MNIST, "--resume", str(finished), "--force"])
    assert "--force: not allowed with argument --resume" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["new", "force", "resume"])
def test_a_locked_run_directory_is_refused_naming_the_holder(finished, command):
    args = {"new": ["--run-dir", str(finished.parent / "other")], "force": ["--run-dir", str(finished), "--force"],
            "resume": ["--resume", str(finished)]}[command]
    target = finished.parent / "other" if command == "new" else finished
    target.mkdir(exist_ok=True)
    before = (finished / "metrics.jsonl").read_text()
    held = lock_run_dir(target)
    try:
        with pytest.raises(RunDirLocked, match=f"{target} is in use: process {os.getpid()} on {socket.gethostname()} "
                                               f"is training in it \\(it holds {target / LOCK}\\)"):
            main([*MNIST, "--steps", "8", *args])
    finally:
        os.close(held)
    assert (finished / "metrics.jsonl").read_text() == before
    assert target.exists()  # a refused run removes no folder


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from ranvier.train.runlock import lock_run_dir; lock_run_dir(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(60)", str(run)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(RunDirLocked, match=f"process {holder.pid} on"):
        lock_run_dir(run)
    holder.kill()
    holder.wait()
    os.close(lock_run_dir(run))


def test_two_trainings_in_one_folder_one_runs_the_other_is_refused(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([*RANVIER, *MNIST, "--steps", "100000", "--checkpoint-every", "50", "--run-dir", str(run)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while first.poll() is None and rundir.checkpoint_step(run) is None:
            time.sleep(0.01)
        config = (run / "config.json").read_text()
        second = subprocess.run([*RANVIER, *MNIST, "--steps", "10", "--seed", "7", "--run-dir", str(run), "--force"],
                                capture_output=True, text=True, check=False)
        assert second.returncode == 1
        assert second.stderr.strip().endswith(f"{run} is in use: process {first.pid} on {socket.gethostname()} is training "
                                              f"in it (it holds {run / LOCK}); wait for it to end, or train in another --run-dir")
        assert first.poll() is None and (run / "config.json").read_text() == config
        assert rundir.checkpoint_step(run) >= 50
    finally:
        first.kill()
        first.wait()
    # The killed run's lock went with it: it resumes.
    resumed = subprocess.run([*RANVIER, "train", "mnist", "--resume", str(run), "--steps", str(rundir.checkpoint_step(run) + 2),
                              "--quiet"], capture_output=True, text=True, check=False)
    assert resumed.returncode == 0, resumed.stderr


def test_the_launcher_watch_sees_a_process_end_before_it_is_reaped():
    child = subprocess.Popen(["sleep", "60"])
    ended = threading.Event()
    watch_launcher(child.pid, ended.set)
    assert not ended.wait(0.3)
    child.kill()  # not waited for: a zombie until then
    assert ended.wait(5)
    child.wait()
