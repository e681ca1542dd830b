"""The op registry: everything ranvier knows about an op type, declared once.

An op's definition holds its attributes with their defaults, its shape/dtype rule, its
numpy reference (the oracle), its gradient rule (VJP), its decompositions into other
ops, its FLOP count, the Builder methods that add it, and for elementwise ops a
formula any code generator can evaluate. Backends keep only their kernels, and each
kernel says which ops it supports.

    unary("Softplus", softplus, FLOATS, method="softplus",
          vjp=lambda x, y, g: g * x.sigmoid(),
          formula=lambda x: x.maximum(0) + ((-x.abs()).exp() + 1.0).log())

(the formula is log(1 + eˣ) written so that it never overflows; ops/elementwise.py holds
the real declaration).

Gradient rules and decompositions build ops through a builder they are handed, so
this layer imports nothing of the graph or the compiler.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import RanvierError, ShapeError, UnknownOpError, shape_str

_NO_DEFAULT = object()


@dataclass(frozen=True)
class Attr:
    """One attribute of an op: its name, how its string value reads, and its default.

    kind: "str", "int", "float", "bool", "ints" (a list; one number reads as a
    one-element list), "pair" (two ints; one number is used twice) or "dtype".
    """

    name: str
    kind: str = "str"
    default: Any = None
    doc: str = ""

    def parse(self, text: str, op_name: str = "", op_type: str = ""):
        try:
            return _PARSERS[self.kind](text)
        except (ValueError, KeyError):
            expected = _EXPECTED[self.kind]
            raise ShapeError(f"{op_type} op {op_name}: attribute {self.name}={text!r} is not {expected}") from None


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no", ""):
        return False
    raise ValueError(text)


def _parse_ints(text: str) -> list[int]:
    """"1,2,3" (ranvier) or "[1, 2, 3]" (Myelin's Python)."""
    body = text.strip().strip("[]()")
    return [int(part) for part in body.replace(" ", "").split(",") if part != ""]


def _parse_pair(text: str) -> list[int]:
    values = _parse_ints(text)
    return values * 2 if len(values) == 1 else values


def _parse_dtype(text: str) -> str:
    if text not in dtypes.ALL_DTYPES:
        raise ValueError(text)
    return text


_PARSERS: dict[str, Callable[[str], Any]] = {
    "str": str, "int": int, "float": float, "bool": _parse_bool, "ints": _parse_ints, "pair": _parse_pair,
    "dtype": _parse_dtype,
}
_EXPECTED = {
    "str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean (1/0/true/false)",
    "ints": "a list of integers", "pair": "one or two integers", "dtype": f"one of {', '.join(dtypes.ALL_DTYPES)}",
}


class Attrs:
    """Typed reads of an op's string attributes, defaulted by the op's declaration.

    `attrs["eps"]` reads a declared attribute (its default when absent); the typed
    readers (`attrs.int(name, default)`) also read undeclared ones. A malformed value
    names the op and the attribute.
    """

    def __init__(self, attrs: dict[str, str], op_name: str = "", op_type: str = "", declared: dict[str, Attr] | None = None):
        self.raw = attrs
        self.op_name = op_name
        self.op_type = op_type
        self.declared = declared or {}

    def __getitem__(self, name: str):
        attr = self.declared.get(name)
        if attr is None:
            raise UnknownOpError(f"{self.op_type} declares no attribute {name!r}; it declares {', '.join(self.declared) or 'none'}")
        if name not in self.raw:
            return list(attr.default) if isinstance(attr.default, (list, tuple)) else attr.default
        return attr.parse(self.raw[name], self.op_name, self.op_type)

    def values(self) -> dict[str, Any]:
        """Every declared attribute, typed and defaulted (what formulas receive)."""
        return {name: self[name] for name in self.declared}

    def _read(self, name: str, kind: str, default):
        if name not in self.raw:
            if default is _NO_DEFAULT:
                attr = self.declared.get(name)
                default = attr.default if attr is not None else None
            return list(default) if isinstance(default, (list, tuple)) else default
        return Attr(name, kind).parse(self.raw[name], self.op_name, self.op_type)

    def str(self, name: str, default=_NO_DEFAULT) -> str | None:
        return self._read(name, "str", default)

    def int(self, name: str, default=_NO_DEFAULT) -> int | None:
        return self._read(name, "int", default)

    def float(self, name: str, default=_NO_DEFAULT) -> float | None:
        return self._read(name, "float", default)

    def bool(self, name: str, default=_NO_DEFAULT) -> bool:
        return bool(self._read(name, "bool", default))

    def ints(self, name: str, default=_NO_DEFAULT) -> list[int] | None:
        return self._read(name, "ints", default)


@dataclass(frozen=True)
class TensorType:
    """The dtype and static shape of one op output."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


class InferContext:
    """What a shape rule sees: the op's identity, its input variables and its attributes."""

    def __init__(self, op_name: str, op_type: str, inputs: Sequence, attrs: dict[str, str], declared: dict[str, Attr] | None = None):
        self.op_name = op_name
        self.op_type = op_type
        self.inputs = list(inputs)
        self.attrs = Attrs(attrs, op_name, op_type, declared)

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
# rule(ctx, gradients of the outputs) -> gradients of the inputs (None: nothing flows back)
VJPRule = Callable[[Any, list], list]
# rule(builder, op) -> the op's outputs rebuilt from other ops, or None where it does not apply
DecompositionRule = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Decomposition:
    """How an op is rebuilt from other ops. The compiler applies it where the backend has
    no kernel for the op whole, and also where `prefer(op)` says the rebuilt form is
    better on any backend (GELU in a training step shares its erf with the backward)."""

    rule: DecompositionRule
    prefer: Callable[[Any], bool] | None = None


def zero_gradient(ctx, grads) -> list:
    """The VJP of a piecewise-constant op: zero almost everywhere (nothing flows back)."""
    return [None] * len(ctx.inputs)


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
    attrs: dict[str, Attr] = field(default_factory=dict)
    vjp: VJPRule | None = None
    decompositions: list[Decomposition] = field(default_factory=list)
    flops: Callable[[Any], int] | None = None
    written: Callable[[Any], list[int]] | None = None
    view: bool = False
    formula: Callable | None = None

    def attrs_of(self, op) -> Attrs:
        return Attrs(op.attrs, op.name, self.type, self.attrs)

    def written_inputs(self, op) -> list[int]:
        """Indices of the inputs this op overwrites in place (Assign's target, a fused update)."""
        return self.written(op) if self.written is not None else []

    def cost(self, op) -> int:
        """Floating-point operations one execution performs (for profiles and GFLOP/s)."""
        if self.flops is not None:
            return self.flops(op)
        return _FAMILY_FLOPS.get(self.family, _no_flops)(op)

    def infer_types(self, op_name: str, inputs: Sequence, attrs: dict[str, str]) -> list[TensorType]:
        ctx = InferContext(op_name, self.type, inputs, attrs, self.attrs)
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


def _no_flops(op) -> int:
    return 0


def _elementwise_flops(op) -> int:
    """One operation per element of a floating-point result."""
    return sum(v.size for v in op.outputs) if all(dtypes.is_float(v.dtype) for v in op.outputs) else 0


_FAMILY_FLOPS: dict[str, Callable[[Any], int]] = {
    "elementwise": _elementwise_flops,
    "reduce": lambda op: op.inputs[0].size,
}

_REGISTRY: dict[str, OpDef] = {}
# Builder method name -> fn(builder, *args, **kwargs), the ops' own Python API.
_METHODS: dict[str, Callable] = {}


def define(
    type: str,
    infer: InferFn,
    reference: ReferenceFn,
    inputs: int | tuple[int, int | None],
    family: str,
    doc: str = "",
    *,
    attrs: Sequence[Attr] = (),
    vjp: VJPRule | None = None,
    flops: Callable[[Any], int] | None = None,
    written: Callable[[Any], list[int]] | None = None,
    view: bool = False,
    formula: Callable | None = None,
    method: str | Sequence[str] | None = None,
    build: Callable | None = None,
) -> OpDef:
    """Register an op type. Redefining a type is an error: one definition per op.

    vjp: the gradient rule, `rule(ctx, grads) -> input grads` (also `@vjp(type)`).
    flops: the FLOP count of one execution (default: by family).
    written: which inputs the op overwrites in place.
    view: the output holds the input's elements in the same order (a reshape).
    formula: elementwise ops: the result from IR values of the inputs, with the declared
        attributes as keywords; backends generate native code from it.
    method: Builder (and Tensor) method names that add this op. `build(b, ...)` gives
        the method its own signature; without it the method takes the inputs, then the
        declared attributes in order, then `name`.
    """
    if type in _REGISTRY:
        raise ValueError(f"op {type} is defined twice")
    lo, hi = (inputs, inputs) if isinstance(inputs, int) else inputs
    definition = OpDef(
        type, infer, reference, lo, hi, family, doc, {a.name: a for a in attrs}, vjp, [], flops, written, view, formula,
    )
    names = [method] if isinstance(method, str) else list(method or [])
    for name in names:
        if name in _METHODS:
            raise ValueError(f"builder method {name} is defined twice (for {type})")
    _REGISTRY[type] = definition
    for name in names:
        _METHODS[name] = _myelin_named(build) if build is not None else _standard_method(definition)
    return definition


def _standard_method(definition: OpDef) -> Callable:
    """b.method(*inputs, *attrs, name=None, **attrs) for an op of a fixed input count."""
    if definition.max_inputs != definition.min_inputs:
        raise ValueError(f"op {definition.type} takes a variable number of inputs; give its method a build function")
    count = definition.min_inputs
    order = list(definition.attrs)

    def method(b, *args, name=None, **attrs):
        args, name = _myelin_name(definition, count, args, name)
        if len(args) > count + len(order):
            raise RanvierError(f"{definition.type} takes {count} inputs and the attributes {order}; got {len(args)} arguments")
        attrs.update(zip(order, args[count:]))
        unknown = sorted(set(attrs) - set(order))
        if unknown:
            raise RanvierError(f"{definition.type} has no attribute {', '.join(unknown)}; it declares {', '.join(order) or 'none'}")
        return b.op(definition.type, list(args[:count]), name, attrs)

    method.__doc__ = definition.doc
    return method


def _myelin_name(definition: OpDef, count: int, args: tuple, name: str | None) -> tuple[tuple, str | None]:
    """Myelin's builder takes the op's name as the last positional argument
    (`f.matmul(x, W, "y")`, `f.softmax(x, "p")`); here that position holds an attribute.
    A trailing string that no string attribute could take is that name."""
    if name is not None or len(args) <= count or not isinstance(args[-1], str):
        return args, name
    attrs = list(definition.attrs.values())
    slot = len(args) - 1 - count
    if slot < len(attrs) and attrs[slot].kind in ("str", "dtype"):
        return args, name
    return args[:-1], args[-1]


def _myelin_named(build: Callable) -> Callable:
    """A build function that also takes Myelin's trailing positional name
    (`f.concat([a, b], "c")`): a string landing on a parameter other than `name` or
    `dtype` is the op's name."""
    parameters = list(inspect.signature(build).parameters)[1:]  # after the builder

    def method(b, *args, **kwargs):
        if args and isinstance(args[-1], str) and "name" not in kwargs:
            slot = parameters[len(args) - 1] if len(args) <= len(parameters) else "name"
            if slot not in ("name", "dtype"):
                args, kwargs = args[:-1], {**kwargs, "name": args[-1]}
        return build(b, *args, **kwargs)

    method.__doc__ = build.__doc__
    return method


def vjp(op_type: str) -> Callable[[VJPRule], VJPRule]:
    """Attach the gradient rule of an op type: `rule(ctx, grads_of_outputs) -> grads_of_inputs`."""

    def register(rule: VJPRule) -> VJPRule:
        op_def(op_type).vjp = rule
        return rule

    return register


def decomposition(op_type: str, prefer: Callable[[Any], bool] | None = None) -> Callable[[DecompositionRule], DecompositionRule]:
    """Attach a decomposition `rule(b, op)` to an op type (see `Decomposition`)."""

    def register(rule: DecompositionRule) -> DecompositionRule:
        op_def(op_type).decompositions.append(Decomposition(rule, prefer))
        return rule

    return register


def op_def(type: str) -> OpDef:
    try:
        return _REGISTRY[type]
    except KeyError:
        raise UnknownOpError(f"unknown op type {type!r}: ranvier has no definition for it") from None


def has_op(type: str) -> bool:
    return type in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def op_method(name: str) -> Callable | None:
    """The Builder method `name` some op definition provides, if any."""
    return _METHODS.get(name)


def attrs_of(op) -> Attrs:
    """An op's attributes, typed and defaulted by its definition."""
    return op_def(op.type).attrs_of(op)


def written_inputs(op) -> list:
    """The inputs an op overwrites in place (Assign's target, a fused update's targets)."""
    return [op.inputs[i] for i in op_def(op.type).written_inputs(op)]


def unchanging_constant(var) -> bool:
    """A constant (an inference model's weights) that no op writes: a key/value cache
    starts as data too, and is written as decoding goes."""
    return var.constant and all(all(v is not var for v in written_inputs(reader)) for reader in var.consumers)


def is_view(op) -> bool:
    """Whether the op's output is its first input's elements in the same order (a reshape)."""
    return op_def(op.type).view
