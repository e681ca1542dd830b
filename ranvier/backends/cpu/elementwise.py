"""IR for one elementwise op on compute values (scalars or vectors of `lanes` elements).

Semantics follow the numpy references: NaN propagates through minimum/maximum and
relu, integer division truncates toward zero, rounding is half to even.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ... import dtypes
from ...errors import CompileError
from . import mathlib
from .convert import cast
from .irutil import constant, intrinsic, is_signed

FLOAT_MATH = {"Exp": "exp", "Log": "log", "Tanh": "tanh", "Sigmoid": "sigmoid", "Erf": "erf", "Sin": "sin", "Cos": "cos", "Silu": "silu"}

SUPPORTED = {
    "Neg", "Abs", "Sign", "Square", "Relu", "Identity", "Exp", "Log", "Sqrt", "Rsqrt", "Reciprocal", "Sin", "Cos",
    "Tanh", "Sigmoid", "Erf", "Silu", "Floor", "Ceil", "Round", "Not", "Gelu", "Cast", "Add", "Sub", "Mul", "Div",
    "Pow", "Minimum", "Maximum", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "And", "Or",
    "Xor", "Cond", "Select",
}

_COMPARE = {"Equal": "==", "NotEqual": "!=", "Less": "<", "LessEqual": "<=", "Greater": ">", "GreaterEqual": ">="}


def emit(b: ir.IRBuilder, op_type: str, attrs: dict, args: list[ir.Value], arg_dtypes: list[str], out_dtype: str) -> ir.Value:
    """The compute value of `op_type(args)`; args are compute values of their dtypes."""
    module = b.module
    x = args[0] if args else None
    dtype = arg_dtypes[0] if arg_dtypes else out_dtype
    is_float = dtypes.is_float(dtype)
    t = x.type if x is not None else None

    if op_type == "Identity":
        return x
    if op_type == "Cast":
        lanes = t.count if isinstance(t, ir.VectorType) else 1
        return cast(b, x, dtype, out_dtype, lanes)
    if op_type in FLOAT_MATH:
        return mathlib.emit(FLOAT_MATH[op_type], b, x)
    if op_type == "Gelu":
        return mathlib.emit("gelu_tanh" if attrs.get("approximate") == "tanh" else "gelu_erf", b, x)
    if op_type == "Neg":
        return b.fneg(x) if is_float else b.neg(x)
    if op_type == "Abs":
        if is_float:
            return b.call(intrinsic(module, "fabs", t), [x])
        if not is_signed(dtype):
            return x
        return b.select(b.icmp_signed("<", x, constant(t, 0)), b.neg(x), x)
    if op_type == "Sign":
        zero, one = constant(t, 0), constant(t, 1)
        if is_float:
            positive = b.select(b.fcmp_ordered(">", x, zero), one, zero)
            signed = b.select(b.fcmp_ordered("<", x, zero), constant(t, -1), positive)
            return b.select(b.fcmp_unordered("uno", x, x), x, signed)
        if not is_signed(dtype):
            return b.zext(b.icmp_unsigned("!=", x, zero), t)
        positive = b.select(b.icmp_signed(">", x, zero), one, zero)
        return b.select(b.icmp_signed("<", x, zero), constant(t, -1), positive)
    if op_type == "Square":
        return b.fmul(x, x) if is_float else b.mul(x, x)
    if op_type == "Relu":
        zero = constant(t, 0)
        if is_float:
            return b.select(b.fcmp_ordered("<", x, zero), zero, x)  # NaN stays NaN, as np.maximum
        if not is_signed(dtype):
            return x
        return b.select(b.icmp_signed("<", x, zero), zero, x)
    if op_type == "Sqrt":
        return b.call(intrinsic(module, "sqrt", t), [x])
    if op_type == "Rsqrt":
        return b.fdiv(constant(t, 1.0), b.call(intrinsic(module, "sqrt", t), [x]))
    if op_type == "Reciprocal":
        return b.fdiv(constant(t, 1.0), x)
    if op_type in ("Floor", "Ceil", "Round"):
        name = {"Floor": "floor", "Ceil": "ceil", "Round": "roundeven"}[op_type]
        return b.call(intrinsic(module, name, t), [x])
    if op_type == "Not":
        return b.not_(x)
    if op_type in ("And", "Or", "Xor"):
        return {"And": b.and_, "Or": b.or_, "Xor": b.xor}[op_type](x, args[1])
    if op_type in _COMPARE:
        y = args[1]
        if is_float:
            predicate = _COMPARE[op_type]
            return b.fcmp_unordered(predicate, x, y) if op_type == "NotEqual" else b.fcmp_ordered(predicate, x, y)
        if dtype == dtypes.DT_BOOL or not is_signed(dtype):
            return b.icmp_unsigned(_COMPARE[op_type], x, y)
        return b.icmp_signed(_COMPARE[op_type], x, y)
    if op_type == "Cond":
        return b.select(x, args[1], args[2])
    if op_type == "Select":
        return b.select(x, args[1], constant(args[1].type, 0))
    y = args[1]
    if op_type == "Add":
        return b.fadd(x, y) if is_float else b.add(x, y)
    if op_type == "Sub":
        return b.fsub(x, y) if is_float else b.sub(x, y)
    if op_type == "Mul":
        return b.fmul(x, y) if is_float else b.mul(x, y)
    if op_type == "Div":
        if is_float:
            return b.fdiv(x, y)
        return _int_div(b, x, y, is_signed(dtype))
    if op_type in ("Minimum", "Maximum"):
        if is_float:
            pick_x = b.fcmp_ordered("<" if op_type == "Minimum" else ">", x, y)
            chosen = b.select(pick_x, x, y)
            return b.select(b.fcmp_unordered("uno", x, x), x, chosen)  # NaN in x propagates too
        compare = b.icmp_signed if is_signed(dtype) else b.icmp_unsigned
        return b.select(compare("<" if op_type == "Minimum" else ">", x, y), x, y)
    if op_type == "Pow":
        return _pow(b, x, y)
    raise CompileError(f"the CPU backend has no elementwise code for {op_type}")


def _int_div(b: ir.IRBuilder, x: ir.Value, y: ir.Value, signed: bool) -> ir.Value:
    """Integer division as the reference computes it, without the hardware trap: x/0 is 0
    and MIN/−1 wraps to MIN (sdiv/udiv of either is undefined and raises SIGFPE on x86)."""
    t = x.type
    zero, one = constant(t, 0), constant(t, 1)
    by_zero = b.icmp_unsigned("==", y, zero)
    if not signed:
        return b.select(by_zero, zero, b.udiv(x, b.select(by_zero, one, y)))
    by_minus_one = b.icmp_signed("==", y, constant(t, -1))
    quotient = b.sdiv(x, b.select(b.or_(by_zero, by_minus_one), one, y))
    return b.select(by_zero, zero, b.select(by_minus_one, b.neg(x), quotient))


def _pow(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """x**y as exp(y·log|x|), with numpy's sign for negative x and integral y (NaN otherwise)."""
    t = x.type
    module = b.module
    magnitude = mathlib.emit("exp", b, b.fmul(y, mathlib.emit("log", b, b.call(intrinsic(module, "fabs", t), [x]))))
    integral = b.fcmp_ordered("==", b.call(intrinsic(module, "floor", t), [y]), y)
    half = b.fmul(y, constant(t, 0.5))
    odd = b.fcmp_ordered("!=", b.call(intrinsic(module, "floor", t), [half]), half)
    negative = b.fcmp_ordered("<", x, constant(t, 0.0))
    signed = b.select(odd, b.fneg(magnitude), magnitude)
    nan = constant(t, math.nan)
    result = b.select(negative, b.select(integral, signed, nan), magnitude)
    # x**0 is 1 for every x (NaN included); 0**y is 0 for y > 0 and inf for y < 0, via log(0) = -inf.
    return b.select(b.fcmp_ordered("==", y, constant(t, 0.0)), constant(t, 1.0), result)

