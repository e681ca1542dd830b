"""ONNX import against ONNX Runtime: models exported by torch.onnx.export from randomly
initialised modules, and one-node models built with onnx.helper for every converter, load,
compile on the CPU backend and give ORT's outputs on random inputs (float32: max abs error
/ max abs value < 1e-5). Also symbolic dimensions, external data, and the errors unsupported
or invalid nodes give (mutated models: test_onnx_fuzz.py).
"""

from __future__ import annotations

import io
import os
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import ranvier  # noqa: E402
import ranvier.onnx as ro  # noqa: E402
from ranvier.errors import RanvierError, UnknownOpError  # noqa: E402
from ranvier.onnx import OnnxError  # noqa: E402
from ranvier.onnx.node import CONVERTERS  # noqa: E402

RNG = np.random.default_rng(15)
TOLERANCE = 1e-5

# PyTorch's exporters warn about themselves (the TorchScript one is deprecated, and traces
# Python-side checks as constants); the tests use both on purpose.
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Converting a tensor to a Python"),
]


@dataclass
class Known:
    """A node input given as an initializer (known at load time), not fed at run time."""

    value: np.ndarray


def rand(*shape, low=None, high=None, dtype=np.float32) -> np.ndarray:
    """Random values, normal unless a range is given; never all zeros."""
    values = RNG.standard_normal(shape) if low is None else RNG.uniform(low, high, shape)
    return np.asarray(values, dtype)


def known(*values, dtype=np.int64) -> Known:
    return Known(np.asarray(values, dtype))


