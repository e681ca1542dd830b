"""Data-parallel training: N ranks through mpiexec take the steps one process takes on the
same global batch (the single-process run is the oracle), with and without ZeRO-1 and
accumulation; checkpoints resume on another number of ranks; a rank that dies or hangs
ends the job with an error and leaves the last checkpoint intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dp_worker
import numpy as np
import pytest

from ranvier import RanvierError
from ranvier.backends.cuda import device
from ranvier.distributed import GradientReducer, World, owners
from ranvier.distributed.launch import find_mpiexec, without_workers
from ranvier.jobs.rundir import checkpoint_step
from ranvier.train.checkpoint import load_checkpoint

WORKER = Path(__file__).resolve().parent / "dp_worker.py"
TOLERANCE = 1e-4  # of each tensor's largest magnitude: float32 sums in another order, through Adam


def mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401

        find_mpiexec()
    except (ImportError, RanvierError):
        return False
    return True


needs_mpi = pytest.mark.skipif(not mpi_available(), reason="needs mpi4py and mpiexec: pip install 'ranvier[mpi]'")


def launch(ranks: int, job: dict, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [find_mpiexec(), "-n", str(ranks), sys.executable, str(WORKER), json.dumps(job)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False)


def run_ranks(ranks: int, job: dict, env: dict | None = None) -> list[dict]:
    done = launch(ranks, job, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = []
    for rank in range(ranks):
        with np.load(Path(job["out"]) / f"rank{rank}.npz") as saved:
            results.append({name: saved[name] for name in saved.files})
    return results


def oracle(job: dict, first: int = 0, trainer=None) -> tuple[list[float], dict[str, np.ndarray]]:
    """The single-process run of the job's steps at the same global batch."""
    trainer = trainer or dp_worker.build(job, World())
    losses = dp_worker.train(trainer, job, first, job["steps"] - first)
    return losses, trainer.state_arrays()


def assert_close(state: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """The state a rank holds (with ZeRO-1, its share of the optimizer state) is the oracle's."""
    for name, want in expected.items():
        if f"state:{name}" not in state:
            continue
        got = state[f"state:{name}"]
        error = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
        assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


# ---- the pieces, in one process ----------------------------------------------------------


def test_owners_balance_the_elements():
    sizes = [1000, 10, 10, 500, 490, 3]
    owner = owners(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(2)]
    assert sorted(loads) == [1003, 1010] and owner[0] != owner[3]
    assert owners([5, 5], 4) == [0, 1]


def test_rows_split_a_batch_evenly_or_refuse():
    world = World()
    world.size, world.rank = 3, 1
    assert world.rows(12) == slice(4, 8)
    with pytest.raises(RanvierError, match="does not split evenly over 3"):
        world.rows(10)


class TwoLikeRanks(World):
    """A world of two ranks holding the same values: the sum doubles each buffer."""

    size = 2

    def __init__(self):
        self.sums: list[int] = []

    def sum_(self, buffer, what):
        self.sums.append(buffer.size)
        buffer *= 2


def test_reducer_buckets_and_writes_every_mean():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(dtype) for shape, dtype in
              [((3, 4), np.float32), ((5,), np.float32), ((300,), np.float32), ((2, 2), np.float64), ((7,), np.float32)]]
    expected = [a.copy() for a in arrays]
    world = TwoLikeRanks()
    reducer = GradientReducer(world, bucket_bytes=256)
    for _ in range(2):  # the bucket buffers are reused
        reducer.submit(arrays[:2])
        reducer.submit(arrays[2:])
        times = reducer.wait()
        for got, want in zip(arrays, expected):
            np.testing.assert_array_equal(got, want)
        assert 0.0 <= times.hidden <= 1.0
    # Two small float32 arrays share a bucket; the large one, the float64 one and the last go alone.
    assert world.sums == [17, 300, 4, 7] * 2


def test_reducer_refuses_a_strided_buffer():
    with pytest.raises(ValueError, match="contiguous"):
        GradientReducer(TwoLikeRanks()).submit([np.zeros((4, 4), np.float32)[:, 1]])


def test_workers_option_is_dropped_for_the_ranks():
    assert without_workers(["train", "mnist", "--workers", "2", "--steps", "3", "--workers=4"]) == ["train", "mnist", "--steps", "3"]


# ---- N ranks against one process -----------------------------------------------------------


