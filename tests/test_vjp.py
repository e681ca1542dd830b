"""Gradient tests: every VJP rule against float64 finite differences and PyTorch autograd,
then the semantics of `ranvier.autodiff` (accumulation, broadcasting, NOGRADIENT flags,
stop frontiers, unknown ops, backward/backward_from, loss scaling, separate gradient
functions) and a float32 smoke test.

Each case of the table builds a small graph on float64 inputs, reduces its output(s)
to a scalar with a fixed random weight per element, and is compiled once: one function
holds the forward pass with its fused gradient, a second the forward pass alone, which
the finite differences evaluate by writing perturbed inputs into its instance.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ranvier as m
from ranvier import autodiff, dtypes
from ranvier.autodiff import backward, backward_from, gradient, vjp
from ranvier.ops import TensorType, all_ops, define, has_op, op_def
from ranvier.ops.random import positions, uniform

F64 = m.DT_DOUBLE
F32 = m.DT_FLOAT32

# Op types that compute a float output but have no VJP (second-order gradients are not
# supported: the backward ops of the windowed nn ops; Assign has no output).
NON_DIFFERENTIABLE = {
    "Assign", "AssignSlice", "AttentionGrad", "Calculate", "SoftmaxCrossEntropyGrad", "Conv2DBackpropInput",
    "Conv2DBackpropFilter", "MaxPoolGrad", "AvgPoolGrad", "SoftmaxTopK", "GroupedMatMulWeightGrad", "MoECombineGrad", "AssignAddScatter",
    "MatMulCalculate", "Conv2DCalculate", "SampleToken", "CachedAttention", "ForEach", "RMSNormGrad",
    "RMSNormCalculate", "LayerNormCalculate", "RMSNormGradCalculate", "MaxPoolGradCalculate", "BatchNormTrainGrad",
    "BatchNormTrainCalculate", "Conv2DCalculateMaxPool",
}

FD_EPS = 1e-6
FD_MAX_ELEMENTS = 40  # per input; larger inputs are checked on a random sample


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------

_RNG = np.random.default_rng(20240611)


def normal(*shape):
    return _RNG.standard_normal(shape)


def away(*shape, lo=0.3, hi=1.5):
    """Values of magnitude in [lo, hi] with random signs: away from 0 (kinks of relu, abs, sign)."""
    return _RNG.uniform(lo, hi, shape) * _RNG.choice([-1.0, 1.0], shape)


def positive(*shape, lo=0.5, hi=2.0):
    return _RNG.uniform(lo, hi, shape)


def off_grid(*shape):
    """Away from integers and half-integers (the jumps of floor, ceil and round)."""
    frac = _RNG.uniform(0.1, 0.4, shape) + _RNG.choice([0.0, 0.5], shape)
    return _RNG.integers(-3, 3, shape) + frac


def untied(shape_a, shape_b, gap=1e-3):
    """Two inputs whose broadcast pairs differ by at least `gap` (min, max, comparisons)."""
    while True:
        a, b = normal(*shape_a), normal(*shape_b)
        if np.min(np.abs(a - b)) > gap:
            return a, b


def off_quotients(shape_a, shape_b):
    """a and b of mixed signs whose broadcast quotients a/b lie away from integers (where
    a remainder jumps)."""
    while True:
        a, b = normal(*shape_a) * 3.0, away(*shape_b, lo=0.5, hi=2.0)
        fraction = np.abs(a / b) % 1.0
        if np.all((fraction > 0.05) & (fraction < 0.95)):
            return a, b


def ints(high, *shape, dtype=np.int32):
    return _RNG.integers(0, high, shape).astype(dtype)


def softmax_rows(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------
# The case table
# ---------------------------------------------------------------------------------------


@dataclass
class Case:
    """build(b, **inputs) and torch(*inputs) compute the same output (or tuple of outputs)."""

    id: str
    build: Callable
    torch: Callable
    inputs: dict
    fd: bool = True  # False where the op is not differentiable at the inputs (ties)
    eps: float = FD_EPS
    rtol: float = 1e-5  # finite differences
    atol: float = 1e-6
    torch_rtol: float = 1e-9
    torch_atol: float = 1e-10

    @property
    def float_inputs(self) -> list[str]:
        return [n for n, a in self.inputs.items() if np.asarray(a).dtype.kind == "f"]


CASES: list[Case] = []


def case(id, build, torch_fn, **inputs):
    options = {k: inputs.pop(k) for k in list(inputs) if k in Case.__dataclass_fields__}
    CASES.append(Case(id, build, torch_fn, {k: np.asarray(v) for k, v in inputs.items()}, **options))


# ---- elementwise unary ------------------------------------------------------------------

UNARY = [
    ("Neg", normal, lambda b, x: -x, lambda x: -x),
    ("Identity", normal, lambda b, x: x.identity(), lambda x: x.clone()),
    ("Abs", away, lambda b, x: abs(x), torch.abs),
    ("Square", normal, lambda b, x: x.square(), torch.square),
    ("Relu", away, lambda b, x: x.relu(), F.relu),
    ("Exp", normal, lambda b, x: x.exp(), torch.exp),
    ("Log", positive, lambda b, x: x.log(), torch.log),
    ("Sqrt", positive, lambda b, x: x.sqrt(), torch.sqrt),
    ("Rsqrt", positive, lambda b, x: x.rsqrt(), torch.rsqrt),
    ("Reciprocal", away, lambda b, x: x.reciprocal(), torch.reciprocal),
    ("Sin", normal, lambda b, x: x.sin(), torch.sin),
    ("Cos", normal, lambda b, x: x.cos(), torch.cos),
    ("Tanh", normal, lambda b, x: x.tanh(), torch.tanh),
    ("Sigmoid", normal, lambda b, x: x.sigmoid(), torch.sigmoid),
    ("Erf", normal, lambda b, x: x.erf(), torch.erf),
    ("Silu", normal, lambda b, x: x.silu(), F.silu),
    ("Softplus", normal, lambda b, x: x.softplus(), F.softplus),
    ("Gelu[erf]", normal, lambda b, x: x.gelu(), F.gelu),
    ("Gelu[tanh]", normal, lambda b, x: x.gelu(approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    # Piecewise-constant ops have a zero gradient; multiplying by x keeps a path that is not.
    ("Sign", away, lambda b, x: x.sign() * x, lambda x: torch.sign(x) * x),
    ("Floor", off_grid, lambda b, x: x.floor() * x, lambda x: torch.floor(x) * x),
    ("Ceil", off_grid, lambda b, x: x.ceil() * x, lambda x: torch.ceil(x) * x),
    ("Round", off_grid, lambda b, x: x.round() * x, lambda x: torch.round(x) * x),
]


def inside(*shape):
    """Inside (-1, 1), away from its ends: the domain of asin, acos and atanh."""
    return _RNG.uniform(-0.9, 0.9, shape)


def quarter_turn(*shape):
    """Inside (-pi/2, pi/2), away from its ends (the poles of tan and sec)."""
    return _RNG.uniform(-1.2, 1.2, shape)


def outside(*shape):
    """|x| in [1.2, 3]: the domain of asec, acsc and acoth."""
    return away(*shape, lo=1.2, hi=3.0)


# Myelin's trigonometric and hyperbolic families, with its definitions (acot(x) = pi/2 - atan(x)).
UNARY += [
    ("Tan", quarter_turn, lambda b, x: x.tan(), torch.tan),
    ("Cot", away, lambda b, x: x.cot(), lambda x: 1 / torch.tan(x)),
    ("Sec", quarter_turn, lambda b, x: x.sec(), lambda x: 1 / torch.cos(x)),
    ("Csc", away, lambda b, x: x.csc(), lambda x: 1 / torch.sin(x)),
    ("Asin", inside, lambda b, x: x.asin(), torch.asin),
    ("Acos", inside, lambda b, x: x.acos(), torch.acos),
    ("Atan", normal, lambda b, x: x.atan(), torch.atan),
    ("Acot", normal, lambda b, x: x.acot(), lambda x: torch.pi / 2 - torch.atan(x)),
    ("Asec", outside, lambda b, x: x.asec(), lambda x: torch.acos(1 / x)),
    ("Acsc", outside, lambda b, x: x.acsc(), lambda x: torch.asin(1 / x)),
    ("Sinh", normal, lambda b, x: x.sinh(), torch.sinh),
    ("Cosh", normal, lambda b, x: x.cosh(), torch.cosh),
    ("Coth", away, lambda b, x: x.coth(), lambda x: 1 / torch.tanh(x)),
    ("Sech", normal, lambda b, x: x.sech(), lambda x: 1 / torch.cosh(x)),
    ("Csch", away, lambda b, x: x.csch(), lambda x: 1 / torch.sinh(x)),
    ("Asinh", normal, lambda b, x: x.asinh(), torch.asinh),
    ("Acosh", lambda *s: positive(*s, lo=1.2, hi=3.0), lambda b, x: x.acosh(), torch.acosh),
    ("Atanh", inside, lambda b, x: x.atanh(), torch.atanh),
    ("Acoth", outside, lambda b, x: x.acoth(), lambda x: torch.atanh(1 / x)),
    ("Asech", lambda *s: positive(*s, lo=0.1, hi=0.9), lambda b, x: x.asech(), lambda x: torch.acosh(1 / x)),
    ("Acsch", away, lambda b, x: x.acsch(), lambda x: torch.asinh(1 / x)),
    ("Softsign", normal, lambda b, x: x.softsign(), F.softsign),
    ("LogSigmoid", normal, lambda b, x: x.log_sigmoid(), F.logsigmoid),
    ("Trunc", off_grid, lambda b, x: x.trunc() * x, lambda x: torch.trunc(x) * x),
]
for _name, _gen, _build, _torch in UNARY:
    case(_name, _build, _torch, x=_gen(3, 5))

# float64 -> float32 -> float64: the float32 roundings limit the finite differences, so
# they use a large step on a quadratic (whose central difference is exact).
case(
    "Cast[f32]",
    lambda b, x: x.cast(F32).square().cast(F64),
    lambda x: x.float().square().double(),
    x=normal(3, 4), eps=1e-3, rtol=1e-3, atol=1e-4, torch_rtol=1e-6, torch_atol=1e-6,
)
case("Cast[int]", lambda b, n, x: n.cast(F64) * x, lambda n, x: n.double() * x, n=ints(5, 3, 4), x=normal(3, 4))

# ---- elementwise binary ------------------------------------------------------------------

BROADCASTS = [
    ("same", [3, 4], [3, 4]),
    ("col-row", [3, 1], [1, 4]),
    ("scalar-matrix", [], [2, 3]),
    ("rank3-rank1", [2, 3, 4], [4]),
    ("rank1-rank3", [4], [2, 3, 4]),
]
BINARY = [
    ("Add", lambda a, b: a + b, lambda a, b: a + b, None),
    ("Sub", lambda a, b: a - b, lambda a, b: a - b, None),
    ("Mul", lambda a, b: a * b, lambda a, b: a * b, None),
    ("Div", lambda a, b: a / b, lambda a, b: a / b, lambda sa, sb: (normal(*sa), away(*sb))),
    ("Pow", lambda a, b: a ** b, torch.pow, lambda sa, sb: (positive(*sa), _RNG.uniform(-1.5, 1.5, sb))),
    ("Minimum", lambda a, b: a.builder.minimum(a, b), torch.minimum, untied),
    ("Maximum", lambda a, b: a.builder.maximum(a, b), torch.maximum, untied),
    ("FMod", lambda a, b: a.fmod(b), torch.fmod, off_quotients),
    ("Mod", lambda a, b: a.mod(b), torch.remainder, off_quotients),
]
for _name, _build, _torch, _gen in BINARY:
    for _label, _sa, _sb in BROADCASTS:
        _a, _b = _gen(_sa, _sb) if _gen else (normal(*_sa), normal(*_sb))
        case(f"{_name}[{_label}]", (lambda fn: lambda b, x, y: fn(x, y))(_build), _torch, x=_a, y=_b)

# Python numbers become constants of the other operand's dtype.
case("Mul[const]", lambda b, x: x * 2.5, lambda x: x * 2.5, x=normal(3, 4))
case("Sub[rconst]", lambda b, x: 2.0 - x, lambda x: 2.0 - x, x=normal(3, 4))
case("Div[rconst]", lambda b, x: 3.0 / x, lambda x: 3.0 / x, x=away(3, 4))
# A constant exponent on a negative base: the exponent's gradient (log of the base) is not wanted.
case("Pow[const-exponent]", lambda b, x: x ** 3.0, lambda x: x ** 3.0, x=normal(3, 4))
case("Pow[const-base]", lambda b, x: 2.0 ** x, lambda x: 2.0 ** x, x=normal(3, 4))

# ---- cond / select and the comparisons and logic feeding them -----------------------------

case("Cond", lambda b, c, x, y: b.cond(c, x, y), torch.where, c=ints(2, 3, 4).astype(bool), x=normal(3, 4), y=normal(1, 4))
case("Cond[broadcast-cond]", lambda b, c, x, y: b.cond(c, x, y), torch.where, c=ints(2, 3, 1).astype(bool), x=normal(3, 4), y=normal())
case("Select", lambda b, c, x: b.select(c, x), lambda c, x: torch.where(c, x, 0.0), c=ints(2, 3, 4).astype(bool), x=normal(4))
_x, _y = untied([3, 4], [3, 4])
case("Cond[greater]", lambda b, x, y: b.cond(x > y, x * y, x - y), lambda x, y: torch.where(x > y, x * y, x - y), x=_x, y=_y)


def _logic(b, x, y):
    c1 = (x < y) & (x <= 0.25)
    c2 = (x >= y) ^ (y > -0.25)
    c3 = ~x.equal(y) | x.not_equal(0.7)
    return b.cond(c1 | (c2 & c3), x * y, x + y)


def _torch_logic(x, y):
    c1 = (x < y) & (x <= 0.25)
    c2 = (x >= y) ^ (y > -0.25)
    c3 = ~(x == y) | (x != 0.7)
    return torch.where(c1 | (c2 & c3), x * y, x + y)


_x, _y = untied([4, 5], [4, 5])
case("Logic", _logic, _torch_logic, x=_x, y=_y)
case(
    "AndNot",
    lambda b, x, y: b.cond(b.logical_and_not(x < y, y > 0.25), x * y, x + y),
    lambda x, y: torch.where(~(x < y) & (y > 0.25), x * y, x + y),
    x=_x, y=_y,
)
case(
    "Bitwise",
    lambda b, n, x: n.bitwise_and(6).bitwise_or(1).bitwise_xor(2).shift_left(3).shift_right(1).bitwise_not().cast(F64) * x,
    lambda n, x: torch.bitwise_not(((((n & 6) | 1) ^ 2) << 3) >> 1).double() * x,
    n=np.arange(-10, 10, dtype=np.int32).reshape(4, 5), x=normal(4, 5),
)
case(
    "Bitcast",
    lambda b, n, x: n.bitcast("uint8").cast(F64) * x,
    lambda n, x: n.view(torch.uint8).double() * x,
    n=np.arange(-10, 10, dtype=np.int8).reshape(4, 5), x=normal(4, 5),
)
case(
    "All-Any",
    lambda b, x, y: b.cond((x > -1.0).all(axis=1, keepdims=True) & (y > 0.5).any(axis=1, keepdims=True), x, y * 2.0),
    lambda x, y: torch.where((x > -1.0).all(dim=1, keepdim=True) & (y > 0.5).any(dim=1, keepdim=True), x, y * 2.0),
    x=away(6, 3), y=away(6, 3),
)
case(
    "ArgMax-ArgMin",
    lambda b, x, p: p.gather(x.argmax(axis=1)) + p.gather(x.argmin(axis=1)),
    lambda x, p: p[x.argmax(dim=1)] + p[x.argmin(dim=1)],
    x=normal(4, 5), p=normal(5, 3),
)
case(
    "OneHot",
    lambda b, n, x: n.one_hot(5, F64) * x,
    lambda n, x: F.one_hot(n.long(), 5).double() * x,
    n=np.array([0, 4, 2, 2], np.int32), x=normal(4, 5),
)

# ---- random numbers: dropout's mask is a constant of x; the numbers have no gradient -----------------


def _kept(shape, seed, rate, stream):
    return torch.from_numpy(uniform(positions(shape), np.int32(seed), stream) >= np.float32(rate))


case(
    "Dropout",
    lambda b, x, s: b.dropout(x, s, 0.4, 3),
    lambda x, s: torch.where(_kept([5, 6], 9, 0.4, 3), x * (1.0 / (1.0 - 0.4)), 0.0),
    x=normal(5, 6), s=np.int32(9),
)
case(
    "RandomUniform",
    lambda b, c, s, x: b.random_uniform(c, s, 2).cast(F64) * x,
    lambda c, s, x: torch.from_numpy(uniform(c.numpy(), s.numpy(), 2)).double() * x,
    c=np.arange(12, dtype=np.int32).reshape(3, 4), s=np.int32(4), x=normal(3, 4),
)

# ---- reductions ------------------------------------------------------------------------------

REDUCE_AXES = [(None, False), ([1], False), ([0, 2], True), ([-1], True), ([-1, 0], False), ([1], True)]


def _dims(axis, rank):
    return list(range(rank)) if axis is None else sorted(a % rank for a in axis)


def _torch_reduce(fn):
    def reduce(x, axis, keepdims):
        dims = _dims(axis, x.dim())
        return fn(x, dims, keepdims)

    return reduce


def _torch_prod(x, dims, keepdims):
    for d in sorted(dims, reverse=True):
        x = x.prod(dim=d, keepdim=keepdims)
    return x


REDUCTIONS = [
    ("Sum", "sum", _torch_reduce(lambda x, d, k: x.sum(dim=d, keepdim=k)), normal),
    ("SumSquares", "sum_squares", _torch_reduce(lambda x, d, k: (x * x).sum(dim=d, keepdim=k)), normal),
    ("Mean", "mean", _torch_reduce(lambda x, d, k: x.mean(dim=d, keepdim=k)), normal),
    ("Max", "max", _torch_reduce(lambda x, d, k: torch.amax(x, dim=d, keepdim=k)), normal),
    ("Min", "min", _torch_reduce(lambda x, d, k: torch.amin(x, dim=d, keepdim=k)), normal),
    ("Product", "product", _torch_reduce(_torch_prod), lambda *s: away(*s, lo=0.6, hi=1.4)),
]
for _name, _method, _torch, _gen in REDUCTIONS:
    for _axis, _keep in REDUCE_AXES:
        case(
            f"{_name}[axis={_axis},keepdims={_keep}]",
            (lambda meth, axis, keep: lambda b, x: getattr(x, meth)(axis=axis, keepdims=keep))(_method, _axis, _keep),
            (lambda fn, axis, keep: lambda x: fn(x, axis, keep))(_torch, _axis, _keep),
            x=_gen(3, 4, 5),
        )

# Ties: the gradient is shared equally by the tied extremes, as torch.amax/amin do. Not
# differentiable there, so PyTorch only.
_ties = np.array([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0], [5.0, -1.0, 5.0, 5.0]])
case("Max[ties,axis=1]", lambda b, x: x.max(axis=1), lambda x: torch.amax(x, dim=1), x=_ties, fd=False)
case("Max[ties,all]", lambda b, x: x.max(), lambda x: torch.amax(x), x=_ties, fd=False)
case("Min[ties,axis=0]", lambda b, x: x.min(axis=0), lambda x: torch.amin(x, dim=0), x=-_ties, fd=False)

# ---- matmul ------------------------------------------------------------------------------------

MATMULS = [
    ("a@b", [3, 4], [4, 5], False, False),
    ("a@bT", [3, 4], [5, 4], False, True),
    ("aT@b", [4, 3], [4, 5], True, False),
    ("aT@bT", [4, 3], [5, 4], True, True),
    ("batch[2,3,4]@[4,5]", [2, 3, 4], [4, 5], False, False),
    ("batch[3,4]@[2,4,5]", [3, 4], [2, 4, 5], False, False),
    ("batch[2,1,3,4]@[3,4,5]", [2, 1, 3, 4], [3, 4, 5], False, False),
    ("batch[2,4,3]T@[5,4]T", [2, 4, 3], [5, 4], True, True),
    ("batch[2,4,3]T@[2,4,5]", [2, 4, 3], [2, 4, 5], True, False),
]
for _label, _sa, _sb, _ta, _tb in MATMULS:
    case(
        f"MatMul[{_label}]",
        (lambda ta, tb: lambda b, x, y: b.matmul(x, y, transpose_a=ta, transpose_b=tb))(_ta, _tb),
        (lambda ta, tb: lambda x, y: torch.matmul(x.mT if ta else x, y.mT if tb else y))(_ta, _tb),
        x=normal(*_sa), y=normal(*_sb),
    )

# ---- shapes --------------------------------------------------------------------------------------

case("Reshape", lambda b, x: x.reshape([2, 6]), lambda x: x.reshape(2, 6), x=normal(3, 4))
case("Reshape[-1]", lambda b, x: x.reshape([4, -1]), lambda x: x.reshape(4, -1), x=normal(2, 3, 4))
case("Transpose[perm]", lambda b, x: x.transpose([2, 0, 1]), lambda x: x.permute(2, 0, 1), x=normal(2, 3, 4))
case("Transpose[default]", lambda b, x: x.transpose(), lambda x: x.permute(2, 1, 0), x=normal(2, 3, 4))
case(
    "Concat[axis=1]",
    lambda b, x, y, z: b.concat([x, y, z], axis=1),
    lambda x, y, z: torch.cat([x, y, z], dim=1),
    x=normal(2, 3), y=normal(2, 1), z=normal(2, 4),
)
case("Concat[axis=-1]", lambda b, x, y: b.concat([x, y], axis=-1), lambda x, y: torch.cat([x, y], -1), x=normal(2, 3, 2), y=normal(2, 3, 3))
case("Concat[axis=0,repeated]", lambda b, x, y: b.concat([x, y, x], axis=0), lambda x, y: torch.cat([x, y, x], 0), x=normal(1, 3), y=normal(2, 3))
case("Split[count]", lambda b, x: x.split(3, axis=1), lambda x: torch.split(x, 2, dim=1), x=normal(2, 6))
case("Split[sizes]", lambda b, x: x.split([1, 3, 2], axis=-1), lambda x: torch.split(x, [1, 3, 2], dim=-1), x=normal(3, 2, 6))
case(
    "Split[unused-part]",
    lambda b, x: (lambda p: (p[0], p[2].tanh()))(x.split([2, 1, 1], axis=0)),
    lambda x: (lambda p: (p[0], p[2].tanh()))(torch.split(x, [2, 1, 1], dim=0)),
    x=normal(4, 3),
)
case("Slice", lambda b, x: x.slice([1, 0, 2], [2, -1, 2]), lambda x: x[1:3, :, 2:4], x=normal(3, 4, 5))
case("BroadcastTo[row]", lambda b, x: x.broadcast_to([3, 4]), lambda x: x.expand(3, 4), x=normal(1, 4))
case("BroadcastTo[rank]", lambda b, x: x.broadcast_to([2, 3, 4]), lambda x: x.expand(2, 3, 4), x=normal(4))
case("BroadcastTo[col]", lambda b, x: x.broadcast_to([2, 3, 4]), lambda x: x.expand(2, 3, 4), x=normal(3, 1))
case("ExpandDims[0]", lambda b, x: x.expand_dims(0) * x.expand_dims(0), lambda x: x.unsqueeze(0) ** 2, x=normal(3, 4))
case("ExpandDims[-1]", lambda b, x: x.expand_dims(-1).exp(), lambda x: x.unsqueeze(-1).exp(), x=normal(3, 4))
case("Squeeze[axis]", lambda b, x: x.squeeze(1), lambda x: x.squeeze(1), x=normal(3, 1, 4))
case("Squeeze[all]", lambda b, x: x.squeeze(), lambda x: x.squeeze(), x=normal(1, 3, 1, 4))

# ---- indexing ------------------------------------------------------------------------------------

case(
    "Gather[repeated]",
    lambda b, p, i: p.gather(i),
    lambda p, i: p[i.long()],
    p=normal(5, 3), i=np.array([[0, 2, 2], [4, 0, 0]], np.int32),
)
case("Gather[int64]", lambda b, p, i: p.gather(i), lambda p, i: p[i], p=normal(4, 2, 3), i=np.array([2, 2, 2, 1], np.int64))
case(
    "Gather[oov]",  # Myelin's out-of-vocabulary row: indices outside the table read it
    lambda b, p, i, o: p.gather(i, o),
    lambda p, i, o: torch.where(((i >= 0) & (i < 5))[..., None], p[i.long().clamp(0, 4)], o),
    p=normal(5, 3), i=np.array([[0, 7, 2], [-1, 4, 7]], np.int32), o=normal(3),
)
case(
    "ScatterAdd",
    lambda b, i, u: b.scatter_add(i, u, rows=5),
    lambda i, u: torch.zeros(5, 3, dtype=u.dtype).index_add(0, i.long(), u),
    i=np.array([0, 3, 3, 1], np.int32), u=normal(4, 3),
)

# Myelin's pooled lookups; negative indices are padding.
_POOLED = np.array([[-1, 3, 0, 3, 1, -1]], np.int32)
case("GatherSum", lambda b, p, i: b.gather_sum(p, i), lambda p, i: p[i[i >= 0].long()].sum(0, keepdim=True), p=normal(5, 3), i=_POOLED)
case("GatherAvg", lambda b, p, i: b.gather_avg(p, i), lambda p, i: p[i[i >= 0].long()].mean(0, keepdim=True), p=normal(5, 3), i=_POOLED)
case("GatherMax", lambda b, p, i: b.gather_max(p, i), lambda p, i: p[i[i >= 0].long()].amax(0, keepdim=True), p=normal(5, 3), i=_POOLED)
case(
    "Shape-Size-Rank-Count",
    lambda b, x: x * (b.size(x).cast(F64) + b.rank(x).cast(F64) + b.shape(x).cast(F64).sum() + b.count(x > 0.0, dtype=F64)),
    lambda x: x * (12 + 2 + 7 + (x > 0).sum()),
    x=away(3, 4),
)

# ---- fused attention ----------------------------------------------------------------------

case(
    "Attention[gqa,causal]",
    lambda b, q, k, v: b.op("Attention", [q, k, v]),
    lambda q, k, v: F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True),
    q=normal(2, 4, 5, 3), k=normal(2, 2, 5, 3), v=normal(2, 2, 5, 3),
)
case(
    "Attention[tokens first]",  # q, k, v and the output [B, T, heads, hd]
    lambda b, q, k, v: b.attention(q, k, v, heads_first=False),
    lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1), v.transpose(1, 2).repeat_interleave(2, 1), is_causal=True,
    ).transpose(1, 2),
    q=normal(2, 5, 4, 3), k=normal(2, 5, 2, 3), v=normal(2, 5, 2, 3),
)
case(
    "Attention[mqa,full]",
    lambda b, q, k, v: b.op("Attention", [q, k, v], None, {"causal": False, "scale": 0.7}),
    lambda q, k, v: F.scaled_dot_product_attention(q, k.expand(-1, 3, -1, -1), v.expand(-1, 3, -1, -1), scale=0.7),
    q=normal(1, 3, 4, 2), k=normal(1, 1, 6, 2), v=normal(1, 1, 6, 2),
)
def _torch_rotary(x, cos, sin, inverse=False):
    """Interleaved pairs turned by the angle at each position (x [..., T, H, D], tables [T, D/2])."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], (-sin if inverse else sin)[:, None, :]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)


