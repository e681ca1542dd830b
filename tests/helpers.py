"""Shared machinery for the op tests.

`run_flow` builds a one-function flow with `ranvier.Builder`, compiles it for each
backend in `BACKENDS` (RANVIER_TEST_BACKENDS, default "reference,cpu"), feeds the inputs
through an Instance, fills every output with a sentinel before `compute()` (twice,
with two different sentinels, so an element the kernel never writes cannot pass by
luck), checks each backend's outputs against the reference backend's and returns the
reference's. `check` compares an
output against an expectation computed independently in the test, with a
tolerance that suits the output dtype; `assert_within_bound` within an error bound that
scales with the magnitudes of the computation's terms, and `cell_against_pytorch` a compiled
cell's output so against a float64 PyTorch function. `run_gpu_kernels_on_host` runs an op's CUDA
kernels compiled for this CPU (the code the GPU gets, its threads one after another).
`shape_error` returns the message of a build that must fail, and `language_model_trainer`
builds the Llama or MoE training step several backends' tests train.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import ranvier
from ranvier import dtypes

FLOATS = dtypes.FLOAT_DTYPES
INTS = dtypes.INT_DTYPES
SIGNED_INTS = ("int8", "int16", "int32", "int64")
UNSIGNED_INTS = ("uint8", "uint16", "uint32", "uint64")
NUMERIC = dtypes.NUMERIC_DTYPES
ALL = dtypes.ALL_DTYPES
LOW_PRECISION = ("float16", "bfloat16")

# (rtol, atol) by output dtype. The reference backend computes half precision in
# float32 (or wider) and rounds once, so these bound one rounding plus slack.
TOLERANCES = {
    "float64": (1e-10, 1e-12),
    "float32": (2e-5, 2e-6),
    "float16": (3e-3, 2e-3),
    "bfloat16": (2e-2, 1e-2),
}

# Every op test runs on each of these backends; the reference is the oracle the others must match.
BACKENDS = tuple(os.environ.get("RANVIER_TEST_BACKENDS", "reference,cpu").split(","))

# Two distinct "never computed" fillers per dtype kind.
_INT_SENTINELS = (-0x5A5A5A5A5A5A5A5B, 0x3C3C3C3C3C3C3C3D)


def np_dtype(dtype: str) -> np.dtype:
    return dtypes.to_numpy(dtype)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _sentinel(dtype: str, which: int):
    if dtypes.is_float(dtype):
        return np.nan if which == 0 else 1234.5
    if dtype == "bool":
        return None  # filled through the raw bytes instead
    info = np.iinfo(np_dtype(dtype))
    span = int(info.max) - int(info.min) + 1
    return (_INT_SENTINELS[which] - int(info.min)) % span + int(info.min)


def _fill(view: np.ndarray, dtype: str, which: int) -> None:
    if dtype == "bool":
        # 0xA5 is not a valid bool byte: an unwritten element shows up in the raw bytes.
        view.view(np.uint8)[...] = 0xA5 if which == 0 else 0x5A
    else:
        view[...] = _sentinel(dtype, which)


def random_array(shape, dtype: str, seed: int = 0, low=-3.0, high=3.0, nonzero=True) -> np.ndarray:
    """Random values of a dtype; integers are drawn from [low, high] (clipped to the dtype)."""
    g = rng(seed)
    shape = tuple(shape)
    if dtype == "bool":
        a = g.random(shape) < 0.5
        # Make sure both values occur when there is room for them.
        if a.size >= 2:
            flat = a.reshape(-1)
            flat[0], flat[-1] = True, False
        return a
    if dtypes.is_float(dtype):
        a = g.uniform(low, high, shape)
        if nonzero:
            a = np.where(np.abs(a) < 1e-3, 0.5, a)
        return a.astype(np_dtype(dtype))
    info = np.iinfo(np_dtype(dtype))
    lo, hi = max(math.floor(low), int(info.min)), min(math.ceil(high), int(info.max))
    a = g.integers(lo, hi + 1, shape, dtype=np.int64)
    if nonzero:
        a = np.where(a == 0, 1 if hi >= 1 else -1, a)
    return a.astype(np_dtype(dtype))


def as_f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


class Result(list):
    """The outputs of a run, plus the flow and the output tensors for inspection."""

    flow: ranvier.Flow
    tensors: list


def run_flow(
    build: Callable,
    inputs: Sequence[np.ndarray] = (),
    *,
    names: Sequence[str] | None = None,
) -> Result:
    """Build `build(f, *input_tensors)` in function "f", compute it, and return its outputs.

    `inputs` are fed as IN variables through `data[x][...] = value`. `build` returns
    a Tensor or a tuple/list of Tensors. Every output is filled with a sentinel
    before computing; the cell is computed twice with two different sentinels and
    both runs must agree bit for bit, so every output element was written.
    """
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    arrays = [np.asarray(a) for a in inputs]
    names = list(names) if names is not None else [f"x{i}" for i in range(len(arrays))]
    handles = [f.var(n, dtypes.from_numpy(a.dtype), a.shape) for n, a in zip(names, arrays)]
    built = build(f, *handles)
    outputs = list(built) if isinstance(built, (tuple, list)) else [built]
    for t in outputs:
        t.var.out = True
    results = {backend: _run_on(backend, flow, handles, arrays, outputs) for backend in BACKENDS}
    runs = [results["reference"]]
    for backend, values in results.items():
        for t, got, want in zip(outputs, values, results["reference"]):
            agree(got, want, t.dtype, f"{t.name} on the {backend} backend")
    result = Result(runs[0])
    result.flow = flow
    result.tensors = outputs
    return result


def _run_on(backend: str, flow, handles, arrays, outputs) -> list[np.ndarray]:
    """Compile for one backend and compute twice with different sentinels in the outputs."""
    network = ranvier.Compiler(backend).compile(flow)
    instance = network.cell("f").instance()
    runs = []
    for which in (0, 1):
        for t in outputs:
            sentinel = instance[t]
            _fill(sentinel, t.dtype, which)
            instance[t] = sentinel  # set through the instance: a device's copy holds it too
        for h, a in zip(handles, arrays):
            if h.var.consumers:
                instance[h][...] = a
        instance.compute()
        runs.append([instance[t].copy() for t in outputs])
    for t, first, second in zip(outputs, *runs):
        assert first.dtype == np_dtype(t.dtype), f"{t.name}: view dtype {first.dtype}, expected {t.dtype}"
        assert list(first.shape) == t.shape
        if t.dtype == "bool":
            raw = np.frombuffer(first.tobytes(), np.uint8)
            assert np.isin(raw, (0, 1)).all(), f"{t.name} on {backend}: some bool elements were not written"
        what = f"{t.name} on {backend}: output depends on the sentinel, so some elements were not written"
        if dtypes.is_float(t.dtype) and _adds_in_any_order(backend, network):
            # atomic adds land in the threads' order, which varies in the last bits; an
            # unwritten element still shows as NaN in one run and 1234.5 in the other
            agree(first, second, t.dtype, what)
        else:
            assert first.tobytes() == second.tobytes(), f"{what}: {first} vs {second}"
    return runs[0]


def _adds_in_any_order(backend: str, network) -> bool:
    """Whether a step of the cell adds with atomics on a GPU (the CUDA backend's scatters)."""
    from ranvier.backends.cuda import scatters

    return backend == "cuda" and any(scatters.supports(step.op) for step in network.cell("f").steps)


def agree(actual: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    """A backend's output against the reference backend's, within the dtype's tolerance."""
    if dtypes.is_float(dtype):
        r, a = TOLERANCES[dtype]
        # a sum of many terms rounds in proportion to its terms, not to its value: where
        # they cancel, the absolute error follows the output's scale (its largest element)
        finite = np.abs(as_f64(expected)[np.isfinite(as_f64(expected))])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        np.testing.assert_allclose(as_f64(actual), as_f64(expected), rtol=4 * r, atol=4 * a * scale, equal_nan=True,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def fused_outputs_on_reference_and_cpu(build: Callable, values: dict[str, np.ndarray], mask: str,
                                       cpu_steps: list[tuple[str, str]]) -> dict[str, list[np.ndarray]]:
    """`build(f, *variables)` (the output Tensors) over variables holding `values`, compiled
    for the reference backend and for the CPU under the feature `mask`, whose steps
    ((kernel, op type) each) must be `cpu_steps`; every output filled with NaN first. Each
    backend's outputs, in float64."""
    outputs = {}
    for backend in ("reference", "cpu"):
        flow = ranvier.Flow()
        f = ranvier.Builder(flow, "f")
        handles = [f.var(name, str(value.dtype), value.shape) for name, value in values.items()]
        results = build(f, *handles)
        for t in results:
            t.var.out = True
        cell = ranvier.Compiler(backend, cpu=mask if backend == "cpu" else "", cache=False).compile(flow).cell("f")
        if backend == "cpu":
            assert [(step.kernel, step.op.type) for step in cell.steps] == cpu_steps
        data = cell.instance()
        for handle, value in zip(handles, values.values()):
            data[handle] = value
        for t in results:
            data[t] = np.full(t.shape, np.nan, np.asarray(data[t]).dtype)
        data.compute()
        outputs[backend] = [np.array(data[t]).astype(np.float64) for t in results]
    return outputs


def cpu_steps_against_reference(build: Callable, shape: Sequence[int], *, matmul: str = "float32", training: bool = False,
                                seed: int = 3, tolerance: float = 1e-5) -> list:
    """`build(f, x)` (a list of output Tensors) on a random float32 x of `shape`, compiled for
    the CPU with its products in `matmul` (and `training` set on the function) and for the
    reference backend, every output filled with NaN first: the CPU's outputs within
    `tolerance` (2e-2 with bf16 products) of the reference's, relative and of its largest
    element; returns the CPU cell's steps (what the passes left)."""
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    f.func.training = training
    x = f.var("x", "float32", list(shape))
    outputs = build(f, x)
    for y in outputs:
        y.var.out = True
    value = random_array(list(shape), "float32", seed=seed)
    results = []
    for backend in ("cpu", "reference"):
        options = {"matmul": matmul} if backend == "cpu" else {}
        cell = ranvier.Compiler(backend, cache=False, **options).compile(flow).cell("f")
        data = cell.instance()
        data[x] = value
        for y in outputs:
            data[y] = np.full(y.shape, np.nan, np.float32)
        data.compute()
        results.append(([np.array(data[y]) for y in outputs], cell))
    (got, cell), (want, _) = results
    bound = 2e-2 if matmul == "bfloat16" else tolerance
    for g, w in zip(got, want):
        assert not np.isnan(g).any(), "an output element was not written"
        np.testing.assert_allclose(g, w, rtol=bound, atol=bound * float(np.abs(w).max()))
    return list(cell.steps)


def run1(build: Callable, *inputs: np.ndarray) -> np.ndarray:
    """run_flow for a single output."""
    (out,) = run_flow(build, inputs)
    return out


def check(actual: np.ndarray, expected, dtype: str | None = None, rtol=None, atol=None) -> None:
    """Compare an op output with an independently computed expectation.

    `dtype` is the ranvier dtype the output must have (default: the actual array's).
    Floats are compared with the dtype's tolerance (NaNs must match); integers and
    bools exactly.
    """
    actual = np.asarray(actual)
    dtype = dtype or dtypes.from_numpy(actual.dtype)
    assert actual.dtype == np_dtype(dtype), f"output dtype {actual.dtype}, expected {dtype}"
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"output shape {actual.shape}, expected {expected.shape}"
    if dtypes.is_float(dtype):
        r, a = TOLERANCES[dtype]
        np.testing.assert_allclose(
            as_f64(actual), as_f64(expected), rtol=rtol if rtol is not None else r,
            atol=atol if atol is not None else a, equal_nan=True,
        )
    else:
        np.testing.assert_array_equal(actual, expected.astype(np_dtype(dtype)))


def assert_within_bound(got, want, bound, tol: float = 1.0, *, slack: float = 1e-30, what: str = "") -> None:
    """|got - want| <= tol * bound + slack, element by element: `bound` the magnitudes the
    error scales with (|a| @ |b| for a product a @ b, whose float32 sums round in proportion
    to their terms), `slack` an absolute floor for elements whose bound is 0. A NaN fails.
    The message names how many elements are out and the worst of them (by its error over
    what was allowed): its index, value, expectation and bound."""
    prefix = f"{what}: " if what else ""
    got, want = as_f64(got), as_f64(want)
    assert got.shape == want.shape, f"{prefix}shape {got.shape}, expected {want.shape}"
    bound = np.broadcast_to(as_f64(bound), got.shape)
    error = np.abs(got - want)
    allowed = tol * bound + slack
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(error <= allowed, 0.0, error / allowed)
    excess[np.isnan(excess)] = np.inf  # a NaN (in got, want or the bound) fails as the worst
    if not excess.any():
        return
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    raise AssertionError(
        f"{prefix}{np.count_nonzero(excess)} of {excess.size} elements off by more than "
        f"{tol:g} x bound + {slack:g}; the worst at {tuple(int(i) for i in worst)}: got {float(got[worst])!r}, "
        f"expected {float(want[worst])!r}, error {error[worst]:.3g}, bound {bound[worst]:.3g} "
        f"({excess[worst]:.3g} times the {allowed[worst]:.3g} allowed)")


def cell_against_pytorch(cell: Any, y: Any, values: dict[str, np.ndarray], function: Callable[..., Any], *,
                         constants: Sequence[str] = (), bf16: Sequence[str] = (), tol: float = 1e-5) -> None:
    """Compute `cell` with each of `values` in its variable f/<name> (but those named in
    `constants`, which the cell holds as constants) and `y` filled with NaN first: every
    element written and within `tol` of `function`'s bound, against `function` of the
    values (as keywords) as float64 torch tensors, those named in `bf16` rounded to bf16
    first; the bound is `function` of their magnitudes (the sum of its terms' magnitudes for
    a convolution, and for what follows it that keeps a sum of positive terms as large)."""
    import ml_dtypes
    import torch

    data = cell.instance()
    for name, value in values.items():
        if name not in constants:
            data[f"f/{name}"] = value
    data[y] = np.full(y.shape, np.nan, np.float32)
    data.compute()
    rounded = {name: value.astype(ml_dtypes.bfloat16) if name in bf16 else value for name, value in values.items()}
    tensors = {name: torch.tensor(value.astype(np.float64)) for name, value in rounded.items()}
    want = function(**tensors).numpy()
    bound = function(**{name: t.abs() for name, t in tensors.items()}).numpy()
    got = np.array(data[y])
    assert np.isfinite(got).all(), "every output element written"
    assert_within_bound(got, want, bound, tol, what=y.name)


def shape_error(build: Callable, inputs: Sequence[tuple[str, str, Sequence[int]]] = ()) -> str:
    """Build a flow expected to fail; returns the ShapeError's message.

    `inputs` are (name, dtype, shape) triples made into IN variables."""
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    handles = [f.var(n, d, s) for n, d, s in inputs]
    with pytest.raises(ranvier.ShapeError) as info:
        build(f, *handles)
    return str(info.value)


def language_model_trainer(model: Any, backend: str, batch: int, seq: int, lr: float, **options: Any) -> Any:
    """`model` (a Llama, or a MoE with its load-balancing loss) training with AdamW and
    clipping on batch × seq tokens (inputs "tokens" and "targets"), compiled for `backend`
    with the Trainer's further `options`."""
    from ranvier.models.moe import MoE
    from ranvier.train.losses import softmax_cross_entropy
    from ranvier.train.optimizers import AdamW
    from ranvier.train.trainer import Trainer

    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "train")
    f.func.training = True
    tokens, targets = f.var("tokens", "int32", [batch, seq]), f.var("targets", "int32", [batch, seq])
    params = model.parameters(f)
    logits = model(f, tokens, params).reshape([batch * seq, model.config.vocab_size])
    loss = softmax_cross_entropy(logits, targets.reshape([batch * seq]))
    if isinstance(model, MoE):
        loss = loss + model.auxiliary_loss(f)
    return Trainer(loss, list(params.values()), AdamW(lr=lr), clip_norm=1.0, inputs=[tokens, targets], backend=backend,
                   **options)


def assert_mentions(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in error message: {message}"


__all__ = [
    "ALL",
    "FLOATS",
    "INTS",
    "LOW_PRECISION",
    "NUMERIC",
    "SIGNED_INTS",
    "UNSIGNED_INTS",
    "Result",
    "as_f64",
    "assert_mentions",
    "assert_within_bound",
    "cell_against_pytorch",
    "check",
    "language_model_trainer",
    "np_dtype",
    "random_array",
    "rng",
    "run1",
    "run_flow",
    "shape_error",
]


def run_gpu_kernels_on_host(op, values: dict[str, np.ndarray], fill: int = 0x5A) -> dict[str, np.ndarray]:
    """The op's GPU kernels' arithmetic compiled for this CPU and run over every launch
    element: each operand's final contents (those not in `values` start as the byte
    `fill` repeated: 0x5A, a pattern no element keeps, or 0xFF, NaN in every float type),
    and the kernels' status word ("status")."""
    import ctypes

    from ranvier.backends.cpu import jit
    from ranvier.backends.cpu.target import host_target
    from ranvier.backends.cuda import kernels

    target = host_target()
    module, launches = kernels.host_module(op, target.machine.triple, str(target.machine.target_data), target.feature_set)
    code = jit.load_object(jit.compile_object(module, target), target, launches[0].name)
    operands = launches[0].operands
    arrays = {}
    for var in operands:
        if var.name in values:
            arrays[var.name] = np.ascontiguousarray(values[var.name]).astype(np_dtype(var.dtype)).copy()
        else:
            pattern = np.full(int(np.prod(var.shape)) * np_dtype(var.dtype).itemsize, fill, np.uint8)
            arrays[var.name] = pattern.view(np_dtype(var.dtype)).reshape(var.shape)
    status = np.zeros(1, np.int64)
    for kernel in launches:
        function = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * (len(operands) + 1), ctypes.c_int64, ctypes.c_int64)(
            code.address_of(kernel.name))
        function(*[arrays[v.name].ctypes.data for v in operands], status.ctypes.data, 0, kernel.elements)
    arrays["status"] = status
    return arrays


def attention_with_gradient(f, q, k, v, dout, bias=None, **attrs) -> list:
    """Attention with its statistics and the AttentionGrad that reads them, as the gradient
    rule builds them: [out, dq, dk, dv, statistics]."""
    out, statistics = f.attention(q, k, v, bias, statistics=True, **attrs)
    gradients = f.op("AttentionGrad", [q, k, v, out, statistics, dout, *([] if bias is None else [bias])], None, attrs)
    return [out, *gradients, statistics]
