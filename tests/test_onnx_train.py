"""ONNX models made trainable (`ranvier.onnx.load(..., trainable=True)`): which
initializers become weights, batch norm and dropout in training mode, an ONNX file
trained as PyTorch trains the module it came from, an op without a gradient refused by
its node at load; and the converters unoptimized exports need (sequences, IsNaN, a
CastLike of a known value, GatherElements folded past ONNX's reference) against ONNX
Runtime."""

from __future__ import annotations

import copy

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import ranvier  # noqa: E402
import ranvier.onnx as ro  # noqa: E402
import ranvier.train  # noqa: E402
from ranvier.errors import UnknownOpError  # noqa: E402
from ranvier.onnx import OnnxError  # noqa: E402
from ranvier.onnx.node import converts  # noqa: E402
from ranvier.onnx.training import learnable_initializers  # noqa: E402
from ranvier.ops import TensorType, define  # noqa: E402
from ranvier.train.optimizers import AdamW  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]
RNG = np.random.default_rng(58)


def model(nodes, inputs: dict, initializers: dict, outputs, opset: int = 17, domains=()) -> onnx.ModelProto:
    """A model of `nodes`: `inputs` fed at run time, `initializers` known; the outputs
    typed by ONNX's shape inference (where it can: not in a test's own domain)."""
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in initializers.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)])
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(proto).graph.value_info}
    del proto.graph.output[:]
    proto.graph.output.extend(inferred[o] for o in outputs)
    return proto


def compute(flow: ranvier.Flow, feeds: dict, outputs) -> list[np.ndarray]:
    data = ranvier.Compiler().compile(flow).cell("main").instance()
    for name, value in feeds.items():
        data[name] = value
    data.compute()
    return [np.array(data[name]) for name in outputs]


# ---- which initializers are weights ----------------------------------------------------------------


def test_without_torchs_record_weights_are_the_floating_initializers_of_several_finite_elements():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "bias"], ["h2"]),
        helper.make_node("Mul", ["h2", "half"], ["h3"]),
        helper.make_node("Add", ["h3", "mask"], ["h4"]),
        helper.make_node("Reshape", ["h4", "shape"], ["h5"]),
        helper.make_node("BatchNormalization", ["h5", "gamma", "beta", "mean", "var"], ["y"]),
    ]
    initializers = {"w": RNG.standard_normal((4, 3)).astype(np.float32), "bias": np.ones(3, np.float32),
                    "half": np.float32(0.5), "mask": np.array([0, -np.inf, 0], np.float32), "shape": np.int64([2, 3, 1]),
                    "gamma": np.ones(3, np.float32), "beta": np.zeros(3, np.float32), "mean": np.zeros(3, np.float32),
                    "var": np.ones(3, np.float32)}
    proto = model(nodes, {"x": np.zeros((2, 4), np.float32)}, initializers, ["y"])
    assert learnable_initializers(proto, True) == ["w", "bias", "gamma", "beta"]
    assert learnable_initializers(proto, ["beta", "w"]) == ["w", "beta"]
    with pytest.raises(OnnxError, match=r"trainable names \['nope'\], which are not initializers"):
        learnable_initializers(proto, ["nope", "w"])
    with pytest.raises(OnnxError, match="initializer 'shape' is INT64; only floating-point weights can be learned"):
        learnable_initializers(proto, ["shape"])
    flow = ro.load(proto, trainable=True)
    assert sorted(a for v in flow.vars.values() if v.learnable for a in v.aliases) == ["beta", "bias", "gamma", "w"]


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(12, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.out = torch.nn.Linear(32, 5)
        self.register_buffer("shift", torch.full((12,), 0.25))  # a buffer: constant, never learned

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.norm(self.hidden(x - self.shift))))


