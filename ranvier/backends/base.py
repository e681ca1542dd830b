"""The interface every backend implements, and the options a compile passes it.

The compiler owns the passes and the memory plan; a backend says what it can run
(`runs_whole`, `capabilities`), picks a kernel for each op (`choose`), and generates,
binds and runs a cell's code. Adding a backend touches no compiler file: implement
`Backend` and name it in `ranvier.backends.register_backend`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..flow.graph import Operation, Variable
from ..runtime import Cell, Instance, Step

MATMUL_PRECISIONS = ("float32", "tfloat32", "bfloat16", "int8")
# Precisions only products by an unchanging constant matrix take (an inference model's
# weights, kept so ahead of time): a training step has none to give them.
WEIGHT_PRECISIONS = ("int8",)
PRECISIONS = ("float32", "bfloat16", "float16")  # what activations are stored in
DENORMALS = ("keep", "flush")


@dataclass(frozen=True)
class CompileOptions:
    """What a user asks of a compile, whatever the backend.

    cpu: CPU features to mask, e.g. "-avx512" (Myelin's --cpu; CPU backend only).
    cache: reuse generated code across processes (the on-disk compile cache).
    matmul: one of MATMUL_PRECISIONS: "float32", or "tfloat32" / "bfloat16": float32 matrix
        products round their inputs to that type and sum in float32, where the backend can
        (`Capabilities`); "int8": products by an unchanging constant matrix read it as int8
        blocks of 32 along k with a float16 scale each (llama.cpp's q8_0), their other input
        quantized the same way, int32 sums of the blocks' products (`narrow_weights`); other
        products stay float32.
    denormals: one of DENORMALS: "keep" computes with IEEE subnormal numbers; "flush" makes
        the CPU backend's code treat them as zero, inputs and results (x86's FTZ and DAZ
        modes, for the cell and the workers running its parts). On Intel cores an
        arithmetic operation on a subnormal costs some hundred cycles: an Adam step over
        state decayed below 1e-38 ran 13 times slower.
    precision: one of PRECISIONS: "float32", or "bfloat16" / "float16": activations and their
        gradients stored in that type (parameters, optimizer state and losses in float32),
        where the backend can (`Capabilities.activation_precisions`)."""

    cpu: str = ""
    cache: bool = True
    matmul: str = "float32"
    denormals: str = "keep"
    precision: str = "float32"


DEFAULT_OPTIONS = CompileOptions()


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so the compiler knows which passes apply.

    rewrites: run the rewriting passes (decompose, fold, CSE, fuse); the reference
        backend runs the flow exactly as built, which is what makes it the oracle.
    matmul_precisions: the precisions its matrix products can run in.
    activation_precisions: the precisions it can store activations in.
    epilogues: it runs a matrix product or convolution and the elementwise program after
        it as one op (MatMulCalculate, Conv2DCalculate), so the epilogue pass may fuse them.
    fuses_epilogue: where given, which epilogues it runs so — `fuses_epilogue(product,
        program, inputs)` for the product's variable, the fused op's program and its further
        inputs; the others stay apart (cuBLASLt adds a bias and applies a ReLU, no more).
    foreach: where given, it runs independent ops of one type and attributes as one kernel
        (a ForEach), so the horizontal fusion pass groups them: `foreach(op)` is a key,
        equal for ops one kernel can run together, or None for an op it would not group.
    foreach_operands: the most variables one such kernel takes.
    pools_convolution: where given, it runs a Conv2DCalculate and the MaxPool that alone
        reads it as one op (Conv2DCalculateMaxPool) where `pools_convolution(conv, pool)`.
    narrow_weights: the precisions it can keep an unchanging constant matrix in, packed
        ahead of time, so that even a vector-matrix product by one (a decode step's, which
        only streams the matrix) reads fewer bytes; the mixed-precision pass marks those too
        (bfloat16, or int8's q8_0 blocks)."""

    rewrites: bool = True
    matmul_precisions: tuple[str, ...] = ("float32",)
    activation_precisions: tuple[str, ...] = ("float32",)
    epilogues: bool = True
    fuses_epilogue: Callable[[Variable, str, list[Variable]], bool] | None = None
    foreach: Callable[[Operation], Hashable | None] | None = None
    foreach_operands: int = 0
    pools_convolution: Callable[[Operation, Operation], bool] | None = None
    narrow_weights: tuple[str, ...] = ()


class Backend(Protocol):
    """What the compiler and the runtime call on a backend: nothing else is asked of one.

    A backend is built by `factory(options)` (`register_backend`) with the compile's
    `CompileOptions`. The compiler runs its passes as `capabilities` allow (decomposing what
    `runs_whole` refuses), asks `choose` for each op's step, plans memory (with
    `workspace_bytes`, `in_place` and `shares_storage`) and calls `finish` with the cell laid
    out; an `Instance` of the cell then calls `bind` once and the function it returns on each
    compute, and reads its profile through `step_seconds` and `all_cores_seconds`. mypy checks
    each backend, and tests/test_backend_protocol.py one written against this class alone."""

    name: str  # what `Compiler(backend=...)` calls it

    @property
    def capabilities(self) -> Capabilities:
        """Which of the compiler's passes apply to its flows."""

    @property
    def step_time_dtype(self) -> type[np.generic]:
        """The unit an instance accumulates its step times in (seconds, cycles), as the dtype
        of `Instance.step_time`."""

    def runs_whole(self, op: Operation) -> bool:
        """Whether a kernel runs the op as it is; if not, the compiler decomposes it."""

    def choose(self, op: Operation) -> Step:
        """The step that computes `op`: its kernel, variant and cost."""

    def workspace_bytes(self, step: Step) -> int:
        """Bytes of working memory the step's kernel needs while it runs, 0 for none: the
        compiler plans them like a temporary live during the step, as `step.workspace`."""

    def in_place(self, op: Operation, source: Variable, target: Variable) -> bool:
        """Whether `op` may write `target` over `source` when `source` dies at `op`."""

    def shares_storage(self, op: Operation) -> bool:
        """Whether a view op's output may simply be its input's bytes."""

    def finish(self, cell: Cell) -> None:
        """Generate (or fetch from a cache) the cell's code, kept in `cell.native`."""

    def bind(self, cell: Cell, instance: Instance) -> Callable[[], None]:
        """The function that computes the cell on an instance's data, called once per
        instance; it adds each step's time to `instance.step_time` (and the part of it run
        on all cores to `instance.all_cores_time`) in `step_time_dtype`'s unit."""

    def step_seconds(self, instance: Instance) -> np.ndarray:
        """The instance's accumulated step times, in seconds."""

    def all_cores_seconds(self, instance: Instance) -> np.ndarray:
        """The part of each step's accumulated time it ran split over all the cores, in seconds."""

    def peak_gflops(self, matmul: str, product_seconds: Callable[[int], float]) -> tuple[float, str] | None:
        """The rate a training run's share of peak (the dashboard's) is taken against, with
        its matrix products in `matmul`, and what was measured; a device's own figure is
        timed on an n × n × n product compiled for this backend, whose seconds (by the
        backend's clock, the best of several computes) `product_seconds(n)` gives. None: no
        figure of its own (the host's fp32 GEMM is taken)."""

    def code(self, cell: Cell, kind: str) -> str:
        """The generated code of a cell as text, e.g. kind "llvm" or "asm"; a RanvierError
        for a kind the backend does not generate."""
