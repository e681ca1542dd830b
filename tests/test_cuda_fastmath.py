"""The GPU maps' exponentials and divisions by the special-function unit where the results are
stored as bfloat16 or float16 (ranvier/backends/cuda/fastmath.py): each op, and the SwiGLU
forward and gradient programs a Llama's step fuses, against float64 rounded to the stored type
over random inputs and the edges (±0, ±inf, NaN, ±88..±100, tiny and subnormal values), on
the host emulator (its models of the SFU's instructions: the precise functions, and perturbed
by the ISA's error bound) and on the GPU where there is one; float32 maps keep the precise
formulas' code, byte for byte."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import np_dtype, random_array, run_gpu_kernels_on_host

import ranvier as rv
from ranvier.backends.cuda import fastmath, kernels, ptx
from ranvier.ops.elementwise import sigmoid
from ranvier.ops.expression import parse

needs_ptxas = pytest.mark.skipif(ptx.ptxas_path() is None, reason="ptxas (CUDA toolkit or nvidia-cuda-nvcc) is not installed")

EDGES = [0.0, -0.0, np.inf, -np.inf, np.nan, 88.0, -88.0, 88.75, -88.75, 89.0, -89.0, 90.0, -90.0, 95.0, -95.0,
         100.0, -100.0, 104.0, -104.0, 1e-30, -1e-30, 1e-39, -1e-39, 3e38, -3e38, 0.625, -0.625, 1e-3, -1e-3]


def _silu(x: np.ndarray) -> np.ndarray:
    """x · sigmoid(x), -0 at -inf (the limit, as the precise formula gives it)."""
    return np.where(np.isneginf(x), -0.0, x * sigmoid(x))


# op → its float64 oracle (numpy)
UNARY = {"Exp": np.exp, "Sigmoid": sigmoid, "Silu": _silu, "Tanh": np.tanh, "Reciprocal": lambda x: 1.0 / x}

SWIGLU = "$0=Silu(%0);@0=Mul($0,%1)"
# of x, a broadcast 1, the output's gradient g and the up projection u: the gradients of u and of x
SWIGLU_GRADIENT = "$0=Sigmoid(%0);$1=Sub(%1,$0);$2=Mul(%0,$1);$3=Add(%1,$2);$4=Mul($0,$3);$5=Mul(%2,%3);" \
    "$6=Silu(%0);@0=Mul(%2,$6);@1=Mul($5,$4)"


def _inputs(size: int, dtype: str, seed: int) -> np.ndarray:
    """Random values of about ±20 (where the exponentials vary), then the edges."""
    values = random_array([size], "float32", seed=seed, low=-20.0, high=20.0)
    values[: len(EDGES)] = EDGES
    with np.errstate(over="ignore"):  # float16's inf for the largest edges
        return values.astype(np_dtype(dtype))


def _ordered(values: np.ndarray) -> np.ndarray:
    """A 16-bit float's bits as integers in the order of the values (±0 both 0), so that
    neighbours (the largest finite value and inf too) are one apart."""
    bits = values.view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


def _assert_rounded_alike(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """`got` (a 16-bit float array) is `want` (float64) rounded to its type, but for a value
    whose precise result lies within the SFU's error of a rounding boundary: at most one unit
    apart, and few that far; NaN where `want` is, and the sign of every other value `want`'s (-0 too)."""
    with np.errstate(over="ignore"):
        rounded = want.astype(got.dtype)
    nan = np.isnan(want)
    assert (np.isnan(got.astype(np.float64)) == nan).all(), f"{name}: NaN at {np.flatnonzero(np.isnan(got.astype(np.float64)) != nan)}"
    signs = np.signbit(got.astype(np.float64)) != np.signbit(rounded.astype(np.float64))
    assert not (signs & ~nan).any(), f"{name}: signs differ at {np.flatnonzero(signs & ~nan)[:8]}"
    apart = np.abs(_ordered(got) - _ordered(rounded))
    worst = int(np.argmax(np.where(nan, 0, apart)))
    assert apart[~nan].max() <= 1, f"{name}: {got[worst]} where float64 gives {want[worst]!r} ({apart[worst]} units apart)"
    # An error of 2^-22 relative moves about one value in 2^14 across a boundary of bfloat16's
    # rounding; one of 2^-15 (a formula magnifying it a hundredfold) about one in a hundred.
    assert np.mean(apart[~nan]) <= 0.005, f"{name}: {np.count_nonzero(apart)} of {apart.size} values a unit apart"


