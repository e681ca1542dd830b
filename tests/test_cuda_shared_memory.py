"""A block kernel's shared memory past 48 KB (`ranvier.backends.cuda.blocks`: the module
docstring): its arrays become slices of the module's dynamic shared memory, which the
launch sizes and the driver allows the function when it loads it; under 48 KB they stay
static variables. Checked with a stand-in kernel of two arrays — the first filled, then
the second, then the first read back, so slices that overlapped would show — on the host
emulator (and the GPU where there is one) against numpy, its PTX by ptxas for sm_90, and
what the runtime hands the driver on the stand-in for libcuda."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import random_array
from test_cuda_runtime import _RecordingDriver

import ranvier as rv
from ranvier import dtypes
from ranvier.backends.cuda import backend, blocks, driver, kernels, ptx
from ranvier.backends.cuda.blocks import BlockProgram
from ranvier.backends.cuda.launch import LaunchShape, Multiprocessor, block_launch, resident_blocks
from ranvier.backends.cuda.library import LIBRARY, Generator
from ranvier.backends.llvm.values import index_value
from ranvier.errors import RanvierError

ROWS, THREADS = 3, 128
FLOAT, INT = dtypes.DT_FLOAT32, dtypes.DT_INT32
# (floats in the first array, integers in the second): 32 + 24 KB, past the static limit; 16 + 8 KB, under it
LARGE, SMALL = (8192, 6144), (4096, 2048)


def _through_shared(first: int, second: int):
    """A stand-in kernel for a Softmax over [ROWS, first], a block per row:
    y[r, e] = x[r, first − 1 − e] + 3·(e mod second), by way of a shared array of the
    row's floats and a second of the integers 3·i."""

    def row(program: BlockProgram, op, index) -> None:
        ctx = program.ctx
        x, y = op.inputs[0], op.outputs[0]
        floats, integers = program.shared(FLOAT, first), program.shared(INT, second)
        with program.phase() as thread, ctx.loop(thread, first, step=THREADS) as e:
            floats.store(e, ctx.load(x, index * first + e))
        with program.phase() as thread, ctx.loop(thread, second, step=THREADS) as e:
            integers.store(e, (e * 3).cast(INT))
        with program.phase() as thread, ctx.loop(thread, first, step=THREADS) as e:
            ctx.store(y, index * first + e, floats.load(first - 1 - e) + integers.load(e % second).cast(FLOAT))

    def launches(op):
        return [(ROWS, lambda ctx, index: row(BlockProgram(ctx, THREADS, ctx.on_gpu), op, index_value(ctx.b, index)), THREADS)]

    return Generator("ThroughShared", frozenset({"Softmax"}), launches)


def _expected(x: np.ndarray, second: int) -> np.ndarray:
    return x[:, ::-1] + (3 * (np.arange(x.shape[1]) % second)).astype(np.float32)


def _cell(monkeypatch, first: int, second: int):
    """A cell of one Softmax over [ROWS, first], which the stand-in kernel runs."""
    monkeypatch.setattr(LIBRARY, "kernels", [_through_shared(first, second), *LIBRARY.kernels])
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    f.softmax(f.var("x", FLOAT, [ROWS, first])).var.out = True
    cell = rv.Compiler("cuda", cache=False).compile(flow).cell("f")
    (step,) = cell.steps
    assert step.kernel == "ThroughShared"
    return cell


@pytest.mark.parametrize("arrays", [LARGE, SMALL], ids=["56KB", "24KB"])
def test_shared_arrays_past_48_kb_are_slices_of_dynamic_shared_memory_at_16_byte_offsets(monkeypatch, arrays):
    """Past 48 KB the module declares its extern shared array and the kernel reads its
    slices (the second from the first's bytes on), none of its own; under 48 KB each array
    is a static variable and nothing is dynamic. ptxas for sm_90 accepts either, the
    dynamic kernel reporting no static shared memory, no spills."""
    first, second = arrays
    cell = _cell(monkeypatch, first, second)
    (kernel,) = cell.native.kernels[0]
    assert kernel.shared_bytes == 4 * (first + second)
    dynamic = arrays == LARGE
    assert kernel.dynamic_shared_bytes == (kernel.shared_bytes if dynamic else 0)
    text = cell.native.ptx
    assert (".extern .shared .align 16 .b8 dynamic_shared[];" in text) == dynamic
    static = re.findall(r"^\s*\.shared \.align 16 \.b8 ([\w$]+)\[(\d+)\];", text, re.MULTILINE)
    assert static == ([] if dynamic else [("shared", str(4 * first)), ("shared_$_1", str(4 * second))])
    slices = re.findall(r'@"dynamic_shared", i32 0, i32 (\d+)\)', str(cell.native.module))
    assert list(dict.fromkeys(slices)) == (["0", str(4 * first)] if dynamic else [])  # the second array's from the first's bytes on
    if ptx.ptxas_path() is None:
        pytest.skip("needs ptxas (CUDA toolkit or nvidia-cuda-nvcc) for the rest")
    report = ptx.assemble(text, "sm_90").report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    used = re.search(r"Used (\d+) registers.*", report)
    assert used is not None
    assert ("smem" not in used.group(0)) == dynamic, used.group(0)  # ptxas counts static shared memory alone
    print(used.group(0))


