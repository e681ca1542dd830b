"""The CPU kernels. Each module registers its kernels in the library (`library.py`) as it
is imported; each kernel's rank, not the order of these imports, says which of the kernels
for an op is tried first."""

from . import attention, cached_attention, conv, index, maps, matmul, moe, reduce, rows, transpose, window, winograd  # noqa: F401  (registration)
from .library import LIBRARY, kernel

__all__ = ["LIBRARY", "kernel"]
