"""The cases of `test_index_safety.py`, and the child process that runs them on one backend.

Each op that reads a run-time index, offset, position or count is one `Case` (or several,
one per kernel it can take): the op, small, reading the integer input `index`; the
elements of it a bad value goes into; and `end`, the first value past the valid ones. The
cases of one index dtype are one cell, compiled once per backend; each bad value then goes
into one case's index, every other index valid, and the cell computes with every buffer
between guard bytes (`ranvier.guards`).

    python tests/index_safety_worker.py BACKEND CPU_MASK [SKIP...]

prints, for each (case, dtype, value) not skipped (a SKIP is "label dtype"), a line
"start KEY" and then its problems as one JSON line; none when the backend refused the
value as the reference does (a RanvierError naming the op: a refused write moves nothing
outside the op's own outputs, and the rows other indices name are right), or computed
what the reference computes. The "start" line tells a parent that sees the child die
which value killed it. First come the kernels the cells' steps run, and the problems of
the valid values (key "valid DTYPE") against the reference.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from helpers import agree, random_array

import ranvier as rv
from ranvier import dtypes
from ranvier.guards import GuardBytesOverwritten
from ranvier.ops import written_inputs

SENTINEL = 0xA5  # every byte of an output before a compute: "not written"


@dataclass(frozen=True)
class Case:
    """`build(f, index, name)` adds op `name` of type `op` reading `index` and returns its
    outputs (as `Builder.op` does). `rows`: outputs whose row r (the output as [index elements / per, ...]) comes
    from index elements [r·per, (r+1)·per) alone; `skipped`: written globals a refused
    compute leaves as they were."""

    label: str
    op: str
    build: Callable
    valid: tuple
    end: int
    positions: tuple[int, ...] = (1,)
    dtypes: tuple[str, ...] = ("int32", "int64")
    rows: dict[str, int] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return np.shape(self.valid)


def _data(f, name: str, shape, dtype: str = "float32", seed: int = 0):
    return f.parameter(name, random_array(shape, dtype, seed=seed))


def _gather(oov: bool):
    def build(f, index, name):
        extra = [_data(f, f"{name}_oov", [5], seed=2)] if oov else []
        return f.op("Gather", [_data(f, f"{name}_table", [6, 5], seed=1), index, *extra], name)

    return build


def _scatter_add(dtype: str):
    return lambda f, index, name: f.op("ScatterAdd", [index, _data(f, f"{name}_updates", [4, 5], dtype, 3)], name, {"rows": 6})


def _pooled(op: str):
    return lambda f, index, name: f.op(op, [_data(f, f"{name}_table", [6, 5], seed=4), index], name)


def _assign_add_scatter(oov: bool):
    def build(f, index, name):
        target, value = _data(f, f"{name}_target", [6, 5], seed=5), _data(f, f"{name}_value", [4, 5], seed=6)
        extra = [_data(f, f"{name}_oov", [1, 5], seed=7)] if oov else []
        return f.op("AssignAddScatter", [target, index, value, *extra], name)

    return build


def _assign_slice(axis: int):
    def build(f, index, name):
        target = _data(f, f"{name}_target", [4, 8, 5], seed=8)
        value = _data(f, f"{name}_value", [3, 8, 5] if axis == 0 else [4, 3, 5], seed=9)
        return f.op("AssignSlice", [target, value, index], name, {"axis": axis})

    return build


def _cached_attention(heads: int, queries: int):
    """One key/value head: `heads` × `queries` query rows, from 4 of which the CPU goes by blocks."""
    def build(f, index, name):
        shapes = {"q": [1, heads, queries, 4], "k": [1, 1, queries, 4], "v": [1, 1, queries, 4]}
        new = [_data(f, f"{name}_{part}", shape, seed=10 + i) for i, (part, shape) in enumerate(shapes.items())]
        caches = [_data(f, f"{name}_{part}_cache", [1, 1, 6, 4], seed=20 + i) for i, part in enumerate("kv")]
        return f.op("CachedAttention", [*new, *caches, index], name)

    return build


def _grouped(op: str):
    def build(f, offsets, name):
        x = _data(f, f"{name}_x", [6, 4], seed=30)
        if op == "GroupedMatMul":
            return f.op(op, [x, _data(f, f"{name}_w", [3, 4, 5], seed=31), offsets], name)
        return f.op(op, [x, _data(f, f"{name}_dy", [6, 5], seed=32), offsets], name, {"experts": 3})

    return build


def _combine(op: str):
    def build(f, slot, name):
        rows, weights = _data(f, f"{name}_rows", [6, 5], seed=40), _data(f, f"{name}_weights", [4, 2], seed=41)
        if op == "MoECombine":
            return f.op(op, [rows, slot, weights], name)
        return f.op(op, [_data(f, f"{name}_dy", [4, 5], seed=42), rows, slot, weights], name)

    return build


def _cross_entropy(op: str):
    def build(f, targets, name):
        logits = _data(f, f"{name}_logits", [4, 6], seed=50)
        if op == "SoftmaxCrossEntropy":
            return f.op(op, [logits, targets], name)
        return f.op(op, [logits, targets, _data(f, f"{name}_dloss", [4], seed=51)], name, {"with_loss": True})

    return build


def _sample_token(f, top_k, name):
    settings = [f.parameter(f"{name}_{part}", np.asarray(value, np.float32))
                for part, value in (("uniform", [0.1, 0.5, 0.9]), ("temperature", 1.0), ("top_p", 0.9))]
    uniform, temperature, top_p = settings
    return f.op("SampleToken", [_data(f, f"{name}_logits", [3, 7], seed=60), uniform, temperature, top_k, top_p], name)


ROWS = (2, 0, 5, 3)  # four valid rows of a 6-row table
CASES = [
    Case("gather", "Gather", _gather(oov=False), ROWS, 6, rows={"gather:0": 1}),
    Case("gather_oov", "Gather", _gather(oov=True), ROWS, 6),
    Case("scatter_add", "ScatterAdd", _scatter_add("float32"), ROWS, 6),
    Case("scatter_add_half", "ScatterAdd", _scatter_add("float16"), ROWS, 6),
    Case("one_hot", "OneHot", lambda f, index, name: f.op("OneHot", [index], name, {"depth": 6}), ROWS, 6),
    Case("gather_sum", "GatherSum", _pooled("GatherSum"), ROWS, 6),
    Case("gather_max", "GatherMax", _pooled("GatherMax"), ROWS, 6),
    Case("gather_avg", "GatherAvg", _pooled("GatherAvg"), ROWS, 6),
    Case("assign_add_scatter", "AssignAddScatter", _assign_add_scatter(oov=False), ROWS, 6),
    Case("assign_add_scatter_oov", "AssignAddScatter", _assign_add_scatter(oov=True), ROWS, 6),
    Case("assign_slice_0", "AssignSlice", _assign_slice(0), 1, 4, (0,), skipped=("assign_slice_0_target",)),
    Case("assign_slice_1", "AssignSlice", _assign_slice(1), 6, 8, (0,), skipped=("assign_slice_1_target",)),
    Case("cached_attention_rows", "CachedAttention", _cached_attention(2, 1), 3, 7, (0,)),
    Case("cached_attention_blocks", "CachedAttention", _cached_attention(4, 2), 3, 7, (0,)),
    Case("moe_route", "MoERoute", lambda f, index, name: f.op("MoERoute", [index], name, {"experts": 3}),
         ((0, 2), (1, 0), (2, 1), (0, 1)), 3),
    Case("grouped_matmul", "GroupedMatMul", _grouped("GroupedMatMul"), (0, 2, 3, 6), 7, (0, 1, 3), ("int32",)),
    Case("grouped_matmul_weight_grad", "GroupedMatMulWeightGrad", _grouped("GroupedMatMulWeightGrad"), (0, 2, 3, 6), 7,
         (0, 1, 3), ("int32",)),
    Case("moe_combine", "MoECombine", _combine("MoECombine"), ((4, 1), (0, 5), (2, 2), (3, 0)), 6, (1,), ("int32",),
         rows={"moe_combine:0": 2}),
    Case("moe_combine_grad", "MoECombineGrad", _combine("MoECombineGrad"), ((4, 1), (0, 5), (2, 2), (3, 0)), 6, (1,),
         ("int32",), rows={"moe_combine_grad:1": 1}),
    Case("cross_entropy", "SoftmaxCrossEntropy", _cross_entropy("SoftmaxCrossEntropy"), ROWS, 6, rows={"cross_entropy:0": 1}),
    Case("cross_entropy_grad", "SoftmaxCrossEntropyGrad", _cross_entropy("SoftmaxCrossEntropyGrad"), ROWS, 6,
         rows={"cross_entropy_grad:0": 1, "cross_entropy_grad:1": 1}),
    Case("sample_token", "SampleToken", _sample_token, 3, 8, (0,), ("int32",)),
]
DTYPES = ("int32", "int64")


def bad_values(case: Case, dtype: str) -> list[int]:
    """Negative, past the end, and the edges of int32 (of int64 too, and 2³² + 1, which
    an int64 index cut to 32 bits would read as the valid 1)."""
    values = [-1, -10**6, -2**31, case.end, 2**31 - 1]
    if dtype == "int64":
        values += [2**31, -2**31 - 1, 2**32 + 1, -2**63, 2**63 - 1]
    return values


def case_flow(dtype: str) -> rv.Flow:
    """Every case of index dtype `dtype` in function "f", each output an output of the cell."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    for case in CASES:
        if dtype in case.dtypes:
            outputs = case.build(f, f.var(f"{case.label}_index", dtype, case.shape), case.label)
            for output in outputs if isinstance(outputs, tuple) else (outputs,):
                output.var.out = True
    return flow