@pytest.mark.parametrize("arrays", [LARGE, SMALL], ids=["56KB", "24KB"])
def test_a_kernel_of_dynamic_shared_memory_computes_what_numpy_does(monkeypatch, on_device, arrays):
    """On the host emulator the slices are of one array on the stack, laid out as on the
    GPU; on a GPU the launch passes the bytes the driver allowed the function. Every
    element written (the emulator's fresh memory is NaN), each equal to numpy's, on the
    first compute and on the graph's replays."""
    first, second = arrays
    data = _cell(monkeypatch, first, second).instance()
    x = random_array([ROWS, first], FLOAT, seed=9)
    data["f/x"] = x
    for _ in range(3):  # kernel by kernel, then captured as a graph, then replayed
        data.compute()
        np.testing.assert_array_equal(data[data.cell.steps[0].op.outputs[0].name], _expected(x, second))


def _on_stand_in(monkeypatch, events: list, shared_per_block: int = 227 * 1024):
    fake = _RecordingDriver(events)
    fake.shared_per_block = shared_per_block
    gpu = driver.DriverGPU(lambda name: fake)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    return gpu


@pytest.mark.parametrize("arrays", [LARGE, SMALL], ids=["56KB", "24KB"])
def test_the_driver_allows_the_function_its_dynamic_shared_memory_and_each_launch_passes_it(monkeypatch, arrays):
    """On the stand-in for libcuda: loading the module sets the function's
    MAX_DYNAMIC_SHARED_SIZE_BYTES to the kernel's bytes, once, before its first launch;
    every launch (those captured into the graph too) passes them as sharedMemBytes. A
    kernel under 48 KB sets nothing and passes 0."""
    events: list = []
    _on_stand_in(monkeypatch, events)
    first, second = arrays
    data = _cell(monkeypatch, first, second).instance()
    data["f/x"] = random_array([ROWS, first], FLOAT, seed=9)
    for _ in range(3):
        data.compute()
    calls = [call for call, _ in events]
    wanted = 4 * (first + second) if arrays == LARGE else 0
    allowed = [args[1:] for call, args in events if call == "cuFuncSetAttribute"]
    assert allowed == ([(driver._MAX_DYNAMIC_SHARED_SIZE_BYTES, wanted)] if wanted else [])
    if wanted:
        assert calls.index("cuFuncSetAttribute") < calls.index("cuLaunchKernel")
    launched = [args for call, args in events if call == "cuLaunchKernel"]
    captured = calls.index("cuStreamBeginCapture_v2") < len(calls) - calls[::-1].index("cuLaunchKernel")
    assert len(launched) == 2 and captured  # the first compute's launch, then the one the graph captured
    assert [(args[1], args[4], args[7]) for args in launched] == [(ROWS, THREADS, wanted)] * 2


def test_a_kernel_wanting_more_shared_memory_than_the_device_gives_a_block_is_named(monkeypatch):
    """The device's limit (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) is read
    when the device is found: a kernel past it fails to load, naming the kernel, its
    bytes and the limit. A compile holds kernels to the GPU's limit already, or without a
    GPU to Hopper's 227 KB."""
    events: list = []
    _on_stand_in(monkeypatch, events, shared_per_block=48 * 1024)
    cell = _cell(monkeypatch, *LARGE)
    with pytest.raises(RanvierError, match=r"kernel k_f_Softmax needs 57344 bytes of shared memory a block, but NVIDIA H100 "
                                           r"80GB HBM3 \(sm_90, 132 multiprocessors\) gives a block at most 49152 bytes"):
        cell.instance()
    assert "cuFuncSetAttribute" not in [call for call, _ in events]
    found = backend.CUDABackend().device  # a GPU here: held to its own limit
    where = re.escape(str(found)) if found else r"a Hopper GPU \(sm_90\)"
    with pytest.raises(RanvierError, match=rf"kernel k_f_Softmax needs 240000 bytes of shared memory a block, but {where} "
                                           rf"gives a block at most {found.shared_per_block if found else 232448} bytes"):
        _cell(monkeypatch, 40000, 20000)


def test_a_launch_shape_counts_its_blocks_shared_memory():
    """A multiprocessor's 228 KB hold two blocks of 100,000 bytes (each with the driver's
    1 KB), however few registers they take; a block past them fits none."""
    sm = Multiprocessor()
    assert resident_blocks(128, 32, sm) == 16 and resident_blocks(128, 32, sm, shared=100_000) == 2
    assert block_launch(1000, 128, 132, 32, shared=100_000) == LaunchShape(264, 128)
    with pytest.raises(RanvierError, match="100000 bytes of shared memory does not fit a multiprocessor"):
        block_launch(1000, 128, 132, 32, Multiprocessor(shared_memory=64 * 1024), shared=100_000)


def test_shared_arrays_take_whole_16_byte_rows():
    assert [blocks.shared_bytes(dtype, count) for dtype, count in [(FLOAT, 4), (FLOAT, 5), (dtypes.DT_BFLOAT16, 1),
                                                                  (dtypes.DT_INT64, 3), (dtypes.DT_BOOL, 17)]] == [16, 32, 16, 32, 32]
    assert kernels.GPUKernel("k", (), 1).dynamic_shared_bytes == 0
