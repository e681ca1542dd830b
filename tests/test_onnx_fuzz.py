"""The ONNX importer and `ranvier run`, fuzzed: small valid models (an MLP of Gemms, a CNN,
attention written out op by op, shape arithmetic, a lookup) mutated with seeded edits of
two kinds: blind ones on the serialized bytes (bit flips, bytes set, inserted, deleted,
the file cut short) and ones that know the protobuf (a dimension, an element type, a
tensor's raw_data cut or grown, an attribute changed, dropped or added, an edge turned
into a cycle, two nodes swapped, an edge or an operator replaced, another opset).

Each case is written to a file and goes through what `ranvier run` does (modelrun's
load_model, read_inputs and run, on random inputs the loaded model declares). It must
either load, run and give ONNX Runtime's outputs on the same inputs, or raise a
RanvierError: never another exception, a signal, a hang, or more than 2 GB (watched as
fuzzing.py says, with ranvier's memory limit set to 256 MB so that what a mutation asks
for past it is refused). Models ranvier runs and ONNX Runtime refuses as invalid fail the
test too; where ONNX Runtime has no kernel for a valid model, or crashes on it, ranvier's
outputs go unchecked.

The seeded run takes FUZZ_SECONDS per model (`RANVIER_FUZZ_SECONDS` sets a longer one,
`RANVIER_FUZZ_SEED` another seed); a failure names the model, the case's number and its edits.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fuzzing import within

pytest.importorskip("onnxruntime")  # the oracle, run in a process of its own (OnnxRuntime)
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ranvier import modelrun  # noqa: E402
from ranvier.errors import RanvierError  # noqa: E402
from ranvier.limits import ENVIRONMENT  # noqa: E402

SEED = int(os.environ.get("RANVIER_FUZZ_SEED", "53"))
FUZZ_SECONDS = float(os.environ.get("RANVIER_FUZZ_SECONDS", "2"))
MIN_CASES = 30  # however slow the machine
CASE_TIMEOUT_S = 60.0  # a compile of a mutated model included
CASE_MEMORY = 2 << 30
RANVIER_LIMIT_MB = 256
TOLERANCE = 1e-4  # of the largest magnitude: mutated attributes give sums over other axes, longer ones
RNG = np.random.default_rng(SEED)


# ---- the valid models ---------------------------------------------------------------------------


def weight(*shape: int, dtype=np.float32) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.5).astype(dtype)


def model(nodes, inputs: dict[str, tuple[int, list[int]]], outputs: list[str], initializers: dict[str, np.ndarray],
          opset: int = 17) -> onnx.ModelProto:
    """A checked model; its outputs typed by ONNX's shape inference."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
                              [helper.make_empty_tensor_value_info(n) for n in outputs],
                              [numpy_helper.from_array(v, n) for n, v in initializers.items()])
    inferred = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    types = {v.name: v for v in inferred.graph.value_info}
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    del proto.graph.output[:]
    proto.graph.output.extend(types[n] if n in types else inferred.graph.output[i] for i, n in enumerate(outputs))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def mlp() -> onnx.ModelProto:
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["z"], name="fc2", transB=1, alpha=0.5),
             helper.make_node("Softmax", ["z"], ["y"], axis=-1)]
    return model(nodes, {"x": (TensorProto.FLOAT, [2, 8])}, ["y"],
                 {"w1": weight(8, 12), "b1": weight(12), "w2": weight(4, 12), "b2": weight(1, 4)})


def cnn() -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"], axis=1),
             helper.make_node("MatMul", ["f", "fc"], ["m"]),
             helper.make_node("Add", ["m", "fb"], ["y"])]
    return model(nodes, {"x": (TensorProto.FLOAT, [1, 3, 8, 8])}, ["y"],
                 {"w": weight(4, 3, 3, 3), "b": weight(4), "fc": weight(64, 5), "fb": weight(5)})


def attention() -> onnx.ModelProto:
    """Scores of queries against keys, scaled, masked and softmaxed, times the values."""
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv"], ["v"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "mask"], ["sm"]), helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    mask = np.triu(np.full((5, 5), -1e9, np.float32), 1)
    return model(nodes, {"x": (TensorProto.FLOAT, [2, 5, 8])}, ["y"],
                 {"wq": weight(8, 8), "wk": weight(8, 8), "wv": weight(8, 8), "scale": np.float32(2.83), "mask": mask})


