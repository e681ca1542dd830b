"""Pointers and the Value operations the GEMM generators are written in
(ranvier/backends/llvm/pointers.py, values.py): each emitted into a small function,
compiled for this CPU and run on numpy arrays. Outputs start as NaN, so an element the
code should have written and did not shows; lanes it must not touch are checked to keep
their NaN."""

from __future__ import annotations

import ctypes
import mmap
import re

import numpy as np
import pytest
from llvmlite import ir

from ranvier import dtypes
from ranvier.backends.cpu import amx, jit
from ranvier.backends.cpu.target import CPUTarget, host_target
from ranvier.backends.llvm.irutil import F32, I32, I64, VOID
from ranvier.backends.llvm.pointers import Pointer, PointerVariable, null, padded_run, parameters, stack
from ranvier.backends.llvm.values import Value, call, choose, forever, index_value, local, loop

FLOAT_PTR, INT_PTR, LONG_PTR = F32.as_pointer(), I32.as_pointer(), I64.as_pointer()
_LOADED: list[jit.LoadedCode] = []  # compiled functions stay mapped for the session


def _compiled(arguments: list[ir.Type], body, result: ir.Type = VOID):
    """A function of `arguments` whose body `body(b, *parameters)` emits (returning its
    result, if any), compiled for the host and loaded: (its address, the module)."""
    module = ir.Module("test")
    target = host_target()
    module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    function = ir.Function(module, ir.FunctionType(result, arguments), name="kernel")
    b = ir.IRBuilder(function.append_basic_block("entry"))
    returned = body(b, *parameters(b, function))
    if isinstance(result, ir.VoidType):
        b.ret_void()
    else:
        b.ret(returned.ir)
    code = jit.load_object(jit.compile_object(module, target), target, "kernel")
    _LOADED.append(code)
    return code.address, module


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


def test_element_pointers_loads_and_stores():
    """y[i] = 2 · x[n − 1 − i]: pointer arithmetic, indexing, scalar loads and stores."""

    def body(b, x, y, n):
        with loop(b, 0, n) as i:
            y[i] = (x + (n - 1))[-i] * 2.0

    address, _ = _compiled([FLOAT_PTR, FLOAT_PTR, I64], body)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(37).astype(np.float32)
    y = np.full_like(x, np.nan)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)(_address(x), _address(y), x.size)
    np.testing.assert_array_equal(y, 2 * x[::-1])


def test_vector_loads_stores_and_masks():
    """A vector copy of 16 floats at any alignment; a masked copy of the first `count`
    touches neither the memory past them (read) nor the output's lanes past them (written)."""

    def body(b, x, y, z, count):
        (y + 1).store((x + 1).load(16, align=4), align=4)
        lanes = Value(b, ir.Constant(ir.VectorType(I64, 16), list(range(16))), dtypes.DT_INT64)
        mask = lanes < count.splat(16)
        z.masked_store(x.masked_load(mask), mask)

    address, _ = _compiled([FLOAT_PTR, FLOAT_PTR, FLOAT_PTR, I64], body)
    rng = np.random.default_rng(2)
    x = rng.standard_normal(17).astype(np.float32)
    y, z = np.full(17, np.nan, np.float32), np.full(16, np.nan, np.float32)
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)
    run(_address(x), _address(y), _address(z), 5)
    np.testing.assert_array_equal(y[1:], x[1:])
    assert np.isnan(y[0])
    np.testing.assert_array_equal(z[:5], x[:5])
    assert np.isnan(z[5:]).all()


def test_masked_load_reads_nothing_past_a_row():
    """Lanes masked off are not read: 3 floats at the end of a page whose next page is
    inaccessible load as a 16-lane vector of them and zeros, without a fault."""

    def body(b, x, y, count):
        lanes = Value(b, ir.Constant(ir.VectorType(I64, 16), list(range(16))), dtypes.DT_INT64)
        y.store(x.masked_load(lanes < count.splat(16)), align=4)

    address, _ = _compiled([FLOAT_PTR, FLOAT_PTR, I64], body)
    page = mmap.PAGESIZE
    memory = mmap.mmap(-1, 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(start + page), ctypes.c_size_t(page), 0) == 0  # PROT_NONE
    row = np.frombuffer(memory, np.float32, count=3, offset=page - 12)
    row[:] = [1.5, -2.0, 3.25]
    y = np.full(16, np.nan, np.float32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)(start + page - 12, _address(y), 3)
    np.testing.assert_array_equal(y, [1.5, -2.0, 3.25] + [0.0] * 13)


def test_masked_loads_refuse_a_converted_dtype():
    """A masked load or gather moves elements as they are stored: one of bfloat16 (stored as 16
    bits, computed as float32) is refused, not given a vector of the wrong type."""
    module = ir.Module("test")
    function = ir.Function(module, ir.FunctionType(VOID, [FLOAT_PTR]), name="f")
    b = ir.IRBuilder(function.append_basic_block("entry"))
    (x,) = parameters(b, function)
    lanes = Value(b, ir.Constant(ir.VectorType(I64, 8), list(range(8))), dtypes.DT_INT64)
    with pytest.raises(TypeError, match="bfloat16"):
        x.view(dtypes.DT_BFLOAT16).masked_load(lanes < 3)


