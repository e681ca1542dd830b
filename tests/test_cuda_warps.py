"""Warp-wide operations of GPU block programs (`ranvier.backends.cuda.warps`): the host
emulator's tensor-core product and lane exchange, against numpy, with fragments laid out
over lanes as the PTX ISA's tables give them (written out here on their own); and the
GPU's instructions, which ptxas must accept."""

from __future__ import annotations

import ctypes
import re

import ml_dtypes
import numpy as np
import pytest
from llvmlite import ir

import ranvier as rv
from ranvier.backends.cpu import jit
from ranvier.backends.cpu.target import host_target
from ranvier.backends.cuda import ptx, warps
from ranvier.backends.cuda.blocks import BlockProgram
from ranvier.backends.cuda.kernels import GPU_FEATURES
from ranvier.backends.llvm.context import Array, EmitContext
from ranvier.backends.llvm.irutil import F32, I32, VOID, storage_type, use_features

WARPS = 2  # a block of two warps: each does its own product


def fragments(matrix: np.ndarray, count: int, at) -> np.ndarray:
    """[32, count]: lane 4g + q's element i is matrix[at(g, q, i)]."""
    out = np.empty((32, count), matrix.dtype)
    for lane in range(32):
        g, q = divmod(lane, 4)
        for i in range(count):
            out[lane, i] = matrix[at(g, q, i)]
    return out