# the tables learned too: their gradients sum over batch and heads
case("Rotary", lambda b, x, c, s: b.rotary(x, c, s), _torch_rotary, x=normal(2, 3, 2, 6), c=normal(3, 3), s=normal(3, 3))
case(
    "Rotary[inverse]",
    lambda b, x, c, s: b.rotary(x, c, s, inverse=True),
    lambda x, c, s: _torch_rotary(x, c, s, inverse=True),
    x=normal(4, 2, 4), c=normal(4, 2), s=normal(4, 2),
)

_CAUSAL_5x5 = torch.triu(torch.full((5, 5), float("-inf"), dtype=torch.float64), 1)
case(
    "Attention[gqa,causal,position bias]",  # a learned bias [H, T, S]: its gradient too
    lambda b, q, k, v, bias: b.attention(q, k, v, bias),
    lambda q, k, v, bias: F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                         attn_mask=bias + _CAUSAL_5x5),
    q=normal(2, 4, 5, 3), k=normal(2, 2, 5, 3), v=normal(2, 2, 5, 3), bias=normal(4, 5, 5),
)
case(
    "Attention[tokens first,position bias]",
    lambda b, q, k, v, bias: b.attention(q, k, v, bias, heads_first=False),
    lambda q, k, v, bias: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1), v.transpose(1, 2).repeat_interleave(2, 1),
        attn_mask=bias + _CAUSAL_5x5,
    ).transpose(1, 2),
    q=normal(2, 5, 4, 3), k=normal(2, 5, 2, 3), v=normal(2, 5, 2, 3), bias=normal(4, 5, 5),
)
case(
    "Attention[mqa,full,batch bias]",
    lambda b, q, k, v, bias: b.attention(q, k, v, bias, causal=False, scale=0.7),
    lambda q, k, v, bias: F.scaled_dot_product_attention(q, k.expand(-1, 3, -1, -1), v.expand(-1, 3, -1, -1), attn_mask=bias, scale=0.7),
    q=normal(2, 3, 4, 2), k=normal(2, 1, 6, 2), v=normal(2, 1, 6, 2), bias=normal(2, 1, 1, 6),
)

