"""Myelin's Builder: one method per op, shapes inferred as ops are added.

Every method returns a `Tensor`, a handle on a flow variable that also knows its
builder, so models can be written with Python operators and methods
(`(x @ W + b).relu().sum(axis=1)`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .. import dtypes
from ..errors import RanvierError
from ..ops import op_def
from .graph import Flow, Function, Operation, Variable, VarFlags, attr_string

TensorLike = "Tensor | Variable | int | float | np.ndarray"


class Tensor:
    """A flow variable seen through a builder: supports operators and op methods."""

    __slots__ = ("var", "builder")

    # numpy defers to our reflected operators (`np_array + x` calls x.__radd__) instead of
    # broadcasting the handle as an object array.
    __array_ufunc__ = None

    def __init__(self, var: Variable, builder: "Builder"):
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
        """Handles are equal when they name the same variable (use .equal() for the Equal op)."""
        return isinstance(other, Tensor) and other.var is self.var

    def __getattr__(self, name: str):
        # x.relu(), x.sum(axis=1), x.reshape([2, 3]), ...: every op method of the builder.
        if name in Builder.OP_METHODS:
            method = getattr(self.builder, name)
            return lambda *args, **kwargs: method(self, *args, **kwargs)
        raise AttributeError(f"Tensor has no attribute {name!r}")

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


def _op_method(fn):
    fn.is_op_method = True
    return fn


class Builder:
    """Adds variables and ops to one function of a flow, Myelin style (`f/x`, `f/MatMul:0`)."""

    OP_METHODS: frozenset[str] = frozenset()

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

    def _wrap(self, var: Variable) -> Tensor:
        return Tensor(var, self)

    # ---- variables -----------------------------------------------------------------

    def var(self, name: str, dtype=dtypes.DT_FLOAT, shape: Iterable[int] = ()) -> Tensor:
        """A function input (IN) of a fixed dtype and shape."""
        full = self._prefixed(name)
        if full in self.flow.vars:
            raise RanvierError(f"variable {full} is already defined")
        var = self.flow.add_var(full, dtype, shape)
        var.flags |= VarFlags.IN
        return self._wrap(var)

    def array(self, name: str, value) -> Tensor:
        """A constant initialized from an array (or anything with the buffer protocol)."""
        array = np.asarray(value)
        var = self.flow.add_var(self.varname(name), dtypes.from_numpy(array.dtype), array.shape)
        var.set_data(array)
        return self._wrap(var)

    def parameter(self, name: str, value) -> Tensor:
        """A learnable variable: lives in the Network, is updated in place by training."""
        tensor = self.array(name, value)
        tensor.var.flags |= VarFlags.LEARNABLE
        return tensor

    def const(self, value, dtype: str | None = None, shape: Sequence[int] | None = None) -> Tensor:
        """A constant. Python ints become int32 and floats float32 unless a dtype is given."""
        if isinstance(value, (Tensor, Variable)):
            return self._wrap(variable_of(value))
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
            return self._wrap(self._scalar_consts[key])
        var = self.flow.add_var(self.varname("const"), dtype, array.shape)
        var.set_data(array)
        if key is not None:
            self._scalar_consts[key] = var
        return self._wrap(var)

    def _operand(self, x, like: Variable | None = None) -> Variable:
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

    # ---- the general op ----------------------------------------------------------------

    def op(self, optype: str, args: Sequence, name: str | None = None, attrs: dict | None = None):
        """Add an op; its outputs' types are inferred now. Returns a Tensor, or a tuple for several outputs."""
        definition = op_def(optype)
        anchor = next((variable_of(a) for a in args if isinstance(a, (Tensor, Variable))), None)
        inputs = [self._operand(a, anchor) for a in args]
        str_attrs = {k: attr_string(v) for k, v in (attrs or {}).items() if v is not None}
        opname = self.opname(name if name is not None else optype)
        types = definition.infer_types(opname, inputs, str_attrs)

        op: Operation = self.flow.add_op(opname, optype)
        op.attrs = str_attrs
        for v in inputs:
            op.add_input(v)
        for i, t in enumerate(types):
            out = self.flow.add_var(f"{opname}:{i}", t.dtype, t.shape)
            op.add_output(out)
        self.func.add(op)
        outputs = tuple(self._wrap(v) for v in op.outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    # ---- elementwise -------------------------------------------------------------------

    @_op_method
    def neg(self, x, name=None): return self.op("Neg", [x], name)
    @_op_method
    def abs(self, x, name=None): return self.op("Abs", [x], name)
    @_op_method
    def sign(self, x, name=None): return self.op("Sign", [x], name)
    @_op_method
    def exp(self, x, name=None): return self.op("Exp", [x], name)
    @_op_method
    def log(self, x, name=None): return self.op("Log", [x], name)
    @_op_method
    def sqrt(self, x, name=None): return self.op("Sqrt", [x], name)
    @_op_method
    def rsqrt(self, x, name=None): return self.op("Rsqrt", [x], name)
    @_op_method
    def rcp(self, x, name=None): return self.op("Reciprocal", [x], name)
    reciprocal = rcp
    @_op_method
    def square(self, x, name=None): return self.op("Square", [x], name)
    @_op_method
    def sin(self, x, name=None): return self.op("Sin", [x], name)
    @_op_method
    def cos(self, x, name=None): return self.op("Cos", [x], name)
    @_op_method
    def tanh(self, x, name=None): return self.op("Tanh", [x], name)
    @_op_method
    def sigmoid(self, x, name=None): return self.op("Sigmoid", [x], name)
    @_op_method
    def relu(self, x, name=None): return self.op("Relu", [x], name)
    @_op_method
    def silu(self, x, name=None): return self.op("Silu", [x], name)
    @_op_method
    def erf(self, x, name=None): return self.op("Erf", [x], name)
    @_op_method
    def floor(self, x, name=None): return self.op("Floor", [x], name)
    @_op_method
    def ceil(self, x, name=None): return self.op("Ceil", [x], name)
    @_op_method
    def round(self, x, name=None): return self.op("Round", [x], name)
    @_op_method
    def identity(self, x, name=None): return self.op("Identity", [x], name)
    @_op_method
    def logical_not(self, x, name=None): return self.op("Not", [x], name)

    @_op_method
    def gelu(self, x, approximate: str = "none", name=None):
        """GELU; approximate='tanh' for the tanh form, 'none' for the exact erf form."""
        return self.op("Gelu", [x], name, {"approximate": approximate if approximate != "none" else None})

    @_op_method
    def cast(self, x, dtype, name=None):
        return self.op("Cast", [x], name, {"dtype": dtypes.normalize(dtype)})

    @_op_method
    def add(self, x, y, name=None): return self.op("Add", [x, y], name)
    @_op_method
    def sub(self, x, y, name=None): return self.op("Sub", [x, y], name)
    @_op_method
    def mul(self, x, y, name=None): return self.op("Mul", [x, y], name)
    @_op_method
    def div(self, x, y, name=None): return self.op("Div", [x, y], name)
    @_op_method
    def pow(self, x, y, name=None): return self.op("Pow", [x, y], name)
    @_op_method
    def minimum(self, x, y, name=None): return self.op("Minimum", [x, y], name)
    @_op_method
    def maximum(self, x, y, name=None): return self.op("Maximum", [x, y], name)
    @_op_method
    def equal(self, x, y, name=None): return self.op("Equal", [x, y], name)
    @_op_method
    def not_equal(self, x, y, name=None): return self.op("NotEqual", [x, y], name)
    @_op_method
    def less(self, x, y, name=None): return self.op("Less", [x, y], name)
    @_op_method
    def less_equal(self, x, y, name=None): return self.op("LessEqual", [x, y], name)
    @_op_method
    def greater(self, x, y, name=None): return self.op("Greater", [x, y], name)
    @_op_method
    def greater_equal(self, x, y, name=None): return self.op("GreaterEqual", [x, y], name)
    @_op_method
    def logical_and(self, x, y, name=None): return self.op("And", [x, y], name)
    @_op_method
    def logical_or(self, x, y, name=None): return self.op("Or", [x, y], name)
    @_op_method
    def logical_xor(self, x, y, name=None): return self.op("Xor", [x, y], name)

    def cond(self, c, x, y, name=None):
        """c ? x : y (Myelin's Cond)."""
        anchor = next((variable_of(v) for v in (x, y) if isinstance(v, (Tensor, Variable))), None)
        return self.op("Cond", [c, self._operand(x, anchor), self._operand(y, anchor)], name)

    where = cond

    def select(self, c, x, name=None):
        """c ? x : 0 (Myelin's Select)."""
        # A Python number keeps its own dtype: the bool condition is no model for it.
        return self.op("Select", [c, self._operand(x)], name)

    # ---- reductions ---------------------------------------------------------------------

    def _reduce(self, optype, x, axis, keepdims, name):
        attrs = {"axis": axis if axis is None or isinstance(axis, (list, tuple)) else [axis]}
        if keepdims:
            attrs["keepdims"] = True
        return self.op(optype, [x], name, attrs)

    @_op_method
    def sum(self, x, axis=None, keepdims=False, name=None): return self._reduce("Sum", x, axis, keepdims, name)
    @_op_method
    def mean(self, x, axis=None, keepdims=False, name=None): return self._reduce("Mean", x, axis, keepdims, name)
    @_op_method
    def max(self, x, axis=None, keepdims=False, name=None): return self._reduce("Max", x, axis, keepdims, name)
    @_op_method
    def min(self, x, axis=None, keepdims=False, name=None): return self._reduce("Min", x, axis, keepdims, name)
    @_op_method
    def product(self, x, axis=None, keepdims=False, name=None): return self._reduce("Product", x, axis, keepdims, name)
    @_op_method
    def all(self, x, axis=None, keepdims=False, name=None): return self._reduce("All", x, axis, keepdims, name)
    @_op_method
    def any(self, x, axis=None, keepdims=False, name=None): return self._reduce("Any", x, axis, keepdims, name)

    @_op_method
    def argmax(self, x, axis=None, keepdims=False, name=None):
        return self.op("ArgMax", [x], name, {"axis": axis, "keepdims": keepdims or None})

    @_op_method
    def argmin(self, x, axis=None, keepdims=False, name=None):
        return self.op("ArgMin", [x], name, {"axis": axis, "keepdims": keepdims or None})

    # ---- matmul and shapes ------------------------------------------------------------------

    @_op_method
    def matmul(self, x, y, transpose_a=False, transpose_b=False, name=None):
        return self.op("MatMul", [x, y], name, {"transpose_a": transpose_a or None, "transpose_b": transpose_b or None})

    @_op_method
    def reshape(self, x, shape, name=None):
        return self.op("Reshape", [x, self.const(np.asarray(list(shape), np.int32))], name)

    @_op_method
    def transpose(self, x, perm=None, name=None):
        return self.op("Transpose", [x], name, {"perm": list(perm) if perm is not None else None})

    t = transpose

    def concat(self, parts, axis=0, name=None):
        return self.op("Concat", [*parts, self.const(int(axis))], name, {"N": len(parts)})

    @_op_method
    def split(self, x, splits, axis=0, name=None):
        """Split into `splits` equal parts, or into parts of the listed sizes."""
        outputs = self.op("Split", [x, self.const(np.asarray(splits, np.int32)), self.const(int(axis))], name)
        return outputs if isinstance(outputs, tuple) else (outputs,)

    @_op_method
    def slice(self, x, begin, size, name=None):
        return self.op("Slice", [x], name, {"begin": list(begin), "size": list(size)})

    @_op_method
    def broadcast_to(self, x, shape, name=None):
        return self.op("BroadcastTo", [x], name, {"shape": list(shape)})

    @_op_method
    def expand_dims(self, x, axis, name=None):
        return self.op("ExpandDims", [x], name, {"axis": axis})

    @_op_method
    def squeeze(self, x, axis=None, name=None):
        return self.op("Squeeze", [x], name, {"axis": None if axis is None else (list(axis) if isinstance(axis, (list, tuple)) else [axis])})

    # ---- indexing ----------------------------------------------------------------------------

    @_op_method
    def gather(self, params, indices, name=None):
        # Python-number indices are int32, not converted to the params' dtype.
        return self.op("Gather", [params, self._operand(indices)], name)

    def scatter_add(self, indices, updates, rows: int, name=None):
        return self.op("ScatterAdd", [self._operand(indices), self._operand(updates)], name, {"rows": rows})

    @_op_method
    def one_hot(self, indices, depth: int, dtype=dtypes.DT_FLOAT32, name=None):
        return self.op("OneHot", [indices], name, {"depth": depth, "dtype": dtypes.normalize(dtype)})

    # ---- neural-network composites -------------------------------------------------------------

    @_op_method
    def softmax(self, x, axis=-1, name=None):
        return self.op("Softmax", [x], name, {"axis": axis if axis != -1 else None})

    @_op_method
    def log_softmax(self, x, axis=-1, name=None):
        return self.op("LogSoftmax", [x], name, {"axis": axis if axis != -1 else None})

    @_op_method
    def layer_norm(self, x, gamma=None, beta=None, eps=1e-5, name=None):
        args = [x] + ([gamma] if gamma is not None else []) + ([beta] if beta is not None else [])
        if beta is not None and gamma is None:
            raise RanvierError("layer_norm: a shift (beta) needs a scale (gamma)")
        return self.op("LayerNorm", args, name, {"eps": eps if eps != 1e-5 else None})

    @_op_method
    def rms_norm(self, x, gamma=None, eps=1e-5, name=None):
        args = [x] + ([gamma] if gamma is not None else [])
        return self.op("RMSNorm", args, name, {"eps": eps if eps != 1e-5 else None})

    @_op_method
    def softmax_cross_entropy(self, logits, target, label_smoothing=0.0, name=None):
        """Per-example cross-entropy of logits against integer classes or probability targets."""
        return self.op("SoftmaxCrossEntropy", [logits, target], name, {"label_smoothing": label_smoothing or None})

    @_op_method
    def conv2d(self, x, w, strides=(1, 1), padding=(0, 0), name=None):
        return self.op("Conv2D", [x, w], name, {"strides": _pair(strides), "padding": _pair(padding)})

    @_op_method
    def max_pool(self, x, ksize=(2, 2), strides=None, padding=(0, 0), name=None):
        return self.op("MaxPool", [x], name, _pool_attrs(ksize, strides, padding))

    @_op_method
    def avg_pool(self, x, ksize=(2, 2), strides=None, padding=(0, 0), name=None):
        return self.op("AvgPool", [x], name, _pool_attrs(ksize, strides, padding))


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


def _pair(value) -> list[int]:
    return [int(value)] * 2 if isinstance(value, (int, np.integer)) else [int(v) for v in value]


def _pool_attrs(ksize, strides, padding) -> dict:
    return {"ksize": _pair(ksize), "strides": None if strides is None else _pair(strides), "padding": _pair(padding)}


Builder.OP_METHODS = frozenset(
    name for name, member in vars(Builder).items() if getattr(member, "is_op_method", False)
) | {"reciprocal", "t"}