def shapes() -> onnx.ModelProto:
    """Shape arithmetic folded at load, as exporters write it, around a little computation."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"]),
             helper.make_node("ConstantOfShape", ["target_c"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.5])),
             helper.make_node("Range", ["start", "limit", "delta"], ["steps"]),
             helper.make_node("Cast", ["steps"], ["stepsf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["flat", "ones"], ["scaled"]),
             helper.make_node("Add", ["scaled", "stepsf"], ["shifted"]),
             helper.make_node("Expand", ["shifted", "wide"], ["e"]),
             helper.make_node("Slice", ["e", "starts", "ends", "slice_axes", "slice_steps"], ["sl"]),
             helper.make_node("ReduceSum", ["sl", "sum_axes"], ["y"], keepdims=0)]
    ints = {"zero": np.int64(0), "axes": np.int64([0]), "minus_one": np.int64([-1]), "target_c": np.int64([2, 12]),
            "start": np.int64(0), "limit": np.int64(12), "delta": np.int64(1), "wide": np.int64([3, 2, 12]),
            "starts": np.int64([0, 1]), "ends": np.int64([3, 12]), "slice_axes": np.int64([0, 2]),
            "slice_steps": np.int64([2, 3]), "sum_axes": np.int64([1])}
    return model(nodes, {"x": (TensorProto.FLOAT, [2, 3, 4])}, ["y"], ints)


def lookup() -> onnx.ModelProto:
    """Rows of a table by fed ids, normalized, gated by a comparison, and cast."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("LayerNormalization", ["rows", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Greater", ["n", "zero"], ["positive"]),
             helper.make_node("Where", ["positive", "n", "floor"], ["w"]),
             helper.make_node("Concat", ["w", "extra"], ["c"], axis=1),
             helper.make_node("Transpose", ["c"], ["t"], perm=[1, 0, 2]),
             helper.make_node("ArgMax", ["t"], ["y"], axis=2, keepdims=0)]
    return model(nodes, {"ids": (TensorProto.INT64, [2, 3])}, ["y", "w"],
                 {"table": weight(10, 6), "gamma": weight(6), "beta": weight(6), "zero": np.float32(0),
                  "floor": np.float32(-0.25), "extra": weight(2, 1, 6)})


MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    "mlp": mlp, "cnn": cnn, "attention": attention, "shapes": shapes, "lookup": lookup}


# ---- mutations ----------------------------------------------------------------------------------

INTERESTING = (0, 1, -1, 2, 3, 7, 255, 65536, 2**31 - 1, -(2**31), 2**31, 2**40, 2**63 - 1)
TYPES = [t for t in TensorProto.DataType.values() if t != TensorProto.UNDEFINED] + [0, 99]
OPERATORS = ["Relu", "Softmax", "Gemm", "MatMul", "Add", "Conv", "Reshape", "Gather", "Transpose", "Concat", "Slice",
             "Expand", "ReduceSum", "Cast", "Where", "Tile", "Identity", "Flatten", "Squeeze", "Unsqueeze", "Pad",
             "Shape", "ConstantOfShape", "Range", "MaxPool", "Sigmoid", "Neg", "Sum", "Not", "ArgMax", "Split"]
ATTRIBUTES = ["axis", "axes", "perm", "keepdims", "transA", "transB", "alpha", "beta", "kernel_shape", "pads", "strides",
              "to", "epsilon", "group", "dilations", "auto_pad", "value", "starts"]


def mutate_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if not data:
        return data, "nothing left to edit"
    data = bytearray(data)
    at = rng.randrange(len(data))
    kind = rng.randrange(5)
    if kind == 0:
        bit = rng.randrange(8)
        data[at] ^= 1 << bit
        return bytes(data), f"flip bit {bit} of byte {at}"
    if kind == 1:
        data[at] = rng.randrange(256)
        return bytes(data), f"set byte {at} to {data[at]}"
    if kind == 2:
        inserted = rng.randbytes(rng.randint(1, 4))
        data[at:at] = inserted
        return bytes(data), f"insert {inserted.hex()} at {at}"
    if kind == 3:
        count = rng.randint(1, 8)
        del data[at:at + count]
        return bytes(data), f"delete {count} at {at}"
    return bytes(data[:at]), f"cut at {at} of {len(data)}"


def interesting(rng: random.Random) -> int:
    return rng.choice(INTERESTING) if rng.random() < 0.7 else rng.randint(-3, 40)


def tensor_types(proto: onnx.ModelProto) -> list[onnx.TypeProto.Tensor]:
    return [v.type.tensor_type for v in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]]


