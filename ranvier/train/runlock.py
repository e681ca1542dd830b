"""The lock a training holds on its run directory, so that two never write one run.

It is an advisory lock (flock) on the file `.lock` inside the run directory, held for the
run's life and released by the operating system when the process ends, however it ends:
a run killed with `kill -9` leaves no stale lock. The file says which process holds it
(its pid and host), for the error a second training gets. The file itself stays: removing
it would let a process that had opened it lock a file no other process can find.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from ..errors import RanvierError

LOCK = ".lock"


class RunDirLocked(RanvierError):
    """Another process is training in the run directory."""


def holder(run_dir: Path) -> dict | None:
    """What the lock file of `run_dir` says of the process holding it, {"pid", "host"};
    None when it says nothing readable (no lock taken yet, or one being taken)."""
    try:
        said = json.loads((run_dir / LOCK).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(said, dict) or type(said.get("pid")) is not int or not isinstance(said.get("host"), str):
        return None
    return said


def lock_run_dir(run_dir: Path) -> int:
    """Lock `run_dir` (an existing folder) for this process and return the lock's file
    descriptor, to close when the run ends; a RunDirLocked error naming the process that
    holds it already. An OSError where the lock file cannot be made (a read-only folder)."""
    path = run_dir / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            said = holder(run_dir)
            who = f"process {said['pid']} on {said['host']}" if said else "another process"
            raise RunDirLocked(f"{run_dir} is in use: {who} is training in it (it holds {path}); "
                               "wait for it to end, or train in another --run-dir") from None
        # The file locked must be the one at the path: one removed since it was opened (with
        # its run directory, by a run that failed) locks nothing another process could see.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    return fd
