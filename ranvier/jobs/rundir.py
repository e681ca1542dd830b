"""What every training job's run directory shares: its claim on the folder (a lock, and the rule
that a new run does not replace an old one unasked), its config.json (written here, read back
by `train/runs.py`), its metrics.jsonl, and the flags a resume may change."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import TEMPORARY, WriteError, atomic_write_bytes, os_error, remove_partial_writes
from ..distributed import current_world
from ..distributed.launch import launcher_pid
from ..errors import RanvierError, brief
from ..train.checkpoint import METADATA, read_metadata
from ..train.runlock import holder, lock_run_dir

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

# A run's files, as --force replaces them: config.json first, which makes the folder a run.
RUN_FILES = ("config.json", "checkpoint", "metrics.jsonl", "tokenizer.model", "tokenizer.json", "data", "curves.png",
             "trained.onnx")
# Those that mark a folder as holding a run, which a new run will not replace unasked.
RUN_MARKERS = ("config.json", "checkpoint", "metrics.jsonl")


@contextlib.contextmanager
def claimed(run_dir: Path, resume: bool = False, force: bool = False) -> Iterator[None]:
    """Hold `run_dir` for one training, from before its config is read to the run's end.

    The folder is made (a new run) and locked (runlock: a second training in it gets an
    error naming this process); one training cannot write is refused here, naming it,
    before any compile, and the temporary files of writes a killed run left are removed.
    A new run (not `resume`) refuses a folder holding a run already, unless `force`, which
    deletes that run first. A new run that fails (or is interrupted) before its first
    checkpoint takes its folder away again: a config without weights is nothing to resume.

    Of a data-parallel run's ranks, rank 0 claims the folder and the others only read it;
    ranks started by `--workers` find it claimed by their launcher, which holds the lock."""
    if not current_world().is_root:
        yield
        return
    existed = run_dir.exists()
    lock = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not held_by_launcher(run_dir):
            lock = lock_run_dir(run_dir)  # making the lock file tests that the folder can be written
        checkpoints = run_dir / "checkpoint"
        if checkpoints.is_dir():
            # Only a write tells: permissions, read-only mounts and root's rights all count.
            fd, probe = tempfile.mkstemp(prefix=".probe.", suffix=TEMPORARY, dir=checkpoints)
            os.close(fd)
            os.unlink(probe)
            remove_partial_writes(checkpoints)
        remove_partial_writes(run_dir)
    except OSError as error:
        if lock is not None:
            os.close(lock)
        raise RanvierError(f"the run directory {run_dir} is not writable: {os_error(error)}") from None
    try:
        if not resume:
            _start_over(run_dir, force)
        yield
    except BaseException:
        if not existed and not (run_dir / "checkpoint").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def held_by_launcher(run_dir: Path) -> bool:
    """Whether this process is a rank started by `--workers` whose launcher holds the lock
    of `run_dir` (the lock file names it)."""
    launcher = launcher_pid()
    return launcher is not None and holder(run_dir) == {"pid": launcher, "host": socket.gethostname()}


def _start_over(run_dir: Path, force: bool) -> None:
    """Make way for a new run in `run_dir`: a run there already is refused, naming what was
    found, or with `force` deleted, its config.json first (a deletion cut short leaves a
    folder that is no longer a run to resume, and is refused again until forced)."""
    found = [name for name in RUN_MARKERS if (run_dir / name).exists()]
    if not found:
        return
    if not force:
        raise RanvierError(f"{run_dir} holds a run already ({', '.join(found)}): pass --resume {run_dir} to continue it, "
                           "--force to start over and replace it, or another --run-dir")
    print(f"--force: replacing the run in {run_dir}")
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's checkpoint; None before its first."""
    folder = run_dir / "checkpoint"
    return int(read_metadata(folder)["step"]) if (folder / METADATA).exists() else None


class MetricsLog:
    """metrics.jsonl, appended to one JSON line per record. Each line is written through at
    once (a killed run loses no logged step) and whole or not at all: a write that fails, on
    a full disk say, is cut back and raises a WriteError naming the file. Only rank 0 of a
    data-parallel run writes it."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666) if current_world().is_root else None

    def write(self, record: dict) -> None:
        if self.fd is None:
            return
        line = memoryview((json.dumps(record) + "\n").encode())
        end = os.fstat(self.fd).st_size
        try:
            while line:
                line = line[os.write(self.fd, line):]
        except OSError as error:
            os.ftruncate(self.fd, end)
            raise WriteError(self.path, error) from error

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_) -> None:
        if self.fd is not None:
            os.close(self.fd)


def checkpoint_due(config, step: int, stop_at: int | None = None) -> bool:
    """Whether a job saves its checkpoint as `step` ends: every `config.checkpoint_every`
    steps, but not at the run's last step (nor at `stop_at`, where it pauses), whose
    checkpoint the job saves after logging its final evaluation: that checkpoint commits the
    run as finished, and a run killed before it resumes from the one before, which drops the
    evaluation's line and logs it again."""
    return step % config.checkpoint_every == 0 and step not in (config.steps, stop_at)


