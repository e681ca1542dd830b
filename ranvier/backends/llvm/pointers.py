"""Pointers with operators: memory reads and writes written like the math around them.

A `Pointer` is an LLVM pointer to elements of a ranvier dtype, stored as the dtype is
stored (bfloat16 as its 16 bits, bool as a byte). Adding an index steps over elements
(getelementptr); indexing reads or writes one element; `load` and `store` move one
element or a vector of them, converted to and from the type arithmetic runs in (a
bfloat16 vector loads as float32), so a kernel's memory traffic reads as

    row = a + i * lda
    total = row[p] * step + total
    (c + j).store(total.splat(lanes), align=64)

Masked loads and stores touch only the lanes a mask leaves on (a row's edge, the
padding of an image); `prefetch` asks for a cache line ahead of its use; the atomic
operations are the thread pool's.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from ... import dtypes
from .convert import widen
from .irutil import BYTE_PTR, I32, I64, VOID, compute_type, declared, i64, storage_type, vector_of
from .values import Value, index_value, loop

_ATOMIC_ORDER = "seq_cst"


class Pointer:
    """An IR pointer to elements of `dtype`, emitted through builder `b`."""

    __slots__ = ("b", "dtype", "ir")
    lanes = 1  # a pointer is one address: a condition's `where` chooses between pointers whole

    def __init__(self, b: ir.IRBuilder, pointer: ir.Value, dtype: str):
        self.b = b
        self.ir = pointer
        self.dtype = dtype

    # ---- addresses ----------------------------------------------------------------------

    def __add__(self, offset: Value | int) -> Pointer:
        """The pointer `offset` elements on (getelementptr)."""
        return self._new(self.b.gep(self.ir, [_index(self.b, offset).ir]))

    def view(self, dtype: str) -> Pointer:
        """The same address as a pointer to `dtype` elements (a bitcast where their storage differs)."""
        target = storage_type(dtype).as_pointer()
        return Pointer(self.b, self.ir if self.ir.type == target else self.b.bitcast(self.ir, target), dtype)

    def address(self) -> Value:
        """The address as an int64."""
        return index_value(self.b, self.b.ptrtoint(self.ir, I64))

    def like(self, x: Pointer) -> Pointer:
        return x

    def _new(self, pointer: ir.Value) -> Pointer:
        return Pointer(self.b, pointer, self.dtype)

    def _vector_pointer(self, lanes: int, vector: bool = False) -> ir.Value:
        element = storage_type(self.dtype)
        wanted = (ir.VectorType(element, lanes) if vector else vector_of(element, lanes)).as_pointer()
        return self.ir if self.ir.type == wanted else self.b.bitcast(self.ir, wanted)

    # ---- reads and writes ------------------------------------------------------------------

    def __getitem__(self, at: Value | int) -> Value:
        """Element `at`, as it computes (`(p + at).load()`)."""
        return (self + at).load()

    def __setitem__(self, at: Value | int, value: Value) -> None:
        (self + at).store(value)

    def load(self, lanes: int = 1, align: int | None = None, vector: bool = False) -> Value:
        """`lanes` elements from here (a scalar for 1, unless `vector`), in the type they
        compute in; `align` in bytes (None: the element's own alignment)."""
        raw = self.b.load(self._vector_pointer(lanes, vector), align=align)
        return Value(self.b, widen(self.b, raw, self.dtype, lanes), self.dtype)

    def store(self, value: Value, align: int | None = None) -> None:
        """`value` (its lanes: a vector's elements side by side) written here, bit for bit:
        it is of this pointer's dtype, or of its storage where that differs (bf16 pairs' slots)."""
        self.b.store(value.ir, self._vector_pointer(value.lanes, isinstance(value.ir.type, ir.VectorType)), align=align)

    def masked_load(self, mask: Value, others: Value | None = None, align: int = 4) -> Value:
        """A vector of `mask`'s lanes from here: memory in the lanes it leaves on, `others`'
        lanes (zeros) in the rest, which are never read (no fault past a row's end)."""
        self._stored_as_computed("masked_load")
        lanes = mask.lanes
        vector = vector_of(compute_type(self.dtype), lanes)
        function = declared(self.b.module, f"llvm.masked.load.{_suffix(vector)}.p0{_suffix(vector)}",
                            ir.FunctionType(vector, [vector.as_pointer(), I32, mask.ir.type, vector]))
        rest = others.ir if others is not None else ir.Constant(vector, None)
        loaded = self.b.call(function, [self._vector_pointer(lanes), ir.Constant(I32, align), mask.ir, rest])
        return Value(self.b, loaded, self.dtype)

    def masked_store(self, value: Value, mask: Value, align: int = 4) -> None:
        """`value`'s lanes that `mask` leaves on written here; memory under the others untouched."""
        vector = value.ir.type
        function = declared(self.b.module, f"llvm.masked.store.{_suffix(vector)}.p0{_suffix(vector)}",
                            ir.FunctionType(VOID, [vector, vector.as_pointer(), I32, mask.ir.type]))
        self.b.call(function, [value.ir, self._vector_pointer(value.lanes), ir.Constant(I32, align), mask.ir])

    def gather(self, offsets: Value, mask: Value, others: Value) -> Value:
        """Lane e: element offsets[e] from here where `mask` leaves lane e on, else `others`'
        lane (not read). `offsets` is an int32 vector."""
        self._stored_as_computed("gather")
        lanes = offsets.lanes
        wide = ir.VectorType(I64, lanes)
        element = compute_type(self.dtype)
        bytes_apart = Value(self.b, ir.Constant(wide, [i64(dtypes.itemsize(self.dtype))] * lanes), dtypes.DT_INT64)
        addresses = self.address().splat(lanes) + offsets.cast(dtypes.DT_INT64) * bytes_apart
        pointers = self.b.inttoptr(addresses.ir, ir.VectorType(element.as_pointer(), lanes))
        vector = ir.VectorType(element, lanes)
        function = declared(self.b.module, f"llvm.masked.gather.{_suffix(vector)}.v{lanes}p0{_suffix(element)}",
                            ir.FunctionType(vector, [pointers.type, I32, mask.ir.type, vector]))
        gathered = self.b.call(function, [pointers, ir.Constant(I32, dtypes.itemsize(self.dtype)), mask.ir, others.ir])
        return Value(self.b, gathered, self.dtype)

    def _stored_as_computed(self, operation: str) -> None:
        if storage_type(self.dtype) != compute_type(self.dtype):
            raise TypeError(f"{operation} reads elements as they are stored: not of {self.dtype}, which computes "
                            f"as {compute_type(self.dtype)}; view the pointer as the stored type's dtype")

    def prefetch(self, cache_level: int = 2) -> None:
        """Ask for the cache line here to be brought in for reading, into L2 (`cache_level`
        2; LLVM's locality 3 less the level) ahead of its use."""
        function = declared(self.b.module, "llvm.prefetch.p0i8", ir.FunctionType(VOID, [BYTE_PTR, I32, I32, I32]))
        locality = 4 - cache_level
        self.b.call(function, [self.b.bitcast(self.ir, BYTE_PTR), ir.Constant(I32, 0), ir.Constant(I32, locality),
                               ir.Constant(I32, 1)])

    # ---- atomics (sequentially consistent) ---------------------------------------------------

    def load_atomic(self) -> Value:
        return Value(self.b, self.b.load_atomic(self.ir, _ATOMIC_ORDER, dtypes.itemsize(self.dtype)), self.dtype)

    def store_atomic(self, value: Value | int) -> None:
        self.b.store_atomic(_of(self, value).ir, self.ir, _ATOMIC_ORDER, dtypes.itemsize(self.dtype))

    def compare_exchange(self, expected: Value | int, replacement: Value | int) -> Value:
        """Write `replacement` here if the element is `expected`, as one atomic step; whether it did (bool)."""
        result = self.b.cmpxchg(self.ir, _of(self, expected).ir, _of(self, replacement).ir, _ATOMIC_ORDER, _ATOMIC_ORDER)
        return Value(self.b, self.b.extract_value(result, 1), dtypes.DT_BOOL)

    def atomic_add(self, amount: Value | int) -> Value:
        """Add `amount` to the element as one atomic step; the element before."""
        return Value(self.b, self.b.atomic_rmw("add", self.ir, _of(self, amount).ir, _ATOMIC_ORDER), self.dtype)

    def atomic_sub(self, amount: Value | int) -> Value:
        return Value(self.b, self.b.atomic_rmw("sub", self.ir, _of(self, amount).ir, _ATOMIC_ORDER), self.dtype)

    def __repr__(self) -> str:
        return f"<Pointer {self.dtype}*: {self.ir.type}>"


def _index(b: ir.IRBuilder, offset: Value | int) -> Value:
    return offset if isinstance(offset, Value) else index_value(b, offset)


def _of(pointer: Pointer, value: Value | int) -> Value:
    """`value` as an element of `pointer`'s dtype (a Python int as a constant)."""
    if isinstance(value, Value):
        return value
    return Value(pointer.b, ir.Constant(compute_type(pointer.dtype), value), pointer.dtype)


def _suffix(type_: ir.Type) -> str:
    if isinstance(type_, ir.VectorType):
        return f"v{type_.count}{_suffix(type_.element)}"
    return {"float": "f32", "double": "f64"}.get(str(type_), str(type_))


def null(b: ir.IRBuilder, dtype: str) -> Pointer:
    """The null pointer to `dtype` elements."""
    return Pointer(b, ir.Constant(storage_type(dtype).as_pointer(), None), dtype)



def stack(b: ir.IRBuilder, dtype: str, count: int, align: int | None = None) -> Pointer:
    """`count` elements of `dtype` on the stack, allotted where `b` is (`align` in bytes)."""
    memory = b.alloca(storage_type(dtype), i64(count))
    if align is not None:
        memory.align = align
    return Pointer(b, memory, dtype)


def padded_run(source: Pointer, first: Value, stop: Value, count: int, buffer: Pointer, partial: Value) -> Pointer:
    """Where the `count` elements of `source` from `first` can be read whole: `source` itself,
    or where `partial` (a row's last run, past its end at `stop`) `buffer` holding those
    before `stop` and zeros after them, so a vector loop reads its last run whole."""
    b = source.b
    with b.if_then(partial.ir), loop(b, 0, count, name="pad") as e:
        at = first + e
        inside = at < stop
        buffer[e] = inside.where(source[inside.where(at, 0)], 0)
    return partial.where(buffer, source + first)


_DTYPES = {"i1": dtypes.DT_BOOL, "i8": dtypes.DT_UINT8, "i16": dtypes.DT_INT16, "i32": dtypes.DT_INT32,
           "i64": dtypes.DT_INT64, "float": dtypes.DT_FLOAT32, "double": dtypes.DT_FLOAT64}


def parameters(b: ir.IRBuilder, function: ir.Function) -> list[Any]:
    """`function`'s arguments as Values and Pointers by their IR types (i64 as int64, i1 as
    bool, i8* as a pointer to uint8, float* to float32, ...)."""
    wrapped: list[Any] = []
    for argument in function.args:
        kind = argument.type
        if isinstance(kind, ir.PointerType):
            wrapped.append(Pointer(b, argument, _DTYPES[str(kind.pointee)]))
        else:
            wrapped.append(Value(b, argument, _DTYPES[str(kind)]))
    return wrapped


class PointerVariable:
    """A pointer kept in memory (a global, a stack slot): `.value` reads it, `.set(p)` writes
    it; `holding(p)` is a kernel's own, such as where a run of reads has got to."""

    def __init__(self, b: ir.IRBuilder, slot: ir.Value, dtype: str):
        self.b, self.slot, self.dtype = b, slot, dtype

    @classmethod
    def holding(cls, initial: Pointer) -> PointerVariable:
        """A new variable on the stack (allotted where the builder is), set to `initial`."""
        variable = cls(initial.b, initial.b.alloca(initial.ir.type), initial.dtype)
        variable.set(initial)
        return variable

    @property
    def value(self) -> Pointer:
        return Pointer(self.b, self.b.load(self.slot), self.dtype)

    def set(self, pointer: Pointer) -> None:
        self.b.store(pointer.ir, self.slot)
