"""ONNX from the command line and from PyTorch: `ranvier convert | run | bench`, from_torch."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper  # noqa: E402

import ranvier  # noqa: E402
from ranvier.cli import main  # noqa: E402
from ranvier.errors import RanvierError  # noqa: E402

RNG = np.random.default_rng(15)


@pytest.fixture
def model_file(tmp_path):
    """y = softmax(x @ W + b) with a symbolic batch; W and b random."""
    W = helper.make_tensor("W", TensorProto.FLOAT, [6, 4], RNG.standard_normal(24).astype(np.float32))
    b = helper.make_tensor("b", TensorProto.FLOAT, [4], RNG.standard_normal(4).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["z"]),
             helper.make_node("Softmax", ["z"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [W, b])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def expected(path, x):
    return ort.InferenceSession(str(path)).run(None, {"x": x})[0]


def test_run_prints_and_saves_outputs(model_file, tmp_path, capsys):
    x = RNG.standard_normal((3, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(model_file), "--dims", "batch=3", "--input", f"x={tmp_path / 'x.npy'}",
                 "--output", str(tmp_path / "out"), "--profile"]) == 0
    out, err = capsys.readouterr()
    assert "y: float32[3x4]" in out and "profile of cell main" in err
    np.testing.assert_allclose(np.load(tmp_path / "out" / "y.npy"), expected(model_file, x), rtol=1e-5, atol=1e-7)


def test_convert_to_flow_and_run_the_flow(model_file, tmp_path, capsys):
    target = tmp_path / "model.flow"
    assert main(["convert", str(model_file), str(target), "--dims", "batch=2"]) == 0
    assert "wrote" in capsys.readouterr().out
    x = RNG.standard_normal((2, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    main(["run", str(target), "--input", f"x={tmp_path / 'x.npy'}", "--output", str(tmp_path / "out")])
    np.testing.assert_allclose(np.load(tmp_path / "out" / "y.npy"), expected(model_file, x), rtol=1e-5, atol=1e-7)


def test_bench_says_which_side_is_faster(model_file, capsys):
    assert main(["bench", str(model_file), "--dims", "batch=2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "ONNX Runtime" in out and ("faster than ONNX Runtime" in out or "slower than ONNX Runtime" in out)
    assert main(["bench", str(model_file), "--dims", "batch=1", "--repeats", "2", "--matmul", "bfloat16"]) == 0
    assert "ranvier (products in bfloat16) " in capsys.readouterr().out


@pytest.mark.parametrize("batch", [1, 3])
def test_run_with_bf16_weights_reads_them_rounded(model_file, tmp_path, capsys, monkeypatch, batch):
    """--matmul bfloat16: the weight's bf16 panels (the generated GEMM forced), the output
    ONNX Runtime's on the weight rounded to bf16, not on the float32 one; a row on
    AVX512-BF16's pairs (Bf16Gemv) where the CPU has them, rows on AMX tiles, which round x
    as well."""
    import ml_dtypes

    monkeypatch.setenv("RANVIER_GEMM", "generated")
    x = RNG.standard_normal((batch, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(model_file), "--dims", f"batch={batch}", "--input", f"x={tmp_path / 'x.npy'}",
                 "--output", str(tmp_path / "out"), "--profile", "--matmul", "bfloat16"]) == 0
    target = ranvier.backends.cpu.target.host_target()
    kernel = ("AmxGemm" if ranvier.backends.cpu.amx.amx_usable(target) else "PackedGemmBf16") if batch > 1 else \
        ("Bf16Gemv" if ranvier.backends.cpu.sgemm.pairs_supported(target) else "PackedGemmBf16")
    assert kernel in capsys.readouterr().err
    model = onnx.load(model_file)
    weight = onnx.numpy_helper.to_array(model.graph.initializer[0])
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(weight.astype(ml_dtypes.bfloat16).astype(np.float32), "W"))
    onnx.save(model, tmp_path / "rounded.onnx")
    got = np.load(tmp_path / "out" / "y.npy")
    if kernel == "PackedGemmBf16":  # (the others round x as well)
        np.testing.assert_allclose(got, expected(tmp_path / "rounded.onnx", x), rtol=1e-5, atol=1e-7)
    assert not np.allclose(got, expected(model_file, x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arguments,message", [
    (["--dims", "batch=2"], "no --input for x"),
    (["--dims", "batch=2", "--input", "z=X"], "no input 'z'; its inputs: x: float32\\[2x6\\]"),
    (["--dims", "batch=2", "--input", "x=SHAPE"], "has shape \\[3x6\\], expected \\[2x6\\]"),
    (["--dims", "batch"], "not NAME=SIZE"),
    ([], "symbolic size 'batch'"),
])
def test_run_errors_name_what_was_wrong(model_file, tmp_path, arguments, message):
    np.save(tmp_path / "shape.npy", np.zeros((3, 6), np.float32))
    arguments = [a.replace("SHAPE", str(tmp_path / "shape.npy")).replace("=X", f"={tmp_path / 'shape.npy'}") for a in arguments]
    with pytest.raises(RanvierError, match=message):
        main(["run", str(model_file), *arguments])


def test_model_files_of_other_kinds_are_refused(tmp_path):
    (tmp_path / "m.txt").write_text("hello")
    with pytest.raises(RanvierError, match="neither a .flow nor an .onnx"):
        main(["run", str(tmp_path / "m.txt")])
    with pytest.raises(RanvierError, match="no model file"):
        main(["run", str(tmp_path / "missing.onnx")])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.export internals
def test_from_torch_matches_the_module():
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    flow = ranvier.from_torch(module, [x])
    data = ranvier.Compiler().compile(flow).cell("main").instance()
    data["input"] = x.numpy()
    data.compute()
    (output,) = flow.outputs(flow.funcs["main"])
    reference = module(x).detach().numpy()
    assert np.abs(data[output] - reference).max() / np.abs(reference).max() < 1e-5
    with pytest.raises(RanvierError, match="torch.nn.Module"):
        ranvier.from_torch(lambda t: t, [x])


def test_an_input_used_only_for_its_shape_needs_no_value_in_the_cell(tmp_path, capsys):
    """`like` only gives `x` its new shape; the load folds it away, and run takes it anyway."""
    nodes = [helper.make_node("Shape", ["like"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
                                           helper.make_tensor_value_info("like", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "shape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    x = RNG.standard_normal(6).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "like.npy", RNG.standard_normal((2, 3)).astype(np.float32))
    main(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}", "--input", f"like={tmp_path / 'like.npy'}",
          "--output", str(tmp_path / "out")])
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "y.npy"), x.reshape(2, 3))


@pytest.fixture
def lookup_file(tmp_path):
    """y = table[ids] + x: an int32 input and a float32 one."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [5, 2], RNG.standard_normal(10).astype(np.float32))
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["rows"]), helper.make_node("Add", ["rows", "x"], ["y"])],
                              "g", [helper.make_tensor_value_info("ids", TensorProto.INT32, [3]),
                                    helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])], [table])
    path = tmp_path / "lookup.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def run_lookup(path, tmp_path, ids: np.ndarray, x: np.ndarray) -> np.ndarray:
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "x.npy", x)
    main(["run", str(path), "--input", f"ids={tmp_path / 'ids.npy'}", "--input", f"x={tmp_path / 'x.npy'}",
          "--output", str(tmp_path / "out")])
    return np.load(tmp_path / "out" / "y.npy")