# ---- window primitives (what convolution and pooling decompose into) ----------------------

case(
    "Pad",
    lambda b, x: b.op("Pad", [x], None, {"before": [1, 0, 2], "after": [0, 3, 1], "value": 0.5}),
    lambda x: F.pad(x, (2, 1, 0, 3, 1, 0), value=0.5),
    x=normal(2, 3, 4),
)
# Overlapping 3-wide windows of a 2x7 input with stride 2: im2col.
_WINDOWS = {"offset": 0, "shape": [2, 3, 3], "strides": [7, 2, 1]}
case(
    "StridedView",
    lambda b, x: b.op("StridedView", [x], None, _WINDOWS),
    lambda x: torch.as_strided(x.reshape(-1), (2, 3, 3), (7, 2, 1), 0),
    x=normal(2, 7),
)
case(
    "StridedScatterAdd",
    lambda b, d: b.op("StridedScatterAdd", [d], None, {**_WINDOWS, "target_shape": [2, 7]}),
    lambda d: torch.zeros(14, dtype=d.dtype).index_add(
        0, torch.as_strided(torch.arange(14), (2, 3, 3), (7, 2, 1), 0).reshape(-1), d.reshape(-1)).reshape(2, 7),
    d=normal(2, 3, 3),
)
case(
    "ScatterAdd[2d-indices]",
    lambda b, i, u: b.scatter_add(i, u, rows=6),
    lambda i, u: torch.zeros(6, 3, dtype=u.dtype).index_add(0, i.reshape(-1).long(), u.reshape(-1, 3)),
    i=np.array([[0, 1], [1, 4]], np.int32), u=normal(2, 2, 3),
)

