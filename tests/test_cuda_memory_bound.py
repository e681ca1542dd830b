"""The CUDA backend's memory-bound kernels in the shapes that reach a GPU's copy bandwidth:
maps that move 16 bytes a thread per operand (`ld.global.v4`) with a scalar tail, and
views that cannot (an unaligned slice) read element by element; rows a warp's, four to a
block, their folds combined by warp shuffles; ForEach kernels without a grid-stride loop,
so that their many pointers are not all held in registers. Each kernel's arithmetic,
compiled for the host, is checked against the numpy reference on random inputs, its outputs
filled with NaN first so that an element no thread writes shows. Nothing here runs on a GPU
(the instruction counts are read from the PTX, and ptxas's report where it is installed)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import random_array, run_gpu_kernels_on_host

import ranvier as rv
from ranvier.backends.cuda import kernels, launch, maps, ptx
from ranvier.errors import RanvierError

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

needs_ptxas = pytest.mark.skipif(ptx.ptxas_path() is None, reason="ptxas (CUDA toolkit or nvidia-cuda-nvcc) is not installed")


def _run_on_host(op, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The op's GPU kernels run on the host, the operands not given starting as NaN."""
    return run_gpu_kernels_on_host(op, values, fill=0xFF)


def _run_steps(flow, values: dict[str, np.ndarray]) -> tuple[list, dict[str, np.ndarray]]:
    """The flow compiled for the GPU (sm_90; no GPU needed) and each step's kernels run on
    the host in turn (`_run_on_host`): the steps, and every variable's final contents."""
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    data = dict(values)
    for step in cell.steps:
        got = _run_on_host(step.op, data)
        assert got["status"][0] == 0
        data.update({name: value for name, value in got.items() if name != "status"})
    return cell.steps, data


def _reference(flow, values: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    data = rv.Compiler("reference").compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    return {name: np.array(data[name]) for name in outputs}


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    assert not np.isnan(got.astype(np.float64)).any(), "an element was not written"
    tolerance = 1e-2 if dtype == "bfloat16" else 1e-6
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=tolerance)


def _ptx(op) -> str:
    module, _ = kernels.kernel_module(op)
    return ptx.emit_ptx(module)


# ---- maps: a vector of 16 bytes per operand, then a scalar tail ------------------------------


# (output dtype, elements): sizes a multiple of the lanes, with a tail of one and of lanes - 1,
# and smaller than one vector
MAP_CASES = [("bfloat16", 1024), ("bfloat16", 1001), ("bfloat16", 1007), ("bfloat16", 5), ("float32", 1024),
             ("float32", 1003), ("float32", 3)]


@pytest.mark.parametrize("dtype,size", MAP_CASES, ids=[f"{d}-{n}" for d, n in MAP_CASES])
def test_a_map_moves_16_bytes_a_thread_and_its_tail_one_element_each(dtype, size):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, y, scale = f.var("x", dtype, [size]), f.var("y", "float32", [size]), f.var("s", "float32", [])
    out = f.cast(f.cast(x, "float32") * y + scale, dtype)
    out.var.out = True
    values = {"f/x": random_array([size], dtype, seed=1), "f/y": random_array([size], "float32", seed=2),
              "f/s": np.float32(0.75)}
    (step,), got = _run_steps(flow, values)
    op = step.op
    _close(got[out.name], _reference(flow, values, [out.name])[out.name], dtype)
    lanes = 8 if dtype == "bfloat16" else 4
    (description,) = maps._describe(op)
    if size >= lanes:
        assert maps.vector_lanes(description) == lanes
        assert kernels._launches(op)[0][0] == size // lanes + size % lanes
        assert re.search(r"ld\.global(\.nc)?\.v4", _ptx(op)) and re.search(r"st\.global\.v4", _ptx(op))
    else:
        assert maps.vector_lanes(description) == 1


