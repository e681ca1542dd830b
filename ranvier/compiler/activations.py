"""Activation precision: a function's float32 activations and their gradients stored in
bfloat16 or float16 (`Compiler(precision=...)`), its parameters, optimizer state, losses and
the values other cells read in float32: half the bytes for every memory-bound kernel and
half-precision inputs for every matrix product. Kernels still compute in float32 (a
half-precision value is widened when loaded and rounded when stored), so what changes is
where values are rounded.

The pass walks the ops in dependency order and picks each one's float dtype, then casts
the inputs that differ (`Cast` ops, which fusion later folds into the neighbouring
elementwise programs, where they cost nothing), unless the op computes that dtype from its
inputs as they are (a row kernel that widens what it reads):
- matrix products (`PRODUCTS`: a MoE layer's grouped ones too) run on half-precision
  inputs (a weight is rounded once per step);
- ops kept in float32 (`FLOAT32_OPS`: a gradient scattered into a table with atomic adds),
  ops that write a value other cells or the caller read (a loss), a global (an
  optimizer's update), one that cannot be typed in half precision or that the backend
  cannot run whole so typed (an attention gradient whose decomposition would round its
  probabilities), get float32 inputs;
- any other op takes the dtype of its largest float input (its activation, rather than a
  norm's gain or a loss's scale), float32 on a tie (a residual stream, float32 from the
  embedding on, stays float32 where a half-precision branch is added to it).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import dtypes
from ..errors import RanvierError
from ..flow.builder import Builder
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import TensorType, op_def

FLOAT32_OPS = {"ScatterAdd", "StridedScatterAdd", "Assign", "AssignSlice"}
PRODUCTS = {"MatMul", "GroupedMatMul", "GroupedMatMulWeightGrad"}
RESHAPES = {"Reshape", "ExpandDims", "Squeeze"}  # views of a value's elements in order
_FLOATS = (dtypes.DT_FLOAT32, dtypes.DT_BFLOAT16, dtypes.DT_FLOAT16)
# Values an op reads or writes in a dtype of their own, whatever the activations': attention's
# softmax statistics (each row's log-sum-exp L), float32, so exp(score − L) is not thrown off
# by L's rounding (a bfloat16 L of 10 errs by up to 0.03: 3% of every probability).
_OWN_DTYPE_INPUTS = {"AttentionGrad": {4}}
_OWN_DTYPE_OUTPUTS = {"Attention": {1}}


def use_activation_precision(flow: Flow, func: Function, keep: set[str], dtype: str = dtypes.DT_BFLOAT16,
                             runs_whole: Callable[[Operation], bool] = lambda op: True) -> None:
    """Store `func`'s float32 activations in `dtype` (module docstring); an op the backend
    cannot run whole in half precision (`runs_whole`) stays float32."""
    b = Builder(flow, func)
    casts: dict[tuple[str, str], Variable] = {}
    ops = flow.op_order(func)
    statistics = _computing_statistics(ops)
    for op in ops:
        own = _OWN_DTYPE_INPUTS.get(op.type, set())
        floats = [i for i, v in enumerate(op.inputs) if v.dtype in _FLOATS and i not in own]
        if not floats or op.type == "Cast":
            continue
        if op.type in PRODUCTS and _pinned(op, keep):
            _widened_after(flow, b, op)
        wanted = dtypes.DT_FLOAT32 if op in statistics else _wanted(op, floats, keep, dtype)
        before = list(op.inputs)
        types = _types(op, runs_whole)
        if not _computes(op, types, wanted):  # unless it computes `wanted` from its inputs as they are
            _cast_inputs(b, op, floats, wanted, casts)
            types = _types(op, runs_whole)
        if types is None:  # the op takes no half-precision input, or has no kernel for one: float32
            for i, var in enumerate(before):
                op.replace_input(op.inputs[i], var)
            _cast_inputs(b, op, floats, dtypes.DT_FLOAT32, casts)
            types = op_def(op.type).infer_types(op.name, op.inputs, op.attrs)
        for var, t in zip(op.outputs, types):
            var.dtype = t.dtype
    for var in reversed(list(casts.values())):  # a cast an op took back (a reshape of one first)
        if not var.consumers and var.producer is not None:
            flow.remove_op(var.producer)
            flow.remove_var(var)
    _drop_unread_reshapes(flow, func, keep)


def _drop_unread_reshapes(flow: Flow, func: Function, keep: set[str]) -> None:
    """Reshapes whose readers now read a reshape of a cast instead: nothing reads them."""
    while unread := [op for op in func.ops if op.type in RESHAPES
                     and not any(v.consumers or v.name in keep or v.out for v in op.outputs)]:
        for op in unread:
            outputs = list(op.outputs)
            flow.remove_op(op)
            for v in outputs:
                flow.remove_var(v)


def _types(op: Operation, runs_whole: Callable[[Operation], bool]) -> list[TensorType] | None:
    """The op's output types on its current inputs, or None where it cannot take them
    (its definition refuses them, or the backend has no kernel for it so typed)."""
    try:
        types = op_def(op.type).infer_types(op.name, op.inputs, op.attrs)
    except RanvierError:
        return None
    outputs = [var.dtype for var in op.outputs]
    for var, t in zip(op.outputs, types):
        var.dtype = t.dtype
    runs = runs_whole(op)
    for var, dtype in zip(op.outputs, outputs):
        var.dtype = dtype
    return types if runs else None


def _computes(op: Operation, types: list[TensorType] | None, wanted: str) -> bool:
    """Whether an op typed so (`_types`) computes `wanted` from its inputs as they are,
    mixed dtypes and all (a norm's gradient reading a half-precision gradient beside a
    float32 residual stream): casting them first would cost a pass of its own."""
    own = _OWN_DTYPE_OUTPUTS.get(op.type, set())
    return types is not None and all(t.dtype == wanted for i, t in enumerate(types) if t.dtype in _FLOATS and i not in own)


def _computing_statistics(ops: list[Operation]) -> set[Operation]:
    """The ops whose every result feeds only a value read in its own dtype, or another such
    op: a decomposed attention's statistics, computed in float32 as they are kept."""
    computing: set[Operation] = set()
    for op in reversed(ops):
        readers = [(reader, i) for var in op.outputs for reader in var.consumers for i, x in enumerate(reader.inputs) if x is var]
        if readers and not any(var.out for var in op.outputs) and all(
                reader in computing or i in _OWN_DTYPE_INPUTS.get(reader.type, set()) for reader, i in readers):
            computing.add(op)
    return computing


