"""A cell as the CUDA backend compiled it (`Cell.native`): its kernels as LLVM IR, PTX and,
where ptxas ran, machine code; each step's launches and their shapes; the steps cuDNN's
attention claims; and, once an instance is bound, the code loaded on the device that runs
it."""

from __future__ import annotations

from dataclasses import dataclass, field

from llvmlite import ir

from ...errors import RanvierError
from ...runtime import Cell
from .blas import Gemm
from .cudnn_attention import Sdpa
from .kernels import GPUKernel
from .launch import LaunchShape


@dataclass
class CUDACode:
    module: ir.Module  # the kernels as LLVM IR (NVPTX)
    ptx: str
    cubin: bytes  # ptxas's machine code for the architecture, or b"": the driver compiles the PTX
    kernels: dict[int, list[GPUKernel | Gemm]]  # each step's launches, in order (none: a view onto itself)
    owners: list[int]  # the steps whose kernels are in the module (steps of one signature share them)
    shapes: dict[int, list[LaunchShape | None]]  # each launch's shape (None: cuBLASLt chooses)
    origin: str  # where the PTX came from: "compiled", "memory" or "disk" (the compile cache)
    key: str  # the compile cache's key of the PTX (the emulator's host code is kept beside it)
    use_disk_cache: bool  # as the compile asked (the emulator's host code follows it)
    loaded: tuple[object, object] | None = None  # (the device, the code loaded there), from the first bind
    # steps cuDNN's fused attention runs where the device takes them (their kernels above: the fall back)
    attention: dict[int, Sdpa] = field(default_factory=dict)

    @staticmethod
    def of(cell: Cell) -> CUDACode:
        """The CUDA code of a cell the CUDA backend compiled."""
        if not isinstance(cell.native, CUDACode):
            raise RanvierError(f"cell {cell.name} was compiled for the {cell.network.backend_name} backend, not for CUDA")
        return cell.native
