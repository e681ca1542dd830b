"""Accuracy, edge cases and determinism of the LLVM IR math library (ranvier.backends.cpu.mathlib).

Every function is compiled into a kernel `void k(T* in, T* out, i64 n)` (a vector loop plus a
scalar tail; n is never a multiple of the width), JIT-compiled with MCJIT at -O3 for the host
CPU and again with the host's AVX/AVX2/AVX-512/FMA features masked off, so both the fused and
the unfused instruction selections are measured. Errors are in ULPs of the result type against
float64 (numpy, math.erf/erfc) for float32 and against 40-digit mpmath for float64, over
log-uniform samples across the whole range of both signs plus function-specific ranges and
edge cases. `pytest -s` prints the table of worst errors.
"""

from __future__ import annotations

import ctypes
import functools
import math
import platform
from dataclasses import dataclass

import llvmlite.binding as llvm
import numpy as np
import pytest
from llvmlite import ir

from ranvier.backends.llvm import mathlib
from ranvier.backends.llvm.irutil import intrinsic, use_features
from ranvier.backends.llvm.values import Value
from ranvier.dtypes import DT_FLOAT32, DT_FLOAT64, DT_INT32

F32, F64 = np.float32, np.float64
FUNCTIONS = tuple(mathlib.FUNCTIONS)
WIDTHS = {F32: (1, 4, 8, 16), F64: (1, 8)}
# The functions Myelin adds (trigonometric and hyperbolic families); float32 computes them in double.
MYELIN = ("tan", "cot", "atan", "asin", "acos", "asec", "acsc", "sinh", "cosh", "sech", "csch", "log1p", "asinh",
          "acosh", "asech", "atanh", "acoth")
# Largest accepted error in ULPs. float32: exp/log 2, the rest 4, those computed in double 1;
# float64: exp/log 2, the rest 8.
LIMITS = {
    F32: {"exp": 2, "log": 2, "tanh": 4, "sigmoid": 4, "silu": 4, "erf": 4, "gelu_erf": 4, "gelu_tanh": 4,
          "sin": 4, "cos": 4, **dict.fromkeys(MYELIN, 1)},
    F64: {"exp": 2, "log": 2, "tanh": 8, "sigmoid": 8, "silu": 8, "erf": 8, "gelu_erf": 8, "gelu_tanh": 8,
          "sin": 8, "cos": 8, **dict.fromkeys(MYELIN, 8)},
}
# Float32 functions outside FUNCTIONS, for the products whose inputs are rounded to bfloat16:
# accurate to a bound of their own rather than in ULPs.
ROUGH = {"gelu_erf_fast": mathlib.gelu_erf_fast, "exp_nonpositive": mathlib.exp_nonpositive}
PERIODIC = ("sin", "cos", "tan", "cot")
TRIG_RANGE = 1e4  # sin/cos/tan/cot accuracy is promised up to here; beyond, only finiteness (and [-1, 1])
# Where the inverse functions are defined (NaN outside): samples concentrate there and at its edges.
DOMAINS = {"asin": (-1, 1), "acos": (-1, 1), "atanh": (-1, 1), "asech": (0, 1), "acosh": (1, 30), "log1p": (-1, 30)}
OUTSIDE_UNIT = ("asec", "acsc", "acoth")  # defined for |x| >= 1
POLES_AT_ZERO = ("cot", "csch")  # ±inf at ±0
# Features masked for the SSE variant: everything that needs AVX (a later "+avx512vl" would turn
# AVX back on) and every FMA.
MASKED_PREFIXES = ("avx", "amx", "fma", "f16c", "xop", "vaes", "vpclmulqdq", "evex512")


# -- compilation ---------------------------------------------------------------------------------

