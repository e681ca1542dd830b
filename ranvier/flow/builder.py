"""Myelin's Builder: variables, constants and ops added to one function, shapes inferred
as ops are added.

Every op method returns a `Tensor`, a handle on a flow variable that also knows its
builder, so models can be written with Python operators and methods
(`(x @ W + b).relu().sum(axis=1)`). The op methods themselves are declared with the
ops (`ranvier.ops`); the Builder looks them up by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .. import dtypes
from ..errors import RanvierError
from ..ops import TensorType, has_op, op_def, op_method
from .elements import Connector, Function, Operation, Variable, attr_string
from .flags import VarFlags

if TYPE_CHECKING:  # the graph imports this module for Flow.define
    from .graph import Flow


class Tensor:
    """A flow variable seen through a builder: supports operators and op methods."""

    __slots__ = ("builder", "var")

    # numpy defers to our reflected operators (`np_array + x` calls x.__radd__) instead of
    # broadcasting the handle as an object array.
    __array_ufunc__ = None

    def __init__(self, var: Variable, builder: Builder):
        self.var = var
        self.builder = builder

    name = property(lambda self: self.var.name)
    shape = property(lambda self: list(self.var.shape))
    dtype = property(lambda self: self.var.dtype)
    rank = property(lambda self: self.var.rank)
    size = property(lambda self: self.var.size)
    producer = property(lambda self: self.var.producer)
    T = property(lambda self: self.builder.transpose(self))

    def __repr__(self) -> str:
        return f"<Tensor {self.var.name}: {self.var.typestr()}>"

    def __hash__(self) -> int:
        return hash(self.var)

    def __eq__(self, other) -> bool:
        """Equal to a handle on the same variable and to the variable itself, whose hash is
        the handle's: a dict keyed by either finds the other (use .equal() for the Equal op)."""
        return variable_of(other) is self.var

    def __getattr__(self, name: str):
        # x.relu(), x.sum(axis=1), x.reshape([2, 3]), ...: every op method, with x first;
        # then the variable's own members (x.data, x.ref, x.consumers), as Myelin's
        # builder returns the variable itself.
        method = op_method(name)
        if method is not None:
            return lambda *args, **kwargs: method(self.builder, self, *args, **kwargs)
        if not name.startswith("_") and hasattr(self.var, name):
            return getattr(self.var, name)
        raise AttributeError(f"Tensor has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        # Myelin programs set what the builder returns: v.type, v.shape, v.ref, v.output, v.data.
        if name in Tensor.__slots__:
            object.__setattr__(self, name, value)
        elif name == "shape":
            self.var.shape = [int(d) for d in value]
        elif not name.startswith("_") and hasattr(self.var, name):
            setattr(self.var, name, value)
        else:
            raise AttributeError(f"Tensor has no attribute {name!r} to set")

    def __add__(self, o): return self.builder.add(self, o)
    def __radd__(self, o): return self.builder.add(o, self)
    def __sub__(self, o): return self.builder.sub(self, o)
    def __rsub__(self, o): return self.builder.sub(o, self)
    def __mul__(self, o): return self.builder.mul(self, o)
    def __rmul__(self, o): return self.builder.mul(o, self)
    def __truediv__(self, o): return self.builder.div(self, o)
    def __rtruediv__(self, o): return self.builder.div(o, self)
    def __matmul__(self, o): return self.builder.matmul(self, o)
    def __rmatmul__(self, o): return self.builder.matmul(o, self)
    def __pow__(self, o): return self.builder.pow(self, o)
    def __rpow__(self, o): return self.builder.pow(o, self)
    def __neg__(self): return self.builder.neg(self)
    def __abs__(self): return self.builder.abs(self)
    def __lt__(self, o): return self.builder.less(self, o)
    def __le__(self, o): return self.builder.less_equal(self, o)
    def __gt__(self, o): return self.builder.greater(self, o)
    def __ge__(self, o): return self.builder.greater_equal(self, o)
    def __and__(self, o): return self.builder.logical_and(self, o)
    def __or__(self, o): return self.builder.logical_or(self, o)
    def __xor__(self, o): return self.builder.logical_xor(self, o)
    def __invert__(self): return self.builder.logical_not(self)


def variable_of(x) -> Variable:
    """The flow variable behind a handle (Tensor) or the variable itself."""
    return x.var if isinstance(x, Tensor) else x


class Builder:
    """Adds variables and ops to one function of a flow, Myelin style (`f/x`, `f/MatMul:0`).

    The op methods (`b.add(x, y)`, `b.softmax(x, axis=1)`) come from the op
    definitions (`ranvier.ops`), so a newly defined op has its method at once.
    """

    def __init__(self, flow: Flow, func: str | Function):
        self.flow = flow
        self.func = flow.func(func)
        self._scalar_consts: dict[tuple, Variable] = {}

    # ---- naming ------------------------------------------------------------------

    def _prefixed(self, name: str) -> str:
        return f"{self.func.name}/{name}"

    def opname(self, optype: str) -> str:
        return self.flow.unique_name(self._prefixed(optype), self.flow.ops, output_taken=True)

    def varname(self, name: str) -> str:
        return self.flow.unique_name(self._prefixed(name), self.flow.vars)

    def wrap(self, var: Variable) -> Tensor:
        """A Tensor handle on `var` that adds its ops through this builder."""
        return Tensor(var, self)

    # ---- variables -----------------------------------------------------------------

    def var(self, name: str, dtype=dtypes.DT_FLOAT, shape: Iterable[int] = ()) -> Tensor:
        """A function input (IN) of a fixed dtype and shape."""
        full = self._prefixed(name)
        if full in self.flow.vars:
            raise RanvierError(f"variable {full} is already defined")
        var = self.flow.add_var(full, dtype, shape)
        var.flags |= VarFlags.IN
        return self.wrap(var)

    def array(self, name: str, value) -> Tensor:
        """A constant initialized from an array (or anything with the buffer protocol).
        A nested Python list becomes float32, or int32 when it holds only integers, as in Myelin."""
        array = np.asarray(value, dtype=_list_dtype(value) if isinstance(value, list) else None)
        var = self.flow.add_var(self.varname(name), dtypes.from_numpy(array.dtype), array.shape)
        var.set_data(array)
        return self.wrap(var)

    def parameter(self, name: str, value) -> Tensor:
        """A learnable variable: lives in the Network, is updated in place by training."""
        tensor = self.array(name, value)
        tensor.var.flags |= VarFlags.LEARNABLE
        return tensor

    def const(self, value, dtype: str | None = None, shape: Sequence[int] | None = None) -> Tensor:
        """A constant. Python ints become int32 and floats float32 unless a dtype is given."""
        if isinstance(value, (Tensor, Variable)):
            return self.wrap(variable_of(value))
        if dtype is None:
            if isinstance(value, bool):
                dtype = dtypes.DT_BOOL
            elif isinstance(value, int):
                dtype = dtypes.DT_INT32
            elif isinstance(value, float):
                dtype = dtypes.DT_FLOAT32
            else:
                dtype = dtypes.from_numpy(np.asarray(value).dtype)
        dtype = dtypes.normalize(dtype)
        array = np.asarray(value, dtype=dtypes.to_numpy(dtype))
        if shape is not None:
            array = array.reshape(shape)
        key = (dtype, array.shape, array.tobytes()) if array.size <= 16 else None
        if key is not None and key in self._scalar_consts:
            return self.wrap(self._scalar_consts[key])
        var = self.flow.add_var(self.varname("const"), dtype, array.shape)
        var.set_data(array)
        if key is not None:
            self._scalar_consts[key] = var
        return self.wrap(var)

    def operand(self, x, like: Variable | None = None) -> Variable:
        """A variable for an op input; Python numbers take the dtype of the other operand.

        A number the other operand's dtype cannot hold exactly (0.5 for an int32 tensor,
        300 or -1 for a uint8 one) keeps its own dtype, so the op reports the mismatch
        instead of silently computing with a truncated or wrapped constant.
        """
        if isinstance(x, (Tensor, Variable)):
            return variable_of(x)
        if like is not None and isinstance(x, (int, float, bool)) and _fits(x, like.dtype):
            return self.const(x, like.dtype).var
        return self.const(x).var

    def operands(self, args: Sequence) -> list[Variable]:
        """Variables for op inputs; Python numbers take the dtype of the first handle among them."""
        anchor = next((variable_of(a) for a in args if isinstance(a, (Tensor, Variable))), None)
        return [self.operand(a, anchor) for a in args]

    # ---- the general op ----------------------------------------------------------------

    def op(self, optype: str, args: Sequence, name: str | None = None, attrs: dict | None = None):
        """Add an op; its outputs' types are inferred now. Returns a Tensor, or a tuple for several outputs.

        Attributes that are None, or equal to the op's declared default, are left out. An op
        type ranvier does not define is added as Myelin's builder adds any op: one output
        of its first input's dtype and its highest-rank input's shape (the program may
        declare another); compiling it is what fails."""
        definition = op_def(optype) if has_op(optype) else None
        inputs = self.operands(args)
        str_attrs = {k: attr_string(v) for k, v in (attrs or {}).items()
                     if v is not None and not (definition and _is_default(definition, k, v))}
        opname = self.opname(name if name is not None else optype)
        types = definition.infer_types(opname, inputs, str_attrs) if definition else [_undefined_op_output(inputs)]

        op: Operation = self.flow.add_op(opname, optype)
        op.attrs = str_attrs
        for v in inputs:
            op.add_input(v)
        for i, t in enumerate(types):
            out = self.flow.add_var(f"{opname}:{i}", t.dtype, t.shape)
            op.add_output(out)
        self.func.add(op)
        outputs = tuple(self.wrap(v) for v in op.outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    # ---- Myelin's structural helpers ------------------------------------------------------

    def rename(self, var, new_suffix: str) -> Tensor:
        """Rename a variable to `<function>/<new_suffix>`."""
        var = variable_of(var)
        self.flow.rename_var(var, self._prefixed(new_suffix))
        return self.wrap(var)

    def cnx(self, name: str, args: Sequence) -> Connector:
        """A connector `<function>/<name>` linking variables that share storage across cells."""
        connector = self.flow.cnx(self._prefixed(name))
        for var in args:
            connector.add(variable_of(var))
        return connector

    def rawop(self, optype: str, name: str | None = None) -> Operation:
        """An op with no inputs or outputs yet; the caller adds them (`op.add_input(v)`)."""
        op = self.flow.add_op(self.opname(name or optype), optype)
        self.func.add(op)
        return op

    def reduce(self, optype: str, x, axis: int | None = None, keepdims: bool | None = None, name: str | None = None) -> Tensor:
        """A reduction op of any type over one axis, or over every element."""
        return self.op(optype, [x], name, {"axis": axis, "keepdims": keepdims})

    def pooling_gather(self, optype: str, embedding, indices, name: str | None = None) -> Tensor:
        """GatherSum, GatherMax or GatherAvg: the rows of `embedding` that `indices` picks, pooled."""
        return self.op(optype, [embedding, indices], name)

    def norm(self, x, name: str | None = None) -> Tensor:
        """The L2 norm of all the elements of x."""
        return self.sqrt(self.sum(self.square(x)), name=name)

    def normalize(self, x, name: str | None = None) -> Tensor:
        """x divided by its L2 norm."""
        return self.mul(x, self.rcp(self.norm(x)), name=name)

    def instance(self, func: str | Function) -> Tensor:
        """A variable standing for an instance of another function, for `ref` to read through."""
        var = self.flow.add_var(self.varname(self.flow.func(func).name), dtypes.DT_RESOURCE, [])
        var.ref = True
        return self.wrap(var)

    def ref(self, instance, var, name: str | None = None) -> Tensor:
        """Myelin's Reference: `var` as the instance bound to `instance` holds it; bind it
        with `data[instance] = other_instance` before computing."""
        target = variable_of(var)
        op = self.rawop("Reference", name)
        op.add_input(variable_of(instance))
        op.set_attr("var", target.name)
        result = self.flow.add_var(f"{op.name}:0", target.dtype, target.shape)
        result.ref = True
        op.add_output(result)
        return self.wrap(result)

    def __getattr__(self, name: str):
        # b.relu(x), b.matmul(x, w, transpose_b=True), ...: the methods op definitions provide.
        method = op_method(name)
        if method is None:
            raise AttributeError(f"Builder has no attribute {name!r} (and no op defines a method of that name)")
        return lambda *args, **kwargs: method(self, *args, **kwargs)



def _undefined_op_output(inputs: list[Variable]) -> TensorType:
    dtype = inputs[0].dtype if inputs else dtypes.DT_FLOAT32
    return TensorType(dtype, tuple(max((v.shape for v in inputs), key=len, default=[])))


def _is_default(definition, name: str, value) -> bool:
    """Whether an attribute value is what the op assumes when the attribute is absent."""
    declared = definition.attrs.get(name)
    if declared is None or declared.default is None:
        return False
    return declared.parse(attr_string(value), name, definition.type) == declared.default


def _list_dtype(values: list) -> str:
    """float32 for a nested list with any float in it, int32 for one of integers only."""
    flat = np.asarray(values).ravel()
    return dtypes.DT_INT32 if flat.size and all(isinstance(v, (int, np.integer)) for v in flat.tolist()) else dtypes.DT_FLOAT32


def _fits(value, dtype: str) -> bool:
    """Whether a Python number converts to `dtype` without changing its value."""
    if dtypes.is_float(dtype):
        return True
    if isinstance(value, float) and not value.is_integer():
        return False
    if dtype == dtypes.DT_BOOL:
        return value in (0, 1)
    info = np.iinfo(dtypes.to_numpy(dtype))
    return int(info.min) <= value <= int(info.max)