# ---- nn composites ---------------------------------------------------------------------------------

for _axis, _shape in [(-1, (3, 5)), (0, (3, 5)), (1, (2, 3, 4))]:
    case(f"Softmax[axis={_axis}]", (lambda a: lambda b, x: x.softmax(axis=a))(_axis), (lambda a: lambda x: torch.softmax(x, a))(_axis), x=normal(*_shape))
    case(
        f"LogSoftmax[axis={_axis}]",
        (lambda a: lambda b, x: x.log_softmax(axis=a))(_axis),
        (lambda a: lambda x: torch.log_softmax(x, a))(_axis),
        x=normal(*_shape),
    )

case("LayerNorm", lambda b, x: x.layer_norm(), lambda x: F.layer_norm(x, (5,)), x=normal(3, 5))
case("LayerNorm[gamma]", lambda b, x, g: x.layer_norm(g), lambda x, g: F.layer_norm(x, (5,), g), x=normal(3, 5), g=normal(5))
case(
    "LayerNorm[gamma,beta]",
    lambda b, x, g, s: x.layer_norm(g, s),
    lambda x, g, s: F.layer_norm(x, (5,), g, s),
    x=normal(3, 5), g=normal(5), s=normal(5),
)
case(
    "LayerNorm[rank3,eps]",
    lambda b, x, g, s: x.layer_norm(g, s, eps=1e-3),
    lambda x, g, s: F.layer_norm(x, (5,), g, s, eps=1e-3),
    x=normal(2, 3, 5), g=normal(5), s=normal(5),
)
case("LayerNorm[rank1]", lambda b, x, g: x.layer_norm(g), lambda x, g: F.layer_norm(x, (5,), g), x=normal(5), g=normal(5))
case("RMSNorm", lambda b, x: x.rms_norm(), lambda x: F.rms_norm(x, (5,), eps=1e-5), x=normal(3, 5))
case("RMSNorm[gamma]", lambda b, x, g: x.rms_norm(g), lambda x, g: F.rms_norm(x, (5,), g, eps=1e-5), x=normal(3, 5), g=normal(5))
case(
    "RMSNorm[rank3,eps]",
    lambda b, x, g: x.rms_norm(g, eps=1e-3),
    lambda x, g: F.rms_norm(x, (5,), g, eps=1e-3),
    x=normal(2, 3, 5), g=normal(5),
)



