"""The CPU backend's kernel library. Kernel modules register into it when imported
(`kernels/__init__.py` imports them all; their ranks, not that order, say which is tried
first); ops no kernel supports call back into Python, which runs their numpy reference.

Two kernels come before every module's, for data with no elements (a zero-size batch):
an op that writes nothing has nothing to do, and one that reads an empty input into a
non-empty output (a product over k = 0 is zeros; a sum over none, 0) runs its reference,
which is right by definition, where the native kernels each assume a size of at least 1."""

from __future__ import annotations

from ....flow.graph import Operation
from ....ops import op_def
from ...kernels import EMPTY_DATA, Kernel, KernelLibrary
from .python import python_callback


def _empty(shape: list[int]) -> bool:
    return 0 in shape


def writes_nothing(op: Operation) -> bool:
    """Every output of `op`, and every input it writes in place, has no elements."""
    written = [*op.outputs, *(op.inputs[i] for i in op_def(op.type).written_inputs(op))]
    return bool(written) and all(_empty(v.shape) for v in written)


def reads_an_empty_input(op: Operation) -> bool:
    return any(_empty(v.shape) for v in op.inputs)


LIBRARY = KernelLibrary("cpu", fallback=Kernel("Python", None, python_callback, native=False))
kernel = LIBRARY.kernel
LIBRARY.register(Kernel("Empty", None, lambda ctx, op: None, supports=writes_nothing, rank=EMPTY_DATA, flops=lambda op: 0))
LIBRARY.register(Kernel("Python", None, python_callback, supports=reads_an_empty_input, rank=EMPTY_DATA + 1, native=False))