def _kernel(module: ir.Module, kind: str, scalar: ir.Type, width: int) -> str:
    """Define `void name(T* src, T* dst, i64 n)` applying `kind` to n elements: `width` at a
    time while a whole vector remains, then one at a time."""
    i64 = ir.IntType(64)
    name = f"{kind}_{_type_name(scalar)}_w{width}"
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [scalar.as_pointer()] * 2 + [i64]), name=name)
    src, dst, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    vector_end = b.sub(n, b.srem(n, ir.Constant(i64, width)))
    start = ir.Constant(i64, 0)
    loops = [(width, vector_end)] + ([(1, n)] if width > 1 else [])
    for lanes, stop in loops:
        before = b.block
        head, body, done = (fn.append_basic_block(f"{part}{lanes}") for part in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        index = b.phi(i64)
        index.add_incoming(start, before)
        b.cbranch(b.icmp_signed("<", index, stop), body, done)
        b.position_at_end(body)
        value_type = scalar if lanes == 1 else ir.VectorType(scalar, lanes)
        load_at = b.bitcast(b.gep(src, [index]), value_type.as_pointer())
        store_at = b.bitcast(b.gep(dst, [index]), value_type.as_pointer())
        loaded = Value(b, b.load(load_at, align=1), DT_FLOAT64 if isinstance(scalar, ir.DoubleType) else DT_FLOAT32)
        value = ROUGH[kind](loaded) if kind in ROUGH else mathlib.emit(kind, loaded)
        b.store(value.ir, store_at, align=1)
        index.add_incoming(b.add(index, ir.Constant(i64, lanes)), body)
        b.branch(head)
        b.position_at_end(done)
        start = index
    b.ret_void()
    return name


def _type_name(scalar: ir.Type) -> str:
    return "f64" if isinstance(scalar, ir.DoubleType) else "f32"


@dataclass
class Compiled:
    """One JIT-compiled module holding every kernel, and its assembly."""

    engine: llvm.ExecutionEngine
    asm: str
    names: dict[tuple[str, type, int], str]  # (kind, dtype, width) -> kernel

    def run(self, kind: str, dtype: type, x: np.ndarray, width: int = 8) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=dtype)
        out = np.full_like(x, 12345.0)
        address = self.engine.get_function_address(self.names[kind, dtype, width])
        signature = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
        signature(address)(x.ctypes.data, out.ctypes.data, x.size)
        return out