@dataclass
class Outcome:
    """What a compute did: its error (None where it returned), whether the guards caught a
    write outside memory, every output and global after it, and the index inputs it wrote."""

    error: str | None
    guard: bool
    values: dict[str, np.ndarray]
    inputs_written: list[str]


class Runner:
    """One cell of the cases, computed with chosen index values from a fresh start each
    time: globals at their initial values, outputs all sentinel bytes."""

    def __init__(self, compiler: rv.Compiler, flow: rv.Flow):
        self.flow = flow
        self.network = compiler.compile(flow)
        self.cell = self.network.cell("f")
        self.data = self.cell.instance()
        self.globals = {v.name: np.array(v.data) for v in flow.vars.values() if v.data is not None and v.learnable}
        self.outputs = [v for v in flow.vars.values() if v.out]
        self.before = {**self.globals, **{v.name: _sentinel(v) for v in self.outputs}}

    def compute(self, bad: tuple[Case, int, int] | None = None) -> Outcome:
        for name, value in self.globals.items():
            self.network[name][...] = value
        given = {}
        for case in CASES:
            name = f"f/{case.label}_index"
            if name in self.flow.vars:
                given[name] = np.array(case.valid, dtypes.to_numpy(self.flow.vars[name].dtype))
                if bad is not None and bad[0] is case:
                    given[name].reshape(-1)[bad[1]] = bad[2]
                self.data[name] = given[name]
        for var in self.outputs:
            self.data[var] = self.before[var.name]
        error, guard = None, False
        try:
            self.data.compute()
        except GuardBytesOverwritten as problem:
            error, guard = str(problem), True
        except rv.RanvierError as problem:
            error = str(problem)
        values = {name: np.array(self.network[name]) for name in self.globals}
        values.update({var.name: np.array(self.data[var]) for var in self.outputs})
        return Outcome(error, guard, values, [name for name, index in given.items() if not _same(self.data[name], index)])


