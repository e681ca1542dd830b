"""IR values with operators: kernels written as their math.

A `Value` is an LLVM value of a ranvier dtype, a scalar or a vector of lanes, in the
type arithmetic runs in (half precision computes in float32, bool is i1). Operators
pick the instruction for the dtype (fadd or add, signed or unsigned compares) and
Python numbers become constants of the other operand's dtype, so a kernel reads like
its formula:

    e = (x - peak.splat(lanes)).exp()
    y = (x < 0).where(0, x)

The methods are the vocabulary of elementwise formulas (`ranvier.ops`): the same
expression builds ops on a Builder's Tensors and generates code on Values. Semantics
follow the numpy references: NaN propagates through minimum, maximum and relu, integer
division truncates toward zero (x / 0 is 0), rounding is half to even.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, overload

from llvmlite import ir

from ... import dtypes
from . import mathlib
from .convert import cast
from .irutil import I32, compute_type, constant, for_range, intrinsic, is_signed, vector_of

Number = int | float | bool

_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


class Value:
    """An IR value of dtype `dtype` (scalar or vector), emitted through builder `b`."""

    __slots__ = ("b", "dtype", "ir")
    __array_ufunc__ = None  # numpy scalars defer to our reflected operators

    def __init__(self, b: ir.IRBuilder, value: ir.Value, dtype: str):
        self.b = b
        self.ir = value
        self.dtype = dtype

    # ---- shape and constants ----------------------------------------------------------

    @property
    def lanes(self) -> int:
        t = self.ir.type
        return t.count if isinstance(t, ir.VectorType) else 1

    @property
    def is_float(self) -> bool:
        return dtypes.is_float(self.dtype)

    def constant(self, value: Number, dtype: str | None = None) -> Value:
        """A constant of this value's lanes, of `dtype` (default: this value's)."""
        dtype = dtype or self.dtype
        return Value(self.b, constant(vector_of(compute_type(dtype), self.lanes), value), dtype)

    def like(self, x: Value | Number) -> Value:
        """`x` as a Value: Python numbers become constants of this value's dtype and lanes."""
        return x if isinstance(x, Value) else self.constant(x)

    def splat(self, lanes: int) -> Value:
        """This scalar repeated over `lanes` lanes (itself when lanes is 1)."""
        if lanes == 1 or self.lanes == lanes:
            return self
        vtype = ir.VectorType(self.ir.type, lanes)
        single = self.b.insert_element(ir.Constant(vtype, ir.Undefined), self.ir, ir.Constant(I32, 0))
        mask = ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
        return self._new(self.b.shuffle_vector(single, ir.Constant(vtype, ir.Undefined), mask))

    def lane(self, index: int | Value) -> Value:
        """One lane of a vector (lane `index`, a number or an integer Value), as a scalar."""
        at = index.ir if isinstance(index, Value) else ir.Constant(ir.IntType(64), index)
        return Value(self.b, self.b.extract_element(self.ir, at), self.dtype)

    def zeros(self) -> Value:
        """Zeros of this value's type (a vector of one lane too)."""
        return self._new(ir.Constant(self.ir.type, None))

    def halves(self) -> tuple[Value, Value]:
        """A vector's low and high halves of lanes (its lane count even)."""
        half = self.lanes // 2
        return self.shuffle(list(range(half))), self.shuffle(list(range(half, self.lanes)))

    def shuffle(self, lanes: list[int], other: Value | None = None) -> Value:
        """A vector of this one's lanes picked by index; indices from this value's lane
        count on pick `other`'s lanes (a vector of the same type)."""
        mask = ir.Constant(ir.VectorType(I32, len(lanes)), lanes)
        second = other.ir if other is not None else ir.Constant(self.ir.type, ir.Undefined)
        return self._new(self.b.shuffle_vector(self.ir, second, mask))

    def _new(self, value: ir.Value, dtype: str | None = None) -> Value:
        return Value(self.b, value, dtype or self.dtype)

    def _call(self, name: str, *args: Value) -> Value:
        return self._new(self.b.call(intrinsic(self.b.module, name, self.ir.type), [self.ir, *(a.ir for a in args)]))

    # ---- arithmetic -----------------------------------------------------------------------

    def __add__(self, other):
        other = self.like(other)
        return self._new(self.b.fadd(self.ir, other.ir) if self.is_float else self.b.add(self.ir, other.ir))

    def __radd__(self, other):
        return self.like(other) + self

    def __sub__(self, other):
        other = self.like(other)
        return self._new(self.b.fsub(self.ir, other.ir) if self.is_float else self.b.sub(self.ir, other.ir))

    def __rsub__(self, other):
        return self.like(other) - self

    def __mul__(self, other):
        other = self.like(other)
        return self._new(self.b.fmul(self.ir, other.ir) if self.is_float else self.b.mul(self.ir, other.ir))

    def __rmul__(self, other):
        return self.like(other) * self

    def __truediv__(self, other):
        other = self.like(other)
        if self.is_float:
            return self._new(self.b.fdiv(self.ir, other.ir))
        return self._integer_division(other)

    def __rtruediv__(self, other):
        return self.like(other) / self

    def mul_add(self, factor: Value | Number, addend: Value | Number) -> Value:
        """self · factor + addend, one fused multiply-add (one rounding) where the target has
        FMA: a dot product's step, written once for the GPU and for its host emulator."""
        if not self.is_float:
            return self * factor + addend
        return self._call("fmuladd", self.like(factor), self.like(addend))

    def fma(self, factor: Value | Number, addend: Value | Number) -> Value:
        """self · factor + addend rounded once, always (llvm.fma: a call to the C library
        per lane where the target has no FMA; `mul_add` is the one that may round twice)."""
        return self._call("fma", self.like(factor), self.like(addend))

    def __neg__(self):
        return self._new(self.b.fneg(self.ir) if self.is_float else self.b.neg(self.ir))

    def _integer_division(self, other: Value) -> Value:
        """Division as the reference computes it, without the hardware trap: x/0 is 0 and
        MIN/−1 wraps to MIN (sdiv/udiv of either is undefined and raises SIGFPE on x86)."""
        zero, one = self.constant(0), self.constant(1)
        by_zero = other.equal(zero)
        if not is_signed(self.dtype):
            return by_zero.where(zero, self._new(self.b.udiv(self.ir, by_zero.where(one, other).ir)))
        by_minus_one = other.equal(-1)
        safe = (by_zero | by_minus_one).where(one, other)
        quotient = self._new(self.b.sdiv(self.ir, safe.ir))
        return by_zero.where(zero, by_minus_one.where(-self, quotient))

    def __floordiv__(self, other):
        """Integer quotient, for the non-negative integers of index arithmetic (udiv)."""
        return self._new(self.b.udiv(self.ir, self.like(other).ir))

    def __mod__(self, other):
        """Integer remainder, for the non-negative integers of index arithmetic (urem)."""
        return self._new(self.b.urem(self.ir, self.like(other).ir))

    def fmod(self, other) -> Value:
        """The remainder of self / other truncated toward zero, of self's sign (C's fmod:
        frem, exact on the CPU; NVPTX lowers it as x − y·trunc(x/y), exact while the
        quotient fits the mantissa), as the reference computes it without the hardware
        trap: an integer x % 0 is 0, as is MIN % −1 (srem of either raises SIGFPE on x86)."""
        other = self.like(other)
        if self.is_float:
            return self._new(self.b.frem(self.ir, other.ir))
        zero, one = self.constant(0), self.constant(1)
        if not is_signed(self.dtype):
            by_zero = other.equal(zero)
            return by_zero.where(zero, self._new(self.b.urem(self.ir, by_zero.where(one, other).ir)))
        trivial = other.equal(zero) | other.equal(-1)
        return trivial.where(zero, self._new(self.b.srem(self.ir, trivial.where(one, other).ir)))

    # ---- comparisons and logic ---------------------------------------------------------------

    def _compare(self, kind: str, other) -> Value:
        other = self.like(other)
        predicate = _COMPARE[kind]
        if self.is_float:
            # Ordered: a comparison with NaN is false; "not equal" is unordered (NaN ≠ NaN).
            compare = self.b.fcmp_unordered if kind == "ne" else self.b.fcmp_ordered
        else:
            signed = is_signed(self.dtype)
            compare = self.b.icmp_signed if signed else self.b.icmp_unsigned
        return self._new(compare(predicate, self.ir, other.ir), dtypes.DT_BOOL)

    def __lt__(self, other):
        return self._compare("lt", other)

    def __le__(self, other):
        return self._compare("le", other)

    def __gt__(self, other):
        return self._compare("gt", other)

    def __ge__(self, other):
        return self._compare("ge", other)

    def equal(self, other) -> Value:
        return self._compare("eq", other)

    def not_equal(self, other) -> Value:
        return self._compare("ne", other)

    def __and__(self, other):
        return self._new(self.b.and_(self.ir, self.like(other).ir))

    def __or__(self, other):
        return self._new(self.b.or_(self.ir, self.like(other).ir))

    def __xor__(self, other):
        return self._new(self.b.xor(self.ir, self.like(other).ir))

    def __invert__(self):
        return self._new(self.b.not_(self.ir))

    def shift_left(self, amount) -> Value:
        """The integer's bits moved up by `amount`, zeros shifted in, the top ones lost
        (shl). A shift by the width or more, or by a negative amount, gives 0 (ONNX's
        BitShift), where shl's result would be poison."""
        if isinstance(amount, int) and 0 <= amount < dtypes.itemsize(self.dtype) * 8:  # in range: shl itself
            return self._new(self.b.shl(self.ir, self.like(amount).ir))
        amount = self.like(amount)
        inside = (amount >= 0) & (amount < dtypes.itemsize(self.dtype) * 8)
        return inside.where(self._new(self.b.shl(self.ir, inside.where(amount, 0).ir)), 0)

    def shift_right(self, amount) -> Value:
        """The integer's bits moved down by `amount`: copies of the sign bit shifted in for
        signed dtypes (ashr), zeros for unsigned ones (lshr). A shift outside [0, width)
        leaves only what is shifted in: −1 or 0 by the sign, 0 unsigned."""
        width = dtypes.itemsize(self.dtype) * 8
        if isinstance(amount, int) and 0 <= amount < width:  # in range: ashr or lshr itself
            shift = self.b.ashr if is_signed(self.dtype) else self.b.lshr
            return self._new(shift(self.ir, self.like(amount).ir))
        amount = self.like(amount)
        inside = (amount >= 0) & (amount < width)
        if is_signed(self.dtype):
            return self._new(self.b.ashr(self.ir, inside.where(amount, width - 1).ir))
        return inside.where(self._new(self.b.lshr(self.ir, inside.where(amount, 0).ir)), 0)

    def where(self, if_true: Any, if_false: Any) -> Any:
        """self ? if_true : if_false, for a bool condition; a number takes the other's dtype.
        Between two pointers (`pointers.Pointer`), one of them."""
        if not isinstance(if_true, (int, float)):  # a Value or a pointer
            like = if_true
        elif not isinstance(if_false, (int, float)):
            like = if_false
        else:
            raise TypeError("where() needs at least one Value to know the result's dtype; make a constant with x.constant()")
        yes, no = like.like(if_true), like.like(if_false)
        if self.lanes < yes.lanes:
            return self.splat(yes.lanes).where(yes, no)
        # A condition the same in every lane (a flag read once) chooses whole vectors: a
        # branch LLVM can take out of the loop, where a lane mask becomes blends and
        # masked stores (microcoded on AMD's cores).
        uniform = self._splat_source()
        condition = self.ir if uniform is None else uniform
        return like._new(self.b.select(condition, yes.ir, no.ir))

    def _splat_source(self) -> ir.Value | None:
        """The scalar a vector made by `splat` repeats, or None."""
        shuffle = self.ir
        if not isinstance(shuffle, ir.ShuffleVector) or any(i.constant for i in shuffle.operands[2].constant):
            return None
        single = shuffle.operands[0]
        if not isinstance(single, ir.InsertElement) or single.operands[2].constant != 0:
            return None
        return single.operands[1]

    def minimum(self, other) -> Value:
        return self._extreme(other, "lt")

    def maximum(self, other) -> Value:
        return self._extreme(other, "gt")

    def _extreme(self, other, kind: str) -> Value:
        other = self.like(other)
        chosen = self._compare(kind, other).where(self, other)  # NaN in other: other is chosen
        return self.not_equal(self).where(self, chosen) if self.is_float else chosen  # NaN in self too

    # ---- elementary functions ---------------------------------------------------------------------

    def copysign(self, sign: Value | Number) -> Value:
        """This float's magnitude with `sign`'s sign."""
        return self._call("copysign", self.like(sign))

    def abs(self) -> Value:
        if self.is_float:
            return self._call("fabs")
        if not is_signed(self.dtype):
            return self
        return (self < 0).where(-self, self)

    def sqrt(self) -> Value:
        return self._call("sqrt")

    def floor(self) -> Value:
        return self._call("floor")

    def ceil(self) -> Value:
        return self._call("ceil")

    def round(self) -> Value:
        """Half to even, as numpy."""
        return self._call("roundeven")

    def trunc(self) -> Value:
        """Toward zero."""
        return self._call("trunc")

    def _math(self, name: str) -> Value:
        return self._new(mathlib.emit(name, self).ir)

    def exp(self) -> Value:
        return self._math("exp")

    def log(self) -> Value:
        return self._math("log")

    def tanh(self) -> Value:
        return self._math("tanh")

    def sigmoid(self) -> Value:
        return self._math("sigmoid")

    def erf(self) -> Value:
        return self._math("erf")

    def sin(self) -> Value:
        return self._math("sin")

    def cos(self) -> Value:
        return self._math("cos")

    def silu(self) -> Value:
        return self._math("silu")

    # The trigonometric and hyperbolic functions of Myelin's op set, and log1p.

    def tan(self) -> Value:
        return self._math("tan")

    def cot(self) -> Value:
        return self._math("cot")

    def atan(self) -> Value:
        return self._math("atan")

    def asin(self) -> Value:
        return self._math("asin")

    def acos(self) -> Value:
        return self._math("acos")

    def asec(self) -> Value:
        return self._math("asec")

    def acsc(self) -> Value:
        return self._math("acsc")

    def sinh(self) -> Value:
        return self._math("sinh")

    def cosh(self) -> Value:
        return self._math("cosh")

    def sech(self) -> Value:
        return self._math("sech")

    def csch(self) -> Value:
        return self._math("csch")

    def log1p(self) -> Value:
        return self._math("log1p")

    def asinh(self) -> Value:
        return self._math("asinh")

    def acosh(self) -> Value:
        return self._math("acosh")

    def asech(self) -> Value:
        return self._math("asech")

    def atanh(self) -> Value:
        return self._math("atanh")

    def acoth(self) -> Value:
        return self._math("acoth")

    def gelu(self, approximate: str = "none") -> Value:
        return self._math("gelu_tanh" if approximate == "tanh" else "gelu_erf")

    def cast(self, dtype: str) -> Value:
        """This value converted to `dtype`, as numpy's astype does."""
        return Value(self.b, cast(self.b, self.ir, self.dtype, dtype, self.lanes), dtype)

    def bitcast(self, dtype: str) -> Value:
        """This value's bits read as `dtype`, as numpy's view does: a narrower dtype splits
        each lane into several (16 int32 lanes read as 32 int16), a wider one joins them."""
        source, target = compute_type(self.dtype), compute_type(dtype)
        lanes, left = divmod(self.lanes * _bits(source), _bits(target))
        if left:
            raise TypeError(f"{self.lanes} lanes of {self.dtype} are not a whole number of {dtype} lanes")
        return Value(self.b, self.b.bitcast(self.ir, vector_of(target, lanes)), dtype)

    def __repr__(self) -> str:
        return f"<Value {self.dtype}x{self.lanes}: {self.ir.type}>"


