"""Conversions between how a dtype is stored and the type arithmetic runs in."""

from __future__ import annotations

from llvmlite import ir

from ... import dtypes
from .irutil import F32, I1, I16, I32, compute_type, constant, is_signed, vector_of


def widen(b: ir.IRBuilder, value: ir.Value, dtype: str, lanes: int) -> ir.Value:
    """Stored value → compute value (half → float32, bfloat16 bits → float32, bool byte → i1)."""
    if dtype == dtypes.DT_FLOAT16:
        return b.fpext(value, vector_of(F32, lanes))
    if dtype == dtypes.DT_BFLOAT16:
        wide = b.shl(b.zext(value, vector_of(I32, lanes)), constant(vector_of(I32, lanes), 16))
        return b.bitcast(wide, vector_of(F32, lanes))
    if dtype == dtypes.DT_BOOL:
        return b.icmp_unsigned("!=", value, constant(value.type, 0))
    return value


def narrow(b: ir.IRBuilder, value: ir.Value, dtype: str, lanes: int) -> ir.Value:
    """Compute value → stored value, rounding to nearest even for half precision."""
    if dtype == dtypes.DT_FLOAT16:
        return b.fptrunc(value, vector_of(ir.HalfType(), lanes))
    if dtype == dtypes.DT_BFLOAT16:
        i32 = vector_of(I32, lanes)
        bits = b.bitcast(value, i32)
        lsb = b.and_(b.lshr(bits, constant(i32, 16)), constant(i32, 1))
        rounded = b.add(bits, b.add(lsb, constant(i32, 0x7FFF)))
        quiet_nan = constant(i32, 0x7FC00000)
        is_nan = b.fcmp_unordered("uno", value, value)
        bits = b.select(is_nan, quiet_nan, rounded)
        return b.trunc(b.lshr(bits, constant(i32, 16)), vector_of(I16, lanes))
    if dtype == dtypes.DT_BOOL:
        return b.zext(value, vector_of(ir.IntType(8), lanes))
    return value


def cast(b: ir.IRBuilder, value: ir.Value, source: str, target: str, lanes: int) -> ir.Value:
    """Convert a compute value of dtype `source` to a compute value of dtype `target` (numpy's astype)."""
    src, dst = compute_type(source), compute_type(target)
    vdst = vector_of(dst, lanes)
    if source == target or (src == dst and not (target in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16))):
        return value
    if target in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16) and source not in dtypes.INT_DTYPES + (dtypes.DT_BOOL,):
        # Round through the narrow type so the compute value is exactly representable.
        as_f32 = cast(b, value, source, dtypes.DT_FLOAT32, lanes)
        return widen(b, narrow(b, as_f32, target, lanes), target, lanes)
    if dst == I1:
        if isinstance(src, ir.IntType):
            return b.icmp_unsigned("!=", value, constant(value.type, 0))
        return b.fcmp_unordered("une", value, constant(value.type, 0.0))
    if src == I1:
        if isinstance(dst, ir.IntType):
            return b.zext(value, vdst)
        return b.uitofp(value, vdst)
    if isinstance(src, ir.IntType) and isinstance(dst, ir.IntType):
        if dst.width > src.width:
            return b.sext(value, vdst) if is_signed(source) else b.zext(value, vdst)
        return b.trunc(value, vdst) if dst.width < src.width else value
    if isinstance(src, ir.IntType):
        converted = b.sitofp(value, vdst) if is_signed(source) else b.uitofp(value, vdst)
        if target in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16):
            return widen(b, narrow(b, converted, target, lanes), target, lanes)
        return converted
    if isinstance(dst, ir.IntType):
        # Through int64 then truncate: what numpy's astype does on x86 for values in range.
        whole = b.fptosi(value, vector_of(ir.IntType(64), lanes))
        return b.trunc(whole, vdst) if dst.width < 64 else whole
    if _float_bits(dst) > _float_bits(src):
        return b.fpext(value, vdst)
    return b.fptrunc(value, vdst)


def _float_bits(t: ir.Type) -> int:
    return 64 if isinstance(t, ir.DoubleType) else 32