def _sentinel(var) -> np.ndarray:
    return np.frombuffer(bytes([SENTINEL]) * var.nbytes, dtypes.to_numpy(var.dtype)).reshape(var.shape)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()


def _inputs_written(outcome: Outcome) -> list[str]:
    return [f"wrote the inputs {', '.join(outcome.inputs_written)}"] if outcome.inputs_written else []


def differences(got: Outcome, want: Outcome, flow: rv.Flow) -> list[str]:
    """Where `got` and the reference's `want` part beyond the dtype's tolerance."""
    found = []
    for name, expected in want.values.items():
        try:
            agree(got.values[name], expected, flow.vars[name].dtype, name)
        except AssertionError as difference:
            found.append(" ".join(str(difference).split())[:300])
    return found


def judge(case: Case, position: int, got: Outcome, want: Outcome, valid: Outcome, runner: Runner) -> list[str]:
    """The problems with the backend's compute `got` of a bad value, beside the reference's
    `want` and the backend's own compute of valid values (module docstring)."""
    if got.guard:
        return [got.error]
    if got.inputs_written:
        return _inputs_written(got)
    if want.error is None:
        refused = [f"refused what the reference computes: {got.error}"] if got.error else []
        return refused or differences(got, want, runner.flow)
    name = f"f/{case.label}"
    if got.error is None:
        return [f"computed what the reference refuses ({want.error})"]
    problems = [] if any(f"op {named} " in got.error for named in _blamed(runner, name)) else [
        f"the error names neither op {name} nor an op of its decomposition: {got.error}"]
    op = runner.flow.ops[name]
    owned = {v.name for v in (*op.outputs, *written_inputs(op))}
    for other, after in got.values.items():
        if other not in owned and not (_same(after, valid.values[other]) or _same(after, runner.before[other])):
            problems.append(f"{other}, not the op's, changed")
    for target in case.skipped:
        if not _same(got.values[f"f/{target}"], runner.before[f"f/{target}"]):
            problems.append(f"{target} was written")
    for output, per in case.rows.items():
        after, right = (outcome.values[f"f/{output}"] for outcome in (got, valid))
        groups = np.size(case.valid) // per
        if _same(after, runner.before[f"f/{output}"]):
            continue  # refused whole
        kept = [r for r in range(groups) if r != position // per]
        if not _same(after.reshape(groups, -1)[kept], right.reshape(groups, -1)[kept]):
            problems.append(f"{output}: the rows of the valid indices are wrong")
    return problems


def _blamed(runner: Runner, name: str) -> set[str]:
    """The ops an error may name for op `name`: itself where a step runs it whole, else
    the ops its decomposition made (they have names of their own)."""
    steps = {step.op.name for step in runner.cell.steps}
    return {name} if name in steps else steps - set(runner.flow.ops)


def compiler(backend: str, mask: str) -> rv.Compiler:
    return rv.Compiler(backend, cpu=mask) if backend == "cpu" else rv.Compiler(backend)


def main(backend: str, mask: str, skip: set[str]) -> None:
    kernels = set()
    for dtype in DTYPES:
        flow = case_flow(dtype)
        reference, runner = Runner(rv.Compiler("reference"), flow), Runner(compiler(backend, mask), flow)
        kernels |= {f"{step.kernel} {step.op.type}" for step in runner.cell.steps}
        want, valid = reference.compute(), runner.compute()
        problems = [valid.error] if valid.error else [*_inputs_written(valid), *differences(valid, want, flow)]
        print(json.dumps({"key": f"valid {dtype}", "problems": problems}), flush=True)
        for case in CASES:
            if dtype not in case.dtypes or f"{case.label} {dtype}" in skip:
                continue
            for position in case.positions:
                for value in bad_values(case, dtype):
                    key = f"{case.label} {dtype} {value} at {position}"
                    print(f"start {key}", flush=True)
                    bad = (case, position, value)
                    problems = judge(case, position, runner.compute(bad), reference.compute(bad), valid, runner)
                    print(json.dumps({"key": key, "problems": problems}), flush=True)
    print(json.dumps({"kernels": sorted(kernels)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], set(sys.argv[3:]))
