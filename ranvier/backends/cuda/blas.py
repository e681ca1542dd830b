"""Matrix products through cuBLASLt, NVIDIA's GEMM library: the plan made at compile time,
its run on a GPU (`CublasLt`, the library through ctypes) and on the host emulator
(`run_on_host`, the same plan in numpy).

A MatMul's matrices are row-major and cuBLASLt's are column-major. A row-major r×c matrix
is the column-major c×r matrix in the same memory, so C = op(X)·op(Y) is computed as
Cᵀ = op(Y)ᵀ·op(X)ᵀ: cuBLASLt's first matrix (A) is our Y, its second (B) our X, and its
N×M column-major result is our M×N C, in place, with no copy or transpose kernel. A batch
goes as one strided batch when every batch dimension of an operand either steps through
it contiguously or is broadcast whole (a batch stride of 0); a shared matrix under a batch
of row blocks (x[B, T, K] @ W) is one product of B·T rows. A partly broadcast batch (x[2,
1, …] @ y[1, 3, …]) has no strided form, and stays with the generated Product kernel.

Precision: float32 products sum in float32 (CUBLAS_COMPUTE_32F); with the compile's matmul
precision "tfloat32" or "bfloat16", cuBLASLt may round the inputs to that type on the
tensor cores and still sums in float32 (COMPUTE_32F_FAST_TF32 / _FAST_16BF). float16 and
bfloat16 matrices sum in float32, float64 ones in float64.

Epilogues: a product followed by a bias added along its rows (a linear layer's), a ReLU,
or both, is one call (cuBLASLt's BIAS, RELU and RELU_BIAS epilogues, on float32 and
half-precision products), and so is a product plus a tensor of its own shape and dtype (a
residual, or another product: the gradients a branching value gets), which cuBLASLt reads
as its C matrix with β = 1 (ADD here; its DEFAULT epilogue) — a half-precision product
widened and added to a float32 tensor too (the residual stream under bfloat16
activations: C and D float32, the product's float32 sums never rounded): the compiler fuses those
(`Capabilities.fuses_epilogue` → `fuses_epilogue`) into a MatMulCalculate, and no other
epilogue, which stays a map kernel of its own.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any  # a loaded library (or a test's stand-in): its functions found by name

import ml_dtypes
import numpy as np

from ... import dtypes
from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from .products import batch_strides

KIND = "cuBLASLt"  # what a cell printout calls a product planned here
WORKSPACE_BYTES = 32 << 20  # scratch cuBLASLt's split-K kernels may use (PyTorch gives Hopper as much)
LIBRARIES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")

# cudaDataType (library_types.h) of each matrix dtype, and the compute type (cublas_api.h)
# its products sum in, by the MatMul's precision attribute.
_DATA_TYPES = {dtypes.DT_FLOAT32: 0, dtypes.DT_FLOAT64: 1, dtypes.DT_FLOAT16: 2, dtypes.DT_BFLOAT16: 14}
_COMPUTE_TYPES = {"32F": 68, "32F_FAST_16BF": 75, "32F_FAST_TF32": 77, "64F": 70}
_FLOAT32_COMPUTE = {"float32": "32F", "tfloat32": "32F_FAST_TF32", "bfloat16": "32F_FAST_16BF"}
# cublasLtMatmulDescAttributes_t, cublasLtMatrixLayoutAttribute_t, cublasLtMatmulPreferenceAttributes_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6
_PREFERENCE_MAX_WORKSPACE = 1
_PREFERENCE_MIN_ALIGNMENTS = (5, 6, 7, 8)  # A's, B's, C's and D's, in bytes: cuBLASLt assumes 256 unless told
_MOST_ALIGNMENT = 256  # the most cuBLASLt's algorithms ask of a matrix's address
CANDIDATES = 8  # algorithms asked of the heuristic, best first: the first that runs is kept
_DESC_EPILOGUE, _DESC_BIAS_POINTER = 7, 8
# MatMulCalculate programs cuBLASLt runs as its epilogue (cublasLtEpilogue_t)
_EPILOGUES = {"@0=Add(%0,%1)": "BIAS", "@0=Add(%1,%0)": "BIAS", "@0=Relu(%0)": "RELU",
              "$0=Add(%0,%1);@0=Relu($0)": "RELU_BIAS", "$0=Add(%1,%0);@0=Relu($0)": "RELU_BIAS"}
_EPILOGUE_CODES = {"DEFAULT": 1, "ADD": 1, "RELU": 2, "BIAS": 4, "RELU_BIAS": 6}  # ADD: DEFAULT with C and β = 1
# A half-precision product widened and added to a float32 tensor (a residual stream): C and D
# float32, the product's float32 sums never rounded to half precision
_WIDENED_ADD = {"$0=Cast[dtype=float32](%0);@0=Add(%1,$0)", "$0=Cast[dtype=float32](%0);@0=Add($0,%1)"}


@dataclass(frozen=True)
class Layout:
    """One column-major matrix (or batch of them) as cuBLASLt describes it, in elements."""

    rows: int
    cols: int
    ld: int
    batch_stride: int


@dataclass(frozen=True)
class GemmPlan:
    """D = op(A)·op(B) over `batch` matrices, column-major, as cuBLASLt is asked for it."""

    dtype: str
    compute: str  # a key of _COMPUTE_TYPES
    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    batch: int
    a: Layout
    b: Layout
    d: Layout
    epilogue: str = "DEFAULT"  # a key of _EPILOGUE_CODES: with a bias or C, the call's fourth operand
    out_dtype: str = ""  # C's and D's, where not A's and B's (a half-precision product's float32 sums)

    @property
    def d_dtype(self) -> str:
        return self.out_dtype or self.dtype

    def __str__(self) -> str:
        """In the MatMul's own terms: its rows × columns × inner size, batch and precision."""
        batch = f" × {self.batch}" if self.batch > 1 else ""
        epilogue = f", epilogue {self.epilogue}" if self.epilogue != "DEFAULT" else ""
        into = f" into {self.d_dtype}" if self.d_dtype != self.dtype else ""
        return f"{self.n}×{self.m}×{self.k}{batch} {self.dtype}{into}, compute {self.compute}{epilogue}"


