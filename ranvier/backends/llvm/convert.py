"""Conversions between how a dtype is stored and the type arithmetic runs in.

float16 converts with F16C instructions where the target has them. Without F16C
(`cpu="-avx512,-avx2"`, or an older CPU) LLVM would lower `fpext`/`fptrunc` of half
to the compiler-rt calls __extendhfsf2/__truncsfhf2, which nothing in the process
defines, so the conversions are written out in integer arithmetic instead (exact,
rounding to nearest even, and vectorizable). A kernel emitter marks its module with
`use_features(module, target.feature_set)` before emitting; an unmarked module gets the
portable code.
"""

from __future__ import annotations

from llvmlite import ir

from ... import dtypes
from .irutil import (
    BF16,
    F32,
    I1,
    I16,
    I32,
    compute_type,
    constant,
    declared,
    has_feature,
    intrinsic,
    is_signed,
    vector_of,
)


def _hardware_half(b: ir.IRBuilder) -> bool:
    return has_feature(b.module, "f16c")


def widen(b: ir.IRBuilder, value: ir.Value, dtype: str, lanes: int) -> ir.Value:
    """Stored value → compute value (half → float32, bfloat16 bits → float32, bool byte → i1)."""
    if dtype == dtypes.DT_FLOAT16:
        if _hardware_half(b):
            return b.fpext(value, vector_of(F32, lanes))
        return _half_to_float(b, value, lanes)
    if dtype == dtypes.DT_BFLOAT16:
        wide = b.shl(b.zext(value, vector_of(I32, lanes)), constant(vector_of(I32, lanes), 16))
        return b.bitcast(wide, vector_of(F32, lanes))
    if dtype == dtypes.DT_BOOL:
        return b.icmp_unsigned("!=", value, constant(value.type, 0))
    return value


def narrow(b: ir.IRBuilder, value: ir.Value, dtype: str, lanes: int) -> ir.Value:
    """Compute value → stored value, rounding to nearest even for half precision."""
    if dtype == dtypes.DT_FLOAT16:
        if _hardware_half(b):
            return b.fptrunc(value, vector_of(ir.HalfType(), lanes))
        return _float_to_half(b, value, lanes)
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
    if source == target or (src == dst and target not in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16)):
        return value
    if target in (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16) and source not in (*dtypes.INT_DTYPES, dtypes.DT_BOOL):
        # Round through the narrow type so the compute value is exactly representable.
        if source == dtypes.DT_FLOAT64 and target == dtypes.DT_FLOAT16:
            as_f32 = _round_to_odd_float(b, value, lanes)  # numpy rounds double → half once
        else:
            # ml_dtypes rounds double → bfloat16 through float32, so the reference rounds twice too.
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
        i64s = vector_of(ir.IntType(64), lanes)
        whole = b.fptosi(value, i64s)
        if target == dtypes.DT_UINT64:  # from 2^63 up, past int64: 2^63 less converted, its top bit set back
            top = constant(value.type, 2.0**63)
            high = b.xor(b.fptosi(b.fsub(value, top), i64s), constant(i64s, -(2**63)))
            whole = b.select(b.fcmp_ordered(">=", value, top), high, whole)
        return b.trunc(whole, vdst) if dst.width < 64 else whole
    if _float_bits(dst) > _float_bits(src):
        return b.fpext(value, vdst)
    return b.fptrunc(value, vdst)


def bf16_pairs(b: ir.IRBuilder, first: ir.Value, second: ir.Value, interleave: bool) -> ir.Value:
    """Two vectors of 16 floats → 16 pairs of bfloat16 (rounded to nearest even) as
    <16 x i32>, the operand of AVX512-BF16's and AMX's dot products of pairs: `first`
    then `second` (consecutive values of k), or, interleaving, (first[i], second[i]) (of
    vectors of any lanes, as many pairs). Needs AVX512-BF16; its conversions read subnormal
    floats as zero."""
    lanes = first.type.count
    if interleave:
        # Shuffled as integers: on bfloat values LLVM would move the shuffle before the
        # conversions and interleave twice as many float lanes.
        halves = [b.bitcast(b.fptrunc(v, ir.VectorType(BF16, lanes)), ir.VectorType(I16, lanes)) for v in (first, second)]
        order = [lane for i in range(lanes) for lane in (i, lanes + i)]
        pairs = b.shuffle_vector(*halves, ir.Constant(ir.VectorType(I32, 2 * lanes), order))
    else:
        # VCVTNE2PS2BF16 converts both at once, its second operand into the low half.
        both = ir.VectorType(BF16, 32)
        convert = declared(b.module, "llvm.x86.avx512bf16.cvtne2ps2bf16.512", ir.FunctionType(both, [first.type] * 2))
        pairs = b.call(convert, [second, first])
    return b.bitcast(pairs, ir.VectorType(I32, lanes))


