"""State ops: Assign overwrites a variable in place (parameters, optimizer state, counters).

Assign has no outputs; it writes its second input into its first. The compiler
schedules it after every other reader of the target in the same function.
"""

from __future__ import annotations

import numpy as np

from .registry import define


def _infer_assign(ctx):
    target, value = ctx.inputs
    if target.dtype != value.dtype or tuple(target.shape) != tuple(value.shape):
        raise ctx.fail(f"a value of the target's type {target.dtype}[{'x'.join(map(str, target.shape))}]")
    return []


ASSIGN = define(
    "Assign",
    _infer_assign,
    lambda attrs, args, outs: [np.asarray(args[1])],
    2,
    "state",
    "Assign(target, value): target = value, in place",
)
ASSIGN.extra["written_inputs"] = lambda op: [0]
