"""The CUDA backend's device-free parts: every elementwise op with a formula, fused
Calculate programs and reductions generate GPU kernels that NVIDIA's assembler accepts for
Hopper and Ampere (skipped where ptxas is missing); the same kernels' arithmetic, compiled
for the host, equals the CPU backend's bit for bit on random, broadcast inputs (and the
numpy reference, for reductions summed in another order); launch shapes follow the
multiprocessor's limits; and a machine without a GPU gets an error naming what is
missing. Nothing here runs on a GPU (tests/test_cuda_runtime.py runs cells on the device, or
on its host emulation)."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_within_bound, attention_with_gradient, np_dtype, random_array, run_gpu_kernels_on_host

import ranvier as rv
from ranvier.backends import compile_cache
from ranvier.backends.cuda import attention, backend, device, driver, kernels, launch, ptx
from ranvier.backends.llvm.irutil import storage_type
from ranvier.errors import RanvierError
from ranvier.ops import TensorType, all_ops, define, has_op

FORMULA_OPS = sorted(name for name, d in all_ops().items() if d.family == "elementwise" and d.formula is not None and name != "Identity")
LOGICAL = {"Not", "And", "Or", "Xor", "AndNot"}
CONDITIONS = {"Cond", "Select"}  # the first input is a bool
INTEGERS = {"RandomUniform"}  # every input is an int32
SHAPE = [3, 5, 7]
BROADCASTS = [[3, 5, 7], [5, 1], [3, 1, 7]]  # the inputs' shapes, in turn: a full one, then broadcast ones
# ops checked in more dtypes than float32: integer arithmetic, doubles, and half-precision loads and stores
MORE_DTYPES = {"Add": ["int32", "int8", "float64", "float16", "bfloat16"], "Div": ["int32", "float64"],
               "Mul": ["int64", "bfloat16"], "Maximum": ["uint8", "float16"], "Less": ["int16", "float64"],
               "Exp": ["float64", "float16"], "Tanh": ["bfloat16"], "Neg": ["int32"], "Abs": ["int8"]}
INTEGER_ONLY = {"BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "ShiftLeft", "ShiftRight"}
MORE_DTYPES.update({"ShiftLeft": ["int8", "uint16", "int64"], "ShiftRight": ["int8", "uint8", "int64"]})
CASES = [(name, "int32" if name in INTEGER_ONLY else "float32") for name in FORMULA_OPS] + \
    [(name, dt) for name, extra in MORE_DTYPES.items() for dt in extra]

needs_ptxas = pytest.mark.skipif(ptx.ptxas_path() is None, reason="ptxas (CUDA toolkit or nvidia-cuda-nvcc) is not installed")


def _single_op_flow(name: str, dtype: str):
    """A flow of one op on random inputs of `dtype` (bools where the op wants them), the
    inputs broadcast against SHAPE; returns the flow, the op and the inputs' values."""
    definition = all_ops()[name]
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    count = definition.min_inputs
    tensors, values = [], {}
    for i in range(count):
        kind = "bool" if name in LOGICAL or (name in CONDITIONS and i == 0) else "int32" if name in INTEGERS else dtype
        shape = BROADCASTS[i]
        tensor = f.var(f"in{i}", kind, shape)
        values[tensor.name] = random_array(shape, kind, seed=i + 1)
        tensors.append(tensor)
    attrs = {"Cast": {"dtype": "float16"}, "Bitcast": {"dtype": "int32"}}.get(name, {})
    out = f.op(name, tensors, None, attrs)
    out.var.out = True
    return flow, out.var.producer, values


def _cpu_outputs(flow, op, values) -> list[np.ndarray]:
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    return [np.array(data[v.name]) for v in op.outputs]


def _assembles(op) -> int:
    """The op's kernel assembles for sm_90 (where ptxas is installed): its elements."""
    module, (kernel,) = kernels.kernel_module(op)
    if ptx.ptxas_path() is not None:
        assert ptx.assemble(ptx.emit_ptx(module)).registers(kernel.name) > 0
    return kernel.elements


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_the_kernels_arithmetic_equals_the_cpu_backends_bit_for_bit(name, dtype):
    flow, op, values = _single_op_flow(name, dtype)
    want = _cpu_outputs(flow, op, values)
    got = run_gpu_kernels_on_host(op, values)
    for var, expected in zip(op.outputs, want):
        result = got[var.name]
        assert result.dtype == expected.dtype and result.shape == expected.shape
        assert result.tobytes() == expected.tobytes(), f"{name} {dtype}: {result} vs {expected}"


@needs_ptxas
@pytest.mark.parametrize("architecture", ["sm_90", "sm_80"])
def test_every_formula_op_assembles_for_the_gpu(architecture):
    """One module per op; ptxas accepts each and reports its registers (no spills)."""
    for name, dtype in CASES:
        _, op, _ = _single_op_flow(name, dtype)
        module, (kernel,) = kernels.kernel_module(op, architecture)
        text = ptx.emit_ptx(module, architecture)
        assert f".visible .entry {kernel.name}(" in text and f".target {architecture}" in text
        assembled = ptx.assemble(text, architecture)
        assert assembled.cubin and 0 < assembled.registers(kernel.name) <= 255, name
        assert "0 bytes spill stores" in assembled.report, f"{name} spills registers"


