"""Matrix products through cuBLASLt: the plan a MatMul becomes (row-major products as
column-major cuBLASLt calls, strided batches, shared matrices as one product of all rows,
precision), what the plan computes (run on the host emulator, so a wrong layout shows as a
wrong result), the descriptors libcublasLt itself builds from it (where the library is
installed: descriptors need no GPU), and what the driver runtime hands the library (a
stand-in library: setup before a graph capture, one cublasLtMatmul per product inside it)."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest
from helpers import random_array
from test_cuda_runtime import _RecordingDriver

import ranvier as rv
from ranvier.backends.cuda import backend, blas, device, driver
from ranvier.errors import RanvierError

PRODUCTS = [  # X's shape, Y's shape, transpose_a, transpose_b, dtype, the plan's (M×N×K, batch)
    ([5, 7], [7, 3], False, False, "float32", "5×3×7"),
    ([7, 5], [3, 7], True, True, "float64", "5×3×7"),
    ([7, 5], [7, 3], True, False, "float32", "5×3×7"),
    ([5, 7], [3, 7], False, True, "bfloat16", "5×3×7"),
    ([2, 3, 5, 7], [7, 4], False, False, "float32", "30×4×7"),  # a shared matrix under every row: one product
    ([2, 3, 7, 5], [7, 4], True, False, "float32", "5×4×7 × 6"),  # transposed rows cannot be stacked
    ([4, 5, 7], [4, 7, 6], False, False, "float16", "5×6×7 × 4"),
    ([5, 7], [3, 7, 6], False, False, "float32", "5×6×7 × 3"),  # a shared left matrix: batch stride 0
    ([3, 1, 5, 7], [3, 1, 7, 2], False, False, "float32", "5×2×7 × 3"),
]


def _product_cell(x_shape, y_shape, ta, tb, dtype, matmul="float32"):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.matmul(f.var("x", dtype, x_shape), f.var("y", dtype, y_shape), transpose_a=ta, transpose_b=tb)
    y.var.out = True
    return rv.Compiler("cuda", matmul=matmul).compile(flow).cell("f"), y.var.name


def _run(cell, output, values):
    data = cell.instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    return np.array(data[output])


def _exact(values, ta, tb, rounding=lambda v: v):
    x, y = (rounding(values[name]).astype(np.float64) for name in ("f/x", "f/y"))
    return (np.swapaxes(x, -1, -2) if ta else x) @ (np.swapaxes(y, -1, -2) if tb else y)


@pytest.mark.parametrize("x_shape,y_shape,ta,tb,dtype,planned", PRODUCTS)
def test_a_planned_product_equals_the_reference(monkeypatch, x_shape, y_shape, ta, tb, dtype, planned):
    """Run as the plan tells cuBLASLt (on the emulator, whose fresh memory is NaN): every
    element written, equal to the float64 product to the dtype's rounding."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    cell, output = _product_cell(x_shape, y_shape, ta, tb, dtype)
    (step,) = cell.steps
    assert step.kernel == blas.KIND and step.variant.startswith(planned + f" {dtype},"), step.variant
    assert f"cuBLASLt[{planned}" in str(cell)
    values = {"f/x": random_array(x_shape, dtype, seed=41), "f/y": random_array(y_shape, dtype, seed=42)}
    got = _run(cell, output, values).astype(np.float64)
    tolerance = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got, _exact(values, ta, tb), rtol=tolerance, atol=tolerance)


