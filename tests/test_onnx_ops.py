"""ONNX's tensor, index and math operators (`ranvier/onnx/elementwise.py` and its
neighbours) against ONNX Runtime, one node at a time, with the helpers of
test_onnx_import: random inputs fed at run time unless marked `Known` (an initializer).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_onnx_import import RNG, Known, assert_matches, build, case, check, check_node, known, rand, run_ranvier

import ranvier.onnx as ro
from ranvier.onnx import OnnxError

X234 = rand(2, 3, 4) * 2


def _with_specials(x: np.ndarray) -> np.ndarray:
    """x with NaN, +inf and -inf among its values."""
    x = x.copy()
    x.flat[[0, 3, 5, 7]] = [np.nan, np.inf, -np.inf, np.nan]
    return x


ELEMENTWISE_CASES = [
    case("Elu", {"x": X234}),
    case("Elu", {"x": X234}, alpha=0.3, id="alpha"),
    case("Selu", {"x": X234}),
    case("Selu", {"x": X234}, alpha=2.0, gamma=3.0, id="alpha-gamma"),
    case("Celu", {"x": X234}, opset=12),
    case("Celu", {"x": X234}, opset=12, alpha=2.5, id="alpha"),
    case("HardSigmoid", {"x": X234 * 3}),
    case("HardSigmoid", {"x": X234 * 3}, alpha=0.4, beta=0.3, id="alpha-beta"),
    case("HardSwish", {"x": X234 * 3}, opset=14),
    case("Mish", {"x": X234 * 3}, opset=18),
    case("PRelu", {"x": X234, "slope": rand(3, 1)}, opset=16),
    case("PRelu", {"x": X234, "slope": Known(rand(4))}, opset=16, id="known-slope"),
    case("Shrink", {"x": X234}),
    case("Shrink", {"x": X234}, bias=0.3, lambd=1.1, id="bias-lambd"),
    case("ThresholdedRelu", {"x": X234}),
    case("ThresholdedRelu", {"x": X234}, alpha=-0.5, id="alpha"),
    case("Swish", {"x": X234 * 3}, opset=24),
    case("Swish", {"x": X234 * 3}, opset=24, alpha=0.7, id="alpha"),
    case("Mod", {"a": RNG.integers(-20, 20, (2, 3, 4)), "b": RNG.integers(1, 6, (3, 1)) * [[1], [-1], [1]]}, id="int64"),
    case("Mod", {"a": RNG.integers(-20, 20, (2, 3, 4)).astype(np.int32), "b": np.int32([3, -4, 5, -7])}, fmod=1,
         id="int32-fmod"),
    case("Mod", {"a": X234 * 10, "b": Known(np.float32([3, -4, 1.5, -0.7]))}, fmod=1, id="float-fmod"),
    case("BitwiseAnd", {"a": RNG.integers(-2**31, 2**31, (2, 3, 4)).astype(np.int32),
                        "b": RNG.integers(-2**31, 2**31, (3, 4)).astype(np.int32)}, opset=18),
    case("BitwiseOr", {"a": RNG.integers(0, 256, (2, 3, 4)).astype(np.uint8),
                       "b": RNG.integers(0, 256, (4,)).astype(np.uint8)}, opset=18, id="uint8"),
    case("BitwiseXor", {"a": RNG.integers(-2**15, 2**15, (3, 4)).astype(np.int16),
                        "b": RNG.integers(-2**15, 2**15, (3, 4)).astype(np.int16)}, opset=18, id="int16"),
    case("BitwiseNot", {"x": RNG.integers(-2**62, 2**62, (3, 4))}, opset=18, id="int64"),
    case("BitShift", {"x": RNG.integers(0, 2**16, (3, 4)).astype(np.uint16),
                      "n": RNG.integers(0, 16, (3, 4)).astype(np.uint16)}, direction="LEFT", id="left-uint16"),
    case("BitShift", {"x": RNG.integers(0, 256, (3, 4)).astype(np.uint8),
                      "n": RNG.integers(0, 8, (4,)).astype(np.uint8)}, direction="RIGHT", id="right-uint8"),
    case("BitCast", {"x": _with_specials(X234)}, to=6, opset=26, id="float32-int32"),
    case("BitCast", {"x": RNG.integers(-2**62, 2**62, (3, 4))}, to=11, opset=26, id="int64-float64"),
    case("BitCast", {"x": RNG.integers(-128, 128, (3, 4)).astype(np.int8)}, to=2, opset=26, id="int8-uint8"),
    case("IsNaN", {"x": _with_specials(X234)}, opset=20),
    case("IsNaN", {"x": _with_specials(X234).astype(np.float16)}, opset=20, id="float16"),
    case("IsInf", {"x": _with_specials(X234)}, opset=20),
    case("IsInf", {"x": _with_specials(X234)}, opset=20, detect_negative=0, id="positive"),
    case("IsInf", {"x": _with_specials(X234)}, opset=20, detect_positive=0, id="negative"),
    case("IsInf", {"x": _with_specials(X234)}, opset=20, detect_positive=0, detect_negative=0, id="neither"),
]


@pytest.mark.parametrize("op, values, kwargs", ELEMENTWISE_CASES)
def test_elementwise(op, values, kwargs):
    check_node(op, values, **kwargs)


def _ints(low, high, shape, dtype=np.int64) -> np.ndarray:
    return RNG.integers(low, high, shape).astype(dtype)


def _distinct(rows: int, columns: int, size: int) -> np.ndarray:
    """int64 indices [rows, columns], distinct within each row, below `size`, some written
    from the end (negative)."""
    picks = np.stack([RNG.permutation(size)[:columns] for _ in range(rows)])
    return np.where(RNG.random(picks.shape) < 0.3, picks - size, picks).astype(np.int64)


X345 = rand(3, 4, 5)
TIES = _ints(0, 3, (3, 4, 5), np.int32)  # integers with many ties

INDEXING_CASES = [
    case("GatherElements", {"data": X345, "indices": _ints(-4, 4, (3, 2, 5))}, axis=1),
    case("GatherElements", {"data": X345, "indices": _ints(-5, 5, (2, 4, 3), np.int32)}, axis=-1, id="int32-smaller"),
    case("GatherElements", {"data": TIES, "indices": _ints(0, 3, (2, 4, 5))}, id="int-axis0"),
    case("GatherND", {"data": X345, "indices": np.int64([[[0, 1], [2, -1]], [[1, 3], [-3, 0]]])}),
    case("GatherND", {"data": X345, "indices": np.int64([[2, 1, 4], [0, -4, -1]])}, id="elements"),
    case("GatherND", {"data": X345, "indices": np.int64([[[1], [3]], [[0], [-1]], [[2], [2]]])}, batch_dims=1,
         id="batch-dims"),
    case("GatherND", {"data": TIES, "indices": Known(np.int64([[1], [0]]))}, id="known-indices"),
    case("ScatterElements", {"data": X345, "indices": _distinct(3, 2, 4).reshape(3, 2, 1), "updates": rand(3, 2, 1)},
         axis=1, opset=18),
    case("ScatterElements", {"data": rand(4, 5), "indices": _distinct(4, 3, 5), "updates": rand(4, 3)}, axis=-1,
         opset=18, id="last-axis"),
    case("ScatterElements", {"data": rand(4, 5), "indices": _ints(-4, 4, (3, 5)), "updates": rand(3, 5)},
         reduction="add", opset=18, id="add-duplicates"),
    case("ScatterElements", {"data": TIES, "indices": _ints(0, 3, (4, 4, 5)), "updates": _ints(-3, 3, (4, 4, 5), np.int32)},
         reduction="mul", opset=18, id="mul-int"),
    case("ScatterElements", {"data": rand(4, 5), "indices": _ints(0, 5, (4, 3)), "updates": rand(4, 3) * 3},
         axis=1, reduction="max", opset=18, id="max"),
    case("ScatterElements", {"data": rand(4, 5), "indices": _ints(0, 5, (4, 3)), "updates": rand(4, 3) * 3},
         axis=1, reduction="min", opset=18, id="min"),
    case("Scatter", {"data": rand(4, 5), "indices": _distinct(4, 3, 5), "updates": rand(4, 3)}, axis=1, opset=10),
    case("ScatterND", {"data": X345, "indices": np.int64([[2], [-3]]), "updates": rand(2, 4, 5)}, opset=18),
    case("ScatterND", {"data": X345, "indices": np.int64([[0, 1, 2], [2, -1, 4], [1, 1, 1]]), "updates": rand(3)},
         opset=18, id="elements"),
    case("ScatterND", {"data": X345, "indices": np.int64([[[0, 1], [2, 1]], [[0, 1], [1, -4]]]),
                       "updates": rand(2, 2, 5)}, reduction="add", opset=18, id="add-duplicates"),
    case("ScatterND", {"data": TIES, "indices": np.int64([[1, 2], [1, 2], [0, 0]]),
                       "updates": _ints(-3, 4, (3, 5), np.int32)}, reduction="mul", opset=18, id="mul-int"),
    case("ScatterND", {"data": X345, "indices": np.int64([[1], [1], [0]]), "updates": rand(3, 4, 5) * 2},
         reduction="max", opset=18, id="max"),
    case("ScatterND", {"data": X345, "indices": np.int64([[1], [1], [0]]), "updates": rand(3, 4, 5) * 2},
         reduction="min", opset=18, id="min"),
    case("OneHot", {"indices": np.int64([[0, -1, 5], [2, -5, 7]]), "depth": Known(np.int64(5)),
                    "values": Known(np.float32([0.5, 2.0]))}),
    case("OneHot", {"indices": np.float32([1.7, -2.2, 3.0]), "depth": Known(np.float32([4])),
                    "values": np.float32([-3, 9])}, axis=0, id="float-indices-axis0"),
    case("OneHot", {"indices": _ints(-3, 3, (2, 3)), "depth": Known(np.int64([3])),
                    "values": Known(np.float32([0, 1]))}, axis=1, id="axis1"),
    case("TopK", {"x": rand(3, 6), "k": known(3)}, outputs=("values", "indices")),
    case("TopK", {"x": rand(5, 3), "k": known(2)}, outputs=("values", "indices"), axis=0, largest=0,
         id="smallest-axis0"),
    case("TopK", {"x": TIES, "k": known(4)}, outputs=("values", "indices"), axis=1, id="int-ties"),
    case("TopK", {"x": TIES, "k": known(3)}, outputs=("values", "indices"), largest=0, id="int-ties-smallest"),
    case("ReverseSequence", {"x": rand(4, 3, 2), "lens": np.int64([4, 1, 3])}),
    case("ReverseSequence", {"x": rand(3, 4, 2), "lens": np.int64([2, 4, 1])}, batch_axis=0, time_axis=1, id="batch-first"),
    case("Compress", {"x": X345, "condition": Known(np.bool_([1, 0, 1, 1]))}, axis=1),
    case("Compress", {"x": X345, "condition": Known(np.bool_([0, 1, 1, 0, 0, 1]))}, id="flattened"),
    case("Tile", {"x": rand(2, 3), "repeats": known(3, 2)}),
    case("Tile", {"x": TIES, "repeats": known(1, 2, 1)}, id="int"),
    case("Slice", {"x": X345, "s": known(3, 4), "e": known(0, -10), "a": known(1, 2), "t": known(-1, -2)},
         opset=13, id="negative-steps"),
    case("Slice", {"x": X345, "s": known(-1, 0), "e": known(-4, 5), "a": known(0, 2), "t": known(-2, 2)},
         opset=13, id="mixed-steps"),
    case("Pad", {"x": X345, "p": known(1, 2, 0, 2, 1, 3)}, mode="reflect", opset=13, id="reflect"),
    case("Pad", {"x": X345, "p": known(2, 0, -1, 1, 3, 2)}, mode="edge", opset=13, id="edge-crop"),
    case("Pad", {"x": X345, "p": known(3, 1, 4, -2), "v": Known(np.float32(0.5)), "a": known(0, -1)}, opset=18,
         id="constant-axes-crop"),
    case("Pad", {"x": TIES, "p": known(0, 5, 2, 1, 6, 0)}, mode="wrap", opset=19, id="wrap-int"),
    case("TensorScatter", {"cache": rand(2, 3, 6, 4), "update": rand(2, 3, 2, 4), "at": np.int64([1, 4])}, opset=24),
    case("TensorScatter", {"cache": rand(2, 5, 3), "update": rand(2, 3, 3), "at": np.int64([4, 1])}, axis=1,
         mode="circular", opset=24, id="circular"),
    case("TensorScatter", {"cache": rand(3, 4, 2), "update": rand(3, 1, 2)}, axis=1, opset=24, id="no-indices"),
    case("CenterCropPad", {"x": X345, "shape": known(2, 7)}, axes=[0, 2], opset=18),
    case("CenterCropPad", {"x": TIES, "shape": known(6, 1, 4)}, opset=18, id="int"),
    case("EyeLike", {"x": rand(3, 5)}, k=1),
    case("EyeLike", {"x": rand(4, 3)}, k=-2, dtype=6, id="int32"),
]


@pytest.mark.parametrize("op, values, kwargs", INDEXING_CASES)
def test_indexing(op, values, kwargs):
    check_node(op, values, **kwargs)


ALGEBRA_CASES = [
    case("Pow", {"x": X345, "e": _ints(-2, 4, (3, 4, 5), np.int32)}, opset=15, id="float-int32"),
    case("Pow", {"x": _ints(-3, 5, (3, 4)), "e": _ints(0, 5, (3, 4))}, opset=15, id="int64-int64"),
    case("Pow", {"x": _ints(1, 6, (3, 4), np.int32), "e": rand(3, 4, low=0.0, high=3.0)}, opset=15,
         id="int32-float"),
    case("CumSum", {"x": X345, "axis": Known(np.int64(1))}),
    case("CumSum", {"x": X345, "axis": Known(np.int32([-1]))}, exclusive=1, id="exclusive"),
    case("CumSum", {"x": TIES, "axis": Known(np.int64(0))}, reverse=1, id="int-reverse"),
    case("CumSum", {"x": X345, "axis": Known(np.int64(2))}, exclusive=1, reverse=1, id="exclusive-reverse"),
    case("AffineGrid", {"theta": rand(2, 2, 3), "size": known(2, 3, 4, 5)}, opset=20),
    case("AffineGrid", {"theta": rand(1, 3, 4), "size": known(1, 1, 3, 2, 4)}, opset=20, align_corners=1, id="3d-corners"),
    case("Hardmax", {"x": X345}, opset=13, axis=1),
    case("Hardmax", {"x": np.float32([[1, 3, 3], [2, 2, 0]])}, opset=13, id="ties"),
    case("Hardmax", {"x": X345}, opset=11, axis=1, id="flattened"),
    case("Det", {"x": rand(2, 3, 3) + 2 * np.eye(3, dtype=np.float32)}),  # away from 0, where the sum cancels
    case("Det", {"x": rand(4, 4) + 2 * np.eye(4, dtype=np.float32)}, id="4x4"),
    case("Einsum", {"a": rand(3, 4), "b": rand(4, 5)}, equation="ij,jk->ik", opset=12),
    case("Einsum", {"a": rand(2, 3, 4), "b": rand(2, 4, 5)}, equation="bij,bjk->bik", opset=12, id="batch-matmul"),
    case("Einsum", {"q": rand(2, 3, 4, 5), "k": rand(2, 3, 6, 5)}, equation="bhqd,bhkd->bhqk", opset=12, id="scores"),
    case("Einsum", {"a": rand(2, 4, 4)}, equation="...ii->...i", opset=12, id="batch-diagonal"),
    case("Einsum", {"a": rand(4, 4)}, equation="ii", opset=12, id="trace"),
    case("Einsum", {"a": rand(3, 4)}, equation="ij->ji", opset=12, id="transpose"),
    case("Einsum", {"a": rand(3, 4), "b": rand(4)}, equation="ij,j", opset=12, id="implicit"),
    case("Einsum", {"a": rand(3, low=0.5, high=1.5), "b": rand(4, low=0.5, high=1.5), "c": rand(3, 4, low=0.5, high=1.5)},
         equation="i,j,ij->", opset=12, id="three"),
    case("Einsum", {"a": rand(2, 1, 3), "b": rand(5, 3)}, equation="...j,kj->...k", opset=12, id="ellipsis-broadcast"),
    case("Einsum", {"a": rand(3), "b": rand(4)}, equation="i,j->ij", opset=12, id="outer"),
    case("Einsum", {"a": rand(2, 3, 4), "b": rand(4, 5), "c": rand(5, 2)}, equation="bij,jk,kl->bil", opset=12,
         id="chain"),
    case("Einsum", {"a": _ints(-5, 5, (2, 3, 4), np.int32), "b": _ints(-5, 5, (2, 4), np.int32)},
         equation="bij,bj->bi", opset=12, id="int32"),
    case("ReduceL1", {"x": X345, "axes": known(1)}, opset=18),
    case("ReduceL2", {"x": X345, "axes": known(-1, 0)}, opset=18, keepdims=0),
    case("ReduceLogSum", {"x": np.abs(X345) + 0.1}, opset=18, id="all"),
    case("ReduceLogSumExp", {"x": X345 * 100, "axes": known(2)}, opset=18, id="large"),
    case("ReduceLogSumExp", {"x": X345, "axes": Known(np.zeros(0, np.int64))}, opset=18, keepdims=0, id="empty-axes"),
    case("ReduceL1", {"x": X345}, opset=13, axes=[0, 2], id="opset13"),
    case("ReduceSum", {"x": np.abs(X345) + 0.1, "axes": Known(np.zeros(0, np.int64))}, opset=13, id="empty-axes"),
    case("ReduceMax", {"x": X345 > 0, "axes": known(1)}, opset=20, id="bool"),
    case("ReduceMin", {"x": X345 > 0, "axes": known(1)}, opset=20, id="bool"),
    case("ArgMax", {"x": TIES}, axis=1, select_last_index=1, opset=13),
    case("ArgMin", {"x": TIES}, axis=-1, keepdims=0, select_last_index=1, opset=13),
]


@pytest.mark.parametrize("op, values, kwargs", ALGEBRA_CASES)
def test_algebra(op, values, kwargs):
    check_node(op, values, **kwargs)


@pytest.mark.parametrize("op, values, what, output_type, rank", [
    ("Range", {"start": np.float32(0), "limit": Known(np.float32(5)), "delta": Known(np.float32(1))}, "start",
     TensorProto.FLOAT, 1),
    ("ConstantOfShape", {"shape": np.int64([2, 3])}, "shape", TensorProto.FLOAT, 2),
    ("NonZero", {"x": X345}, "its values set the output's shape", TensorProto.INT64, 2),
    ("Unique", {"x": X345}, "its values set the output's shape", TensorProto.FLOAT, 1),
    ("Compress", {"x": X345, "condition": np.bool_([1, 0, 1])}, "condition", TensorProto.FLOAT, 3),
    ("Tile", {"x": X345, "repeats": np.int64([1, 2, 1])}, "repeats", TensorProto.FLOAT, 3),
    ("NonMaxSuppression", {"boxes": rand(1, 6, 4), "scores": rand(1, 2, 6)}, "boxes", TensorProto.INT64, 2),
])
def test_inputs_that_set_shapes_must_be_known(op, values, what, output_type, rank):
    """Read from the model's inputs, an input that sets the output's shape is refused by
    name (the model loads with it as an initializer, as the cases above show)."""
    node = helper.make_node(op, list(values), ["y"])
    model = build([node], values, ["y"], opset=18)
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", output_type, ["n"] * rank))
    with pytest.raises(OnnxError, match=rf"{op}.*{what}.*known at load"):
        ro.load(model)


def _bytes(shape, dtype=np.uint8) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(int(info.min), int(info.max) + 1, shape).astype(dtype)


QUANTIZATION_CASES = [
    case("QuantizeLinear", {"x": X345 * 40, "scale": Known(np.float32(0.3)), "zero": Known(np.uint8(128))}, opset=21),
    case("QuantizeLinear", {"x": X345 * 40, "scale": rand(4, low=0.2, high=0.5), "zero": _bytes(4, np.int8)},
         axis=1, opset=21, id="per-axis-int8"),
    case("QuantizeLinear", {"x": X345 * 4000, "scale": Known(rand(3, 4, 3, low=0.5, high=2.0)),
                            "zero": Known(_bytes((3, 4, 3), np.int16))}, axis=-1, block_size=2, opset=21,
         id="blocked-int16"),
    case("QuantizeLinear", {"x": X345 * 40, "scale": rand(1, low=0.2, high=0.5)}, opset=21, id="uint8-no-zero-point"),
    case("DequantizeLinear", {"x": _bytes((3, 4, 5), np.int8), "scale": Known(np.float32(0.05)),
                              "zero": Known(np.int8(-3))}, opset=21),
    case("DequantizeLinear", {"x": _bytes((3, 4, 5)), "scale": rand(5, low=0.01, high=0.1), "zero": _bytes(5)},
         axis=-1, opset=21, id="per-axis-uint8"),
    case("DequantizeLinear", {"x": _bytes((3, 4, 5), np.uint16), "scale": Known(rand(3, 2, 5, low=0.01, high=0.1)),
                              "zero": Known(_bytes((3, 2, 5), np.uint16))}, axis=1, block_size=2, opset=21,
         id="blocked-uint16"),
    case("DequantizeLinear", {"x": _bytes((3, 4), np.int8), "scale": np.array(0.02, np.float16)}, opset=21, id="float16"),
    case("DynamicQuantizeLinear", {"x": X345 * 3}, outputs=("y", "scale", "zero"), opset=11),
    case("DynamicQuantizeLinear", {"x": np.abs(X345) + 1}, outputs=("y", "scale", "zero"), opset=11, id="positive"),
    case("MatMulInteger", {"a": _bytes((3, 4)), "b": _bytes((4, 5)), "a0": Known(np.uint8(120)),
                           "b0": Known(_bytes(5))}, opset=10),
    case("MatMulInteger", {"a": _bytes((2, 3, 4), np.int8), "b": _bytes((4, 5), np.int8)}, opset=10, id="int8"),
    case("QLinearMatMul", {"a": _bytes((3, 4)), "sa": np.array(0.02, np.float32), "za": np.array(130, np.uint8),
                           "b": _bytes((4, 5)), "sb": np.array(0.03, np.float32), "zb": np.array(120, np.uint8),
                           "sy": np.array(0.4, np.float32), "zy": np.array(125, np.uint8)},
         opset=21),
    case("QLinearMatMul", {"a": _bytes((2, 3, 4), np.int8), "sa": Known(np.float32([0.02])), "za": Known(np.int8([1])),
                           "b": _bytes((2, 4, 5), np.int8), "sb": Known(np.float32([0.03])), "zb": Known(np.int8([-2])),
                           "sy": Known(np.float32([0.1])), "zy": Known(np.int8([-4]))}, opset=21, id="int8-3d"),
]


@pytest.mark.parametrize("op, values, kwargs", QUANTIZATION_CASES)
def test_quantization(op, values, kwargs):
    check_node(op, values, **kwargs)


W34 = rand(3, 4)
TRAINING_CASES = [
    ("Adagrad", {"r": np.float32(0.1), "t": np.int64(3), "x": W34, "g": rand(3, 4), "h": rand(3, 4) ** 2},
     {"decay_factor": 0.1, "epsilon": 1e-5, "norm_coefficient": 0.01}, 2),
    ("Adam", {"r": np.float32(0.1), "t": np.int64(4), "x": W34, "x2": rand(5), "g": rand(3, 4), "g2": rand(5),
              "v": rand(3, 4), "v2": rand(5), "h": rand(3, 4) ** 2, "h2": rand(5) ** 2},
     {"alpha": 0.9, "beta": 0.99, "epsilon": 1e-4, "norm_coefficient": 0.01, "norm_coefficient_post": 0.02}, 6),
    ("Adam", {"r": np.float32(0.1), "t": np.int64(0), "x": W34, "g": rand(3, 4), "v": rand(3, 4), "h": rand(3, 4) ** 2},
     {"alpha": 0.8, "beta": 0.9}, 3),
    ("Momentum", {"r": np.float32(0.1), "t": np.int64(0), "x": W34, "g": rand(3, 4), "v": rand(3, 4)},
     {"alpha": 0.9, "beta": 0.5, "mode": "standard", "norm_coefficient": 0.01}, 2),
    ("Momentum", {"r": np.float32(0.1), "t": np.int64(2), "x": W34, "g": rand(3, 4), "v": rand(3, 4)},
     {"alpha": 0.9, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.01}, 2),
]


@pytest.mark.parametrize("op, values, attrs, outputs", TRAINING_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(TRAINING_CASES)])
def test_training_updates(op, values, attrs, outputs):
    """The update rules of ONNX's training domain, which ONNX Runtime does not run, against
    ONNX's reference implementation."""
    from onnx.reference import ReferenceEvaluator

    feeds = {name: np.asarray(value) for name, value in values.items()}
    names = [f"out{i}" for i in range(outputs)]
    node = helper.make_node(op, list(feeds), names, domain="ai.onnx.preview.training", **attrs)
    model = build([node], feeds, names, opset=18)
    model.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    count = len(feeds) - 2 - outputs  # parameters: each has one more input (its gradient) than outputs
    parameters = list(feeds.values())[2:]
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, parameters[i % count].shape)
                              for i, name in enumerate(names))
    expected = ReferenceEvaluator(model).run(None, feeds)
    for name, actual, e in zip(names, run_ranvier(model, feeds, names), expected):
        assert_matches(actual, np.asarray(e, np.float32), name)