@dataclass(frozen=True)
class Gemm:
    """A product's launch: its plan, and the variables in cuBLASLt's A, B and D (and the
    bias, with one)."""

    name: str
    plan: GemmPlan
    operands: tuple[Variable, ...]


def epilogue_of(program: str, product: Variable, inputs: list[Variable]) -> str | None:
    """The cuBLASLt epilogue that runs a product's fused program (module docstring), or None."""
    widened = program in _WIDENED_ADD
    kind = "BIAS" if widened else _EPILOGUES.get(program)
    if kind is None or product.dtype not in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16):
        return None
    if "BIAS" not in kind:
        return kind if not inputs else None
    (bias,) = inputs
    out_dtype = dtypes.DT_FLOAT32 if widened else product.dtype
    if kind == "BIAS" and list(bias.shape) == list(product.shape) and bias.dtype == out_dtype:
        return "ADD"  # the whole of a tensor like the product's added: cuBLASLt's C
    if widened:
        return None
    along_rows = bias.shape[-1:] == product.shape[-1:] and all(d == 1 for d in bias.shape[:-1])
    return kind if along_rows and bias.dtype == product.dtype and bias.rank <= product.rank else None


def fuses_epilogue(product: Variable, program: str, inputs: list[Variable]) -> bool:
    """Whether one cuBLASLt call runs the product (a MatMul it takes) and this epilogue."""
    producer = product.producer
    return (producer is not None and producer.type == "MatMul" and plan_product(producer) is not None
            and epilogue_of(program, product, inputs) is not None)


def _batch_step(var: Variable, batch: list[int]) -> int | None:
    """Elements from one of `var`'s matrices to the next along the flattened batch: the
    matrix size, 0 where `var` is broadcast over the whole batch, None where neither."""
    live = [(size, stride) for size, stride in zip(batch, batch_strides(var, batch)) if size > 1]
    if all(stride == 0 for _, stride in live):
        return 0
    matrix = var.shape[-1] * var.shape[-2]
    expected = matrix
    for size, stride in reversed(live):
        if stride != expected:
            return None
        expected *= size
    return matrix


