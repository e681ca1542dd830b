"""Model files from the command line: convert between formats, run one on inputs from .npy
files, and time it against ONNX Runtime (`ranvier convert | run | bench`).

A model file is a Myelin `.flow` or an `.onnx` model; its graph becomes one compiled
cell whose inputs are the function's variables without data.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from . import dtypes
from .compiler import Compiler
from .errors import RanvierError, shape_str
from .flow.graph import Flow, Function, Variable
from .limits import check_allocation
from .runtime import Instance


def parse_dims(text: str | None) -> dict[str, int]:
    """"batch=1,seq=128" → {"batch": 1, "seq": 128}."""
    dims: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, _, size = item.partition("=")
        if not size.strip().isdigit():
            raise RanvierError(f"--dims entry {item!r} is not NAME=SIZE (e.g. batch=1,seq=128)")
        dims[name.strip()] = int(size)
    return dims


def load_model(path: str | os.PathLike, dims: Mapping[str, int] | None = None) -> Flow:
    """A .flow or .onnx file as a flow. For a .flow file, dims' `batch` binds its −1 dimensions."""
    path = Path(path)
    if not path.exists():
        raise RanvierError(f"no model file {path}")
    if path.suffix == ".onnx":
        from .onnx import load

        return load(path, dims=dims)
    if path.suffix == ".flow":
        unknown = set(dims or {}) - {"batch"}
        if unknown:
            raise RanvierError(f"a .flow file has one symbolic size, batch; got --dims {sorted(unknown)}")
        return Flow().load(path, batch_size=(dims or {}).get("batch"))
    raise RanvierError(f"{path} is neither a .flow nor an .onnx model")


def convert(source: str | os.PathLike, target: str | os.PathLike, dims: Mapping[str, int] | None = None) -> Flow:
    """Read `source` and write it as `target` (.flow, or .onnx), atomically."""
    flow = load_model(source, dims)
    suffix = Path(target).suffix
    if suffix == ".flow":
        flow.save(target)
    elif suffix == ".onnx":
        from .onnx import save

        save(flow, target)
    else:
        raise RanvierError(f"cannot write {target}: the formats are .flow and .onnx")
    return flow


def only_function(flow: Flow) -> Function:
    if len(flow.funcs) != 1:
        raise RanvierError(f"the model has {len(flow.funcs)} functions ({', '.join(flow.funcs)}); these commands run models of one")
    return next(iter(flow.funcs.values()))


def model_inputs(flow: Flow) -> list[Variable]:
    """What the function reads, and the model's declared inputs it reads only for their
    shapes (folded away at load; a user, or ONNX Runtime, still passes them)."""
    read = flow.inputs(only_function(flow), const=False)
    declared = [v for v in flow.vars.values() if v.in_ and v.data is None and v.producer is None and v not in read]
    return read + declared


def _name(var: Variable) -> str:
    """The name a user knows a variable by: its ONNX name (an alias) when it has one."""
    return var.aliases[0] if var.aliases else var.name


def read_inputs(flow: Flow, specs: Sequence[str]) -> dict[str, np.ndarray]:
    """NAME=FILE.npy pairs, checked against the model's inputs (every one given, shapes that fit)."""
    wanted = {_name(v): v for v in model_inputs(flow)}
    given: dict[str, np.ndarray] = {}
    for spec in specs:
        name, _, file = spec.partition("=")
        if not file:
            raise RanvierError(f"--input {spec!r} is not NAME=FILE.npy")
        if name not in wanted:
            raise RanvierError(f"the model has no input {name!r}; its inputs: {describe(wanted.values())}")
        try:
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise RanvierError(f"cannot read input {name} from {file}: {error}") from None
        var = wanted[name]
        if array.dtype.kind not in "biuf":  # booleans and real numbers: not records, strings, dates or complex
            raise RanvierError(f"input {name} from {file} holds elements of dtype {array.dtype}, expected real numbers "
                               f"(or booleans) for a {var.dtype} input")
        if list(array.shape) != var.shape:
            raise RanvierError(f"input {name} from {file} has shape [{shape_str(array.shape)}], expected [{shape_str(var.shape)}]")
        if not converts_exactly(array, dtypes.to_numpy(var.dtype)):
            raise RanvierError(f"input {name} from {file} is {array.dtype}, which the model's {var.dtype} input cannot hold "
                               "(floats are not truncated into integers, and integers must be in its range)")
        given[name] = array
    missing = [n for n in wanted if n not in given]
    if missing:
        raise RanvierError(f"no --input for {', '.join(missing)}; the model's inputs: {describe(wanted.values())}")
    return given


