"""Small helpers for emitting LLVM IR: element types, loops, vectors and intrinsics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from llvmlite import ir

from ... import dtypes

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
F64 = ir.DoubleType()
VOID = ir.VoidType()
BYTE_PTR = I8.as_pointer()


class _BFloatType(ir.Type):
    """LLVM's bfloat type, which llvmlite does not define: the element of the AVX512-BF16
    and AMX-BF16 instructions' operands."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloatType)

    def __hash__(self) -> int:
        return hash("bfloat")


BF16 = _BFloatType()


def i64(value: int) -> ir.Constant:
    return ir.Constant(I64, int(value))


# How each dtype is stored in memory. bfloat16 travels as its 16 bits and is
# widened to float32 by hand; bool is one byte, as numpy stores it.
_STORAGE = {
    dtypes.DT_FLOAT16: ir.HalfType(),
    dtypes.DT_BFLOAT16: I16,
    dtypes.DT_FLOAT32: F32,
    dtypes.DT_FLOAT64: F64,
    dtypes.DT_INT8: I8,
    dtypes.DT_INT16: I16,
    dtypes.DT_INT32: I32,
    dtypes.DT_INT64: I64,
    dtypes.DT_UINT8: I8,
    dtypes.DT_UINT16: I16,
    dtypes.DT_UINT32: I32,
    dtypes.DT_UINT64: I64,
    dtypes.DT_BOOL: I8,
}


def storage_type(dtype: str) -> ir.Type:
    return _STORAGE[dtype]


def compute_type(dtype: str) -> ir.Type:
    """The type arithmetic runs in: half precision widens to float32, bool is i1."""
    if dtype in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16):
        return F32
    if dtype == dtypes.DT_BOOL:
        return I1
    return _STORAGE[dtype]


def is_signed(dtype: str) -> bool:
    return dtype in (dtypes.DT_INT8, dtypes.DT_INT16, dtypes.DT_INT32, dtypes.DT_INT64)


def vector_of(scalar: ir.Type, lanes: int) -> ir.Type:
    return scalar if lanes == 1 else ir.VectorType(scalar, lanes)


