"""The fallback: a step whose op has no native kernel yet calls back into Python, which
runs the op's numpy reference on the instance's views. The printed cell marks such
steps `[python]`, so what still leaves native code is visible."""

from __future__ import annotations

from llvmlite import ir

from ...llvm.irutil import I64, VOID, i64
from ..codegen import CALLBACK


def python_callback(ctx, op) -> None:
    callback_type = ir.FunctionType(VOID, [I64])
    callback = ctx.b.bitcast(ctx.table_entry(CALLBACK), callback_type.as_pointer())
    ctx.b.call(callback, [i64(ctx.step_index)])