def test_a_partly_broadcast_batch_is_left_to_the_generated_kernel(monkeypatch):
    """x[2, 1, …] @ y[1, 3, …] has no single batch stride for either side."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    cell, output = _product_cell([2, 1, 5, 7], [1, 3, 7, 4], False, False, "float32")
    assert [step.kernel for step in cell.steps] == ["Product"]
    values = {"f/x": random_array([2, 1, 5, 7], "float32", seed=1), "f/y": random_array([1, 3, 7, 4], "float32", seed=2)}
    np.testing.assert_allclose(_run(cell, output, values), _exact(values, False, False), rtol=1e-5, atol=1e-6)


def _tf32(values: np.ndarray) -> np.ndarray:
    """Rounded to TF32's 10 mantissa bits, nearest even, independently of ranvier's rounding."""
    mantissa, exponent = np.frexp(values.astype(np.float64))
    return np.ldexp(np.round(mantissa * 2**11) / 2**11, exponent)


@pytest.mark.parametrize("precision,rounding", [
    ("tfloat32", _tf32), ("bfloat16", lambda v: v.astype(ml_dtypes.bfloat16)),
])
def test_a_mixed_precision_product_rounds_its_inputs_and_sums_in_float32(monkeypatch, precision, rounding):
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    cell, output = _product_cell([2, 24, 64], [64, 16], False, False, "float32", matmul=precision)
    compute = {"tfloat32": "32F_FAST_TF32", "bfloat16": "32F_FAST_16BF"}[precision]
    assert cell.steps[0].variant.endswith(f"compute {compute}")
    values = {"f/x": random_array([2, 24, 64], "float32", seed=5), "f/y": random_array([64, 16], "float32", seed=6)}
    got = _run(cell, output, values).astype(np.float64)
    np.testing.assert_allclose(got, _exact(values, False, False, rounding), rtol=1e-5, atol=1e-5)
    assert np.abs(got - _exact(values, False, False)).max() > 1e-4  # the rounding happened


def test_a_vector_matrix_product_stays_float32_in_mixed_precision():
    cell, _ = _product_cell([1, 64], [64, 16], False, False, "float32", matmul="tfloat32")
    assert cell.steps[0].variant.endswith("compute 32F")


def test_the_plan_is_cublaslts_column_major_view_of_the_row_major_product():
    """Y is cuBLASLt's A and X its B: C[M, N] row-major is Cᵀ = Yᵀ·Xᵀ column-major."""
    cell, _ = _product_cell([3, 7, 5], [3, 6, 7], True, True, "float32")
    gemm = blas.plan_product(cell.steps[0].op)
    assert [v.name for v in gemm.operands] == ["f/y", "f/x", cell.steps[0].op.outputs[0].name]
    plan = gemm.plan
    assert (plan.m, plan.n, plan.k, plan.batch, plan.transa, plan.transb) == (6, 5, 7, 3, True, True)
    assert plan.a == blas.Layout(rows=7, cols=6, ld=7, batch_stride=42)
    assert plan.b == blas.Layout(rows=5, cols=7, ld=5, batch_stride=35)
    assert plan.d == blas.Layout(rows=6, cols=5, ld=6, batch_stride=30)


EPILOGUES = [  # how the layer ends, the dtype, X's shape, the plan's epilogue (None: a map kernel of its own)
    ("relu(x @ w + b)", "float32", [3, 8, 16], "RELU_BIAS"), ("b + x @ w", "float32", [8, 16], "BIAS"),
    ("relu(x @ w)", "float16", [8, 16], "RELU"), ("gelu(x @ w + b)", "float32", [8, 16], None),
    ("relu(x @ w + b)", "float64", [8, 16], None), ("x @ w + b", "float32", [2, 1, 8, 16], None),
    # a tensor of the product's shape added: cuBLASLt's C, with β = 1
    ("x @ w + r", "float32", [3, 8, 16], "ADD"), ("r + x @ w", "bfloat16", [8, 16], "ADD"),
    ("relu(x @ w + r)", "float32", [8, 16], None),
]


def _layer(ending: str, dtype: str, x_shape: list[int]):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, b = f.var("x", dtype, x_shape), f.var("b", dtype, [4])
    w = f.var("w", dtype, [3, 16, 4] if len(x_shape) == 4 else [16, 4])  # [2, 1, …] @ [3, …]: no strided batch
    product = x @ w
    r = f.var("r", dtype, list(product.shape))
    y = {"relu(x @ w + b)": lambda: f.relu(product + b), "b + x @ w": lambda: b + product, "relu(x @ w)": lambda: f.relu(product),
         "gelu(x @ w + b)": lambda: f.gelu(product + b), "x @ w + b": lambda: product + b, "x @ w + r": lambda: product + r,
         "r + x @ w": lambda: r + product, "relu(x @ w + r)": lambda: f.relu(product + r)}[ending]()
    y.var.out = True
    values = {"f/x": random_array(x_shape, dtype, seed=1), "f/w": random_array(w.shape, dtype, seed=2) * 0.3}
    if "b" in ending:
        values["f/b"] = random_array([4], dtype, seed=3)
    if "r" in ending.replace("relu", ""):
        values["f/r"] = random_array(list(product.shape), dtype, seed=4)
    return flow, y.var.name, values