def _bits(type_: ir.Type) -> int:
    """The width of a scalar IR type in bits."""
    return type_.width if isinstance(type_, ir.IntType) else {"half": 16, "float": 32, "double": 64}[str(type_)]


def index_value(b: ir.IRBuilder, value: ir.Value | int) -> Value:
    """An int64 Value (loop counters, offsets) from an i64 IR value or a Python int."""
    return Value(b, value if isinstance(value, ir.Value) else constant(ir.IntType(64), value), dtypes.DT_INT64)


def lane_numbers(b: ir.IRBuilder, lanes: int, dtype: str = dtypes.DT_INT64) -> Value:
    """The vector [0, 1, ..., lanes - 1] of `dtype`: added to a vector's first index, each
    lane's own (to mask the lanes past a row's end)."""
    return Value(b, ir.Constant(ir.VectorType(compute_type(dtype), lanes), list(range(lanes))), dtype)


@contextmanager
def loop(b: ir.IRBuilder, start: Value | ir.Value | int, stop: Value | ir.Value | int, step: int = 1,
         name: str = "i") -> Iterator[Value]:
    """`for (i = start; i < stop; i += step)` over int64 Values; the body is the with-block."""
    first, last = (_index_ir(x) for x in (start, stop))
    with for_range(b, first, last, step, name) as index:
        yield index_value(b, index)