def _compile(variant: str) -> Compiled:
    """Every kernel in one module, optimized at -O3 and JIT-compiled for the host CPU, or for
    the host CPU without AVX and FMA ("sse")."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features()
    if variant == "sse":
        for name in features:
            if name.startswith(MASKED_PREFIXES):
                features[name] = False
    module = ir.Module(name="mathlib_test")
    module.triple = llvm.get_process_triple()
    use_features(module, [name for name, on in features.items() if on])  # FMA's exact products where present
    names = {}
    for dtype, scalar in ((F32, ir.FloatType()), (F64, ir.DoubleType())):
        for width in WIDTHS[dtype]:
            for kind in FUNCTIONS + (tuple(ROUGH) if dtype is F32 else ()):
                names[kind, dtype, width] = _kernel(module, kind, scalar, width)
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=features.flatten(), opt=3)
    if hasattr(llvm, "create_pass_builder"):  # the new pass manager (llvmlite >= 0.44)
        builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
        builder.getModulePassManager().run(parsed, builder)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    return Compiled(engine, machine.emit_assembly(parsed), names)


VARIANTS = ["native"] + (["sse"] if platform.machine().lower() in ("x86_64", "amd64") else [])


@pytest.fixture(scope="module", params=VARIANTS)
def compiled(request) -> Compiled:
    return _compile(request.param)


# -- samples ---------------------------------------------------------------------------------------

def _log_uniform(rng: np.random.Generator, dtype: type, count: int) -> np.ndarray:
    """Both signs, exponents uniform from the smallest subnormal to the largest finite value."""
    info = np.finfo(dtype)
    low = math.log2(float(info.smallest_subnormal))
    high = math.log2(float(info.max))
    x = np.exp2(rng.uniform(low, high, count)) * rng.choice([-1.0, 1.0], count)
    x = x.astype(dtype)
    return x[np.isfinite(x)]


def _near_multiples_of_half_pi(dtype: type, limit: float) -> np.ndarray:
    """dtype(k * pi/2) and its neighbours for |k * pi/2| <= limit: the hardest inputs to reduce."""
    k = np.arange(-int(limit / (np.pi / 2)), int(limit / (np.pi / 2)) + 1)
    x = (k * (np.pi / 2)).astype(dtype)
    return np.concatenate([x, np.nextafter(x, dtype(np.inf)), np.nextafter(x, dtype(-np.inf))])


def _samples(kind: str, dtype: type, rng: np.random.Generator, count: int) -> np.ndarray:
    info = np.finfo(dtype)
    tiny, subnormal, big = float(info.tiny), float(info.smallest_subnormal), float(info.max)
    common = [0.0, -0.0, subnormal, -subnormal, tiny, -tiny, tiny / 3, -tiny / 3, 1e-30, -1e-30, 1.0, -1.0, 0.5, -0.5,
              big, -big]
    parts = [_log_uniform(rng, dtype, count), np.array(common)]

    def uniform(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, count // 2)

    if kind == "exp":
        overflow = math.log(big)
        underflow = math.log(subnormal)
        edges = [overflow, underflow, underflow - 0.7, math.log(tiny), 88.0, -88.0, 709.0, -709.0, 745.2, -745.2]
        edges = np.array(edges, dtype=dtype)
        parts += [uniform(underflow - 2, overflow + 2), edges, np.nextafter(edges, dtype(np.inf)),
                  np.nextafter(edges, dtype(-np.inf)), uniform(-1, 1), uniform(-1e-6, 1e-6)]
    elif kind == "log":
        eps = float(info.eps)
        parts += [np.abs(parts[0]), uniform(0, 4), 1 + uniform(-1e-3, 1e-3), 1 + eps * np.arange(-40, 40),
                  np.abs(uniform(0, 1)) * tiny, np.array([2.0, 0.5, math.e, 10.0])]
    elif kind in PERIODIC:
        parts += [uniform(-TRIG_RANGE, TRIG_RANGE), uniform(-10, 10), _near_multiples_of_half_pi(dtype, TRIG_RANGE)]
    elif kind in DOMAINS or kind in OUTSIDE_UNIT:
        lo, hi = DOMAINS.get(kind, (1, 30))
        eps = float(info.eps)
        edges = np.array([lo, hi], dtype=np.float64)[:, None] + eps * np.arange(-40, 41) * np.maximum(1, abs(hi))
        parts += [uniform(lo, hi), uniform(lo, lo + 1e-3), uniform(hi - 1e-3, hi), edges.reshape(-1),
                  uniform(-1e-3, 1e-3)]
        if kind in OUTSIDE_UNIT:
            parts += [-part for part in parts[2:]]
    else:
        parts += [uniform(-20, 20), uniform(-3, 3), uniform(-1e-3, 1e-3), uniform(-120, 120),
                  uniform(-40, 0), uniform(-800, 800)]
    x = np.concatenate([np.asarray(p, dtype=np.float64).astype(dtype) for p in parts])
    return x[np.isfinite(x)]


# -- references --------------------------------------------------------------------------------

def _sigmoid64(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


_erf64 = np.vectorize(math.erf, otypes=[np.float64])
_erfc64 = np.vectorize(math.erfc, otypes=[np.float64])
_GELU_A = math.sqrt(2 / math.pi)


def _reference_f64(kind: str, x: np.ndarray) -> np.ndarray:
    """float64 values, accurate to a small fraction of a float32 ulp."""
    with np.errstate(all="ignore"):
        return {
            "exp": np.exp,
            "log": np.log,
            "tanh": np.tanh,
            "sigmoid": _sigmoid64,
            "silu": lambda v: v * _sigmoid64(v),
            "erf": _erf64,
            "gelu_erf": lambda v: 0.5 * v * _erfc64(-v / math.sqrt(2)),
            "gelu_tanh": lambda v: v * _sigmoid64(2 * _GELU_A * (v + 0.044715 * v**3)),
            "sin": np.sin,
            "cos": np.cos,
            "tan": np.tan,
            "cot": lambda v: 1 / np.tan(v),
            "atan": np.arctan,
            "asin": np.arcsin,
            "acos": np.arccos,
            "asec": lambda v: np.arccos(1 / v),
            "acsc": lambda v: np.arcsin(1 / v),
            "sinh": np.sinh,
            "cosh": np.cosh,
            "sech": lambda v: 1 / np.cosh(v),
            "csch": lambda v: 1 / np.sinh(v),
            "log1p": np.log1p,
            "asinh": np.arcsinh,
            "acosh": np.arccosh,
            "asech": lambda v: np.where(v == 0, np.inf, np.arccosh(1 / v)),  # the limit at ±0
            "atanh": np.arctanh,
            "acoth": lambda v: np.arctanh(1 / v),
        }[kind](x)


def _reference_mp(kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """40-digit values as unevaluated sums hi + lo of doubles."""
    mp = pytest.importorskip("mpmath").mp

    def erfc(z):  # mpmath overflows on huge arguments; the value is 0 or 2 to any precision there
        return mp.erfc(z) if abs(z) < 100 else mp.mpf(0 if z > 0 else 2)

    def erf(z):
        return mp.erf(z) if abs(z) < 100 else mp.sign(z)

    def gelu_tanh(v):
        return v / (1 + mp.exp(-2 * mp.sqrt(2 / mp.pi) * (v + mp.mpf("0.044715") * v**3)))

    def real(function, lo, hi, outside=False, poles=None):
        """The function on its real domain [lo, hi] (|x| >= hi with outside), NaN elsewhere,
        and the infinities at its poles."""

        def restricted(v):
            if poles and float(v) in poles:
                return poles[float(v)]
            inside = abs(v) >= hi if outside else lo <= v <= hi
            return function(v) if inside else mp.nan

        return restricted

    function = {
        "exp": mp.exp,
        "log": lambda v: mp.log(v) if v > 0 else (mp.ninf if v == 0 else mp.nan),
        "tanh": mp.tanh,
        "sigmoid": lambda v: 1 / (1 + mp.exp(-v)),
        "silu": lambda v: v / (1 + mp.exp(-v)),
        "erf": erf,
        "gelu_erf": lambda v: v / 2 * erfc(-v / mp.sqrt(2)),
        "gelu_tanh": gelu_tanh,
        "sin": mp.sin,
        "cos": mp.cos,
        "tan": mp.tan,
        "cot": mp.cot,
        "atan": mp.atan,
        "asin": real(mp.asin, -1, 1),
        "acos": real(mp.acos, -1, 1),
        "asec": real(lambda v: mp.acos(1 / v), -1, 1, outside=True),
        "acsc": real(lambda v: mp.asin(1 / v), -1, 1, outside=True),
        "sinh": mp.sinh,
        "cosh": mp.cosh,
        "sech": mp.sech,
        "csch": mp.csch,
        "log1p": real(mp.log1p, -1, mp.inf, poles={-1.0: mp.ninf}),
        "asinh": mp.asinh,
        "acosh": real(mp.acosh, 1, mp.inf),
        "asech": real(lambda v: mp.acosh(1 / v), 0, 1, poles={0.0: mp.inf}),
        "atanh": real(mp.atanh, -1, 1, poles={-1.0: mp.ninf, 1.0: mp.inf}),
        "acoth": real(lambda v: mp.atanh(1 / v), -1, 1, outside=True, poles={-1.0: mp.ninf, 1.0: mp.inf}),
    }[kind]
    hi = np.empty(x.size)
    lo = np.empty(x.size)
    with mp.workdps(40):
        for i, v in enumerate(x.tolist()):
            if v == 0 and kind in POLES_AT_ZERO:  # mpmath has no signed zero
                hi[i], lo[i] = math.copysign(math.inf, v), 0.0
                continue
            exact = function(mp.mpf(v))
            hi[i] = float(exact)
            lo[i] = float(exact - hi[i]) if math.isfinite(hi[i]) else 0.0
    return hi, lo


@functools.cache
def _case(kind: str, dtype: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The accuracy samples for `kind` and their exact values as hi + lo. sin and cos are
    measured only up to TRIG_RANGE."""
    rng = np.random.default_rng(sum(map(ord, kind)))
    x = _samples(kind, dtype, rng, 20000 if dtype is F32 else 2500)
    if kind in PERIODIC:
        x = x[np.abs(x) <= TRIG_RANGE]
    if dtype is F32:
        return x, _reference_f64(kind, x.astype(F64)), np.zeros(x.size)
    return (x, *_reference_mp(kind, x))


