"""The GPU maps' exponentials and divisions by the special-function unit, where the result's
precision allows: one rule (`formula`). A value a map stores as bfloat16 or float16, or one
that feeds only such stores, takes its exp, sigmoid, silu, tanh, reciprocal and division
from the SFU's approximations; every other value keeps the precise formulas (`llvm/mathlib.py`),
so a float32 map's code is what it was.

The precise float32 formulas cost the stories110M bf16 step's SwiGLU gradient ~100 SASS
instructions an element (a Cody-Waite exp polynomial, two IEEE divisions each with its slow
path) against ~10 bytes moved: on an H200 that map is bound by instruction issue, not by memory.
By the SFU it is an ex2, a reciprocal and a few multiplies.

The approximations' float32 errors, as the PTX ISA states them (9.7.3, "Floating Point
Instructions"): ex2.approx.f32 at most 2 ulp over the full range, subnormal results kept
(without .ftz); rcp.approx.f32 at most 1 ulp over the full range; div.full.f32 at most 2 ulp
over the full range. An exponential's argument x·log2(e) is rounded once more, 2^-24·|x·log2 e|
relative, which moves e^x by at most 2^-17.5 relatively before it over- or underflows. All of
it is under 2^-17 relative, where bfloat16 rounds at 2^-9 (float16 at 2^-12): a result differs
from the precise one's only where the precise one lies within that much of a rounding
boundary, by one unit of the narrow type. tanh.approx.f32 is not taken: its stated relative
error, 2^-11, is a quarter of bfloat16's rounding, and a gradient's 1 - tanh² magnifies it
near ±1; tanh is 1 - 2 / (e^2|x| + 1) by ex2 and a reciprocal instead (the polynomial
near 0, where that cancels, as `mathlib.tanh` does).

The edges are the precise formulas' (`mathlib`): exp overflows to inf and underflows through
the subnormals to 0, sigmoid is 1 and 0 at ±inf, silu(-inf) = -0 and silu(+inf) = inf, ±0
keeps its sign through silu and tanh, and NaN comes out NaN.

On the host emulator (a module for the CPU) each SFU instruction is modelled by the precise
function: 2^x from the exponential in double, 1 / x and x / y by IEEE division; the emulator's
tests then check the formula around it. `HOST_ERROR` perturbs the models by that relative
amount (up or down by the argument's last bit), as the hardware may err: a test sets it to
the ISA's bound, so that a formula that magnified the SFU's error would fail there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from llvmlite import ir

from ... import dtypes
from ...ops.expression import Program
from ..llvm import mathlib
from ..llvm.formulas import Formula, Formulas, apply
from ..llvm.irutil import declared
from ..llvm.values import Value
from .ptx import TRIPLE

NARROW = (dtypes.DT_BFLOAT16, dtypes.DT_FLOAT16)  # stored types whose rounding dwarfs the SFU's error
LOG2E = math.log2(math.e)
HOST_ERROR = 0.0  # the host models' relative perturbation (a test's); the ISA's bound is about 2^-22
BOUNDED = -150.0  # silu's factor x limited to this: e^-150 is 0 in float32, so -inf · 0 is not NaN

F32 = ir.FloatType()


# ---- the SFU's instructions, and their host models ------------------------------------------------


def _on_gpu(x: Value) -> bool:
    return bool(x.b.module.triple == TRIPLE)


def _float(x: Value, value: ir.Value) -> Value:
    return Value(x.b, value, dtypes.DT_FLOAT32)


def _perturbed(result: Value, argument: Value) -> Value:
    """The host model's result moved by HOST_ERROR, up or down by the argument's last bit."""
    if not HOST_ERROR:
        return result
    odd = (argument.bitcast(dtypes.DT_INT32) & 1).not_equal(0)
    moved: Value = result * odd.where(1.0 + HOST_ERROR, result.constant(1.0 - HOST_ERROR))
    return moved


def _intrinsic(x: Value, name: str, *args: Value) -> Value:
    function = declared(x.b.module, name, ir.FunctionType(F32, [F32] * len(args)))
    return _float(x, x.b.call(function, [a.ir for a in args]))


def power_of_two(a: Value) -> Value:
    """2^a: ex2.approx.f32 (2 ulp; subnormal results kept, as the precise exp keeps them;
    2^-inf = 0, 2^inf = inf). On the host, the exponential in double, rounded once."""
    if _on_gpu(a):
        return _intrinsic(a, "llvm.nvvm.ex2.approx.f", a)
    exact = (a.cast(dtypes.DT_FLOAT64) * math.log(2)).exp().cast(dtypes.DT_FLOAT32)
    return _perturbed(exact, a)


def reciprocal(x: Value) -> Value:
    """1 / x over the full range: rcp.approx.f32 (1 ulp; subnormal results kept, 1/±0 = ±inf),
    which LLVM selects for a division allowed to approximate (`afn`)."""
    if _on_gpu(x):
        return _float(x, x.b.fdiv(ir.Constant(F32, 1.0), x.ir, flags=("afn",)))
    return _perturbed(1.0 / x, x)


def reciprocal_of_large(x: Value) -> Value:
    """1 / x for x ≥ 1 or NaN (a logistic's 1 + e): the SFU's rcp alone (rcp.approx.ftz.f32,
    1 ulp), without the scaling a subnormal argument or result needs; those lie below 2^-126,
    where a reciprocal of at most 1 does not reach (1/inf = 0 all the same)."""
    if _on_gpu(x):
        return _intrinsic(x, "llvm.nvvm.rcp.approx.ftz.f", x)
    return _perturbed(1.0 / x, x)


def divide(x: Value, y: Value) -> Value:
    """x / y over the full range: div.full.f32 (2 ulp; where div.approx.f32 gives 0 for
    |y| > 2^126)."""
    if _on_gpu(x):
        return _intrinsic(x, "llvm.nvvm.div.full", x, y)
    return _perturbed(x / y, y)


# ---- the formulas on them --------------------------------------------------------------------------


def exp(x: Value) -> Value:
    """e^x = 2^(x·log2 e): inf above ~88.72, 0 below ~-103.97 (subnormal between -87.3 and there)."""
    return power_of_two(x * LOG2E)


def _logistic(x: Value) -> tuple[Value, Value]:
    """e = e^-|x| in [0, 1], and 1 / (1 + e): sigmoid(x) is the second for x ≥ 0, their product
    below (neither form overflows or cancels)."""
    e = power_of_two(x.abs() * -LOG2E)
    return e, reciprocal_of_large(e + 1.0)


def sigmoid(x: Value) -> Value:
    """1 / (1 + e^-x): 1 at inf, 0 (through the subnormals) at -inf, 0.5 at ±0."""
    e, r = _logistic(x)
    value: Value = (x >= 0.0).where(r, e * r)
    return value


def silu(x: Value) -> Value:
    """x · sigmoid(x), x limited below to BOUNDED so that silu(-inf) is -0, the limit, not NaN
    (NaN passes the limit); sigmoid's e and 1 / (1 + e) are the same instructions as a
    Sigmoid's of the same x, which LLVM computes once (the SwiGLU gradient takes both)."""
    value: Value = (x < BOUNDED).where(BOUNDED, x) * sigmoid(x)
    return value


def tanh(x: Value) -> Value:
    """1 - 2 / (e^2|x| + 1) with x's sign, the polynomial below `mathlib.TANH_CUT` (±0 keeps
    its sign there); ±1 where e^2|x| overflows."""
    a = x.abs()
    large = 1.0 - 2.0 * reciprocal_of_large(power_of_two(a * (2 * LOG2E)) + 1.0)
    value: Value = (a < mathlib.TANH_CUT).where(mathlib.tanh_near_zero(a), large)
    return value.copysign(x)


# op type → its SFU formula on float32 IR values
_SFU: dict[str, Callable[..., Value]] = {
    "Exp": exp,
    "Sigmoid": sigmoid,
    "Silu": silu,
    "Tanh": tanh,
    "Reciprocal": reciprocal,
    "Div": divide,
}


def _on_float32(op_type: str) -> Formula:
    """The op's SFU formula where its arguments are float32 scalars (a narrow type computes in
    float32), its own formula otherwise (an integer division, float64 arithmetic)."""
    function = _SFU[op_type]

    def formula(args: list[Value], attrs: dict[str, str]) -> Value:
        if all(arg.ir.type == F32 for arg in args):
            return function(*(_float(arg, arg.ir) for arg in args))
        return apply(op_type, attrs, args)

    return formula


_FORMULAS = {op_type: _on_float32(op_type) for op_type in _SFU}


def formula(op_type: str, stored: Iterable[str]) -> Formula | None:
    """The rule: an op's SFU formula where every result its value reaches is stored as one of
    the `NARROW` types (`stored`: their dtypes), else None (its precise formula)."""
    return _FORMULAS.get(op_type) if all(dtype in NARROW for dtype in stored) else None


def program_formulas(program: Program, outputs: int, stored: list[str]) -> Formulas:
    """`formula` for each call of a program with `outputs` results, which with the values
    it writes in place are stored as `stored` says (`Program.feeds`)."""
    feeds = program.feeds(outputs)
    return lambda call: formula(call.op_type, [stored[k] for k in feeds[call]])