@pytest.mark.parametrize("ending,dtype,x_shape,epilogue", EPILOGUES)
def test_a_bias_and_a_relu_after_a_product_are_cublaslts_epilogue(monkeypatch, ending, dtype, x_shape, epilogue):
    """One call where cuBLASLt can (a float32 or half product, a bias along its rows), a
    map kernel after the product elsewhere; the CPU's result either way."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    flow, output, values = _layer(ending, dtype, x_shape)
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    if epilogue is None:
        assert [step.kernel for step in cell.steps][-1] == "Map" and "epilogue" not in str(cell)
    else:
        (step,) = cell.steps
        assert step.kernel == blas.KIND and step.variant.endswith(f"epilogue {epilogue}")
    results = []
    for backend_name in ("cuda", "cpu"):
        data = rv.Compiler(backend_name).compile(flow).cell("f").instance()
        for name, value in values.items():
            data[name] = value
        data.compute()
        results.append(np.array(data[output]).astype(np.float64))
    tolerance = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(*results, rtol=tolerance, atol=tolerance)


# ---- libcublasLt ----------------------------------------------------------------------------


def _installed_library():
    try:
        return ctypes.CDLL(blas.find_library())
    except RanvierError:
        return None


LIBRARY = _installed_library()
needs_cublaslt = pytest.mark.skipif(LIBRARY is None, reason="libcublasLt (pip install nvidia-cublas) is not installed")
# cublasLtMatrixLayoutAttribute_t and cublasLtMatmulDescAttributes_t values (cublasLt.h)
_LAYOUT_ROWS, _LAYOUT_COLS, _LAYOUT_LD, _LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 2, 3, 4, 5, 6
_DESC_COMPUTE_TYPE, _DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE = 0, 3, 4, 7


def _read(getter, handle, attribute, kind):
    value, written = kind(), ctypes.c_size_t()
    status = getter(handle, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value)), ctypes.byref(written))
    assert status == 0 and written.value == ctypes.sizeof(value)
    return value.value


@needs_cublaslt
@pytest.mark.parametrize("x_shape,y_shape,ta,tb,dtype,precision", [
    ([3, 7, 5], [3, 6, 7], True, True, "float32", "tfloat32"), ([5, 7], [7, 3], False, False, "float64", "float32"),
    ([4, 7, 5], [7, 6], True, False, "bfloat16", "float32"),
])
def test_libcublaslt_accepts_the_plans_descriptors(x_shape, y_shape, ta, tb, dtype, precision):
    """The real library builds the descriptors from the plan's values and gives them back
    (which checks each attribute's size and type as ctypes passes it)."""
    cell, _ = _product_cell(x_shape, y_shape, ta, tb, dtype, matmul=precision)
    plan = blas.plan_product(cell.steps[0].op).plan
    desc, layouts = blas.describe(LIBRARY, plan)
    get_desc, get_layout = LIBRARY.cublasLtMatmulDescGetAttribute, LIBRARY.cublasLtMatrixLayoutGetAttribute
    assert _read(get_desc, desc, _DESC_COMPUTE_TYPE, ctypes.c_int32) == blas._COMPUTE_TYPES[plan.compute]
    assert (_read(get_desc, desc, _DESC_TRANSA, ctypes.c_int32), _read(get_desc, desc, _DESC_TRANSB, ctypes.c_int32)) \
        == (plan.transa, plan.transb)
    assert _read(get_desc, desc, _DESC_EPILOGUE, ctypes.c_uint32) == blas._EPILOGUE_CODES[plan.epilogue]
    for handle, layout in zip(layouts, (plan.a, plan.b, plan.d)):
        assert _read(get_layout, handle, _LAYOUT_ROWS, ctypes.c_uint64) == layout.rows
        assert _read(get_layout, handle, _LAYOUT_COLS, ctypes.c_uint64) == layout.cols
        assert _read(get_layout, handle, _LAYOUT_LD, ctypes.c_int64) == layout.ld
        assert _read(get_layout, handle, _LAYOUT_BATCH_COUNT, ctypes.c_int32) == plan.batch
        assert _read(get_layout, handle, _LAYOUT_BATCH_STRIDE, ctypes.c_int64) == (layout.batch_stride if plan.batch > 1 else 0)
        LIBRARY.cublasLtMatrixLayoutDestroy(handle)
    LIBRARY.cublasLtMatmulDescDestroy(desc)


@needs_cublaslt
def test_libcublaslt_takes_the_alignment_preferences():
    preference = ctypes.c_void_p()
    assert LIBRARY.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)) == 0
    for attribute, value in zip(blas._PREFERENCE_MIN_ALIGNMENTS, (64, 128, 16, 256)):
        blas._set(LIBRARY, "cublasLtMatmulPreferenceSetAttribute", preference, attribute, ctypes.c_uint32(value))
        assert _read(LIBRARY.cublasLtMatmulPreferenceGetAttribute, preference, attribute, ctypes.c_uint32) == value
    LIBRARY.cublasLtMatmulPreferenceDestroy(preference)


