"""Converters of ONNX's elementwise operators beyond `converters.py`'s table: the
activations with parameters (Elu, Selu, Celu, HardSigmoid, HardSwish, Mish, PRelu, Shrink,
ThresholdedRelu, Swish, SwiGLU) and the float tests (IsNaN, IsInf), each as the few ranvier
ops of its formula, which the compiler fuses into one loop; Mod, as ranvier's FMod or Mod; and the
bitwise operators of integers (BitwiseAnd, BitwiseOr, BitwiseXor, BitwiseNot, BitShift) and
BitCast.
"""

from __future__ import annotations

import math

import numpy as np

from .node import Node, converts, onnx_dtype


def _exp_minus_one(x, alpha: float):
    """alpha · (exp(x) − 1), the negative branch of Elu, Selu and Celu."""
    return (x.exp() - 1.0) * alpha


@converts("Elu")
def elu(node: Node):
    x = node.tensor(0)
    return node.b.cond(x < 0.0, _exp_minus_one(x, float(node.attr("alpha", 1.0))), x)


@converts("Selu")
def selu(node: Node):
    x = node.tensor(0)
    alpha = float(node.attr("alpha", 1.67326319217681884765625))
    gamma = float(node.attr("gamma", 1.05070102214813232421875))
    return node.b.cond(x > 0.0, x, _exp_minus_one(x, alpha)) * gamma


@converts("Celu")
def celu(node: Node):
    x = node.tensor(0)
    alpha = float(node.attr("alpha", 1.0))
    return node.b.cond(x > 0.0, x, _exp_minus_one(x * (1.0 / alpha), alpha))


def _hard_sigmoid(x, alpha: float, beta: float):
    """max(0, min(1, alpha · x + beta))."""
    return (x * alpha + beta).maximum(0.0).minimum(1.0)


@converts("HardSigmoid")
def hard_sigmoid(node: Node):
    return _hard_sigmoid(node.tensor(0), float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5)))


@converts("HardSwish")
def hard_swish(node: Node):
    x = node.tensor(0)
    return x * _hard_sigmoid(x, 1.0 / 6.0, 0.5)


@converts("Mish")
def mish(node: Node):
    x = node.tensor(0)
    return x * x.softplus().tanh()


@converts("PRelu")
def prelu(node: Node):
    x, slope = node.tensor(0), node.tensor(1)
    return node.b.cond(x < 0.0, x * slope, x)


@converts("Shrink")
def shrink(node: Node):
    x = node.tensor(0)
    bias, lambd = float(node.attr("bias", 0.0)), float(node.attr("lambd", 0.5))
    return node.b.cond(x < -lambd, x + bias, node.b.cond(x > lambd, x - bias, node.b.const(0, x.dtype)))


@converts("ThresholdedRelu")
def thresholded_relu(node: Node):
    x = node.tensor(0)
    return node.b.select(x > float(node.attr("alpha", 1.0)), x)


def _swish(x, alpha: float):
    """x · sigmoid(alpha · x)."""
    return x * (x * alpha if alpha != 1.0 else x).sigmoid()


@converts("Swish")
def swish(node: Node):
    return _swish(node.tensor(0), float(node.attr("alpha", 1.0)))


@converts("SwiGLU")
def swiglu(node: Node):
    """a · sigmoid(alpha · a) · b: the Swish of a gating b."""
    return _swish(node.tensor(0), float(node.attr("alpha", 1.0))) * node.tensor(1)


@converts("IsNaN")
def is_nan(node: Node):
    x = node.tensor(0)
    return node.b.not_equal(x, x)


@converts("IsInf")
def is_inf(node: Node):
    x = node.tensor(0)
    positive, negative = bool(node.attr("detect_positive", 1)), bool(node.attr("detect_negative", 1))
    if positive and negative:
        return node.b.equal(x.abs(), math.inf)
    if positive or negative:
        return node.b.equal(x, math.inf if positive else -math.inf)
    return np.zeros(x.shape, bool)  # detects neither


@converts("Mod")
def mod(node: Node):
    """fmod=1: C's fmod (the dividend's sign); fmod=0: Python's % (the divisor's sign)."""
    a, b = node.tensor(0), node.tensor(1)
    return node.b.fmod(a, b) if node.attr("fmod", 0) else node.b.mod(a, b)


_BITWISE = {"BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor"}


@converts(*_BITWISE)
def bitwise(node: Node):
    return getattr(node.b, _BITWISE[node.proto.op_type])(node.tensor(0), node.tensor(1))


@converts("BitwiseNot")
def bitwise_not(node: Node):
    return node.b.bitwise_not(node.tensor(0))


@converts("BitShift")
def bit_shift(node: Node):
    direction = node.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise node.error(f"direction {direction!r} is not LEFT or RIGHT")
    method = node.b.shift_left if direction == "LEFT" else node.b.shift_right
    return method(node.tensor(0), node.tensor(1))


@converts("BitCast")
def bit_cast(node: Node):
    return node.b.bitcast(node.tensor(0), onnx_dtype(node.attr("to"), f"{node.label}'s to"))