def _pinned(op: Operation, keep: set[str]) -> bool:
    """Whether the op writes a value that keeps its dtype: one the caller or other cells
    read, or a global."""
    return any(v.name in keep or v.is_global for v in op.outputs)


def _widened_after(flow: Flow, b: Builder, op: Operation) -> None:
    """A product whose output keeps float32 (a weight's gradient the trainer reads) writes
    a value of its own, which a Cast then widens into the original: the product still
    takes half-precision inputs (its output rounded once, as autocast's are)."""
    original = op.outputs[0]
    cast = b.op("Cast", [original], None, {"dtype": original.dtype}).var.producer
    own = cast.outputs[0]
    op.outputs[0], own.producer = own, op
    cast.outputs[0], original.producer = original, cast
    cast.replace_input(original, own)


def _wanted(op: Operation, floats: list[int], keep: set[str], dtype: str) -> str:
    if op.type in PRODUCTS:
        return dtype
    if op.type in FLOAT32_OPS or _pinned(op, keep):
        return dtypes.DT_FLOAT32
    largest = max(op.inputs[i].size for i in floats)
    return dtype if {op.inputs[i].dtype for i in floats if op.inputs[i].size == largest} == {dtype} else dtypes.DT_FLOAT32


def _cast_inputs(b: Builder, op: Operation, floats: list[int], wanted: str, casts: dict[tuple[str, str], Variable]) -> None:
    """Each float input of `op` not of dtype `wanted` replaced by its cast (one per value)."""
    for i in floats:
        var = op.inputs[i]
        if var.dtype != wanted:
            op.replace_input(var, _cast(b, var, wanted, casts))


def _cast(b: Builder, var: Variable, wanted: str, casts: dict[tuple[str, str], Variable]) -> Variable:
    """`var` in dtype `wanted`, cast once per value; a reshape of a value, the same reshape
    of the value's cast (a norm's output, cast for its product, is read reshaped by the
    weight's gradient: one cast serves both)."""
    key = (var.name, wanted)
    if key not in casts:
        producer = var.producer
        if producer is not None and producer.func is b.func and producer.type in RESHAPES:
            casts[key] = b.wrap(_cast(b, producer.inputs[0], wanted, casts)).reshape(list(var.shape)).var
        else:
            casts[key] = b.op("Cast", [var], None, {"dtype": wanted}).var
    return casts[key]
