"""The CPU backend's kernel library. Kernel modules register into it when imported (in
the order `kernels/__init__.py` imports them); ops no kernel supports call back into
Python, which runs their numpy reference."""

from __future__ import annotations

from ...kernels import Kernel, KernelLibrary
from .python import python_callback

LIBRARY = KernelLibrary("cpu", fallback=Kernel("Python", None, python_callback, native=False))
kernel = LIBRARY.kernel