def plan_product(op: Operation) -> Gemm | None:
    """The op's product (and epilogue) as one cuBLASLt call, or None where it is not one
    (module docstring)."""
    if op.type not in ("MatMul", "MatMulCalculate") or op.inputs[0].dtype not in _DATA_TYPES:
        return None
    epilogue = epilogue_of(op.attrs["expr"], op.outputs[0], op.inputs[2:]) if op.type == "MatMulCalculate" else "DEFAULT"
    if epilogue is None:
        return None
    x, y = op.inputs[:2]
    out = op.outputs[0]
    attrs = attrs_of(op)
    tx, ty = attrs["transpose_a"], attrs["transpose_b"]
    *batch, rows, cols = out.shape
    inner = x.shape[-2] if tx else x.shape[-1]
    x_step, y_step = _batch_step(x, batch), _batch_step(y, batch)
    if x_step is None or y_step is None or 0 in (rows, cols, inner):
        return None
    count = math.prod(batch)
    if count > 1 and y_step == 0 and x_step and not tx:
        rows, count, x_step = rows * count, 1, 0  # one product of every batch's rows
    if x.dtype == dtypes.DT_FLOAT64:
        compute = "64F"
    elif x.dtype == dtypes.DT_FLOAT32:
        compute = _FLOAT32_COMPUTE[attrs["precision"]]
    else:
        compute = "32F"
    a = Layout(inner, cols, inner, y_step) if ty else Layout(cols, inner, cols, y_step)
    b = Layout(rows, inner, rows, x_step) if tx else Layout(inner, rows, inner, x_step)
    d = Layout(cols, rows, cols, rows * cols)
    out_dtype = out.dtype if out.dtype != x.dtype else ""
    described = GemmPlan(x.dtype, compute, ty, tx, cols, rows, inner, count, a, b, d, epilogue, out_dtype)
    return Gemm("g_" + "".join(c if c.isalnum() else "_" for c in op.name), described, (y, x, out, *op.inputs[2:]))


# ---- the plan on the host (the emulator) ---------------------------------------------------


def _host_matrices(address: int, layout: Layout, dtype: np.dtype, batch: int) -> np.ndarray:
    """The column-major matrices at host `address` as a writable [batch, rows, cols] view."""
    extent = layout.batch_stride * (batch - 1) + layout.ld * (layout.cols - 1) + layout.rows
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (extent * dtype.itemsize)).from_address(address)).view(dtype)
    item = dtype.itemsize
    return np.lib.stride_tricks.as_strided(raw, (batch, layout.rows, layout.cols),
                                           (layout.batch_stride * item, item, layout.ld * item))


