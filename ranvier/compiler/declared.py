"""Outputs as Myelin programs declare them.

Myelin programs often declare an op's output themselves (a `rawop` and a variable of
their choosing: a Gather of one index into [1, d] rather than [1, 1, d]), and Myelin's
kernels check only that the elements fit. The compiler keeps the declared shape: the op
computes its own shape into a new variable, and a Reshape gives the declared one (in
the same storage where the memory plan allows).

Myelin's builders (SLING's Python Builder, the C++ FlowBuilder) also declare a
comparison or a logic op with its input's type: `Less` of two float32 tensors is a
float32 tensor, and `And`, `Not`, `All`, and `Cond`'s and `Select`'s conditions read
such tensors. The compiler keeps the declared type: a numeric condition is true where it
is not zero, and a bool result is cast to the declared type, 0 or 1 (Myelin's kernels
write all-one bit masks there; both read as the same booleans).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .. import dtypes
from ..errors import CompileError, RanvierError
from ..flow.builder import Builder
from ..flow.graph import Flow, Operation
from ..ops import TensorType, has_op, op_def
from .rewrite import add_op, write_into

# How many leading inputs of each op are conditions (None: all of them).
_CONDITION_INPUTS = {"And": None, "Or": None, "Xor": None, "AndNot": None, "Not": None, "All": None, "Any": None,
                     "Cond": 1, "Select": 1}


def convert_declared_conditions(flow: Flow) -> None:
    for op in list(flow.ops.values()):
        if op.func is None or op.type not in _CONDITION_INPUTS:
            continue
        conditions = op.inputs[: _CONDITION_INPUTS[op.type]]
        for var in dict.fromkeys(v for v in conditions if v.dtype in dtypes.NUMERIC_DTYPES):
            op.replace_input(var, Builder(flow, op.func).not_equal(var, 0).var)
    for op, index, computed in _declared_outputs(flow):
        declared = op.outputs[index]
        if computed.dtype == dtypes.DT_BOOL and declared.dtype in dtypes.NUMERIC_DTYPES:
            _redirect_output(flow, op, index, computed, "Cast", declared.dtype)


def reshape_declared_outputs(flow: Flow) -> None:
    for op, index, computed in _declared_outputs(flow):
        declared = op.outputs[index]
        if (declared.dtype == computed.dtype and declared.shape_defined() and declared.shape != list(computed.shape)
                and math.prod(declared.shape) == math.prod(computed.shape)):
            _redirect_output(flow, op, index, computed, "Reshape", declared.shape)


def _declared_outputs(flow: Flow) -> Iterator[tuple[Operation, int, TensorType]]:
    """(op, output index, the type the op computes there) for every output of every op in
    a function; ops whose types cannot be inferred are left to the type check that follows."""
    for op in list(flow.ops.values()):
        if op.func is None or not op.outputs or op.type == "Reshape" or not has_op(op.type):
            continue
        try:
            types = op_def(op.type).infer_types(op.name, op.inputs, op.attrs)
        except RanvierError:
            continue
        for index, computed in enumerate(types[: len(op.outputs)]):
            yield op, index, computed


def _redirect_output(flow: Flow, op: Operation, index: int, computed: TensorType, convert: str,
                     target: str | list[int]) -> None:
    """Make `op` write its output `index` as it computes it, into a new variable, and a
    `convert` op (Reshape to shape `target`, Cast to dtype `target`) fill the declared one."""
    func = op.func
    if func is None:
        raise CompileError(f"{op.type} op {op.name} belongs to no function")
    result = flow.add_var(flow.unique_name(f"{op.outputs[index].name}.computed", flow.vars), computed.dtype, computed.shape)
    declared = write_into(op, index, result)
    view = add_op(flow, func, convert, [result], [declared], name=f"{op.name}.declared")
    if convert == "Reshape":
        shape = flow.add_var(flow.unique_name(f"{view.name}/shape", flow.vars), "int32", [len(target)])
        shape.data = np.asarray(target, np.int32)
        view.add_input(shape)
    else:
        view.set_attr("dtype", target)
