"""Vectorized elementary functions emitted as straight-line LLVM IR.

Every public function takes an `ir.IRBuilder` and a value of type float, double or a
vector of either (any width) and returns a value of the same type. Each lane runs the
same instruction sequence, so results do not depend on the vector width. The code
uses only arithmetic, compares, selects, integer manipulation of the float encodings
and intrinsics that lower to instructions on every x86 level — no libm calls, loops
or branches:

* Rounding to an integer adds and subtracts 1.5 * 2^(p-1) (p = significand bits)
  instead of calling llvm.rint/floor, which become libm calls below SSE4.1; the
  integer is then read straight out of the sum's encoding.
* Polynomials use llvm.fmuladd: a fused multiply-add where the target has FMA, a
  multiply and an add where it does not (llvm.fma would become a call to libm's fma
  there). Results are identical across vector widths on one target and may differ in
  the last bit between FMA and non-FMA targets.
* Range reductions never depend on fusion: their constants are split (Cody-Waite) so
  that every product they need is exact in plain arithmetic, or they use Dekker's
  exact product.

Polynomial coefficients are minimax fits (Remez exchange in 50-digit mpmath, weighted
for the relative error of the final result), rounded to the target precision from the
low order up, each rounding compensated by a weighted least-squares refit of the
higher-order coefficients. The error of each rounded polynomial is noted next to it.
tests/test_mathlib.py measures the end-to-end error in ULPs.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence

from llvmlite import ir

from .irutil import has_feature, intrinsic

# -- coefficient tables, lowest order first -------------------------------------------------
# exp(r) = 1 + r + r^2 * P(r) for |r| <= ln2/2; rel. error 2^-28.1 (f32), 2^-57.7 (f64).
_EXP = {
    32: (0.49999994, 0.16666512, 0.041668225, 0.008369654, 0.0013825825),
    64: (0.5000000000000012, 0.1666666666666643, 0.04166666666651606, 0.008333333333483177,
         0.0013888888947556587, 0.00019841269534021604, 2.480148880850325e-05, 2.755755791444198e-06,
         2.763185256558413e-07, 2.5010552425133662e-08),
}
# log(1+f) = 2 atanh(s) = 2s + s * z * Q(z), s = f / (2 + f), z = s^2 <= 0.0295 (fdlibm's
# scheme); rel. error of the s * z * Q term 2^-30.1 (f32), 2^-59.4 (f64).
_LOG = {
    32: (0.6666678, 0.39976877, 0.29889685),
    64: (0.666666666666674, 0.3999999999937741, 0.2857142875134315, 0.22222197588688905,
         0.18183618730610906, 0.15312579777174176, 0.14811417767687712),
}
# tanh(x) = x + x^3 * P(x^2) for |x| < 0.625; rel. error 2^-27.7 (f32), 2^-56.4 (f64).
_TANH_CUT = 0.625
_TANH = {
    32: (-0.3333328, 0.13331412, -0.053737402, 0.020632116, -0.0056977225),
    64: (-0.33333333333332854, 0.1333333333326155, -0.053968253930943955, 0.02186948756801502,
         -0.008863220894000658, 0.0035919882987696782, -0.0014549544530637827, 0.0005863023696505671,
         -0.0002285362984452076, 7.711350173067707e-05, -1.6057902448280745e-05),
}
# erf(x) = x + x * P(x^2) for |x| < 0.5, i.e. P's constant term is 2/sqrt(pi) - 1, which keeps
# the leading term exact; rel. error 2^-29.3 (f32), 2^-56.0 (f64). 0.5 is about where erf and
# erfc cross, so neither erf = 1 - erfc above it nor erfc = 1 - erf below it cancels much.
_ERF_CUT = 0.5
_ERF = {
    32: (0.12837917, -0.3761261, 0.11282855, -0.026758812, 0.004720762),
    64: (0.12837916709551256, -0.3761263890318326, 0.1128379167091327, -0.026866170629825208,
         0.005223977331905118, -0.0008548294625607735, 0.00012053199700619726, -1.4842740406357477e-05,
         1.469649461046637e-06),
}
# float32 erf alone (not erfc or Gelu, whose tails need relative accuracy): x + x * P(x^2) below
# _ERF32_CUT, else 1 - exp(-x^2) * E(t) with E(t) ~ erfcx(x) = exp(x^2) erfc(x) over [_ERF32_CUT,
# _ERF32_ONE], t = (x - mid) / half in [-1, 1]; erf rounds to 1 beyond. No division and a plain exp:
# above the cut erfc <= 0.16, so its relative error (exp's, and x^2's rounding times x^2) moves erf
# by a fraction of an ulp. Least-squares fits on relative error. Against float64 erf on 2.2M points
# in [-5, 5]: at most 1.04 ulp (the erfc-tail form float64 keeps: 1.87), in 0.71 of its time (AVX2).
_ERF32_CUT = 1.0
_ERF32_SMALL = (0.12837917, -0.3761263, 0.11283622, -0.02685551, 0.005191834, -0.00080433843, 7.9710946e-05)
_ERF32_ONE = 3.92
_ERFCX32_MID, _ERFCX32_HALF = 2.46, 1.46
_ERFCX32 = (0.21382068, -0.11151691, 0.055256315, -0.026167596, 0.011896706, -0.005216671, 0.0022247802,
            -0.0009088646, 0.00033392553, -0.00013546355, 7.876433e-05, -2.6877029e-05)
# erfc(u) = exp(-u^2) * S(t) / u for 0.5 <= u <= _ERFC_MAX, t = (u - c) / (u + c). u * exp(u^2) *
# erfc(u) tends to 1/sqrt(pi), so S varies little and its Horner sum is well conditioned; the
# Moebius map folds u -> infinity into t -> 1. A small c keeps |t| small near u = 0.5, where
# S is most sensitive to the rounding error of t; float64 takes a larger c to cover its longer
# range with fewer terms. Rel. error 2^-28.7 (f32), 2^-53.2 (f64: half an ulp of the constant
# term). _ERFC_MAX is where 0.5 * x * erfc(x / sqrt2), the Gelu tail, drops below half the
# smallest subnormal.
_ERFC_C = {32: 1.0, 64: 3.5}
_ERFC_MAX = {32: 10.2, 64: 27.4}
_ERFC_TAIL = {
    32: (0.42758358, 0.30874312, -0.16661866, -0.040823374, 0.019653512, 0.017460272, 0.004142381,
         -0.002331288, -0.0029720028, -0.0019392915, 0.00036846328, 0.000929501),
    64: (0.54352779463113, 0.07462793234757402, -0.12184303896622828, 0.12942880995888045,
         -0.10475870253491852, 0.06670995750433711, -0.03290004337586534, 0.01167078477188063,
         -0.0022412025349675484, -0.0002954115262699838, 0.0003362348141083037, -5.841949538948325e-05,
         -2.8064906523831015e-05, 1.2945211860241097e-05, 1.92517358019025e-06, -2.093174971871871e-06,
         -1.1983774003899586e-07, 3.3195524520129486e-07, 1.1049561876668203e-08, -5.1618923639769463e-08,
         -1.7543700815782798e-09, 5.856043731402173e-09),
}
# sin(r) = r + r^3 * S(r^2), cos(r) = 1 - r^2/2 + r^4 * C(r^2) for |r| <= pi/4 (fitted on
# 1.001 * pi/4); rel. error sin 2^-27.9 / 2^-57.9, cos 2^-33.0 / 2^-63.9 (f32 / f64).
_TRIG_CLAMP = math.pi / 4 * 1.001
_SIN = {
    32: (-0.16666655, 0.008332188, -0.00019518072),
    64: (-0.1666666666666663, 0.008333333333321888, -0.0001984126982941891, 2.755731356505335e-06,
         -2.505073921556132e-08, 1.5895744543462727e-10),
}
_COS = {
    32: (0.041666646, -0.001388731, 2.4432338e-05),
    64: (0.041666666666666595, -0.0013888888888873318, 2.4801587288975266e-05, -2.755731420644774e-07,
         2.0875703628228804e-09, -1.1358642976671471e-11),
}
# atan(t) = t - t * z * P(z), z = t^2, for |t| <= 7/16 (fdlibm's coefficients, double only:
# float32 functions of this group run in double); rel. error 2^-57.6.
_ATAN = (0.333333333333329318027, -0.199999999998764832476, 0.142857142725034663711, -0.111111104054623557880,
         0.0909088713343650656196, -0.0769187620504482999495, 0.0666107313738753120669, -0.0583357013379057348645,
         0.0497687799461593236017, -0.0365315727442169155270, 0.0162858201153657823623)
# fdlibm's reduction of atan's argument a >= 0: below each bound b, t = (a - c) / (1 + c * a) and
# atan(a) = atan(c) + atan(t) with atan(c) = hi + lo; above the last bound t = -1 / a (c = inf).
_ATAN_BOUNDS = (7 / 16, 11 / 16, 19 / 16, 39 / 16)
_ATAN_BASES = ((0.5, float.fromhex("0x1.dac670561bb4fp-2"), float.fromhex("0x1.a2b7f222f65e2p-56")),
               (1.0, float.fromhex("0x1.921fb54442d18p-1"), float.fromhex("0x1.1a62633145c07p-55")),
               (1.5, float.fromhex("0x1.f730bd281f69bp-1"), float.fromhex("0x1.007887af0cbbdp-56")),
               (math.inf, float.fromhex("0x1.921fb54442d18p+0"), float.fromhex("0x1.1a62633145c07p-54")))
# sinh(x) = x + x^3 * S(x^2) for |x| < 1: the Taylor series, rel. error 2^-56.8 (double).
_SINH_CUT = 1.0
_SINH = tuple(1 / math.factorial(2 * k + 3) for k in range(9))
# sinh and cosh of |x| beyond this overflow double (log(2 * DBL_MAX)).
_HYPERBOLIC_OVERFLOW = 710.4758600739439
# asinh and acosh of a beyond this are log(a) + log(2): sqrt(a^2 +- 1) rounds to a.
_ARC_HYPERBOLIC_LARGE = 2.0**28

# -- range reduction constants ----------------------------------------------------------------
# ln2 = LN2_HI + LN2_LO with LN2_HI rounded to p - 11 bits, so k * LN2_HI is exact for |k| < 2^11.
_LN2_HI = {32: float.fromhex("0x1.62ep-1"), 64: float.fromhex("0x1.62e42fefa38p-1")}
_LN2_LO = {32: float.fromhex("0x1.0bfbe8p-15"), 64: float.fromhex("0x1.ef35793c7673p-45")}
# exp's input is clamped to [lo, hi]: exp(hi) overflows; exp(lo) underflows even when scaled by
# a factor up to 2^20 (silu, gelu), and its 2^k still splits into two normal halves.
_EXP_CLAMP = {32: (-150.0, 89.0), 64: (-1400.0, 711.0)}
# pi/2 = C1 + C2 + C3 with C1, C2 of 39 bits (k * Ci exact for k < 2^14, |x| < 25735) and C3 the
# next 53 bits: about 131 bits in all, enough for the closest approach of a double to a multiple
# of pi/2 below 2^14 * pi/2 (2^-60.5, at 29 * pi/2). Reduction always runs in double.
_PIO2 = (float.fromhex("0x1.921fb54444p+0"), float.fromhex("-0x1.2e7b967674p-40"),
         float.fromhex("0x1.8a2e03707344ap-81"))
# Gelu (tanh form): 0.5 * x * (1 + tanh(y)) = x * sigmoid(2y), 2y = x * (G1 + G2 * x^2),
# G1 = 2 * sqrt(2/pi), G2 = G1 * 0.044715, each as an unevaluated sum hi + lo of two floats.
_GELU_G1 = {32: (1.5957691669464111, -4.534068054340423e-08), 64: (1.5957691216057308, -9.96930880911092e-17)}
_GELU_G2 = {32: (0.07135481387376785, 2.3988324659995897e-09), 64: (0.07135481627260025, -6.175149918155315e-19)}
_GELU_CLAMP = 40.0  # |2y| > 4000 beyond: sigmoid(2y) is exactly 0 or 1

class _Ops:
    """Lane-wise operations on one floating type (scalar or vector) and the integer type of the
    same shape and width, with constants splatted to that shape."""

    def __init__(self, builder: ir.IRBuilder, type_: ir.Type) -> None:
        lanes = type_.count if isinstance(type_, ir.VectorType) else None
        scalar = type_.element if lanes else type_
        if not isinstance(scalar, (ir.FloatType, ir.DoubleType)):
            raise TypeError(f"mathlib works on float, double or vectors of them, not {type_}")
        self.builder = builder
        self.ty = type_
        self.bits = 64 if isinstance(scalar, ir.DoubleType) else 32
        self.mant = 52 if self.bits == 64 else 23  # explicit significand bits
        self.bias = 1023 if self.bits == 64 else 127
        self._fscalar = scalar
        self._iscalar = ir.IntType(self.bits)
        self.ity = ir.VectorType(self._iscalar, lanes) if lanes else self._iscalar

    def like(self, scalar: ir.Type) -> _Ops:
        """Operations on `scalar` elements with this type's shape."""
        shape = ir.VectorType(scalar, self.ty.count) if isinstance(self.ty, ir.VectorType) else scalar
        return _Ops(self.builder, shape)

    def c(self, value: float) -> ir.Constant:
        return self._splat(self.ty, ir.Constant(self._fscalar, value))

    def ic(self, value: int) -> ir.Constant:
        return self._splat(self.ity, ir.Constant(self._iscalar, value))

    @staticmethod
    def _splat(type_: ir.Type, scalar: ir.Constant) -> ir.Constant:
        return ir.Constant(type_, [scalar] * type_.count) if isinstance(type_, ir.VectorType) else scalar

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.fadd(a, b)

    def sub(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.fsub(a, b)

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.fmul(a, b)

    def div(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.fdiv(a, b)

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        """a * b + c, fused where the target has FMA."""
        return self._call("llvm.fmuladd", a, b, c)

    def poly(self, x: ir.Value, coeffs: Sequence[float]) -> ir.Value:
        """Horner evaluation of sum(coeffs[i] * x^i)."""
        acc = self.c(coeffs[-1])
        for coeff in reversed(coeffs[:-1]):
            acc = self.fma(acc, x, self.c(coeff))
        return acc

    def abs(self, x: ir.Value) -> ir.Value:
        return self._call("llvm.fabs", x)

    def copysign(self, magnitude: ir.Value, sign: ir.Value) -> ir.Value:
        return self._call("llvm.copysign", magnitude, sign)

    def _call(self, name: str, *args: ir.Value) -> ir.Value:
        return self.builder.call(intrinsic(self.builder.module, name, self.ty), list(args))

    def cmp(self, op: str, a: ir.Value, b: ir.Value) -> ir.Value:
        """Ordered comparison: false when either side is NaN."""
        return self.builder.fcmp_ordered(op, a, b)

    def select(self, cond: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.select(cond, a, b)

    def min_const(self, x: ir.Value, limit: float) -> ir.Value:
        """min(x, limit), passing NaN through."""
        return self.select(self.cmp(">", x, self.c(limit)), self.c(limit), x)

    def clamp(self, x: ir.Value, lo: float, hi: float) -> ir.Value:
        """x limited to [lo, hi], passing NaN through."""
        return self.min_const(self.select(self.cmp("<", x, self.c(lo)), self.c(lo), x), hi)

    def to_int(self, x: ir.Value) -> ir.Value:
        return self.builder.bitcast(x, self.ity)

    def from_int(self, i: ir.Value) -> ir.Value:
        return self.builder.bitcast(i, self.ty)

    def round_int(self, x: ir.Value) -> tuple[ir.Value, ir.Value]:
        """x rounded to the nearest integer (ties to even) as a float and as an integer, for
        |x| < 2^(p-2). Adding 1.5 * 2^(p-1) leaves the integer in the low significand bits;
        larger inputs or NaN give a meaningless but defined result (never poison)."""
        magic = 1.5 * 2.0**self.mant
        shifted = self.add(x, self.c(magic))
        as_int = self.builder.sub(self.to_int(shifted), self.ic(_float_bits(magic, self.bits)))
        return self.sub(shifted, self.c(magic)), as_int

    def pow2(self, k: ir.Value) -> ir.Value:
        """2^k for an integer k in the normal exponent range."""
        return self.from_int(self.builder.shl(self.builder.add(k, self.ic(self.bias)), self.ic(self.mant)))


def _float_bits(value: float, bits: int) -> int:
    """The IEEE encoding of `value`, rounded to the `bits`-wide format, as a signed integer."""
    fmt, ifmt = ("<d", "<q") if bits == 64 else ("<f", "<i")
    return struct.unpack(ifmt, struct.pack(fmt, value))[0]


# -- double-word arithmetic (exact with or without FMA) ----------------------------------------

def _split(o: _Ops, a: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Veltkamp's split: a = hi + lo, each with at most half the significand bits."""
    t = o.mul(a, o.c(2.0 ** ((o.mant + 2) // 2) + 1))
    hi = o.sub(t, o.sub(t, a))
    return hi, o.sub(a, hi)


def _two_prod(o: _Ops, a: ir.Value, b: ir.Value) -> tuple[ir.Value, ir.Value]:
    """a * b = p + e exactly (barring overflow and underflow): e is one fused multiply-add
    where the module's target has FMA, else Dekker's product of split halves (seven
    multiplies and eight adds more: llvm.fma without FMA would call the C library per lane)."""
    p = o.mul(a, b)
    if has_feature(o.builder.module, "fma"):
        return p, o._call("llvm.fma", a, b, o.builder.fneg(p))
    ah, al = _split(o, a)
    bh, bl = _split(o, b)
    e = o.add(o.add(o.add(o.sub(o.mul(ah, bh), p), o.mul(ah, bl)), o.mul(al, bh)), o.mul(al, bl))
    return p, e


def _two_sum(o: _Ops, a: ir.Value, b: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Knuth's sum: a + b = s + e exactly."""
    s = o.add(a, b)
    bb = o.sub(s, a)
    return s, o.add(o.sub(a, o.sub(s, bb)), o.sub(b, bb))


# -- building blocks ---------------------------------------------------------------------------

def _exp_parts(o: _Ops, hi: ir.Value, lo: ir.Value | None = None) -> tuple[ir.Value, ir.Value]:
    """exp(hi + lo) as a pair (m, s) with exp = m * s, where m is normal and s a power of two.

    k = round((hi + lo) / ln2) and r = hi + lo - k * ln2 (Cody-Waite: k * LN2_HI is exact, and so,
    by Sterbenz's lemma, is hi - k * LN2_HI whenever lo is small), so |r| <= ln2/2 and
    exp = 2^k * (1 + r + r^2 P(r)). 2^k is applied as 2^k1 * 2^k2 with k1 = k >> 1: m = p * 2^k1
    is exact and normal, so the one rounding of a subnormal result happens in the final multiply
    by s = 2^k2. A caller may scale m first (x * exp(z) = (m * x) * s) to keep that single
    rounding. `lo` carries the low part of an argument known to more than working precision.
    """
    lo_limit, hi_limit = _EXP_CLAMP[o.bits]
    hi = o.clamp(hi, lo_limit, hi_limit)
    whole = hi if lo is None else o.add(hi, lo)
    k, ki = o.round_int(o.mul(whole, o.c(1 / math.log(2))))
    r = o.sub(hi, o.mul(k, o.c(_LN2_HI[o.bits])))
    if lo is not None:
        r = o.add(r, lo)
    r = o.sub(r, o.mul(k, o.c(_LN2_LO[o.bits])))
    p = o.add(o.c(1.0), o.fma(o.mul(r, r), o.poly(r, _EXP[o.bits]), r))
    k1 = o.builder.ashr(ki, o.ic(1))
    k2 = o.builder.sub(ki, k1)
    return o.mul(p, o.pow2(k1)), o.pow2(k2)


def _logistic_parts(o: _Ops, z: ir.Value, z_lo: ir.Value | None = None) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Pieces of sigmoid(z + z_lo): e = exp(-|z + z_lo|) as (m, s), and the denominator 1 + e.

    sigmoid(z) = 1 / (1 + e) for z >= 0 and e / (1 + e) for z < 0; neither form cancels or
    overflows, and the second keeps full relative accuracy deep into the subnormal range.
    """
    negative_lo = None
    if z_lo is not None:
        negative_lo = o.select(o.cmp("<", z, o.c(0.0)), z_lo, o.builder.fneg(z_lo))
    m, s = _exp_parts(o, o.builder.fneg(o.abs(z)), negative_lo)
    return m, s, o.add(o.c(1.0), o.mul(m, s))


def _scaled_logistic(o: _Ops, x: ir.Value, z: ir.Value, z_lo: ir.Value | None = None) -> ir.Value:
    """x * sigmoid(z) for z with the sign of x, rounded once even when the result is subnormal.

    For x = -inf the limit -0 is returned (x * sigmoid(x) -> 0), not NaN.
    """
    m, s, denominator = _logistic_parts(o, z, z_lo)
    positive = o.cmp(">=", z, o.c(0.0))
    # one division serves both signs: x / (1 + e) above zero, m * (x / (1 + e)) * s below
    quotient = o.div(o.select(positive, x, o.clamp(x, _EXP_CLAMP[o.bits][0], 0.0)), denominator)
    return o.select(positive, quotient, o.mul(o.mul(m, quotient), s))


def _erfc_tail(o: _Ops, v: ir.Value, gelu: bool) -> tuple[ir.Value, ir.Value, ir.Value]:
    """erfc(u) with u = v, or for Gelu 0.5 * v * erfc(u) with u = v / sqrt2, as a triple (m, s, q)
    with value (m * q) * s; valid for u >= 0.5. v is first clamped to where the value underflows.

    exp(-u^2) is computed from u^2 = hi + lo exactly: vh keeps the upper half of v's
    significand so vh^2 is exact, and lo = (v - vh)(v + vh) is small. Rounding u^2 instead
    would cost a relative error of about u^2 ulps, hundreds in the far tail. For Gelu,
    0.5 * v * exp(-u^2) * S / u = exp(-u^2 - ln(2)/2) * S: the constant joins the low part of
    the exponent and no division is needed.
    """
    v = o.min_const(v, _ERFC_MAX[o.bits] * (math.sqrt(2) if gelu else 1.0))
    u = o.mul(v, o.c(math.sqrt(0.5))) if gelu else v
    kept = (o.mant + 1) // 2
    vh = o.from_int(o.builder.and_(o.to_int(v), o.ic(-(1 << (o.mant + 1 - kept)))))
    scale = o.c(-0.5 if gelu else -1.0)
    square_hi = o.mul(o.mul(vh, vh), scale)
    square_lo = o.mul(o.mul(o.sub(v, vh), o.add(v, vh)), scale)
    if gelu:
        square_lo = o.sub(square_lo, o.c(math.log(2) / 2))
    m, s = _exp_parts(o, square_hi, square_lo)
    c = o.c(_ERFC_C[o.bits])
    tail = o.poly(o.div(o.sub(u, c), o.add(u, c)), _ERFC_TAIL[o.bits])
    return m, s, tail if gelu else o.div(tail, u)


def _erf_small(o: _Ops, a: ir.Value) -> ir.Value:
    """erf(a) for |a| < 0.5."""
    return o.fma(a, o.poly(o.mul(a, a), _ERF[o.bits]), a)


def _trig_parts(builder: ir.IRBuilder, x: ir.Value) -> tuple[_Ops, ir.Value, ir.Value, ir.Value]:
    """sin(r), cos(r) and the quadrant k (an integer) with |x| = r + k * pi/2, |r| <= pi/4.

    The Cody-Waite reduction with a three-part pi/2 runs in double for both precisions: in
    float it could not resolve the float inputs closest to multiples of pi/2 (2^-27.8 away
    below 1e4). It is exact up to the final rounding for |x| < 25735; beyond, accuracy fades
    gradually, and past 2^51 the quotient is meaningless, but r is clamped to [-pi/4, pi/4]
    (slightly widened) so sine and cosine stay in [-1, 1].
    """
    o = _Ops(builder, x.type)
    d = o.like(ir.DoubleType())
    a = o.abs(x)
    wide = a if o.bits == 64 else builder.fpext(a, d.ty)
    k, ki = d.round_int(d.mul(wide, d.c(2 / math.pi)))
    r = wide
    for part in _PIO2:
        r = d.sub(r, d.mul(k, d.c(part)))
    if o.bits == 32:
        r = builder.fptrunc(r, o.ty)
        ki = builder.trunc(ki, o.ity)
    r = o.clamp(r, -_TRIG_CLAMP, _TRIG_CLAMP)
    z = o.mul(r, r)
    sin_r = o.fma(o.mul(r, z), o.poly(z, _SIN[o.bits]), r)
    cos_r = o.fma(o.mul(z, z), o.poly(z, _COS[o.bits]), o.fma(z, o.c(-0.5), o.c(1.0)))
    return o, sin_r, cos_r, ki


def _odd(o: _Ops, ki: ir.Value) -> ir.Value:
    return o.builder.icmp_unsigned("!=", o.builder.and_(ki, o.ic(1)), o.ic(0))


def _sign_of(o: _Ops, x: ir.Value) -> ir.Value:
    """The sign bit of x, as an integer mask."""
    return o.builder.and_(o.to_int(x), o.ic(-(1 << (o.bits - 1))))


def _sin_cos(builder: ir.IRBuilder, x: ir.Value, cosine: bool) -> ir.Value:
    """sin(x) or cos(x) from `_trig_parts`: quadrant k mod 4 picks sin or cos of r and the
    sign; sin is odd, so it takes x's sign back."""
    o, sin_r, cos_r, ki = _trig_parts(builder, x)
    if cosine:
        ki = builder.add(ki, o.ic(1))
    result = o.select(_odd(o, ki), cos_r, sin_r)
    sign = builder.shl(builder.and_(ki, o.ic(2)), o.ic(o.bits - 2))
    if not cosine:
        sign = builder.xor(sign, _sign_of(o, x))
    return o.from_int(builder.xor(o.to_int(result), sign))


def _tan_cot(builder: ir.IRBuilder, x: ir.Value, cotangent: bool) -> ir.Value:
    """tan(x) or cot(x) of |x| = r + k * pi/2: tan is sin(r) / cos(r) for even k and
    -cos(r) / sin(r) for odd k (cot the reciprocals); both are odd, so x's sign comes back."""
    o, sin_r, cos_r, ki = _trig_parts(builder, x)
    odd = _odd(o, ki)
    swap = builder.not_(odd) if cotangent else odd
    quotient = o.div(o.select(swap, cos_r, sin_r), o.select(swap, sin_r, cos_r))
    result = o.select(odd, builder.fneg(quotient), quotient)
    return o.from_int(builder.xor(o.to_int(result), _sign_of(o, x)))


def _atan_positive(d: _Ops, a: ir.Value) -> ir.Value:
    """atan(a) for a >= 0, fdlibm's scheme: a is reduced to t = (a - c) / (1 + c * a) for
    the c nearest it (t = -1 / a above 39/16), |t| <= 7/16, and atan(a) = atan(c) + atan(t)
    with atan(c) known to twice the precision. Each a - c is exact (Sterbenz)."""
    numerator, denominator, hi, lo = a, d.c(1.0), d.c(0.0), d.c(0.0)
    for bound, (c, base_hi, base_lo) in zip(_ATAN_BOUNDS, _ATAN_BASES):
        above = d.cmp(">=", a, d.c(bound))
        if math.isinf(c):
            n, m = d.c(-1.0), a
        else:
            n, m = d.sub(a, d.c(c)), d.fma(a, d.c(c), d.c(1.0))
        numerator = d.select(above, n, numerator)
        denominator = d.select(above, m, denominator)
        hi = d.select(above, d.c(base_hi), hi)
        lo = d.select(above, d.c(base_lo), lo)
    t = d.div(numerator, denominator)
    z = d.mul(t, t)
    tail = d.sub(d.mul(d.mul(t, z), d.poly(z, _ATAN)), lo)
    return d.sub(hi, d.sub(tail, t))


def _log1p(d: _Ops, y: ir.Value) -> ir.Value:
    """log(1 + y) as log(u) + (y - (u - 1)) / u with u = 1 + y rounded: the quotient puts
    back, to first order, what rounding u lost. Where u rounds to 1 the result is y itself
    (its sign of zero too)."""
    u = d.add(d.c(1.0), y)
    correction = d.div(d.sub(y, d.sub(u, d.c(1.0))), u)
    finite = d.builder.and_(d.cmp(">", u, d.c(0.0)), d.cmp("<", u, d.c(2.0**53)))
    result = d.add(log(d.builder, u), d.select(finite, correction, d.c(0.0)))
    return d.select(d.cmp("==", u, d.c(1.0)), y, result)


def _acosh(d: _Ops, y: ir.Value, t: ir.Value) -> ir.Value:
    """acosh(y), given t = y - 1 to full relative accuracy (near y = 1 everything hangs on it):
    log1p(t + sqrt(2t + t^2)) up to y = 2, log(2y - 1 / (y + sqrt(y^2 - 1))) above, and
    log(y) + log(2) where y^2 - 1 rounds to y^2. NaN below 1."""
    small = _log1p(d, d.add(t, d.builder.call(_sqrt(d), [d.fma(t, t, d.add(t, t))])))
    root = d.builder.call(_sqrt(d), [d.fma(y, y, d.c(-1.0))])
    middle = log(d.builder, d.sub(d.add(y, y), d.div(d.c(1.0), d.add(y, root))))
    large = d.add(log(d.builder, y), d.c(math.log(2)))
    result = d.select(d.cmp(">", y, d.c(_ARC_HYPERBOLIC_LARGE)), large, d.select(d.cmp(">", y, d.c(2.0)), middle, small))
    return d.select(d.cmp("<", y, d.c(1.0)), d.c(math.nan), result)


def _sqrt(o: _Ops) -> ir.Function:
    return intrinsic(o.builder.module, "llvm.sqrt", o.ty)


def _exp_half(d: _Ops, a: ir.Value) -> ir.Value:
    """exp(a) / 2 for a >= 0, finite up to where sinh and cosh overflow."""
    m, s = _exp_parts(d, a)
    half = d.mul(d.mul(m, d.c(0.5)), s)
    return d.select(d.cmp(">", a, d.c(_HYPERBOLIC_OVERFLOW)), d.c(math.inf), half)


def _reciprocal_exp(d: _Ops, a: ir.Value, sign: float) -> ir.Value:
    """2e / (1 + sign * e^2) with e = exp(-a), a >= 0: sech (sign 1) and, for a not small,
    |csch| (sign -1). e = m * s is applied last, so a subnormal result is rounded once."""
    m, s = _exp_parts(d, d.builder.fneg(a))
    e = d.mul(m, s)
    return d.mul(d.div(d.add(m, m), d.fma(d.mul(e, e), d.c(sign), d.c(1.0))), s)


# -- public functions --------------------------------------------------------------------------

Function = Callable[[ir.IRBuilder, ir.Value], ir.Value]


def _nan_in_nan_out(function: Function) -> Function:
    """Return a NaN input itself (quieted, sign and payload kept) whatever path it took through
    the computation: the bits of a NaN produced from NaN operands depend on operand order,
    which instruction selection may commute differently at different vector widths."""

    @functools.wraps(function)
    def wrapped(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
        result = function(builder, x)
        return builder.select(builder.fcmp_unordered("uno", x, x), builder.fadd(x, x), result)

    return wrapped


@_nan_in_nan_out
def exp(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """e^x; overflows to inf above log(max), underflows through the subnormals to 0."""
    o = _Ops(builder, x.type)
    m, s = _exp_parts(o, x)
    return o.mul(m, s)


@_nan_in_nan_out
def log(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Natural logarithm, fdlibm's scheme: x = 2^k * m with m in [sqrt(1/2), sqrt(2)), found
    from the encoding (subnormals are first scaled by 2^(p+1)); with f = m - 1 and
    s = f / (2 + f), log(m) = f - f^2/2 + s * (f^2/2 + z * Q(z)), z = s^2, and
    log(x) = k * ln2 + log(m) with ln2 split so that k * LN2_HI is exact.
    log(0) = -inf, log(x < 0) = NaN, log(inf) = inf."""
    o = _Ops(builder, x.type)
    b = builder
    tiny = o.cmp("<", x, o.c(2.0 ** (1 - o.bias)))
    normal = o.select(tiny, o.mul(x, o.c(2.0 ** (o.mant + 1))), x)
    sqrt_half = _float_bits(math.sqrt(0.5), o.bits)
    bits = b.add(o.to_int(normal), o.ic(_float_bits(1.0, o.bits) - sqrt_half))
    k = b.sub(b.ashr(bits, o.ic(o.mant)), o.ic(o.bias))
    k = b.sub(k, b.select(tiny, o.ic(o.mant + 1), o.ic(0)))
    m = o.from_int(b.add(b.and_(bits, o.ic((1 << o.mant) - 1)), o.ic(sqrt_half)))
    f = o.sub(m, o.c(1.0))
    s = o.div(f, o.add(o.c(2.0), f))
    z = o.mul(s, s)
    half_f2 = o.mul(o.mul(f, f), o.c(0.5))
    kf = b.sitofp(k, o.ty)
    result = o.fma(s, o.add(half_f2, o.mul(z, o.poly(z, _LOG[o.bits]))), o.mul(kf, o.c(_LN2_LO[o.bits])))
    result = o.add(o.add(o.sub(result, half_f2), f), o.mul(kf, o.c(_LN2_HI[o.bits])))
    result = o.select(o.cmp("<", x, o.c(0.0)), o.c(math.nan), result)
    result = o.select(o.cmp("==", x, o.c(0.0)), o.c(-math.inf), result)
    return o.select(o.cmp("==", x, o.c(math.inf)), o.c(math.inf), result)


@_nan_in_nan_out
def tanh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Hyperbolic tangent: an odd polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above (where
    the subtraction loses less than a bit), with x's sign; tiny x gives x, large |x| gives ±1."""
    o = _Ops(builder, x.type)
    a = o.abs(x)
    z = o.mul(a, a)
    small = o.fma(o.mul(a, z), o.poly(z, _TANH[o.bits]), a)
    m, s = _exp_parts(o, o.add(a, a))
    large = o.sub(o.c(1.0), o.div(o.c(2.0), o.add(o.mul(m, s), o.c(1.0))))
    return o.copysign(o.select(o.cmp("<", a, o.c(_TANH_CUT)), small, large), x)


@_nan_in_nan_out
def sigmoid(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """1 / (1 + e^-x), from e = exp(-|x|) as 1 / (1 + e) or e / (1 + e), so it is accurate in
    both tails: 1 for large x, subnormal down to 0 for very negative x."""
    o = _Ops(builder, x.type)
    m, s, denominator = _logistic_parts(o, x)
    numerator = o.select(o.cmp(">=", x, o.c(0.0)), o.c(1.0), o.mul(m, s))
    return o.div(numerator, denominator)


@_nan_in_nan_out
def silu(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """x * sigmoid(x) (swish); silu(-inf) = -0, the limit."""
    return _scaled_logistic(_Ops(builder, x.type), x, x)


@_nan_in_nan_out
def erf(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Error function, with x's sign: in float32 x + x * P(x^2) below 1, 1 - exp(-x^2) * E(t)
    above (`_ERF32_CUT`); in float64 x + x * P(x^2) below 0.5, 1 - erfc(|x|) above with erfc
    from the tail approximation."""
    o = _Ops(builder, x.type)
    a = o.abs(x)
    if o.bits == 32:
        small = o.fma(a, o.poly(o.mul(a, a), _ERF32_SMALL), a)
        v = o.min_const(a, _ERF32_ONE)
        t = o.fma(v, o.c(1 / _ERFCX32_HALF), o.c(-_ERFCX32_MID / _ERFCX32_HALF))
        # exp(-x²), unclamped: past _ERF32_ONE it only shrinks, and erf stays 1. The same
        # exp of the same -(x·x) elsewhere in a program (Gelu's gradient: its density) is
        # then the same instructions, which LLVM computes once.
        m, s = _exp_parts(o, o.builder.fneg(o.mul(x, x)))
        large = o.sub(o.c(1.0), o.mul(o.mul(m, o.poly(t, _ERFCX32)), s))
        return o.copysign(o.select(o.cmp("<", a, o.c(_ERF32_CUT)), small, large), x)
    m, s, q = _erfc_tail(o, a, gelu=False)
    large = o.sub(o.c(1.0), o.mul(o.mul(m, q), s))
    return o.copysign(o.select(o.cmp("<", a, o.c(_ERF_CUT)), _erf_small(o, a), large), x)


@_nan_in_nan_out
def gelu_erf(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Exact Gelu, 0.5 * x * (1 + erf(x / sqrt2)). Where |x| / sqrt2 >= 0.5 it is
    x - 0.5 * x * erfc(u) for x > 0 and 0.5 * x * erfc(u) for x < 0 (u = |x| / sqrt2), so the
    negative tail keeps its relative accuracy down to the subnormals; gelu_erf(-inf) = -0."""
    o = _Ops(builder, x.type)
    a = o.abs(x)
    u = o.mul(a, o.c(math.sqrt(0.5)))
    small = o.mul(x, o.fma(o.copysign(o.c(0.5), x), _erf_small(o, u), o.c(0.5)))
    m, s, q = _erfc_tail(o, a, gelu=True)
    tail = o.mul(o.mul(m, q), s)
    large = o.select(o.cmp(">=", x, o.c(0.0)), o.sub(x, tail), o.builder.fneg(tail))
    return o.select(o.cmp("<", u, o.c(_ERF_CUT)), small, large)


@_nan_in_nan_out
def gelu_tanh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Tanh-approximated Gelu, 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), computed
    as x * sigmoid(2y). 2y is formed in double-word arithmetic (Dekker products, hi + lo
    constants): the relative error of exp(2y) is |2y| times that of 2y, which would reach
    hundreds of ulps in the negative tail. gelu_tanh(-inf) = -0."""
    o = _Ops(builder, x.type)
    xc = o.clamp(x, -_GELU_CLAMP, _GELU_CLAMP)
    g1_hi, g1_lo = (o.c(v) for v in _GELU_G1[o.bits])
    g2_hi, g2_lo = (o.c(v) for v in _GELU_G2[o.bits])
    sq_hi, sq_lo = _two_prod(o, xc, xc)
    p_hi, p_lo = _two_prod(o, g2_hi, sq_hi)
    p_lo = o.add(p_lo, o.add(o.mul(g2_hi, sq_lo), o.mul(g2_lo, sq_hi)))
    t_hi, t_lo = _two_sum(o, g1_hi, p_hi)
    t_lo = o.add(t_lo, o.add(p_lo, g1_lo))
    z_hi, z_lo = _two_prod(o, xc, t_hi)
    z_lo = o.add(z_lo, o.mul(xc, t_lo))
    return _scaled_logistic(o, x, z_hi, z_lo)


@_nan_in_nan_out
def sin(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Sine; see `_sin_cos` for the range reduction. sin(±inf) = NaN."""
    return _sin_cos(builder, x, cosine=False)


@_nan_in_nan_out
def cos(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Cosine; see `_sin_cos` for the range reduction. cos(±inf) = NaN."""
    return _sin_cos(builder, x, cosine=True)


def _in_double(function: Function) -> Function:
    """Compute a float32 input in double and round once. The double algorithms err by a few
    double ulps, far below half a float32 ulp, so float32 results are within about half an
    ulp; these functions (rarer in models than exp or tanh) get one implementation."""

    @functools.wraps(function)
    def wrapped(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
        o = _Ops(builder, x.type)
        if o.bits == 64:
            return function(builder, x)
        wide = builder.fpext(x, o.like(ir.DoubleType()).ty)
        return builder.fptrunc(function(builder, wide), x.type)

    return wrapped


@_nan_in_nan_out
@_in_double
def tan(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Tangent; the reduction is sin's and cos's. tan(±inf) = NaN."""
    return _tan_cot(builder, x, cotangent=False)


@_nan_in_nan_out
@_in_double
def cot(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Cotangent, 1 / tan(x); cot(±0) = ±inf."""
    return _tan_cot(builder, x, cotangent=True)


@_nan_in_nan_out
@_in_double
def atan(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Arctangent, in (-pi/2, pi/2); atan(±inf) = ±pi/2."""
    d = _Ops(builder, x.type)
    return d.copysign(_atan_positive(d, d.abs(x)), x)


@_nan_in_nan_out
@_in_double
def asin(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Arcsine, atan(x / sqrt((1 - x)(1 + x))): 1 - |x| is exact where it matters (|x| >= 1/2),
    so the argument keeps its relative accuracy up to ±1. NaN beyond."""
    d = _Ops(builder, x.type)
    a = d.abs(x)
    root = builder.call(_sqrt(d), [d.mul(d.sub(d.c(1.0), a), d.add(d.c(1.0), a))])
    return d.copysign(_atan_positive(d, d.div(a, root)), x)


@_nan_in_nan_out
@_in_double
def acos(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Arccosine, 2 atan(sqrt((1 - x) / (1 + x))), accurate at both ends (1 - x and 1 + x are
    exact there); in [0, pi], NaN beyond ±1."""
    d = _Ops(builder, x.type)
    ratio = d.div(d.sub(d.c(1.0), x), d.add(d.c(1.0), x))
    angle = _atan_positive(d, builder.call(_sqrt(d), [ratio]))
    return d.select(d.cmp("<", ratio, d.c(0.0)), d.c(math.nan), d.add(angle, angle))


@_nan_in_nan_out
@_in_double
def sinh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Hyperbolic sine: its Taylor series below 1 (where e^x - e^-x would cancel), else
    (e^|x| - e^-|x|) / 2 with x's sign; ±inf beyond log(2 * DBL_MAX)."""
    d = _Ops(builder, x.type)
    a = d.abs(x)
    z = d.mul(a, a)
    small = d.fma(d.mul(a, z), d.poly(z, _SINH), a)
    half = _exp_half(d, a)
    large = d.sub(half, d.div(d.c(0.25), half))
    return d.copysign(d.select(d.cmp("<", a, d.c(_SINH_CUT)), small, large), x)


@_nan_in_nan_out
@_in_double
def cosh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Hyperbolic cosine, (e^|x| + e^-|x|) / 2 (no cancellation); inf beyond log(2 * DBL_MAX)."""
    d = _Ops(builder, x.type)
    half = _exp_half(d, d.abs(x))
    return d.add(half, d.div(d.c(0.25), half))


@_nan_in_nan_out
@_in_double
def sech(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Hyperbolic secant, 2e / (1 + e^2) with e = exp(-|x|): no overflow on the way, and the
    tail stays accurate through the subnormals."""
    d = _Ops(builder, x.type)
    return _reciprocal_exp(d, d.abs(x), 1.0)


@_nan_in_nan_out
@_in_double
def csch(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Hyperbolic cosecant: 1 / sinh(x) below 1, 2e / (1 - e^2) with e = exp(-|x|) above
    (accurate through the subnormals), with x's sign; csch(±0) = ±inf."""
    d = _Ops(builder, x.type)
    a = d.abs(x)
    small = d.div(d.c(1.0), sinh(builder, a))
    return d.copysign(d.select(d.cmp("<", a, d.c(_SINH_CUT)), small, _reciprocal_exp(d, a, -1.0)), x)


@_nan_in_nan_out
@_in_double
def log1p(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """log(1 + x), accurate for small x; -inf at -1, NaN below."""
    return _log1p(_Ops(builder, x.type), x)


@_nan_in_nan_out
@_in_double
def asinh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Inverse hyperbolic sine (fdlibm's forms): log1p(a + a^2 / (1 + sqrt(1 + a^2))) up to
    a = |x| = 2, log(2a + 1 / (a + sqrt(a^2 + 1))) above, log(a) + log(2) for huge a; x's sign."""
    d = _Ops(builder, x.type)
    a = d.abs(x)
    square = d.mul(a, a)
    root = builder.call(_sqrt(d), [d.add(square, d.c(1.0))])
    small = _log1p(d, d.add(a, d.div(square, d.add(d.c(1.0), root))))
    middle = log(builder, d.add(d.add(a, a), d.div(d.c(1.0), d.add(a, root))))
    large = d.add(log(builder, a), d.c(math.log(2)))
    result = d.select(d.cmp(">", a, d.c(_ARC_HYPERBOLIC_LARGE)), large, d.select(d.cmp(">", a, d.c(2.0)), middle, small))
    return d.copysign(result, x)


@_nan_in_nan_out
@_in_double
def acosh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Inverse hyperbolic cosine, for x >= 1 (NaN below)."""
    d = _Ops(builder, x.type)
    return _acosh(d, x, d.sub(x, d.c(1.0)))


@_nan_in_nan_out
@_in_double
def asech(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Inverse hyperbolic secant, acosh(1 / x) for 0 < x <= 1 with 1 / x - 1 formed as
    (1 - x) / x, exact but for one rounding, and log(2 / x) for tiny x; asech(0) = inf, NaN
    outside [0, 1]."""
    d = _Ops(builder, x.type)
    result = _acosh(d, d.div(d.c(1.0), x), d.div(d.sub(d.c(1.0), x), x))
    # log(2 / x) where acosh(1 / x) is log(1 / x) + log(2), without 1 / x overflowing.
    tiny = d.sub(d.c(math.log(2)), log(builder, x))
    return d.select(d.cmp("<", x, d.c(1 / _ARC_HYPERBOLIC_LARGE)), tiny, result)


@_nan_in_nan_out
@_in_double
def atanh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Inverse hyperbolic tangent, log1p(2a / (1 - a)) / 2 with a = |x| and x's sign (below
    1/2 as 2a + 2a^2 / (1 - a), fdlibm's form); ±inf at ±1, NaN beyond."""
    d = _Ops(builder, x.type)
    a = d.abs(x)
    twice = d.add(a, a)
    rest = d.sub(d.c(1.0), a)
    small = d.add(twice, d.div(d.mul(twice, a), rest))
    argument = d.select(d.cmp("<", a, d.c(0.5)), small, d.div(twice, rest))
    return d.copysign(d.mul(_log1p(d, argument), d.c(0.5)), x)


@_nan_in_nan_out
@_in_double
def acoth(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Inverse hyperbolic cotangent, atanh(1 / x) = log1p(2 / (|x| - 1)) / 2 with x's sign:
    |x| - 1 is exact near 1, where the value hangs on it. ±inf at ±1, NaN inside (-1, 1)."""
    d = _Ops(builder, x.type)
    a = d.abs(x)
    return d.copysign(d.mul(_log1p(d, d.div(d.c(2.0), d.sub(a, d.c(1.0)))), d.c(0.5)), x)


@_nan_in_nan_out
@_in_double
def asec(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Inverse secant, acos(1 / x) = 2 atan(sqrt((x - 1) / (x + 1))): x ∓ 1 is exact near ±1,
    where the value hangs on it. In [0, pi], NaN inside (-1, 1); asec(±inf) = pi/2."""
    d = _Ops(builder, x.type)
    bounded = d.clamp(x, -(2.0**60), 2.0**60)  # (x - 1) / (x + 1) rounds to 1 long before
    # As (1 - x) / (-1 - x), so that x = -1 divides by +0: the limit +inf from x < -1.
    ratio = d.div(d.sub(d.c(1.0), bounded), d.sub(d.c(-1.0), bounded))
    angle = _atan_positive(d, d.abs(builder.call(_sqrt(d), [ratio])))
    return d.select(d.cmp("<", ratio, d.c(0.0)), d.c(math.nan), d.add(angle, angle))


@_nan_in_nan_out
@_in_double
def acsc(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Inverse cosecant, asin(1 / x) = atan(1 / sqrt(|x| - 1) sqrt(|x| + 1)) with x's sign
    (no overflow, exact |x| - 1 near 1). In [-pi/2, pi/2], NaN inside (-1, 1)."""
    d = _Ops(builder, x.type)
    a = d.abs(x)
    roots = d.mul(builder.call(_sqrt(d), [d.sub(a, d.c(1.0))]), builder.call(_sqrt(d), [d.add(a, d.c(1.0))]))
    return d.copysign(_atan_positive(d, d.div(d.c(1.0), roots)), x)


FUNCTIONS: dict[str, Function] = {
    "exp": exp,
    "log": log,
    "tanh": tanh,
    "sigmoid": sigmoid,
    "silu": silu,
    "erf": erf,
    "gelu_erf": gelu_erf,
    "gelu_tanh": gelu_tanh,
    "sin": sin,
    "cos": cos,
    "tan": tan,
    "cot": cot,
    "atan": atan,
    "asin": asin,
    "acos": acos,
    "asec": asec,
    "acsc": acsc,
    "sinh": sinh,
    "cosh": cosh,
    "sech": sech,
    "csch": csch,
    "log1p": log1p,
    "asinh": asinh,
    "acosh": acosh,
    "asech": asech,
    "atanh": atanh,
    "acoth": acoth,
}


def emit(kind: str, builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """Emit math function `kind` (a key of FUNCTIONS, e.g. "exp") applied to `value`."""
    try:
        function = FUNCTIONS[kind]
    except KeyError:
        raise ValueError(f"unknown math function {kind!r}; known: {', '.join(FUNCTIONS)}") from None
    return function(builder, value)
