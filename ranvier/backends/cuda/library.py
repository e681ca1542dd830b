"""The GPU backend's kernel library, the same mechanism as the CPU's (`backends/kernels.py`):
each generator module (`maps`, `rows`, `reductions`, ...) registers its kernels as it is
imported (`kernels.py` imports them all), each with its rank among those that may take the
same ops. A GPU kernel's `emit(op)` gives the op's launches in order, each (elements, how to
emit one element, threads per block of a block kernel or 0; `kernels.py` says more)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...flow.graph import Operation, Variable
from ..kernels import Kernel, KernelLibrary

Launches = Callable[[Operation], list[tuple[Any, ...]]]  # an op's launches: (elements, emit[, threads]) each


@dataclass(frozen=True)
class Generator(Kernel):
    """A kernel of the GPU library, with what its launches need besides: `operands(op)`, the
    variables its kernels take, each once, where not every input and output; and whether an
    op it runs may join a ForEach kernel (`foreach`: its one launch grouped with others)."""

    operands: Callable[[Operation], tuple[Variable, ...]] | None = None
    foreach: bool = False


def _none(op: Operation) -> list[tuple[Any, ...]]:
    return []


LIBRARY = KernelLibrary("cuda", fallback=Generator("None", None, _none, native=False))


def one_launch(elements: Callable[[Operation], int], emit: Callable[..., None]) -> Launches:
    """The launches of a kernel of one launch: `elements(op)` elements, each `emit(ctx, op, index)`."""
    return lambda op: [(elements(op), lambda ctx, index: emit(ctx, op, index), 0)]