def _batch_norm(b, x, g, s, eps=1e-5):
    return b.op("BatchNormTrain", [x, g, s], None, {"eps": eps})


def _torch_batch_norm(x, g, s, eps=1e-5):
    dims = [0, *range(2, x.dim())]
    return F.batch_norm(x, None, None, g, s, training=True, eps=eps), x.mean(dims), x.var(dims, unbiased=False)


case("BatchNormTrain[y]", lambda b, x, g, s: _batch_norm(b, x, g, s)[0], lambda x, g, s: _torch_batch_norm(x, g, s)[0],
     x=normal(3, 4, 2, 5), g=normal(4), s=normal(4))
case("BatchNormTrain[y,mean,var]", lambda b, x, g, s: _batch_norm(b, x, g, s, eps=1e-3),
     lambda x, g, s: _torch_batch_norm(x, g, s, eps=1e-3), x=normal(4, 3, 7), g=normal(3), s=normal(3))
case("BatchNormTrain[rank2,mean]", lambda b, x, g, s: _batch_norm(b, x, g, s)[1] * 1.0, lambda x, g, s: _torch_batch_norm(x, g, s)[1],
     x=normal(5, 3), g=normal(3), s=normal(3))


def _torch_xent(smoothing=0.0):
    def xent(x, t):
        classes = x.shape[-1]
        flat_t = t.reshape(-1).long() if not t.is_floating_point() else t.reshape(-1, classes)
        loss = F.cross_entropy(x.reshape(-1, classes), flat_t, reduction="none", label_smoothing=smoothing)
        return loss.reshape(x.shape[:-1])

    return xent


case("SoftmaxCrossEntropy[int32]", lambda b, x, t: x.softmax_cross_entropy(t), _torch_xent(), x=normal(4, 5), t=ints(5, 4))
case(
    "SoftmaxCrossEntropy[int64,rank3]",
    lambda b, x, t: x.softmax_cross_entropy(t),
    _torch_xent(),
    x=normal(2, 3, 5), t=ints(5, 2, 3, dtype=np.int64),
)
case(
    "SoftmaxCrossEntropy[probs]",
    lambda b, x, t: x.softmax_cross_entropy(t),
    _torch_xent(),
    x=normal(4, 5), t=softmax_rows(normal(4, 5)),
)
# Target rows that do not sum to 1: the gradient is still the derivative of the op as defined.
case(
    "SoftmaxCrossEntropy[unnormalized]",
    lambda b, x, t: x.softmax_cross_entropy(t),
    _torch_xent(),
    x=normal(4, 5), t=positive(4, 5, lo=0.1, hi=1.0),
)
case(
    "SoftmaxCrossEntropy[int,smoothing]",
    lambda b, x, t: x.softmax_cross_entropy(t, label_smoothing=0.1),
    _torch_xent(0.1),
    x=normal(4, 5), t=ints(5, 4),
)
case(
    "SoftmaxCrossEntropy[probs,smoothing]",
    lambda b, x, t: x.softmax_cross_entropy(t, label_smoothing=0.2),
    _torch_xent(0.2),
    x=normal(2, 3, 5), t=softmax_rows(normal(2, 3, 5)),
)

CONVS = [
    ("stride2,pad1", [2, 3, 7, 7], [4, 3, 3, 3], (2, 2), (1, 1)),
    ("stride1,pad0", [1, 2, 5, 6], [3, 2, 2, 3], (1, 1), (0, 0)),
    ("stride(1,2),pad(1,0)", [2, 2, 6, 7], [3, 2, 3, 2], (1, 2), (1, 0)),
]
for _label, _sx, _sw, _s, _p in CONVS:
    case(
        f"Conv2D[{_label}]",
        (lambda s, p: lambda b, x, w: b.conv2d(x, w, strides=s, padding=p))(_s, _p),
        (lambda s, p: lambda x, w: F.conv2d(x, w, stride=s, padding=p))(_s, _p),
        x=normal(*_sx), w=normal(*_sw),
    )

POOLS = [
    ("k3,s2,p1", [2, 3, 6, 7], (3, 3), (2, 2), (1, 1)),
    ("k2", [1, 2, 6, 6], (2, 2), None, (0, 0)),
    ("k(2,3),s(1,2),p(1,1)", [1, 2, 5, 7], (2, 3), (1, 2), (1, 1)),
]
for _label, _sx, _k, _s, _p in POOLS:
    case(
        f"MaxPool[{_label}]",
        (lambda k, s, p: lambda b, x: b.max_pool(x, k, s, p))(_k, _s, _p),
        (lambda k, s, p: lambda x: F.max_pool2d(x, k, s, p))(_k, _s, _p),
        x=normal(*_sx),
    )
    case(
        f"AvgPool[{_label}]",
        (lambda k, s, p: lambda b, x: b.avg_pool(x, k, s, p))(_k, _s, _p),
        (lambda k, s, p: lambda x: F.avg_pool2d(x, k, s, p, count_include_pad=True))(_k, _s, _p),
        x=normal(*_sx),
    )

# ---- mixture of experts ---------------------------------------------------------------------------

case("TopK", lambda b, x: x.top_k(3)[0], lambda x: torch.topk(x, 3).values, x=normal(4, 7))
case(
    "TopK[indices]",
    lambda b, x, p: x.top_k(2)[0] * p.gather(x.top_k(2)[1]),
    lambda x, p: torch.topk(x, 2).values * p[torch.topk(x, 2).indices],
    x=normal(5, 6), p=normal(6),
)
_GROUP_OFFSETS = np.array([0, 3, 3, 7, 9], np.int32)
case(
    "GroupedMatMul",
    lambda b, x, w, o: b.grouped_matmul(x, w, o),
    lambda x, w, o: torch.cat([torch.cat([x[a:z] @ w[e] for e, (a, z) in enumerate(itertools.pairwise(o))]), torch.zeros(2, 5, dtype=x.dtype)]),
    x=normal(11, 4), w=normal(4, 4, 5), o=_GROUP_OFFSETS,
)
case(
    "GroupedMatMul[transpose_b]",
    lambda b, x, w, o: b.grouped_matmul(x, w, o, transpose_b=True),
    lambda x, w, o: torch.cat([x[a:z] @ w[e].T for e, (a, z) in enumerate(itertools.pairwise(o))]),
    x=normal(9, 3), w=normal(4, 6, 3), o=_GROUP_OFFSETS,
)
case(
    "MoECombine",
    lambda b, r, s, w: b.moe_combine(r, s, w),
    lambda r, s, w: (r[s.long()] * w.unsqueeze(-1)).sum(1),
    r=normal(7, 5), s=np.array([[0, 3], [3, 6], [2, 0], [5, 1]], np.int32), w=normal(4, 2),
)
case(
    "MoEAuxLoss",
    lambda b, logits, counts: b.load_balancing_loss(logits.softmax(), counts),
    lambda logits, counts: 4 * (counts.double() / 6 * torch.softmax(logits, -1).mean(0)).sum(),
    logits=normal(6, 4), counts=np.array([5, 0, 4, 3], np.int32),
)


def _moe_layer(b, x, router, w, experts=4, k=2):
    """Route each token to its top-k experts, run them as one grouped product, combine."""
    weights, choices = (x @ router).softmax().top_k(k)
    order, slot, offsets, _kept, _counts = b.moe_route(choices, experts=experts)
    rows = b.grouped_matmul(x.gather(order), w, offsets)
    return (rows.gather(slot) * weights.expand_dims(-1)).sum(axis=1)