def _flow(expr: str, dtype: str, size: int) -> tuple[rv.Flow, list[str]]:
    """A Calculate of `expr` over inputs f/x0, f/x1, ... of `size` elements of `dtype` (%1 a
    scalar in the SwiGLU gradient, its broadcast 1)."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    operands = max(int(k) for k in re.findall(r"%(\d)", expr)) + 1
    inputs = [f.var(f"x{k}", dtype, [] if expr == SWIGLU_GRADIENT and k == 1 else [size]) for k in range(operands)]
    outputs = 2 if "@1" in expr else 1
    made = f.op("Calculate", inputs, None if outputs == 1 else outputs, {"expr": expr})
    made = list(made) if isinstance(made, (list, tuple)) else [made]
    for out in made:
        out.var.out = True
    return flow, [out.name for out in made]


def _computed(flow: rv.Flow, outputs: list[str], values: dict[str, np.ndarray]) -> list[np.ndarray]:
    data = rv.Compiler("cuda").compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    return [np.array(data[name]) for name in outputs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_each_sfu_op_stored_narrow_is_its_float64_value_rounded(on_device, dtype):
    """Exp, Sigmoid, Silu, Tanh and Reciprocal each a map storing bfloat16 (or float16),
    and Div: float64's value rounded to the stored type, within one unit, with float64's NaN
    and signs, at the edges too (overflow to inf, underflow through the subnormals to 0,
    silu(-inf) = -0, tanh(-0) = -0, 1 / ±0 = ±inf, x / inf = 0)."""
    size = 1031  # a tail past the last vector of 8
    x = _inputs(size, dtype, seed=1)
    for name, oracle in UNARY.items():
        flow, outputs = _flow(f"@0={name}(%0)", dtype, size)
        (got,) = _computed(flow, outputs, {"f/x0": x})
        with np.errstate(all="ignore"):
            _assert_rounded_alike(got, oracle(x.astype(np.float64)), name)
    y = np.roll(_inputs(size, dtype, seed=2), 7)
    flow, outputs = _flow("@0=Div(%0,%1)", dtype, size)
    (got,) = _computed(flow, outputs, {"f/x0": x, "f/x1": y})
    with np.errstate(all="ignore"):
        _assert_rounded_alike(got, x.astype(np.float64) / y.astype(np.float64), "Div")


def _swiglu_oracles(x: np.ndarray, u: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SwiGLU's output silu(x)·u and its gradients g·silu(x) (of u) and g·u·silu'(x) (of x), in float64."""
    s = sigmoid(x)
    return _silu(x) * u, g * _silu(x), g * u * (s * (1.0 + x * (1.0 - s)))


def test_the_swiglu_forward_and_gradient_programs_in_bfloat16_are_float64s_rounded(on_device):
    """The SwiGLU programs of a bfloat16 Llama step (their Sigmoid and Silu one ex2 and one
    reciprocal between them) give float64's values rounded to bfloat16, within one unit; the
    gate's edges among random inputs."""
    size = 4099
    x = _inputs(size, "bfloat16", seed=3)
    x[np.isnan(x.astype(np.float32)) | np.isinf(x.astype(np.float32))] = 1.5  # the oracles' inf · 0 would be NaN
    u, g = (random_array([size], "bfloat16", seed=seed) for seed in (4, 5))
    want_y, want_du, want_dx = (w for w in _swiglu_oracles(*(v.astype(np.float64) for v in (x, u, g))))
    flow, outputs = _flow(SWIGLU, "bfloat16", size)
    (y,) = _computed(flow, outputs, {"f/x0": x, "f/x1": u})
    _assert_rounded_alike(y, want_y, "SwiGLU")
    flow, outputs = _flow(SWIGLU_GRADIENT, "bfloat16", size)
    du, dx = _computed(flow, outputs, {"f/x0": x, "f/x1": np.ones([], np.float32), "f/x2": g, "f/x3": u})
    _assert_rounded_alike(du, want_du, "SwiGLU gradient of u")
    _assert_rounded_alike(dx, want_dx, "SwiGLU gradient of x")