def ulp_errors(dtype: type, got: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """|got - (hi + lo)| in ULPs of `dtype` at the exact value hi + lo. Where the exact value
    rounds to ±inf or is NaN, the error is 0 if got is the same and inf otherwise."""
    info = np.finfo(dtype)
    with np.errstate(over="ignore"):
        rounded = hi.astype(dtype)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(hi), float(info.tiny)))) - info.nmant)
    got = got.astype(F64)
    with np.errstate(invalid="ignore"):
        error = np.abs((got - hi) - lo) / ulp
    special = np.isinf(rounded) | np.isnan(hi)
    same = (got == rounded) | (np.isnan(got) & np.isnan(hi))
    error[special] = np.where(same[special], 0.0, np.inf)
    error[np.isnan(error)] = np.inf
    return error


# -- tests -----------------------------------------------------------------------------------------

RESULTS: dict[tuple[str, str, str], tuple[float, float, int]] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_table():
    yield
    if RESULTS:
        lines = [f"{'function':<10} {'dtype':<8} {'variant':<7} {'max ulp':>8}  {'at x':>14}  samples"]
        for (kind, dtype, variant), (worst, where, count) in sorted(RESULTS.items()):
            lines.append(f"{kind:<10} {dtype:<8} {variant:<7} {worst:8.3f}  {where:14.7g}  {count}")
        print("\n" + "\n".join(lines))


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", FUNCTIONS)
def test_accuracy(compiled: Compiled, request, kind: str, dtype: type) -> None:
    x, hi, lo = _case(kind, dtype)
    got = compiled.run(kind, dtype, x)
    errors = ulp_errors(dtype, got, hi, lo)
    worst = int(np.argmax(errors))
    variant = request.node.callspec.params["compiled"]
    RESULTS[kind, np.dtype(dtype).name, variant] = (float(errors[worst]), float(x[worst]), x.size)
    assert errors[worst] <= LIMITS[dtype][kind], f"{kind}({x[worst]!r}) = {got[worst]!r}, {errors[worst]:.2f} ulp"


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["sin", "cos"])
def test_trig_of_huge_arguments_stays_in_range(compiled: Compiled, kind: str, dtype: type) -> None:
    """Past TRIG_RANGE accuracy may fade, but results stay finite and within [-1, 1]."""
    x = _log_uniform(np.random.default_rng(3), dtype, 5000)
    x = np.concatenate([x[np.abs(x) > TRIG_RANGE], np.array([np.finfo(dtype).max, -np.finfo(dtype).max], dtype)])
    assert np.all(np.abs(compiled.run(kind, dtype, x)) <= 1)