def test_gather():
    """Lane e: x[offsets[e]] where the mask leaves it on, the others' lane elsewhere."""

    def body(b, x, offsets, y):
        indices = offsets.load(8, align=4)
        on = indices >= 0
        y.store(x.gather(on.where(indices, 0), on, indices.constant(-1.0, dtypes.DT_FLOAT32)), align=4)

    address, _ = _compiled([FLOAT_PTR, INT_PTR, FLOAT_PTR], body)
    x = np.arange(100, dtype=np.float32) * 1.5
    offsets = np.array([7, -1, 99, 0, 42, -5, 3, 3], np.int32)
    y = np.full(8, np.nan, np.float32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(address)(_address(x), _address(offsets), _address(y))
    np.testing.assert_array_equal(y, np.where(offsets >= 0, x[np.maximum(offsets, 0)], -1.0))


def test_prefetch_and_views():
    """A prefetch of L2 (locality 2) changes nothing; a view of bfloat16 loads widened floats."""

    def body(b, x, y):
        (x + 16).prefetch()
        y.store(x.view(dtypes.DT_BFLOAT16).load(8, align=2), align=4)

    address, module = _compiled([FLOAT_PTR, FLOAT_PTR], body)
    assert re.search(r'call void @"llvm.prefetch.p0i8"\(i8\* %"\.\d+", i32 0, i32 2, i32 1\)', str(module))
    values = np.array([1.5, -2.25, 3.0, 0.125], np.float32)  # exact in bfloat16: their upper halves
    halves = (values.view(np.uint32) >> 16).astype(np.uint16)
    x = np.zeros(32, np.float32)
    x.view(np.uint16)[:8] = np.concatenate([halves, halves])
    y = np.full(8, np.nan, np.float32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(address)(_address(x), _address(y))
    np.testing.assert_array_equal(y, np.concatenate([values, values]))


def test_atomics():
    """compare_exchange swaps only when the element is the one expected; atomic_add and
    atomic_sub return the element before."""

    def body(b, word, out):
        out[0] = word.compare_exchange(5, 9).cast(dtypes.DT_INT64)  # 4 there: no swap
        out[1] = word.compare_exchange(4, 9).cast(dtypes.DT_INT64)
        out[2] = word.atomic_add(3)
        out[3] = word.atomic_sub(2)
        word.store_atomic(100)
        out[4] = word.load_atomic()

    address, _ = _compiled([LONG_PTR, LONG_PTR], body)
    word, out = np.array([4], np.int64), np.full(5, -1, np.int64)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(address)(_address(word), _address(out))
    assert out.tolist() == [0, 1, 9, 12, 100] and word[0] == 100


def test_fma_copysign_and_lanes():
    """fma rounds once (a·b + c of 1 ± 2⁻²³ and −1 is −2⁻⁴⁶, not the 0 of two roundings);
    copysign, a lane picked by an index Value, zeros of a one-lane vector."""

    def body(b, x, y, which):
        a, m, c = (x + 0).load(), x[1], x[2]
        y[0] = a.fma(m, c)
        y[1] = a * m + c
        y[2] = x[3].copysign(x[4])
        y[3] = x.load(8, align=4).lane(which)
        y[4] = (x + 0).load(1, vector=True).zeros().lane(0) + 7.0

    address, _ = _compiled([FLOAT_PTR, FLOAT_PTR, I64], body)
    x = np.array([1 + 2**-23, 1 - 2**-23, -1, 2.5, -0.0, 11, 12, 13], np.float32)
    y = np.full(5, np.nan, np.float32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)(_address(x), _address(y), 6)
    assert y.tolist() == [-(2.0**-46), 0.0, -2.5, 12.0, 7.0]


def test_choose_runs_only_the_branch_taken():
    """choose(c, f, g): a load of a null pointer on the branch not taken never runs."""

    def body(b, x, flag):
        nothing = null(b, dtypes.DT_FLOAT32)
        return choose(flag.not_equal(0), lambda: x[0] + 1.0, lambda: nothing[0])

    address, _ = _compiled([FLOAT_PTR, I64], body, result=F32)
    x = np.array([41.0], np.float32)
    assert ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_void_p, ctypes.c_int64)(address)(_address(x), 1) == 42.0


def test_forever_local_stack_and_calls():
    """A loop left by `leave_if`, a local and a pointer variable, an array on the stack, a call
    of another function with Values and pointers: the sum of the first n squares, twice."""

    def body(b, n, out):
        module = b.module
        helper = ir.Function(module, ir.FunctionType(VOID, [LONG_PTR, I64]), name="twice")
        helper.linkage = "internal"
        inner = ir.IRBuilder(helper.append_basic_block("entry"))
        target, value = parameters(inner, helper)
        target[0] = value * 2
        inner.ret_void()

        total, i = local(b, dtypes.DT_INT64, initial=index_value(b, 0)), local(b, dtypes.DT_INT64, initial=index_value(b, 0))
        at = PointerVariable.holding(out)
        with forever(b) as leave_if:
            leave_if(i.value >= n)
            total.set(total.value + i.value * i.value)
            i.set(i.value + 1)
        scratch = stack(b, dtypes.DT_INT64, 4)
        call(b, helper, scratch + 1, total.value)
        at.value[0] = scratch[1]
        assert call(b, helper, at.value + 1, 5) is None

    address, _ = _compiled([I64, LONG_PTR], body)
    out = np.full(2, -1, np.int64)
    ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(address)(10, _address(out))
    assert out.tolist() == [2 * sum(i * i for i in range(10)), 10]


@pytest.mark.parametrize("dtype", [dtypes.DT_INT32, dtypes.DT_UINT32])
def test_constant_shifts_are_plain_instructions(dtype):
    """A shift by a constant inside the width is the instruction itself (no range select),
    arithmetic for signed dtypes, logical for unsigned ones."""

    def body(b, x, y):
        v = Pointer(b, x.ir, dtype).load(4, align=4)
        Pointer(b, y.ir, dtype).store(v.shift_right(3).shift_left(1), align=4)

    address, module = _compiled([INT_PTR, INT_PTR], body)
    assert "select" not in str(module)
    x = np.array([-64, 64, 7, -1], np.int32)
    y = np.full(4, 99, np.int32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(address)(_address(x), _address(y))
    numbers = x if dtype == dtypes.DT_INT32 else x.view(np.uint32)
    assert y.view(numbers.dtype).tolist() == ((numbers >> 3) << 1).astype(numbers.dtype).tolist()


def test_bitcast_splits_and_joins_lanes():
    """bitcast as numpy's view: 8 int32 lanes read as 16 int16 (the q8_0 GEMM's bytes taken
    two at a time) and back; lanes that do not fill whole lanes of the other dtype refuse."""

    def body(b, x, halves, whole):
        split = Pointer(b, x.ir, dtypes.DT_INT32).load(8, align=4).bitcast(dtypes.DT_INT16)
        assert split.lanes == 16
        Pointer(b, halves.ir, dtypes.DT_INT16).store(split, align=2)
        Pointer(b, whole.ir, dtypes.DT_INT32).store((split + 1).bitcast(dtypes.DT_INT32), align=4)
        with pytest.raises(TypeError, match="3 lanes of int16"):
            Pointer(b, halves.ir, dtypes.DT_INT16).load(3, align=2).bitcast(dtypes.DT_INT32)

    address, _ = _compiled([INT_PTR, ir.IntType(16).as_pointer(), INT_PTR], body)
    x = np.random.default_rng(3).integers(-(2**31), 2**31, 8).astype(np.int32)
    halves, whole = np.zeros(16, np.int16), np.zeros(8, np.int32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(address)(_address(x), _address(halves),
                                                                                        _address(whole))
    np.testing.assert_array_equal(halves, x.view(np.int16))
    np.testing.assert_array_equal(whole, (x.view(np.int16) + np.int16(1)).view(np.int32))


@pytest.mark.parametrize("first", [0, 8, 13, 16])
def test_padded_run_reads_a_last_run_whole(first):
    """padded_run: a run inside the row is read in place; one past the row's end (`stop`
    20) from the buffer, the elements before the end then zeros, the row's memory past its
    end (NaN here) never read."""

    def body(b, x, y, start):
        buffer = stack(b, dtypes.DT_FLOAT32, 8)
        run = padded_run(x, start, index_value(b, 20), 8, buffer, start + 8 > 20)
        y.store(run.load(8, align=4), align=4)

    address, _ = _compiled([FLOAT_PTR, FLOAT_PTR, I64], body)
    x = np.full(32, np.nan, np.float32)
    x[:20] = np.random.default_rng(4).standard_normal(20)
    y = np.full(8, np.nan, np.float32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)(_address(x), _address(y), first)
    expected = np.zeros(8, np.float32)
    expected[: min(8, 20 - first)] = x[first : min(first + 8, 20)]
    np.testing.assert_array_equal(y, expected)


def test_amx_gemm_builds_for_an_amx_cpu():
    """The AMX GEMM's module builds and compiles for a Sapphire Rapids target, on any host:
    its tile loads, products and stores are there (a CPU without AMX cannot run it)."""
    features = ",".join(f"+{f}" for f in sorted(amx.REQUIRED_FEATURES | {"avx512vl", "avx512dq", "avx2", "fma", "avx"}))
    target = CPUTarget("sapphirerapids", features)
    assembly = jit.assembly(amx.build_module(target), target)
    assert assembly.count("tdpbf16ps") >= 4 and "tileloaddt1" in assembly and "tilestored" in assembly
