"""The reference backend: runs every op through its numpy reference. It is the oracle
every other backend is tested against, so it favours clarity and accuracy over speed."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .. import dtypes
from ..errors import RanvierError
from ..flow.graph import Operation, Variable
from ..ops import TensorType, op_def
from ..runtime import Cell, Instance, Step
from .base import DEFAULT_OPTIONS, Capabilities, CompileOptions

_LOW_PRECISION = (dtypes.DT_FLOAT16, dtypes.DT_BFLOAT16)


def _widen(array: np.ndarray, var: Variable) -> np.ndarray:
    """Half-precision inputs are computed in float32 and rounded once on output."""
    return array.astype(np.float32) if var.dtype in _LOW_PRECISION else array


class ReferenceBackend:
    name = "reference"
    step_time_dtype = np.float64  # seconds, from the host clock
    # The oracle runs the flow exactly as built: no rewriting, every op whole.
    capabilities = Capabilities(rewrites=False)

    def __init__(self, options: CompileOptions = DEFAULT_OPTIONS):
        self.options = options

    def runs_whole(self, op: Operation) -> bool:
        return True

    def workspace_bytes(self, step: Step) -> int:
        return 0

    def code(self, cell: Cell, kind: str) -> str:
        raise RanvierError(f"the reference backend generates no code: cell {cell.name} runs each op's numpy reference")

    def choose(self, op: Operation) -> Step:
        return Step(op, op.type, "reference", op_def(op.type).cost(op))

    def in_place(self, op: Operation, source: Variable, target: Variable) -> bool:
        # Every reference kernel computes its results before writing any of them.
        return source.nbytes == target.nbytes

    def shares_storage(self, op: Operation) -> bool:
        return False  # the oracle keeps every value in its own storage

    def finish(self, cell: Cell) -> None:
        """Nothing to generate: the reference runs the steps as they are."""

    def bind(self, cell: Cell, instance: Instance) -> Callable[[], None]:
        kernels = [reference_kernel(step.op, instance) for step in cell.steps]
        clock = time.perf_counter
        times = instance.step_time

        def run() -> None:
            for index, kernel in enumerate(kernels):
                start = clock()
                kernel()
                times[index] += clock() - start

        return run

    def step_seconds(self, instance: Instance) -> np.ndarray:
        return instance.step_time

    def peak_gflops(self, matmul: str, product_seconds: Callable[[int], float]) -> tuple[float, str] | None:
        return None  # numpy on the host: the host's GEMM is the peak

    def all_cores_seconds(self, instance: Instance) -> np.ndarray:
        return instance.all_cores_time  # numpy's own threads are not counted: zeros


def reference_kernel(op: Operation, instance: Instance) -> Callable[[], None]:
    """Run one op's numpy reference on an instance's views (also the CPU backend's fallback)."""
    inputs = [instance.view(v) for v in op.inputs]
    # Results fill the outputs, then the inputs the op overwrites in place.
    outputs = [instance.view(v) for v in op.outputs]
    outputs += [instance.view(op.inputs[i]) for i in op_def(op.type).written_inputs(op)]

    def kernel() -> None:
        for out, result in zip(outputs, evaluate(op, inputs)):
            np.copyto(out, result.reshape(out.shape), casting="unsafe")

    return kernel


def evaluate(op: Operation, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The op's numpy reference on `inputs`: its outputs, then the new values of the
    inputs it writes in place."""
    definition = op_def(op.type)
    types = [TensorType(v.dtype, tuple(v.shape)) for v in op.outputs]
    args = [_widen(array, var) for array, var in zip(inputs, op.inputs)]
    # IEEE semantics: overflow, inf and NaN are values here, not warnings.
    with np.errstate(all="ignore"):
        try:
            results = definition.reference(definition.attrs_of(op), args, types)
        except (IndexError, ValueError, ZeroDivisionError) as error:
            raise RanvierError(f"{op.type} op {op.name} failed: {error}") from error
    return [np.asarray(result) for result in results]