def build(nodes, values: dict, outputs, opset: int = 17) -> onnx.ModelProto:
    """A model over `values`: arrays are graph inputs, `Known`s initializers. The outputs
    are left untyped; `check` types them from ORT's results."""
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for name, v in values.items() if not isinstance(v, Known)]
    initializers = [numpy_helper.from_array(v.value, name) for name, v in values.items() if isinstance(v, Known)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_empty_tensor_value_info(o) for o in outputs], initializers)
    opsets = [helper.make_opsetid("", opset)]
    if any(n.domain == "com.microsoft" for n in nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    return helper.make_model(graph, opset_imports=opsets)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


def run_ranvier(model, feeds: dict, outputs, dims=None, backend: str = "cpu") -> list[np.ndarray]:
    cell = ranvier.Compiler(backend).compile(ro.load(model, dims=dims)).cell("main")
    data = cell.instance()
    for name, value in feeds.items():
        if name in cell:  # an input whose shape alone is read folds away
            data[name] = value
    data.compute()
    return [np.array(data[name]) for name in outputs]


def assert_matches(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, ORT {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, ORT {expected.dtype}"
    if expected.dtype.kind == "f":
        error = np.abs(actual - expected).max(initial=0) / max(np.abs(expected).max(initial=0), 1e-30)
        assert error < TOLERANCE, f"{what}: relative error {error:.2e}"
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def check(model: onnx.ModelProto, feeds: dict, dims=None, backend: str = "cpu") -> None:
    """Run the model in ORT and ranvier and compare every output."""
    expected = run_ort(model, feeds)
    outputs = [o.name for o in model.graph.output]
    if not model.graph.output[0].type.HasField("tensor_type"):  # built by `build`: type them as ORT found them
        del model.graph.output[:]
        model.graph.output.extend(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(e.dtype), e.shape)
                                  for name, e in zip(outputs, expected))
    for name, actual, e in zip(outputs, run_ranvier(model, feeds, outputs, dims, backend), expected):
        assert_matches(actual, e, name)


def check_node(op: str, values: dict, *, inputs=None, outputs=("y",), opset=17, domain="", **attrs) -> None:
    """One node reading `values` (in order, unless `inputs` names them) into `outputs`."""
    node = helper.make_node(op, list(inputs or values), list(outputs), domain=domain or None, **attrs)
    check(build([node], values, outputs, opset), {k: v for k, v in values.items() if not isinstance(v, Known)})


def case(op: str, values: dict, *, id: str = "", **kwargs):
    return pytest.param(op, values, kwargs, id=f"{op}-{id}" if id else op)


# ---- one node per converter ----------------------------------------------------------------------

# Each unary operator on inputs inside its domain.
UNARY_INPUTS = {
    "Log": rand(3, 4, low=0.1, high=3), "Sqrt": rand(3, 4, low=0.1, high=3), "Reciprocal": rand(3, 4, low=0.5, high=2),
    "Asin": rand(3, 4, low=-0.9, high=0.9), "Acos": rand(3, 4, low=-0.9, high=0.9),
    "Atanh": rand(3, 4, low=-0.9, high=0.9), "Acosh": rand(3, 4, low=1.1, high=3), "Not": rand(3, 4) > 0,
}
UNARY = ["Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Erf", "Floor", "Ceil", "Round",
         "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Sign", "Not",
         "Softplus", "Softsign", "Identity"]

X34 = rand(3, 4)
X234 = rand(2, 3, 4)
IMAGE = rand(2, 3, 7, 8)
INTS = RNG.integers(-3, 4, (2, 3, 4)).astype(np.int64)

def _attention_mask(*shape) -> np.ndarray:
    """A boolean mask (True: attend) that leaves every query its first key."""
    mask = RNG.random(shape) < 0.6
    mask[..., 0] = True
    return mask


Q4, K4, V4 = rand(2, 4, 3, 8), rand(2, 2, 5, 8), rand(2, 2, 5, 8)
ATTENTION_CASES = [  # ONNX's Attention (opset 23)
    case("Attention", {"q": Q4, "k": K4, "v": V4}, opset=23, id="grouped"),
    case("Attention", {"q": Q4, "k": K4, "v": V4, "m": _attention_mask(2, 1, 3, 5)}, opset=23, id="boolean-mask"),
    case("Attention", {"q": Q4, "k": K4, "v": V4, "m": rand(2, 4, 3, 5)}, opset=23, scale=0.3, id="float-mask-scale"),
    case("Attention", {"q": rand(2, 3, 32), "k": rand(2, 5, 16), "v": rand(2, 5, 16)}, opset=23, q_num_heads=4,
         kv_num_heads=2, id="3d"),
    case("Attention", {"q": Q4, "k": K4, "v": V4, "m": _attention_mask(2, 1, 3, 5) & np.array([True, False, True])[:, None]},
         opset=23, id="a-query-sees-no-key"),  # its row is 0 (the operator's errata), not 0/0
    case("Attention", {"q": rand(2, 4, 5, 8), "k": K4, "v": V4}, opset=23, is_causal=1, id="causal"),
    case("Attention", {"q": Q4, "k": K4, "v": V4}, opset=23, is_causal=1, id="causal-more-keys-than-queries"),
    case("Attention", {"q": rand(1, 4, 1, 8), "k": rand(1, 2, 1, 8), "v": rand(1, 2, 1, 8), "pk": rand(1, 2, 4, 8),
                       "pv": rand(1, 2, 4, 8)}, inputs=["q", "k", "v", "", "pk", "pv"], outputs=("y", "present_key", "present_value"),
         opset=23, is_causal=1, id="cached"),
    # Computed op by op: a softcap, the scores output, values of another head size than the keys'.
    case("Attention", {"q": Q4, "k": K4, "v": V4, "m": rand(2, 4, 3, 5)}, opset=23, softcap=2.0, id="softcap"),
    *(case("Attention", {"q": Q4, "k": K4, "v": V4, "m": mask}, opset=23, softcap=1.5, qk_matmul_output_mode=mode,
           outputs=("y", "present_key", "present_value", "qk"), id=f"qk-output-mode{mode}")
      for mode, mask in [(1, _attention_mask(2, 1, 3, 5)), (2, rand(2, 4, 3, 5)), (3, _attention_mask(2, 1, 3, 5))]),
    case("Attention", {"q": Q4, "k": K4, "v": rand(2, 2, 5, 6)}, opset=23, is_causal=1, id="values-of-other-head-size"),
]

NODE_CASES = [
    *(case(op, {"x": UNARY_INPUTS.get(op, rand(3, 4) * 2)}) for op in UNARY),
    # Binary operators broadcast both ways: [2,3,1] with [4] gives [2,3,4].
    *(case(op, {"a": rand(2, 3, 1), "b": rand(4)}) for op in ("Add", "Sub", "Mul", "Div")),
    case("Pow", {"a": rand(2, 3, 1, low=0.5, high=2), "b": rand(4)}),
    case("Add", {"a": X234, "b": Known(rand(3, 1))}, id="known"),
    case("Mul", {"a": rand(), "b": Known(np.float32(2.5))}, id="scalars"),
    *(case(op, {"a": INTS, "b": RNG.integers(-3, 4, (3, 1)).astype(np.int64)})
      for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")),
    case("Less", {"a": rand(2, 3, 4), "b": rand(3, 4)}, id="float"),
    *(case(op, {"a": rand(2, 3, 4) > 0, "b": rand(4) > 0}) for op in ("And", "Or", "Xor")),
    *(case(op, {"a": rand(2, 3, 4), "b": rand(3, 1), "c": rand(4)}) for op in ("Max", "Min", "Sum", "Mean")),
    case("Max", {"a": X34}, id="one"),
    case("Where", {"c": rand(3, 1) > 0, "a": rand(2, 3, 4), "b": rand(4)}),
    case("Clip", {"x": X234, "lo": Known(np.float32(-0.5)), "hi": Known(np.float32(0.7))}, opset=13),
    case("Clip", {"x": X234, "lo": Known(np.float32(-0.5))}, id="min-only"),
    case("Clip", {"x": X234, "hi": Known(np.float32(0.3))}, inputs=["x", "", "hi"], id="max-only"),
    case("Clip", {"x": X234}, id="none"),
    case("Clip", {"x": X234}, opset=6, min=-0.5, max=0.25, id="attributes"),
    case("LeakyRelu", {"x": X234}, alpha=0.2),
    case("LeakyRelu", {"x": X234}, id="default"),
    case("Gelu", {"x": X234 * 3}, opset=20),
    case("Gelu", {"x": X234 * 3}, opset=20, approximate="tanh", id="tanh"),
    case("Cast", {"x": X234 * 5}, to=TensorProto.INT64, id="to-int64"),
    case("Cast", {"x": INTS}, to=TensorProto.FLOAT, id="to-float"),
    case("Cast", {"x": INTS}, to=TensorProto.BOOL, id="to-bool"),
    case("Cast", {"x": X234}, to=TensorProto.FLOAT, id="same"),
    case("CastLike", {"x": INTS, "like": Known(np.float32([1.0]))}),
    # MatMul: numpy's rules, 1-D operands and batch broadcasting.
    case("MatMul", {"a": rand(3, 4), "b": rand(4, 5)}),
    case("MatMul", {"a": rand(4), "b": rand(4, 5)}, id="vector-left"),
    case("MatMul", {"a": rand(2, 3, 4), "b": rand(4)}, id="vector-right"),
    case("MatMul", {"a": rand(4), "b": rand(4)}, id="dot"),
    case("MatMul", {"a": rand(2, 1, 3, 4), "b": rand(3, 4, 5)}, id="batch-broadcast"),
    case("MatMul", {"a": rand(2, 3, 4), "w": Known(rand(4, 5))}, id="known-weight"),
    case("Gemm", {"a": rand(3, 4), "b": rand(4, 5), "c": rand(5)}),
    case("Gemm", {"a": rand(4, 3), "b": Known(rand(5, 4)), "c": Known(rand(3, 1))},
         transA=1, transB=1, alpha=0.5, beta=2.0, id="transposed-scaled"),
    case("Gemm", {"a": rand(3, 4), "b": rand(4, 5)}, alpha=1.5, id="no-c"),
    case("Gemm", {"a": rand(3, 4), "b": rand(4, 5), "c": Known(rand(3, 5))}, beta=0.0, id="beta-0"),
    # Softmax before opset 13 flattens the axes from `axis` on; from 13 it is one axis.
    case("Softmax", {"x": X234}, opset=11, axis=1, id="opset11-axis1"),
    case("Softmax", {"x": X234}, opset=11, id="opset11-default"),
    case("Softmax", {"x": X234}, opset=13, axis=1, id="opset13-axis1"),
    case("Softmax", {"x": X234}, opset=13, id="opset13-default"),
    case("LogSoftmax", {"x": X234}, opset=11, axis=0, id="opset11-axis0"),
    case("LogSoftmax", {"x": X234}, opset=13, axis=-2, id="opset13-axis-2"),
    case("LayerNormalization", {"x": X234, "g": Known(rand(4)), "b": Known(rand(4))}),
    case("LayerNormalization", {"x": X234, "g": Known(rand(3, 4))}, axis=-2, epsilon=1e-3, id="axis-2-no-bias"),
    case("LayerNormalization", {"x": X234, "g": rand(4), "b": rand(4)}, id="fed-scale"),
    case("LayerNormalization", {"x": X234, "g": Known(rand(1)), "b": Known(rand(3, 1))}, axis=1, id="broadcast-scale-bias"),
    case("LayerNormalization", {"x": X234 * 3 + 1, "g": Known(rand(3, 4))}, axis=1, outputs=("y", "mean", "inv_std"),
         id="mean-and-inverse-std"),
    # Shapes.
    case("Reshape", {"x": X234, "s": known(0, -1, 2)}),
    case("Reshape", {"x": X234, "s": known(-1)}, id="flat"),
    case("Reshape", {"x": X234, "s": known(4, 0, 2)}, opset=14, allowzero=0, id="zero-copies"),
    case("Flatten", {"x": IMAGE}),
    case("Flatten", {"x": IMAGE}, axis=0, id="axis0"),
    case("Flatten", {"x": IMAGE}, axis=-2, id="axis-2"),
    case("Transpose", {"x": IMAGE}, perm=[0, 2, 3, 1]),
    case("Transpose", {"x": X234}, id="reversed"),
    case("Concat", {"a": X234, "b": Known(rand(2, 1, 4)), "c": rand(2, 2, 4)}, axis=-2),
    case("Concat", {"a": X234, "b": rand(2, 3, 1)}, axis=2, id="last"),
    case("Unsqueeze", {"x": X234}, opset=11, axes=[0, -1], id="opset11"),
    case("Unsqueeze", {"x": X234, "axes": known(1, -1)}, opset=13, id="opset13"),
    case("Squeeze", {"x": rand(1, 3, 1, 4)}, opset=11, axes=[2], id="opset11"),
    case("Squeeze", {"x": rand(1, 3, 1, 4), "axes": known(-2, 0)}, opset=13, id="opset13"),
    case("Squeeze", {"x": rand(1, 3, 1, 4)}, opset=13, id="all-ones"),
    case("Split", {"x": rand(2, 7, 3)}, outputs=("y", "z"), opset=11, axis=1, split=[3, 4], id="opset11-attribute"),
    case("Split", {"x": rand(2, 7, 3), "s": known(5, 2)}, outputs=("y", "z"), opset=13, axis=1, id="opset13-input"),
    case("Split", {"x": rand(6, 3)}, outputs=("y", "z", "w"), opset=13, id="opset13-equal"),
    case("Split", {"x": rand(2, 7, 3)}, outputs=("y", "z"), opset=18, axis=-2, num_outputs=2, id="opset18-uneven"),
    # Slice: negative and out-of-range starts and ends are clamped; steps > 1 stride.
    case("Slice", {"x": rand(5, 6, 7), "s": known(1, -5), "e": known(-1, 1000), "a": known(0, 2)}),
    case("Slice", {"x": rand(5, 6, 7), "s": known(-1000, 1), "e": known(4, 6), "a": known(-2, 2), "t": known(2, 3)},
         id="steps"),
    case("Slice", {"x": rand(5, 6), "s": known(0, 0), "e": known(5, 6)}, id="no-axes"),
    # Gather: constant indices (negatives count from the end) and fed ones, on axis 0 and 1.
    case("Gather", {"x": rand(5, 4), "i": known(-1, 0, 3, -2)}),
    case("Gather", {"x": rand(3, 5, 4), "i": Known(np.int64([[-1, 0], [2, 2]]))}, axis=1, id="axis1-negative"),
    case("Gather", {"x": Known(rand(10, 4)), "i": np.int64([[3, -1, 9], [0, -10, 5]])}, id="fed"),
    case("Gather", {"x": rand(3, 5, 4), "i": np.int64([-2, 4, 0])}, axis=1, id="fed-axis1"),
    case("Gather", {"x": rand(3, 5, 4), "i": np.int32([[1, -4], [3, -1]])}, axis=-1, id="fed-axis-1"),
    case("Expand", {"x": rand(3, 1), "s": known(2, 3, 4)}),
    case("Expand", {"x": X34, "s": known(4)}, id="smaller-shape"),
    case("Trilu", {"x": X234}),
    case("Trilu", {"x": rand(2, 4, 5), "k": Known(np.int64(-1))}, upper=0, id="lower-k-1"),
    case("Trilu", {"x": rand(4, 3), "k": Known(np.int64(1))}, upper=1, id="upper-k1"),
    # Reductions: axes as an attribute (ReduceSum before 13, the others before 18) or an input.
    *(case(op, {"x": X234}, opset=13, axes=[0, -1], keepdims=k, id=f"opset13-keepdims{k}")
      for op in ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare") for k in (0, 1)),
    *(case(op, {"x": X234, "a": known(1)}, opset=18, keepdims=k, id=f"opset18-keepdims{k}")
      for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceSumSquare") for k in (0, 1)),
    case("ReduceSum", {"x": X234}, opset=11, axes=[1], keepdims=0, id="opset11"),
    case("ReduceSum", {"x": X234, "a": known(-1, 0)}, opset=13, id="opset13"),
    case("ReduceMean", {"x": X234}, opset=18, keepdims=0, id="all"),
    case("ReduceSum", {"x": X234}, opset=13, noop_with_empty_axes=1, id="noop"),
    case("ReduceSum", {"x": X234, "a": Known(np.int64([]))}, opset=13, id="empty-axes-all"),
    case("ReduceSum", {"x": X234, "a": Known(np.int64([]))}, opset=13, noop_with_empty_axes=1, id="empty-axes-noop"),
    case("ArgMax", {"x": X234}, axis=1, keepdims=0),
    case("ArgMax", {"x": X234}, id="default"),
    *(case(op, {"x": RNG.integers(0, 3, (2, 3, 4)).astype(np.float32)}, axis=axis, keepdims=k, select_last_index=1,
           id=f"last-axis{axis}-keepdims{k}") for op in ("ArgMax", "ArgMin") for axis, k in ((1, 0), (-1, 1))),
    case("ArgMin", {"x": X234}, axis=-1, keepdims=1),
    # Convolution and pooling over [N, C, H, W].
    case("Conv", {"x": IMAGE, "w": Known(rand(4, 3, 3, 3)), "b": Known(rand(4))}, pads=[1, 1, 1, 1]),
    case("Conv", {"x": IMAGE, "w": rand(4, 3, 3, 2)}, strides=[2, 1], pads=[1, 0, 2, 1], id="asymmetric"),
    case("Conv", {"x": IMAGE, "w": Known(rand(4, 3, 3, 3))}, strides=[2, 2], auto_pad="SAME_UPPER", id="same-upper"),
    case("Conv", {"x": IMAGE, "w": Known(rand(4, 3, 2, 2))}, auto_pad="SAME_LOWER", id="same-lower"),
    case("Conv", {"x": IMAGE, "w": Known(rand(4, 3, 3, 3)), "b": rand(4)}, auto_pad="VALID", strides=[2, 2],
         id="valid"),
    case("MaxPool", {"x": IMAGE}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    case("MaxPool", {"x": -IMAGE - 5}, kernel_shape=[2, 3], pads=[0, 1, 1, 2], id="asymmetric-negative"),
    case("MaxPool", {"x": IMAGE}, kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER", id="same-upper"),
    *(case("AveragePool", {"x": IMAGE}, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=c,
           id=f"count-include-pad{c}") for c in (0, 1)),
    *(case("AveragePool", {"x": IMAGE}, kernel_shape=[2, 3], pads=[1, 0, 0, 2], count_include_pad=c,
           id=f"asymmetric-count-include-pad{c}") for c in (0, 1)),
    case("AveragePool", {"x": IMAGE}, kernel_shape=[2, 2], id="no-pads"),
    case("GlobalAveragePool", {"x": IMAGE}),
    case("GlobalMaxPool", {"x": IMAGE}),
    case("Pad", {"x": X234, "p": known(0, 1, 2, 1, 0, 3), "v": Known(np.float32(1.5))}, opset=13),
    case("Pad", {"x": X234, "p": known(0, 1, 0, 0, 2, 1)}, opset=13, id="zeros"),
    case("Pad", {"x": X234, "p": known(0, 1, 2, 1, 0, 3), "v": Known(np.float32([-1.5]))}, opset=13,
         id="value-of-shape-1"),  # as ONNX's Attention function passes it
    case("Pad", {"x": X234, "p": known(2, 1, 0, 3), "v": Known(np.float32(-2)), "a": known(-1, 0)}, opset=18,
         id="axes"),
    case("Pad", {"x": X234}, opset=2, pads=[0, 1, 1, 0, 2, 0], value=0.5, id="opset2"),
    case("Resize", {"x": IMAGE, "r": known(dtype=np.float32), "s": known(1, 1, 2, 2, dtype=np.float32)},
         opset=13, mode="nearest", id="scales"),
    case("Resize", {"x": IMAGE, "z": known(2, 3, 14, 24)}, inputs=["x", "", "", "z"], opset=13, id="sizes-x2-x3"),
    case("Resize", {"x": IMAGE, "s": known(1, 1, 2, 2, dtype=np.float32)}, inputs=["x", "", "s"], opset=13,
         coordinate_transformation_mode="asymmetric", nearest_mode="floor", id="asymmetric-floor"),
    case("Resize", {"x": IMAGE, "s": known(1, 1, 3, 2, dtype=np.float32)}, inputs=["x", "", "s"], opset=13,
         nearest_mode="round_prefer_ceil", id="x3-round-prefer-ceil"),
    case("Resize", {"x": IMAGE, "s": known(1, 1, 2, 2, dtype=np.float32)}, inputs=["x", "", "s"], opset=13,
         coordinate_transformation_mode="pytorch_half_pixel", id="pytorch-half-pixel"),
    case("Resize", {"x": IMAGE, "s": known(1, 1, 2, 2, dtype=np.float32)}, inputs=["x", "", "s"], opset=13,
         coordinate_transformation_mode="asymmetric", id="asymmetric-round"),
    case("BatchNormalization", {"x": IMAGE, "g": Known(rand(3)), "b": Known(rand(3)), "m": Known(rand(3)),
                                "v": Known(rand(3, low=0.5, high=2))}, epsilon=1e-3),
    case("BatchNormalization", {"x": rand(5, 3), "g": Known(rand(3)), "b": Known(rand(3)), "m": Known(rand(3)),
                                "v": Known(rand(3, low=0.5, high=2))}, opset=9, id="rank2-opset9"),
    case("Dropout", {"x": X234}, opset=13),
    case("Dropout", {"x": X234, "r": Known(np.float32(0.3))}, opset=12, id="ratio"),
    case("Dropout", {"x": X234}, opset=13, outputs=("y", "mask"), id="mask"),
    case("Dropout", {"x": X234, "r": Known(np.float32(0.0)), "t": Known(np.bool_(True))}, opset=13,
         outputs=("y", "mask"), id="training-ratio-0"),
    case("SkipLayerNormalization", {"x": X234, "s": rand(2, 3, 4), "g": Known(rand(4)), "b": Known(rand(4)),
                                    "bias": Known(rand(4))}, domain="com.microsoft", epsilon=1e-5),
    case("SkipLayerNormalization", {"x": X234, "s": rand(2, 3, 4), "g": Known(rand(4))}, domain="com.microsoft",
         id="no-beta"),
    case("FastGelu", {"x": X234 * 3, "b": Known(rand(4))}, domain="com.microsoft"),
    case("FastGelu", {"x": X234 * 3}, domain="com.microsoft", id="no-bias"),
    case("BiasGelu", {"x": X234 * 3, "b": Known(rand(4))}, domain="com.microsoft"),
    case("Upsample", {"x": IMAGE, "s": Known(np.float32([1, 1, 2, 3]))}, opset=9),
    case("Shape", {"x": X234}),
    case("Shape", {"x": IMAGE}, opset=15, start=1, end=-1, id="start-end"),
    case("Size", {"x": IMAGE}),
    *ATTENTION_CASES,
]


@pytest.mark.parametrize("op, values, kwargs", NODE_CASES)
def test_node(op, values, kwargs):
    check_node(op, values, **kwargs)


def test_shape_arithmetic_folds():
    """What the TorchScript exporter writes for `x.view(x.shape[0], -1)`, `arange(x.shape[1])` and
    `zeros_like(x)`: it all folds at load, leaving only the arithmetic on x."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Gather", ["s", "one"], ["m"], axis=0),
        helper.make_node("Range", ["start", "m", "step"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("ConstantOfShape", ["s"], ["ones"], value=numpy_helper.from_array(np.float32([2.0]))),
        helper.make_node("Mul", ["x", "ones"], ["x2"]),
        helper.make_node("Add", ["x2", "rf"], ["y"]),
    ]
    values = {"x": rand(3, 4, 4), "zero": Known(np.int64(0)), "one": Known(np.int64(1)), "axes": known(0),
              "minus_one": known(-1), "start": Known(np.int64(0)), "step": Known(np.int64(1))}
    model = build(nodes, values, ["flat", "y"])
    check(model, {"x": values["x"]})
    ops = {op.type for op in ro.load(model).ops.values()}
    assert not ops & {"Shape", "Range", "ConstantOfShape", "Gather", "Concat"}, ops


# ---- models exported by torch.onnx.export --------------------------------------------------------

nn = torch.nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 32), nn.GELU(), nn.Linear(32, 10), nn.LogSoftmax(-1))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    """A ResNet basic block; a strided or widening one has a projection shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(),
                                  nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False), nn.BatchNorm2d(outputs))
        self.shortcut = nn.Identity() if stride == 1 and inputs == outputs else \
            nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class Encoder(nn.Module):
    """BERT-style: token and position embeddings, post-norm layers, a padding mask."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.position = nn.Parameter(torch.randn(16, 32) * 0.1)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, ids, mask):
        return self.layers(self.embed(ids) + self.position[: ids.shape[1]], src_key_padding_mask=mask == 0)


class GPT(nn.Module):
    """GPT-2-style: pre-norm blocks, causal attention, tanh GELU, an untied head."""

    def __init__(self, vocab=100, dim=32, heads=4, layers=2, context=16):
        super().__init__()
        self.wte, self.wpe, self.heads = nn.Embedding(vocab, dim), nn.Embedding(context, dim), heads
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim),
            "ln2": nn.LayerNorm(dim), "fc": nn.Linear(dim, 4 * dim), "out": nn.Linear(4 * dim, dim),
        }) for _ in range(layers))
        self.lnf, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        batch, length = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(length))
        for b in self.blocks:
            q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                       for t in b["qkv"](b["ln1"](x)).split(x.shape[-1], -1))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b["proj"](y.transpose(1, 2).reshape(batch, length, -1))
            x = x + b["out"](nn.functional.gelu(b["fc"](b["ln2"](x)), approximate="tanh"))
        return self.head(self.lnf(x))


def family(name: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """A randomly initialised module (BatchNorm with random running statistics) and inputs."""
    torch.manual_seed(0)
    module, inputs = {
        "mlp": lambda: (MLP(), [torch.randn(4, 20)]),
        "cnn": lambda: (CNN(), [torch.randn(2, 3, 32, 32)]),
        "bert": lambda: (Encoder(), [torch.randint(0, 100, (2, 16)), torch.tensor([[1] * 16, [1] * 10 + [0] * 6])]),
        "gpt": lambda: (GPT(), [torch.randint(0, 100, (2, 16))]),
    }[name]()
    for norm in (m for m in module.modules() if isinstance(m, nn.BatchNorm2d)):
        norm.running_mean.normal_(0, 0.5)
        norm.running_var.uniform_(0.5, 2)
        norm.weight.data.normal_(1, 0.3)
        norm.bias.data.normal_(0, 0.3)
    return module.eval(), inputs


def export(module: nn.Module, inputs: list[torch.Tensor], dynamo: bool, **options) -> onnx.ModelProto:
    if dynamo:
        return torch.onnx.export(module, tuple(inputs), dynamo=True, verbose=False, **options).model_proto
    buffer = io.BytesIO()
    torch.onnx.export(module, tuple(inputs), buffer, dynamo=False, **options)
    return onnx.load_from_string(buffer.getvalue())


def graph_inputs(model: onnx.ModelProto) -> list[str]:
    initializers = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


EXPORTS = [("mlp", True), ("cnn", True), ("bert", True), ("gpt", True), ("cnn", False), ("bert", False), ("gpt", False)]


@pytest.fixture(scope="module", params=EXPORTS, ids=[f"{n}-{'dynamo' if d else 'torchscript'}" for n, d in EXPORTS])
def exported(request) -> tuple[onnx.ModelProto, dict]:
    name, dynamo = request.param
    module, inputs = family(name)
    model = export(module, inputs, dynamo)
    return model, {n: t.numpy() for n, t in zip(graph_inputs(model), inputs)}


def test_exported_model(exported):
    model, feeds = exported
    check(model, feeds)


def test_exported_model_on_the_cuda_backends_device(exported, monkeypatch):
    """The same models compiled for the GPU, run on the host emulation of the device."""
    from ranvier.backends.cuda import device

    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    model, feeds = exported
    check(model, feeds, backend="cuda")


# ---- symbolic dimensions, external data -----------------------------------------------------------


@pytest.fixture(scope="module")
def dynamic_gpt() -> onnx.ModelProto:
    """The GPT decoder with a symbolic batch and sequence length."""
    module, inputs = family("gpt")
    shapes = {"ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=16)}}
    return export(module, inputs, True, input_names=["ids"], dynamic_shapes=shapes)


@pytest.mark.parametrize("batch, seq", [(1, 5), (3, 16)])
def test_symbolic_dims(dynamic_gpt, batch, seq):
    assert [d.dim_param for d in dynamic_gpt.graph.input[0].type.tensor_type.shape.dim] == ["batch", "seq"]
    check(dynamic_gpt, {"ids": RNG.integers(0, 100, (batch, seq))}, dims={"batch": batch, "seq": seq})


def test_unbound_dim_is_named(dynamic_gpt):
    with pytest.raises(OnnxError, match=r"'ids'.*'seq'.*dims=\{'seq': N\}"):
        ro.load(dynamic_gpt, dims={"batch": 2})


def test_unknown_dims_name_is_refused(dynamic_gpt):
    with pytest.raises(OnnxError, match=r"\['beam'\].*\['batch', 'seq'\]"):
        ro.load(dynamic_gpt, dims={"batch": 2, "seq": 4, "beam": 3})


def test_external_data(tmp_path):
    values = {"x": rand(2, 8), "w": Known(rand(8, 6)), "b": Known(rand(6))}
    model = build([helper.make_node("Gemm", ["x", "w", "b"], ["y"])], values, ["y"])
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6]))
    onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="w.data", size_threshold=0)
    assert (tmp_path / "w.data").stat().st_size == (8 * 6 + 6) * 4
    feeds = {"x": values["x"]}
    [expected] = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, feeds)
    [actual] = run_ranvier(tmp_path / "m.onnx", feeds, ["y"])
    assert_matches(actual, expected, "y")


def external_model(folder) -> tuple[onnx.ModelProto, bytes]:
    """A Gemm whose weight is external data in `folder`/w.data, saved by onnx itself; the
    model as saved, and the data file's bytes."""
    folder.mkdir()
    values = {"x": rand(2, 8), "w": Known(rand(8, 6))}
    model = build([helper.make_node("MatMul", ["x", "w"], ["y"])], values, ["y"])
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6]))
    onnx.save_model(model, folder / "m.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    return onnx.load(folder / "m.onnx", load_external_data=False), (folder / "w.data").read_bytes()


def set_external(model: onnx.ModelProto, **entries: str) -> None:
    [weight] = model.graph.initializer
    for entry in weight.external_data:
        if entry.key in entries:
            entry.value = entries.pop(entry.key)
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)


def outside_file(folder, data: bytes):
    secret = folder.parent / "secret.bin"
    secret.write_bytes(bytes(reversed(data)))  # the same size as the weight: a reader that follows it would load it
    return secret


EXTERNAL_REFUSED = {
    "a linked file": (lambda folder, data: (folder / "w.data").unlink() or (folder / "w.data").symlink_to(
        outside_file(folder, data)), {}, "symbolic link, w.data"),
    "a linked folder": (lambda folder, data: (folder / "d").symlink_to(outside_file(folder, data).parent),
                        {"location": "d/secret.bin"}, "symbolic link, d"),
    "a path up": (outside_file, {"location": "../secret.bin"}, "not a path inside"),
    "an absolute path": (outside_file, {"location": "/etc/passwd"}, "not a path inside"),
    "a missing file": (lambda folder, data: (folder / "w.data").unlink(), {}, "does not exist"),
    "a folder": (lambda folder, data: (folder / "sub").mkdir(), {"location": "sub"}, "not a regular file"),
    "a FIFO": (lambda folder, data: os.mkfifo(folder / "pipe"), {"location": "pipe"}, "not a regular file"),
    "a short file": (lambda folder, data: (folder / "w.data").write_bytes(data[:-4]), {}, r"bytes 0 to 192 .* 188"),
    "an offset past the end": (lambda folder, data: None, {"offset": "8"}, r"bytes 8 to 200 .* 192"),
    "a length past the end": (lambda folder, data: None, {"length": "4096"}, r"length 4096 is not the 192 bytes"),
    "a negative offset": (lambda folder, data: None, {"offset": "-8"}, r"bytes -8 to 184"),
    "a length that is no number": (lambda folder, data: None, {"length": "lots"}, "not a whole number"),
}


@pytest.mark.parametrize("case", EXTERNAL_REFUSED)
def test_external_data_outside_the_models_folder_is_refused(case, tmp_path):
    """Whatever the onnx package would do (before 1.21 it follows links anywhere), ranvier
    reads external data only from regular files inside the model's folder, reached through
    no symbolic link, within their length."""
    folder = tmp_path / "model"
    model, data = external_model(folder)
    prepare, entries, reason = EXTERNAL_REFUSED[case]
    prepare(folder, data)
    set_external(model, **entries)
    onnx.save_model(model, folder / "m.onnx")
    with pytest.raises(OnnxError, match=rf"m.onnx: tensor 'w'.*{reason}"):
        ro.load(folder / "m.onnx")


def test_external_data_needs_the_models_file(tmp_path):
    model, _ = external_model(tmp_path / "model")
    with pytest.raises(OnnxError, match="tensor 'w' keeps its data in a file beside the model"):
        ro.load(model)


# ---- errors ------------------------------------------------------------------------------------------


def model_with(node: onnx.NodeProto, values: dict, opset: int = 17) -> onnx.ModelProto:
    """A one-node model whose output types come from ONNX's shape inference (ORT may not run it)."""
    model = onnx.shape_inference.infer_shapes(build([node], values, node.output, opset))
    for output in model.graph.output:
        if not output.type.HasField("tensor_type"):  # inference gave up on an invalid node: any type will do
            output.CopyFrom(helper.make_tensor_value_info(output.name, TensorProto.FLOAT, []))
    return model


@pytest.mark.parametrize("op, values, attrs", [
    ("Bernoulli", {"x": rand(3, 4, low=0.1, high=0.9)}, {}),
    ("RandomUniformLike", {"x": X34}, {}),
])
def test_unsupported_operator_is_named(op, values, attrs):
    model = model_with(helper.make_node(op, list(values), ["y"], name="the_node", **attrs), values)
    with pytest.raises(UnknownOpError, match=rf"{op} \(domain ai.onnx, opset 17\) of node 'the_node'"):
        ro.load(model)


W333 = Known(rand(4, 3, 3, 3))
REFUSED = [
    ("Slice", {"x": X34, "s": known(0), "e": known(3), "a": known(1), "t": known(0)}, {}, "'step' cannot be 0"),
    ("Pad", {"x": X34, "p": known(1, 1, 1, 1)}, {"mode": "mirror"}, "mode 'mirror'"),
    ("Resize", {"x": IMAGE, "r": known(dtype=np.float32), "s": known(1, 1, 2, 2, dtype=np.float32)},
     {"mode": "area"}, "mode 'area' is not one of nearest, linear, cubic"),
    ("Gather", {"x": X34, "i": known(4)}, {}, "outside"),
    ("Gemm", {"a": X34, "b": Known(rand(4, 5)), "c": Known(rand(2, 1, 5))}, {},
     r"its C of shape \[2, 1, 5\] does not broadcast to the product's \[3, 5\]"),
    ("Gemm", {"a": X34, "b": Known(rand(4, 5)), "c": Known(rand(3, 2))}, {"beta": 0.0}, "its C of shape"),
    ("Conv", {"x": IMAGE, "w": W333}, {"kernel_shape": [5, 5]}, r"kernel_shape \[5, 5\] contradicts its weight's window \[3, 3\]"),
    # Found by test_onnx_fuzz.py: each was taken (the bias and scale reshaped, the axis taken modulo the rank).
    ("Conv", {"x": IMAGE, "w": W333, "b": Known(rand(1, 4))}, {}, r"bias of shape \[1, 4\] is not one value per output channel"),
    ("Conv", {"x": IMAGE, "w": W333}, {"pads": [1, 1, 1, 1], "auto_pad": "SAME_UPPER"}, "both pads and auto_pad"),
    ("LayerNormalization", {"x": X234, "g": Known(rand(4)), "b": Known(rand(4, 1))}, {},
     r"bias of shape \[4, 1\] does not broadcast to the normalized axes \[4\]"),
    ("LayerNormalization", {"x": X234, "g": Known(rand(4))}, {"axis": 35}, r"axis 35 is outside \[-3, 3\)"),
    ("ReduceSum", {"x": X234, "a": Known(np.int64([[1]]))}, {}, r"its axes \(input 1\) is int64\[1x1\], not a vector"),
]


@pytest.mark.parametrize("op, values, attrs, reason", REFUSED, ids=[f"{r[0]}-{r[3]}" for r in REFUSED])
def test_refused_node_is_named(op, values, attrs, reason):
    model = model_with(helper.make_node(op, list(values), ["y"], name="the_node", **attrs), values)
    with pytest.raises(OnnxError, match=rf"'the_node' \({op}, opset 17\).*{reason}"):
        ro.load(model)


def test_refused_attention_is_named():
    """The scores output of mode 0 with a softcap: ONNX's reference gives the softcapped
    scores where its specification says the raw ones; refused rather than guessed."""
    values = {"q": Q4, "k": K4, "v": V4}
    outputs = ["y", "present_key", "present_value", "qk"]
    node = helper.make_node("Attention", list(values), outputs, name="the_node", softcap=2.0, qk_matmul_output_mode=0)
    with pytest.raises(OnnxError, match=r"'the_node' \(Attention, opset 23\).*qk_matmul_output_mode=0 with softcap=2.0"):
        ro.load(model_with(node, values, opset=23))


def test_opset_23_exports_attention_as_one_node():
    """The dynamo exporter at opset 23 writes SDPA as ONNX's Attention node; ranvier's
    outputs equal ONNX Runtime's on the opset-20 export of the same module (ORT's own
    Attention refuses the encoder's [B, 1, 1, S] padding mask)."""
    for name in ("bert", "gpt"):
        module, inputs = family(name)
        model = export(module, inputs, True, opset_version=23)
        assert any(node.op_type == "Attention" for node in model.graph.node)
        feeds = {n: t.numpy() for n, t in zip(graph_inputs(model), inputs)}
        oracle = export(module, inputs, True)
        expected = run_ort(oracle, {n: t.numpy() for n, t in zip(graph_inputs(oracle), inputs)})
        outputs = [o.name for o in model.graph.output]
        for name_, actual, e in zip(outputs, run_ranvier(model, feeds, outputs), expected):
            assert_matches(actual, e, name_)


def test_declared_output_types_are_checked():
    model = model_with(helper.make_node("Relu", ["x"], ["y"]), {"x": X34})
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    with pytest.raises(OnnxError, match="graph output 'y' is declared int64 but its node computes float32"):
        ro.load(model)


def test_declared_value_types_are_checked():
    """Intermediate values' declared types are held to what their nodes compute, as ONNX
    Runtime holds them; one declared without an element type is refused as it refuses it."""
    model = model_with(helper.make_node("Relu", ["x"], ["y"]), {"x": X34})
    model.graph.value_info.append(helper.make_tensor_value_info("y", TensorProto.INT32, [3, 4]))
    with pytest.raises(OnnxError, match="value 'y' is declared int32 but its node computes float32"):
        ro.load(model)
    model.graph.value_info[-1].type.tensor_type.elem_type = TensorProto.UNDEFINED
    with pytest.raises(OnnxError, match="value 'y' is declared a tensor_type of element type 0"):
        ro.load(model)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.UNDEFINED
    del model.graph.value_info[:]
    with pytest.raises(OnnxError, match="graph output 'y' is declared a tensor_type of element type 0"):
        ro.load(model)


def test_an_initializer_of_negative_dims_is_refused():
    model = model_with(helper.make_node("Add", ["x", "one"], ["y"]), {"x": X34, "one": Known(np.float32([1.0]))})
    model.graph.initializer[0].dims[0] = -(2**31)  # onnx 1.16 took it for [-1], a one-element tensor
    with pytest.raises(OnnxError, match=r"(?i)negative dimension"):  # onnx 1.23's checker says so first
        ro.load(model)


def test_a_graph_without_outputs_is_refused():
    model = model_with(helper.make_node("Relu", ["x"], ["y"]), {"x": X34})
    del model.graph.output[:]
    with pytest.raises(OnnxError, match="the model's graph has no outputs"):
        ro.load(model)


def test_an_opset_newer_than_onnx_knows_is_refused():
    model = model_with(helper.make_node("Relu", ["x"], ["y"]), {"x": X34})
    model.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    with pytest.raises(OnnxError, match=rf"opset {onnx.defs.onnx_opset_version() + 1} of ONNX's operators; .* knows them "
                                        rf"up to opset {onnx.defs.onnx_opset_version()}"):
        ro.load(model)


def test_input_names_that_clean_alike_stay_apart():
    """"x/y", "x:y" and "x_y" are all x_y as flow names; each is its own input."""
    nodes = [helper.make_node("Add", ["x/y", "x:y"], ["s"]), helper.make_node("Mul", ["s", "x_y"], ["y"])]
    check(build(nodes, {"x/y": rand(3, 4), "x:y": rand(3, 4), "x_y": rand(3, 4)}, ["y"]),
          {"x/y": rand(3, 4), "x:y": rand(3, 4), "x_y": rand(3, 4)})


def test_folded_nodes_are_type_checked():
    """A node folded at load is checked against its operator's schema as ONNX Runtime checks
    it: a Softmax of integers is refused (ONNX's reference evaluator computed [0, 1, 0, 0])."""
    node = helper.make_node("Softmax", ["c"], ["y"], name="the_node")
    model = helper.make_model(helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
                                                [numpy_helper.from_array(np.int64([1, 5, 2, 3]), "c")]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(OnnxError, match=r"'the_node' \(Softmax, opset 17\): is invalid: .*unsupported type: tensor\(int64\)"):
        ro.load(model)


def test_a_converters_mistake_is_named(monkeypatch):
    """What a converter returns is held to the type and shape ONNX infers for the node."""
    monkeypatch.setitem(CONVERTERS, "Relu", lambda node: node.tensor(0).transpose([1, 0]))
    with pytest.raises(OnnxError, match=r"'the_node' \(Relu, opset 17\): its output 'y' came out float32\[4x3\] "
                                        r"where ONNX infers float32\[3x4\]"):
        ro.load(model_with(helper.make_node("Relu", ["x"], ["y"], name="the_node"), {"x": X34}))


def constant_of_shape_model(*shape: int) -> onnx.ModelProto:
    """The 114-byte model of issue 53: a ConstantOfShape folded at load, summed."""
    nodes = [helper.make_node("ConstantOfShape", ["s"], ["c"], name="the_node"),
             helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.int64(shape), "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shape, limit_mb, size", [((2000, 1000), "1", "7.63 MiB"), ((10**6, 10**6), None, "3.64 TiB")])
def test_a_value_folded_past_the_memory_limit_is_refused_before_it_is_computed(shape, limit_mb, size, monkeypatch):
    if limit_mb is None:
        monkeypatch.delenv("RANVIER_MAX_MEMORY_MB", raising=False)
    else:
        monkeypatch.setenv("RANVIER_MAX_MEMORY_MB", limit_mb)
    tracemalloc.start()
    try:
        with pytest.raises(OnnxError, match=rf"'the_node' \(ConstantOfShape, opset 17\): its output 'c', "
                                            rf"float32\[{shape[0]}x{shape[1]}\] computed at load: {size}, past ranvier's memory limit"):
            ro.load(constant_of_shape_model(*shape))
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    monkeypatch.setenv("RANVIER_MAX_MEMORY_MB", "1")
    [total] = run_ranvier(constant_of_shape_model(20, 30), {}, ["y"])  # what fits is folded
    assert total == 0


def test_an_output_past_the_memory_limit_is_refused_at_compile_time():
    """The 113-byte model of issue 53: an input expanded to 4 TB, which compiled and then
    failed in numpy's allocation when the instance was made."""
    node = helper.make_node("Expand", ["x", "s"], ["y"])
    model = model_with(node, {"x": rand(1), "s": known(100_000, 100_000, 100)})
    with pytest.raises(RanvierError, match=r"an instance of cell main \(its largest variable main/.* \(y\): "
                                           r"float32\[100000x100000x100\], 3.64 TiB\): 3.64 TiB, past ranvier's memory limit"):
        ranvier.Compiler().compile(ro.load(model))


def test_computed_reshape_target_needs_its_inputs_bound():
    """A shape computed from graph inputs names them; bound with `constants`, the model loads."""
    nodes = [helper.make_node("Abs", ["s"], ["t"]), helper.make_node("Reshape", ["x", "t"], ["y"], name="the_node")]
    model = onnx.shape_inference.infer_shapes(build(nodes, {"x": X34, "s": np.int64([-2, 6])}, ["y"]))
    with pytest.raises(ro.ValueNeeded, match=r"'the_node' \(Reshape.*target shape.*'t'.*computed from graph inputs "
                                             r"\['s'\].*constants=") as refused:
        ro.load(model)
    assert refused.value.inputs == {"s"}
    data = ranvier.Compiler().compile(ro.load(model, constants={"s": np.int64([-2, 6])})).cell("main").instance()
    data["x"] = X34
    data.compute()
    np.testing.assert_array_equal(data["y"], X34.reshape(2, 6))
    with pytest.raises(OnnxError, match=r"constant for graph input 's' is int32\[2\]; the model declares it int64\[2\]"):
        ro.load(model, constants={"s": np.int32([-2, 6])})
    with pytest.raises(OnnxError, match=r"constants names \['z'\], which are not inputs of the model"):
        ro.load(model, constants={"z": np.int64([2, 6])})
