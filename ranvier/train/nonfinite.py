"""Finding where a training step first produced inf or NaN.

Every compiled update is guarded: a step whose gradients are not all finite writes no
parameter and no optimizer state. With loss scaling such a step is expected now and then
(the scale backs off and the step is counted as skipped). Without it, training stops
with a `NonFiniteError` naming the step and the first tensor that held a non-finite
value. Because the guarded step left the parameters as they were, and the batch is still
in the cell's inputs, the trainer can replay the step's function op by op through the
numpy references to find that tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ..backends.reference import evaluate
from ..errors import RanvierError
from ..flow.graph import Flow, Function


class NonFiniteError(RanvierError):
    """Training met inf or NaN without loss scaling: `step` (1-based) and the tensor."""

    def __init__(self, step: int, where: str):
        super().__init__(
            f"step {step}: training stopped on a non-finite value; the first is {where}. "
            "The step updated nothing: the parameters are as before it. A lower learning rate, "
            "gradient clipping or loss scaling may help."
        )
        self.step = step
        self.where = where


def describe(name: str, array: np.ndarray) -> str | None:
    """'<name>: 3 of 640 elements are NaN, the first at [0, 17]', or None when all are finite."""
    array = np.asarray(array)
    if not np.issubdtype(array.dtype, np.floating) and array.dtype.kind != "V":
        return None  # integers and booleans are always finite
    values = array.astype(np.float32) if array.dtype.kind == "V" else array  # bfloat16 as stored
    bad = ~np.isfinite(values)
    if not bad.any():
        return None
    first = np.unravel_index(int(np.argmax(bad)), array.shape) if array.ndim else ()
    kinds = sorted({"NaN" if np.isnan(v) else "inf" for v in values[bad][:1000].tolist()})
    return (f"{name}: {int(bad.sum()):,} of {array.size:,} elements are {' or '.join(kinds)}, "
            f"the first at [{', '.join(map(str, first))}]")


def first_in(named: Iterable[tuple[str, np.ndarray]]) -> str | None:
    """The description of the first of the (name, array) pairs that is not all finite."""
    for name, array in named:
        found = describe(name, array)
        if found is not None:
            return found
    return None


def replay(flow: Flow, func: Function, values: Mapping[str, np.ndarray]) -> str | None:
    """Run `func`'s ops in order on `values` (its inputs by name: the parameters' current
    values, the batch; a constant defaults to its data) and describe the first non-finite
    tensor: an input, or an op's output whose inputs were finite. Writes (Assign) are not
    replayed: they change nothing the step computes."""
    arrays: dict[str, np.ndarray] = {}
    for var in flow.inputs(func):
        arrays[var.name] = values.get(var.name, var.data)
        found = describe(f"input {var.name}", arrays[var.name])
        if found is not None:
            return found
    for op in flow.op_order(func):
        if op.type == "Assign":
            continue
        results = evaluate(op, [arrays[v.name] for v in op.inputs])
        for var, result in zip(op.outputs, results):
            arrays[var.name] = result
            found = describe(f"{var.name} (output of {op.type} op {op.name})", result)
            if found is not None:
                return found
    return None
