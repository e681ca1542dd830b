"""ONNX export: every exported op family, the MNIST classifier and a Llama forward, run by
ONNX Runtime against ranvier's compiled CPU cell on the same random inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import ranvier as rv  # noqa: E402
from ranvier.errors import RanvierError, UnknownOpError  # noqa: E402
from ranvier.models import CNN, MLP  # noqa: E402
from ranvier.models.llama import Llama, LlamaConfig  # noqa: E402
from ranvier.onnx.exporter import save  # noqa: E402
from ranvier.train.classifier import build_classifier  # noqa: E402
from ranvier.train.optimizers import AdamW  # noqa: E402
from ranvier.train.trainer import Trainer  # noqa: E402

RNG = np.random.default_rng(15)


def uniform(shape, lo=-2.0, hi=2.0, dtype=np.float32):
    return RNG.uniform(lo, hi, shape).astype(dtype)


def session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def ranvier_outputs(flow, function, feeds, names):
    data = rv.Compiler().compile(flow).cell(function).instance()
    for name, value in feeds.items():
        data[name] = value
    data.compute()
    return [np.array(data[name]) for name in names]


def assert_close(got, expected, name):
    assert got.shape == expected.shape and got.dtype == expected.dtype, name
    if got.dtype.kind == "f":
        error = np.abs(got.astype(np.float64) - expected).max() / np.abs(expected).max()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"
    else:
        np.testing.assert_array_equal(got, expected, err_msg=name)


def check(flow, feeds, function=None, **options):
    """Export, check the model with ONNX's full checker, run it in ONNX Runtime and compare
    every output with the compiled CPU cell's. Returns the model."""
    model = save(flow, function=function, **options)
    onnx.checker.check_model(model, full_check=True)
    feeds = {getattr(k, "name", k): v for k, v in feeds.items()}
    names = [o.name for o in model.graph.output]
    got = session(model).run(None, feeds)
    function = function or next(iter(flow.funcs))
    for name, value, expected in zip(names, got, ranvier_outputs(flow, function, feeds, names)):
        assert_close(value, expected, name)
    return model


def node_types(model):
    return {node.op_type for node in model.graph.node}


# ---- elementwise ---------------------------------------------------------------------------------

DOMAINS = {  # inputs where each op is defined and well-conditioned, never zero
    (-3.0, 3.0): ["abs", "neg", "sign", "relu", "identity", "exp", "sin", "cos", "tanh", "sigmoid", "erf", "softplus",
                  "softsign", "floor", "ceil", "round", "trunc", "atan", "sinh", "cosh", "asinh", "square", "silu",
                  "gelu", "log_sigmoid", "acot", "sech"],
    (0.2, 1.3): ["log", "sqrt", "rsqrt", "reciprocal", "cot", "csc", "coth", "csch", "acsch"],
    (-0.9, 0.9): ["asin", "acos", "atanh", "tan", "sec"],
    (1.1, 3.0): ["acosh", "asec", "acsc", "acoth"],
    (0.1, 0.9): ["asech"],
}


@pytest.mark.parametrize("opset", [18, 20])
def test_unary(opset):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    feeds = {}
    for i, ((lo, hi), methods) in enumerate(DOMAINS.items()):
        x = f.var(f"x{i}", rv.DT_FLOAT, [4, 8])
        feeds[x] = uniform([4, 8], lo, hi)
        for method in methods:
            getattr(f, method)(x, name=method).var.out = True
        if lo < 0:
            f.gelu(x, approximate="tanh", name="gelu_tanh").var.out = True
    model = check(flow, feeds, opset=opset)
    assert ("Gelu" in node_types(model)) == (opset >= 20)