SPECIAL = {
    # function: [(input, expected)], checked bit for bit (the sign of zero included).
    "exp": [(np.inf, np.inf), (-np.inf, 0.0), (1e4, np.inf), (-1e4, 0.0), (0.0, 1.0), (-0.0, 1.0)],
    "log": [(0.0, -np.inf), (-0.0, -np.inf), (-1.0, np.nan), (-np.inf, np.nan), (np.inf, np.inf), (1.0, 0.0)],
    "tanh": [(np.inf, 1.0), (-np.inf, -1.0), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30), (-1e-30, -1e-30),
             (30.0, 1.0), (-30.0, -1.0)],
    "sigmoid": [(np.inf, 1.0), (-np.inf, 0.0), (0.0, 0.5), (1e3, 1.0), (-1e4, 0.0)],
    "silu": [(np.inf, np.inf), (-np.inf, -0.0), (0.0, 0.0), (-0.0, -0.0), (-1e4, -0.0), (1e4, 1e4)],
    "erf": [(np.inf, 1.0), (-np.inf, -1.0), (0.0, 0.0), (-0.0, -0.0), (30.0, 1.0), (-30.0, -1.0)],
    "gelu_erf": [(np.inf, np.inf), (-np.inf, -0.0), (0.0, 0.0), (-0.0, -0.0), (-1e4, -0.0), (1e4, 1e4)],
    "gelu_tanh": [(np.inf, np.inf), (-np.inf, -0.0), (0.0, 0.0), (-0.0, -0.0), (-1e4, -0.0), (1e4, 1e4)],
    "sin": [(np.inf, np.nan), (-np.inf, np.nan), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30)],
    "cos": [(np.inf, np.nan), (-np.inf, np.nan), (0.0, 1.0), (-0.0, 1.0)],
    "tan": [(np.inf, np.nan), (-np.inf, np.nan), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30)],
    "cot": [(np.inf, np.nan), (-np.inf, np.nan), (0.0, np.inf), (-0.0, -np.inf)],
    "atan": [(np.inf, np.pi / 2), (-np.inf, -np.pi / 2), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30), (1.0, np.pi / 4)],
    "asin": [(1.0, np.pi / 2), (-1.0, -np.pi / 2), (0.0, 0.0), (-0.0, -0.0), (1.5, np.nan), (-np.inf, np.nan)],
    "acos": [(1.0, 0.0), (-1.0, np.pi), (0.0, np.pi / 2), (1.5, np.nan), (np.inf, np.nan)],
    "asec": [(1.0, 0.0), (-1.0, np.pi), (np.inf, np.pi / 2), (-np.inf, np.pi / 2), (0.5, np.nan), (0.0, np.nan)],
    "acsc": [(1.0, np.pi / 2), (-1.0, -np.pi / 2), (np.inf, 0.0), (-np.inf, -0.0), (0.5, np.nan), (0.0, np.nan)],
    "sinh": [(np.inf, np.inf), (-np.inf, -np.inf), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30), (1e4, np.inf)],
    "cosh": [(np.inf, np.inf), (-np.inf, np.inf), (0.0, 1.0), (-0.0, 1.0), (1e4, np.inf), (-1e4, np.inf)],
    "sech": [(np.inf, 0.0), (-np.inf, 0.0), (0.0, 1.0), (-0.0, 1.0), (1e4, 0.0)],
    "csch": [(np.inf, 0.0), (-np.inf, -0.0), (0.0, np.inf), (-0.0, -np.inf), (1e4, 0.0)],
    "log1p": [(0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30), (-1.0, -np.inf), (-2.0, np.nan), (np.inf, np.inf)],
    "asinh": [(np.inf, np.inf), (-np.inf, -np.inf), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30)],
    "acosh": [(1.0, 0.0), (np.inf, np.inf), (0.5, np.nan), (-1.0, np.nan), (-np.inf, np.nan)],
    "asech": [(1.0, 0.0), (0.0, np.inf), (1.5, np.nan), (-0.5, np.nan), (np.inf, np.nan)],
    "atanh": [(1.0, np.inf), (-1.0, -np.inf), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30), (1.5, np.nan)],
    "acoth": [(1.0, np.inf), (-1.0, -np.inf), (np.inf, 0.0), (-np.inf, -0.0), (0.5, np.nan), (0.0, np.nan)],
}


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", FUNCTIONS)
def test_special_values(compiled: Compiled, kind: str, dtype: type) -> None:
    inputs, expected = (np.array(column, dtype=dtype) for column in zip(*SPECIAL[kind], (np.nan, np.nan), strict=True))
    got = compiled.run(kind, dtype, inputs)
    same = np.where(np.isnan(expected), np.isnan(got), (got == expected) & (np.signbit(got) == np.signbit(expected)))
    assert same.all(), f"{kind}{inputs[~same].tolist()} = {got[~same].tolist()}, expected {expected[~same].tolist()}"


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_same_bits_for_every_width(compiled: Compiled, dtype: type) -> None:
    """Each lane runs the same instructions, so the vector width cannot change a result."""
    rng = np.random.default_rng(7)
    specials = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0]
    x = np.concatenate([specials, _log_uniform(rng, dtype, 2000)[:1500], rng.uniform(-30, 30, 500)])
    x = x[: 16 * (x.size // 16) - 3].astype(dtype)  # not a multiple of any width: the tails run too
    for kind in FUNCTIONS:
        results = [compiled.run(kind, dtype, x, width).view(f"u{x.itemsize}") for width in WIDTHS[dtype]]
        for width, result in zip(WIDTHS[dtype][1:], results[1:], strict=True):
            assert np.array_equal(result, results[0]), f"{kind} differs between widths 1 and {width}"


def _same_special_values(compiled: Compiled, kind: str, width: int, special: list[tuple[float, float]]) -> None:
    inputs, expected = (np.array(column, F32) for column in zip(*special, strict=True))
    got = compiled.run(kind, F32, inputs, width)
    same = np.where(np.isnan(expected), np.isnan(got), (got == expected) & (np.signbit(got) == np.signbit(expected)))
    assert same.all(), f"{kind}{inputs[~same].tolist()} = {got[~same].tolist()}"


@pytest.mark.parametrize("width", WIDTHS[F32])
def test_fast_gelu_within_its_absolute_bound(compiled: Compiled, width: int) -> None:
    """gelu_erf_fast against float64 Gelu within 2.5e-7 · max(|x|, 1), at every width; its
    special values bit for bit."""
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.uniform(-8, 8, 20000), rng.standard_normal(20000) * 3, _log_uniform(rng, F32, 5000),
                        np.array([6.0, -6.0, np.nextafter(F32(-6), F32(-7)), 1e-30, -1e-30])]).astype(F32)
    got = compiled.run("gelu_erf_fast", F32, x, width).astype(F64)
    x64 = x.astype(F64)
    error = np.abs(got - 0.5 * x64 * _erfc64(-x64 / math.sqrt(2))) / np.maximum(np.abs(x64), 1)
    assert error.max() <= 2.5e-7, f"gelu_erf_fast({x[np.argmax(error)]!r}): error {error.max():.3g} of max(|x|, 1)"
    _same_special_values(compiled, "gelu_erf_fast", width, [
        (np.inf, np.inf), (-np.inf, -0.0), (0.0, 0.0), (-0.0, -0.0), (-1e4, -0.0), (1e4, 1e4), (np.nan, np.nan)])