def _fused_step(build):
    """The first Calculate the CPU compile fuses out of `build(f)`'s ops, with the cell."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    build(f)
    cell = rv.Compiler("cpu").compile(flow).cell("f")
    (step,) = [s for s in cell.steps if s.op.type == "Calculate"]
    return cell, step.op


def _adam_like(f):
    w, m, v, g = (f.var(n, "float32", [6, 50]) for n in "wmvg")
    lr = f.var("lr", "float32", [])
    new_m = m * 0.9 + g * 0.1
    new_v = v * 0.999 + g * g * 0.001
    new_w = w - lr * new_m / (f.sqrt(new_v) + 1e-8)
    for t in (new_m, new_v, new_w):
        t.var.out = True


def _gelu_and_mask(f):
    x, b = f.var("x", "float32", [4, 33]), f.var("b", "float32", [33])
    h = x + b
    (f.gelu(h) * f.cast(h > 0.5, "float32")).var.out = True
    f.tanh(h).var.out = True


@pytest.mark.parametrize("build", [_adam_like, _gelu_and_mask])
def test_a_fused_calculate_program_becomes_one_kernel_with_the_cpus_arithmetic(build):
    cell, op = _fused_step(build)
    values = {v.name: random_array(v.shape, v.dtype, seed=k, low=0.1 if v.name == "f/v" else -3)
              for k, v in enumerate(op.inputs) if not v.constant}
    values.update({v.name: np.asarray(v.data).reshape(v.shape) for v in op.inputs if v.constant})
    data = cell.instance()
    for name, value in values.items():
        if not cell.network.flow.vars[name].constant:
            data[name] = value
    data.compute()
    got = run_gpu_kernels_on_host(op, values)
    for var in op.outputs:
        assert got[var.name].tobytes() == np.array(data[var.name]).tobytes(), var.name
    _assembles(op)


def _large_maps(f):
    """Maps of four elements a thread: an update in place over a ragged size (67,591: a
    launch of 16,898 groups, the last of three past the end), broadcast inputs, bfloat16
    loads and stores; and a transposed copy."""
    w = f.parameter("w", random_array([257, 263], "float32", seed=1))
    x, b = f.var("x", "bfloat16", [257, 263]), f.var("b", "float32", [263])
    lr = f.var("lr", "float32", [])
    h = f.cast(x, "float32") + b
    f.op("Calculate", [w, h, lr], None, {"expr": "$0=Mul(%1,%2);%0=Sub(%0,$0)"})
    f.cast(f.gelu(h), "bfloat16").var.out = True
    f.transpose(h, [1, 0]).var.out = True


def test_a_large_map_takes_four_elements_a_thread_and_loads_them_first():
    flow = rv.Flow()
    _large_maps(rv.Builder(flow, "f"))
    values = {"f/x": random_array([257, 263], "bfloat16", seed=2), "f/b": random_array([263], "float32", seed=3),
              "f/lr": np.float32(0.25)}
    cpu = rv.Compiler("cpu").compile(flow)
    data = cpu.cell("f").instance()
    for name, value in values.items():
        data[name] = value
    before = np.array(cpu["f/w"])
    data.compute()
    for step in cpu.cell("f").steps:
        op = step.op
        if not kernels.supports(op):
            continue
        inputs = {v.name: np.array(data[v.name]) if v.name != "f/w" else before for v in op.inputs if not v.constant}
        inputs.update({v.name: np.asarray(v.data).reshape(v.shape) for v in op.inputs if v.constant})
        got = run_gpu_kernels_on_host(op, inputs)
        assert got["status"][0] == 0
        for var in [*op.outputs, *(v for v in op.inputs if v.name == "f/w")]:
            want = np.array(cpu["f/w"] if var.name == "f/w" else data[var.name])
            assert got[var.name].tobytes() == want.tobytes(), (op.type, var.name)
        if op.outputs and op.outputs[0].size == 257 * 263:
            assert _assembles(op) == -(-257 * 263 // 4)


REDUCTION_CASES = [  # op, dtype, input shape, axes (None: all)
    ("Sum", "float32", [6, 40], [1]), ("Sum", "float32", [6, 40, 3], [1]), ("Mean", "float32", [4, 5, 6], [0, 1]),
    ("Max", "float32", [7, 9], [0]), ("Min", "float64", [7, 9], None), ("Product", "float32", [3, 8], [1]),
    ("Sum", "int32", [5, 11], [1]), ("Max", "int8", [4, 6, 5], [2]), ("All", "bool", [6, 7], [1]),
    ("Any", "bool", [6, 7], [0]), ("Mean", "float16", [8, 30], [1]), ("Sum", "bfloat16", [3, 16, 4], [1]),
    ("ArgMax", "float32", [5, 9, 4], 1), ("ArgMin", "int32", [7, 6], -1),
    # long axes, few outputs: a block per output element (32, 128 and 256 threads)
    ("Sum", "float32", [3, 5000], [1]), ("Max", "float64", [300, 4], [0]), ("Mean", "float32", [70000], None),
    ("Sum", "int32", [2, 100, 3], [1]),
    ("SumSquares", "float32", [6, 40, 3], [1]), ("SumSquares", "float32", [3, 5000], [1]),
]


@pytest.mark.parametrize("name,dtype,shape,axes", REDUCTION_CASES, ids=[f"{c[0]}-{c[1]}-{len(c[2])}d" for c in REDUCTION_CASES])
def test_a_reduction_matches_the_reference_a_thread_or_a_block_per_output(name, dtype, shape, axes):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", dtype, shape)
    attrs = {} if axes is None else {"axis": axes}
    if name.startswith("Arg"):
        attrs["output_type"] = "int64"
    out = f.op(name, [x], None, attrs)
    out.var.out = True
    op = out.var.producer
    values = {"f/x": random_array(shape, dtype, seed=3, low=0.5 if name == "Product" else -3, high=1.5 if name == "Product" else 3)}
    got = run_gpu_kernels_on_host(op, values)[out.var.name]
    data = rv.Compiler("reference").compile(flow).cell("f").instance()
    data["f/x"] = values["f/x"]
    data.compute()
    want = np.array(data[out.var.name])
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype.kind in "fV":  # floats, bfloat16 among them: summed in another order
        reduced = int(np.prod(shape)) // want.size
        magnitude = np.abs(values["f/x"].astype(np.float64))
        summed = np.sum(magnitude, axis=None if axes is None else tuple(np.atleast_1d(axes))) / (reduced if name == "Mean" else 1)
        scale = summed if name in ("Sum", "Mean") else np.abs(want.astype(np.float64))  # SumSquares: positive terms
        float32_eps = float(np.finfo(np.float32).eps)
        compute_eps = float(np.finfo(np.float64).eps) if dtype == "float64" else float32_eps
        bound = (reduced * compute_eps + float(ml_dtypes.finfo(want.dtype).eps)) * scale
        assert_within_bound(got, want, bound, slack=0.0)
    else:
        np.testing.assert_array_equal(got, want)
    assert _assembles(op) == want.size
    (kernel,) = kernels.kernel_module(op)[1]
    reduced = int(np.prod(shape)) // max(1, want.size)
    assert kernel.threads == (0 if reduced < 64 or name.startswith("Arg") or dtype == "bool" else
                              32 if reduced <= 1024 else 128 if reduced <= 8192 else 256)


if not has_op("GpuTestOpaque"):
    # A user's op with a reference and nothing else: no kernel on any backend but the reference.
    define("GpuTestOpaque", lambda ctx: [TensorType(ctx.inputs[0].dtype, ctx.inputs[0].shape)],
           lambda attrs, args, outs: [np.asarray(args[0], np.float64) * 3.0], 1, "test")


def test_an_op_without_a_gpu_kernel_is_refused_by_name():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.op("GpuTestOpaque", [f.var("a", "float32", [2, 3])])
    with pytest.raises(RanvierError, match=r"GpuTestOpaque\).*no GPU kernel computes it yet"):
        kernels.kernel_module(y.var.producer)


PRODUCT_CASES = [  # A's shape, B's shape, transpose_a, transpose_b, dtype
    ([5, 7], [7, 3], False, False, "float32"), ([7, 5], [3, 7], True, True, "float64"),
    ([2, 3, 5, 7], [7, 4], False, False, "float32"), ([3, 7, 5], [1, 7, 6], True, False, "float32"),
    ([2, 1, 5, 7], [3, 6, 7], False, True, "float16"),
]


@pytest.mark.parametrize("a_shape,b_shape,ta,tb,dtype", PRODUCT_CASES)
def test_a_product_is_one_thread_per_output_element_and_matches_the_reference(a_shape, b_shape, ta, tb, dtype):
    """Batched (broadcast as numpy does), either side transposed: every element written,
    equal to the float64 product to the dtype's rounding."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.matmul(f.var("a", dtype, a_shape), f.var("b", dtype, b_shape), transpose_a=ta, transpose_b=tb)
    y.var.out = True
    values = {"f/a": random_array(a_shape, dtype, seed=31), "f/b": random_array(b_shape, dtype, seed=32)}
    got = run_gpu_kernels_on_host(y.var.producer, values)[y.var.name]
    a, b = (values[n].astype(np.float64) for n in ("f/a", "f/b"))
    want = (np.swapaxes(a, -1, -2) if ta else a) @ (np.swapaxes(b, -1, -2) if tb else b)
    tolerance = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tolerance, atol=tolerance)
    assert _assembles(y.var.producer) == y.var.size


def test_the_kernels_operands_are_each_variable_once_in_a_stable_order():
    _, op, _ = _single_op_flow("Add", "float32")
    _, (kernel,) = kernels.kernel_module(op)
    assert [v.name for v in kernel.operands] == ["f/in0", "f/in1", op.outputs[0].name]
    assert kernel.elements == int(np.prod(SHAPE))
    parameters = [str(t) for t in kernels.kernel_module(op)[0].get_global(kernel.name).function_type.args]
    assert parameters == [str(storage_type("float32").as_pointer())] * 3 + ["i64*"]  # the operands, then the status word


# ---- launch shapes ---------------------------------------------------------------------------


def test_a_small_map_gets_one_thread_per_element_in_whole_warps():
    assert launch.map_launch(10, 132, 20) == launch.LaunchShape(1, 32)
    assert launch.map_launch(100, 132, 20) == launch.LaunchShape(1, 128)
    assert launch.map_launch(1000, 132, 20) == launch.LaunchShape(4, 256)


def test_a_large_map_fills_every_multiprocessor_once_and_loops():
    # 256 threads at 32 registers: 8 blocks by threads (2048), 8 by registers (65536 / 8192)
    assert launch.map_launch(10**8, 132, 32) == launch.LaunchShape(132 * 8, 256)
    # at 128 registers a block takes 32768: two fit
    assert launch.map_launch(10**8, 132, 128) == launch.LaunchShape(132 * 2, 256)
    # 255 registers are allotted as 256 per thread: one block of 256 threads fills a multiprocessor
    assert launch.map_launch(10**8, 8, 255) == launch.LaunchShape(8, 256)


def test_a_block_that_cannot_fit_and_an_empty_launch_are_refused():
    small = launch.Multiprocessor(registers=32768)
    with pytest.raises(RanvierError, match="does not fit a multiprocessor"):
        launch.map_launch(10**6, 4, 255, small)
    with pytest.raises(RanvierError, match="needs elements and multiprocessors"):
        launch.map_launch(0, 132, 20)
    with pytest.raises(RanvierError, match="expected a name like 'sm_90'"):
        ptx.target_machine("hopper")


def test_ptxas_is_found_in_either_cuda_wheel_layout(tmp_path):
    assert ptx.wheel_ptxas([str(tmp_path)]) is None
    for layout in ("cuda_nvcc", "cu13"):
        (tmp_path / layout / "bin").mkdir(parents=True)
        (tmp_path / layout / "bin" / "ptxas").write_text("")
    assert ptx.wheel_ptxas([str(tmp_path / "missing"), str(tmp_path)]) == str(tmp_path / "cu13" / "bin" / "ptxas")


# ---- finding a GPU ---------------------------------------------------------------------------