def test_binary_and_logic():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    a, b = f.var("a", rv.DT_FLOAT, [3, 4]), f.var("b", rv.DT_FLOAT, [4])
    base = f.var("base", rv.DT_FLOAT, [3, 4])
    i, j = f.var("i", rv.DT_INT32, [3, 4]), f.var("j", rv.DT_INT32, [3, 4])
    p, q = f.var("p", rv.DT_BOOL, [3, 4]), f.var("q", rv.DT_BOOL, [3, 4])
    for method in ("add", "sub", "mul", "div", "minimum", "maximum", "equal", "not_equal", "less", "less_equal",
                   "greater", "greater_equal"):
        getattr(f, method)(a, b, name=method).var.out = True
    f.pow(base, b, name="pow").var.out = True
    for method in ("add", "sub", "mul", "div", "minimum", "maximum", "less"):
        getattr(f, method)(i, j, name=f"int_{method}").var.out = True
    for method in ("logical_and", "logical_or", "logical_xor", "logical_and_not"):
        getattr(f, method)(p, q, name=method).var.out = True
    f.logical_not(p, name="not").var.out = True
    f.cond(p, a, b, name="cond").var.out = True
    f.select(q, a, name="select").var.out = True
    f.cast(a, rv.DT_INT32, name="to_int").var.out = True
    f.cast(i, rv.DT_FLOAT, name="to_float").var.out = True
    f.cast(a, rv.DT_FLOAT64, name="to_double").var.out = True
    nonzero = RNG.integers(1, 9, [3, 4]) * RNG.choice([-1, 1], [3, 4])
    check(flow, {
        a: uniform([3, 4]), b: uniform([4], 0.5, 2.0), base: uniform([3, 4], 0.5, 3.0),
        i: RNG.integers(-50, 50, [3, 4]).astype(np.int32), j: nonzero.astype(np.int32),
        p: RNG.random([3, 4]) < 0.5, q: RNG.random([3, 4]) < 0.5,
    })


# ---- matrices, shapes, reductions ---------------------------------------------------------------------


def test_matmul():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [2, 3, 8])
    W = f.array("W", uniform([8, 5]))
    Wt = f.array("Wt", uniform([5, 8]))
    y = f.var("y", rv.DT_FLOAT, [2, 8, 4])
    f.matmul(x, W, name="plain").var.out = True
    f.matmul(x, Wt, transpose_b=True, name="tb").var.out = True
    f.matmul(y, x, transpose_a=True, transpose_b=True, name="tab").var.out = True
    f.matmul(x, y, name="batched").var.out = True
    check(flow, {x: uniform([2, 3, 8]), y: uniform([2, 8, 4])})