def converts_exactly(array: np.ndarray, dtype) -> bool:
    """Whether `array` becomes a `dtype` input as a user means it: of the same kind or a
    wider one (float64 rounded to float32, integers to floats), integers in the type's range."""
    if not np.can_cast(array.dtype, dtype, casting="same_kind"):
        return False
    if np.dtype(dtype).kind in "iu" and array.size:
        limits = np.iinfo(dtype)
        return bool(limits.min <= array.min() and array.max() <= limits.max)
    return True


def random_inputs(flow: Flow, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs to time a model with: normal floats; integers 0 or 1 (valid token ids and masks)."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for var in model_inputs(flow):
        check_allocation(var.nbytes, f"input {_name(var)}: {var.typestr()}")
        if dtypes.is_float(var.dtype):
            inputs[_name(var)] = rng.standard_normal(var.shape).astype(dtypes.to_numpy(var.dtype))
        else:
            inputs[_name(var)] = rng.integers(0, 2, var.shape).astype(dtypes.to_numpy(var.dtype))
    return inputs


def describe(variables) -> str:
    return ", ".join(f"{_name(v)}: {v.typestr()}" for v in variables)


def instance(flow: Flow, backend: str = "cpu", cpu: str = "", matmul: str = "float32") -> Instance:
    network = Compiler(backend=backend, cpu=cpu, matmul=matmul).compile(flow)
    return network.cell(only_function(flow).name).instance()


def feed(data: Instance, inputs: Mapping[str, np.ndarray]) -> None:
    """Set the inputs the cell reads; an input the model uses only for its shape (folded
    away at load) has nothing to set."""
    for name, array in inputs.items():
        if name in data.cell:
            data[name] = array


def run(flow: Flow, inputs: Mapping[str, np.ndarray], backend: str = "cpu", cpu: str = "",
        matmul: str = "float32") -> tuple[Instance, dict[str, np.ndarray]]:
    """Compute the model once; its outputs by name."""
    data = instance(flow, backend, cpu, matmul)
    feed(data, inputs)
    data.compute()
    outputs = flow.outputs(only_function(flow))
    return data, {_name(v): np.array(data[v]) for v in outputs}


def bench(path: str | os.PathLike, flow: Flow, repeats: int = 10, cpu: str = "", matmul: str = "float32") -> dict[str, float]:
    """Median seconds per inference of ranvier (its products in `matmul`) and of ONNX Runtime
    (float32, default session, all graph optimizations) on the same random inputs,
    alternating; needs onnxruntime."""
    try:
        import onnxruntime
    except ImportError:
        raise RanvierError("ranvier bench compares with ONNX Runtime: pip install onnxruntime") from None
    inputs = random_inputs(flow)
    data = instance(flow, cpu=cpu, matmul=matmul)
    feed(data, inputs)
    session = onnxruntime.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name] for i in session.get_inputs()}
    return race({"ranvier": data.compute, "onnxruntime": lambda: session.run(None, feeds)}, repeats)


SETTLE = 0.2  # seconds


def race(sides: dict[str, Callable[[], object]], repeats: int, settle: float = SETTLE) -> dict[str, float]:
    """Median seconds per call of each side, after one warm-up call each (first touch of
    weights, thread pools), alternating so both see the same machine. A pause before each
    call lets the other side's threads go idle: ONNX Runtime's spin for a while after a
    run, and would otherwise take the cores from ranvier's next call. Each round calls the
    sides in an order of its own (shuffled, the same every race), so no side always follows
    the same one: a call finds the cores as the call before left them, and on a shared
    2-core VM a ranvier side right after another ranvier side ran 1.25-1.4 times as long as
    the same code right after OpenVINO (ResNet-18 bf16 at batch 1, two instances of one
    compiled cell, 30 rounds in each order), where the race's fixed order put ranvier-bf16
    after ranvier's float32 side every time."""
    for side in sides.values():
        side()
    times: dict[str, list[float]] = {name: [] for name in sides}
    order, shuffle = list(sides), random.Random(0).shuffle
    for _ in range(repeats):
        for name in order:
            side = sides[name]
            time.sleep(settle)
            start = time.perf_counter()
            side()
            times[name].append(time.perf_counter() - start)
        shuffle(order)
    return {name: statistics.median(values) for name, values in times.items()}


def comparison(side: str, ours: float, peer: str, theirs: float, higher_is_better: bool) -> str:
    """"ranvier is 2.30× faster than pytorch" (or "slower"): two medians' ratio, at least 1,
    with its direction in words."""
    speedup = ours / theirs if higher_is_better else theirs / ours
    if speedup >= 1:
        return f"{side} is {speedup:.2f}× faster than {peer}"
    return f"{side} is {1 / speedup:.2f}× slower than {peer}"