class _FakeDriver:
    """A stand-in for libcuda: each call fills its out-arguments, or fails with `fail`; its
    device an H100's (a block's shared memory at most `shared_per_block` bytes)."""

    def __init__(self, devices: int = 1, fail: dict[str, int] | None = None, shared_per_block: int = 227 * 1024):
        self.devices, self.fail, self.shared_per_block = devices, fail or {}, shared_per_block

    def __getattr__(self, call: str):
        def run(*args):
            if call in self.fail:
                return self.fail[call]
            if call == "cuDeviceGetCount":
                args[0]._obj.value = self.devices
            elif call == "cuDeviceGetName":
                args[0].value = b"NVIDIA H100 80GB HBM3"
            elif call == "cuDeviceGetAttribute":
                args[0]._obj.value = {75: 9, 76: 0, 16: 132, 97: self.shared_per_block}[args[1]]
            elif call == "cuGetErrorName":
                args[1]._obj.value = {100: b"CUDA_ERROR_NO_DEVICE", 900: b"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                                      999: b"CUDA_ERROR_UNKNOWN"}[args[0]]
            return 0

        return run


def test_a_device_is_described_through_the_driver():
    device = driver.find_device(lambda name: _FakeDriver())
    assert device == driver.Device("NVIDIA H100 80GB HBM3", (9, 0), 132)
    assert device.architecture == "sm_90" and "132 multiprocessors" in str(device)


@pytest.mark.parametrize("fake,message", [
    (_FakeDriver(fail={"cuInit": 100}), "failed to start: CUDA_ERROR_NO_DEVICE"),
    (_FakeDriver(devices=0), "sees no GPU"),
    (_FakeDriver(fail={"cuDeviceGetAttribute": 999}), "failed to describe device 0: CUDA_ERROR_UNKNOWN"),
])
def test_what_the_driver_lacks_is_named(fake, message):
    with pytest.raises(RanvierError, match=message):
        driver.find_device(lambda name: fake)


def _missing(name):
    raise OSError(f"{name}: cannot open shared object file")


def test_without_a_driver_find_device_names_the_library():
    with pytest.raises(RanvierError, match="needs an NVIDIA GPU and its driver: libcuda.so.1 could not be loaded"):
        driver.find_device(_missing)
    assert "cuda" in rv.backends.backend_names()


def _mlp(f):
    x = f.var("x", "float32", [32, 784])
    w, b = f.const(random_array([784, 96], "float32", seed=1)), f.const(random_array([96], "float32", seed=2))
    h = f.gelu(x @ w + b)
    f.sum(f.transpose(h, [1, 0]), axis=[1]).var.out = True


def _compile_for_gpu(monkeypatch, device, build=_mlp):
    monkeypatch.setattr(backend, "find_device", device)
    flow = rv.Flow()
    build(rv.Builder(flow, "f"))
    return rv.Compiler("cuda").compile(flow).cell("f")


def test_without_a_gpu_a_cell_compiles_for_hopper_and_its_instance_names_what_is_missing(monkeypatch):
    cell = _compile_for_gpu(monkeypatch, lambda: driver.find_device(_missing))
    kinds = [step.kernel for step in cell.steps]
    assert kinds == ["cuBLASLt", "Map", "Copy", "Reduce"], kinds  # the bias and GELU stay one kernel, not an epilogue
    assert cell.steps[0].variant == "32×96×784 float32, compute 32F"
    text = cell.backend.code(cell, "ptx")
    assert text.count(".visible .entry") == 3 and ".target sm_90" in text
    if ptx.ptxas_path() is not None:
        assert all(step.variant.startswith("sm_90") for step in cell.steps[1:])
        assert "Map[sm_90 3 × 256]" in str(cell)  # 32 × 96 elements, four float32 a thread
        ptx.assemble(text)
    with pytest.raises(RanvierError, match="compiled for sm_90, but the CUDA backend needs an NVIDIA GPU and its driver"):
        cell.instance()
    with pytest.raises(RanvierError, match="'llvm' or 'ptx', not 'asm'"):
        cell.asm()


def _two_layers(f):
    x = f.var("x", "float32", [8, 16])
    for layer in range(2):
        w, b = f.var(f"w{layer}", "float32", [16, 16]), f.var(f"b{layer}", "float32", [16])
        x = f.gelu(x @ w + b)
    x.var.out = True


def test_steps_of_one_signature_share_their_kernels(monkeypatch):
    """A model's layers: the second layer's bias-and-GELU runs the first one's kernel on
    its own variables, so the module holds one (and compiles in a fraction of the time)."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    cell = _compile_for_gpu(monkeypatch, lambda: driver.find_device(_missing), _two_layers)
    maps = [index for index, step in enumerate(cell.steps) if step.kernel == "Map"]
    assert len(maps) == 2 and cell.native.owners == maps[:1]
    (first,), (second,) = (cell.native.kernels[index] for index in maps)
    assert first.name == second.name and first.operands != second.operands
    assert cell.backend.code(cell, "ptx").count(".visible .entry") == 1
    values = {f"f/{name}": random_array(shape, "float32", seed=i) * 0.5
              for i, (name, shape) in enumerate([("x", [8, 16]), ("w0", [16, 16]), ("b0", [16]), ("w1", [16, 16]), ("b1", [16])])}
    flow = rv.Flow()
    _two_layers(rv.Builder(flow, "f"))
    (out,) = [v.name for v in flow.vars.values() if v.out]
    results = []
    for data in (cell.instance(), rv.Compiler("cpu").compile(flow).cell("f").instance()):
        for name, value in values.items():
            data[name] = value
        data.compute()
        results.append(np.array(data[out]))
    np.testing.assert_allclose(*results, rtol=1e-5, atol=1e-6)


def test_a_cells_ptx_and_launch_shapes_are_kept_in_the_compile_cache(monkeypatch, tmp_path):
    from collections import OrderedDict

    monkeypatch.setenv("RANVIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_cache, "_MEMORY_CACHE", OrderedDict())
    first = _compile_for_gpu(monkeypatch, lambda: driver.find_device(_missing))
    again = _compile_for_gpu(monkeypatch, lambda: driver.find_device(_missing))
    compile_cache._MEMORY_CACHE.clear()
    from_disk = _compile_for_gpu(monkeypatch, lambda: driver.find_device(_missing))
    assert [c.native.origin for c in (first, again, from_disk)] == ["compiled", "memory", "disk"]
    assert first.backend.code(first, "ptx") == from_disk.backend.code(from_disk, "ptx")
    assert str(first) == str(from_disk)  # the same launch shapes, from the kept ptxas report
    assert first.native.cubin == from_disk.native.cubin  # the driver loads it without compiling the PTX
    assert first.native.cubin[:4] == (b"\x7fELF" if ptx.ptxas_path() else b"")
    other = _compile_for_gpu(monkeypatch, lambda: driver.Device("NVIDIA A100", (8, 0), 108))
    assert other.native.origin == "compiled" and ".target sm_80" in other.backend.code(other, "ptx")
    monkeypatch.setenv("RANVIER_ATTENTION_GRAD_BLOCKS_PER_SM", "3")  # launch bounds asked for: code of its own
    assert _compile_for_gpu(monkeypatch, lambda: driver.find_device(_missing)).native.origin == "compiled"


def test_a_found_gpu_sets_the_architecture_and_its_instances_go_to_the_driver(monkeypatch):
    cell = _compile_for_gpu(monkeypatch, lambda: driver.Device("NVIDIA A100", (8, 0), 108))
    assert ".target sm_80" in cell.backend.code(cell, "ptx")

    def refusing_driver():
        raise RanvierError("the CUDA driver failed to make a context: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(backend, "DriverGPU", refusing_driver)
    backend._driver_gpu.cache_clear()
    with pytest.raises(RanvierError, match="failed to make a context"):
        cell.instance()
    backend._driver_gpu.cache_clear()


def test_an_op_without_a_gpu_kernel_fails_the_compile_by_name(monkeypatch):
    def opaque(f):
        f.op("GpuTestOpaque", [f.var("x", "float32", [6, 4])]).var.out = True

    with pytest.raises(RanvierError, match="GpuTestOpaque op f/GpuTestOpaque has no GPU kernel yet"):
        _compile_for_gpu(monkeypatch, lambda: driver.find_device(_missing), opaque)


ROW_CASES = [  # op, attrs, dtype, row length: a short row, a head's, a vocabulary's (a block of 32, 128 or 256 threads)
    ("Softmax", {"axis": -1}, "float32", 7), ("LogSoftmax", {"axis": -1}, "float64", 40), ("Softmax", {"axis": -1}, "float16", 33),
    ("LayerNorm", {"eps": 1e-5}, "float32", 48), ("RMSNorm", {"eps": 1e-6}, "float32", 64),
    ("SoftmaxCrossEntropy", {}, "float32", 50), ("SoftmaxCrossEntropyGrad", {"with_loss": True}, "float32", 1000),
    ("SoftmaxCrossEntropyGrad", {"label_smoothing": 0.1}, "float32", 30), ("LayerNorm", {"eps": 1e-5}, "float32", 3000),
    ("SoftmaxCrossEntropyGrad", {"with_loss": True}, "float32", 9000),
    ("Rotary", {}, "float32", 48), ("Rotary", {"inverse": True}, "float64", 64),  # a head's pairs turned
    ("RMSNormGrad", {"eps": 1e-5}, "float32", 288), ("RMSNormGrad", {"eps": 1e-6}, "float32", 2000),
]


def _row_op(name, attrs, dtype, n, labels=None):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    rows = 6
    shape = [2, 3, n] if name.startswith(("Softmax", "Log")) and "Cross" not in name else [rows, n]
    x = f.var("x", dtype, [1, 3, 2, n] if name == "Rotary" else shape)  # Rotary: [B, T, H, D]
    values = {"f/x": random_array(x.shape, dtype, seed=4)}
    inputs = [x]
    if name == "Rotary":
        for k, table in enumerate(["cos", "sin"]):
            inputs.append(f.var(table, dtype, [3, n // 2]))
            values[f"f/{table}"] = random_array([3, n // 2], dtype, seed=7 + k)
    if name == "RMSNormGrad":  # a half-precision gradient beside float32 rows, and a gain
        inputs += [f.var("dy", "bfloat16", shape), f.var("gamma", dtype, [n])]
        values["f/dy"], values["f/gamma"] = random_array(shape, "bfloat16", seed=8), random_array([n], dtype, seed=9)
    if name in ("LayerNorm", "RMSNorm"):
        for k, extra in enumerate(["gamma", "beta"][: 2 if name == "LayerNorm" else 1]):
            inputs.append(f.var(extra, dtype, [n]))
            values[f"f/{extra}"] = random_array([n], dtype, seed=5 + k)
    if "CrossEntropy" in name:
        inputs.append(f.var("labels", "int32", [rows]))
        values["f/labels"] = np.array(labels if labels is not None else [3, 0, n - 1, 7, 1, 2], np.int32)
    if name == "SoftmaxCrossEntropyGrad":
        inputs.append(f.var("dloss", dtype, [rows]))
        values["f/dloss"] = random_array([rows], dtype, seed=6)
    outputs = f.op(name, inputs, None, dict(attrs))
    for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
        out.var.out = True
    return flow, (outputs[0] if isinstance(outputs, (list, tuple)) else outputs).var.producer, values


@pytest.mark.parametrize("name,attrs,dtype,n", ROW_CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in ROW_CASES])
def test_a_row_op_runs_the_cpus_row_passes_split_over_a_block(name, attrs, dtype, n):
    flow, op, values = _row_op(name, attrs, dtype, n)
    got = run_gpu_kernels_on_host(op, values)
    assert got["status"][0] == 0
    data = rv.Compiler("reference").compile(flow).cell("f").instance()
    for key, value in values.items():
        data[key] = value
    data.compute()
    for var in op.outputs:  # each within its own dtype's rounding (RMSNormGrad's dy·x̂ is dy's bfloat16)
        eps = float(ml_dtypes.finfo(np_dtype(var.dtype)).eps)
        want = np.array(data[var.name]).astype(np.float64)
        error = np.abs(got[var.name].astype(np.float64) - want)
        assert np.all(error <= 8 * eps * (np.abs(want) + 1) + (n * eps if var.dtype not in ("float16", "bfloat16") else 4 * eps)), (name, var.name, error.max())
    # six rows: a warp's each, four to a block of 128 threads, or a block's each
    assert _assembles(op) == (2 if n <= 1024 else 6)
    (kernel,) = kernels.kernel_module(op)[1]
    assert kernel.threads == (128 if n <= 8192 else 256)


def test_sampling_splits_each_pass_and_bisection_over_a_block():
    """SampleToken on a block of 128 threads per 5,000-word row: every cut and the token
    are the reference's (the uniform numbers lie mid-way in their tokens' shares), the
    probabilities within the block's summation order."""
    from ranvier.ops.sampling import pick, sample_distribution

    rows, n = 2, 5000
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    inputs = [f.var("l", "float32", [rows, n]), f.var("u", "float32", [rows]), f.var("t", "float32", []),
              f.var("k", "int32", []), f.var("p", "float32", [])]
    tokens, probabilities = f.sample_token(*inputs)
    logits = random_array([rows, n], "float32", seed=4)
    p = [sample_distribution(row, 0.9, 200, 1.0) for row in logits]
    top_p = float(np.mean(np.cumsum(np.sort(p[0])[::-1])[[29, 30]]))  # a nucleus of 31 in row 0
    p = [sample_distribution(row, 0.9, 200, top_p) for row in logits]
    uniform = np.array([np.cumsum(q)[pick(q, 0.4)] - q[pick(q, 0.4)] / 2 for q in p], np.float32)
    values = {"f/l": logits, "f/u": uniform, "f/t": np.float32(0.9), "f/k": np.int32(200), "f/p": np.float32(top_p)}
    op = tokens.var.producer
    got = run_gpu_kernels_on_host(op, values)
    assert got["status"][0] == 0
    assert got[tokens.name].tolist() == [pick(q, float(u)) for q, u in zip(p, uniform, strict=True)]
    np.testing.assert_allclose(got[probabilities.name], np.array(p), atol=1e-6)
    assert _assembles(op) == rows
    (kernel,) = kernels.kernel_module(op)[1]
    assert kernel.threads == 128