def test_an_onnx_file_trains_as_the_pytorch_module_it_came_from(tmp_path):
    torch.manual_seed(1)
    module = Classifier().eval()
    path = tmp_path / "classifier.onnx"
    torch.onnx.export(module, (torch.zeros(8, 12),), dynamo=True, verbose=False).save(path)
    assert learnable_initializers(onnx.load(path), True) == [n for n, _ in module.named_parameters()], \
        "the parameters torch.export recorded, not the buffer"
    batches = [(RNG.standard_normal((8, 12)).astype(np.float32), RNG.integers(0, 5, 8)) for _ in range(20)]
    step = ranvier.train.compile_step(path, "cross_entropy", AdamW(lr=1e-2), batch=batches[0])
    reference = copy.deepcopy(module).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in batches:
        ours = step(x, y)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        assert abs(ours - loss.item()) <= 1e-4 * loss.item()
    weights = step.weights()
    assert set(weights) == {n for n, _ in module.named_parameters()}
    for name, value in reference.named_parameters():
        assert np.abs(weights[name] - value.detach().numpy()).max() <= 1e-3 * 20 * 1e-2, name


# ---- training-mode batch norm and dropout -----------------------------------------------------------


@pytest.mark.parametrize("shape", [[6, 3, 4, 5], [7, 3]])
def test_batch_normalization_trains_on_the_batch_and_updates_its_running_statistics(shape):
    x = RNG.standard_normal(shape).astype(np.float32) * 2 + 1
    gamma, beta = RNG.standard_normal(3).astype(np.float32), RNG.standard_normal(3).astype(np.float32)
    mean, var = RNG.standard_normal(3).astype(np.float32), RNG.uniform(0.5, 2, 3).astype(np.float32)
    node = helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y", "new_mean", "new_var"], epsilon=1e-3,
                            momentum=0.7, training_mode=1)
    proto = model([node], {"x": x}, {"g": gamma, "b": beta, "m": mean, "v": var}, ["y", "new_mean", "new_var"], opset=15)
    flow = ro.load(proto, trainable=True)
    network = ranvier.Compiler().compile(flow)
    data = network.cell("main").instance()
    data["x"] = x
    running = [torch.from_numpy(mean.copy()), torch.from_numpy(var.copy())]
    for _ in range(2):  # the statistics move on from where the last step left them
        data.compute()
        expected = torch.nn.functional.batch_norm(torch.from_numpy(x), *running, torch.from_numpy(gamma),
                                                  torch.from_numpy(beta), training=True, momentum=0.3, eps=1e-3)
        np.testing.assert_allclose(np.array(data["y"]), expected.numpy(), rtol=1e-5, atol=1e-5)
        for name, value in zip(("m", "v"), running):
            np.testing.assert_allclose(network.globals[flow.lookup(name).name], value.numpy(), rtol=1e-5)
        np.testing.assert_allclose(np.array(data["new_var"]), running[1].numpy(), rtol=1e-5)


def test_batch_normalization_needs_two_values_per_channel():
    node = helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y"])
    ones = np.ones(3, np.float32)
    proto = model([node], {"x": np.zeros((1, 3), np.float32)}, {"g": ones, "b": ones, "m": ones, "v": ones}, ["y"])
    with pytest.raises(OnnxError, match="needs more than one value per channel to train"):
        ro.load(proto, trainable=True)


def test_dropout_nodes_drop_in_training_each_in_a_stream_of_its_own():
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Dropout", ["h", "r"], ["y"]),
             helper.make_node("Dropout", ["h", "r"], ["z"])]
    x = RNG.uniform(0.5, 1.5, (64, 256)).astype(np.float32)
    proto = model(nodes, {"x": x}, {"w": np.full(256, 2.0, np.float32), "r": np.float32(0.25)}, ["y", "z"], opset=13)
    y, z = compute(ro.load(proto, trainable=True), {"x": x}, ["y", "z"])
    for out in (y, z):
        assert abs((out == 0).mean() - 0.25) < 5 * np.sqrt(0.25 * 0.75 / out.size)
        np.testing.assert_allclose(out[out != 0], (2 * x / 0.75)[out != 0], rtol=1e-6)
    assert ((y == 0) != (z == 0)).mean() > 0.3
    (inference,) = compute(ro.load(proto), {"x": x}, ["y"])
    np.testing.assert_array_equal(inference, 2 * x)


# ---- an op without a gradient -----------------------------------------------------------------------

define("TestOpaque", lambda ctx: [TensorType(ctx.inputs[0].dtype, ctx.inputs[0].shape)],
       lambda attrs, args, outs: [np.asarray(args[0]) * 2], 1, "elementwise", "2x, with no gradient (a test's op)")


