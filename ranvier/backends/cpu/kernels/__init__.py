"""The CPU kernels. Each module registers its kernels in the library (`library.py`) as it
is imported; each kernel's rank, not the order of these imports, says which of the kernels
for an op is tried first."""

from . import (  # noqa: F401  (registration)
    attention,
    batch_norm,
    cached_attention,
    conv,
    conv_pool,
    conv_stacked,
    index,
    maps,
    matmul,
    moe,
    reduce,
    rows,
    transpose,
    window,
    winograd,
)
from .library import LIBRARY, kernel

__all__ = ["LIBRARY", "kernel"]
