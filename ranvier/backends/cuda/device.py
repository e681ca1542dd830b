"""What the CUDA runtime asks of a device, and a device that is this CPU.

`GPU` is the runtime's whole view of a device: memory (allocate, copy in and out, zero),
the cell's kernels loaded, launches, cuBLASLt products and cuDNN's attention, timing marks
between them, and a compute's launches captured once as a graph and replayed. Two kinds provide
it: the CUDA driver (`driver.DriverGPU`: PTX loaded by the driver, launches on the
device, products by cuBLASLt) and `emulator.HostEmulator`, which runs the same kernels on
this CPU where no GPU is at hand: `RANVIER_CUDA_DEVICE=emulator` selects it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ...runtime import Cell
from .blas import Gemm
from .cudnn_attention import Sdpa
from .kernels import GPUKernel
from .launch import LaunchShape

EMULATOR = "emulator"
DEVICE_ENVIRONMENT = "RANVIER_CUDA_DEVICE"  # "emulator": run cells on emulator.HostEmulator


class GPU(Protocol):
    """A device's memory, code and clock, as the runtime uses them. Addresses are ints."""

    name: str
    host_memory: bool  # whether its addresses are the host's (the emulator's are)

    def allocate(self, nbytes: int) -> int: ...

    def release(self, address: int) -> None:
        """Give back memory `allocate` gave."""

    def upload(self, address: int, host: np.ndarray) -> None: ...

    def download(self, address: int, host: np.ndarray) -> None: ...

    def zero(self, address: int, nbytes: int) -> None: ...

    def load(self, cell: Cell) -> Any:
        """The cell's kernels, ready to launch: what `launch` and `gemm` take as `code`, of
        the device's own type."""

    def launch(self, code: Any, kernel: GPUKernel, shape: LaunchShape, addresses: list[int]) -> None:
        """Run `kernel` over its elements; `addresses`: its operands', then its status word's."""

    def gemm(self, code: Any, gemm: Gemm, addresses: list[int]) -> None:
        """Run a planned product; `addresses`: cuBLASLt's A, B and D (and a bias)."""

    def attention_refusal(self, code: Any, call: Sdpa) -> str:
        """Why the device does not run a claimed attention step with cuDNN ("" where it
        does): then the step's own kernels run in its place."""

    def attention(self, code: Any, call: Sdpa, addresses: list[int]) -> None:
        """Run a claimed attention step with cuDNN; `addresses`: its `Sdpa.operands`'."""

    def timer(self, marks: int) -> Timer:
        """`marks` points in the launch order to time between, made once and reused."""

    def graph(self, launches: Callable[[], None]) -> Any:
        """The launches (and timing marks) `launches` makes, captured once as a graph that
        `replay` runs again as one launch; this call runs them too."""

    def replay(self, graph: Any) -> None:
        """Run a graph `graph` made (of the device's own type)."""

    def discard(self, graph: Any) -> None:
        """Give back a graph `graph` made."""

    def synchronize(self) -> None: ...


class Timer(Protocol):
    def record(self, mark: int) -> None:
        """Set mark `mark` at this point of the launch order."""

    def seconds(self, start: int, stop: int) -> float:
        """Time between two marks, once the launches between them have finished."""

    def close(self) -> None:
        """Give back what the marks hold on the device."""