def _lookup(name, indices, oov=False, width=5):
    """A lookup into 9 rows of 2 × `width` (Gather) or of `width` + 4 columns (OneHot)."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    index = f.var("i", "int32", [len(indices)])
    values = {"f/i": np.array(indices, np.int32)}
    if name == "Gather":
        table = f.var("t", "float32", [9, 2, width])
        values["f/t"] = random_array([9, 2, width], "float32", seed=7)
        inputs = [table, index]
        if oov:
            inputs.append(f.var("oov", "float32", [2, width]))
            values["f/oov"] = random_array([2, width], "float32", seed=8)
        out = f.op("Gather", inputs, None, {})
    else:
        out = f.op("OneHot", [index], None, {"depth": width + 4})
    out.var.out = True
    return flow, out.var.producer, values


@pytest.mark.parametrize("width", [5, 300])  # rows of 10 and 9 elements (a thread each), of 600 and 304 (a warp)
@pytest.mark.parametrize("name,indices,oov", [("Gather", [3, 0, 8, 3], False), ("Gather", [3, -1, 12, 0], True),
                                             ("OneHot", [3, 0, 8, 3, -2, 9], False)])
def test_a_lookup_runs_a_thread_or_a_block_per_index_with_the_cpus_results(name, indices, oov, width):
    flow, op, values = _lookup(name, indices, oov, width)
    got = run_gpu_kernels_on_host(op, values)
    assert got["status"][0] == 0
    (want,) = _cpu_outputs(flow, op, values)
    assert got[op.outputs[0].name].tobytes() == want.tobytes()
    # a thread per short row, a warp per long one, four to a block
    assert _assembles(op) == (len(indices) if width == 5 else -(-len(indices) // 4))
    assert kernels.kernel_module(op)[1][0].threads == (0 if width == 5 else 128)


@pytest.mark.parametrize("before,after,value", [([0, 1, 2, 2], [0, 1, 2, 2], 0.0), ([1, 0, 0, 3], [0, 2, 1, 0], -1.5)])
def test_a_pad_is_one_thread_per_output_element_with_the_cpus_result(before, after, value):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [2, 3, 5, 4])
    out = f.op("Pad", [x], None, {"before": before, "after": after, "value": value})
    out.var.out = True
    values = {"f/x": random_array([2, 3, 5, 4], "float32", seed=9)}
    got = run_gpu_kernels_on_host(out.var.producer, values)[out.var.name]
    (want,) = _cpu_outputs(flow, out.var.producer, values)
    assert got.tobytes() == want.tobytes()


def _scatter(name, dtype="float32"):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    if name == "ScatterAdd":
        indices, updates = f.var("i", "int32", [6]), f.var("u", dtype, [6, 5])
        out = f.op("ScatterAdd", [indices, updates], None, {"rows": 4})
        values = {"f/i": np.array([1, 3, 1, 0, 3, 3], np.int32), "f/u": random_array([6, 5], dtype, seed=10)}
    else:  # the windows of a 3 × 3, stride 2 view of a 7 × 9 image: overlapping windows add up
        d = f.var("d", dtype, [3, 4, 3, 3])
        out = f.op("StridedScatterAdd", [d], None, {"offset": 0, "shape": [3, 4, 3, 3], "strides": [18, 2, 9, 1],
                                                   "target_shape": [7, 9]})
        values = {"f/d": random_array([3, 4, 3, 3], dtype, seed=11)}
    out.var.out = True
    return flow, out.var.producer, values


@pytest.mark.parametrize("dtype,atomic", [  # the hardware's atomic add, or a compare-and-swap loop on the word
    ("float32", "add.f32"), ("float64", "add.f64"), ("int32", "add.u32"), ("int64", "add.u64"), ("float16", "cas.b32"),
    ("bfloat16", "cas.b32"), ("int8", "cas.b32"), ("uint16", "cas.b32"),
])
@pytest.mark.parametrize("name", ["ScatterAdd", "StridedScatterAdd"])
def test_a_scatter_zeroes_then_adds_with_atomics_and_equals_the_cpu_in_index_order(name, dtype, atomic):
    flow, op, values = _scatter(name, dtype)
    got = run_gpu_kernels_on_host(op, values)
    assert got["status"][0] == 0
    (want,) = _cpu_outputs(flow, op, values)
    if dtype in ("float16", "bfloat16"):  # rounded after each add here; the CPU's reference rounds the sum once
        eps = float(ml_dtypes.finfo(np_dtype(dtype)).eps)
        np.testing.assert_allclose(got[op.outputs[0].name].astype(np.float64), want.astype(np.float64), rtol=4 * eps, atol=4 * eps)
    else:
        assert got[op.outputs[0].name].tobytes() == want.tobytes()
    module, launches = kernels.kernel_module(op)
    assert [k.elements for k in launches] == [op.outputs[0].size, op.inputs[-1].size]
    text = ptx.emit_ptx(module)
    assert re.search(rf"\b(atom|red)\.[a-z.]*{re.escape(atomic)}\b", text), atomic
    if ptx.ptxas_path() is not None:
        assembled = ptx.assemble(text)
        assert all(assembled.registers(k.name) > 0 for k in launches)


def test_a_gather_outside_its_table_sets_the_status_word():
    _, op, values = _lookup("Gather", [3, 9, 0])
    assert run_gpu_kernels_on_host(op, values)["status"][0] == 1


@pytest.mark.parametrize("name", ["TopK", "SoftmaxTopK"])
def test_a_router_row_takes_its_top_k_one_row_per_thread(name):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [5, 8])
    outputs = f.op(name, [x], None, {"k": 3})
    for out in outputs:
        out.var.out = True
    op = outputs[0].var.producer
    values = {"f/x": random_array([5, 8], "float32", seed=12)}
    values["f/x"][1, 2] = values["f/x"][1, 5]  # a tie goes to the lower index
    got = run_gpu_kernels_on_host(op, values)
    want = _cpu_outputs(flow, op, values)
    for var, expected in zip(op.outputs, want):
        if var.dtype == "float32" and name == "SoftmaxTopK":  # the softmax's sum in another order
            np.testing.assert_allclose(got[var.name], expected, rtol=4e-7, atol=0)
        else:
            assert got[var.name].tobytes() == expected.tobytes(), var.name
    _assembles(op)


def test_a_class_label_out_of_range_sets_the_kernels_status_word():
    _, op, values = _row_op("SoftmaxCrossEntropy", {}, "float32", 10, labels=[3, 0, 10, 7, 1, 2])
    assert run_gpu_kernels_on_host(op, values)["status"][0] == 1
    values["f/labels"][2] = 9
    assert run_gpu_kernels_on_host(op, values)["status"][0] == 0


def _copies(f):
    x = f.var("x", "float32", [6, 10, 40])
    z = f.var("z", "float32", [7, 7])
    for out in (f.transpose(x, [2, 0, 1]), f.slice(x, [1, 2, 3], [4, 7, 30]), f.broadcast_to(f.reshape(z, [7, 1, 7]), [7, 13, 7]),
                f.transpose(z), f.concat([x, f.slice(x, [0, 0, 0], [6, 10, 3])], axis=2)):
        out.var.out = True
    for part in f.split(x, 2, axis=1):
        part.var.out = True


@pytest.fixture
def networks(monkeypatch) -> list:
    """Every network compiled while the test runs (a trainer's, whose instances then fail)."""
    compiled = []
    compile_flow = rv.Compiler.compile
    monkeypatch.setattr(rv.Compiler, "compile", lambda self, flow, *more: compiled.append(compile_flow(self, flow, *more)) or compiled[-1])
    return compiled


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_training_step_compiles_for_the_gpu_whole(monkeypatch, networks, model):
    """Forward, loss and its gradient, backward products (a CNN's windows and their
    scatter-adds) and Adam: every step a GPU kernel or a planned product; only the
    instances need the device."""
    from ranvier.jobs.mnist import MnistConfig, make_trainer

    monkeypatch.setattr(backend, "find_device", lambda: driver.find_device(_missing))
    with pytest.raises(RanvierError, match="compiled for sm_90, but the CUDA backend needs an NVIDIA GPU"):
        make_trainer(MnistConfig(steps=1, backend="cuda", model=model))
    train = networks[0].cell("train")
    kinds = [step.kernel for step in train.steps]
    if model == "mlp":
        assert set(kinds) == {"cuBLASLt", "Map", "Copy", "Reduce", "Rows", "ForEach"}, kinds
        # the four parameters' Adam updates, as one kernel
        assert [(step.op.attrs["op"], step.op.attrs["count"]) for step in train.steps if step.kernel == "ForEach"] == [
            ("Calculate", "4")], [step.op.name for step in train.steps if step.kernel == "ForEach"]
        assert sum(kind == "cuBLASLt" for kind in kinds) == 5  # two forward products, three backward
        assert [step.op.type for step in train.steps if step.kernel == "Rows"] == ["SoftmaxCrossEntropyGrad"]
    else:
        assert {"cuBLASLt", "Pad", "Scatter", "Reduce", "Rows"} <= set(kinds), kinds
    if ptx.ptxas_path() is not None:
        ptx.assemble(train.backend.code(train, "ptx"))


def test_copies_through_views_equal_the_cpu_backends():
    flow = rv.Flow()
    _copies(rv.Builder(flow, "f"))
    values = {"f/x": random_array([6, 10, 40], "float32", seed=1), "f/z": random_array([7, 7], "float32", seed=2)}
    copies = [op for op in flow.ops.values() if op.type in ("Transpose", "Slice", "BroadcastTo", "Reshape", "Concat", "Split")]
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    reshaped = {}
    for op in copies:
        inputs = {**values, **reshaped}
        ran = run_gpu_kernels_on_host(op, inputs)
        for out in op.outputs:
            reshaped[out.name] = ran[out.name]
            if out.out:
                assert ran[out.name].tobytes() == np.array(data[out.name]).tobytes(), op.type


def _route(capacity: int, choices: np.ndarray):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    experts = f.var("experts", "int32", list(choices.shape))
    outputs = f.op("MoERoute", [experts], None, {"experts": 4, "capacity": capacity})
    for out in outputs:
        out.var.out = True
    return flow, outputs[0].var.producer, {"f/experts": choices}


@pytest.mark.parametrize("capacity", [0, 3])
def test_the_routing_sort_runs_in_one_thread_with_the_cpus_result(capacity):
    """Every choice placed (or dropped at capacity) as the CPU places it: order, slot,
    offsets, kept and counts equal bit for bit; an expert out of range sets the status."""
    choices = np.random.default_rng(5).integers(0, 4, (9, 2)).astype(np.int32)
    choices[4] = [3, 3]  # one expert twice over: more than capacity 3 wants it
    flow, op, values = _route(capacity, choices)
    got = run_gpu_kernels_on_host(op, values)
    assert got["status"][0] == 0
    for var, expected in zip(op.outputs, _cpu_outputs(flow, op, values)):
        assert got[var.name].tobytes() == expected.tobytes(), var.name
    assert _assembles(op) == 1
    values["f/experts"][2, 1] = 4
    assert run_gpu_kernels_on_host(op, values)["status"][0] == 1


def _grouped(op_type: str, dtype: str, transposed: bool, offsets: list[int], rows: int = 10, k: int = 5, n: int = 7):
    """A grouped product (or its weight gradient) of 3 experts over 10 rows, K 5, N 7 (unless given)."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    experts = len(offsets) - 1
    x = f.var("x", dtype, [rows, k])
    groups = f.var("offsets", "int32", [experts + 1])
    if op_type == "GroupedMatMul":
        w = f.var("w", dtype, [experts, n, k] if transposed else [experts, k, n])
        out = f.op(op_type, [x, w, groups], None, {"transpose_b": transposed})
        values = {"f/w": random_array(list(w.shape), dtype, seed=22)}
    else:
        dy = f.var("dy", dtype, [rows, n])
        out = f.op(op_type, [x, dy, groups], None, {"experts": experts, "transpose": transposed})
        values = {"f/dy": random_array([rows, n], dtype, seed=23)}
    out.var.out = True
    values.update({"f/x": random_array([rows, k], dtype, seed=21), "f/offsets": np.array(offsets, np.int32)})
    return out.var.producer, values


GROUPED_CASES = [(op_type, dtype, transposed) for op_type in ("GroupedMatMul", "GroupedMatMulWeightGrad")
                 for dtype in ("float32", "float64") for transposed in (False, True)]


@pytest.mark.parametrize("op_type,dtype,transposed", GROUPED_CASES)
def test_a_grouped_product_is_one_thread_per_output_and_matches_the_reference(op_type, dtype, transposed):
    """Groups of 4, 0 and 3 rows, then 3 rows no group holds (dropped at capacity): those
    rows, and the gradient of the expert no row chose, are zeros; every element is
    written, and equals the float64 reference to the dtype's rounding."""
    from ranvier.ops.moe import grouped_matmul, grouped_matmul_weight_grad

    op, values = _grouped(op_type, dtype, transposed, [0, 4, 4, 7])
    got = run_gpu_kernels_on_host(op, values)
    assert got["status"][0] == 0
    x, offsets = values["f/x"], values["f/offsets"]
    if op_type == "GroupedMatMul":
        want = grouped_matmul(x, values["f/w"], offsets, transposed)
        assert not want[7:].any()
    else:
        want = grouped_matmul_weight_grad(x, values["f/dy"], offsets, 3, transposed)
        assert not want[1].any()
    result = got[op.outputs[0].name]
    np.testing.assert_allclose(result, want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-6 if dtype == "float32" else 1e-13)
    assert _assembles(op) == op.outputs[0].size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["element-per-thread", "tensor-cores"])
