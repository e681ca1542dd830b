"""Calculate: a fused elementwise op whose body is a Calculate expression program.

The compiler's fusion pass creates it from chains of elementwise ops; its shape rule
and numpy reference evaluate the program statement by statement through the
registered op definitions, so a fused op means exactly what its parts meant.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .expression import Call, Ref, parse
from .registry import Attr, Attrs, TensorType, define, op_def


class _Spec:
    """The name/dtype/shape view of a value that shape rules read."""

    def __init__(self, name: str, dtype: str, shape):
        self.name, self.dtype, self.shape = name, dtype, list(shape)
        self.data = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def program_types(program, inputs, op_name: str) -> dict[str, _Spec]:
    """Types of every temporary, output and call, inferred through the sub-ops' rules."""
    values = {f"%{i}": _Spec(getattr(v, "name", f"%{i}"), v.dtype, v.shape) for i, v in enumerate(inputs)}

    def evaluate(node):
        if isinstance(node, Ref):
            return values[str(node)]
        args = [evaluate(a) for a in node.args]
        (t,) = op_def(node.op_type).infer_types(f"{op_name}:{node.op_type}", args, dict(node.attrs))
        spec = values[str(node)] = _Spec(str(node), t.dtype, t.shape)
        return spec

    for target, call in program.statements:
        values[str(target)] = evaluate(call)
    return values


def _infer(ctx):
    program = parse(ctx.attrs["expr"])
    values = program_types(program, ctx.inputs, ctx.op_name)
    for target, _ in program.statements:
        if target.kind == "%":
            written, into = values[str(target)], ctx.inputs[target.index]
            if written.dtype != into.dtype or list(written.shape) != list(into.shape):
                raise ctx.fail(f"a value of {into.name}'s type to write into it in place (got {written.dtype}{written.shape})")
    outputs = sorted((int(k[1:]), v) for k, v in values.items() if k.startswith("@"))
    return [TensorType(v.dtype, v.shape) for _, v in outputs]


def written_inputs(op) -> list[int]:
    """A statement assigning %i writes input i in place (a fused parameter update)."""
    return [target.index for target, _ in parse(op.attrs.get("expr", "")).statements if target.kind == "%"]


def _reference(attrs, args, outs):
    program = parse(attrs["expr"])
    values = {f"%{i}": a for i, a in enumerate(args)}

    def evaluate(node):
        if isinstance(node, Ref):
            return values[str(node)]
        sub_args = [evaluate(a) for a in node.args]
        definition = op_def(node.op_type)
        sub_attrs = Attrs(dict(node.attrs), "Calculate", node.op_type, definition.attrs)
        dtype = _dtype_of(node, sub_args)
        (result,) = definition.reference(sub_attrs, sub_args, [TensorType(dtype, np.broadcast_shapes(*[np.shape(a) for a in sub_args]))])
        return np.asarray(result)

    writes = []
    for target, call in program.statements:
        result = evaluate(call)
        if target.kind == "%":
            writes.append(result)
        else:
            values[str(target)] = result
    return [values[f"@{j}"] for j in range(len(outs))] + writes


def _dtype_of(call: Call, args) -> str:
    if call.op_type == "Cast":
        return dict(call.attrs)["dtype"]
    return dtypes.from_numpy(np.asarray(args[0]).dtype) if args else dtypes.DT_FLOAT32


def _flops(op) -> int:
    """One operation per element for each statement that computes (not a copy)."""
    statements = parse(op.attrs["expr"]).statements
    size = max([v.size for v in op.outputs] + [v.size for v in op.inputs])
    return size * sum(1 for _, call in statements if call.op_type != "Identity")


define(
    "Calculate", _infer, _reference, (1, None), "fused", "fused elementwise program",
    attrs=[Attr("expr", "str", "", "the program, e.g. $0=Mul(%0,%1);@0=Add($0,%2)")],
    written=written_inputs,
    flops=_flops,
)