@converts("Opaque", domain="test.ranvier")
def _opaque(node):
    return node.b.op("TestOpaque", [node.tensor(0)])


def test_an_op_without_a_gradient_is_refused_by_its_node_when_made_trainable():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Opaque", ["h"], ["y"], domain="test.ranvier",
                                                                             name="the_opaque_node")]
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    proto = model(nodes, {"x": x}, {"w": np.ones((4, 3), np.float32)}, ["h"], domains=["test.ranvier"])
    proto.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]))
    (y,) = compute(ro.load(proto), {"x": x}, ["y"])  # for inference it is fine
    np.testing.assert_allclose(y, 2 * x @ np.ones((4, 3)), rtol=1e-6)
    with pytest.raises(UnknownOpError, match="ONNX node 'the_opaque_node' became op TestOpaque .*which has no gradient"):
        ro.load(proto, trainable=True)


# ---- converters that unoptimized exports need, against ONNX Runtime --------------------------------


def _against_ort(proto: onnx.ModelProto, feeds: dict, outputs) -> None:
    expected = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    got = compute(ro.load(proto), feeds, outputs)
    for name, want, have in zip(outputs, expected, got):
        assert have.dtype == want.dtype and have.shape == want.shape, name
        np.testing.assert_allclose(have, want, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("split, keepdims, positions", [
    (np.int64(2), 1, [0, 2]),  # parts of 2, the last of 1
    (np.int64([1, 3, 1]), 1, [1, -1]),
    (None, 0, [3, -5]),  # parts of 1, squeezed
])
def test_split_to_sequence_and_sequence_at(split, keepdims, positions):
    x = RNG.standard_normal((2, 5, 3)).astype(np.float32)
    inputs = ["x", "s"] if split is not None else ["x"]
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("SplitToSequence", ["r", *inputs[1:]], ["seq"], axis=1, keepdims=keepdims)]
    nodes += [helper.make_node("SequenceAt", ["seq", f"p{i}"], [f"y{i}"]) for i in range(len(positions))]
    initializers = {f"p{i}": np.int64(p) for i, p in enumerate(positions)} | ({"s": split} if split is not None else {})
    outputs = [f"y{i}" for i in range(len(positions))]
    _against_ort(model(nodes, {"x": x}, initializers, outputs), {"x": x}, outputs)


def test_is_nan_of_a_computed_value():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    x[0, 1] = x[2, 3] = np.nan
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("IsNaN", ["r"], ["n"]),
             helper.make_node("Where", ["n", "zero", "r"], ["y"])]
    _against_ort(model(nodes, {"x": x}, {"zero": np.float32(0)}, ["n", "y"], opset=13), {"x": x}, ["n", "y"])