@needs_mpi
@pytest.mark.parametrize(("model", "ranks", "zero", "accumulate"), [
    ("mlp", 2, False, 1),
    ("mlp", 3, True, 2),
    ("stack", 2, True, 1),
    ("stack", 3, False, 2),
])
def test_ranks_take_the_single_process_steps(tmp_path, model, ranks, zero, accumulate):
    job = {"model": model, "steps": 3, "zero": zero, "accumulate": accumulate, "out": str(tmp_path)}
    results = run_ranks(ranks, job)
    losses, expected = oracle(job)
    np.testing.assert_allclose(results[0]["losses"], losses, rtol=1e-5)
    for result in results:
        assert_close(result, expected)
    assert {name for result in results for name in result} == {f"state:{name}" for name in expected} | {"losses", "hidden", "skipped"}
    # Every rank holds the same parameters, bit for bit.
    for name in expected:
        if not zero or "adam" not in name:
            for result in results[1:]:
                np.testing.assert_array_equal(result[f"state:{name}"], results[0][f"state:{name}"])
    if zero:  # each rank holds only its share of the optimizer state
        moments = [sum(v.size for k, v in result.items() if k.endswith("adam_m")) for result in results]
        assert sum(moments) == sum(v.size for k, v in expected.items() if k.endswith("adam_m"))
        assert max(moments) < sum(moments)


@needs_mpi
@pytest.mark.parametrize(("model", "zero", "accumulate"), [("stack", True, 1), ("stack", False, 2), ("mlp", True, 2)])
def test_ranks_on_the_cuda_emulator_take_the_cpus_single_process_steps(tmp_path, model, zero, accumulate):
    """Two ranks on the CUDA backend (its host emulator), where parameters, optimizer state
    and resident gradients live on the device: the gradients the all-reduce averages on the
    host and the parameters ZeRO-1 gathers there reach the device before the next step."""
    job = {"model": model, "steps": 3, "zero": zero, "accumulate": accumulate, "out": str(tmp_path), "backend": "cuda"}
    results = run_ranks(2, job, env={device.DEVICE_ENVIRONMENT: device.EMULATOR})
    losses, expected = oracle({**job, "backend": "cpu"})
    np.testing.assert_allclose(results[0]["losses"], losses, rtol=1e-5)
    for result in results:
        assert_close(result, expected)


@needs_mpi
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_all(tmp_path):
    job = {"model": "mlp", "steps": 4, "poison_at": 2, "out": str(tmp_path)}
    results = run_ranks(2, job)
    trainer = dp_worker.build(job, World())
    losses, expected = oracle(job, trainer=trainer)
    assert trainer.skipped_steps == 1
    assert [int(result["skipped"]) for result in results] == [1, 1]
    np.testing.assert_allclose(results[0]["losses"][[0, 1, 3]], np.array(losses)[[0, 1, 3]], rtol=1e-5)
    assert not np.isfinite(results[0]["losses"][2])
    for result in results:
        assert_close(result, expected)


@needs_mpi
def test_two_ranks_resume_on_one_and_one_on_two(tmp_path):
    # 2 ranks (ZeRO-1) for 2 steps, then one process for 2 more: the 4-step curve of one process.
    job = {"model": "stack", "steps": 2, "zero": True, "out": str(tmp_path / "a"), "save": str(tmp_path / "a-ckpt")}
    first = run_ranks(2, job)
    whole = {**job, "steps": 4}
    losses, expected = oracle(whole)
    resumed = dp_worker.build(whole, World())
    assert resumed.load(tmp_path / "a-ckpt")["step"] == 2
    later, state = oracle(whole, first=2, trainer=resumed)
    np.testing.assert_allclose(np.concatenate([first[0]["losses"], later]), losses, rtol=1e-5)
    assert_close({f"state:{k}": v for k, v in state.items()}, expected)

    # One process for 2 steps, then 2 ranks for 2 more.
    job = {"model": "mlp", "steps": 2, "out": str(tmp_path / "b")}
    single = dp_worker.build(job, World())
    dp_worker.train(single, job, 0, 2)
    single.save(tmp_path / "b-ckpt")
    results = run_ranks(2, {**job, "steps": 4, "load": str(tmp_path / "b-ckpt")})
    losses, expected = oracle({**job, "steps": 4})
    np.testing.assert_allclose(results[0]["losses"], losses[2:], rtol=1e-5)
    assert_close(results[1], expected)