def test_heuristic_results_are_laid_out_as_cublaslt_writes_them():
    """cublasLtMatmulHeuristicResult_t: the algorithm's 8 words, the workspace size, the
    status, the waves and 4 reserved ints; the heuristic writes an array of them, so past
    the first a wrong size reads garbage."""
    assert ctypes.sizeof(blas._HeuristicResult) == 96


def test_without_libcublaslt_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(blas.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(blas.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    with pytest.raises(RanvierError, match=r"libcublasLt was not found: pip install 'ranvier\[cuda\]'"):
        blas.find_library()


class _FakeCublasLt:
    """A stand-in for libcublasLt that records its calls (and the driver's, through `events`).
    Its heuristic offers `offered` algorithms, numbered 0, 1, ... in their first word; a
    product run with one of the `refused` fails (CUBLAS_STATUS_NOT_SUPPORTED)."""

    NOT_SUPPORTED = 15

    def __init__(self, events: list, offered: int = 1, refused: tuple[int, ...] = ()):
        self.events, self.offered, self.refused = events, offered, refused

    def __getattr__(self, call: str):
        def run(*args):
            self.events.append((call, args))
            if call == "cublasLtMatmulAlgoGetHeuristic":
                *_, results, found = args
                for number in range(min(self.offered, args[-3])):
                    results[number].algo[0] = number
                found._obj.value = min(self.offered, args[-3])
            elif call == "cublasLtMatmul" and args[12]._obj[0] in self.refused:
                return self.NOT_SUPPORTED
            elif call == "cublasLtGetStatusName":
                return {self.NOT_SUPPORTED: b"CUBLAS_STATUS_NOT_SUPPORTED"}.get(args[0])
            return 0

        return run


def _product_on_stand_ins(monkeypatch, events: list, **blas_stand_in):
    """A product [4, 5, 7] @ [7, 6] on the libcuda and libcublasLt stand-ins (`blas_stand_in`:
    the _FakeCublasLt's options); its instance, inputs set."""
    monkeypatch.setattr(blas, "find_library", lambda: "libcublasLt.so.13")
    fake_driver, fake_blas = _RecordingDriver(events), _FakeCublasLt(events, **blas_stand_in)
    gpu = driver.DriverGPU(lambda name: fake_blas if "cublas" in name else fake_driver)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    cell, _ = _product_cell([4, 5, 7], [7, 6], False, False, "float32")
    data = cell.instance()
    data["f/x"], data["f/y"] = random_array([4, 5, 7], "float32", seed=1), random_array([7, 6], "float32", seed=2)
    return data


def test_the_heuristic_is_told_each_matrixs_alignment_and_asked_for_several_algorithms(monkeypatch):
    """The heuristic is told the alignment of each matrix's real address (y, cuBLASLt's A,
    lies 576 bytes into the arena: 64-byte aligned; cuBLASLt assumes 256 unless told) and
    asked for several algorithms."""
    events: list = []
    data = _product_on_stand_ins(monkeypatch, events)
    data.compute()
    addresses = [data.device.address(v) for v in blas.plan_product(data.cell.steps[0].op).operands]
    told = {args[1]: args[2]._obj.value for call, args in events if call == "cublasLtMatmulPreferenceSetAttribute"}
    assert [told[attribute] for attribute in blas._PREFERENCE_MIN_ALIGNMENTS] == \
        [blas.alignment(address) for address in (*addresses, addresses[2])]  # A, B, C (D's, no C here), D
    assert told[blas._PREFERENCE_MIN_ALIGNMENTS[0]] == 64 and told[blas._PREFERENCE_MIN_ALIGNMENTS[1]] == 256
    (heuristic,) = [args for call, args in events if call == "cublasLtMatmulAlgoGetHeuristic"]
    assert heuristic[7] == blas.CANDIDATES > 1
    assert blas.alignment(576) == 64 and blas.alignment(1 << 20) == 256 and blas.alignment(8) == 8


def test_the_first_algorithm_that_runs_is_kept(monkeypatch):
    """The heuristic's first two are refused; the third runs the first compute's product and
    is the one the second compute captures (the third replays it), the heuristic asked once."""
    events: list = []
    data = _product_on_stand_ins(monkeypatch, events, offered=4, refused=(0, 1))
    for _ in range(3):
        data.compute()
    runs = [args[12]._obj[0] for call, args in events if call == "cublasLtMatmul"]
    assert runs == [0, 1, 2, 2]
    assert [call for call, _ in events].count("cublasLtMatmulAlgoGetHeuristic") == 1


@pytest.mark.parametrize("offered,why", [(3, r"the 3 algorithms its heuristic offered were refused \(CUBLAS_STATUS_NOT_SUPPORTED\)"),
                                         (0, "its heuristic offered none")])
def test_a_product_no_algorithm_runs_is_named_with_its_shape_and_dtypes(monkeypatch, offered, why):
    events: list = []
    data = _product_on_stand_ins(monkeypatch, events, offered=offered, refused=(0, 1, 2))
    with pytest.raises(RanvierError, match=r"cuBLASLt has no algorithm that runs the product 20×6×7 float32, compute 32F "
                                           r"with A, B, C and D at 64, 256, 256, 256-byte-aligned addresses: " + why):
        data.compute()


def test_the_driver_prepares_products_before_capture_and_runs_one_call_each_inside_it(monkeypatch):
    """Handle, workspace and descriptors when the cell is loaded, the algorithm by the first
    compute, which runs launch by launch (a graph capture may not allocate, nor load
    cuBLASLt's kernels); in the second compute's capture, cublasLtMatmul on the runtime's
    stream with the arena addresses of Y, X and the output, and the workspace."""
    events: list = []
    monkeypatch.setattr(blas, "find_library", lambda: "libcublasLt.so.13")
    fake_driver, fake_blas = _RecordingDriver(events), _FakeCublasLt(events)
    gpu = driver.DriverGPU(lambda name: fake_blas if "cublas" in name else fake_driver)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    cell, _ = _product_cell([4, 5, 7], [7, 6], False, False, "float32")
    data = cell.instance()
    data["f/x"], data["f/y"] = random_array([4, 5, 7], "float32", seed=1), random_array([7, 6], "float32", seed=2)
    data.compute()
    data.compute()
    calls = [call for call, _ in events]
    setup = ["cublasLtCreate", "cuMemAlloc_v2", "cublasLtMatmulDescCreate", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"]
    assert all(calls.index(call) < calls.index("cuStreamBeginCapture_v2") for call in setup)
    begin, end = calls.index("cuStreamBeginCapture_v2"), calls.index("cuStreamEndCapture")
    assert [c for c in calls[begin:end] if c.startswith("cublasLt")] == ["cublasLtMatmul"]
    warm_up, arguments = [args for call, args in events if call == "cublasLtMatmul"]
    assert [warm_up[i].value for i in (3, 5, 8, 10)] == [arguments[i].value for i in (3, 5, 8, 10)]  # A, B, C, D
    device_data = data.device
    addresses = [device_data.address(v) for v in blas.plan_product(cell.steps[0].op).operands]
    assert [arguments[i].value for i in (3, 5, 10)] == addresses
    assert arguments[15] is gpu._stream and arguments[14].value == blas.WORKSPACE_BYTES



def test_each_call_of_a_biased_product_hands_cublaslt_its_bias(monkeypatch):
    """The descriptor is made once per cell; the bias's address is the instance's, set on
    it right before the call (and so captured in the instance's graph)."""
    events: list = []
    monkeypatch.setattr(blas, "find_library", lambda: "libcublasLt.so.13")
    fake_driver, fake_blas = _RecordingDriver(events), _FakeCublasLt(events)
    gpu = driver.DriverGPU(lambda name: fake_blas if "cublas" in name else fake_driver)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    flow, _, values = _layer("relu(x @ w + b)", "float32", [8, 16])
    data = rv.Compiler("cuda").compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    data.compute()
    calls = [call for call, _ in events]
    matmuls = [index for index, call in enumerate(calls) if call == "cublasLtMatmul"]
    assert len(matmuls) == 2  # the first compute's (which chose the algorithm), and the captured one
    for matmul in matmuls:
        setting = max(index for index in range(matmul) if calls[index] == "cublasLtMatmulDescSetAttribute")
        attribute, pointer = events[setting][1][1], events[setting][1][2]._obj.value
        assert attribute == blas._DESC_BIAS_POINTER and pointer == data.device.address(flow.vars["f/b"])


def test_a_product_plus_a_tensor_of_its_shape_hands_cublaslt_that_tensor_as_c_with_beta_one(monkeypatch):
    """A residual added to a product is cuBLASLt's C (β = 1) in the same call: C the
    residual's address, D the output's, and no bias pointer set."""
    events: list = []
    monkeypatch.setattr(blas, "find_library", lambda: "libcublasLt.so.13")
    fake_driver, fake_blas = _RecordingDriver(events), _FakeCublasLt(events)
    gpu = driver.DriverGPU(lambda name: fake_blas if "cublas" in name else fake_driver)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    flow, output, values = _layer("x @ w + r", "float32", [3, 8, 16])
    data = rv.Compiler("cuda").compile(flow).cell("f").instance()
    for name, value in values.items():
        data[name] = value
    data.compute()
    (arguments,) = [args for call, args in events if call == "cublasLtMatmul"]
    alpha, beta, c, d = arguments[2][0], arguments[7][0], arguments[8].value, arguments[10].value
    assert (alpha, beta) == (1.0, 1.0)
    assert c == data.device.address(flow.vars["f/r"]) and d == data.device.address(flow.vars[output]) and c != d
    assert not [args for call, args in events if call == "cublasLtMatmulDescSetAttribute" and args[1] == blas._DESC_BIAS_POINTER]


def test_a_half_precision_product_added_to_a_float32_residual_keeps_its_float32_sums(monkeypatch):
    """bfloat16 activations' residual add (the product widened, then added to the float32
    stream) is one call: C and D float32, A and B bfloat16, the sums never rounded to
    bfloat16 — the CPU's result, which rounds the product first, within that rounding."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w, r = f.var("x", "bfloat16", [2, 8, 16]), f.var("w", "bfloat16", [16, 12]), f.var("r", "float32", [2, 8, 12])
    y = r + f.cast(x @ w, "float32")
    y.var.out = True
    values = {"f/x": random_array([2, 8, 16], "bfloat16", seed=1), "f/w": random_array([16, 12], "bfloat16", seed=2),
              "f/r": random_array([2, 8, 12], "float32", seed=3)}
    cell = rv.Compiler("cuda").compile(flow).cell("f")
    (step,) = cell.steps
    assert step.kernel == blas.KIND and step.variant.endswith("bfloat16 into float32, compute 32F, epilogue ADD"), step.variant
    results = {}
    for backend_name in ("cuda", "cpu"):
        data = rv.Compiler(backend_name).compile(flow).cell("f").instance()
        for name, value in values.items():
            data[name] = value
        data.compute()
        results[backend_name] = np.array(data[y]).astype(np.float64)
    exact = values["f/r"].astype(np.float64) + values["f/x"].astype(np.float64) @ values["f/w"].astype(np.float64)
    np.testing.assert_allclose(results["cuda"], exact, rtol=1e-5, atol=1e-5)  # float32 sums, one rounding
    np.testing.assert_allclose(results["cpu"], exact, rtol=1e-2, atol=2e-2)  # the product rounded to bfloat16 first