def _index_ir(x: Value | ir.Value | int) -> ir.Value:
    if isinstance(x, Value):
        return x.ir
    return constant(ir.IntType(64), x) if isinstance(x, int) else x


@contextmanager
def forever(b: ir.IRBuilder, name: str = "loop") -> Iterator[Callable[[Value], None]]:
    """A loop whose with-block is its body, repeated until a `leave_if(condition)` the
    with-block calls finds its condition true (a `while (true) { ... if (c) break; ... }`)."""
    head, done = b.append_basic_block(f"{name}.head"), b.append_basic_block(f"{name}.done")
    b.branch(head)
    b.position_at_end(head)

    def leave_if(condition: Value) -> None:
        rest = b.append_basic_block(f"{name}.on")
        b.cbranch(condition.ir, done, rest)
        b.position_at_end(rest)

    yield leave_if
    b.branch(head)
    b.position_at_end(done)


def choose(condition: Value, if_true: Callable[[], Any], if_false: Callable[[], Any]) -> Any:
    """condition ? if_true() : if_false(), each emitted on its own branch, so only the one
    chosen runs (a load that may not be read where the other is taken; `where` computes both)."""
    b = condition.b
    with b.if_else(condition.ir) as (yes, no):
        with yes:
            chosen = if_true()
            yes_block = b.block
        with no:
            other = if_false()
            no_block = b.block
    merged = b.phi(chosen.ir.type)
    merged.add_incoming(chosen.ir, yes_block)
    merged.add_incoming(other.ir, no_block)
    return chosen._new(merged)