@pytest.mark.parametrize("width", WIDTHS[F32])
def test_exp_of_nonpositive_values_within_its_bound(compiled: Compiled, request, width: int) -> None:
    """exp_nonpositive against float64 exp within 4e-7 of it (3e-6 without FMA), or 2^-126
    below it; exp(-inf) = 0, as a softmax over masked keys needs."""
    rng = np.random.default_rng(12)
    x = -np.concatenate([np.abs(rng.standard_normal(20000)) * 30, rng.uniform(0, 100, 20000), np.abs(_log_uniform(rng, F32, 5000)),
                         np.array([87.3, 87.4, 88.0, 1e-30])]).astype(F32)
    got = compiled.run("exp_nonpositive", F32, x, width).astype(F64)
    want = np.exp(x.astype(F64))
    bound = 3e-6 if request.node.callspec.params["compiled"] == "sse" else 4e-7
    excess = np.abs(got - want) - (bound * want + 2.0**-126)
    assert excess.max() <= 0, f"exp_nonpositive({x[np.argmax(excess)]!r}) = {got[np.argmax(excess)]!r}"
    _same_special_values(compiled, "exp_nonpositive", width, [
        (-np.inf, 0.0), (0.0, 1.0), (-0.0, 1.0), (-88.0, 0.0), (-1e30, 0.0), (np.nan, np.nan)])


