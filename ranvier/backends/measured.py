"""Measurements of this machine kept in the code cache's folder (code generated from them
is cached there too), so each is taken once per machine, not once per process."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any  # JSON numbers and booleans, read as each measurement needs

from ..atomic import atomic_write_bytes
from .cache_folder import cache_dir


def kept_path(kind: str, identity: str) -> Path:
    """The file holding measurements of `kind` for a machine described by `identity`."""
    return cache_dir() / f"{kind}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"


@contextmanager
def kept(path: Path) -> Iterator[dict[str, Any] | None]:
    """The measurements in `path` (an empty dict if there are none or they do not read),
    held under a lock beside the file: processes starting together on a fresh machine
    wait for the first one's measurement rather than each taking its own. What the body
    adds to the dict is written back atomically. None where there is no folder to keep
    them in (measure, and keep nothing)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 -- held across the measurement
    except OSError:
        yield None
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        values = _read(path)
        before = dict(values)
        yield values
        if values != before:
            atomic_write_bytes(path, json.dumps(values, sort_keys=True).encode())


def _read(path: Path) -> dict[str, Any]:
    """The measurements in `path`, a JSON object of numbers and booleans; an empty dict
    where there are none or they do not read as such (a corrupt file is measured anew)."""
    try:
        values = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return values if _are_measurements(values) else {}


def _are_measurements(values: object) -> bool:
    return isinstance(values, dict) and all(type(v) is bool or (type(v) in (int, float) and math.isfinite(v))
                                            for v in values.values())


def unreadable(folder: Path) -> list[Path]:
    """The measurement files in `folder` (`kept_path`'s) that do not read as measurements."""
    return [path for path in folder.glob("*-*.json") if path.is_file() and not _read(path)]
