"""The CPU kernels. Each module registers its kernels in the library (`library.py`) as it
is imported; the import order below is the order kernels are tried in, but for ConvTiles,
which registers ahead of Winograd's kernel (`first`): each declines the convolutions the
other runs faster."""

from . import matmul, winograd, conv, transpose, maps, reduce, rows, index, window, attention, cached_attention, moe  # noqa: F401, I001  (registration, in order)
from .library import LIBRARY, kernel

__all__ = ["LIBRARY", "kernel"]