def write_config(run_dir: Path, kind: str, config) -> None:
    """Save a job config as `run_dir/config.json`, with the run's kind first (rank 0 of a
    data-parallel run)."""
    if current_world().is_root:
        atomic_write_bytes(run_dir / "config.json", json.dumps({"kind": kind, **asdict(config)}, indent=1).encode())


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop metric lines logged after the checkpoint (a resumed run logs them again), and a
    last line cut short (by a machine that stopped mid-write)."""
    if not path.exists() or not current_world().is_root:
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # (a cut line, or one nested past what the parser recurses)
            if number == len(lines):
                break
            raise RanvierError(f"{path} line {number} is not JSON: {line[:80]!r}") from None
        if not isinstance(record, dict) or type(record.get("step", 0)) is not int:
            raise RanvierError(f"{path} line {number} is {brief(record)}, expected a JSON object with an integer step")
        if record.get("step", 0) <= step:
            kept.append(line)
    atomic_write_bytes(path, ("\n".join(kept) + "\n" if kept else "").encode())


def apply_resume_flags(run_dir: Path, config, flags: dict, may_change: set[str]) -> None:
    """Apply to a run's config the flags given on resume: those in `may_change` (steps,
    checkpoint interval, ...) replace the run's; any other that differs from the run's is
    refused, naming it, since the checkpoint was trained under the run's."""
    own = {name: value for name, value in flags.items() if hasattr(config, name)}

    def recorded(name: str):
        return getattr(config, f"{name}_requested", None) or getattr(config, name)

    changed = sorted(name for name, value in own.items() if name not in may_change and recorded(name) != value)
    if changed:
        def flag(name: str, value) -> str:
            return f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        given = ", ".join(flag(name, own[name]) for name in changed)
        was = ", ".join(flag(name, recorded(name)) for name in changed)
        raise RanvierError(f"cannot change {given} on resume: {run_dir} was trained with {was} "
                           "(leave them out to resume, or start a new run)")
    for name in may_change & own.keys():
        setattr(config, name, own[name])


# What a resumed run may change: how far it goes and how often it saves.
RESUMABLE = {"steps", "minutes", "checkpoint_every", "zero"}


def prepare_resume(run_dir: Path, config, flags: dict) -> bool:
    """Apply the command line's `flags` (by config field) to a run's config for a resume;
    False when there is nothing left to train."""
    apply_resume_flags(run_dir, config, flags, RESUMABLE)
    # A time budget is this session's: a run resumed without one finishes its planned steps.
    config.minutes = flags.get("minutes")
    if config.minutes is not None and "steps" not in flags:
        config.steps = None
    if config.steps is None and config.minutes is None:
        raise RanvierError(f"{run_dir} stopped before --minutes planned its steps: pass --steps N or --minutes M to resume it")
    done = checkpoint_step(run_dir)
    if done is None:
        print(f"{run_dir} has no checkpoint (it stopped before its first): training from step 0")
    return steps_to_resume(run_dir, config, done or 0)


def steps_to_resume(run_dir: Path, config, done: int) -> bool:
    """Whether a resumed run has steps left to train (`config.steps` set on resume); a
    finished run says so, and fewer steps than it has made are refused."""
    if config.steps is not None and config.steps < done:
        raise RanvierError(f"{run_dir} is already at step {done}: --steps {config.steps} is fewer; "
                           f"pass --steps N > {done} to train further")
    if config.steps == done:
        print(f"run {run_dir} finished at step {done} of {config.steps}; pass --steps N > {done} to train further")
        return False
    return True


def requested_matmul(config) -> str:
    """The matrix-product precision the run asked for (config.matmul is what ran)."""
    return config.matmul_requested or config.matmul


def note_precision(config, trainer) -> None:
    """Say so where the backend stores activations in another precision than --precision
    asked for (half-precision activations are the CUDA backend's; the CPU keeps float32)."""
    if config.precision != "float32" and trainer.precision != config.precision:
        print(f"--precision {config.precision}: the {config.backend} backend stores activations in {trainer.precision}")


def note_skipped(config, trainer) -> None:
    """With float16 activations (dynamic loss scaling on), how many steps the scaling skipped."""
    if config.precision == "float16":
        print(f"loss scaling skipped {trainer.skipped_steps:,} of {trainer.step_count:,} steps")


def record_matmul(config, ran: str) -> None:
    """Record in the config the precision the matrix products run in, beside the one asked
    for, and say so when they differ (bfloat16 needs AMX-BF16 tiles or AVX512-BF16; without
    them the compiler keeps float32)."""
    config.matmul_requested = requested_matmul(config)
    config.matmul = ran
    if ran != config.matmul_requested and ran == "float32":  # (bfloat16 activations take bfloat16 products: no news)
        where = (f"the {config.backend} backend has no bfloat16 matrix products" if config.backend != "cpu" else
                 f"this CPU{f' (masked with --cpu={config.cpu})' if config.cpu else ''} has no usable AMX-BF16 or AVX512-BF16")
        print(f"--matmul {config.matmul_requested}: {where}: matrix products run in {ran}")