def test_straight_line_code_without_calls(compiled: Compiled, request) -> None:
    """No libm (or any other) calls; the masked variant really uses only SSE registers."""
    assert "call" not in compiled.asm
    if request.node.callspec.params["compiled"] == "sse":
        assert not any(register in compiled.asm for register in ("%ymm", "%zmm", "vfmadd"))


def test_emit_rejects_unknown_kinds_and_types() -> None:
    module = ir.Module()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]), name="f")
    builder = ir.IRBuilder(fn.append_basic_block())
    with pytest.raises(ValueError, match="unknown math function"):
        mathlib.emit("cbrt", Value(builder, ir.Constant(ir.FloatType(), 1.0), DT_FLOAT32))
    with pytest.raises(TypeError):
        mathlib.emit("exp", Value(builder, fn.args[0], DT_INT32))


def test_intrinsic_is_declared_once() -> None:
    module = ir.Module()
    vector = ir.VectorType(ir.FloatType(), 16)
    fma = intrinsic(module, "llvm.fma", vector)
    assert fma.name == "llvm.fma.v16f32" and len(fma.args) == 3
    assert intrinsic(module, "llvm.fma", vector) is fma
    assert intrinsic(module, "llvm.fabs", ir.DoubleType()).name == "llvm.fabs.f64"