def test_matmul_bfloat16_rounds_its_operands():
    """ranvier rounds the operands to bfloat16 (to nearest) and sums in float32; the CPU here
    may have no AMX tiles to run it, so numpy's rounding is the oracle."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [4, 16])
    W = f.array("W", uniform([16, 8]))
    f.matmul(x, W, precision="bfloat16", name="y")
    x_value = uniform([4, 16])
    (got,) = session(save(flow)).run(None, {"f/x": x_value})
    rounded = [a.astype(ml_dtypes.bfloat16).astype(np.float64) for a in (x_value, W.var.data)]
    assert_close(got, (rounded[0] @ rounded[1]).astype(np.float32), "bfloat16 matmul")
    assert np.abs(got - x_value @ W.var.data).max() > 1e-4  # the rounding is there


def test_shapes():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [2, 3, 4])
    y = f.var("y", rv.DT_FLOAT, [2, 1, 4])
    f.reshape(x, [6, -1], name="reshape").var.out = True
    f.transpose(x, name="reversed").var.out = True
    f.transpose(x, perm=[1, 0, 2], name="perm").var.out = True
    f.concat([x, y], axis=1, name="concat").var.out = True
    for part in (*f.split(x, 2, axis=2), *f.split(x, [1, 2], axis=-2)):
        part.var.out = True
    f.slice(x, [1, 0, 1], [1, 2, -1], name="slice").var.out = True
    f.broadcast_to(y, [3, 2, 5, 4], name="broadcast").var.out = True
    f.expand_dims(x, 1, name="expand").var.out = True
    f.squeeze(y, name="squeeze").var.out = True
    f.pad(x, before=[0, 1, 2], after=[1, 0, 1], value=0.5, name="pad").var.out = True
    for method in ("shape", "size", "rank"):
        getattr(f, method)(x, name=method).var.out = True
    f.strided_view(x, offset=1, shape=[3, 2, 2], strides=[4, 12, 2], name="view").var.out = True
    check(flow, {x: uniform([2, 3, 4]), y: uniform([2, 1, 4])})


def test_reductions():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [3, 4, 5])
    p = f.var("p", rv.DT_BOOL, [3, 4])
    for method in ("sum", "sum_squares", "mean", "max", "min", "product"):
        getattr(f, method)(x, axis=[0, 2], name=method).var.out = True
        getattr(f, method)(x, axis=[-1], keepdims=True, name=f"{method}_kept").var.out = True
        getattr(f, method)(x, name=f"{method}_all").var.out = True
    f.all(p, axis=[1], name="all").var.out = True
    f.any(p, name="any").var.out = True
    f.count(x > 0.5, axis=1, name="count").var.out = True
    f.count(x, dtype=rv.DT_INT32, name="count_nonzero").var.out = True
    f.argmax(x, axis=1, name="argmax").var.out = True
    f.argmin(x, axis=-1, keepdims=True, output_type="int64", name="argmin").var.out = True
    f.argmax(x, name="argmax_flat").var.out = True
    check(flow, {x: uniform([3, 4, 5], 0.5, 1.5), p: RNG.random([3, 4]) < 0.8})


# ---- neural-network ops ------------------------------------------------------------------------------


def test_normalization_and_losses():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [4, 6])
    labels = f.var("labels", rv.DT_INT32, [4])
    target = f.var("target", rv.DT_FLOAT, [4, 6])
    gamma, beta = f.array("gamma", uniform([6], 0.5, 1.5)), f.array("beta", uniform([6]))
    f.softmax(x, name="softmax").var.out = True
    f.softmax(x, axis=0, name="softmax0").var.out = True
    f.log_softmax(x, name="log_softmax").var.out = True
    f.layer_norm(x, gamma, beta, eps=1e-3, name="layer_norm").var.out = True
    f.layer_norm(x, name="layer_norm_plain").var.out = True
    f.rms_norm(x, gamma, name="rms_norm").var.out = True
    f.rms_norm(x, eps=1e-2, name="rms_norm_plain").var.out = True
    f.softmax_cross_entropy(x, labels, name="xent").var.out = True
    f.softmax_cross_entropy(x, labels, label_smoothing=0.1, name="xent_smooth").var.out = True
    f.softmax_cross_entropy(x, target, name="xent_probs").var.out = True
    f.one_hot(labels, 7, name="one_hot").var.out = True
    probs = RNG.random([4, 6]).astype(np.float32)
    check(flow, {x: uniform([4, 6]), labels: RNG.integers(0, 6, [4]).astype(np.int32), target: probs / probs.sum(-1, keepdims=True)})



def test_half_precision_logits_export_a_float32_loss():
    """The per-example loss of float16 logits is float32 in ranvier, and the exported model
    computes it in float32 from the widened logits, as ranvier does."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_HALF, [5, 9])
    labels = f.var("labels", rv.DT_INT32, [5])
    target = f.var("target", rv.DT_HALF, [5, 9])
    f.softmax_cross_entropy(x, labels, label_smoothing=0.1, name="xent").var.out = True
    f.softmax_cross_entropy(x, target, name="xent_probs").var.out = True
    probs = RNG.random([5, 9])
    model = check(flow, {x: uniform([5, 9], -6, 6).astype(np.float16), labels: RNG.integers(0, 9, [5]).astype(np.int32),
                         target: (probs / probs.sum(-1, keepdims=True)).astype(np.float16)})
    assert {o.type.tensor_type.elem_type for o in model.graph.output} == {onnx.TensorProto.FLOAT}


