"""Per-step profiles, as Myelin prints them: for each step its kernel, time, share of the
cell's time and achieved GFLOP/s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .flow.graph import Operation
from .ops import Attrs
from .ops.expression import parse


def flops(op: Operation) -> int:
    """Floating-point operations one execution of `op` performs (an estimate for profiles)."""
    outputs = sum(v.size for v in op.outputs)
    if op.type == "MatMul":
        a, b = op.inputs
        k = a.shape[-2] if Attrs(op.attrs).bool("transpose_a") else a.shape[-1]
        return 2 * op.outputs[0].size * k
    if op.type in ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"):
        # Each does one multiply-add per (output position, filter tap) of the forward conv.
        positions = {"Conv2D": op.outputs[0], "Conv2DBackpropInput": op.inputs[0], "Conv2DBackpropFilter": op.inputs[1]}[op.type]
        filters = op.outputs[0] if op.type == "Conv2DBackpropFilter" else op.inputs[1]
        return 2 * positions.size * math.prod(filters.shape[1:])
    if op.type == "Calculate":
        statements = parse(op.attrs["expr"]).statements
        size = max([v.size for v in op.outputs] + [v.size for v in op.inputs])
        return size * sum(1 for _, call in statements if call.op_type != "Identity")
    if op.type in ("Softmax", "LogSoftmax", "LayerNorm", "RMSNorm", "SoftmaxCrossEntropy"):
        return 5 * op.inputs[0].size
    if op.type in ("Sum", "Mean", "Max", "Min", "Product", "ArgMax", "ArgMin"):
        return op.inputs[0].size
    if op.inputs and op.outputs and all(v.dtype.startswith(("float", "bfloat")) for v in op.outputs):
        return outputs if op.type not in ("Reshape", "Identity", "Transpose", "Concat", "Split", "Slice", "BroadcastTo", "ExpandDims", "Squeeze", "Gather", "Assign") else 0
    return 0


@dataclass
class StepTime:
    index: int
    kernel: str
    seconds: float
    flops: int
    op: Operation


class Profile:
    """Average time per compute of each step of a cell, over the computes since the last reset."""

    def __init__(self, cell_name: str, computes: int, steps: list[StepTime]):
        self.cell_name = cell_name
        self.computes = computes
        self.steps = steps

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.steps)

    def __str__(self) -> str:
        total = self.total or 1e-30
        lines = [
            f"profile of cell {self.cell_name}: {self.computes} computes, {self.total * 1e3:.3f} ms per compute",
            f"  {'step':>4}  {'kernel':<24} {'time us':>9} {'share':>6} {'GFLOP/s':>8}  op",
        ]
        for s in sorted(self.steps, key=lambda s: -s.seconds):
            rate = f"{s.flops / s.seconds / 1e9:8.1f}" if s.flops and s.seconds > 0 else f"{'':>8}"
            outs = ", ".join(v.name for v in s.op.outputs) or s.op.inputs[0].name
            lines.append(f"  {s.index:>4}  {s.kernel:<24} {s.seconds * 1e6:9.2f} {s.seconds / total * 100:5.1f}% {rate}  {outs} = {s.op.type}")
        return "\n".join(lines)
