"""Vectorized elementary functions emitted as straight-line LLVM IR.

Every public function takes a `Value` (values.py) of float32 or float64, a scalar or a
vector of any width, and returns one of the same type, written as the formula it computes
(`1.0 - 2.0 / (m * s + 1.0)`); `Value.exp()` and its kin call them. Each lane runs the
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
from typing import TYPE_CHECKING

from llvmlite import ir

from ... import dtypes
from .irutil import has_feature

if TYPE_CHECKING:  # the functions are written over Values, which call them: values.py imports this module
    from .values import Value

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
TANH_CUT = 0.625
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
# Exact Gelu to within 2.5e-7 * max(|x|, 1), for the epilogue of a product whose inputs are
# rounded to bfloat16 (a thousandth of that rounding's error): x * sigmoid(g) with g = logit(Phi(x))
# fitted as x * G(x^2) on |x| <= _GELU_FAST_CLAMP (least squares weighted by Phi * (1 - Phi), so
# Phi's error is what is fitted), G scaled by -log2(e): exp(-g) = 2^w, w = x * G(x^2), 2^w as
# 2^round(w) times _EXP2_HALF. Beyond the clamp Phi is 1 or 0 to within 1e-9.
_GELU_FAST_CLAMP = 6.0
_GELU_FAST_LOG2 = (-2.302210807800293, -0.10483022779226303, 8.93213800736703e-05, 0.00016139185754582286,
                   -1.1748766155506019e-05, 4.0474776596965967e-07, -5.67913271964926e-09)
# 2^f for |f| <= 1/2, rel. error 3e-7 (float32 Horner): the fast functions' power of two.
# log2(e) = _LOG2E[0] + _LOG2E[1], the first a float32.
_LOG2E = (1.4426950216293335, 1.92596298909109e-08)
_EXP2_HALF = (1.0, 0.6931470036506653, 0.2402222454547882, 0.055507123470306396, 0.009670180268585682,
              0.0013260914711281657)

class _Format:
    """The encoding of a float dtype: its width, explicit significand bits, exponent bias,
    and the integer dtype of its bits."""

    def __init__(self, dtype: str) -> None:
        self.bits = 64 if dtype == dtypes.DT_FLOAT64 else 32
        self.mant = 52 if self.bits == 64 else 23
        self.bias = 1023 if self.bits == 64 else 127
        self.int = dtypes.DT_INT64 if self.bits == 64 else dtypes.DT_INT32


def _format(x: Value) -> _Format:
    return _Format(x.dtype)


def _poly(x: Value, coeffs: Sequence[float]) -> Value:
    """Horner evaluation of sum(coeffs[i] * x^i)."""
    acc = x.constant(coeffs[-1])
    for coeff in reversed(coeffs[:-1]):
        acc = acc.mul_add(x, coeff)
    return acc


def _min_const(x: Value, limit: float) -> Value:
    """min(x, limit), passing NaN through."""
    return (x > limit).where(limit, x)


def _clamp(x: Value, lo: float, hi: float) -> Value:
    """x limited to [lo, hi], passing NaN through."""
    return _min_const((x < lo).where(lo, x), hi)


def _round_int(x: Value) -> tuple[Value, Value]:
    """x rounded to the nearest integer (ties to even) as a float and as an integer, for
    |x| < 2^(p-2). Adding 1.5 * 2^(p-1) leaves the integer in the low significand bits;
    larger inputs or NaN give a meaningless but defined result (never poison)."""
    f = _format(x)
    magic = 1.5 * 2.0**f.mant
    shifted = x + magic
    as_int = shifted.bitcast(f.int) - _float_bits(magic, f.bits)
    return shifted - magic, as_int


def _pow2(k: Value, dtype: str) -> Value:
    """2^k, a float of `dtype`, for an integer k in the normal exponent range."""
    f = _Format(dtype)
    return (k + f.bias).shift_left(f.mant).bitcast(dtype)


def _float_bits(value: float, bits: int) -> int:
    """The IEEE encoding of `value`, rounded to the `bits`-wide format, as a signed integer."""
    fmt, ifmt = ("<d", "<q") if bits == 64 else ("<f", "<i")
    return struct.unpack(ifmt, struct.pack(fmt, value))[0]


# -- double-word arithmetic (exact with or without FMA) ----------------------------------------

def _split(a: Value) -> tuple[Value, Value]:
    """Veltkamp's split: a = hi + lo, each with at most half the significand bits."""
    t = a * (2.0 ** ((_format(a).mant + 2) // 2) + 1)
    hi = t - (t - a)
    return hi, a - hi


def _two_prod(a: Value, b: Value) -> tuple[Value, Value]:
    """a * b = p + e exactly (barring overflow and underflow): e is one fused multiply-add
    where the module's target has FMA, else Dekker's product of split halves (seven
    multiplies and eight adds more: llvm.fma without FMA would call the C library per lane)."""
    p = a * b
    if has_feature(a.b.module, "fma"):
        return p, a.fma(b, -p)
    ah, al = _split(a)
    bh, bl = _split(b)
    e = ah * bh - p + ah * bl + al * bh + al * bl
    return p, e


def _two_sum(a: Value, b: Value) -> tuple[Value, Value]:
    """Knuth's sum: a + b = s + e exactly."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


# -- building blocks ---------------------------------------------------------------------------

def _exp_parts(hi: Value, lo: Value | None = None) -> tuple[Value, Value]:
    """exp(hi + lo) as a pair (m, s) with exp = m * s, where m is normal and s a power of two.

    k = round((hi + lo) / ln2) and r = hi + lo - k * ln2 (Cody-Waite: k * LN2_HI is exact, and so,
    by Sterbenz's lemma, is hi - k * LN2_HI whenever lo is small), so |r| <= ln2/2 and
    exp = 2^k * (1 + r + r^2 P(r)). 2^k is applied as 2^k1 * 2^k2 with k1 = k >> 1: m = p * 2^k1
    is exact and normal, so the one rounding of a subnormal result happens in the final multiply
    by s = 2^k2. A caller may scale m first (x * exp(z) = (m * x) * s) to keep that single
    rounding. `lo` carries the low part of an argument known to more than working precision.
    """
    bits = _format(hi).bits
    lo_limit, hi_limit = _EXP_CLAMP[bits]
    hi = _clamp(hi, lo_limit, hi_limit)
    whole = hi if lo is None else hi + lo
    k, ki = _round_int(whole * (1 / math.log(2)))
    r = hi - k * _LN2_HI[bits]
    if lo is not None:
        r = r + lo
    r = r - k * _LN2_LO[bits]
    p = 1.0 + (r * r).mul_add(_poly(r, _EXP[bits]), r)
    k1 = ki.shift_right(1)
    k2 = ki - k1
    return p * _pow2(k1, hi.dtype), _pow2(k2, hi.dtype)


def _logistic_parts(z: Value, z_lo: Value | None = None) -> tuple[Value, Value, Value]:
    """Pieces of sigmoid(z + z_lo): e = exp(-|z + z_lo|) as (m, s), and the denominator 1 + e.

    sigmoid(z) = 1 / (1 + e) for z >= 0 and e / (1 + e) for z < 0; neither form cancels or
    overflows, and the second keeps full relative accuracy deep into the subnormal range.
    """
    negative_lo = None
    if z_lo is not None:
        negative_lo = (z < 0.0).where(z_lo, -z_lo)
    m, s = _exp_parts(-z.abs(), negative_lo)
    return m, s, 1.0 + m * s


def _scaled_logistic(x: Value, z: Value, z_lo: Value | None = None) -> Value:
    """x * sigmoid(z) for z with the sign of x, rounded once even when the result is subnormal.

    For x = -inf the limit -0 is returned (x * sigmoid(x) -> 0), not NaN.
    """
    m, s, denominator = _logistic_parts(z, z_lo)
    positive = z >= 0.0
    # one division serves both signs: x / (1 + e) above zero, m * (x / (1 + e)) * s below
    quotient = positive.where(x, _clamp(x, _EXP_CLAMP[_format(x).bits][0], 0.0)) / denominator
    return positive.where(quotient, m * quotient * s)


def _erfc_tail(v: Value, gelu: bool) -> tuple[Value, Value, Value]:
    """erfc(u) with u = v, or for Gelu 0.5 * v * erfc(u) with u = v / sqrt2, as a triple (m, s, q)
    with value (m * q) * s; valid for u >= 0.5. v is first clamped to where the value underflows.

    exp(-u^2) is computed from u^2 = hi + lo exactly: vh keeps the upper half of v's
    significand so vh^2 is exact, and lo = (v - vh)(v + vh) is small. Rounding u^2 instead
    would cost a relative error of about u^2 ulps, hundreds in the far tail. For Gelu,
    0.5 * v * exp(-u^2) * S / u = exp(-u^2 - ln(2)/2) * S: the constant joins the low part of
    the exponent and no division is needed.
    """
    f = _format(v)
    v = _min_const(v, _ERFC_MAX[f.bits] * (math.sqrt(2) if gelu else 1.0))
    u = v * math.sqrt(0.5) if gelu else v
    kept = (f.mant + 1) // 2
    vh = (v.bitcast(f.int) & -(1 << (f.mant + 1 - kept))).bitcast(v.dtype)
    scale = -0.5 if gelu else -1.0
    square_hi = vh * vh * scale
    square_lo = (v - vh) * (v + vh) * scale
    if gelu:
        square_lo = square_lo - math.log(2) / 2
    m, s = _exp_parts(square_hi, square_lo)
    c = _ERFC_C[f.bits]
    tail = _poly((u - c) / (u + c), _ERFC_TAIL[f.bits])
    return m, s, tail if gelu else tail / u


def _erf_small(a: Value) -> Value:
    """erf(a) for |a| < 0.5."""
    return a.mul_add(_poly(a * a, _ERF[_format(a).bits]), a)


def _trig_parts(x: Value) -> tuple[Value, Value, Value]:
    """sin(r), cos(r) and the quadrant k (an integer) with |x| = r + k * pi/2, |r| <= pi/4.

    The Cody-Waite reduction with a three-part pi/2 runs in double for both precisions: in
    float it could not resolve the float inputs closest to multiples of pi/2 (2^-27.8 away
    below 1e4). It is exact up to the final rounding for |x| < 25735; beyond, accuracy fades
    gradually, and past 2^51 the quotient is meaningless, but r is clamped to [-pi/4, pi/4]
    (slightly widened) so sine and cosine stay in [-1, 1].
    """
    f = _format(x)
    a = x.abs()
    wide = a.cast(dtypes.DT_FLOAT64)
    k, ki = _round_int(wide * (2 / math.pi))
    r = wide
    for part in _PIO2:
        r = r - k * part
    if f.bits == 32:
        r = r.cast(x.dtype)
        ki = ki.cast(f.int)
    r = _clamp(r, -_TRIG_CLAMP, _TRIG_CLAMP)
    z = r * r
    sin_r = (r * z).mul_add(_poly(z, _SIN[f.bits]), r)
    cos_r = (z * z).mul_add(_poly(z, _COS[f.bits]), z.mul_add(-0.5, 1.0))
    return sin_r, cos_r, ki


def _odd(ki: Value) -> Value:
    return (ki & 1).not_equal(0)


def _sign_of(x: Value) -> Value:
    """The sign bit of x, as an integer mask."""
    f = _format(x)
    return x.bitcast(f.int) & -(1 << (f.bits - 1))


def _sin_cos(x: Value, cosine: bool) -> Value:
    """sin(x) or cos(x) from `_trig_parts`: quadrant k mod 4 picks sin or cos of r and the
    sign; sin is odd, so it takes x's sign back."""
    sin_r, cos_r, ki = _trig_parts(x)
    f = _format(x)
    if cosine:
        ki = ki + 1
    result = _odd(ki).where(cos_r, sin_r)
    sign = (ki & 2).shift_left(f.bits - 2)
    if not cosine:
        sign = sign ^ _sign_of(x)
    return (result.bitcast(f.int) ^ sign).bitcast(x.dtype)


def _tan_cot(x: Value, cotangent: bool) -> Value:
    """tan(x) or cot(x) of |x| = r + k * pi/2: tan is sin(r) / cos(r) for even k and
    -cos(r) / sin(r) for odd k (cot the reciprocals); both are odd, so x's sign comes back."""
    sin_r, cos_r, ki = _trig_parts(x)
    odd = _odd(ki)
    swap = ~odd if cotangent else odd
    quotient = swap.where(cos_r, sin_r) / swap.where(sin_r, cos_r)
    result = odd.where(-quotient, quotient)
    return (result.bitcast(_format(x).int) ^ _sign_of(x)).bitcast(x.dtype)


def _atan_positive(a: Value) -> Value:
    """atan(a) for a >= 0, fdlibm's scheme: a is reduced to t = (a - c) / (1 + c * a) for
    the c nearest it (t = -1 / a above 39/16), |t| <= 7/16, and atan(a) = atan(c) + atan(t)
    with atan(c) known to twice the precision. Each a - c is exact (Sterbenz)."""
    numerator, denominator, hi, lo = a, a.constant(1.0), a.constant(0.0), a.constant(0.0)
    for bound, (c, base_hi, base_lo) in zip(_ATAN_BOUNDS, _ATAN_BASES):
        above = a >= bound
        if math.isinf(c):
            n, m = a.constant(-1.0), a
        else:
            n, m = a - c, a.mul_add(c, 1.0)
        numerator = above.where(n, numerator)
        denominator = above.where(m, denominator)
        hi = above.where(base_hi, hi)
        lo = above.where(base_lo, lo)
    t = numerator / denominator
    z = t * t
    tail = t * z * _poly(z, _ATAN) - lo
    return hi - (tail - t)


def _log1p(y: Value) -> Value:
    """log(1 + y) as log(u) + (y - (u - 1)) / u with u = 1 + y rounded: the quotient puts
    back, to first order, what rounding u lost. Where u rounds to 1 the result is y itself
    (its sign of zero too)."""
    u = 1.0 + y
    correction = (y - (u - 1.0)) / u
    finite = (u > 0.0) & (u < 2.0**53)
    result = log(u) + finite.where(correction, 0.0)
    return u.equal(1.0).where(y, result)


def _acosh(y: Value, t: Value) -> Value:
    """acosh(y), given t = y - 1 to full relative accuracy (near y = 1 everything hangs on it):
    log1p(t + sqrt(2t + t^2)) up to y = 2, log(2y - 1 / (y + sqrt(y^2 - 1))) above, and
    log(y) + log(2) where y^2 - 1 rounds to y^2. NaN below 1."""
    small = _log1p(t + t.mul_add(t, t + t).sqrt())
    root = y.mul_add(y, -1.0).sqrt()
    middle = log(y + y - 1.0 / (y + root))
    large = log(y) + math.log(2)
    result = (y > _ARC_HYPERBOLIC_LARGE).where(large, (y > 2.0).where(middle, small))
    return (y < 1.0).where(math.nan, result)


def _exp_half(a: Value) -> Value:
    """exp(a) / 2 for a >= 0, finite up to where sinh and cosh overflow."""
    m, s = _exp_parts(a)
    half = m * 0.5 * s
    return (a > _HYPERBOLIC_OVERFLOW).where(math.inf, half)


def _reciprocal_exp(a: Value, sign: float) -> Value:
    """2e / (1 + sign * e^2) with e = exp(-a), a >= 0: sech (sign 1) and, for a not small,
    |csch| (sign -1). e = m * s is applied last, so a subnormal result is rounded once."""
    m, s = _exp_parts(-a)
    e = m * s
    return (m + m) / (e * e).mul_add(sign, 1.0) * s


# -- public functions --------------------------------------------------------------------------

Function = Callable[["Value"], "Value"]


def _nan_in_nan_out(function: Function) -> Function:
    """Return a NaN input itself (quieted, sign and payload kept) whatever path it took through
    the computation: the bits of a NaN produced from NaN operands depend on operand order,
    which instruction selection may commute differently at different vector widths."""

    @functools.wraps(function)
    def wrapped(x: Value) -> Value:
        result = function(x)
        return x.not_equal(x).where(x + x, result)

    return wrapped


@_nan_in_nan_out
def exp(x: Value) -> Value:
    """e^x; overflows to inf above log(max), underflows through the subnormals to 0."""
    m, s = _exp_parts(x)
    return m * s


@_nan_in_nan_out
def log(x: Value) -> Value:
    """Natural logarithm, fdlibm's scheme: x = 2^k * m with m in [sqrt(1/2), sqrt(2)), found
    from the encoding (subnormals are first scaled by 2^(p+1)); with f = m - 1 and
    s = f / (2 + f), log(m) = f - f^2/2 + s * (f^2/2 + z * Q(z)), z = s^2, and
    log(x) = k * ln2 + log(m) with ln2 split so that k * LN2_HI is exact.
    log(0) = -inf, log(x < 0) = NaN, log(inf) = inf."""
    o = _format(x)
    tiny = x < 2.0 ** (1 - o.bias)
    normal = tiny.where(x * 2.0 ** (o.mant + 1), x)
    sqrt_half = _float_bits(math.sqrt(0.5), o.bits)
    bits = normal.bitcast(o.int) + (_float_bits(1.0, o.bits) - sqrt_half)
    k = bits.shift_right(o.mant) - o.bias
    k = k - tiny.where(o.mant + 1, k.constant(0))
    m = ((bits & ((1 << o.mant) - 1)) + sqrt_half).bitcast(x.dtype)
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    half_f2 = f * f * 0.5
    kf = k.cast(x.dtype)
    result = s.mul_add(half_f2 + z * _poly(z, _LOG[o.bits]), kf * _LN2_LO[o.bits])
    result = result - half_f2 + f + kf * _LN2_HI[o.bits]
    result = (x < 0.0).where(math.nan, result)
    result = x.equal(0.0).where(-math.inf, result)
    return x.equal(math.inf).where(math.inf, result)


@_nan_in_nan_out
def tanh(x: Value) -> Value:
    """Hyperbolic tangent: an odd polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above (where
    the subtraction loses less than a bit), with x's sign; tiny x gives x, large |x| gives ±1."""
    a = x.abs()
    small = tanh_near_zero(a)
    m, s = _exp_parts(a + a)
    large = 1.0 - 2.0 / (m * s + 1.0)
    return (a < TANH_CUT).where(small, large).copysign(x)


def tanh_near_zero(a: Value) -> Value:
    """tanh(a) for |a| < TANH_CUT, as an odd polynomial (where 1 - 2 / (e^2a + 1) would cancel)."""
    z = a * a
    return (a * z).mul_add(_poly(z, _TANH[_format(a).bits]), a)


@_nan_in_nan_out
def sigmoid(x: Value) -> Value:
    """1 / (1 + e^-x), from e = exp(-|x|) as 1 / (1 + e) or e / (1 + e), so it is accurate in
    both tails: 1 for large x, subnormal down to 0 for very negative x."""
    m, s, denominator = _logistic_parts(x)
    numerator = (x >= 0.0).where(1.0, m * s)
    return numerator / denominator


@_nan_in_nan_out
def silu(x: Value) -> Value:
    """x * sigmoid(x) (swish); silu(-inf) = -0, the limit."""
    return _scaled_logistic(x, x)


@_nan_in_nan_out
def erf(x: Value) -> Value:
    """Error function, with x's sign: in float32 x + x * P(x^2) below 1, 1 - exp(-x^2) * E(t)
    above (`_ERF32_CUT`); in float64 x + x * P(x^2) below 0.5, 1 - erfc(|x|) above with erfc
    from the tail approximation."""
    a = x.abs()
    if _format(x).bits == 32:
        small = a.mul_add(_poly(a * a, _ERF32_SMALL), a)
        v = _min_const(a, _ERF32_ONE)
        t = v.mul_add(1 / _ERFCX32_HALF, -_ERFCX32_MID / _ERFCX32_HALF)
        # exp(-x²), unclamped: past _ERF32_ONE it only shrinks, and erf stays 1. The same
        # exp of the same -(x·x) elsewhere in a program (Gelu's gradient: its density) is
        # then the same instructions, which LLVM computes once.
        m, s = _exp_parts(-(x * x))
        large = 1.0 - m * _poly(t, _ERFCX32) * s
        return (a < _ERF32_CUT).where(small, large).copysign(x)
    m, s, q = _erfc_tail(a, gelu=False)
    large = 1.0 - m * q * s
    return (a < _ERF_CUT).where(_erf_small(a), large).copysign(x)


@_nan_in_nan_out
def gelu_erf(x: Value) -> Value:
    """Exact Gelu, 0.5 * x * (1 + erf(x / sqrt2)). Where |x| / sqrt2 >= 0.5 it is
    x - 0.5 * x * erfc(u) for x > 0 and 0.5 * x * erfc(u) for x < 0 (u = |x| / sqrt2), so the
    negative tail keeps its relative accuracy down to the subnormals; gelu_erf(-inf) = -0."""
    a = x.abs()
    u = a * math.sqrt(0.5)
    small = x * x.constant(0.5).copysign(x).mul_add(_erf_small(u), 0.5)
    m, s, q = _erfc_tail(a, gelu=True)
    tail = m * q * s
    large = (x >= 0.0).where(x - tail, -tail)
    return (u < _ERF_CUT).where(small, large)


@_nan_in_nan_out
def exp_nonpositive(x: Value) -> Value:
    """e^x for x <= 0 (softmax's logits less their maximum) to within 4e-7 of it (3e-6 without FMA), in about
    two thirds of `exp`'s instructions: 2^n times 2^f by a polynomial, n = round(x * log2(e))
    and f = x * log2(e) - n with log2(e) as a sum of two floats (so f errs by 2^-25, not by
    x's rounding), x first clamped to -88, where n = -127 and 2^n, made of its exponent bits,
    is 0 (exp(-inf) = 0). Values below e^-87.3 (2^-126) are 0 or subnormal; float64 takes `exp`."""
    if _format(x).bits == 64:
        return exp(x)
    c = (x < -88.0).where(-88.0, x)
    whole, n = _round_int(c * _LOG2E[0])
    f = c.mul_add(_LOG2E[1], c.mul_add(_LOG2E[0], -whole))
    return _poly(f, _EXP2_HALF) * _pow2(n, x.dtype)


@_nan_in_nan_out
def gelu_erf_fast(x: Value) -> Value:
    """Exact Gelu to within 2.5e-7 * max(|x|, 1) (`_GELU_FAST_CLAMP`), in about a third of
    `gelu_erf`'s instructions and no erfc tail: for float32 products whose inputs are rounded to
    bfloat16; float64 takes `gelu_erf`. gelu_erf_fast(-inf) = -0, (inf) = inf."""
    if _format(x).bits == 64:
        return gelu_erf(x)
    c = _clamp(x, -_GELU_FAST_CLAMP, _GELU_FAST_CLAMP)
    w = c * _poly(c * c, _GELU_FAST_LOG2)
    whole, k = _round_int(w)
    e = _poly(w - whole, _EXP2_HALF) * _pow2(k, x.dtype)
    return (x < -_GELU_FAST_CLAMP).where(-0.0, x / (1.0 + e))


@_nan_in_nan_out
def gelu_tanh(x: Value) -> Value:
    """Tanh-approximated Gelu, 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), computed
    as x * sigmoid(2y). 2y is formed in double-word arithmetic (Dekker products, hi + lo
    constants): the relative error of exp(2y) is |2y| times that of 2y, which would reach
    hundreds of ulps in the negative tail. gelu_tanh(-inf) = -0."""
    bits = _format(x).bits
    xc = _clamp(x, -_GELU_CLAMP, _GELU_CLAMP)
    g1_hi, g1_lo = (x.constant(v) for v in _GELU_G1[bits])
    g2_hi, g2_lo = (x.constant(v) for v in _GELU_G2[bits])
    sq_hi, sq_lo = _two_prod(xc, xc)
    p_hi, p_lo = _two_prod(g2_hi, sq_hi)
    p_lo = p_lo + (g2_hi * sq_lo + g2_lo * sq_hi)
    t_hi, t_lo = _two_sum(g1_hi, p_hi)
    t_lo = t_lo + (p_lo + g1_lo)
    z_hi, z_lo = _two_prod(xc, t_hi)
    z_lo = z_lo + xc * t_lo
    return _scaled_logistic(x, z_hi, z_lo)


@_nan_in_nan_out
def sin(x: Value) -> Value:
    """Sine; see `_sin_cos` for the range reduction. sin(±inf) = NaN."""
    return _sin_cos(x, cosine=False)


@_nan_in_nan_out
def cos(x: Value) -> Value:
    """Cosine; see `_sin_cos` for the range reduction. cos(±inf) = NaN."""
    return _sin_cos(x, cosine=True)


def _in_double(function: Function) -> Function:
    """Compute a float32 input in double and round once. The double algorithms err by a few
    double ulps, far below half a float32 ulp, so float32 results are within about half an
    ulp; these functions (rarer in models than exp or tanh) get one implementation."""

    @functools.wraps(function)
    def wrapped(x: Value) -> Value:
        if x.dtype == dtypes.DT_FLOAT64:
            return function(x)
        return function(x.cast(dtypes.DT_FLOAT64)).cast(x.dtype)

    return wrapped


@_nan_in_nan_out
@_in_double
def tan(x: Value) -> Value:
    """Tangent; the reduction is sin's and cos's. tan(±inf) = NaN."""
    return _tan_cot(x, cotangent=False)


@_nan_in_nan_out
@_in_double
def cot(x: Value) -> Value:
    """Cotangent, 1 / tan(x); cot(±0) = ±inf."""
    return _tan_cot(x, cotangent=True)


@_nan_in_nan_out
@_in_double
def atan(x: Value) -> Value:
    """Arctangent, in (-pi/2, pi/2); atan(±inf) = ±pi/2."""
    return _atan_positive(x.abs()).copysign(x)


@_nan_in_nan_out
@_in_double
def asin(x: Value) -> Value:
    """Arcsine, atan(x / sqrt((1 - x)(1 + x))): 1 - |x| is exact where it matters (|x| >= 1/2),
    so the argument keeps its relative accuracy up to ±1. NaN beyond."""
    a = x.abs()
    root = ((1.0 - a) * (1.0 + a)).sqrt()
    return _atan_positive(a / root).copysign(x)


@_nan_in_nan_out
@_in_double
def acos(x: Value) -> Value:
    """Arccosine, 2 atan(sqrt((1 - x) / (1 + x))), accurate at both ends (1 - x and 1 + x are
    exact there); in [0, pi], NaN beyond ±1."""
    ratio = (1.0 - x) / (1.0 + x)
    angle = _atan_positive(ratio.sqrt())
    return (ratio < 0.0).where(math.nan, angle + angle)


@_nan_in_nan_out
@_in_double
def sinh(x: Value) -> Value:
    """Hyperbolic sine: its Taylor series below 1 (where e^x - e^-x would cancel), else
    (e^|x| - e^-|x|) / 2 with x's sign; ±inf beyond log(2 * DBL_MAX)."""
    a = x.abs()
    z = a * a
    small = (a * z).mul_add(_poly(z, _SINH), a)
    half = _exp_half(a)
    large = half - 0.25 / half
    return (a < _SINH_CUT).where(small, large).copysign(x)


@_nan_in_nan_out
@_in_double
def cosh(x: Value) -> Value:
    """Hyperbolic cosine, (e^|x| + e^-|x|) / 2 (no cancellation); inf beyond log(2 * DBL_MAX)."""
    half = _exp_half(x.abs())
    return half + 0.25 / half


@_nan_in_nan_out
@_in_double
def sech(x: Value) -> Value:
    """Hyperbolic secant, 2e / (1 + e^2) with e = exp(-|x|): no overflow on the way, and the
    tail stays accurate through the subnormals."""
    return _reciprocal_exp(x.abs(), 1.0)


@_nan_in_nan_out
@_in_double
def csch(x: Value) -> Value:
    """Hyperbolic cosecant: 1 / sinh(x) below 1, 2e / (1 - e^2) with e = exp(-|x|) above
    (accurate through the subnormals), with x's sign; csch(±0) = ±inf."""
    a = x.abs()
    small = 1.0 / sinh(a)
    return (a < _SINH_CUT).where(small, _reciprocal_exp(a, -1.0)).copysign(x)


@_nan_in_nan_out
@_in_double
def log1p(x: Value) -> Value:
    """log(1 + x), accurate for small x; -inf at -1, NaN below."""
    return _log1p(x)


@_nan_in_nan_out
@_in_double
def asinh(x: Value) -> Value:
    """Inverse hyperbolic sine (fdlibm's forms): log1p(a + a^2 / (1 + sqrt(1 + a^2))) up to
    a = |x| = 2, log(2a + 1 / (a + sqrt(a^2 + 1))) above, log(a) + log(2) for huge a; x's sign."""
    a = x.abs()
    square = a * a
    root = (square + 1.0).sqrt()
    small = _log1p(a + square / (1.0 + root))
    middle = log(a + a + 1.0 / (a + root))
    large = log(a) + math.log(2)
    result = (a > _ARC_HYPERBOLIC_LARGE).where(large, (a > 2.0).where(middle, small))
    return result.copysign(x)


@_nan_in_nan_out
@_in_double
def acosh(x: Value) -> Value:
    """Inverse hyperbolic cosine, for x >= 1 (NaN below)."""
    return _acosh(x, x - 1.0)


@_nan_in_nan_out
@_in_double
def asech(x: Value) -> Value:
    """Inverse hyperbolic secant, acosh(1 / x) for 0 < x <= 1 with 1 / x - 1 formed as
    (1 - x) / x, exact but for one rounding, and log(2 / x) for tiny x; asech(0) = inf, NaN
    outside [0, 1]."""
    result = _acosh(1.0 / x, (1.0 - x) / x)
    # log(2 / x) where acosh(1 / x) is log(1 / x) + log(2), without 1 / x overflowing.
    tiny = math.log(2) - log(x)
    return (x < 1 / _ARC_HYPERBOLIC_LARGE).where(tiny, result)


@_nan_in_nan_out
@_in_double
def atanh(x: Value) -> Value:
    """Inverse hyperbolic tangent, log1p(2a / (1 - a)) / 2 with a = |x| and x's sign (below
    1/2 as 2a + 2a^2 / (1 - a), fdlibm's form); ±inf at ±1, NaN beyond."""
    a = x.abs()
    twice = a + a
    rest = 1.0 - a
    small = twice + twice * a / rest
    argument = (a < 0.5).where(small, twice / rest)
    return (_log1p(argument) * 0.5).copysign(x)


@_nan_in_nan_out
@_in_double
def acoth(x: Value) -> Value:
    """Inverse hyperbolic cotangent, atanh(1 / x) = log1p(2 / (|x| - 1)) / 2 with x's sign:
    |x| - 1 is exact near 1, where the value hangs on it. ±inf at ±1, NaN inside (-1, 1)."""
    a = x.abs()
    return (_log1p(2.0 / (a - 1.0)) * 0.5).copysign(x)


@_nan_in_nan_out
@_in_double
def asec(x: Value) -> Value:
    """Inverse secant, acos(1 / x) = 2 atan(sqrt((x - 1) / (x + 1))): x ∓ 1 is exact near ±1,
    where the value hangs on it. In [0, pi], NaN inside (-1, 1); asec(±inf) = pi/2."""
    bounded = _clamp(x, -(2.0**60), 2.0**60)  # (x - 1) / (x + 1) rounds to 1 long before
    # As (1 - x) / (-1 - x), so that x = -1 divides by +0: the limit +inf from x < -1.
    ratio = (1.0 - bounded) / (-1.0 - bounded)
    angle = _atan_positive(ratio.sqrt().abs())
    return (ratio < 0.0).where(math.nan, angle + angle)


@_nan_in_nan_out
@_in_double
def acsc(x: Value) -> Value:
    """Inverse cosecant, asin(1 / x) = atan(1 / sqrt(|x| - 1) sqrt(|x| + 1)) with x's sign
    (no overflow, exact |x| - 1 near 1). In [-pi/2, pi/2], NaN inside (-1, 1)."""
    a = x.abs()
    roots = (a - 1.0).sqrt() * (a + 1.0).sqrt()
    return _atan_positive(1.0 / roots).copysign(x)


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


def emit(kind: str, x: Value) -> Value:
    """Math function `kind` (a key of FUNCTIONS, e.g. "exp") applied to `x`, computed in the
    float type of its IR (half precision computes in float32)."""
    try:
        function = FUNCTIONS[kind]
    except KeyError:
        raise ValueError(f"unknown math function {kind!r}; known: {', '.join(FUNCTIONS)}") from None
    scalar = x.ir.type.element if isinstance(x.ir.type, ir.VectorType) else x.ir.type
    if not isinstance(scalar, (ir.FloatType, ir.DoubleType)):
        raise TypeError(f"mathlib works on float, double or vectors of them, not {x.ir.type}")
    return function(x._new(x.ir, dtypes.DT_FLOAT64 if isinstance(scalar, ir.DoubleType) else dtypes.DT_FLOAT32))