SIGNAL = rand(2, 6, 5, 1)
SPECTRUM = rand(2, 6, 5, 2)
SPECTRAL_CASES = [
    case("DFT", {"x": SIGNAL, "n": Known(np.int64(6)), "axis": Known(np.int64(1))}, opset=20, id="real"),
    case("DFT", {"x": SPECTRUM, "n": Known(np.int64(8)), "axis": Known(np.int64(-2))}, opset=20, id="complex-padded"),
    case("DFT", {"x": SIGNAL}, opset=17, axis=1, onesided=1, id="rfft-opset17"),
    case("DFT", {"x": SPECTRUM, "n": Known(np.int64(4)), "axis": Known(np.int64(1))}, opset=20, inverse=1,
         id="inverse-truncated"),
    case("DFT", {"x": SPECTRUM, "n": Known(np.int64(10)), "axis": Known(np.int64(1))}, opset=20, inverse=1, onesided=1,
         id="irfft"),
]


@pytest.mark.parametrize("op, values, kwargs", SPECTRAL_CASES)
def test_spectral(op, values, kwargs):
    check_node(op, values, **kwargs)


@pytest.mark.parametrize("onesided", [0, 1])
def test_stft_against_numpy(onesided):
    """Frames of 8 samples 3 apart, windowed, transformed as numpy's FFT does (ONNX Runtime's
    STFT misses ONNX's own cases)."""
    signal, window = rand(2, 30, 1), rand(8, low=0.1, high=1.0)
    values = {"signal": signal, "step": Known(np.int64(3)), "window": window, "length": Known(np.int64(8))}
    node = helper.make_node("STFT", list(values), ["y"], onesided=onesided)
    model = build([node], values, ["y"], opset=17)
    bins = 5 if onesided else 8
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, bins, 2]))
    frames = np.stack([signal[:, 3 * f:3 * f + 8, 0] * window for f in range(8)], axis=1)
    spectrum = np.fft.fft(frames, axis=-1)[..., :bins]
    expected = np.stack([spectrum.real, spectrum.imag], axis=-1).astype(np.float32)
    (actual,) = run_ranvier(model, {"signal": signal, "window": window}, ["y"])
    assert_matches(actual, expected, "y")


