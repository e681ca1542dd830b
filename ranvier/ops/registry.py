"""The op registry: each op type is declared once with its shape/dtype rule and numpy reference.

Later layers attach more to the same definition (a VJP in `ranvier.autodiff`, a
decomposition for the compiler), so one op has exactly one place to look.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import ShapeError, UnknownOpError
from ..flow.graph import shape_str


@dataclass(frozen=True)
class TensorType:
    """The dtype and static shape of one op output."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


class Attrs:
    """Typed reads of an op's string attributes; a malformed value names the op and attribute."""

    def __init__(self, attrs: dict[str, str], op_name: str = "", op_type: str = ""):
        self.raw = attrs
        self.op_name = op_name
        self.op_type = op_type

    def _bad(self, name: str, expected: str) -> ShapeError:
        return ShapeError(
            f"{self.op_type} op {self.op_name}: attribute {name}={self.raw[name]!r} is not {expected}"
        )

    def has(self, name: str) -> bool:
        return name in self.raw

    def str(self, name: str, default: str | None = None) -> str | None:
        return self.raw.get(name, default)

    def int(self, name: str, default: int | None = None) -> int | None:
        if name not in self.raw:
            return default
        try:
            return int(self.raw[name])
        except ValueError:
            raise self._bad(name, "an integer") from None

    def float(self, name: str, default: float | None = None) -> float | None:
        if name not in self.raw:
            return default
        try:
            return float(self.raw[name])
        except ValueError:
            raise self._bad(name, "a number") from None

    def bool(self, name: str, default: bool = False) -> bool:
        if name not in self.raw:
            return default
        value = self.raw[name].strip().lower()
        if value in ("1", "true", "yes"):
            return True
        if value in ("0", "false", "no", ""):
            return False
        raise self._bad(name, "a boolean (1/0/true/false)")

    def ints(self, name: str, default: Sequence[int] | None = None) -> list[int] | None:
        """A list of integers, written as "1,2,3" (ranvier) or "[1, 2, 3]" (Myelin's Python)."""
        if name not in self.raw:
            return None if default is None else list(default)
        text = self.raw[name].strip().strip("[]()")
        if not text:
            return []
        try:
            return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
        except ValueError:
            raise self._bad(name, "a list of integers") from None


class InferContext:
    """What a shape rule sees: the op's identity, its input variables and its attributes."""

    def __init__(self, op_name: str, op_type: str, inputs: Sequence, attrs: dict[str, str]):
        self.op_name = op_name
        self.op_type = op_type
        self.inputs = list(inputs)
        self.attrs = Attrs(attrs, op_name, op_type)

    def fail(self, expected: str) -> ShapeError:
        """An error naming the op, every input with its type, and what was expected."""
        described = ", ".join(
            f"{getattr(v, 'name', '?')}: {v.dtype}[{shape_str(v.shape)}]" for v in self.inputs
        )
        return ShapeError(f"{self.op_type} op {self.op_name} got ({described}); expected {expected}")

    def constant(self, index: int, what: str) -> np.ndarray:
        """The constant data of input `index` (shape arguments such as Reshape's target)."""
        if index >= len(self.inputs) or self.inputs[index].data is None:
            raise self.fail(f"input {index} ({what}) to be a constant")
        return np.asarray(self.inputs[index].data)


InferFn = Callable[[InferContext], list[TensorType]]
ReferenceFn = Callable[[Attrs, list[np.ndarray], list[TensorType]], list[np.ndarray]]


@dataclass
class OpDef:
    """Everything ranvier knows about one op type."""

    type: str
    infer: InferFn
    reference: ReferenceFn
    min_inputs: int
    max_inputs: int | None
    family: str
    doc: str = ""
    extra: dict = field(default_factory=dict)

    def written_inputs(self, op) -> list[int]:
        """Indices of the inputs this op overwrites in place (Assign's target, a fused update)."""
        rule = self.extra.get("written_inputs")
        return rule(op) if rule is not None else []

    def infer_types(self, op_name: str, inputs: Sequence, attrs: dict[str, str]) -> list[TensorType]:
        ctx = InferContext(op_name, self.type, inputs, attrs)
        n = len(ctx.inputs)
        if n < self.min_inputs or (self.max_inputs is not None and n > self.max_inputs):
            if self.max_inputs is None:
                expected = f"at least {self.min_inputs} inputs"
            elif self.min_inputs == self.max_inputs:
                expected = f"{self.min_inputs} input{'s' if self.min_inputs != 1 else ''}"
            else:
                expected = f"{self.min_inputs} to {self.max_inputs} inputs"
            raise ctx.fail(expected)
        return self.infer(ctx)


_REGISTRY: dict[str, OpDef] = {}


def define(
    type: str,
    infer: InferFn,
    reference: ReferenceFn,
    inputs: int | tuple[int, int | None],
    family: str,
    doc: str = "",
) -> OpDef:
    """Register an op type. Redefining a type is an error: one definition per op."""
    if type in _REGISTRY:
        raise ValueError(f"op {type} is defined twice")
    lo, hi = (inputs, inputs) if isinstance(inputs, int) else inputs
    definition = OpDef(type, infer, reference, lo, hi, family, doc)
    _REGISTRY[type] = definition
    return definition


def op_def(type: str) -> OpDef:
    try:
        return _REGISTRY[type]
    except KeyError:
        raise UnknownOpError(f"unknown op type {type!r}: ranvier has no definition for it") from None


def has_op(type: str) -> bool:
    return type in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)
