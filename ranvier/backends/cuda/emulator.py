"""A device that is this CPU: `HostEmulator` runs each launch's element function compiled
for this CPU over every element, one launch after another, and each product as
cuBLASLt's plan says in numpy (`blas.run_on_host`): the same generated arithmetic and the
same runtime (arena, transfers, status words, globals kept on the "device"), and cuDNN's
attention as its plan says in numpy (`cudnn_attention.run_on_host`), where no GPU
is at hand. It is what the tests run cells on, and `RANVIER_CUDA_DEVICE=emulator` selects
it; it is slow, and never chosen in a GPU's place unasked.

It compiles and loads the kernels with the CPU backend's LLVM loader (`cpu/jit.py`): the one
place the CUDA backend uses the CPU's (tests/test_imports.py allows this module alone).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from ... import guards
from ...runtime import Cell
from .. import compile_cache
from ..cpu import jit
from ..cpu.target import host_target
from ..kernels import chosen_kernel
from ..llvm.irutil import use_features
from . import blas, cudnn_attention, kernels
from .blas import Gemm
from .code import CUDACode
from .cudnn_attention import Sdpa
from .kernels import GPUKernel
from .launch import LaunchShape


class HostTimer:
    """Marks as the host's clock: the emulator runs each launch as it is made."""

    def __init__(self, marks: int):
        self.times = [0.0] * marks

    def record(self, mark: int) -> None:
        self.times[mark] = time.perf_counter()

    def seconds(self, start: int, stop: int) -> float:
        return self.times[stop] - self.times[start]

    def close(self) -> None:
        pass


@dataclass
class HostKernels:
    """A cell's kernels compiled for this CPU (`HostEmulator.load`): each one's function by
    name, and the loaded code they are in, which lives as long as they do."""

    functions: dict[str, Callable[..., None]]
    code: object


class HostEmulator:
    """The GPU's kernels run on this CPU (see the module's docstring). Memory is host
    memory, kept alive here; addresses are its own. Fresh memory has every bit set (NaN in
    a float, -1 in an integer), as a device's holds whatever it held: a kernel that reads
    what nothing wrote shows in its results."""

    name = "host emulator of the CUDA backend (this CPU)"
    host_memory = True  # its "device" addresses are the host's

    def __init__(self) -> None:
        self._memory: dict[int, np.ndarray] = {}

    def allocate(self, nbytes: int) -> int:
        memory = guards.allocate(max(1, nbytes), 64, fill=0xFF, what="a block of emulated device memory")
        address = memory.ctypes.data
        self._memory[address] = memory
        return address

    def release(self, address: int) -> None:
        del self._memory[address]

    def upload(self, address: int, host: np.ndarray) -> None:
        ctypes.memmove(address, np.ascontiguousarray(host).ctypes.data, host.nbytes)

    def download(self, address: int, host: np.ndarray) -> None:
        ctypes.memmove(host.ctypes.data, address, host.nbytes)

    def zero(self, address: int, nbytes: int) -> None:
        ctypes.memset(address, 0, nbytes)

    def load(self, cell: Cell) -> HostKernels:
        """The cell's launches compiled for this CPU as one module, kept in the compile
        cache beside the cell's PTX (under the same key)."""
        target = host_target()
        native = CUDACode.of(cell)

        def compile_for_host() -> bytes:
            module = ir.Module(f"{cell.name} on the host")
            module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
            use_features(module, target.feature_set)
            for index in native.owners:  # each kernel once, however many steps run it
                kernels.add_host_kernels(module, cell.steps[index].op, chosen_kernel(cell.steps[index]))
            return jit.compile_object(module, target)

        launches = list({kernel.name: kernel for step_kernels in native.kernels.values() for kernel in step_kernels
                         if isinstance(kernel, GPUKernel)}.values())
        if not launches:  # a cell of no steps (its outputs are its inputs' views)
            return HostKernels({}, None)
        key = jit.cache_key(f"cuda emulator\n{native.key}", target)
        entry, _ = compile_cache.cached_object(key, compile_for_host, native.use_disk_cache)
        code = jit.load_object(entry, target, launches[0].name)
        functions: dict[str, Callable[..., None]] = {}
        for kernel in launches:
            signature = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * (kernel.pointers + 1), ctypes.c_int64, ctypes.c_int64)
            functions[kernel.name] = signature(code.address_of(kernel.name))
        return HostKernels(functions, code)

    def launch(self, code: HostKernels, kernel: GPUKernel, shape: LaunchShape, addresses: list[int]) -> None:
        code.functions[kernel.name](*addresses, 0, kernel.elements)

    def gemm(self, code: HostKernels, gemm: Gemm, addresses: list[int]) -> None:
        blas.run_on_host(gemm.plan, addresses)

    def attention_refusal(self, code: HostKernels, call: Sdpa) -> str:
        return ""  # every plan runs as `cudnn_attention.run_on_host` computes it

    def attention(self, code: HostKernels, call: Sdpa, addresses: list[int]) -> None:
        cudnn_attention.run_on_host(call.plan, addresses)

    def timer(self, marks: int) -> HostTimer:
        return HostTimer(marks)

    def graph(self, launches: Callable[[], None]) -> Callable[[], None]:
        """The emulator runs each launch as it is made: its graph is the call itself."""
        launches()
        return launches

    def replay(self, graph: Callable[[], None]) -> None:
        graph()

    def discard(self, graph: Callable[[], None]) -> None:
        pass

    def synchronize(self) -> None:
        pass