def splat(b: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    if lanes == 1:
        return value
    vtype = ir.VectorType(value.type, lanes)
    single = b.insert_element(ir.Constant(vtype, ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(single, ir.Constant(vtype, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))


def constant(type_: ir.Type, value) -> ir.Constant:
    """A scalar or splatted vector constant of `type_`."""
    if isinstance(type_, ir.VectorType):
        return ir.Constant(type_, [constant(type_.element, value)] * type_.count)
    if isinstance(type_, ir.IntType):
        return ir.Constant(type_, int(value))
    return ir.Constant(type_, float(value))


_FEATURES = "_ranvier_target_features"


def use_features(module: ir.Module, features: Iterable[str]) -> None:
    """Record the CPU features `module` is compiled for (LLVM names: "fma", "f16c"), so
    emitters pick instructions by them; an unmarked module gets the portable code."""
    setattr(module, _FEATURES, frozenset(features))


def has_feature(module: ir.Module, feature: str) -> bool:
    return feature in getattr(module, _FEATURES, ())


_ARITY = {"fma": 3, "fmuladd": 3, "copysign": 2, "minnum": 2, "maxnum": 2}


def declared(module: ir.Module, name: str, type_: ir.FunctionType) -> ir.Function:
    """The module's function `name`, declared at its first use."""
    existing = module.globals.get(name)
    return existing if existing is not None else ir.Function(module, type_, name=name)


def intrinsic(module: ir.Module, name: str, type_: ir.Type) -> ir.Function:
    """An overloaded LLVM intrinsic such as llvm.fma.v16f32 ("fma" or "llvm.fma" on
    <16 x float>), declared once per module."""
    base = name.removeprefix("llvm.")
    return declared(module, f"llvm.{base}.{_type_suffix(type_)}", ir.FunctionType(type_, [type_] * _ARITY.get(base, 1)))


def _type_suffix(type_: ir.Type) -> str:
    if isinstance(type_, ir.VectorType):
        return f"v{type_.count}{_type_suffix(type_.element)}"
    if isinstance(type_, ir.FloatType):
        return "f32"
    if isinstance(type_, ir.DoubleType):
        return "f64"
    if isinstance(type_, ir.HalfType):
        return "f16"
    if isinstance(type_, ir.IntType):
        return f"i{type_.width}"
    raise TypeError(f"no intrinsic suffix for {type_}")


@contextmanager
def for_range(b: ir.IRBuilder, start: ir.Value, stop: ir.Value, step: int = 1, name: str = "i") -> Iterator[ir.Value]:
    """`for (i = start; i < stop; i += step)`: the body is emitted inside the with-block."""
    pre = b.block
    header = b.append_basic_block(f"{name}.head")
    body = b.append_basic_block(f"{name}.body")
    done = b.append_basic_block(f"{name}.done")
    b.branch(header)
    b.position_at_end(header)
    index = b.phi(I64, name=name)
    index.add_incoming(start, pre)
    b.cbranch(b.icmp_signed("<", index, stop), body, done)
    b.position_at_end(body)
    yield index
    following = b.add(index, i64(step), name=f"{name}.next")
    index.add_incoming(following, b.block)
    b.branch(header)
    b.position_at_end(done)


def by_strips(b: ir.IRBuilder, m: ir.Value, height: int, strip: Callable[[ir.Value, int], None]) -> None:
    """Rows [0, m) in strips of `height` rows, `strip(first row, rows)`, then the m % height rows
    left as one strip of that many: a kernel whose tiles are unrolled per strip height calls
    each with a constant count."""
    full = b.mul(b.sdiv(m, i64(height)), i64(height))
    with for_range(b, i64(0), full, step=height, name="ir") as first:
        strip(first, height)
    left = b.sub(m, full)
    for rows in range(1, height):
        with b.if_then(b.icmp_signed("==", left, i64(rows))):
            strip(full, rows)


CACHE_LINE = 64  # bytes


def whole_lines(nbytes: int) -> int:
    """`nbytes` rounded up to whole cache lines: scratch whose parts each start on a line."""
    return -(-nbytes // CACHE_LINE) * CACHE_LINE


def cache_line_aligned(b: ir.IRBuilder, pointer: ir.Value, type_: ir.PointerType) -> ir.Value:
    """`pointer` rounded up to the next cache line (scratch whose start must be aligned:
    its allotment has a line to spare), as `type_`."""
    address = b.ptrtoint(pointer, I64)
    return b.inttoptr(b.and_(b.add(address, i64(CACHE_LINE - 1)), i64(-CACHE_LINE)), type_)


def typed_pointer(b: ir.IRBuilder, base: ir.Value, offset_elements: ir.Value, element: ir.Type, lanes: int = 1) -> ir.Value:
    """Pointer to element `offset` of a buffer, typed for loading `lanes` elements at once."""
    pointer = b.gep(base, [offset_elements])
    return b.bitcast(pointer, vector_of(element, lanes).as_pointer()) if lanes > 1 else pointer


def load(b: ir.IRBuilder, base: ir.Value, offset: ir.Value, element: ir.Type, lanes: int = 1) -> ir.Value:
    return b.load(typed_pointer(b, base, offset, element, lanes), align=1 if lanes > 1 else None)


def store(b: ir.IRBuilder, value: ir.Value, base: ir.Value, offset: ir.Value, element: ir.Type, lanes: int = 1) -> None:
    b.store(value, typed_pointer(b, base, offset, element, lanes), align=1 if lanes > 1 else None)


def transpose_square(b: ir.IRBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """An L × L block held as L vectors of L lanes, transposed in registers: one stage per
    bit of the index, each swapping that bit of the row number with the same bit of the
    column number across pairs of rows (log2 L stages of L shuffles)."""
    lanes = len(rows)
    mask_type = ir.VectorType(ir.IntType(32), lanes)
    h = 1
    while h < lanes:
        low = ir.Constant(mask_type, [c if c & h == 0 else lanes + c - h for c in range(lanes)])
        high = ir.Constant(mask_type, [c + h if c & h == 0 else lanes + c for c in range(lanes)])
        swapped = list(rows)
        for i in range(lanes):
            if i & h == 0:
                swapped[i] = b.shuffle_vector(rows[i], rows[i + h], low)
                swapped[i + h] = b.shuffle_vector(rows[i], rows[i + h], high)
        rows, h = swapped, h * 2
    return rows
