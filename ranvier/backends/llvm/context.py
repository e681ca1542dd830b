"""What kernel emitters write with, on every LLVM backend: a context over one function
being generated, whose vocabulary is loads and stores of a variable's elements (converted
to and from the type they compute in), constants, loops, local variables and conditions.
A backend says where a variable's elements are (`pointer`), how wide its vectors are
(`lanes_for`), how a kernel reports bad data (`fail`) and how a row kernel's passes
split a row (`row_fold`, `row_each`): the CPU's step functions reach variables through
the cell's pointer table and pass over a row in vectors, a GPU kernel reaches them
through its parameters and may split a row over a block's threads. Kernels written in
this vocabulary alone (row kernels, reductions) serve both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from llvmlite import ir

from ... import dtypes
from ...flow.graph import Variable
from .convert import narrow, widen
from .irutil import compute_type, constant, i64, load, storage_type, store, vector_of
from .loops import fold, for_vectors
from .values import Local, Value, index_value, lane_numbers, loop


class EmitContext:
    """A function being generated: its module and the builder at its current block."""

    row_passes_reread_memory = False  # a row kernel's later passes find the row in cache (a CPU core's)

    def __init__(self, module: ir.Module, builder: ir.IRBuilder):
        self.module = module
        self.b = builder

    def pointer(self, var: Variable) -> ir.Value:
        """A pointer to `var`'s elements, typed by how its dtype is stored."""
        raise NotImplementedError

    def lanes_for(self, dtypes_: list[str]) -> int:
        """Vector width for a loop touching these dtypes."""
        raise NotImplementedError

    def fail(self, condition: Value | ir.Value) -> None:
        """Report bad data (an index out of range) when `condition` holds; the runtime raises."""
        raise NotImplementedError

    def row_fold(self, start: Value | int, length: int | Value, lanes: int, dtype: str, initial, combine, term) -> Value:
        """`combine` over `term(index, width)` along a row of `length` from `start` (a row
        kernel's pass, `rows.Row`): here in vectors of `lanes`, then the lanes folded."""
        return fold(self, start, length, lanes, dtype, initial, combine, term)

    def row_peak_and_exp_sum(self, start: Value | int, length: int | Value, lanes: int, dtype: str, read) -> tuple[Value, Value]:
        """A row's maximum and Σ exp(x − max) of `read(index, width)`: here two passes, the
        maximum then the sum, each exponential computed once."""
        peak = self.row_fold(start, length, lanes, dtype, -math.inf, lambda a, x: (x > a).where(x, a), read)
        total = self.row_fold(start, length, lanes, dtype, 0.0, lambda a, x: a + x,
                              lambda i, w: (read(i, w) - peak.splat(w)).exp())
        return peak, total

    def row_each(self, start: Value | int, length: int | Value, lanes: int, body) -> None:
        """`body(index, width)` over a row (a row kernel's last pass): here in vectors."""
        for_vectors(self, start, length, lanes, body)

    def index(self, value: Value | ir.Value | int) -> Value:
        """An int64 Value: loop counters, offsets, sizes."""
        return value if isinstance(value, Value) else index_value(self.b, value)

    def constant(self, dtype: str, value, lanes: int = 1) -> Value:
        return Value(self.b, constant(vector_of(compute_type(dtype), lanes), value), dtype)

    def element_pointer(self, var: Variable, at: Value | int) -> ir.Value:
        """A pointer to element `at` of `var`."""
        return self.b.gep(self.pointer(var), [ir_of(at)])

    def load(self, var: Variable, at: Value | int, lanes: int = 1) -> Value:
        """`lanes` elements of `var` from element `at`, in the type they compute in."""
        raw = load(self.b, self.pointer(var), ir_of(at), storage_type(var.dtype), lanes)
        return Value(self.b, widen(self.b, raw, var.dtype, lanes), var.dtype)

    def store(self, var: Variable, at: Value | int, value: Value | float) -> None:
        """Write `value` (rounded to how `var` is stored) at element `at` of `var`."""
        value = value if isinstance(value, Value) else self.constant(var.dtype, value)
        narrowed = narrow(self.b, value.ir, var.dtype, value.lanes)
        store(self.b, narrowed, self.pointer(var), ir_of(at), storage_type(var.dtype), value.lanes)

    def copy(self, source: Variable, source_at: Value | int, target: Variable, target_at: Value | int, lanes: int = 1) -> None:
        """Move `lanes` elements bit for bit (same dtype; nothing converted or rounded)."""
        element = storage_type(source.dtype)
        raw = load(self.b, self.pointer(source), ir_of(source_at), element, lanes)
        store(self.b, raw, self.pointer(target), ir_of(target_at), element, lanes)

    @contextmanager
    def loop(self, start: Value | int, stop: Value | int, step: int = 1, name: str = "i") -> Iterator[Value]:
        """`for (i = start; i < stop; i += step)` with an int64 Value i; the body is the with-block."""
        with loop(self.b, start, stop, step, name) as i:
            yield i

    def local(self, dtype: str, lanes: int = 1, initial=None) -> Local:
        """A variable of the kernel (an accumulator, a running maximum)."""
        with self.b.goto_entry_block():
            slot = self.b.alloca(vector_of(compute_type(dtype), lanes))
        result = Local(self.b, slot, dtype)
        if initial is not None:
            result.set(initial if isinstance(initial, Value) else self.constant(dtype, initial, lanes))
        return result

    def lane_numbers(self, lanes: int) -> Value:
        """The int64 vector [0, 1, ..., lanes - 1] (0 for a scalar)."""
        if lanes == 1:
            return self.index(0)
        return lane_numbers(self.b, lanes)

    def array(self, dtype: str, count: int) -> Array:
        """A scratch array of `count` scalars on the step's stack."""
        with self.b.goto_entry_block():
            base = self.b.alloca(compute_type(dtype), size=i64(count))
        return Array(self.b, base, dtype)

    def when(self, condition: Value):
        """`if (condition)`: the body is the with-block."""
        return self.b.if_then(condition.ir)


class Array:
    """Scalars in the step's stack frame: `.load(i)`, `.store(i, value)`."""

    def __init__(self, b: ir.IRBuilder, base: ir.Value, dtype: str):
        self.b, self.base, self.dtype = b, base, dtype

    def load(self, at: Value | int) -> Value:
        return Value(self.b, self.b.load(self.b.gep(self.base, [ir_of(at)])), self.dtype)

    def store(self, at: Value | int, value: Value) -> None:
        self.b.store(value.ir, self.b.gep(self.base, [ir_of(at)]))


def ir_of(value) -> ir.Value:
    """The IR of a Value, an IR value itself, or an i64 constant for a Python int."""
    if isinstance(value, Value):
        return value.ir
    if isinstance(value, int):
        return i64(value)
    return value


def load_index(ctx: EmitContext, var: Variable, position: Value | int) -> Value:
    """Element `position` of an integer variable, as int64."""
    return ctx.load(var, position).cast(dtypes.DT_INT64)


def check_range(ctx: EmitContext, index: Value, rows: int) -> Value:
    """Whether 0 <= index < rows; when not, the kernel reports it (`fail`: the runtime raises)."""
    bad = (index < 0) | (index >= rows)
    ctx.fail(bad)
    return ~bad