def test_a_broadcast_row_is_a_vector_and_a_broadcast_scalar_is_repeated():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, bias, gain = f.var("x", "float32", [48, 96]), f.var("b", "float32", [96]), f.var("g", "float32", [48, 1])
    out = (x + bias) * gain
    out.var.out = True
    values = {"f/x": random_array([48, 96], "float32", seed=3), "f/b": random_array([96], "float32", seed=4),
              "f/g": random_array([48, 1], "float32", seed=5)}
    (step,), got = _run_steps(flow, values)
    assert maps.vector_lanes(maps._describe(step.op)[0]) == 4
    _close(got[out.name], _reference(flow, values, [out.name])[out.name], "float32")


# the SwiGLU gradient as a Llama's training step fuses it: x, a broadcast 1, the up projection u
# and the output's gradient g in; the gradients of u and of x out
SWIGLU_GRADIENT = "$0=Sigmoid(%0);$1=Sub(%1,$0);$2=Mul(%0,$1);$3=Add(%1,$2);$4=Mul($0,$3);$5=Mul(%2,%3);$6=Silu(%0);" \
    "@0=Mul(%2,$6);@1=Mul($5,$4)"


@needs_ptxas
@pytest.mark.parametrize("dtype,size", [("bfloat16", 4099), ("float32", 4097)])
def test_a_map_of_many_operands_computes_lane_by_lane_in_few_registers(dtype, size):
    """The program runs one lane at a time between the vector loads and stores: its outputs
    equal the reference's (a tail too), and its kernel keeps to 64 registers without
    spilling (four blocks of 256 threads a multiprocessor). On whole vectors every lane's
    temporaries were live at once: 109 registers in bfloat16 (two blocks), 56 in float32."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, one, up, grad = (f.var(name, dtype, [] if name == "one" else [size]) for name in ("x", "one", "u", "g"))
    outputs = f.op("Calculate", [x, one, up, grad], 2, {"expr": SWIGLU_GRADIENT})
    for out in outputs:
        out.var.out = True
    values = {f"f/{name}": random_array([size], dtype, seed=k) for k, name in enumerate("xug")}
    values["f/one"] = np.ones([], np.float32)
    (step,), got = _run_steps(flow, values)
    want = _reference(flow, values, [out.name for out in outputs])
    for out in outputs:
        _close(got[out.name], want[out.name], dtype)
    assert maps.vector_lanes(maps._describe(step.op)[0]) == (8 if dtype == "bfloat16" else 4)
    module, (kernel,) = kernels.kernel_module(step.op)
    assembled = ptx.assemble(ptx.emit_ptx(module))
    assert assembled.registers(kernel.name) <= 64 and "0 bytes spill stores" in assembled.report, assembled.report


# (begin column, columns of the slice): an offset a multiple of four float32 (16 bytes) takes
# vectors; an offset of one, or a row length that is not, reads element by element
SLICE_CASES = [(4, 32, 4), (1, 32, 1), (4, 30, 1), (0, 40, 4)]


@pytest.mark.parametrize("begin,columns,lanes", SLICE_CASES, ids=[f"{b}+{c}" for b, c, _ in SLICE_CASES])
def test_a_slice_is_vectors_where_its_start_is_aligned_and_elements_where_not(begin, columns, lanes):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [9, 44])
    part = f.op("Slice", [x], None, {"begin": [0, begin], "size": [9, columns]})
    out = f.exp(part)
    out.var.out = True
    values = {"f/x": random_array([9, 44], "float32", seed=6)}
    steps, got = _run_steps(flow, values)
    assert [step.op.type for step in steps] == ["Slice", "Exp"]
    assert maps.vector_lanes(maps._describe(steps[0].op)[0]) == lanes
    _close(got[out.name], _reference(flow, values, [out.name])[out.name], "float32")


# ---- rows: a warp per short row, four to a block; a block's warps combined by shuffles ------


# (op, rows, length): short rows four to a block (seven: the last block's fourth warp has no
# row), and long rows over a block of four and of eight warps
ROW_CASES = [("RMSNorm", 7, 96), ("Softmax", 7, 200), ("RMSNorm", 3, 2000), ("Softmax", 2, 9000), ("LogSoftmax", 5, 1030)]


@pytest.mark.parametrize("name,rows,length", ROW_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in ROW_CASES])
def test_rows_are_a_warps_four_to_a_block_or_a_blocks_and_match_the_reference(name, rows, length):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [rows, length])
    values = {"f/x": random_array([rows, length], "float32", seed=7)}
    inputs = [x]
    if name == "RMSNorm":
        inputs.append(f.var("g", "float32", [length]))
        values["f/g"] = random_array([length], "float32", seed=8)
    out = f.op(name, inputs, None, {})
    out.var.out = True
    op = out.var.producer
    got = _run_on_host(op, values)
    _close(got[out.name], _reference(flow, values, [out.name])[out.name], "float32")
    (kernel,) = kernels.kernel_module(op)[1]
    assert (kernel.elements, kernel.threads) == ((-(-rows // 4), 128) if length <= 1024 else (rows, 128 if length <= 8192 else 256))
    text = _ptx(op)
    # a warp's lanes are combined by shuffles; a block's warps through shared memory and barriers
    assert "shfl.sync.down" in text
    assert ("bar.sync" in text) == (length > 1024)


# ---- a ForEach: a thread per element, no loop holding every pointer in registers --------------


def test_a_foreach_launch_covers_its_elements_without_a_grid_stride_loop():
    assert launch.covering_launch(10**8, 0, 80) == launch.LaunchShape(-(-10**8 // 256), 256)
    assert launch.covering_launch(100, 0, 80) == launch.LaunchShape(1, 128)
    assert launch.covering_launch(5000, 128, 40) == launch.LaunchShape(5000, 128)
    with pytest.raises(RanvierError, match="does not fit a multiprocessor"):
        launch.covering_launch(10, 1024, 255)


# ---- a Llama training step's PTX: what a regression of the above would show --------------------


@pytest.mark.slow
@needs_ptxas
def test_a_llama_training_steps_ptx_loads_16_bytes_and_folds_rows_by_shuffles(monkeypatch):
    """stories15M's training step (2 × 32 tokens, bfloat16 activations, AdamW with clipping)
    as benchmarks/llama_train.py --backend cuda compiles it, counted in its PTX and ptxas's
    report. Before vector maps, warp shuffles and one-pass ForEach kernels it had 1,634
    global loads, none of 16 bytes, 20 shuffles (the attention's), and ForEach kernels of
    up to 201 registers a thread. (Since a ForEach's code is a body per member program, not
    per member, the counts are of fewer lines: 536 loads, 32 of 16 bytes, 134 shuffles.)
    Every ForEach of updates and casts loads and stores 16 bytes."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from common import ranvier_trainer
    finally:
        sys.path.remove(str(BENCHMARKS))
    from ranvier.models.llama import PRESETS, Llama

    compiled = []
    compile_flow = rv.Compiler.compile
    monkeypatch.setattr(rv.Compiler, "compile", lambda self, flow, *more: compiled.append(compile_flow(self, flow, *more)) or compiled[-1])
    monkeypatch.delenv("RANVIER_CUDA_DEVICE", raising=False)
    with contextlib.suppress(RanvierError):  # the instance needs a GPU; the cell is compiled by then
        ranvier_trainer(Llama(dataclasses.replace(PRESETS["stories15M"], max_seq_len=32), seed=0), 2, 32, "bfloat16",
                        backend="cuda", precision="bfloat16")
    cell = compiled[0].cell("train")
    text = cell.backend.code(cell, "ptx")
    loads = re.findall(r"\bld\.global\S*", text)
    wide = [load for load in loads if ".v4" in load]
    assert len(wide) >= 24 and len(re.findall(r"\bst\.global\S*\.v4", text)) >= 16, (len(wide), len(loads))
    assert len(re.findall(r"\bshfl\.sync", text)) >= 100
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n}\n", text, re.DOTALL))
    updates = [name for name in bodies if name.endswith("_foreach") and ("Calculate" in name or "Cast" in name)]
    assert updates and all("ld.global.v4" in bodies[n] and "st.global.v4" in bodies[n] for n in updates), updates
    report = ptx.assemble(text).report
    reported = re.findall(r"Compiling entry function '([^']+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers", report, re.DOTALL)
    assert not [name for name, spilled, _ in reported if int(spilled)], "no kernel spills"
    foreach = {name: int(registers) for name, _, registers in reported if name.endswith("_foreach")}
    assert foreach and max(foreach.values()) <= 96, foreach
