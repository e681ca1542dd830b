"""Kernel libraries, as Myelin's: a backend's kernels each say which ops they support and
what they cost, and for every step the library picks the first kernel that supports its op.

    @LIBRARY.kernel("SoftmaxRow", ops={"Softmax"}, supports=last_axis)
    def softmax(ctx, op): ...

A kernel with `ops=None` is tried for every op type (the elementwise kernel takes any
op with a formula). The fallback is what runs when no kernel supports an op; it is not
native, so the compiler decomposes such an op where its definition can.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..errors import RanvierError
from ..flow.graph import Operation, Variable
from ..ops import op_def

Plan = TypeVar("Plan")
Emit = Callable[..., None]  # a backend's generator for a step (on the CPU, `emit(ctx, op)`)


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
    supports: whether this kernel handles a given op (its dtypes, shapes, attributes).
    flops: FLOPs per execution, for profiles (default: the op definition's count).
    in_place: whether the kernel may write output `target` over input `source` when the
        input dies at this step: `in_place(op, source, target)`.
    workspace: bytes of working memory the kernel needs while it runs.
    prepares: the constants it reads in a form of its own, made once (`Prepared`).
    native: False for a fallback that leaves generated code (the printed cell says so).
    """

    name: str
    ops: frozenset[str] | None
    emit: Emit
    supports: Callable[[Operation], bool] = _always
    flops: Callable[[Operation], int] | None = None
    in_place: Callable[[Operation, Variable, Variable], bool] | None = None
    workspace: Callable[[Operation], int] | None = None
    prepares: Callable[[Operation], list[Prepared]] | None = None
    native: bool = True

    def cost(self, op: Operation) -> int:
        return self.flops(op) if self.flops is not None else op_def(op.type).cost(op)

    def may_write_over(self, op: Operation, source: Variable, target: Variable) -> bool:
        return self.in_place is not None and self.in_place(op, source, target)

    def workspace_bytes(self, op: Operation) -> int:
        return self.workspace(op) if self.workspace is not None else 0

    def prepared(self, op: Operation) -> list[Prepared]:
        return self.prepares(op) if self.prepares is not None else []


class KernelLibrary:
    """The kernels of one backend, tried in registration order (`first=True` puts a kernel,
    a user's say, ahead of the ones there)."""

    def __init__(self, name: str, fallback: Kernel):
        self.name = name
        self.fallback = fallback
        self.kernels: list[Kernel] = []

    def register(self, kernel: Kernel, first: bool = False) -> Kernel:
        if any(k.name == kernel.name and k.ops == kernel.ops for k in self.kernels):
            raise ValueError(f"{self.name} library: kernel {kernel.name} for {sorted(kernel.ops or ['every op'])} is registered twice")
        if first:
            self.kernels.insert(0, kernel)
        else:
            self.kernels.append(kernel)
        return kernel

    def kernel(
        self, name: str, ops: Iterable[str] | None = None, *, first: bool = False, **options: Any,
    ) -> Callable[[Emit], Emit]:
        """Decorator: register the decorated emitter as kernel `name` for `ops`."""

        def register(emit: Emit) -> Emit:
            self.register(Kernel(name, frozenset(ops) if ops is not None else None, emit, **options), first)
            return emit

        return register

    def choose(self, op: Operation, unavailable: Container[str] = ()) -> Kernel:
        """The first kernel that supports `op`, else the fallback; kernels named in
        `unavailable` (their instructions are not the target's) are passed over."""
        for kernel in self.kernels:
            if kernel.name not in unavailable and (kernel.ops is None or op.type in kernel.ops) and kernel.supports(op):
                return kernel
        return self.fallback

    def supports(self, op: Operation, unavailable: Container[str] = ()) -> bool:
        """Whether a native kernel runs the op whole."""
        return self.choose(op, unavailable).native
