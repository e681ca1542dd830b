"""Backends turn a cell's steps into running code: `reference` (numpy, the oracle), `cpu`
(LLVM) and `cuda` (LLVM's NVPTX and cuBLASLt through the CUDA driver, on an NVIDIA GPU or,
with RANVIER_CUDA_DEVICE=emulator, the same kernels on this CPU).
The compiler finds them here by name; a backend's module is imported when a compile
first asks for it."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..errors import RanvierError
from .base import DENORMALS, MATMUL_PRECISIONS, PRECISIONS, WEIGHT_PRECISIONS, Backend, Capabilities, CompileOptions

__all__ = ["DENORMALS", "MATMUL_PRECISIONS", "PRECISIONS", "WEIGHT_PRECISIONS", "Backend", "Capabilities", "CompileOptions", "backend_names", "create_backend", "register_backend"]

Factory = Callable[[CompileOptions], Backend]

# name -> a factory, or "module:attribute" naming one (imported on first use)
_BACKENDS: dict[str, Factory | str] = {
    "cpu": "ranvier.backends.cpu.backend:CPUBackend",
    "cuda": "ranvier.backends.cuda.backend:CUDABackend",
    "reference": "ranvier.backends.reference:ReferenceBackend",
}


def register_backend(name: str, factory: Factory | str) -> None:
    """Make `Compiler(backend=name)` build its backend with `factory(options)`."""
    _BACKENDS[name] = factory


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(name: str, options: CompileOptions) -> Backend:
    if options.matmul not in MATMUL_PRECISIONS:
        raise RanvierError(f"unknown matmul precision {options.matmul!r}; available: {', '.join(MATMUL_PRECISIONS)}")
    if options.precision not in PRECISIONS:
        raise RanvierError(f"unknown precision {options.precision!r}; available: {', '.join(PRECISIONS)}")
    if options.denormals not in DENORMALS:
        raise RanvierError(f"unknown denormals mode {options.denormals!r}; available: {', '.join(DENORMALS)}")
    factory = _BACKENDS.get(name)
    if factory is None:
        raise RanvierError(f"unknown backend {name!r}; available: {', '.join(backend_names())}")
    if isinstance(factory, str):
        module, attribute = factory.split(":")
        factory = getattr(importlib.import_module(module), attribute)
    return factory(options)