def edit_dims(rng: random.Random, proto: onnx.ModelProto) -> str:
    """A dimension of an initializer or of a declared input or output."""
    if rng.random() < 0.5 and proto.graph.initializer:
        tensor = rng.choice(proto.graph.initializer)
        dims = list(tensor.dims)
        if dims and rng.random() < 0.8:
            dims[rng.randrange(len(dims))] = interesting(rng)
        else:
            dims.insert(rng.randint(0, len(dims)), rng.choice([1, 2, 0]))
        del tensor.dims[:]
        tensor.dims.extend(dims)
        return f"initializer {tensor.name!r} dims {dims}"
    declared = rng.choice(tensor_types(proto))
    if not declared.shape.dim:
        declared.shape.dim.add().dim_value = 1
        return "a declared scalar given a dimension"
    dim = rng.choice(declared.shape.dim)
    if rng.random() < 0.2:
        dim.dim_param = "n"
        return "a declared dimension made symbolic"
    dim.dim_value = max(interesting(rng), 0) % 2**62
    return f"a declared dimension set to {dim.dim_value}"


def edit_dtype(rng: random.Random, proto: onnx.ModelProto) -> str:
    element = rng.choice(TYPES)
    if rng.random() < 0.4 and proto.graph.initializer:
        tensor = rng.choice(proto.graph.initializer)
        tensor.data_type = element
        return f"initializer {tensor.name!r} data_type {element}"
    rng.choice(tensor_types(proto)).elem_type = element
    return f"a declared element type set to {element}"


def edit_raw_data(rng: random.Random, proto: onnx.ModelProto) -> str:
    tensor = rng.choice(proto.graph.initializer)
    raw = tensor.raw_data
    cut = rng.randrange(len(raw) + 1) if rng.random() < 0.5 else len(raw) + rng.choice([1, 4, 8, 100])
    tensor.raw_data = raw[:cut] + bytes(max(0, cut - len(raw)))
    return f"initializer {tensor.name!r} raw_data of {len(raw)} bytes made {cut}"


def edit_values(rng: random.Random, proto: onnx.ModelProto) -> str:
    """An element of an integer initializer (shapes, axes, indices) or a float one."""
    tensor = rng.choice(proto.graph.initializer)
    try:
        array = numpy_helper.to_array(tensor).copy()
    except (ValueError, TypeError, KeyError):  # an earlier edit made it unreadable
        return "an unreadable initializer left as it was"
    if not array.size or array.dtype.kind not in "iuf":
        return "an initializer left as it was"
    flat = array.reshape(-1)
    at = rng.randrange(flat.size)
    if array.dtype.kind in "iu":
        flat[at] = np.array(interesting(rng)).astype(array.dtype)
    else:
        # Moderate values: past float32's range ONNX leaves the arithmetic to the runtime (a
        # scale of 1e-40 made ONNX Runtime's fused scaled softmax finite where the ops give NaN).
        flat[at] = rng.choice([0.5, -2.0, 3.0, 100.0])
    tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    return f"initializer {tensor.name!r} element {at} set to {flat[at]}"


def edit_attribute(rng: random.Random, proto: onnx.ModelProto) -> str:
    node = rng.choice(proto.graph.node)
    if node.attribute and rng.random() < 0.7:
        attribute = rng.choice(node.attribute)
        kind = rng.randrange(3)
        if kind == 0:
            node.attribute.remove(attribute)
            return f"node {node.name or node.output[0]!r}: attribute {attribute.name} dropped"
        if kind == 1 and attribute.ints:
            at = rng.randrange(len(attribute.ints))
            attribute.ints[at] = interesting(rng)
            return f"node {node.name or node.output[0]!r}: {attribute.name}[{at}] = {attribute.ints[at]}"
        if attribute.type == onnx.AttributeProto.INT:
            attribute.i = interesting(rng)
            return f"node {node.name or node.output[0]!r}: {attribute.name} = {attribute.i}"
        if attribute.type == onnx.AttributeProto.FLOAT:
            attribute.f = rng.choice([0.0, -1.0, 2.5])
            return f"node {node.name or node.output[0]!r}: {attribute.name} = {attribute.f}"
    name = rng.choice(ATTRIBUTES)
    value = rng.choice([interesting(rng), [interesting(rng) for _ in range(rng.randint(1, 4))], 0.5, "SAME_UPPER"])
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute(name, value)])
    return f"node {node.name or node.output[0]!r}: attribute {name} = {value!r}"