def _torch_moe_layer(x, router, w, k=2):
    weights, choices = torch.topk(torch.softmax(x @ router, -1), k)
    return torch.stack([sum(weights[t, j] * (x[t] @ w[choices[t, j]]) for j in range(k)) for t in range(x.shape[0])])


case("MoE[dispatch-combine]", _moe_layer, _torch_moe_layer, x=normal(7, 3), router=normal(3, 4), w=normal(4, 3, 5))

# ---- composites: several rules chained, a tensor used on several paths -----------------------------

case(
    "MLP",
    lambda b, x, w1, b1, w2, t: ((x @ w1 + b1).gelu() @ w2).softmax_cross_entropy(t).mean(),
    lambda x, w1, b1, w2, t: F.cross_entropy(F.gelu(x @ w1 + b1) @ w2, t.long()),
    x=normal(4, 3), w1=normal(3, 6), b1=normal(6), w2=normal(6, 5), t=ints(5, 4),
)
case(
    "Attention",
    lambda b, q, k, v: b.matmul((b.matmul(q, k, transpose_b=True) * 0.5).softmax(), v).layer_norm(),
    lambda q, k, v: F.layer_norm(torch.softmax(q @ k.mT * 0.5, -1) @ v, (4,)),
    q=normal(2, 3, 4), k=normal(2, 5, 4), v=normal(2, 5, 4),
)

CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS), "case ids must be unique"


# ---------------------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------------------


def _weighted_loss(b: m.Builder, outputs, weights):
    """sum_i sum(output_i * weight_i): every output element reaches the loss with its own weight."""
    loss = None
    for i, (out, w) in enumerate(zip(outputs, weights)):
        term = b.sum(out * b.array(f"weight{i}", w))
        loss = term if loss is None else loss + term
    return loss


def _build(flow: m.Flow, func: str, c: Case, weights=None):
    b = m.Builder(flow, func)
    tensors = {n: b.var(n, dtypes.from_numpy(a.dtype), a.shape) for n, a in c.inputs.items()}
    out = c.build(b, **tensors)
    outputs = out if isinstance(out, tuple) else (out,)
    for o in outputs:
        o.var.out = True  # read after compute: keep its storage from being reused by the loss
    if weights is None:
        wrng = np.random.default_rng(zlib.crc32(c.id.encode()))
        weights = [wrng.uniform(0.5, 1.5, o.shape) * wrng.choice([-1.0, 1.0], o.shape) for o in outputs]
    return tensors, outputs, _weighted_loss(b, outputs, weights), weights


class Compiled:
    """One case compiled once: `f` computes the loss and its fused gradients, `fwd` only the loss."""

    def __init__(self, c: Case):
        self.case = c
        flow = m.Flow()
        self.fwd_inputs, _, self.fwd_loss, self.weights = _build(flow, "fwd", c)
        tensors, outputs, loss, _ = _build(flow, "f", c, self.weights)
        for out in outputs:
            assert out.dtype == F64
        wrt = [tensors[n] for n in c.float_inputs]
        grads = gradient(flow, "f", wrt, loss=loss)
        net = m.Compiler().compile(flow)
        self.fwd = net.cell("fwd").instance()
        full = net.cell("f").instance()
        for n, a in c.inputs.items():
            self.fwd[self.fwd_inputs[n]][...] = a
            full[tensors[n]][...] = a
        full.compute()
        self.outputs = [full[o].copy() for o in outputs]
        self.loss_value = float(full[loss])
        self.grads = {n: full[grads[tensors[n].name]].copy() for n in c.float_inputs}

    def loss(self) -> float:
        self.fwd.compute()
        return float(self.fwd[self.fwd_loss])


@functools.cache
def compiled(case_id: str) -> Compiled:
    return Compiled(CASES[CASE_IDS.index(case_id)])


def finite_differences(comp: Compiled, name: str, eps: float):
    """Central differences of the loss for (a sample of) the elements of one input."""
    view = comp.fwd[comp.fwd_inputs[name]].reshape(-1)
    assert np.shares_memory(view, comp.fwd[comp.fwd_inputs[name]])
    count = view.size
    if count > FD_MAX_ELEMENTS:
        index = np.sort(np.random.default_rng(count).choice(count, FD_MAX_ELEMENTS, replace=False))
    else:
        index = np.arange(count)
    numeric = np.empty(len(index))
    for k, i in enumerate(index):
        saved = view[i]
        view[i] = saved + eps
        up = comp.loss()
        view[i] = saved - eps
        down = comp.loss()
        view[i] = saved
        numeric[k] = (up - down) / (2 * eps)
    return index, numeric


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_gradient_matches_finite_differences(case_id):
    comp = compiled(case_id)
    c = comp.case
    if not c.fd:
        pytest.skip("not differentiable at these inputs (ties); checked against PyTorch only")
    assert comp.loss() == pytest.approx(comp.loss_value, rel=1e-12, abs=1e-12)
    for name in c.float_inputs:
        index, numeric = finite_differences(comp, name, c.eps)
        analytic = comp.grads[name].reshape(-1)[index]
        np.testing.assert_allclose(analytic, numeric, rtol=c.rtol, atol=c.atol, err_msg=f"{case_id}: d loss / d {name}")


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_gradient_matches_torch(case_id):
    comp = compiled(case_id)
    c = comp.case
    if c.torch is None:
        pytest.skip("no PyTorch counterpart")
    tensors = {n: torch.tensor(a, requires_grad=n in c.float_inputs) for n, a in c.inputs.items()}
    out = c.torch(*tensors.values())
    outputs = out if isinstance(out, tuple) else (out,)
    assert len(outputs) == len(comp.outputs)
    for mine, theirs in zip(comp.outputs, outputs):
        # The same function: otherwise comparing gradients would mean nothing.
        np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=c.torch_rtol, atol=c.torch_atol, err_msg=f"{case_id}: output")
    loss = sum((o * torch.tensor(w)).sum() for o, w in zip(outputs, comp.weights))
    wrt = [tensors[n] for n in c.float_inputs]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    for name, t, g in zip(c.float_inputs, wrt, grads):
        expected = np.zeros(t.shape) if g is None else g.numpy()
        np.testing.assert_allclose(comp.grads[name], expected, rtol=c.torch_rtol, atol=c.torch_atol, err_msg=f"{case_id}: d loss / d {name}")


# ---------------------------------------------------------------------------------------
# Coverage of the rule registry
# ---------------------------------------------------------------------------------------


def _builtin(op_type: str) -> bool:
    """Op types ranvier itself defines (tests may register their own)."""
    return all_ops()[op_type].infer.__module__.startswith("ranvier.")


def test_every_op_has_a_rule_or_is_declared_non_differentiable():
    builtin = {t for t in all_ops() if _builtin(t)}
    rules = {t for t in builtin if autodiff.has_vjp(t)}
    missing = sorted(t for t in builtin if t not in rules and t not in NON_DIFFERENTIABLE)
    assert not missing, f"op types with neither a VJP rule nor a place in NON_DIFFERENTIABLE: {missing}"
    assert builtin >= NON_DIFFERENTIABLE, f"unknown op types in NON_DIFFERENTIABLE: {sorted(NON_DIFFERENTIABLE - builtin)}"
    stale = sorted(NON_DIFFERENTIABLE & rules)
    assert not stale, f"op types with a VJP rule listed as non-differentiable: {stale}"


def test_every_rule_is_covered_by_a_case():
    covered = set()
    for c in CASES:
        flow = m.Flow()
        _build(flow, "f", c)
        covered |= {op.type for op in flow.func("f").ops}
    rules = {t for t in all_ops() if _builtin(t) and autodiff.has_vjp(t)}
    assert not rules - covered, f"VJP rules without a test case: {sorted(rules - covered)}"


# ---------------------------------------------------------------------------------------
# Semantics
# ---------------------------------------------------------------------------------------


def _run(flow, func, feeds, fetch):
    net = m.Compiler().compile(flow)
    inst = net.cell(func).instance()
    for t, v in feeds.items():
        inst[t][...] = v
    inst.compute()
    return {k: inst[t].copy() for k, t in fetch.items()}


