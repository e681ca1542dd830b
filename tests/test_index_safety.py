"""Every kernel that reads a run-time index, offset, position or count, given values out of
range (negative, past the end, the edges of int32 and int64) on every backend variant:
the compute is refused with a RanvierError naming the op, as the reference refuses it,
or computes what the reference computes where the op defines a meaning for the value
(padding, an out-of-vocabulary row), and nothing is written outside the op's outputs.
The cases and the checks of each compute are `index_safety_worker.py`'s.

Each variant runs in a child process with every buffer between guard bytes
(`ranvier.guards`): a write just outside a buffer fails that compute by name, and a write
far outside, which may kill the process, kills only the child, which starts again past
the case that killed it. The child processes run side by side.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from index_safety_worker import CASES

import ranvier as rv
from ranvier import guards
from ranvier.backends.cpu.gemm_choice import GEMM_ENVIRONMENT
from ranvier.backends.cpu.kernels.library import LIBRARY
from ranvier.backends.cuda.device import DEVICE_ENVIRONMENT, EMULATOR
from ranvier.ops import all_ops, op_def
from ranvier.runtime import aligned_empty

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "index_safety_worker.py"
VARIANTS = {  # name: (backend, CPU feature mask, the GEMM grouped products take: both CPU kernels run)
    "reference": ("reference", "", None),
    "cpu": ("cpu", "", "generated"),
    "cpu-avx512": ("cpu", "-avx512", "blas"),
    "cpu-avx2": ("cpu", "-avx2", "generated"),
    "cuda-emulator": ("cuda", "", None),
}
WORKER_SECONDS = 300

# Ops whose shape rules name an integer input or output that no kernel reads as a place.
NOT_INDICES = {
    "ArgMax": "its integer output is computed, not read",
    "ArgMin": "its integer output is computed, not read",
    "TopK": "its integer output is computed, not read",
    "SoftmaxTopK": "its integer output is computed, not read",
    "Shape": "an integer output known when the cell is compiled",
    "Size": "an integer output known when the cell is compiled",
    "Rank": "an integer output known when the cell is compiled",
    "MoEAuxLoss": "its expert counts are summed as numbers, never used as places",
    "RandomUniform": "its counters and seed are hashed as numbers, never used as places",
    "Dropout": "its seed is hashed as a number, never used as a place",
}


class Child:
    """One variant's worker process, started again past a (case, dtype) that killed it."""

    def __init__(self, variant: str):
        self.variant = variant
        self.problems: dict[str, list[str]] = {}
        self.kernels: set[str] = set()
        self.skip: list[str] = []
        self.process: subprocess.Popen | None = self._start()

    def _start(self) -> subprocess.Popen:
        backend, mask, gemm = VARIANTS[self.variant]
        env = {**os.environ, guards.ENVIRONMENT: "1", DEVICE_ENVIRONMENT: EMULATOR}
        if gemm:
            env[GEMM_ENVIRONMENT] = gemm
        return subprocess.Popen([sys.executable, str(WORKER), backend, mask, *self.skip], cwd=TESTS, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def results(self) -> dict[str, list[str]]:
        while self.process is not None:
            try:
                out, err = self.process.communicate(timeout=WORKER_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                out, err = self.process.communicate()
            running = self._read(out)
            if self.process.returncode == 0:
                self.process = None
            elif running is None:
                self.problems["worker"] = [f"the worker failed outside any case ({_exit(self.process.returncode)}): {err[-2000:]}"]
                self.process = None
            else:
                self.problems[running] = [f"the process died ({_exit(self.process.returncode)}): {err[-1000:]}"]
                self.skip.append(" ".join(running.split()[:2]))  # the rest of that case and dtype
                self.process = self._start()
        return self.problems

    def _read(self, out: str) -> str | None:
        """Record the finished keys' problems; the key the worker was running when it stopped."""
        running = None
        for line in out.splitlines():
            if line.startswith("start "):
                running = line.removeprefix("start ")
                continue
            record = json.loads(line)
            if "kernels" in record:
                self.kernels |= set(record["kernels"])
            else:
                self.problems[record["key"]], running = record["problems"], None
        return running


def _exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


@pytest.fixture(scope="module")
def children() -> dict[str, Child]:
    return {variant: Child(variant) for variant in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_case_in_range_computes_what_the_reference_does(children, variant):
    found = children[variant].results()
    assert not found.get("worker"), found["worker"]
    for dtype in ("int32", "int64"):
        assert found[f"valid {dtype}"] == [], "\n".join(found[f"valid {dtype}"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("label", [case.label for case in CASES])
def test_an_index_out_of_range_is_refused_and_nothing_outside_the_op_is_written(children, variant, label):
    found = children[variant].results()
    keys = [key for key in found if key.startswith(f"{label} ")]
    assert keys, f"the worker ran no value of case {label}: {found.get('worker')}"
    problems = [f"{key}: {problem}" for key in keys for problem in found[key]]
    assert not problems, "\n".join(problems)


def test_every_cpu_kernel_of_an_index_op_runs_in_some_variant(children):
    """A kernel the cases never reach (a new one, or one chosen by size) is untested."""
    ops = {case.op for case in CASES}
    wanted = {f"{kernel.name} {op}" for kernel in LIBRARY.kernels if kernel.ops for op in kernel.ops & ops}
    ran = set().union(*(children[v].kernels for v, (backend, *_) in VARIANTS.items() if backend == "cpu"))
    assert wanted <= ran, f"kernels no case runs: {sorted(wanted - ran)}"


def _rule_source(function, seen: set) -> str:
    """The source of a shape rule and of the ops' helpers and rules it calls."""
    if not isinstance(function, types.FunctionType) or function in seen or not function.__module__.startswith("ranvier.ops"):
        return ""
    seen.add(function)
    text = inspect.getsource(function)
    names = inspect.getclosurevars(function)
    called = [*names.globals.values(), *names.nonlocals.values()]
    called += [op_def(other).infer for other in re.findall(r'op_def\("(\w+)"\)', text)]
    return text + "".join(_rule_source(f, seen) for f in called)


def test_every_op_with_an_integer_input_has_a_case():
    """An op whose shape rule names an integer dtype reads an index, offset or count at run
    time, unless it is one of NOT_INDICES: a new one needs a Case in the worker."""
    integer = re.compile(r"\bINDEX\b|int32|int64|DT_INT")
    named = {name for name, definition in all_ops().items() if integer.search(_rule_source(definition.infer, set()))}
    covered = {case.op for case in CASES}
    assert named - set(NOT_INDICES) == covered, f"without a case: {sorted(named - set(NOT_INDICES) - covered)}"
    assert not covered & set(NOT_INDICES)


def test_guard_bytes_name_a_buffer_written_just_outside(monkeypatch):
    monkeypatch.setenv(guards.ENVIRONMENT, "1")
    buffer = aligned_empty(100, what="the test's buffer")
    assert buffer.ctypes.data % 64 == 0 and not buffer.any()
    guards.check()
    ctypes.memset(buffer.ctypes.data - 3, 0, 1)
    ctypes.memset(buffer.ctypes.data + 101, 0, 1)
    with pytest.raises(guards.GuardBytesOverwritten, match=r"the test's buffer \(100 bytes; written up to 3 bytes before it "
                                                           r"and 2 bytes after it\)"):
        guards.check()
    guards.check()  # restored: only new damage is reported


def _assign_slice_model(folder: Path, dtype: str, axis: int, start: int) -> list[str]:
    """A .flow writing two rows into a resident [4, 8] cache at a start read from a .npy
    file (the issue's reproduction), and its inputs: `ranvier run`'s arguments."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    cache = f.parameter("cache", np.ones((4, 8), np.float32))
    rows = f.var("rows", "float32", [2, 8] if axis == 0 else [4, 2])
    position = f.var("start", dtype, [])
    f.op("AssignSlice", [cache, rows, position], None, {"axis": axis})
    (cache * 2.0).var.out = True
    flow.save(folder / "model.flow")
    np.save(folder / "rows.npy", np.full(rows.shape, 7, np.float32))
    np.save(folder / "start.npy", np.array(start, dtype))
    return [str(folder / "model.flow"), "--input", f"f/rows={folder / 'rows.npy'}", "--input", f"f/start={folder / 'start.npy'}"]


@pytest.mark.parametrize("dtype,axis,start", [("int64", 0, -1), ("int32", 1, -2**31), ("int64", 0, -10**6)])
def test_ranvier_run_refuses_a_start_outside_the_cache_in_one_line(tmp_path, dtype, axis, start):
    arguments = _assign_slice_model(tmp_path, dtype, axis, start)
    guarded = {**os.environ, guards.ENVIRONMENT: "1"}  # a write a row before the cache fails too, not only a far one
    done = subprocess.run([sys.executable, "-m", "ranvier.cli", "run", *arguments], capture_output=True, text=True, env=guarded,
                          timeout=WORKER_SECONDS, check=False)
    assert done.returncode == 1, f"{_exit(done.returncode)}: {done.stderr[-2000:]}"
    capacity = 4 if axis == 0 else 8
    # On a loaded machine the compile may outlast the CLI's one second and announce itself first.
    said = [line for line in done.stderr.splitlines() if not line.startswith("compiling ")]
    assert said == [f"ranvier: error: AssignSlice op f/AssignSlice failed: start {start} is outside [0, {capacity})"]
