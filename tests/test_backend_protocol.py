"""The `Backend` protocol (ranvier/backends/base.py) is the whole contract between a backend
and the compiler and runtime: a backend written against it alone, registered by name,
compiles and runs every op family. `NumpyProtocolBackend` here knows nothing of the
reference backend or the CPU's: each step runs its op's numpy reference from the op
registry. It asks for every pass (rewrites, epilogues, ForEach groups), and in its
"decomposing" form runs no composite whole, so the compiler decomposes what it can.
Each case runs on it and on the reference backend, from the same random inputs; mypy
checks the class against the protocol (pyproject.toml lists this file)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import numpy as np
import pytest
from helpers import language_model_trainer

import ranvier as rv
from ranvier.autodiff import gradient
from ranvier.backends import Backend, Capabilities, CompileOptions, register_backend
from ranvier.errors import RanvierError
from ranvier.flow.graph import Operation, Variable
from ranvier.jobs.peak import measured_peak
from ranvier.models import llama, moe
from ranvier.ops import TensorType, all_ops, op_def
from ranvier.ops.foreach import Member, members
from ranvier.runtime import Cell, Instance, Step
from ranvier.train.trainer import Trainer


class NumpyProtocolBackend:
    """Every op through its numpy reference, written against the protocol alone."""

    name = "numpy-protocol"
    step_time_dtype = np.float64

    def __init__(self, options: CompileOptions, decomposing: bool = False) -> None:
        self.options = options
        self.decomposing = decomposing
        self.capabilities = Capabilities(rewrites=True, epilogues=True, foreach=self._foreach_key, foreach_operands=12)

    @staticmethod
    def _foreach_key(op: Operation) -> Hashable | None:
        return op.type if op_def(op.type).family in ("elementwise", "state") else None

    def runs_whole(self, op: Operation) -> bool:
        return not (self.decomposing and op_def(op.type).decompositions)

    def choose(self, op: Operation) -> Step:
        return Step(op, "numpy", flops=op_def(op.type).cost(op))

    def workspace_bytes(self, step: Step) -> int:
        return 0

    def in_place(self, op: Operation, source: Variable, target: Variable) -> bool:
        return False

    def shares_storage(self, op: Operation) -> bool:
        return False

    def finish(self, cell: Cell) -> None:
        cell.native = [step.op for step in cell.steps]

    def code(self, cell: Cell, kind: str) -> str:
        raise RanvierError(f"the {self.name} backend generates no code")

    def bind(self, cell: Cell, instance: Instance) -> Callable[[], None]:
        def run() -> None:
            for index, step in enumerate(cell.steps):
                start = time.perf_counter()
                _run_reference(step.op, instance)
                instance.step_time[index] += time.perf_counter() - start

        return run

    def step_seconds(self, instance: Instance) -> np.ndarray:
        return instance.step_time

    def peak_gflops(self, matmul: str, product_seconds: Callable[[int], float]) -> tuple[float, str] | None:
        n = 64
        return 2 * n**3 / product_seconds(n) / 1e9, f"{matmul} GEMM on {self.name}"

    def all_cores_seconds(self, instance: Instance) -> np.ndarray:
        return instance.all_cores_time


def _run_reference(op: Operation, instance: Instance) -> None:
    """The op's reference on the instance's arrays: its outputs, then the inputs it writes."""
    definition = op_def(op.type)
    inputs = [instance.view(v) for v in op.inputs]
    targets = [instance.view(v) for v in op.outputs] + [inputs[i] for i in definition.written_inputs(op)]
    types = [TensorType(v.dtype, tuple(v.shape)) for v in op.outputs]
    with np.errstate(all="ignore"):
        results = definition.reference(definition.attrs_of(op), inputs, types)
    for target, result in zip(targets, results):
        np.copyto(target, np.asarray(result).reshape(target.shape), casting="unsafe")


def _decomposing(options: CompileOptions) -> Backend:
    return NumpyProtocolBackend(options, decomposing=True)


register_backend("numpy-protocol", NumpyProtocolBackend)
register_backend("numpy-protocol-decomposing", _decomposing)
BACKENDS = ["numpy-protocol", "numpy-protocol-decomposing"]

TINY_LLAMA = llama.LlamaConfig(dim=16, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=23, hidden_dim=24, max_seq_len=8)
TINY_MOE = moe.MoEConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=29, hidden_dim=24, max_seq_len=16,
                         n_experts=3, top_k=1, capacity_factor=0.6, normalize_top_k=False, aux_loss_weight=0.05)


def _trainer(kind: str, backend: str) -> Trainer:
    """A tiny Llama or MoE language model training with AdamW and clipping on 2 × 8 tokens."""
    model = llama.Llama(TINY_LLAMA, seed=1) if kind == "llama" else moe.MoE(TINY_MOE, seed=1)
    trainer: Trainer = language_model_trainer(model, backend, 2, 8, 1e-2)
    return trainer


STATES = ("assigned", "sliced", "scattered")  # globals the flow below writes in place


def _every_other_family() -> tuple[rv.Flow, dict[str, np.ndarray]]:
    """One flow of what the models leave out: convolution and pooling with their gradients,
    pads and strided views, lookups, a KV-cached decode step's attention, sampling, sorts
    of shape ops, reductions to indices, and in-place assignments."""
    rng = np.random.default_rng(5)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    values: dict[str, np.ndarray] = {}

    def var(name: str, shape: list[int], dtype: str = "float32") -> rv.Tensor:
        values[f"f/{name}"] = rng.standard_normal(shape).astype(dtype)
        return f.var(name, dtype, shape)

    def constant(name: str, value: np.ndarray) -> rv.Tensor:
        return f.parameter(name, np.asarray(value))

    image, filters = var("image", [2, 3, 6, 6]), f.array("filters", rng.standard_normal([4, 3, 3, 3]).astype(np.float32))
    pooled = f.max_pool(f.relu(f.conv2d(image, filters, padding=1)), 2)
    padded = f.op("Pad", [pooled], None, {"before": [0, 0, 1, 0], "after": [0, 1, 0, 2], "value": 0.5})
    viewed = f.strided_view(padded, offset=1, shape=[2, 3], strides=[5, 2])
    scattered = f.strided_scatter_add(viewed, offset=2, shape=[2, 3], strides=[4, 1], target_shape=[3, 4])
    table, ids = var("table", [7, 5]), constant("ids", np.array([3, 0, 6, 3], np.int32))
    looked = [f.gather(table, ids), f.one_hot(ids, 7), f.scatter_add(ids, var("rows", [4, 5]), 7),
              f.op("GatherSum", [table, constant("bags", np.array([[1, 2], [6, 6]], np.int32))], None)]
    queries, position = var("q", [1, 2, 1, 4]), constant("position", np.array(2, np.int32))
    caches = [f.parameter(f"{part}_cache", rng.standard_normal([1, 1, 5, 4]).astype(np.float32)) for part in "kv"]
    attended = f.op("CachedAttention", [queries, var("k", [1, 1, 1, 4]), var("v", [1, 1, 1, 4]), *caches, position], None)
    logits = var("logits", [3, 7])
    settings = [constant(name, np.asarray(value, np.float32)) for name, value in
                (("uniform", [0.1, 0.5, 0.9]), ("temperature", 1.0), ("top_p", 0.9))]
    token = f.op("SampleToken", [logits, settings[0], settings[1], constant("top_k", np.array(3, np.int32)), settings[2]], None)
    halves = f.split(f.concat([logits, logits.exp()], axis=1), 2, axis=1)
    shaped = [halves[1], f.transpose(logits).reshape([1, 21]), f.argmax(logits, axis=1), f.max(logits, axis=0)]
    states = {name: f.parameter(name, rng.standard_normal([3, 7]).astype(np.float32)) for name in STATES}
    f.assign(states["assigned"], states["assigned"] + logits.softmax())
    f.op("AssignSlice", [states["sliced"], var("slice", [1, 7]), constant("row", np.array(2, np.int32))], None, {"axis": 0})
    f.op("AssignAddScatter", [states["scattered"], constant("scattered_rows", np.array([0, 2, 0], np.int32)), logits], None)
    (image_gradient,) = gradient(flow, "f", [image], loss=pooled.sum()).values()
    for out in [image_gradient, padded, scattered, *looked, attended, *token, *shaped]:
        out.var.out = True
    return flow, values


def _outputs(flow: rv.Flow, values: dict[str, np.ndarray], backend: str) -> dict[str, np.ndarray]:
    """Every output of `f` (and the state it assigns), computed once from `values`; the
    outputs are NaN before the compute, so one left unwritten shows."""
    cell = rv.Compiler(backend).compile(flow).cell("f")
    data = cell.instance()
    for name, value in values.items():
        data[name] = value
    outputs = [v for v in flow.vars.values() if v.out]
    for var in outputs:
        if var.dtype.startswith("float"):
            data[var] = np.nan
    data.compute()
    results = {var.name: np.array(data[var]) for var in outputs}
    results.update({name: np.array(cell.network[f"f/{name}"]) for name in STATES})
    return results


def _families(cells: list[Cell]) -> set[str]:
    """The op families the cells' steps compute, ForEach members' included."""
    ops: list[Operation | Member] = [step.op for cell in cells for step in cell.steps]
    ops += [member for op in ops if op.type == "ForEach" for member in members(op)]
    return {op_def(op.type).family for op in ops}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_a_language_models_training_steps_match_the_reference(kind: str, backend: str) -> None:
    """Three AdamW steps with clipping: the losses, then every parameter."""
    ours, reference = _trainer(kind, backend), _trainer(kind, "reference")
    rng = np.random.default_rng(7)
    vocabulary = (TINY_LLAMA if kind == "llama" else TINY_MOE).vocab_size
    for _ in range(3):
        batch = [rng.integers(0, vocabulary, (2, 8)).astype(np.int32) for _ in range(2)]
        assert ours.step(batch) == pytest.approx(reference.step(batch), rel=1e-5)
    for name, value in reference.network.parameters().items():
        np.testing.assert_allclose(ours.network[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_other_family_matches_the_reference(backend: str) -> None:
    flow, values = _every_other_family()
    ours, theirs = _outputs(flow, values, backend), _outputs(flow, values, "reference")
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cases_compute_every_op_family(backend: str) -> None:
    """A family no case above reaches (a new one) is untested on a backend of the protocol
    alone: the cases' cells, compiled for it, hold every family's ops."""
    cells = [cell for kind in ("llama", "moe") for cell in _trainer(kind, backend).network.cells.values()]
    cells.append(rv.Compiler(backend).compile(_every_other_family()[0]).cell("f"))
    # (ranvier's own ops: not those another test module defines in this process)
    wanted = {definition.family for definition in all_ops().values() if definition.infer.__module__.startswith("ranvier.")}
    assert _families(cells) == wanted


def test_the_protocol_declares_every_method_the_compiler_and_runtime_call() -> None:
    """What the backend above implements is the protocol: no more, no less."""
    declared = {name for name in vars(Backend) if not name.startswith("_")} | set(Backend.__annotations__)
    implemented = {name for name in vars(NumpyProtocolBackend) if not name.startswith("_")} | {"capabilities"}
    assert declared == implemented


def test_a_run_on_the_backend_times_its_steps_and_its_peak() -> None:
    """The profile and the dashboard's peak come through the protocol too."""
    flow, values = _every_other_family()
    data = rv.Compiler("numpy-protocol").compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    assert all(step.seconds > 0 for step in data.profile().steps)
    gflops, what = measured_peak("numpy-protocol")
    assert gflops > 0 and what == "float32 GEMM on numpy-protocol"