@pytest.mark.parametrize("op_type", ["GroupedMatMul", "GroupedMatMulWeightGrad"])
def test_group_offsets_that_do_not_rise_set_the_status_word(op_type, dtype):
    op, values = _grouped(op_type, dtype, False, [0, 6, 4, 7])
    assert run_gpu_kernels_on_host(op, values)["status"][0] == 1
    op, values = _grouped(op_type, dtype, False, [0, 4, 6, 11])  # past the 10 rows
    assert run_gpu_kernels_on_host(op, values)["status"][0] == 1
    op, values = _grouped(op_type, dtype, False, [1, 4, 6, 7])  # rows before the first group
    assert run_gpu_kernels_on_host(op, values)["status"][0] == 1


MMA_GROUPED_CASES = [  # rows, K, N, group offsets
    (150, 40, 70, [0, 70, 70, 140]),  # ragged groups over two row tiles, an empty expert, 10 rows no group holds
    (20, 64, 24, [0, 0, 5, 20]),  # the first expert empty, a depth of two whole tiles, fewer columns than a tile
    (200, 16, 130, [0, 130, 200, 200]),  # a group of three row tiles, the last expert empty, three column tiles
    (140, 24, 8, [0, 1, 1, 65, 130, 131, 131, 131, 139, 139]),  # nine experts: groups of 1, 64 and 65 rows, four empty
    # groups of 63, 64, 65, 0, 1 and 97 rows (the weight gradient's depth ragged in each), 10 rows dropped; K 1.5 tiles
    (300, 48, 72, [0, 63, 127, 192, 192, 193, 290]),
    (90, 37, 45, [0, 33, 33, 80]),  # rows of x and w no whole number of 16-byte chunks: loaded value by value
]