def test_the_formulas_hold_with_the_sfus_error_at_the_isas_bound(monkeypatch):
    """The host's models of ex2, rcp and div.full moved by 2^-22 relative, up or down (about the
    2 ulp the PTX ISA allows): every SFU formula's bfloat16 result is still float64's rounded,
    so none of them magnifies the instructions' error into the stored type's rounding."""
    monkeypatch.setattr(fastmath, "HOST_ERROR", 2.0**-22)
    size = 1031
    x = _inputs(size, "bfloat16", seed=6)
    for name, oracle in UNARY.items():
        flow, _ = _flow(f"@0={name}(%0)", "bfloat16", size)
        (op,) = [op for op in flow.ops.values() if op.type == "Calculate"]
        got = run_gpu_kernels_on_host(op, {"f/x0": x}, fill=0xFF)[op.outputs[0].name]
        with np.errstate(all="ignore"):
            _assert_rounded_alike(got, oracle(x.astype(np.float64)), name)


def test_a_call_takes_the_sfu_where_every_result_it_feeds_is_narrow():
    """The rule (`fastmath.formula`) on a program of a float32 and a bfloat16 result: a call
    feeding only the bfloat16 one takes the SFU's formula, one feeding both or only the
    float32 one its precise formula, as does an op the SFU does not compute (Log)."""
    program = parse("$0=Sigmoid(%0);$1=Exp(%0);@0=Mul($0,%1);@1=Add($0,Tanh($1));@1=Mul(@1,Log(%1));%1=Div(%0,$1)")
    formulas = fastmath.program_formulas(program, 2, ["float32", "bfloat16", "float16"])
    chosen = {str(call): formulas(call) is not None for call in program.feeds(2)}
    assert chosen == {"Sigmoid(%0)": False, "Exp(%0)": True, "Mul($0,%1)": False, "Tanh($1)": True,
                      "Add($0,Tanh($1))": False, "Log(%1)": False, "Mul(@1,Log(%1))": False, "Div(%0,$1)": True}


def _map_ptx(expr: str, dtype: str) -> str:
    flow, _ = _flow(expr, dtype, 1 << 20)
    (op,) = [op for op in flow.ops.values() if op.type == "Calculate"]
    module, _ = kernels.kernel_module(op)
    return ptx.emit_ptx(module)


PROGRAMS = [*(f"@0={name}(%0)" for name in UNARY), "@0=Div(%0,%1)", SWIGLU, SWIGLU_GRADIENT]


@pytest.mark.parametrize("expr", PROGRAMS)
def test_a_float32_maps_code_is_the_precise_formulas(monkeypatch, expr):
    """A float32 map's PTX is the same, byte for byte, with the rule as without it (every
    call its precise formula), and has none of the SFU's approximations."""
    text = _map_ptx(expr, "float32")
    monkeypatch.setattr(fastmath, "formula", lambda op_type, stored: None)
    assert text == _map_ptx(expr, "float32")
    assert not re.search(r"\b(ex2|rcp)\.approx|div\.full|div\.approx", text)


@pytest.mark.parametrize("expr", PROGRAMS)
def test_a_bfloat16_maps_code_takes_the_sfu_and_no_ieee_division(expr):
    """Each op's bfloat16 map computes by the SFU (ex2.approx, rcp.approx or div.full), with
    no IEEE division (div.rn and its slow path)."""
    text = _map_ptx(expr, "bfloat16")
    assert re.search(r"\b(ex2|rcp)\.approx|div\.full", text) and not re.search(r"\bdiv\.rn", text)


@needs_ptxas
def test_a_bfloat16_swiglu_gradient_is_one_ex2_and_one_reciprocal_a_lane():
    """The bfloat16 SwiGLU gradient's map (8 lanes a thread): one ex2.approx and one
    rcp.approx a lane, its Sigmoid's and Silu's shared, no IEEE division; ptxas sm_90 gives
    it at most 32 registers (45 with the precise formulas, whose SASS was 869 instructions
    to 334 now)."""
    text = _map_ptx(SWIGLU_GRADIENT, "bfloat16")
    assert len(re.findall(r"\bex2\.approx\.f32", text)) == 8
    assert len(re.findall(r"\brcp\.approx\.ftz\.f32", text)) == 8
    assert not re.search(r"\bdiv\.rn", text)
    (name,) = re.findall(r"\.entry\s+(\w+)", text)
    assembled = ptx.assemble(text)
    assert assembled.registers(name) <= 32 and "0 bytes spill stores" in assembled.report, assembled.report
