"""Outputs declared with another shape of the same size.

Myelin programs often declare an op's output themselves (a `rawop` and a variable of
their choosing: a Gather of one index into [1, d] rather than [1, 1, d]), and Myelin's
kernels check only that the elements fit. The compiler keeps the declared shape: the op
computes its own shape into a new variable, and a Reshape gives the declared one (in
the same storage where the memory plan allows).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import RanvierError
from ..flow.graph import Flow, Operation
from ..ops import op_def


def reshape_declared_outputs(flow: Flow) -> None:
    for op in list(flow.ops.values()):
        if op.func is None or not op.outputs or op.type == "Reshape":
            continue
        try:
            types = op_def(op.type).infer_types(op.name, op.inputs, op.attrs)
        except RanvierError:
            continue  # the type check that follows reports it
        for index, (var, t) in enumerate(zip(op.outputs, types)):
            declared = list(var.shape)
            if (var.dtype == t.dtype and var.shape_defined() and declared != list(t.shape)
                    and math.prod(declared) == math.prod(t.shape)):
                _reshape_output(flow, op, index, list(t.shape))


def _reshape_output(flow: Flow, op: Operation, index: int, shape: list[int]) -> None:
    declared = op.outputs[index]
    computed = flow.add_var(flow.unique_name(f"{declared.name}.computed", flow.vars), declared.dtype, shape)
    declared.producer = None
    op.outputs[index] = computed
    computed.producer = op
    view = flow.add_op(flow.unique_name(f"{op.name}.declared", flow.ops), "Reshape")
    target = flow.add_var(flow.unique_name(f"{view.name}/shape", flow.vars), "int32", [len(declared.shape)])
    target.data = np.asarray(declared.shape, np.int32)
    view.add_input(computed)
    view.add_input(target)
    view.add_output(declared)
    op.func.add(view)