@pytest.mark.parametrize("rows,k,n,offsets", MMA_GROUPED_CASES)
@pytest.mark.parametrize("transposed", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("op_type", ["GroupedMatMul", "GroupedMatMulWeightGrad"])
@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_bfloat16_grouped_products_run_on_tensor_cores_a_block_per_tile(operands, op_type, transposed, rows, k, n, offsets):
    """The tensor-core kernels, as the host emulator runs their warps' products: every
    output element written (outputs NaN first), equal to float64 over the operands rounded
    to bfloat16 within the output's rounding (float32 sums); rows no group holds and the
    gradient of an expert no row chose are zeros. Float32 operands take them where the
    products may round to bfloat16 (the compile's matmul precision), else the
    element-per-thread kernel. A block of four warps per 64 × 64 tile; the GPU's code
    assembles with no spills (but a word where ptxas trades it for occupancy), its sums in registers, its fragments by ldmatrix, its
    bfloat16 rows copied by cp.async (float32 ones read as 16-byte vectors) where they are
    whole 16-byte chunks."""
    from ranvier.backends.cuda import grouped_mma
    from ranvier.ops.moe import grouped_matmul, grouped_matmul_weight_grad

    op, values = _grouped(op_type, operands, transposed, offsets, rows, k, n)
    if operands == "float32":
        assert not grouped_mma.supports(op) and kernels.kernel_kind(op) == "GroupedProduct"
        op.set_attr("precision", "bfloat16")
    assert kernels.kernel_kind(op) == "GroupedProductMMA"
    got = run_gpu_kernels_on_host(op, values, fill=0xFF)
    assert got["status"][0] == 0
    rounded = {name: value.astype(ml_dtypes.bfloat16).astype(np.float64) for name, value in values.items() if name != "f/offsets"}
    experts = len(offsets) - 1
    if op_type == "GroupedMatMul":
        want = grouped_matmul(rounded["f/x"], rounded["f/w"], values["f/offsets"], transposed)
        assert not want[offsets[-1]:].any()
    else:
        want = grouped_matmul_weight_grad(rounded["f/x"], rounded["f/dy"], values["f/offsets"], experts, transposed)
        empty = [e for e in range(experts) if offsets[e] == offsets[e + 1]]
        assert empty and not want[empty].any()
    result = got[op.outputs[0].name]
    share = 2.0**-8 if operands == "bfloat16" else 1e-5  # the output's rounding, or float32 sums in a different order
    np.testing.assert_allclose(result, want, rtol=share, atol=share * np.abs(want).max() / 64)
    module, (launched,) = kernels.kernel_module(op)
    row_tiles = -(-rows // 64) + experts if op_type == "GroupedMatMul" else experts * -(-(n if transposed else k) // 64)
    assert launched.threads == 128 and launched.elements == row_tiles * -(-(k if transposed and op_type != "GroupedMatMul" else n) // 64)
    if ptx.ptxas_path() is not None:
        text = ptx.emit_ptx(module)
        # 64 columns by 32 of the depth, less those of columns past the output's, which LLVM drops; the
        # streaming loop's body twice where LLVM unrolls it by its two buffers
        assert 0 < text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") <= 32
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text or "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text
        x_copied = op_type == "GroupedMatMul" and k % 8 == 0  # x's rows a whole number of 16-byte vectors
        if x_copied:
            assert ("cp.async.cg.shared.global" in text) == (operands == "bfloat16")
            assert ("ld.global.v4" in text) == (operands == "float32")
        report = ptx.assemble(text).report
        # at most a word spilled: ptxas, told a block is 128 threads (`.maxntid`), may spill one to fit
        # another block a multiprocessor (float32 at 140 × 24 × 8: 48 registers and 4 bytes, 10 blocks, not 56 and 9)
        assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) <= 4, report
        print(re.search(r"Used \d+ registers.*", report).group(0))
        if operands == "bfloat16":  # ldmatrix and cp.async (its zero fill too) are sm_80's
            ptx.assemble(ptx.emit_ptx(kernels.kernel_module(op, "sm_80")[0], "sm_80"), "sm_80")


@pytest.mark.parametrize("start,expect_status", [(0, 0), (5, 0), (8, 1)])
def test_a_slice_assigned_in_place_writes_its_rows_and_drops_those_past_the_end(start, expect_status):
    """A KV cache's write: rows start..start+3 of axis 1 (those inside the 8 rows); a start
    outside the target sets the status word and writes nothing."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    target, value = f.var("cache", "float32", [2, 8, 5]), f.var("value", "float32", [2, 3, 5])
    position = f.var("position", "int32", [])
    f.op("AssignSlice", [target, value, position], None, {"axis": 1})
    op = flow.ops["f/AssignSlice"]
    values = {"f/cache": random_array([2, 8, 5], "float32", seed=41), "f/value": random_array([2, 3, 5], "float32", seed=42),
              "f/position": np.array(start, np.int32)}
    got = run_gpu_kernels_on_host(op, values)
    assert got["status"][0] == expect_status
    want = values["f/cache"].copy()
    if not expect_status:
        rows = min(3, 8 - start)
        want[:, start : start + rows] = values["f/value"][:, :rows]
    assert got["f/cache"].tobytes() == want.tobytes()
    assert _assembles(op) == 30


def test_an_assign_copies_every_element_in_place():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    target, value = f.var("state", "float64", [4, 7]), f.var("value", "float64", [4, 7])
    f.assign(target, value)
    op = next(op for op in flow.ops.values() if op.type == "Assign")
    values = {"f/state": random_array([4, 7], "float64", seed=43), "f/value": random_array([4, 7], "float64", seed=44)}
    assert run_gpu_kernels_on_host(op, values)["f/state"].tobytes() == values["f/value"].tobytes()


ATTENTION_CASES = [  # heads, kv heads, queries, keys, head size, causal, dtype, score bias
    (4, 2, 5, 5, 8, True, "float32", None), (4, 1, 3, 7, 6, True, "float64", "position"),
    (2, 2, 6, 4, 5, False, "float32", "padding"),
    (2, 1, 4, 4, 8, True, "float16", None),
    (2, 2, 6, 4, 2, False, "bfloat16", "padding"),  # a head of two: no statistics parked in a row
    (1, 1, 5, 9, 1, True, "float64", None),
    (2, 1, 70, 70, 8, True, "float32", "padding"),  # three blocks of query (and key) rows, three streamed tiles
    (2, 2, 3, 70, 4, True, "float64", "position"),  # a few queries at the end of a long cache
    (1, 1, 40, 37, 700, False, "float64", None),  # rows so long that a streamed tile holds two of them
    (2, 1, 70, 70, 8, True, "float32", "unseen"),  # left padding: the second image's first queries see no key
    (2, 2, 6, 4, 5, False, "float64", "unseen"),  # the second image's every key masked
    (2, 1, 35, 35, 64, True, "float32", None),  # a Llama's head size: the gradient's key and query rows two lanes' each
    (2, 1, 35, 35, 64, True, "float16", "unseen"),  # the same in half precision, some queries seeing no key
    (2, 1, 70, 37, 128, False, "float32", "padding"),  # every launch's rows split over lanes (two or four)
    (2, 2, 40, 70, 64, True, "float64", "position"),  # split rows in float64, a chunk of keys past a ragged tile
]


def attention_bias(kind, heads, queries, keys, causal, dtype):
    """A padding mask [2, 1, 1, S] of 0 and −∞ or a learned position bias [H, T, S]. The
    mask leaves every query a key: key 0 when causal (query 0 may see no other), else
    the last, with the second image's first keys masked (left padding: a row's maximum
    stays −∞ over its first keys); an "unseen" mask leaves some queries none."""
    rng = np.random.default_rng(7)
    if kind == "unseen":  # some queries see no key: their rows and gradients are 0
        hidden = np.zeros((2, 1, 1, keys), bool)
        hidden[1, ..., : keys - queries + 2 if causal else keys] = True
        return np.where(hidden, -np.inf, 0.0).astype(dtype)
    if kind == "padding":
        hidden = rng.random((2, 1, 1, keys)) < 0.3
        if causal:
            hidden[..., 0] = False
        else:
            hidden[1, ..., :2], hidden[..., -1] = True, False
        return np.where(hidden, -np.inf, 0.0).astype(dtype)
    return rng.standard_normal((heads, queries, keys)).astype(dtype)


def _attention_op(op_type, heads, kv_heads, queries, keys, size, causal, dtype, bias=None, heads_first=True, statistics=False):
    """An Attention (with its statistics where asked), or the AttentionGrad that reads an
    Attention's output and statistics, and random operands for it: q, k, v, d out and the
    bias, and for a gradient the forward's output and statistics, float64's rounded."""
    from ranvier.ops.attention import attention as attention_reference

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    shapes = {"q": [2, heads, queries, size], "k": [2, kv_heads, keys, size], "v": [2, kv_heads, keys, size]}
    if not heads_first:
        shapes = {name: [shape[0], shape[2], shape[1], shape[3]] for name, shape in shapes.items()}
    shapes["dout"] = shapes["q"]
    values = {f"f/{name}": random_array(shape, dtype, seed=50 + i) for i, (name, shape) in enumerate(shapes.items())}
    if bias is not None:
        values["f/bias"] = attention_bias(bias, heads, queries, keys, causal, dtype)
        shapes["bias"] = list(values["f/bias"].shape)
    q, k, v, dout, *score_bias = [f.var(name, dtype, shape) for name, shape in shapes.items()]
    attrs = {"causal": causal, "heads_first": heads_first}
    if op_type == "AttentionGrad":
        outputs = attention_with_gradient(f, q, k, v, dout, *score_bias, **attrs)[1:4]
        forward = flow.ops["f/Attention"].outputs
        wanted = attention_reference(*(values[f"f/{name}"] for name in ("q", "k", "v")), values.get("f/bias"),
                                     causal=causal, heads_first=heads_first, statistics=True)
        for var, want in zip(forward, wanted):
            values[var.name] = want.astype(np_dtype(var.dtype))
    else:
        outputs = f.attention(q, k, v, *score_bias, statistics=statistics, **attrs)
    for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
        out.var.out = True
    return flow.ops[f"f/{op_type}"], values


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads-first", "heads-last"])
@pytest.mark.parametrize("heads,kv_heads,queries,keys,size,causal,dtype,bias", ATTENTION_CASES)
@pytest.mark.parametrize("op_type", ["Attention", "AttentionGrad"])
def test_attention_streams_tiles_through_a_blocks_shared_memory(op_type, heads, kv_heads, queries, keys, size, causal, dtype, bias,
                                                                heads_first):
    """Grouped heads, a causal mask with fewer queries than keys, or none, a padding mask
    (some queries seeing no key) or a position bias, rows in one block or several, tiles
    of many rows or of two, the operands [B, heads, T, hd] or [B, T, heads, hd], half
    precision: every output element written (NaN before), equal to the float64 reference
    to the dtype's rounding: the forward's output and statistics (+∞ where a query sees
    no key), the gradient's dq, dk, dv from the forward's output and statistics, in two
    launches (key rows, then query rows)."""
    from ranvier.ops.attention import attention as attention_reference
    from ranvier.ops.attention import attention_grad

    op, values = _attention_op(op_type, heads, kv_heads, queries, keys, size, causal, dtype, bias, heads_first,
                               statistics=True)
    assert kernels.kernel_kind(op) == "Attention"
    got = run_gpu_kernels_on_host(op, values, fill=0xFF)
    assert got["status"][0] == 0
    names = ("q", "k", "v") if op_type == "Attention" else ("q", "k", "v", "Attention:0", "Attention:1", "dout")
    args = [values[f"f/{name}"] for name in names]
    score_bias = values.get("f/bias")
    want = (attention_reference(*args, score_bias, causal=causal, heads_first=heads_first, statistics=True)
            if op_type == "Attention" else attention_grad(*args, score_bias, causal=causal, heads_first=heads_first))
    tolerance = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 2e-5, "float64": 1e-12}[dtype]
    for var, expected in zip(op.outputs, want, strict=True):
        np.testing.assert_allclose(got[var.name].astype(np.float64), expected, rtol=tolerance, atol=tolerance, err_msg=var.name)
    module, launched = kernels.kernel_module(op)
    query_blocks, key_blocks = 2 * heads * -(-queries // attention.TILE), 2 * kv_heads * -(-keys // attention.TILE)
    assert [k.elements for k in launched] == ([query_blocks] if op_type == "Attention" else [key_blocks, query_blocks])
    held = [2] if op_type == "Attention" else [4, 3]  # the rows a thread of each launch holds
    assert [k.threads for k in launched] == [attention.TILE * attention.row_parts(size, rows, dtype) for rows in held]
    if ptx.ptxas_path() is not None:
        ptx.assemble(ptx.emit_ptx(module))


@pytest.mark.parametrize("size,dtype", [(8, "float64"), (64, "float32"), (128, "float16")])
def test_attention_gradient_reads_the_forwards_output_and_statistics(size, dtype):
    """The gradient takes pₛ = exp(score − L) and D = Σ d out ∘ out from its inputs, not
    from the scores again: with L raised by 1.5 and an output that is not the forward's,
    dq, dk, dv are the reference's for those inputs (whole rows a thread, and rows split
    over two or four lanes)."""
    from ranvier.ops.attention import attention_grad

    op, values = _attention_op("AttentionGrad", 4, 2, 40, 40, size, True, dtype, "padding")
    out, statistics = op.inputs[3:5]
    values[statistics.name] = values[statistics.name] + 1.5
    values[out.name] = random_array(out.shape, dtype, seed=60)
    got = run_gpu_kernels_on_host(op, values, fill=0xFF)
    args = [values[var.name] for var in op.inputs]
    wants = attention_grad(*args[:6], args[6], causal=True)
    tolerance = {"float16": 3e-3, "float32": 2e-5, "float64": 1e-12}[dtype]
    for var, want in zip(op.outputs, wants, strict=True):
        np.testing.assert_allclose(got[var.name].astype(np.float64), want, rtol=tolerance, atol=tolerance, err_msg=var.name)


def test_attention_without_statistics_writes_its_output_alone():
    """An inference's Attention, no statistics asked: the one output, every element."""
    from ranvier.ops.attention import attention as attention_reference

    op, values = _attention_op("Attention", 4, 2, 37, 37, 64, True, "float32", "padding")
    assert len(op.outputs) == 1 and kernels.kernel_kind(op) == "Attention"
    got = run_gpu_kernels_on_host(op, values, fill=0xFF)
    (want,) = attention_reference(*(values[f"f/{name}"] for name in ("q", "k", "v")), values["f/bias"])
    np.testing.assert_allclose(got[op.outputs[0].name], want, rtol=2e-5, atol=2e-5)


