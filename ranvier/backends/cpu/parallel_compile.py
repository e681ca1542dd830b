"""A cell's modules compiled side by side. llvmlite lets one thread of a process into LLVM
at a time, so threads would take turns: each module past the first goes to a worker
process of its own (this interpreter running `serve`: the module's IR in on stdin, its
object file out on stdout) while this process compiles the first. A worker costs about
half a second to start (it imports ranvier for the same optimization pipeline), so only
cells of `WORKER_LINES` lines of IR or more use them (a smaller cell's modules are linked
into one and compiled here); where a worker fails, its module is compiled here instead (a
broken module then raises LLVM's error as it would anyway). The objects come back as one
bundle (`jit.bundle`), cached and loaded as one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO, cast

from llvmlite import ir

from . import jit
from .parallel import thread_count
from .target import CPUTarget

WORKER_LINES = 20_000  # lines of IR from which worker processes pay for their start
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])  # where this ranvier is imported from
_SERVE = "import sys; sys.path.insert(0, sys.argv[1]); from ranvier.backends.cpu.parallel_compile import serve; serve()"


def parts() -> int:
    """How many modules a cell's steps are spread over: one per core this process may use
    (never more than the machine has: a benchmark may pretend to more)."""
    return min(thread_count(), os.cpu_count() or 1)


def compile_modules(modules: list[ir.Module], target: CPUTarget) -> bytes:
    """Machine code for a cell's modules: one object, or a bundle of one per module."""
    texts = [str(module) for module in modules]
    if len(texts) == 1 or sum(text.count("\n") for text in texts) < WORKER_LINES:
        return jit.compile_text(*texts, target=target)  # one object, as one module would give
    workers = [_start(text, target) for text in texts[1:]]
    objects = [jit.compile_text(texts[0], target=target)]
    for worker, text in zip(workers, texts[1:]):
        objects.append(_result(worker, text, target))
    return jit.bundle(objects)


def _start(text: str, target: CPUTarget) -> subprocess.Popen[bytes] | None:
    try:
        worker = subprocess.Popen([sys.executable, "-c", _SERVE, _PACKAGE_PARENT, target.name, target.features],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except OSError:  # no process to spare (a limit, an interpreter gone): compiled here
        return None
    stdin = cast(IO[bytes], worker.stdin)  # a pipe, as asked
    try:
        stdin.write(text.encode())
        stdin.close()
    except BrokenPipeError:  # it ended before reading its module: `_result` finds it failed
        pass
    return worker


def _result(worker: subprocess.Popen[bytes] | None, text: str, target: CPUTarget) -> bytes:
    if worker is not None:
        stdout = cast(IO[bytes], worker.stdout)
        code = stdout.read()
        stdout.close()
        if worker.wait() == 0 and code:
            return code
    return jit.compile_text(text, target=target)


def serve() -> None:
    """A worker: the IR on stdin compiled for the CPU named by argv[2:4], its object file to stdout."""
    name, features = sys.argv[2:4]
    code = jit.compile_text(sys.stdin.buffer.read().decode(), target=CPUTarget(name, features))
    with os.fdopen(sys.stdout.fileno(), "wb", closefd=False) as out:
        out.write(code)
