"""Attention in the layout its operands come in: [B, T, heads, hd] (`heads_first` false) where
q, k and v are views of a product's rows and its result goes back into rows.

An exported attention layer splits each operand's features into heads and moves the heads
before the positions ([B, heads, T, hd]: a Transpose each), then moves them back after the
Attention op and merges them into features again. The Attention kernels read and write
[B, T, heads, hd] as well, a head's rows heads · hd apart, so in that layout the split's
Transposes become the start of the chain of views that takes each operand out of its product
(one copy that reads whole rows of it, where in [B, heads, T, hd] it read a head's hd
elements at a time), and the merge after it reads the result in order: a reshape, no copy.

Only where every operand comes from a reshape or Transpose and only such ops read the result
(fold-views then folds the Transposes this adds), and not in a training step, whose gradient
reads the operands in the layout it was built for.
"""

from __future__ import annotations

from ..flow.builder import Builder
from ..flow.graph import Flow, Function, Operation
from ..ops import attrs_of, is_view
from .rewrite import splice

_SWAP = [0, 2, 1, 3]  # [B, heads, T, hd] ↔ [B, T, heads, hd]


def use_rows_layout(flow: Flow, func: Function, keep: set[str]) -> None:
    """Each Attention op of `func` in [B, heads, T, hd] whose operands and result are views
    becomes one in [B, T, heads, hd] between Transposes (see the module)."""
    if func.training:
        return
    for op in [op for op in func.ops if op.type == "Attention"]:
        q, k, v = op.inputs[:3]
        if not attrs_of(op)["heads_first"] or any(x.rank != 4 or not _viewed(x.producer) for x in (q, k, v)):
            continue
        out = op.outputs[0]
        if out.name in keep or out.out or not out.consumers or not all(_viewed(reader) for reader in out.consumers):
            continue
        b = Builder(flow, func)
        swapped = [b.wrap(x).transpose(_SWAP).var for x in (q, k, v)]
        rows = b.op("Attention", [*swapped, *op.inputs[3:]], None, {**op.attrs, "heads_first": False})
        out, *statistics = rows if isinstance(rows, tuple) else (rows,)  # statistics are [B, H, T] either way
        splice(flow, op, [out.transpose(_SWAP), *statistics])


def _viewed(op: Operation | None) -> bool:
    """Whether `op` is a reshape or a Transpose (a chain of views fold-views folds)."""
    return op is not None and (is_view(op) or op.type == "Transpose")