MMA_ATTENTION_CASES = [  # heads, kv heads, queries, keys, head size, causal, score bias, heads first
    (4, 2, 70, 70, 64, True, None, True),  # two blocks of 64 query (and key) rows, the second ragged; GQA
    (2, 2, 5, 130, 32, True, "padding", True),  # a few queries at the end of a long cache, a ragged last tile
    (2, 1, 70, 70, 48, False, "position", False),  # a learned bias, [B, T, heads, hd]: MQA
    (2, 2, 33, 100, 128, True, None, False),  # 64-key tiles scored 32 keys at a time, the second tile ragged
    (2, 1, 40, 37, 16, False, "unseen", True),  # the second image's first queries see no key
]


@pytest.mark.parametrize("heads,kv_heads,queries,keys,size,causal,bias,heads_first", MMA_ATTENTION_CASES)
@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_bfloat16_attention_runs_on_tensor_cores_a_warp_per_16_rows(operands, heads, kv_heads, queries, keys, size, causal,
                                                                   bias, heads_first):
    """The tensor-core kernels, as the host emulator runs their warps' products and
    exchanges, the gradient fed the forward's own output and statistics: every output
    element written (outputs and workspace NaN first), equal to float64 attention, its
    log-sum-exp and its gradient over q, k, v and dout rounded to bfloat16, within the
    rounding of the probabilities (and score gradients) to bfloat16: 2⁻⁸ of the largest
    |v| for the output, 2⁻⁷ of each gradient's largest element (dK, dV summed over a
    group's heads), 2⁻¹⁰ for L; a row that sees no key 0, its L +∞. Four warps a block, a
    block per 64 query (or key) rows of a head: the forward; the gradient's row terms D,
    its key blocks (dq added across them) and a bfloat16 dq's rounding. The GPU's code
    assembles, its tiles' fragments by ldmatrix, bfloat16 rows copied by cp.async (which
    the emulator makes at the wait that covers them, so a missing wait shows), dq's sums
    by red.global.add.f32, no launch spilling registers (but one of float32 operands at
    heads of 128). Float32 operands take the kernels where the products may
    round to bfloat16; bfloat16 operands (bfloat16 activations) always."""
    from ranvier.backends.cuda import attention_mma
    from ranvier.ops.attention import attention as attention_reference
    from ranvier.ops.attention import attention_grad

    gradient, values = _attention_op("AttentionGrad", heads, kv_heads, queries, keys, size, causal, operands, bias, heads_first)
    forward = gradient.inputs[3].producer  # the Attention whose output and statistics the gradient reads
    for op in (forward, gradient):
        if operands == "float32":
            assert not attention_mma.supports(op)  # float32 products unless the compile asks for bfloat16
            op.set_attr("precision", "bfloat16")
        assert attention_mma.supports(op) and kernels.kernel_kind(op) == "AttentionMMA"
    got = run_gpu_kernels_on_host(forward, values, fill=0xFF)
    assert got["status"][0] == 0
    out, statistics = (got[var.name] for var in forward.outputs)
    names = ("q", "k", "v", "dout")
    rounded = {name: values[f"f/{name}"].astype(ml_dtypes.bfloat16).astype(np.float64) for name in names}
    score_bias = values.get("f/bias")
    attrs = {"causal": causal, "heads_first": heads_first}
    want_out, want_statistics = attention_reference(rounded["q"], rounded["k"], rounded["v"], score_bias, statistics=True, **attrs)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=2.0**-8 * np.abs(rounded["v"]).max(), err_msg="out")
    assert statistics.dtype == np.float32 and np.array_equal(np.isinf(statistics), np.isinf(want_statistics))
    seen = np.isfinite(want_statistics)
    np.testing.assert_allclose(statistics[seen], want_statistics[seen], rtol=2.0**-10, atol=2.0**-10, err_msg="statistics")

    got = run_gpu_kernels_on_host(gradient, {**values, forward.outputs[0].name: out, forward.outputs[1].name: statistics},
                                  fill=0xFF)
    assert got["status"][0] == 0
    wants = attention_grad(rounded["q"], rounded["k"], rounded["v"], want_out, want_statistics, rounded["dout"], score_bias,
                           **attrs)
    for var, want in zip(gradient.outputs, wants):
        np.testing.assert_allclose(got[var.name], want, rtol=0, atol=2.0**-7 * np.abs(want).max(), err_msg=var.name)

    for op, launched_blocks in ((forward, [2 * heads * -(-queries // 64)]),
                                (gradient, [2 * heads * -(-queries // 64), 2 * kv_heads * -(-keys // 64)])):
        module, launched = kernels.kernel_module(op)
        rounding = [] if op is forward or operands == "float32" else [2 * heads * queries * size]  # bfloat16 dq from its sums
        assert [k.elements for k in launched] == launched_blocks + rounding
        assert [k.threads for k in launched] == [128] * len(launched_blocks) + [0] * len(rounding)
        if ptx.ptxas_path() is not None:
            text = ptx.emit_ptx(module)
            assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
            assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text  # B fragments from the shared tiles
            assert ("cp.async.cg.shared.global" in text) == (operands == "bfloat16")  # rows copied as they are
            assert ("red.global.add.f32" in text) == (op is gradient)
            report = ptx.assemble(text).report
            # float32 rows rounded in registers as each tile is loaded: at heads of 128, beside dK's
            # and dV's 128 sums, the gradient's key launch spills 28 bytes
            if operands == "bfloat16" or size <= 64:
                assert report.count(" 0 bytes stack frame") == len(launched), report


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("size", [32, 64, 128])
def test_attention_streams_whole_tiles_at_a_llamas_head_sizes(size, dtype):
    """Every launch streams tiles of a block's 32 rows: its shared memory two rows of the
    tile's each, and L and D in the gradient's key launch (at head size 128 that launch
    took tiles of 31 rows in 32 KiB, 34 tiles a head of 1,024 queries where 32 cover it,
    each with a ragged chunk of keys)."""
    rows = attention.TILE * 2 * size * 4
    for op_type, wanted in (("Attention", [rows]), ("AttentionGrad", [rows + attention.TILE * 2 * 4, rows])):
        op, _ = _attention_op(op_type, 4, 2, 256, 256, size, True, dtype, statistics=True)
        assert [kernel.shared_bytes for kernel in kernels.kernel_module(op)[1]] == wanted


@pytest.mark.skipif(ptx.ptxas_path() is None, reason="needs ptxas (CUDA toolkit or nvidia-cuda-nvcc)")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("size", [32, 64, 128])
def test_attention_keeps_a_threads_rows_in_registers(size, dtype):
    """At a Llama's head sizes every launch of the forward kernel (with its statistics) and
    of the gradient takes no local memory: the thread's rows (or its lanes' parts of them)
    are registers, not reloaded per key from the operands or spilled to the stack, half
    precision's widened to float32 as well. Whole rows a thread, the gradient's key launch
    spilled 692 bytes at head size 64, every launch at 128."""
    for op_type in ("Attention", "AttentionGrad"):
        op, _ = _attention_op(op_type, 4, 2, 256, 256, size, True, dtype, statistics=True)
        assert kernels.kernel_kind(op) == "Attention"
        module, launched = kernels.kernel_module(op)
        report = ptx.assemble(ptx.emit_ptx(module)).report
        for name in (kernel.name for kernel in launched):
            properties = re.search(rf"Function properties for {re.escape(name)}\n\s*(\d+) bytes stack frame, (\d+) bytes spill",
                                   report)
            assert properties and properties.groups() == ("0", "0"), (name, report)


def _launch_bounds(text: str, kernel: str) -> dict[str, int]:
    """The `.maxntid` and `.minnctapersm` directives of `kernel`'s entry in PTX `text`."""
    entry = re.search(rf"\.entry {re.escape(kernel)}\(.*?\)(.*?)\{{", text, re.DOTALL)
    assert entry, kernel
    return {name: int(value) for name, value in re.findall(r"\.(maxntid|minnctapersm) (\d+)", entry.group(1))}


@needs_ptxas
@pytest.mark.parametrize("size", [64, 128])
def test_block_kernels_bound_their_blocks_and_the_attention_key_launch_fits_blocks_as_asked(monkeypatch, size):
    """Every block kernel's PTX says its launch's threads (`.maxntid`), a thread kernel's
    nothing; RANVIER_ATTENTION_GRAD_BLOCKS_PER_SM asks the tensor-core gradient's key launch
    to fit that many blocks a multiprocessor (`.minnctapersm`), and ptxas caps its registers
    to 65,536 / (128 threads · blocks) (sm_90: 255 registers at heads of 128 unbound)."""
    from ranvier.backends.cuda import attention_mma

    op, _ = _attention_op("AttentionGrad", 4, 2, 256, 256, size, True, "bfloat16")
    for blocks in (0, 3, 4):
        monkeypatch.setenv(attention_mma.KEY_BLOCKS_ENVIRONMENT, str(blocks))
        module, launched = kernels.kernel_module(op)
        assert kernels.kernel_kind(op) == "AttentionMMA" and [k.threads for k in launched] == [128, 128, 0]
        text = ptx.emit_ptx(module)
        assembled = ptx.assemble(text)
        rows, key, rounding = (kernel.name for kernel in launched)
        assert _launch_bounds(text, rows) == {"maxntid": 128} and _launch_bounds(text, rounding) == {}
        assert _launch_bounds(text, key) == {"maxntid": 128, **({"minnctapersm": blocks} if blocks else {})}
        if blocks:
            assert assembled.registers(key) <= 65536 // (128 * blocks)


@pytest.mark.parametrize("setting", ["-1", "17", "three"])
def test_a_bad_blocks_per_multiprocessor_setting_is_refused_by_name(monkeypatch, setting):
    from ranvier.backends.cuda import attention_mma

    monkeypatch.setenv(attention_mma.KEY_BLOCKS_ENVIRONMENT, setting)
    op, _ = _attention_op("AttentionGrad", 4, 2, 64, 64, 64, True, "bfloat16")
    with pytest.raises(RanvierError, match="RANVIER_ATTENTION_GRAD_BLOCKS_PER_SM.*from 1 to 16"):
        kernels.kernel_module(op)