def test_convolution_and_pooling():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [2, 3, 9, 8])
    w = f.array("w", uniform([4, 3, 3, 3]))
    f.conv2d(x, w, name="conv").var.out = True
    f.conv2d(x, w, strides=2, padding=[1, 2], name="conv_strided").var.out = True
    f.max_pool(x, 2, name="max_pool").var.out = True
    f.max_pool(x, 3, strides=2, padding=1, name="max_pool_padded").var.out = True
    f.avg_pool(x, 2, strides=1, name="avg_pool").var.out = True
    f.avg_pool(x, [3, 2], padding=1, name="avg_pool_padded").var.out = True
    check(flow, {x: uniform([2, 3, 9, 8])})


def test_lookups_and_top_k():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    table = f.array("table", uniform([10, 3]))
    oov = f.array("oov", uniform([3]))
    tokens = f.var("tokens", rv.DT_INT32, [2, 5])
    wild = f.var("wild", rv.DT_INT64, [4])
    x = f.var("x", rv.DT_FLOAT, [3, 7])
    f.gather(table, tokens, name="gather").var.out = True
    f.gather(table, wild, oov, name="gather_oov").var.out = True
    for part in f.top_k(x, 3, name="top_k"):
        part.var.out = True
    for part in f.op("SoftmaxTopK", [x], "softmax_top_k", {"k": 2}):
        part.var.out = True
    check(flow, {
        tokens: RNG.integers(0, 10, [2, 5]).astype(np.int32), wild: np.array([3, -1, 12, 9]), x: uniform([3, 7]),
    })


@pytest.mark.parametrize("heads, kv_heads, queries, keys, causal, scale, bias", [
    (4, 2, 5, 5, True, None, None),  # grouped-query, as Llama
    (3, 1, 4, 6, True, None, [3, 4, 6]),  # multi-query, more keys than queries, a position bias
    (2, 2, 3, 4, False, 0.3, [2, 1, 1, 4]),  # a padding mask's shape
])
@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("statistics", [False, True])
def test_attention(heads, kv_heads, queries, keys, causal, scale, bias, heads_first, statistics):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")

    def shape(heads: int, positions: int) -> list[int]:
        return [2, heads, positions, 8] if heads_first else [2, positions, heads, 8]

    q = f.var("q", rv.DT_FLOAT, shape(heads, queries))
    k = f.var("k", rv.DT_FLOAT, shape(kv_heads, keys))
    v = f.var("v", rv.DT_FLOAT, shape(kv_heads, keys))
    inputs = {q: uniform(q.shape), k: uniform(k.shape), v: uniform(v.shape)}
    if bias is not None:
        bias = f.var("bias", rv.DT_FLOAT, bias)
        inputs[bias] = uniform(bias.shape)
    f.attention(q, k, v, bias, causal=causal, scale=scale, heads_first=heads_first, statistics=statistics, name="attention")
    check(flow, inputs)


def test_rotary():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [2, 5, 3, 8])
    cos, sin = f.array("cos", uniform([5, 4])), f.array("sin", uniform([5, 4]))
    f.rotary(x, cos, sin, name="rotary").var.out = True
    f.rotary(x, cos, sin, inverse=True, name="rotary_back").var.out = True
    check(flow, {x: uniform([2, 5, 3, 8])})


# ---- models ------------------------------------------------------------------------------------------


def test_trained_mnist_mlp_gives_the_same_predictions():
    setup = build_classifier(MLP([784, 64, 10], activation="gelu"), [784], batch=32, eval_batch=100)
    trainer = Trainer(setup.loss, setup.params, AdamW(lr=1e-3), predict=setup.logits, inputs=[setup.x, setup.labels])
    images = RNG.random([256, 784], dtype=np.float32)
    labels = (images[:, :10].argmax(axis=1)).astype(np.int32)
    trainer.set_dataset([images, labels])
    trainer.train(30, progress=False)

    with pytest.raises(RanvierError, match="train, infer"):
        save(setup.flow)
    model = save(setup.flow, function="infer", weights=trainer.state_arrays())
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["infer/x"]
    assert [o.name for o in model.graph.output] == [setup.logits.name]
    (logits,) = session(model).run(None, {"infer/x": images[:100]})
    expected = trainer.evaluate(images[:100])
    assert_close(logits, expected, "logits")
    np.testing.assert_array_equal(logits.argmax(axis=1), expected.argmax(axis=1))
    # Without the trained weights, the export holds the initial ones.
    (initial,) = session(save(setup.flow, function="infer")).run(None, {"infer/x": images[:100]})
    assert np.abs(initial - logits).max() > 1e-3


