"""Simplification passes: constant folding and common-subexpression elimination."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import TensorType, op_def
from .rewrite import erase, replace_uses

FOLD_LIMIT = 1 << 16  # elements: fold small constant results, keep big ones as computations


def _written(flow: Flow) -> set[str]:
    """Globals some op writes in place, in any function: state one cell updates and
    another reads is not a constant of either."""
    names = set()
    for op in flow.ops.values():
        for i in op_def(op.type).written_inputs(op):
            names.add(op.inputs[i].name)
    return names


def fold_constants(flow: Flow, func: Function, keep: set[str]) -> None:
    """Evaluate ops whose inputs are all constants at compile time."""
    written = _written(flow)
    for op in flow.op_order(func):
        definition = op_def(op.type)
        if (
            not op.outputs
            or definition.written_inputs(op)
            or any(v.data is None or v.learnable or v.name in written for v in op.inputs)
            or any(v.name in keep or v.size > FOLD_LIMIT for v in op.outputs)
        ):
            continue
        types = [TensorType(v.dtype, tuple(v.shape)) for v in op.outputs]
        args = [np.asarray(v.data) for v in op.inputs]
        args = [a.astype(np.float32) if v.dtype in ("float16", "bfloat16") else a for a, v in zip(args, op.inputs)]
        with np.errstate(all="ignore"):
            results = definition.reference(definition.attrs_of(op), args, types)
        outputs = list(op.outputs)
        flow.remove_op(op)
        for var, result in zip(outputs, results):
            var.set_data(result)


def _operand_key(var: Variable, written: set[str]) -> Hashable:
    """What makes two operands the same: their variable, or for small constants their
    value (a gradient rule's 1/√2 is the forward pass's 1/√2)."""
    if var.data is not None and not var.learnable and var.size <= 16 and var.name not in written:
        return ("constant", var.dtype, tuple(var.shape), np.asarray(var.data).tobytes())
    return var.name


def eliminate_common_subexpressions(flow: Flow, func: Function, keep: set[str]) -> None:
    """Ops of one type, with the same attributes and inputs, compute the same thing once."""
    seen: dict[Hashable, Operation] = {}
    written = _written(flow)
    for op in flow.op_order(func):
        if not op.outputs or op_def(op.type).written_inputs(op):
            continue
        key = (op.type, tuple(sorted(op.attrs.items())), tuple(_operand_key(v, written) for v in op.inputs))
        original = seen.get(key)
        if original is None or any(v.name in keep for v in op.outputs):
            seen.setdefault(key, op)
            continue
        for duplicate, kept in zip(op.outputs, original.outputs):
            replace_uses(duplicate, kept)
        erase(flow, [op], list(op.outputs))