def _as_tensor_cores_read(values: np.ndarray, compute: str) -> np.ndarray:
    """float32 inputs as a FAST compute type may read them: rounded (to nearest even) to
    TF32's 10 or bfloat16's 7 mantissa bits."""
    if compute == "32F_FAST_16BF":
        return values.astype(ml_dtypes.bfloat16).astype(np.float32)
    if compute == "32F_FAST_TF32":
        bits = values.astype(np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        return np.asarray(rounded.view(np.float32))
    return values


def run_on_host(gemm: GemmPlan, addresses: list[int]) -> None:
    """What cublasLtMatmul computes for the plan, over host memory at A's, B's and D's
    addresses: the emulator's product, and the check that a plan means the MatMul."""
    dtype, d_dtype = np.dtype(dtypes.to_numpy(gemm.dtype)), np.dtype(dtypes.to_numpy(gemm.d_dtype))
    a, b, d = (_host_matrices(address, layout, kind, gemm.batch)
               for address, layout, kind in zip(addresses, (gemm.a, gemm.b, gemm.d), (dtype, dtype, d_dtype)))
    wide = np.float64 if gemm.compute == "64F" else np.float32
    op_a = _as_tensor_cores_read((a.swapaxes(1, 2) if gemm.transa else a).astype(wide), gemm.compute)
    op_b = _as_tensor_cores_read((b.swapaxes(1, 2) if gemm.transb else b).astype(wide), gemm.compute)
    result = np.matmul(op_a, op_b)
    if "BIAS" in gemm.epilogue:  # one value per row of D (a column of the MatMul's product)
        result = result + _host_matrices(addresses[3], Layout(gemm.m, 1, gemm.m, 0), dtype, 1).astype(wide)
    if gemm.epilogue == "ADD":  # C, laid out as D
        result = result + _host_matrices(addresses[3], gemm.d, d_dtype, gemm.batch).astype(wide)
    if "RELU" in gemm.epilogue:
        result = np.maximum(result, 0)
    d[...] = result.astype(d_dtype)


# ---- the plan on a GPU ------------------------------------------------------------------------


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (cublasLt.h)."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def find_library() -> str:
    """Where libcublasLt is: NVIDIA's wheel (`pip install 'ranvier[cuda]'`) or the system's
    library path. Raises, naming what to install, where neither has it."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for name in LIBRARIES:
            for found in sorted(Path(root).glob(f"*/lib/{name}")):
                return str(found)
    for name in LIBRARIES:
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise RanvierError("the CUDA backend runs matrix products with cuBLASLt, and libcublasLt was not found: "
                       "pip install 'ranvier[cuda]' (NVIDIA's nvidia-cublas wheel), or put a CUDA toolkit's lib64 "
                       "on LD_LIBRARY_PATH")


@dataclass
class Prepared:
    """A plan's descriptors, made once, and the algorithm that ran it at each alignment of
    its matrices' addresses (an instance's are the same at every compute)."""

    gemm: GemmPlan
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ...]  # A's, B's and D's
    alpha: ctypes.Array[ctypes.c_float] | ctypes.Array[ctypes.c_double]
    beta: ctypes.Array[ctypes.c_float] | ctypes.Array[ctypes.c_double]
    algorithms: dict[tuple[int, ...], _HeuristicResult] = field(default_factory=dict)  # by A's, B's, C's and D's alignments


def alignment(address: int) -> int:
    """The largest power of two, up to 256, that `address` is a multiple of."""
    return min(_MOST_ALIGNMENT, address & -address) if address else _MOST_ALIGNMENT


def _status_name(library: Any, status: int) -> str:
    name = library.cublasLtGetStatusName
    name.restype = ctypes.c_char_p
    return (name(status) or b"status %d" % status).decode()


def _check(library: Any, status: int, what: str) -> None:
    if status != 0:
        raise RanvierError(f"cuBLASLt failed to {what}: {_status_name(library, status)}")


def _set(library: Any, setter: str, handle: ctypes.c_void_p, attribute: int, value: ctypes._SimpleCData[Any]) -> None:
    _check(library, getattr(library, setter)(handle, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))),
           f"set attribute {attribute} ({setter})")


def describe(library: Any, gemm: GemmPlan) -> tuple[ctypes.c_void_p, tuple[ctypes.c_void_p, ...]]:
    """The plan's operation and matrix-layout descriptors, made by `library` (libcublasLt:
    descriptors need no GPU)."""
    data_type = _DATA_TYPES[gemm.dtype]
    scale_type = _DATA_TYPES[dtypes.DT_FLOAT64 if gemm.compute == "64F" else dtypes.DT_FLOAT32]
    desc = ctypes.c_void_p()
    _check(library, library.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_TYPES[gemm.compute], scale_type),
           f"describe {gemm}")
    for attribute, transposed in ((_DESC_TRANSA, gemm.transa), (_DESC_TRANSB, gemm.transb)):
        _set(library, "cublasLtMatmulDescSetAttribute", desc, attribute, ctypes.c_int32(int(transposed)))
    if gemm.epilogue != "DEFAULT":
        _set(library, "cublasLtMatmulDescSetAttribute", desc, _DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_CODES[gemm.epilogue]))
    layouts = []
    for layout, matrix_type in ((gemm.a, data_type), (gemm.b, data_type), (gemm.d, _DATA_TYPES[gemm.d_dtype])):
        handle = ctypes.c_void_p()
        _check(library, library.cublasLtMatrixLayoutCreate(ctypes.byref(handle), matrix_type, ctypes.c_uint64(layout.rows),
                                                           ctypes.c_uint64(layout.cols), ctypes.c_int64(layout.ld)),
               f"describe a matrix of {gemm}")
        if gemm.batch > 1:
            _set(library, "cublasLtMatrixLayoutSetAttribute", handle, _LAYOUT_BATCH_COUNT, ctypes.c_int32(gemm.batch))
            _set(library, "cublasLtMatrixLayoutSetAttribute", handle, _LAYOUT_BATCH_STRIDE, ctypes.c_int64(layout.batch_stride))
        layouts.append(handle)
    return desc, tuple(layouts)


class CublasLt:
    """libcublasLt through ctypes, on a device's stream: a handle and one workspace for
    every product (they run one after another on that stream), and each plan's descriptors,
    made when its cell is loaded — before any graph capture, which may not allocate. A
    product's algorithm is chosen at its first call, which runs outside any capture (an
    instance's first compute launches kernel by kernel), as cuBLASLt's users do: the
    heuristic is told the alignment of each matrix's real address (else it assumes 256
    bytes, and offers algorithms that refuse the arena's 64-byte-aligned matrices) and asked
    for several algorithms, best first; the first that runs is kept for later calls, so
    that a product in a graph is one cublasLtMatmul call."""

    def __init__(self, stream: ctypes.c_void_p, allocate: Callable[[int], int], load: Callable[[str], Any] = ctypes.CDLL):
        self.library = load(find_library())
        self._stream = stream
        self._handle = ctypes.c_void_p()
        _check(self.library, self.library.cublasLtCreate(ctypes.byref(self._handle)), "start")
        self._workspace = allocate(WORKSPACE_BYTES)

    def prepare(self, gemm: GemmPlan) -> Prepared:
        desc, layouts = describe(self.library, gemm)
        scale = ctypes.c_double if gemm.compute == "64F" else ctypes.c_float
        beta = 1.0 if gemm.epilogue == "ADD" else 0.0
        return Prepared(gemm, desc, layouts, (scale * 1)(1.0), (scale * 1)(beta))

    def _candidates(self, prepared: Prepared, alignments: tuple[int, ...]) -> list[_HeuristicResult]:
        """Up to CANDIDATES algorithms for the product with its matrices so aligned, best first."""
        library = self.library
        preference = ctypes.c_void_p()
        _check(library, library.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "make a preference")
        try:
            _set(library, "cublasLtMatmulPreferenceSetAttribute", preference, _PREFERENCE_MAX_WORKSPACE,
                 ctypes.c_uint64(WORKSPACE_BYTES))
            for attribute, value in zip(_PREFERENCE_MIN_ALIGNMENTS, alignments):
                _set(library, "cublasLtMatmulPreferenceSetAttribute", preference, attribute, ctypes.c_uint32(value))
            results, found = (_HeuristicResult * CANDIDATES)(), ctypes.c_int()
            a_layout, b_layout, d_layout = prepared.layouts
            _check(library, library.cublasLtMatmulAlgoGetHeuristic(self._handle, prepared.desc, a_layout, b_layout, d_layout,
                                                                   d_layout, preference, CANDIDATES, results,
                                                                   ctypes.byref(found)),
                   f"choose an algorithm for {prepared.gemm}")
        finally:
            library.cublasLtMatmulPreferenceDestroy(preference)
        return list(results[: found.value])

    def matmul(self, prepared: Prepared, addresses: list[int]) -> None:
        """D = op(A)·op(B), and the epilogue, on the stream (`addresses`: A's, B's, D's and
        the bias's or C's where there is one); the first call chooses the algorithm."""
        if "BIAS" in prepared.gemm.epilogue:
            _set(self.library, "cublasLtMatmulDescSetAttribute", prepared.desc, _DESC_BIAS_POINTER,
                 ctypes.c_uint64(addresses[3]))
        a, b, d = addresses[:3]
        c = addresses[3] if prepared.gemm.epilogue == "ADD" else d
        alignments = tuple(alignment(address) for address in (a, b, c, d))
        chosen = prepared.algorithms.get(alignments)
        if chosen is not None:
            _check(self.library, self._run(prepared, chosen, a, b, c, d), f"run {prepared.gemm}")
            return
        candidates = self._candidates(prepared, alignments)
        refused = []
        for candidate in candidates:
            status = self._run(prepared, candidate, a, b, c, d)
            if status == 0:
                prepared.algorithms[alignments] = candidate
                return
            refused.append(_status_name(self.library, status))
        offered = (f"the {len(candidates)} algorithms its heuristic offered were refused ({', '.join(sorted(set(refused)))})"
                   if candidates else "its heuristic offered none")
        raise RanvierError(f"cuBLASLt has no algorithm that runs the product {prepared.gemm} with A, B, C and D at "
                           f"{', '.join(map(str, alignments))}-byte-aligned addresses: {offered}")

    def _run(self, prepared: Prepared, algorithm: _HeuristicResult, a: int, b: int, c: int, d: int) -> int:
        """One cublasLtMatmul call on the stream; its status."""
        a_layout, b_layout, d_layout = prepared.layouts
        return int(self.library.cublasLtMatmul(
            self._handle, prepared.desc, prepared.alpha, ctypes.c_uint64(a), a_layout, ctypes.c_uint64(b), b_layout,
            prepared.beta, ctypes.c_uint64(c), d_layout, ctypes.c_uint64(d), d_layout, ctypes.byref(algorithm.algo),
            ctypes.c_uint64(self._workspace), ctypes.c_size_t(WORKSPACE_BYTES), self._stream))