def test_mnist_cnn():
    setup = build_classifier(CNN(channels=(4, 8)), [1, 28, 28], batch=8, eval_batch=4)
    check(setup.flow, {"infer/x": RNG.random([4, 1, 28, 28], dtype=np.float32)}, function="infer")


def test_llama_forward():
    config = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=67, hidden_dim=88, max_seq_len=16)
    model = Llama(config, seed=3)
    for key, value in model.initial.items():  # weights under which every part of the model matters
        model.initial[key] = (value + RNG.normal(0, 0.3, value.shape)).astype(np.float32)
    flow = rv.Flow()
    b = rv.Builder(flow, "forward")
    tokens = b.var("tokens", rv.DT_INT32, [2, 12])
    model(b, tokens).var.out = True
    exported = check(flow, {tokens: RNG.integers(0, config.vocab_size, [2, 12]).astype(np.int32)})
    assert {"Gather", "MatMul", "Softmax", "Sigmoid"} <= node_types(exported)


# ---- choosing what goes out, files and errors ----------------------------------------------------------------


def small_flow():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [2, 16])
    W = f.parameter("W", uniform([16, 32]))
    h = f.tanh(x @ W, name="h")
    y = f.softmax(h, name="y")
    return flow, x, W, h, y


def test_inputs_and_outputs_can_be_chosen():
    flow, x, _, h, _ = small_flow()
    model = save(flow, inputs=[x, "f/W"], outputs=[h])
    assert [i.name for i in model.graph.input] == ["f/x", "f/W"]
    assert [o.name for o in model.graph.output] == ["f/h:0"]
    assert not model.graph.initializer and "Softmax" not in node_types(model)
    x_value, W_value = uniform([2, 16]), uniform([16, 32])
    (got,) = session(model).run(None, {"f/x": x_value, "f/W": W_value})
    np.testing.assert_allclose(got, np.tanh(x_value @ W_value), rtol=1e-5, atol=1e-6)


def test_written_atomically(tmp_path):
    flow, *_ = small_flow()
    path = tmp_path / "out" / "model.onnx"
    model = save(flow, path)
    assert onnx.load(path) == model
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx"]


def test_external_data(tmp_path):
    flow, *_ = small_flow()
    path = tmp_path / "model.onnx"
    model = save(flow, path, external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert not onnx.load(path, load_external_data=False).graph.initializer[0].raw_data  # the data is outside
    assert model.graph.initializer[0].raw_data  # the returned model keeps it
    x_value = uniform([2, 16])
    from_file = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"f/x": x_value})
    np.testing.assert_array_equal(from_file[0], session(model).run(None, {"f/x": x_value})[0])


def test_errors():
    flow, _, W, _, _ = small_flow()
    with pytest.raises(RanvierError, match="no function 'g'.*has f"):
        save(flow, function="g")
    with pytest.raises(RanvierError, match="opset 12"):
        save(flow, opset=12)
    with pytest.raises(RanvierError, match="no data for f/x"):
        save(flow, inputs=[W])
    with pytest.raises(RanvierError, match=r"weights for f/W have shape \[3, 4\]"):
        save(flow, weights={"f/W": np.zeros([3, 4], np.float32)})
    g = rv.Builder(flow, "g")
    z = g.var("z", rv.DT_FLOAT, [2])
    with pytest.raises(RanvierError, match="output g/z is not computed by function f"):
        save(flow, function="f", outputs=[z])


def test_an_op_without_mapping_is_named():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    indices = f.var("indices", rv.DT_INT32, [3])
    f.scatter_add(indices, f.var("updates", rv.DT_FLOAT, [3, 2]), rows=5, name="scatter")
    with pytest.raises(UnknownOpError, match="op f/scatter of type ScatterAdd has no ONNX mapping"):
        save(flow)
