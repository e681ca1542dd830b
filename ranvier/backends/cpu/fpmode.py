"""The x86 floating-point control register (MXCSR) as generated code reads and sets it:
flush-to-zero (a subnormal result becomes 0) and denormals-are-zero (a subnormal input
counts as 0). An Intel core takes some hundred cycles for an arithmetic operation that
meets a subnormal; in these modes it takes none. The register belongs to a thread, so a
cell sets it around its steps and the worker pool's workers copy the caller's for each job.
"""

from __future__ import annotations

from llvmlite import ir

from ..llvm.irutil import BYTE_PTR, I32, VOID, declared

FLUSH_BITS = 0x8040  # FTZ (bit 15) and DAZ (bit 6)


def is_x86(triple: str) -> bool:
    """Whether code for this target triple runs on x86 (and so has MXCSR)."""
    return triple.startswith(("x86_64", "i386", "i686"))


def _intrinsic(module: ir.Module, name: str) -> ir.Function:
    return declared(module, name, ir.FunctionType(VOID, [BYTE_PTR]))


def read_mxcsr(b: ir.IRBuilder, into: ir.Value) -> None:
    """Store the calling thread's MXCSR into the i32 at `into`."""
    b.call(_intrinsic(b.module, "llvm.x86.sse.stmxcsr"), [b.bitcast(into, BYTE_PTR)])


def write_mxcsr(b: ir.IRBuilder, source: ir.Value) -> None:
    """Load the calling thread's MXCSR from the i32 at `source`."""
    b.call(_intrinsic(b.module, "llvm.x86.sse.ldmxcsr"), [b.bitcast(source, BYTE_PTR)])


def flushing(b: ir.IRBuilder) -> ir.Value:
    """Set flush-to-zero and denormals-are-zero on the calling thread; returns the i32 slot
    holding the MXCSR it had, for `write_mxcsr` to restore."""
    saved, flushed = b.alloca(I32), b.alloca(I32)
    read_mxcsr(b, saved)
    b.store(b.or_(b.load(saved), ir.Constant(I32, FLUSH_BITS)), flushed)
    write_mxcsr(b, flushed)
    return saved