def edit_edges(rng: random.Random, proto: onnx.ModelProto) -> str:
    """A cycle (an input read from the node's own or a later node's output), an input read
    from another value, or two nodes swapped."""
    nodes = proto.graph.node
    kind = rng.randrange(3)
    if kind == 2 and len(nodes) > 1:
        i, j = rng.sample(range(len(nodes)), 2)
        first, second = onnx.NodeProto(), onnx.NodeProto()
        first.CopyFrom(nodes[i])
        second.CopyFrom(nodes[j])
        nodes[i].CopyFrom(second)
        nodes[j].CopyFrom(first)
        return f"nodes {i} and {j} swapped"
    at = rng.randrange(len(nodes))
    node = nodes[at]
    if not node.input:
        return "a node without inputs left as it was"
    slot = rng.randrange(len(node.input))
    if kind == 0:
        source = rng.choice([o for n in nodes[at:] for o in n.output])
        node.input[slot] = source
        return f"node {at} input {slot} reads {source!r}, computed at or after it (a cycle)"
    names = [v.name for v in proto.graph.input] + [t.name for t in proto.graph.initializer] + [o for n in nodes for o in n.output]
    node.input[slot] = rng.choice([*names, "", "nowhere"])
    return f"node {at} input {slot} reads {node.input[slot]!r}"


def edit_operator(rng: random.Random, proto: onnx.ModelProto) -> str:
    if rng.random() < 0.25:
        version = rng.choice([1, 6, 9, 11, 13, 18, 21, 99])
        proto.opset_import[0].version = version
        return f"opset {version}"
    node = rng.choice(proto.graph.node)
    node.op_type = rng.choice(OPERATORS)
    return f"node {node.name or node.output[0]!r} made a {node.op_type}"


EDITS = [edit_dims, edit_dtype, edit_raw_data, edit_values, edit_attribute, edit_edges, edit_operator]


def mutated(rng: random.Random, base: onnx.ModelProto) -> tuple[bytes, list[str]]:
    """One to three edits: on the protobuf (two thirds of the time), or on its bytes."""
    if rng.random() < 1 / 3:
        data, edits = base.SerializeToString(), []
        for _ in range(rng.randint(1, 3)):
            data, edit = mutate_bytes(rng, data)
            edits.append(edit)
        return data, edits
    proto = onnx.ModelProto()
    proto.CopyFrom(base)
    edits = [rng.choice(EDITS)(rng, proto) for _ in range(rng.randint(1, 3))]
    return proto.SerializeToString(), edits


# ---- one case ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    refused: RanvierError | None = None
    outputs: dict[str, np.ndarray] | None = None
    feeds: dict[str, np.ndarray] | None = None


def run_like_the_command(path: Path, folder: Path, outcome: Outcome) -> None:
    """What `ranvier run MODEL --input NAME=FILE.npy ...` does, on random inputs of the
    types and shapes the loaded model declares."""
    flow = modelrun.load_model(path)
    outcome.feeds = modelrun.random_inputs(flow, seed=SEED)
    specs = []
    for index, (name, array) in enumerate(outcome.feeds.items()):
        np.save(folder / f"input{index}.npy", array)
        specs.append(f"{name}={folder / f'input{index}.npy'}")
    _, outcome.outputs = modelrun.run(flow, modelrun.read_inputs(flow, specs))


