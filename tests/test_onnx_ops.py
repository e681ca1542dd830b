"""ONNX's tensor, index and math operators (`ranvier/onnx/elementwise.py` and its
neighbours) against ONNX Runtime, one node at a time, with the helpers of
test_onnx_import: random inputs fed at run time unless marked `Known` (an initializer).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_onnx_import import RNG, Known, case, check_node, rand

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