X32 = RNG.standard_normal((3, 2))


@pytest.mark.parametrize("ids, x, message", [
    (np.array([1.7, 0, 4]), X32, "input ids from .* is float64, which the model's int32 input cannot hold"),
    (np.int64([1, 2**31, 4]), X32, "input ids from .* is int64, which the model's int32 input cannot hold"),
    (np.int64([1, -2**31 - 1, 4]), X32, "is int64, which the model's int32"),
    (np.int32([1, 0, 4]), X32 + 1j, "input x from .* holds elements of dtype complex128, expected real numbers"),
    (np.array([True, False, True]).astype(np.uint64) << 63, X32, "is uint64, which the model's int32"),
])
def test_run_refuses_inputs_their_type_cannot_hold(lookup_file, tmp_path, ids, x, message):
    """An .npy of another type is taken only where nothing is lost but a float's rounding
    (ORT refuses any other type; ranvier cast 1.7 to 1 and wrapped 2^31 into int32)."""
    with pytest.raises(RanvierError, match=message):
        run_lookup(lookup_file, tmp_path, ids, x)


def test_run_takes_inputs_of_a_kind_it_can_hold(lookup_file, tmp_path):
    ids = np.int64([4, 0, 2])
    got = run_lookup(lookup_file, tmp_path, ids, X32)  # int64 ids in int32's range, float64 rounded to float32
    want = ort.InferenceSession(str(lookup_file)).run(None, {"ids": ids.astype(np.int32), "x": X32.astype(np.float32)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bench_refuses_random_inputs_past_the_memory_limit(tmp_path, monkeypatch):
    """bench draws its inputs before compiling: a declared [2, 2^31] input was numpy's
    MemoryError (found by test_onnx_fuzz.py)."""
    monkeypatch.setenv("RANVIER_MAX_MEMORY_MB", "1024")  # however much memory the machine has
    table = helper.make_tensor("table", TensorProto.FLOAT, [5, 2], RNG.standard_normal(10).astype(np.float32))
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["y"])], "g",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 2**31])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2**31, 2])], [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "wide.onnx")
    with pytest.raises(RanvierError, match=r"input ids: int64\[2x2147483648\]: 32 GiB, past ranvier's memory limit"):
        main(["bench", str(tmp_path / "wide.onnx")])