@overload
def call(b: ir.IRBuilder, function: ir.Value, *arguments: Any, dtype: str) -> Value: ...


@overload
def call(b: ir.IRBuilder, function: ir.Value, *arguments: Any, dtype: None = None) -> None: ...


def call(b: ir.IRBuilder, function: ir.Value, *arguments: Any, dtype: str | None = None) -> Value | None:
    """`function` called with `arguments` (Values, pointers, IR values; a Python int as an
    int64): its result as a Value of `dtype`, or None where `dtype` is not given."""
    values = [constant(ir.IntType(64), a) if isinstance(a, int) else getattr(a, "ir", a) for a in arguments]
    result = b.call(function, values)
    return Value(b, result, dtype) if dtype is not None else None


class Local:
    """A mutable kernel variable: read `.value`, write `.set(v)`."""

    def __init__(self, b: ir.IRBuilder, slot: ir.Value, dtype: str):
        self.b, self.slot, self.dtype = b, slot, dtype

    @property
    def value(self) -> Value:
        return Value(self.b, self.b.load(self.slot), self.dtype)

    def set(self, value: Value) -> None:
        self.b.store(value.ir, self.slot)


def local(b: ir.IRBuilder, dtype: str, lanes: int = 1, initial: Value | None = None) -> Local:
    """A variable of `lanes` lanes of `dtype` on the stack, allotted where `b` is."""
    result = Local(b, b.alloca(vector_of(compute_type(dtype), lanes)), dtype)
    if initial is not None:
        result.set(initial)
    return result