def test_multiple_uses_accumulate():
    xv = normal(3, 4)
    flow = m.Flow()
    f = m.Builder(flow, "f")
    x = f.var("x", F64, [3, 4])
    loss = (x * x + x).sum()
    h = x.tanh()
    loss2 = (h * h + h * x).sum()
    grads = gradient(flow, "f", [x], loss=loss)
    grads2 = gradient(flow, "f", [x], loss=loss2)
    out = _run(flow, "f", {x: xv}, {"g": grads["f/x"], "g2": grads2["f/x"]})
    np.testing.assert_allclose(out["g"], 2 * xv + 1, rtol=1e-12)
    t = np.tanh(xv)
    np.testing.assert_allclose(out["g2"], (2 * t + xv) * (1 - t * t) + t, rtol=1e-12)


def test_broadcasts_are_summed_back():
    xv, yv, sv, mv, w = normal(3, 1), normal(1, 4), normal(), normal(2, 3), normal(3, 4)
    flow = m.Flow()
    f = m.Builder(flow, "f")
    x, y, s, mm = f.var("x", F64, [3, 1]), f.var("y", F64, [1, 4]), f.var("s", F64, []), f.var("m", F64, [2, 3])
    loss = ((x + y) * f.array("w", w)).sum() + (s * mm).sum()
    grads = gradient(flow, "f", [x, y, s, mm], loss=loss)
    out = _run(flow, "f", {x: xv, y: yv, s: sv, mm: mv}, dict(grads.items()))
    assert out["f/x"].shape == (3, 1) and out["f/y"].shape == (1, 4) and out["f/s"].shape == ()
    np.testing.assert_allclose(out["f/x"], w.sum(axis=1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(out["f/y"], w.sum(axis=0, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(out["f/s"], mv.sum(), rtol=1e-12)
    np.testing.assert_allclose(out["f/m"], np.full((2, 3), sv), rtol=1e-12)


def test_binary_min_max_ties_go_to_the_first_operand():
    """Maximum/Minimum give a tie's whole gradient to the first operand (TensorFlow's
    convention; PyTorch splits it 0.5/0.5). The Max/Min reductions split ties equally."""
    av, cv = np.array([1.0, 2.0, 3.0, -1.0]), np.array([1.0, 1.0, 3.0, 0.0])
    flow = m.Flow()
    f = m.Builder(flow, "f")
    a, c = f.var("a", F64, [4]), f.var("c", F64, [4])
    gmax = gradient(flow, "f", [a, c], loss=f.maximum(a, c).sum())
    gmin = gradient(flow, "f", [a, c], loss=f.minimum(a, c).sum())
    out = _run(flow, "f", {a: av, c: cv}, {"max_a": gmax["f/a"], "max_c": gmax["f/c"], "min_a": gmin["f/a"], "min_c": gmin["f/c"]})
    np.testing.assert_array_equal(out["max_a"], [1, 1, 1, 0])
    np.testing.assert_array_equal(out["max_c"], [0, 0, 0, 1])
    np.testing.assert_array_equal(out["min_a"], [1, 0, 1, 1])
    np.testing.assert_array_equal(out["min_c"], [0, 1, 0, 0])


def test_unreachable_wrt_gets_zeros():
    flow = m.Flow()
    f = m.Builder(flow, "f")
    x, y, s = f.var("x", F64, [2, 3]), f.var("y", F64, [4]), f.var("s", F64, [])
    loss = (x * x).sum()
    grads = gradient(flow, "f", [x, y, s], loss=loss)
    xv = normal(2, 3)
    out = _run(flow, "f", {x: xv}, grads)  # y and s are read by no op of the cell
    np.testing.assert_allclose(out["f/x"], 2 * xv, rtol=1e-12)
    assert out["f/y"].shape == (4,) and out["f/s"].shape == ()
    np.testing.assert_array_equal(out["f/y"], 0.0)
    np.testing.assert_array_equal(out["f/s"], 0.0)


def _two_paths():
    """loss = sum((x @ W)^2) + sum(x^2): a path through h = x @ W and one around it."""
    flow = m.Flow()
    f = m.Builder(flow, "f")
    x = f.var("x", F64, [3, 4])
    W = f.parameter("W", normal(4, 2))
    h = x @ W
    loss = (h * h).sum() + (x * x).sum()
    return flow, x, W, h, loss


def test_nogradient_variable_flag_stops_gradients():
    xv = normal(3, 4)
    flow, x, W, h, loss = _two_paths()
    h.var.nogradient = True
    grads = gradient(flow, "f", [x, W], loss=loss)
    out = _run(flow, "f", {x: xv}, grads)
    np.testing.assert_allclose(out["f/x"], 2 * xv, rtol=1e-12)  # only the path around h
    np.testing.assert_array_equal(out["f/W"], 0.0)

    # On an input: nothing reaches it, even though it was asked for.
    flow, x, W, h, loss = _two_paths()
    x.var.nogradient = True
    grads = gradient(flow, "f", [x, W], loss=loss)
    out = _run(flow, "f", {x: xv}, grads)
    np.testing.assert_array_equal(out["f/x"], 0.0)
    np.testing.assert_allclose(out["f/W"], 2 * xv.T @ (xv @ flow.var("f/W").data), rtol=1e-12)


def test_nogradient_op_flag_stops_gradients():
    xv = normal(3, 4)
    flow, x, W, h, loss = _two_paths()
    h.producer.nogradient = True
    grads = gradient(flow, "f", [x, W], loss=loss)
    out = _run(flow, "f", {x: xv}, grads)
    np.testing.assert_allclose(out["f/x"], 2 * xv, rtol=1e-12)
    np.testing.assert_array_equal(out["f/W"], 0.0)


def test_stop_frontier():
    xv = normal(3, 4)
    flow, x, W, h, loss = _two_paths()
    Wv = flow.var("f/W").data
    grads = gradient(flow, "f", [x, W], loss=loss, stop=[h])
    # A stopped variable asked for (a wrt variable) still gets its gradient.
    grads_h = gradient(flow, "f", [h], loss=loss, stop=[h])
    out = _run(flow, "f", {x: xv}, {**grads, **grads_h})
    np.testing.assert_allclose(out["f/x"], 2 * xv, rtol=1e-12)
    np.testing.assert_array_equal(out["f/W"], 0.0)
    np.testing.assert_allclose(out[h.name], 2 * xv @ Wv, rtol=1e-12)


def test_wrt_variables_depending_on_each_other_get_full_gradients():
    xv = normal(3, 4)
    flow, x, _W, h, loss = _two_paths()
    Wv = flow.var("f/W").data
    grads = gradient(flow, "f", [x, h], loss=loss)
    out = _run(flow, "f", {x: xv}, grads)
    np.testing.assert_allclose(out[h.name], 2 * xv @ Wv, rtol=1e-12)
    np.testing.assert_allclose(out["f/x"], 2 * xv + 2 * xv @ Wv @ Wv.T, rtol=1e-12)


if not has_op("VjpTestCube"):
    define(
        "VjpTestCube",
        lambda ctx: [TensorType(ctx.inputs[0].dtype, ctx.inputs[0].shape)],
        lambda attrs, args, outs: [np.asarray(args[0], np.float64) ** 3],
        1,
        "test",
        "x^3, a user op for the autodiff tests",
    )


def _cube_flow():
    flow = m.Flow()
    f = m.Builder(flow, "f")
    x = f.var("x", F64, [2, 3])
    y = f.op("VjpTestCube", [x.tanh()], name="cube")
    return flow, x, y.sum()


def test_op_without_rule_raises_unknown_op_error():
    assert not autodiff.has_vjp("VjpTestCube")
    flow, x, loss = _cube_flow()
    with pytest.raises(m.UnknownOpError) as error:
        gradient(flow, "f", [x], loss=loss)
    assert "VjpTestCube" in str(error.value) and "f/cube" in str(error.value)


def test_user_registered_vjp():
    @vjp("VjpTestCube")
    def _cube(ctx, g):
        (x,) = ctx.inputs
        return [g[0] * (x * x) * 3.0]

    try:
        assert autodiff.has_vjp("VjpTestCube")
        xv = normal(2, 3)
        flow, x, loss = _cube_flow()
        grads = gradient(flow, "f", [x], loss=loss)
        out = _run(flow, "f", {x: xv}, grads)
        t = np.tanh(xv)
        np.testing.assert_allclose(out["f/x"], 3 * t**2 * (1 - t**2), rtol=1e-12)
    finally:
        op_def("VjpTestCube").vjp = None


def _small_net(seed=7):
    """A small classifier; returns (flow, x, params, h, loss, feeds)."""
    r = np.random.default_rng(seed)
    flow = m.Flow()
    f = m.Builder(flow, "f")
    x = f.var("x", F64, [5, 4])
    t = f.var("t", m.DT_INT32, [5])
    W1, b1 = f.parameter("W1", r.standard_normal((4, 6))), f.parameter("b1", r.standard_normal(6))
    W2 = f.parameter("W2", r.standard_normal((6, 3)))
    h = (x @ W1 + b1).tanh()
    loss = (h @ W2).softmax_cross_entropy(t).mean(name="loss")
    feeds = {x: r.standard_normal((5, 4)), t: r.integers(0, 3, 5).astype(np.int32)}
    return flow, x, [W1, b1, W2], h, loss, feeds


def test_backward_and_backward_from_agree_with_gradient():
    flow, _x, params, _h, loss, feeds = _small_net()
    reference = _run(flow, "f", feeds, gradient(flow, "f", params, loss=loss))

    flow, _x, params, _h, loss, feeds = _small_net()
    got = _run(flow, "f", feeds, backward(loss, params))
    for name in reference:
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-12, atol=1e-15)

    # Seeded at an intermediate with d loss / d h, computed by a first pass.
    flow, _x, params, h, loss, feeds = _small_net()
    gh = gradient(flow, "f", [h], loss=loss)[h.name]
    dh = _run(flow, "f", feeds, {"dh": gh})["dh"]
    flow, _x, params, h, loss, feeds = _small_net()
    seed = m.Builder(flow, "f").var("dh", F64, h.shape)
    got = _run(flow, "f", {**feeds, seed: dh}, backward_from(seed, h, params))
    for name in ("f/W1", "f/b1"):
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(got["f/W2"], 0.0)  # W2 comes after h: nothing flows to it from h

    # A number as the seed scales every gradient.
    flow, _x, params, _h, loss, feeds = _small_net()
    got = _run(flow, "f", feeds, backward_from(3.0, loss, params))
    for name in reference:
        np.testing.assert_allclose(got[name], 3.0 * reference[name], rtol=1e-12, atol=1e-15)


def test_loss_scale_multiplies_gradients():
    flow, _x, params, _h, loss, feeds = _small_net()
    reference = _run(flow, "f", feeds, backward(loss, params))
    flow, _x, params, _h, loss, feeds = _small_net()
    scaled = _run(flow, "f", feeds, backward(loss, params, loss_scale=1024.0))
    for name in reference:
        assert np.abs(reference[name]).max() > 0
        np.testing.assert_allclose(scaled[name], 1024.0 * reference[name], rtol=1e-12, atol=1e-15)


def test_seed_tensor_must_have_the_loss_shape():
    flow, _x, params, h, _loss, _feeds = _small_net()
    seed = m.Builder(flow, "f").var("bad_seed", F64, [5, 7])
    with pytest.raises(m.RanvierError, match="shape"):
        backward_from(seed, h, params)


def test_loss_defaults_to_the_only_output():
    flow = m.Flow()
    f = m.Builder(flow, "f")
    x = f.var("x", F64, [3])
    (x * x).sum()
    grads = gradient(flow, "f", [x])
    xv = normal(3)
    np.testing.assert_allclose(_run(flow, "f", {x: xv}, grads)["f/x"], 2 * xv, rtol=1e-12)
    x.exp()  # a second output
    with pytest.raises(m.RanvierError, match="outputs"):
        gradient(flow, "f", [x])


def _deep_net(into=None):
    """A chain of elementwise ops, so the forward cell's memory plan reuses dead storage."""
    flow, x, params, h, loss, feeds = _small_net(seed=11)
    z = h
    for _ in range(4):
        z = (z * 1.5).sin() + z.tanh()
    extra = (z * z).mean()
    total = loss + extra
    grads = gradient(flow, "f", [x, *params], loss=total, into=into)
    return flow, x, total, grads, feeds


def test_separate_gradient_function():
    flow, x, _total, fused_grads, feeds = _deep_net()
    fused = _run(flow, "f", feeds, fused_grads)

    flow, x, _total, grads, feeds = _deep_net(into="gradients/f")
    net = m.Compiler().compile(flow)
    assert set(net.cells) == {"f", "gradients/f"}
    gcell = net.cell("gradients/f")
    assert gcell.func.backprop
    # Everything the gradient cell reads of the forward pass comes from the primal instance.
    assert "input" not in gcell.roles.values(), gcell.roles
    forward = net.cell("f").instance()
    for t, v in feeds.items():
        forward[t][...] = v
    forward.compute()
    backward_instance = gcell.instance(primal=forward)
    backward_instance.compute()
    for name, g in grads.items():
        np.testing.assert_allclose(backward_instance[g], fused[name], rtol=1e-12, atol=1e-15, err_msg=name)

    # New inputs: the gradient cell follows its primal.
    forward[x][...] = feeds[x] * -0.5
    forward.compute()
    backward_instance.compute()
    flow2, x2, _, fused_grads2, feeds2 = _deep_net()
    fused2 = _run(flow2, "f", {**feeds2, x2: feeds2[x2] * -0.5}, fused_grads2)
    for name, g in grads.items():
        np.testing.assert_allclose(backward_instance[g], fused2[name], rtol=1e-12, atol=1e-15, err_msg=name)

    with pytest.raises(m.RanvierError, match="primal"):
        gcell.instance().compute()


def _attention_net(into=None):
    flow = m.Flow()
    f = m.Builder(flow, "f")
    q, k, v = (f.var(name, F64, [2, 4, 6, 8] if name == "q" else [2, 2, 6, 8]) for name in "qkv")
    out = f.attention(q, k, v)
    loss = (out * out.tanh()).sum()
    grads = gradient(flow, "f", [q, k, v], loss=loss, into=into)
    rng = np.random.default_rng(5)
    feeds = {x: rng.standard_normal(x.shape) for x in (q, k, v)}
    return flow, grads, feeds


def test_attention_gradient_turns_the_forwards_statistics_on_in_a_separate_gradient_function():
    """The rule gives the forward's Attention its statistics output, which the gradient cell
    reads from its primal instance, as it reads the forward's output: the gradients are the
    fused training function's, and the forward computes each row's log-sum-exp once."""
    flow, grads, feeds = _attention_net()
    fused = _run(flow, "f", feeds, grads)
    flow, grads, feeds = _attention_net(into="gradients/f")
    (attention,) = [op for op in flow.func("f").ops if op.type == "Attention"]
    assert len(attention.outputs) == 2 and attention.attr("statistics") == "1"
    net = m.Compiler().compile(flow)
    forward = net.cell("f").instance()
    for t, value in feeds.items():
        forward[t][...] = value
    forward.compute()
    backward_instance = net.cell("gradients/f").instance(primal=forward)
    backward_instance.compute()
    for name, g in grads.items():
        np.testing.assert_allclose(backward_instance[g], fused[name], rtol=1e-12, atol=1e-14, err_msg=name)


# ---------------------------------------------------------------------------------------
# float32
# ---------------------------------------------------------------------------------------


def test_float32_mlp_agrees_with_float64():
    r = np.random.default_rng(3)
    xv = r.standard_normal((8, 6))
    tv = r.integers(0, 4, 8).astype(np.int32)
    values = {"W1": r.standard_normal((6, 10)) * 0.5, "b1": r.standard_normal(10) * 0.1,
              "W2": r.standard_normal((10, 4)) * 0.5, "b2": r.standard_normal(4) * 0.1}

    def run(dtype):
        flow = m.Flow()
        f = m.Builder(flow, "f")
        x = f.var("x", dtype, [8, 6])
        t = f.var("t", m.DT_INT32, [8])
        p = {n: f.parameter(n, v.astype(dtypes.to_numpy(dtype))) for n, v in values.items()}
        logits = (x @ p["W1"] + p["b1"]).gelu() @ p["W2"] + p["b2"]
        loss = logits.softmax_cross_entropy(t).mean()
        grads = gradient(flow, "f", [x, *p.values()], loss=loss)
        for g in grads.values():
            assert g.dtype == dtype
        return _run(flow, "f", {x: xv.astype(dtypes.to_numpy(dtype)), t: tv}, grads)

    g64, g32 = run(F64), run(F32)
    for name in g64:
        assert g32[name].dtype == np.float32
        np.testing.assert_allclose(g32[name], g64[name], rtol=1e-4, atol=2e-6, err_msg=name)