def test_max_unpool_of_overlapping_windows():
    """Where MaxPool's windows overlap, one element is the maximum of several and its index
    comes several times, with its value each time: unpooled, it comes back once, as ONNX
    Runtime puts it."""
    indices = np.int64([[[[0, 6], [6, 11]], [[16, 17], [17, 17]]]])
    x = rand(1, 2, 2, 2)
    x[0, 0, 1, 0] = x[0, 0, 0, 1]
    x[0, 1, 1, :] = x[0, 1, 0, 1]
    check_node("MaxUnpool", {"x": x, "i": indices}, kernel_shape=[3, 3], strides=[1, 1], opset=11)


def test_swiglu_against_the_reference():
    """SwiGLU (opset 28, which ONNX Runtime does not run yet) against ONNX's reference."""
    from onnx.reference import ReferenceEvaluator

    values = {"a": rand(3, 8) * 3, "b": rand(3, 8)}
    node = helper.make_node("SwiGLU", ["a", "b"], ["y"], alpha=0.7)
    model = build([node], values, ["y"], opset=28)
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8]))
    (expected,) = ReferenceEvaluator(model).run(None, values)
    (actual,) = run_ranvier(model, values, ["y"])
    assert_matches(actual, expected, "y")


IMAGE = rand(2, 3, 5, 6)
GRID = rand(2, 4, 7, 2, low=-1.3, high=1.3)  # points inside and outside the image
GRID_SAMPLE_CASES = [
    case("GridSample", {"x": IMAGE, "grid": GRID}, opset=20, mode=mode, padding_mode=padding, align_corners=corners,
         id=f"{mode}-{padding}-{corners}")
    for mode in ("nearest", "linear", "cubic") for padding in ("zeros", "border", "reflection") for corners in (0, 1)
] + [
    case("GridSample", {"x": rand(1, 2, 3, 4, 5), "grid": rand(1, 2, 3, 4, 3, low=-1.3, high=1.3)}, opset=20,
         mode=mode, padding_mode=padding, id=f"volumetric-{mode}-{padding}")
    for mode in ("nearest", "linear") for padding in ("zeros", "reflection")
]


