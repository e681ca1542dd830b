"""Elementwise math as loop bodies, for every LLVM backend: an op's formula applied to IR
values, and a Calculate program evaluated statement by statement. The CPU's vector loops
and the GPU's one-thread-per-element kernels run the same bodies, so an op defined with a
formula gets a kernel on each."""

from __future__ import annotations

from collections.abc import Callable

from ...errors import RanvierError
from ...ops import Attrs, op_def
from ...ops.expression import Call, Program
from .strided import Body
from .values import Value


def apply(op_type: str, attrs: dict[str, str], args: list[Value]) -> Value:
    """`op_type(args)` on IR values, by the op's formula, with its typed attributes."""
    definition = op_def(op_type)
    if definition.formula is None:
        raise RanvierError(f"op type {op_type} has no formula to generate code from")
    return definition.formula(*args, **Attrs(attrs, op_type, op_type, definition.attrs).values())


# An op's formula in place of its own: its arguments and attributes → its value.
Formula = Callable[[list[Value], dict[str, str]], Value]
# The formula a call of a program is computed by in place of its op's own, or None.
Formulas = Callable[[Call], Formula | None]


def program_body(program: Program, outputs: int, formulas: Formulas | None = None) -> Body:
    """A Calculate program as a loop body: its `outputs` results, then what it writes in place;
    a call for which `formulas` names one computed by that formula instead of its op's own."""

    def call(node: Call, args: list[Value]) -> Value:
        attrs = dict(node.attrs)
        formula = formulas(node) if formulas is not None else None
        return formula(args, attrs) if formula is not None else apply(node.op_type, attrs, args)

    def body(values, lanes):
        return program.evaluate(values, outputs, call)

    return body
