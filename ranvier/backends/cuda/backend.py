"""`Compiler(backend="cuda")`: a compile for an NVIDIA GPU first finds one (`driver.py`),
so a machine without a GPU, its driver or a device gets an error naming which. The
kernels a cell would run are generated and checked here without a GPU (`maps.py`,
`ptx.py`); what runs them on the device (memory, launches, graph replay) is not built yet,
and a compile that found a GPU says so rather than run anything on the CPU instead."""

from __future__ import annotations

from ...errors import RanvierError
from ..base import Backend, CompileOptions
from .driver import find_device


def create(options: CompileOptions) -> Backend:
    device = find_device()
    raise RanvierError(f"found {device}, but ranvier cannot run cells on a GPU yet: it generates and checks the GPU "
                       "kernels (ranvier.backends.cuda) without a device runtime; use --backend cpu")