@needs_mpi
@pytest.mark.parametrize("failure", ["kill", "hang"])
def test_a_lost_rank_ends_the_job_and_keeps_the_checkpoint(tmp_path, failure):
    folder = tmp_path / "ckpt"
    job = {"model": "mlp", "steps": 6, "save": str(folder), "save_every": 2, "out": str(tmp_path), "fail": failure, "fail_at": 3}
    start = time.perf_counter()
    done = launch(2, job, timeout=90, env={"RANVIER_DP_TIMEOUT": "3"})
    assert done.returncode != 0
    assert time.perf_counter() - start < 60
    if failure == "hang":  # rank 0 gave up on rank 1 and said why
        assert "did not complete within 3 s" in done.stderr and "another rank has died, hangs" in done.stderr
    arrays, metadata = load_checkpoint(folder)
    assert metadata["step"] == 2
    assert all(np.isfinite(a).all() for a in arrays.values())


@needs_mpi
def test_cli_workers_continue_one_loss_curve(tmp_path):
    def train(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "ranvier.cli", "train", "mnist", "--batch", "32",
                               "--checkpoint-every", "5", "--quiet", *args],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("test_accuracy=") == 1  # rank 0 alone prints
        return done.stdout

    train("--steps", "20", "--run-dir", str(tmp_path / "one"))
    train("--steps", "10", "--workers", "2", "--run-dir", str(tmp_path / "two"))
    train("--resume", str(tmp_path / "two"), "--steps", "20")

    def curve(run: str) -> dict[int, float]:
        lines = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {line["step"]: line["loss"] for line in lines if "loss" in line}

    one, two = curve("one"), curve("two")
    assert sorted(one) == sorted(two) == [10, 20]
    np.testing.assert_allclose([two[10], two[20]], [one[10], one[20]], rtol=1e-5)
    assert not any(p.name.startswith(".") for p in (tmp_path / "two" / "checkpoint").iterdir())


def test_workers_without_a_launcher_say_what_to_install(monkeypatch):
    from ranvier.distributed import launch as launching

    monkeypatch.setattr(launching.shutil, "which", lambda name: None)
    monkeypatch.setattr(launching.sys, "executable", "/nonexistent/python")
    with pytest.raises(RanvierError, match=r"pip install 'ranvier\[mpi\]'"):
        launching.find_mpiexec()


def test_checkpoints_are_the_same_with_accumulation_and_without(tmp_path):
    job = {"model": "mlp", "steps": 2, "out": str(tmp_path)}
    plain = dp_worker.build(job, World())
    accumulated = dp_worker.build({**job, "accumulate": 2}, World())
    assert {n: a.shape for n, a in plain.state_arrays().items()} == {n: a.shape for n, a in accumulated.state_arrays().items()}
    dp_worker.train(plain, job, 0, 2)
    plain.save(tmp_path / "ckpt")
    assert accumulated.load(tmp_path / "ckpt")["step"] == 2


@needs_mpi
@pytest.mark.slow
def test_cli_llama_on_two_workers_matches_one(tmp_path):
    """The language-model job through the CheckpointedStack with ZeRO-1: each rank reads its
    rows of the shared batches, and the validation loss is the single process's."""
    def validation_loss(*args: str) -> float:
        done = subprocess.run([sys.executable, "-m", "ranvier.cli", "train", "llama", "--steps", "3", "--batch", "4",
                               "--seq", "32", "--checkpointed", "--quiet", *args],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        (line,) = [line for line in done.stdout.splitlines() if line.startswith("validation_loss=")]
        return float(line.split()[0].split("=")[1])

    one = validation_loss("--run-dir", str(tmp_path / "one"))
    two = validation_loss("--run-dir", str(tmp_path / "two"), "--workers", "2", "--zero")
    assert two == pytest.approx(one, rel=1e-5)


def ranks_of(launcher: int) -> list[int]:
    """The processes below `launcher` (mpiexec, its proxy, the ranks), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
    found, frontier = [], [launcher]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@needs_mpi
@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="finds the launcher's processes in /proc")
def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    """`kill -9` of `ranvier train ... --workers 2` ends mpiexec and both ranks within
    seconds, and the run resumes from its last checkpoint."""
    run = tmp_path / "run"
    mnist = [sys.executable, "-m", "ranvier.cli", "train", "mnist", "--batch", "8", "--quiet"]
    launcher = subprocess.Popen([*mnist, "--steps", "1000000", "--checkpoint-every", "20", "--workers", "2", "--run-dir", str(run)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while launcher.poll() is None and checkpoint_step(run) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        below = ranks_of(launcher.pid)
        assert len(below) >= 3, f"mpiexec and two ranks: {below}"  # (and for MPICH, a proxy between them)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(map(alive, below)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in below if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the launcher's processes outlived it"
    resumed = subprocess.run([*mnist, "--resume", str(run), "--steps", str(checkpoint_step(run) + 2)],
                             capture_output=True, text=True, check=False)
    assert resumed.returncode == 0, resumed.stderr
