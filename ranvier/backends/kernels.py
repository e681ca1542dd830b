"""Kernel libraries, as Myelin's: a backend's kernels each say which ops they can run
(`supports`) and their rank among the kernels for the same ops, and for every step the
library picks, in order of rank, the first kernel that can run its op and is not passed
over for a faster one (`prefer`: a measured choice, such as the generated GEMM's against
BLAS for the product's shape).

    @LIBRARY.kernel("SoftmaxRow", ops={"Softmax"}, supports=last_axis)
    def softmax(ctx, op): ...

A kernel with `ops=None` is tried for every op type (the elementwise kernel takes any
op with a formula). Ranks order the kernels that may take the same op (lower first),
whatever order their modules are imported in: two such kernels of one rank are an error.
The fallback is what runs when no kernel supports an op; it is not native, so the
compiler decomposes such an op where its definition can. Each backend has one library
(the CPU's `cpu/kernels/library.py`, the GPU's `cuda/library.py`), and a step keeps the
kernel chosen for it (`Step.chosen`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..errors import RanvierError
from ..flow.graph import Operation, Variable
from ..ops import op_def
from ..runtime import Step

Plan = TypeVar("Plan")
# Ranks for kernels of any op (`ops=None`): those for data with no elements come before every
# other kernel; the general ones (an elementwise op's formula) after every op's own.
EMPTY_DATA = -100
GENERAL = 1000
# A backend's generator for a step: on the CPU `emit(ctx, op)` writes LLVM IR; on a GPU
# `emit(op)` gives the op's launches.
Emit = Callable[..., Any]


def _always(op: Operation) -> bool:
    return True


def planned(plan: Plan | None, op: Operation) -> Plan:
    """The plan a kernel's `supports` found for `op` (a tiling, a geometry), as its emitter
    takes it again: None there means the kernel was asked to emit an op it does not support."""
    if plan is None:
        raise RanvierError(f"{op.type} op {op.name}: its kernel was chosen for an op it does not support")
    return plan


@dataclass(frozen=True)
class Prepared:
    """A constant a kernel reads in a form of its own (a GEMM's weights packed into
    panels), made from the constant's value once per network and target, so no step
    repacks it. `form` names the form; `make(value, target)` makes it."""

    var: Variable
    form: str
    make: Callable[[np.ndarray, Any], np.ndarray]  # (value, the backend's target)


@dataclass(frozen=True)
class Kernel:
    """One way a backend computes ops.

    emit: the backend's generator for a step (on the CPU, `emit(ctx, op)` writes LLVM IR).
    supports: whether this kernel can run a given op (its dtypes, shapes, attributes).
    rank: its place among the kernels that may take the same ops: lower ranks are tried
        first (0, the default: an op's own kernel, ahead of the general ones).
    prefer: whether, for an op it can run, this kernel is to run it rather than the next
        kernel that can (a choice measured on this machine: faster here); None: always.
    flops: FLOPs per execution, for profiles (default: the op definition's count).
    in_place: whether the kernel may write output `target` over input `source` when the
        input dies at this step: `in_place(op, source, target)`.
    workspace: bytes of working memory the kernel needs while it runs.
    prepares: the constants it reads in a form of its own, made once (`Prepared`).
    calls: the backend's shared routines its code calls (on the CPU, the slots of a cell's
        pointer table holding its GEMMs), which a cell's table holds where a step's kernel
        calls them, and which a target that cannot run them passes the kernel over for.
    native: False for a fallback that leaves generated code (the printed cell says so).
    """

    name: str
    ops: frozenset[str] | None
    emit: Emit
    supports: Callable[[Operation], bool] = _always
    rank: int = 0
    prefer: Callable[[Operation], bool] | None = None
    flops: Callable[[Operation], int] | None = None
    in_place: Callable[[Operation, Variable, Variable], bool] | None = None
    workspace: Callable[[Operation], int] | None = None
    prepares: Callable[[Operation], list[Prepared]] | None = None
    calls: frozenset[int] = frozenset()
    native: bool = True

    def takes(self, op: Operation) -> bool:
        """Whether the kernel is for ops of `op`'s type and can run this one."""
        return (self.ops is None or op.type in self.ops) and self.supports(op)

    def overlaps(self, other: Kernel) -> bool:
        """Whether the two kernels may be asked for ops of one type."""
        return self.ops is None or other.ops is None or bool(self.ops & other.ops)

    def cost(self, op: Operation) -> int:
        return self.flops(op) if self.flops is not None else op_def(op.type).cost(op)

    def may_write_over(self, op: Operation, source: Variable, target: Variable) -> bool:
        return self.in_place is not None and self.in_place(op, source, target)

    def workspace_bytes(self, op: Operation) -> int:
        return self.workspace(op) if self.workspace is not None else 0

    def prepared(self, op: Operation) -> list[Prepared]:
        return self.prepares(op) if self.prepares is not None else []


def chosen_kernel(step: Step) -> Kernel:
    """The library kernel chosen for `step` (kept on it as it was chosen)."""
    if not isinstance(step.chosen, Kernel):
        raise RanvierError(f"step {step.op.name} ({step.kernel}) has no library kernel: it was chosen by another backend")
    return step.chosen


class KernelLibrary:
    """The kernels of one backend (a backend's may be a subclass of Kernel, with what its
    generators need besides), tried in order of rank (`Kernel.rank`)."""

    def __init__(self, name: str, fallback: Kernel):
        self.name = name
        self.fallback = fallback
        self.kernels: list[Kernel] = []

    def register(self, kernel: Kernel) -> Kernel:
        for other in self.kernels:
            if other.name == kernel.name and other.ops == kernel.ops:
                raise ValueError(f"{self.name} library: kernel {kernel.name} for {sorted(kernel.ops or ['every op'])} is registered twice")
            if other.rank == kernel.rank and other.overlaps(kernel):
                raise ValueError(f"{self.name} library: kernels {other.name} and {kernel.name} may take the same ops "
                                 f"and have the same rank {kernel.rank}: give one a rank that says which is tried first")
        self.kernels.append(kernel)
        self.kernels.sort(key=lambda k: (k.rank, k.name))
        return kernel

    def kernel(self, name: str, ops: Iterable[str] | None = None, **options: Any) -> Callable[[Emit], Emit]:
        """Decorator: register the decorated emitter as kernel `name` for `ops`."""

        def register(emit: Emit) -> Emit:
            self.register(Kernel(name, frozenset(ops) if ops is not None else None, emit, **options))
            return emit

        return register

    def choose(self, op: Operation, unavailable: Container[str] = ()) -> Kernel:
        """The first kernel, by rank, that can run `op` and is preferred for it; where each
        that can run it prefers the next, the first of them; where none can, the fallback.
        Kernels named in `unavailable` (their instructions are not the target's) are passed
        over."""
        passed_over: Kernel | None = None
        for kernel in self.kernels:
            if kernel.name in unavailable or not kernel.takes(op):
                continue
            if kernel.prefer is None or kernel.prefer(op):
                return kernel
            passed_over = passed_over or kernel
        return passed_over or self.fallback

    def supports(self, op: Operation, unavailable: Container[str] = ()) -> bool:
        """Whether a native kernel runs the op whole."""
        return self.choose(op, unavailable).native