# The PTX ISA's tables for mma.m16n8k16: (elements a lane holds, where element i of lane 4g + q lies)
A_LAYOUT = (8, lambda g, q, i: (g + 8 * (i // 2 % 2), 2 * q + i % 2 + 8 * (i // 4)))  # A, 16 × 16
B_LAYOUT = (4, lambda g, q, i: (2 * q + i % 2 + 8 * (i // 2), g))  # B, 16 × 8
C_LAYOUT = (4, lambda g, q, i: (g + 8 * (i // 2), 2 * q + i % 2))  # C and D, 16 × 8


def words(fragments: np.ndarray) -> np.ndarray:
    """bfloat16 pairs as 32-bit words, the lower-numbered element in the low half."""
    bits = fragments.view(np.uint16).astype(np.uint32)
    return (bits[:, 0::2] | (bits[:, 1::2] << 16)).astype(np.int32)


def _product_kernel(on_gpu: bool):
    """`kernel(a words, b words, c, d)`: each warp's fragments from the arrays (its lanes'
    words and floats in turn), D = A·B + C by `warps.mma`, D's fragments back."""
    module = ptx.gpu_module("warps") if on_gpu else ir.Module("warps")
    if on_gpu:
        use_features(module, GPU_FEATURES)
    else:
        target = host_target()
        module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    pointers = [I32.as_pointer(), I32.as_pointer(), F32.as_pointer(), F32.as_pointer()]
    function = ir.Function(module, ir.FunctionType(VOID, pointers), "kernel")
    ctx = EmitContext(module, ir.IRBuilder(function.append_basic_block("entry")))
    ctx.on_gpu = on_gpu
    program = BlockProgram(ctx, 32 * WARPS, on_gpu)
    fa, fb = program.private("int32", 4), program.private("int32", 2)
    fc, fd = program.private("float32", 4), program.private("float32", 4)
    a, b, c, d = (Array(ctx.b, arg, dtype) for arg, dtype in zip(function.args, ["int32", "int32", "float32", "float32"]))
    with program.phase() as thread:
        for k in range(4):
            fa.store(k, a.load(thread * 4 + k))
            fc.store(k, c.load(thread * 4 + k))
        for k in range(2):
            fb.store(k, b.load(thread * 2 + k))
    warps.mma(program, (fd, 0), (fa, 0), (fb, 0), (fc, 0))
    with program.phase() as thread:
        for k in range(4):
            d.store(thread * 4 + k, fd.load(k))
    ctx.b.ret_void()
    if on_gpu:
        ptx.mark_kernel(module, function)
    return module


def test_the_emulated_product_is_each_warps_bfloat16_matrices_summed_in_float32():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((WARPS, 16, 16)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((WARPS, 16, 8)).astype(ml_dtypes.bfloat16)
    c = rng.standard_normal((WARPS, 16, 8)).astype(np.float32)
    a_words = np.concatenate([words(fragments(a[w], *A_LAYOUT)) for w in range(WARPS)])
    b_words = np.concatenate([words(fragments(b[w], *B_LAYOUT)) for w in range(WARPS)])
    c_floats = np.concatenate([fragments(c[w], *C_LAYOUT) for w in range(WARPS)])
    d_floats = np.full_like(c_floats, np.nan)
    target = host_target()
    code = jit.load_object(jit.compile_object(_product_kernel(on_gpu=False), target), target, "kernel")
    ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4)(code.address_of("kernel"))(
        *[array.ctypes.data for array in (a_words, b_words, c_floats, d_floats)])
    for w in range(WARPS):
        want = a[w].astype(np.float64) @ b[w].astype(np.float64) + c[w]
        got = d_floats[32 * w : 32 * (w + 1)]
        np.testing.assert_allclose(got, fragments(want, *C_LAYOUT), rtol=1e-5, atol=1e-5)


def test_an_exchange_passes_each_lanes_values_to_its_butterfly_partner():
    module = ir.Module("exchange")
    target = host_target()
    module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    function = ir.Function(module, ir.FunctionType(VOID, [F32.as_pointer(), F32.as_pointer()]), "kernel")
    ctx = EmitContext(module, ir.IRBuilder(function.append_basic_block("entry")))
    program = BlockProgram(ctx, 64, on_gpu=False)
    source, target_values = program.private("float32", 2), program.private("float32", 2)
    given, got = (Array(ctx.b, arg, "float32") for arg in function.args)
    with program.phase() as thread:
        for k in range(2):
            source.store(k, given.load(thread * 2 + k))
    warps.exchange(program, target_values, source, 2, mask=2)
    with program.phase() as thread:
        for k in range(2):
            got.store(thread * 2 + k, target_values.load(k))
    ctx.b.ret_void()
    code = jit.load_object(jit.compile_object(module, target), target, "kernel")
    values = np.random.default_rng(4).standard_normal((64, 2)).astype(np.float32)
    out = np.full_like(values, np.nan)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(code.address_of("kernel"))(values.ctypes.data, out.ctypes.data)
    np.testing.assert_array_equal(out, values[np.arange(64) ^ 2])


@pytest.mark.skipif(ptx.ptxas_path() is None, reason="needs ptxas (CUDA toolkit or nvidia-cuda-nvcc)")
def test_the_gpus_product_is_one_mma_instruction_that_ptxas_accepts():
    text = ptx.emit_ptx(_product_kernel(on_gpu=True))
    assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 1
    assert "local" not in text  # the fragments are registers
    assert ptx.assemble(text).registers("kernel") > 0


TILE_ROWS, TILE_STRIDE = 16, 12  # a shared tile of 16 rows (and one more), 12 words (48 bytes: whole 16-byte rows) apart
TILE_WORDS = (TILE_ROWS + 1) * TILE_STRIDE


def _row(thread):
    """The tile row (its first word) a thread names to ldmatrix: a scattered one, sometimes
    its second 16 bytes, so a lane read from the wrong lane's row shows."""
    return (thread * 5 + 3) % TILE_ROWS * TILE_STRIDE + (thread // 3) % 2 * 4


def _module(name: str, on_gpu: bool, arguments: int = 2):
    module = ptx.gpu_module(name) if on_gpu else ir.Module(name)
    if on_gpu:
        use_features(module, GPU_FEATURES)
    else:
        target = host_target()
        module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    function = ir.Function(module, ir.FunctionType(VOID, [I32.as_pointer()] * arguments), "kernel")
    ctx = EmitContext(module, ir.IRBuilder(function.append_basic_block("entry")))
    ctx.on_gpu = on_gpu
    return module, function, ctx, BlockProgram(ctx, 32 * WARPS, on_gpu)


def _finish(module, function, ctx, on_gpu: bool):
    ctx.b.ret_void()
    if on_gpu:
        ptx.mark_kernel(module, function)
    return module


def _load_matrices_kernel(on_gpu: bool, count: int, transpose: bool):
    """`kernel(tile words, out)`: the tile into shared memory, then each lane's `count`
    words from `warps.load_matrices` (the rows a row past those `_row` names), lane after lane."""
    module, function, ctx, program = _module("ldmatrix", on_gpu)
    given, out = (Array(ctx.b, arg, "int32") for arg in function.args)
    tile = program.shared("int32", TILE_WORDS)
    words = program.private("int32", count)
    with program.phase() as thread, ctx.loop(thread, TILE_WORDS, step=program.threads) as e:
        tile.store(e, given.load(e))
    warps.load_matrices(program, (words, 0), tile, _row, count, transpose, offset=TILE_STRIDE)
    with program.phase() as thread:
        for i in range(count):
            out.store(thread * count + i, words.load(i))
    return _finish(module, function, ctx, on_gpu)


def _run(module, *arrays) -> None:
    target = host_target()
    code = jit.load_object(jit.compile_object(module, target), target, "kernel")
    ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * len(arrays))(code.address_of("kernel"))(*[a.ctypes.data for a in arrays])


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_load_matrices_gives_each_lane_the_isas_elements_of_the_rows_its_warp_names(count, transpose):
    """ldmatrix as the PTX ISA says: lanes 8i .. 8i + 7 name the rows of matrix i; lane
    4g + q's register i holds its row g's elements 2q and 2q + 1 (transposed: element g of
    its rows 2q and 2q + 1), the lower-numbered in the low half; each row's address the
    lane's register plus the instruction's immediate offset."""
    rng = np.random.default_rng(5)
    halves = rng.integers(0, 1 << 16, TILE_WORDS * 2, dtype=np.uint16)
    out = np.full(32 * WARPS * count, -1, np.int32)
    _run(_load_matrices_kernel(on_gpu=False, count=count, transpose=transpose), halves.view(np.int32), out)
    got = out.view(np.uint32).reshape(WARPS, 32, count)
    for w in range(WARPS):
        for i in range(count):
            matrix = np.stack([halves[2 * (_row(32 * w + 8 * i + r) + TILE_STRIDE):][:8] for r in range(8)])  # lane 8i + r's row
            if transpose:
                matrix = matrix.T
            for lane in range(32):
                g, q = divmod(lane, 4)
                want = int(matrix[g, 2 * q]) | int(matrix[g, 2 * q + 1]) << 16
                assert got[w, lane, i] == want, (w, lane, i)


COPIES = 32 * WARPS  # one 16-byte copy a thread in each group
MARK = -7  # what the tile holds before the copies land


def _permuted(thread):
    """Where a thread's copy lands in its half of the tile (a bijection of the block's threads)."""
    return (thread * 5 + 3) % COPIES


def _copy_kernel(on_gpu: bool, zeros: bool = False):
    """`kernel(source words, out)`: the tile marked, then thread t copies source's 16-byte
    chunks t and COPIES + t into the tile's chunks `_permuted(t)` and COPIES +
    `_permuted(t)` in two groups (with `zeros`, an odd thread's second copy is of zeros:
    no source); it reads its first word of each after waiting for all but the latest
    group (out[0 .. 2) of its row of four), then after waiting for both (out[2 .. 4));
    then the whole tile after the barrier (out from 4·COPIES on)."""
    module, function, ctx, program = _module("copies", on_gpu)
    given, out = (Array(ctx.b, arg, "int32") for arg in function.args)
    tile = program.shared("int32", 2 * COPIES * 4)
    copies = warps.AsyncCopies(program, per_group=1, groups=2)
    with program.phase() as thread, ctx.loop(thread, 2 * COPIES * 4, step=program.threads) as e:
        tile.store(e, ctx.constant("int32", MARK))
    with program.phase() as thread:
        words = [_permuted(thread) * 4, (COPIES + _permuted(thread)) * 4]
        for group in range(2):
            inside = (thread % 2).equal(0) if zeros and group else None
            copies.copy(tile, words[group], ctx.b.gep(given.base, [((group * COPIES + thread) * 4).ir]), inside)
            copies.commit()
        for pending in (1, 0):
            copies.wait(pending)
            for group in range(2):
                out.store(thread * 4 + (1 - pending) * 2 + group, tile.load(words[group]))
    with program.phase() as thread, ctx.loop(thread, 2 * COPIES * 4, step=program.threads) as e:
        out.store(COPIES * 4 + e, tile.load(e))
    return _finish(module, function, ctx, on_gpu)


def test_an_asynchronous_copy_moves_16_bytes_from_global_to_shared_memory_at_the_wait_that_covers_it():
    """Each chunk lands where its copy said; on the host emulator a group lands at the
    first wait that leaves fewer groups in flight than came after it, not before (on a
    GPU a copy not yet waited for may or may not have landed)."""
    source = np.random.default_rng(6).integers(-(1 << 31), 1 << 31, 2 * COPIES * 4, dtype=np.int64).astype(np.int32)
    out = np.full(COPIES * 4 + source.size, -1, np.int32)
    _run(_copy_kernel(on_gpu=False), source, out)
    chunks = source.reshape(2, COPIES, 4)
    want = np.empty_like(chunks)
    want[:, [_permuted(t) for t in range(COPIES)]] = chunks
    np.testing.assert_array_equal(out[COPIES * 4 :].reshape(2, COPIES, 4), want)
    seen = out[: COPIES * 4].reshape(COPIES, 4)
    np.testing.assert_array_equal(seen[:, 0], chunks[0, :, 0])  # the first group, waited for
    np.testing.assert_array_equal(seen[:, 1], MARK)  # the second, still in flight
    np.testing.assert_array_equal(seen[:, 2:], chunks[:, :, 0].T)


def test_a_copy_with_no_source_lands_zeros_at_the_wait_that_covers_it():
    """cp.async's zero fill (source size 0): the chunk is 16 bytes of zeros, landing, like
    a copy, only at its wait; the other copies as before."""
    source = np.random.default_rng(7).integers(1, 1 << 31, 2 * COPIES * 4, dtype=np.int64).astype(np.int32)
    out = np.full(COPIES * 4 + source.size, -1, np.int32)
    _run(_copy_kernel(on_gpu=False, zeros=True), source, out)
    chunks = source.reshape(2, COPIES, 4).copy()
    chunks[1, 1::2] = 0  # odd threads' second copies: zeros
    want = np.empty_like(chunks)
    want[:, [_permuted(t) for t in range(COPIES)]] = chunks
    np.testing.assert_array_equal(out[COPIES * 4 :].reshape(2, COPIES, 4), want)
    seen = out[: COPIES * 4].reshape(COPIES, 4)
    np.testing.assert_array_equal(seen[:, 1], MARK)  # in flight: neither the copy nor its zeros yet
    np.testing.assert_array_equal(seen[:, 2:], chunks[:, :, 0].T)


CHUNK_READS = [("bfloat16", 8), ("bfloat16", 1), ("float32", 4), ("float32", 1)]  # a source's dtype, values read at a time


def _source_length(lanes: int) -> int:
    """Elements of a chunk test's source: its last chunks (all but the first values of
    one, unless read 8 at a time) past the end, so zeros."""
    return 2 * COPIES * warps.CHUNK - (24 if lanes == warps.CHUNK else 21 if lanes == 1 else 20)


def _chunk_kernel(on_gpu: bool, dtype: str, lanes: int):
    """`kernel(source, out)`: the tile marked, then thread t copies the source's chunks t
    and COPIES + t (`warps.copy_chunk`, `lanes` values at a time, those past the source's
    end zeros, their offsets clamped inside it) into the tile's chunks `_permuted(t)` and
    COPIES + `_permuted(t)`, waits for its copies; the tile after the barrier into out."""
    module, function, ctx, program = _module("chunks", on_gpu)
    given, out = function.args
    source = rv.Builder(rv.Flow(), "f").var("source", dtype, [_source_length(lanes)]).var
    ctx.pointer = lambda var: ctx.b.bitcast(given, storage_type(var.dtype).as_pointer())
    tile, words = program.shared("int32", 2 * COPIES * 4), Array(ctx.b, out, "int32")
    copies = warps.AsyncCopies(program, per_group=2, groups=1)
    with program.phase() as thread, ctx.loop(thread, 2 * COPIES * 4, step=program.threads) as e:
        tile.store(e, ctx.constant("int32", MARK))
    with program.phase() as thread:
        for half in range(2):
            chunk = half * COPIES + thread

            def place(first: int, count: int, chunk=chunk):
                at = chunk * warps.CHUNK + first
                return at.minimum(source.size - count), at < source.size

            warps.copy_chunk(program, copies, tile, (half * COPIES + _permuted(thread)) * 4, source, place, lanes)
        copies.commit()
        copies.wait(0)
    with program.phase() as thread, ctx.loop(thread, 2 * COPIES * 4, step=program.threads) as e:
        words.store(e, tile.load(e))
    return _finish(module, function, ctx, on_gpu)


@pytest.mark.parametrize("dtype,lanes", CHUNK_READS)
def test_a_chunk_copy_writes_every_bfloat16_of_the_tile_and_zeros_past_the_source(dtype, lanes):
    """`warps.copy_chunk`: every word of the tile written (none left marked), each chunk's
    8 values the source's rounded to bfloat16 (to nearest even), packed in pairs (the
    lower-numbered in the low half), zeros where they lie past the source's end: whole
    chunks by cp.async's zero fill, single values and vectors by the thread."""
    length = _source_length(lanes)
    values = np.random.default_rng(8).standard_normal(length).astype(np.float32)
    source = values.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else values
    out = np.full(2 * COPIES * 4, MARK, np.int32)
    _run(_chunk_kernel(on_gpu=False, dtype=dtype, lanes=lanes), np.ascontiguousarray(source).view(np.uint8), out)
    padded = np.zeros(2 * COPIES * warps.CHUNK, ml_dtypes.bfloat16)
    padded[:length] = values.astype(ml_dtypes.bfloat16)
    chunks = padded.view(np.int32).reshape(2, COPIES, 4)
    want = np.empty_like(chunks)
    want[:, [_permuted(t) for t in range(COPIES)]] = chunks
    np.testing.assert_array_equal(out.reshape(2, COPIES, 4), want)
    assert not want[1, _permuted(COPIES - 1)].any()  # the last chunk lies past the source: zeros


@pytest.mark.skipif(ptx.ptxas_path() is None, reason="needs ptxas (CUDA toolkit or nvidia-cuda-nvcc)")
@pytest.mark.parametrize("architecture", ["sm_80", "sm_90"])
def test_the_gpus_loads_and_copies_are_their_instructions_that_ptxas_accepts(architecture):
    text = ptx.emit_ptx(_load_matrices_kernel(on_gpu=True, count=4, transpose=True), architecture)
    assert text.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 1
    ptx.assemble(text, architecture)
    text = ptx.emit_ptx(_copy_kernel(on_gpu=True), architecture)
    assert [text.count(f"cp.async.{what}") for what in ("cg.shared.global", "commit_group", "wait_group 1", "wait_group 0")] == \
        [2, 2, 1, 1]
    ptx.assemble(text, architecture)
    for dtype, lanes in CHUNK_READS:  # a whole bfloat16 chunk by cp.async, float32 vectors by ld.global.v4
        text = ptx.emit_ptx(_chunk_kernel(on_gpu=True, dtype=dtype, lanes=lanes), architecture)
        assert text.count("cp.async.cg.shared.global") == (2 if lanes == 8 else 0)
        assert text.count("ld.global.v4") == (4 if lanes == 4 else 0)
        ptx.assemble(text, architecture)
    text = ptx.emit_ptx(_copy_kernel(on_gpu=True, zeros=True), architecture)
    assert text.count("cp.async.cg.shared.global") == 2 and re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", text)
    ptx.assemble(text, architecture)
