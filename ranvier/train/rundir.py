"""What every training job's run directory shares: its config.json and its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from ..atomic import atomic_write_bytes
from ..errors import RanvierError

Config = TypeVar("Config")


def read_config(run_dir: Path, kind: type[Config]) -> Config:
    """The job config saved in `run_dir/config.json`."""
    path = run_dir / "config.json"
    if not path.exists():
        raise RanvierError(f"{run_dir} is not a run directory: config.json is missing")
    return kind(**json.loads(path.read_text()))


def keep_metrics_until(path: Path, step: int) -> None:
    """On resume, drop metric lines logged after the checkpoint (they will be logged again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    atomic_write_bytes(path, ("\n".join(kept) + "\n" if kept else "").encode())