def _float_bits(t: ir.Type) -> int:
    return 64 if isinstance(t, ir.DoubleType) else 32


def _half_to_float(b: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """Half bits → float32 exactly, subnormals, infinities and NaN included."""
    i32, f32 = vector_of(I32, lanes), vector_of(F32, lanes)
    h = b.zext(b.bitcast(value, vector_of(I16, lanes)), i32)
    sign = b.shl(b.and_(h, constant(i32, 0x8000)), constant(i32, 16))
    shifted = b.shl(b.and_(h, constant(i32, 0x7FFF)), constant(i32, 13))
    exponent = b.and_(shifted, constant(i32, 0x7C00 << 13))
    normal = b.add(shifted, constant(i32, (127 - 15) << 23))
    special = b.add(normal, constant(i32, (128 - 16) << 23))  # Inf/NaN: exponent all ones
    # A subnormal half: let the FPU renormalize m·2⁻²⁴ as (2⁻¹⁴ + m·2⁻²⁴) − 2⁻¹⁴.
    tiny = b.fsub(b.bitcast(b.add(normal, constant(i32, 1 << 23)), f32), constant(f32, 2.0**-14))
    bits = b.select(
        b.icmp_unsigned("==", exponent, constant(i32, 0x7C00 << 13)),
        special,
        b.select(b.icmp_unsigned("==", exponent, constant(i32, 0)), b.bitcast(tiny, i32), normal),
    )
    return b.bitcast(b.or_(bits, sign), f32)


def _float_to_half(b: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """float32 → half bits, rounding to nearest even; overflow gives ±Inf, NaN stays NaN."""
    i32, f32 = vector_of(I32, lanes), vector_of(F32, lanes)
    bits = b.bitcast(value, i32)
    sign = b.and_(bits, constant(i32, -0x80000000))
    magnitude = b.xor(bits, sign)
    # Too large for a half (Inf included): Inf; NaN: the quiet NaN.
    is_nan = b.icmp_unsigned(">", magnitude, constant(i32, 255 << 23))
    huge = b.select(is_nan, constant(i32, 0x7E00), constant(i32, 0x7C00))
    # Subnormal or zero: adding 0.5 lets the FPU round the low bits (to nearest even).
    magic = constant(i32, 126 << 23)
    tiny = b.sub(b.bitcast(b.fadd(b.bitcast(magnitude, f32), b.bitcast(magic, f32)), i32), magic)
    # Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
    odd = b.and_(b.lshr(magnitude, constant(i32, 13)), constant(i32, 1))
    rounded = b.add(b.add(magnitude, constant(i32, ((15 - 127) << 23) + 0xFFF)), odd)
    normal = b.lshr(rounded, constant(i32, 13))
    half = b.select(
        b.icmp_unsigned(">=", magnitude, constant(i32, (127 + 16) << 23)),
        huge,
        b.select(b.icmp_unsigned("<", magnitude, constant(i32, 113 << 23)), tiny, normal),
    )
    half = b.or_(half, b.lshr(sign, constant(i32, 16)))
    return b.bitcast(b.trunc(half, vector_of(I16, lanes)), vector_of(ir.HalfType(), lanes))


def _round_to_odd_float(b: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """double → float32 rounded to odd: truncated toward zero, with the last bit set when
    inexact. Rounding that to half (13 bits shorter) then gives the correctly rounded half,
    where rounding to nearest twice could land on the wrong side of a halfway point."""
    i32 = vector_of(I32, lanes)
    nearest = b.fptrunc(value, vector_of(F32, lanes))
    back = b.fpext(nearest, value.type)
    fabs = intrinsic(b.module, "fabs", value.type)
    bits = b.bitcast(nearest, i32)
    # One step toward zero where rounding went away from it (the bit pattern is sign-magnitude).
    away = b.fcmp_ordered(">", b.call(fabs, [back]), b.call(fabs, [value]))
    bits = b.select(away, b.sub(bits, constant(i32, 1)), bits)
    inexact = b.fcmp_ordered("!=", back, value)
    bits = b.select(inexact, b.or_(bits, constant(i32, 1)), bits)
    return b.bitcast(bits, vector_of(F32, lanes))