def _serve_onnx_runtime(connection) -> None:
    """ONNX Runtime's side: (model, feeds) in, its outputs or its error's text out."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # its warnings about old opsets it does not optimize: errors only
    while True:
        try:
            data, feeds = connection.recv()
        except EOFError:
            return
        try:
            connection.send(onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, feeds))
        except Exception as error:  # noqa: BLE001  (ONNX Runtime's errors share no base, and may not pickle)
            connection.send(str(error))


class OnnxRuntime:
    """ONNX Runtime in a process of its own, started again after a case that kills it: a
    session on a mutated model segfaulted there (seed 11), and the oracle's crash must not
    end the test. `run` gives its outputs, its error's text, or None where it crashed or hung."""

    def __init__(self):
        self.process = None

    def run(self, data: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | str | None:
        if self.process is None:
            context = multiprocessing.get_context("spawn")  # not a fork of this process's threads
            self.connection, child = context.Pipe()
            self.process = context.Process(target=_serve_onnx_runtime, args=(child,), daemon=True)
            self.process.start()
            child.close()
        try:
            self.connection.send((data, feeds))
            if self.connection.poll(CASE_TIMEOUT_S):
                return self.connection.recv()
        except (EOFError, OSError):  # it died
            pass
        self.close()
        return None

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.connection.close()
            self.process = None


@pytest.fixture(scope="module")
def onnx_runtime():
    runtime = OnnxRuntime()
    yield runtime
    runtime.close()


def compare(runtime: OnnxRuntime, data: bytes, outcome: Outcome, label: str) -> str:
    """ranvier's outputs against ONNX Runtime's: "matched", "no kernel" where ONNX Runtime
    has none for a valid model, "no oracle" where it crashed or hung; fails on a difference,
    or where ONNX Runtime finds the model invalid that ranvier ran."""
    expected = runtime.run(data, outcome.feeds)
    if expected is None:
        return "no oracle"
    if isinstance(expected, str):
        assert "NOT_IMPLEMENTED" in expected, f"{label}: ranvier ran a model ONNX Runtime refuses: {expected}"
        return "no kernel"
    proto = onnx.load_from_string(data)
    overflows = overflowing(proto) or not all(np.isfinite(e).all() for e in expected if e.dtype.kind == "f")
    for name, want in zip([o.name for o in proto.graph.output], expected):
        got = outcome.outputs[name]
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{label}: output {name} is {got.dtype}{list(got.shape)}, ONNX Runtime's {want.dtype}{list(want.shape)}"
        if want.dtype.kind == "f":
            finite = np.isfinite(want)
            if overflows:  # past float32's range the order of the sums decides inf, -inf or NaN: compare the rest
                finite &= np.isfinite(got)
            else:
                np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{label}: output {name}'s non-finite elements")
            scale = max(float(np.abs(want[finite]).max(initial=0)), 1e-30)
            error = float(np.abs(got[finite] - want[finite]).max(initial=0)) / scale
            assert error < TOLERANCE, f"{label}: output {name} differs from ONNX Runtime's by {error:.2e} of its largest"
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"{label}: output {name}")
    return "matched"


def overflowing(proto: onnx.ModelProto) -> bool:
    """Whether a float initializer holds a value whose products may pass float32's range
    (an edit of its bytes makes exponents of 2^100 and more)."""
    for tensor in proto.graph.initializer:
        try:
            array = numpy_helper.to_array(tensor)
        except (ValueError, TypeError, KeyError):
            continue
        with np.errstate(invalid="ignore"):  # NaN in a narrow float type
            if array.dtype.kind == "f" and array.size and not np.all(np.abs(array.astype(np.float64)) < 1e18):
                return True
    return False


def peak_resident() -> int:
    """The most memory the process has held, in bytes (Linux counts ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the test ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_mutated_models_run_as_onnx_runtime_does_or_are_refused(name, tmp_path, monkeypatch, watched, onnx_runtime,
                                                                  request):
    monkeypatch.setenv(ENVIRONMENT, str(RANVIER_LIMIT_MB))
    base = MODELS[name]()
    rng = random.Random(f"{SEED}-{name}")
    path = tmp_path / "model.onnx"
    counts = {"refused": 0, "matched": 0, "no kernel": 0, "no oracle": 0}
    unchecked = []
    cases = 0
    resident = peak_resident()
    start = time.perf_counter()
    while cases < MIN_CASES or time.perf_counter() - start < FUZZ_SECONDS:
        data, edits = mutated(rng, base) if cases else (base.SerializeToString(), ["none"])
        label = f"{name} case {cases} (seed {SEED}): {'; '.join(edits)}"
        path.write_bytes(data)
        outcome = Outcome()
        outcome.refused = within(lambda outcome=outcome: run_like_the_command(path, tmp_path, outcome), CASE_MEMORY,
                                 CASE_TIMEOUT_S, label)
        if outcome.refused is not None:
            assert cases, f"{label}: the valid model was refused: {outcome.refused}"
            counts["refused"] += 1
        else:
            checked = compare(onnx_runtime, data, outcome, label)
            counts[checked] += 1
            if checked == "no oracle":
                unchecked.append(label)
        cases += 1
    request.node.user_properties.extend([("fuzz_cases", cases), *counts.items(), ("no oracle", unchecked[:5])])
    # What tracemalloc does not see (LLVM's memory, the compiled code's) shows in the process's peak.
    assert peak_resident() - resident < CASE_MEMORY, f"{name}: the process grew by {peak_resident() - resident:,} bytes"
    assert counts["matched"] >= 1 and counts["refused"] > cases // 10, counts
