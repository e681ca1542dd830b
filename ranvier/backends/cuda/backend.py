"""`Compiler(backend="cuda")`: cells compiled for an NVIDIA GPU.

A compile needs no GPU: the passes run as for the CPU (less epilogue fusion: a GPU product
is a cuBLASLt call, its epilogue a kernel of its own), each step gets GPU kernels —
generated (`kernels.py`: maps, copies, pads, reductions, rows, lookups, scatters, a MoE
layer's routing and grouped products; one thread per output element, row or index) — or is a float32 matrix product planned for
cuBLASLt, and the cell's kernels are one PTX module, for the GPU found (`driver.py`) or
else Hopper (sm_90, 132 multiprocessors). With ptxas at
hand each kernel's launch shape follows its registers, and the printed cell shows it.

Running a cell needs the device runtime (arena, launches, CUDA graph replay), which is not
built yet: making an instance raises, naming what this machine lacks (the driver, a GPU)
or, where a GPU was found, that the runtime is missing. Nothing runs on the CPU instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import llvmlite.binding as llvm
import numpy as np

from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops import op_def
from ...runtime import Cell, Instance, Step
from ..base import DEFAULT_OPTIONS, Capabilities, CompileOptions
from ..cpu import jit  # the compile cache, shared with the CPU's object files
from . import kernels, ptx
from .driver import Device, find_device
from .launch import map_launch

GEMM_KERNEL = "CublasLtGemm"


def _describe(cell: Cell) -> str:
    """What a cell's kernels depend on: each step's op, attributes and variables (small
    constants by value: a concatenation's axis)."""
    lines = []
    for step in cell.steps:
        op = step.op
        lines.append(f"{step.kernel} {op.type} {op.name} {sorted(op.attrs.items())}")
        for v in (*op.inputs, *op.outputs):
            value = np.ascontiguousarray(v.data).tobytes().hex() if v.data is not None and v.size <= 16 else ""
            lines.append(f"  {v.name} {v.dtype}{list(v.shape)} {value}")
    return "\n".join(lines)
HOPPER_MULTIPROCESSORS = 132  # an H100 SXM's: the launch shapes of a compile without a GPU


def _planned_gemm(op: Operation) -> bool:
    """A float32 MatMul: a cuBLASLt call (batched over leading dimensions)."""
    return op.type == "MatMul" and all(v.dtype == "float32" for v in (*op.inputs[:2], *op.outputs))


class CUDABackend:
    name = "cuda"
    step_time_dtype = np.float64  # seconds, as CUDA events measure them

    def __init__(self, options: CompileOptions = DEFAULT_OPTIONS):
        self.capabilities = Capabilities(rewrites=True, matmul_precisions=("float32",), epilogues=False)
        self.use_disk_cache = options.cache
        self.device: Device | None = None
        self.missing = ""
        try:
            self.device = find_device()
        except RanvierError as error:
            self.missing = str(error)
        self.architecture = self.device.architecture if self.device else ptx.ARCHITECTURE
        self.multiprocessors = self.device.multiprocessors if self.device else HOPPER_MULTIPROCESSORS

    # ---- compile time -----------------------------------------------------------------

    def runs_whole(self, op: Operation) -> bool:
        return _planned_gemm(op) or kernels.supports(op)

    def choose(self, op: Operation) -> Step:
        if _planned_gemm(op):
            return Step(op, GEMM_KERNEL, self.architecture, op_def(op.type).cost(op))
        if not kernels.supports(op):
            raise RanvierError(f"{op.type} op {op.name} has no GPU kernel yet: the CUDA backend generates elementwise "
                               "maps, fused Calculate programs, copies through views, pads, reductions, row kernels "
                               "(softmax, norms, cross-entropy), lookups (gather, one-hot), scatter-adds, and MoE "
                               "routing and grouped products, and plans "
                               "float32 matrix products for cuBLASLt; use --backend cpu for this model")
        return Step(op, kernels.kernel_kind(op), self.architecture, op_def(op.type).cost(op))

    def workspace_bytes(self, step: Step) -> int:
        return 0

    def in_place(self, op: Operation, source: Variable, target: Variable) -> bool:
        """A thread reads its element's inputs before it writes: an elementwise op may write
        over an input of its output's exact type and shape."""
        same = source.dtype == target.dtype and list(source.shape) == list(target.shape)
        return same and kernels.supports(op) and kernels.kernel_kind(op) == "Map"

    def shares_storage(self, op: Operation) -> bool:
        return False

    def finish(self, cell: Cell) -> None:
        """The cell's kernels as one PTX module, and with ptxas each one's launch shape; both
        kept in the compile cache (`ranvier cache`), keyed by the cell, the architecture, and
        the code generator's and LLVM's versions."""
        module = ptx.gpu_module(cell.name, self.architecture)
        generated = {}
        for index, step in enumerate(cell.steps):
            if step.kernel != GEMM_KERNEL:
                generated[index] = kernels.add_kernels(module, step.op)

        def generate() -> bytes:
            text = ptx.emit_ptx(module, self.architecture)
            report = ptx.assemble(text, self.architecture).report if generated and ptx.ptxas_path() else ""
            return json.dumps({"ptx": text, "ptxas": report}).encode()

        sources = jit.source_digest("backends/cuda", "backends/llvm", "ops")
        key = hashlib.sha256(f"{sources}\n{self.architecture}\n{llvm.llvm_version_info}\n{_describe(cell)}".encode())
        entry, origin = jit.cached_object(f"cuda-{key.hexdigest()}", generate, self.use_disk_cache)
        built = json.loads(entry)
        if built["ptxas"]:
            report = ptx.Assembled(b"", built["ptxas"])
            for index, launches in generated.items():
                shapes = [map_launch(k.elements, self.multiprocessors, report.registers(k.name)) for k in launches]
                cell.steps[index].variant = f"{self.architecture} {', '.join(map(str, shapes))}"
        cell.native = {"module": module, "ptx": built["ptx"], "kernels": generated, "origin": origin}

    def code(self, cell: Cell, kind: str) -> str:
        """The cell's GPU kernels as LLVM IR ("llvm") or PTX ("ptx")."""
        if kind == "llvm":
            return str(cell.native["module"])
        if kind == "ptx":
            return cell.native["ptx"]
        raise RanvierError(f"the CUDA backend shows its code as 'llvm' or 'ptx', not {kind!r}")

    # ---- run time -----------------------------------------------------------------------

    def bind(self, cell: Cell, instance: Instance) -> Callable[[], None]:
        if self.device is None:
            raise RanvierError(f"cell {cell.name} was compiled for {self.architecture}, but {self.missing}")
        raise RanvierError(f"found {self.device}, but ranvier cannot run cells on a GPU yet: it compiles them for the "
                           "GPU (kernels as PTX, products planned for cuBLASLt) without a device runtime; use --backend cpu")

    def step_seconds(self, instance: Instance) -> np.ndarray:
        return np.zeros(len(instance.cell.steps))

    def all_cores_seconds(self, instance: Instance) -> np.ndarray:
        return np.zeros(len(instance.cell.steps))