@pytest.mark.parametrize("op, values, kwargs", GRID_SAMPLE_CASES)
def test_grid_sample(op, values, kwargs):
    check_node(op, values, **kwargs)


def _body(nodes, inputs, outputs) -> onnx.GraphProto:
    """A subgraph of float32 values of any shape, but for Loop's iteration number i (an
    int64) and its condition cond (a bool), scalars."""
    kinds = {"i": TensorProto.INT64, "cond": TensorProto.BOOL, "cond_out": TensorProto.BOOL}

    def info(name):
        return helper.make_tensor_value_info(name, kinds.get(name, TensorProto.FLOAT), [] if name in kinds else None)

    return helper.make_graph(nodes, "body", [info(name) for name in inputs], [info(name) for name in outputs])


@pytest.mark.parametrize("taken", [True, False])
def test_if_with_a_condition_known_at_load(taken):
    """The branch taken reads the model's input and a value of the outer graph."""
    x = rand(3, 4)
    then_branch = _body([helper.make_node("Mul", ["x", "x"], ["t"])], [], ["t"])
    else_branch = _body([helper.make_node("Sub", ["x", "shift"], ["e"])], [], ["e"])
    nodes = [helper.make_node("Exp", ["x"], ["shift"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    check(build(nodes, {"x": x, "c": Known(np.bool_(taken))}, ["y"], opset=17), {"x": x})


def test_loop_unrolled_at_load():
    """Four iterations of a running sum and product over the iteration number, with a scan
    output of each step's sum."""
    x = rand(2, 3)
    body = _body([helper.make_node("Identity", ["cond"], ["cond_out"]),
                  helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
                  helper.make_node("Add", ["total", "fi"], ["total_out"]),
                  helper.make_node("Mul", ["product", "x"], ["product_out"]),
                  helper.make_node("Add", ["total_out", "product_out"], ["step"])],
                 ["i", "cond", "total", "product"], ["cond_out", "total_out", "product_out", "step"])
    node = helper.make_node("Loop", ["n", "go", "x", "x"], ["total", "product", "steps"], body=body)
    check(build([node], {"x": x, "n": Known(np.int64(4)), "go": Known(np.bool_(True))}, ["total", "product", "steps"],
                opset=17), {"x": x})


@pytest.mark.parametrize("directions", [(0, 0), (1, 0), (0, 1)], ids=["forward", "reverse-input", "reverse-output"])
def test_scan_unrolled_at_load(directions):
    """A running sum (state) over the rows of x scanned along axis 1, each step's sum times
    the row of a second scan input as a scan output stacked along axis 1."""
    x, w = rand(3, 5, 4), rand(5, 4)
    body = _body([helper.make_node("Add", ["state", "row"], ["state_out"]),
                  helper.make_node("Mul", ["state_out", "weights"], ["out"])],
                 ["state", "row", "weights"], ["state_out", "out"])
    node = helper.make_node("Scan", ["initial", "x", "w"], ["final", "outs"], body=body, num_scan_inputs=2,
                            scan_input_axes=[1, 0], scan_input_directions=[directions[0], 0],
                            scan_output_axes=[1], scan_output_directions=[directions[1]])
    initial = rand(3, 4)
    check(build([node], {"initial": initial, "x": x, "w": w}, ["final", "outs"], opset=17),
          {"initial": initial, "x": x, "w": w})


def test_known_nodes_fold_in_their_own_opset():
    """An opset-11 Unsqueeze (axes an attribute, an input from opset 13) of a known value
    folds as opset 11 defines it: ONNX's reference evaluator takes a bare node as of the
    newest opset."""
    x = rand(3, 4)
    nodes = [helper.make_node("Unsqueeze", ["n"], ["shape"], axes=[0]), helper.make_node("Reshape", ["x", "shape"], ["y"])]
    check(build(nodes, {"x": x, "n": Known(np.int64(12))}, ["y"], opset=11), {"x": x})