def test_a_known_value_cast_like_a_computed_one_stays_known():
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    nodes = [helper.make_node("CastLike", ["quarter", "x"], ["c"]), helper.make_node("Sqrt", ["c"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["y"])]
    proto = model(nodes, {"x": x}, {"quarter": np.float64(0.25)}, ["y"], opset=15)
    _against_ort(proto, {"x": x}, ["y"])
    ops = {op.type for op in ro.load(proto).ops.values()}
    assert ops == {"Mul", "Identity"} or ops == {"Mul"}, f"the scale folded at load, not {ops}"


def test_gather_elements_of_known_values_folds_past_onnx_references_64_rows():
    table = RNG.integers(0, 9, (1, 100)).astype(np.int64)
    x = RNG.standard_normal((1, 16)).astype(np.float32)
    nodes = [helper.make_node("GatherElements", ["table", "index"], ["g"], axis=1),
             helper.make_node("Cast", ["g"], ["f"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "f"], ["y"])]
    proto = model(nodes, {"x": x}, {"table": table, "index": np.arange(16, dtype=np.int64)[None] * 5 - 3}, ["y"], opset=13)
    _against_ort(proto, {"x": x}, ["y"])


# ---- ranvier train onnx ---------------------------------------------------------------------------


def _mlp_file(path, width: int = 784) -> str:
    """A classifier of flat images as ONNX: a [batch, width] input, two layers."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"], transB=1)]
    initializers = {"w1": rng.normal(0, 0.05, (32, width)).astype(np.float32), "b1": np.zeros(32, np.float32),
                    "w2": rng.normal(0, 0.2, (10, 32)).astype(np.float32), "b2": np.zeros(10, np.float32)}
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
                              [numpy_helper.from_array(v, n) for n, v in initializers.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def _metrics(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_onnx_a_classifier_resumes_where_it_stopped_and_writes_the_trained_model(tmp_path, capsys):
    from ranvier.cli import main

    model = _mlp_file(tmp_path / "mlp.onnx")
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    common = ["--batch", "16", "--lr", "3e-3", "--quiet"]
    main(["train", "onnx", model, "--steps", "40", "--run-dir", str(straight), *common])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("test_accuracy=0.") and float(last.split("=")[1].split()[0]) > 0.5
    main(["train", "onnx", model, "--steps", "20", "--run-dir", str(interrupted), *common])
    main(["train", "onnx", "--resume", str(interrupted), "--steps", "40", "--quiet"])
    assert "from step 20" in capsys.readouterr().out
    def losses(run_dir):
        return [(r["step"], r["loss"]) for r in _metrics(run_dir) if "loss" in r]

    assert losses(interrupted) == losses(straight)  # step for step, bit for bit
    assert _metrics(interrupted)[-1] == _metrics(straight)[-1]  # the same test accuracy
    trained = onnx.load(straight / "trained.onnx")
    images = np.random.default_rng(1).uniform(0, 1, (3, 784)).astype(np.float32)
    (logits,) = ort.InferenceSession(trained.SerializeToString()).run(None, {"x": images})
    assert logits.shape == (3, 10)
    assert not np.array_equal(numpy_helper.to_array(trained.graph.initializer[0]),
                              numpy_helper.to_array(onnx.load(model).graph.initializer[0])), "the weights trained"


def test_train_onnx_a_language_model_on_token_shards(tmp_path, capsys):
    from ranvier.cli import main

    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    main(["data", "pretokenize", str(tmp_path / "text.txt"), "--out", str(tmp_path / "shards"), "--bytes"])
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["table", "tokens"], ["e"]), helper.make_node("MatMul", ["e", "out"], ["logits"])]
    graph = helper.make_graph(nodes, "bigram", [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["b", "t"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", 258])],
                              [numpy_helper.from_array(rng.normal(0, 0.1, (258, 16)).astype(np.float32), "table"),
                               numpy_helper.from_array(rng.normal(0, 0.1, (16, 258)).astype(np.float32), "out")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "bigram.onnx")
    main(["train", "onnx", str(tmp_path / "bigram.onnx"), "--data", str(tmp_path / "shards"), "--batch", "8", "--seq", "16",
          "--steps", "60", "--lr", "1e-2", "--run-dir", str(tmp_path / "run"), "--quiet"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("validation_loss=")
    assert float(last.split("=")[1].split()[0]) < np.log(258) - 1, "it learned the text's letters"
    assert (tmp_path / "run" / "trained.onnx").is_file()


def test_train_onnx_refuses_what_it_cannot_train_by_name(tmp_path):
    from ranvier.cli import main
    from ranvier.errors import RanvierError

    with pytest.raises(RanvierError, match="takes a model to start a run .* or --resume RUN_DIR to continue one, not both"):
        main(["train", "onnx"])
    with pytest.raises(RanvierError, match=r"28 × 28 images; .*input 'x' is \[8, 100\] \(100 values an example\)"):
        main(["train", "onnx", _mlp_file(tmp_path / "small.onnx", width=100), "--batch", "8", "--run-dir", str(tmp_path / "a"),
              "--quiet"])
    model = _mlp_file(tmp_path / "mlp.onnx")
    main(["train", "onnx", model, "--steps", "2", "--batch", "8", "--run-dir", str(tmp_path / "b"), "--quiet"])
    (tmp_path / "mlp.onnx").write_bytes((tmp_path / "mlp.onnx").read_bytes() + b"\0")
    with pytest.raises(RanvierError, match="mlp.onnx has changed since .* started"):
        main(["train", "onnx", "--resume", str(tmp_path / "b"), "--steps", "4", "--quiet"])
