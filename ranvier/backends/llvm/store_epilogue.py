"""An element epilogue run where a kernel stores: the fused ops that write each element of
their first output once (RMSNormCalculate and its kin, MaxPoolGradCalculate) emit their
base op's kernel into a context whose stores of that output hand each value to the
Calculate program instead, so the output itself is never stored."""

from __future__ import annotations

from dataclasses import dataclass

from .context import EmitContext


@dataclass(frozen=True)
class Unstored:
    """An op's first output that an epilogue takes as each element is computed."""

    name: str
    dtype: str
    shape: tuple


class StoreEpilogue:
    """The context a fused op's base op runs in: its stores of `first` run the epilogue
    program on the value instead (the program's further inputs read at the same element,
    or single values), storing the program's outputs; all else is the kernel's."""

    def __init__(self, ctx: EmitContext, first: Unstored, further: list, outputs: list, program):
        self._ctx, self._first, self._further, self._outputs, self._program = ctx, first, further, outputs, program

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)

    def store(self, var, at, value) -> None:
        if var is not self._first:
            self._ctx.store(var, at, value)
            return
        w = value.lanes
        operands = [value] + [self._ctx.load(v, at, w) if v.size > 1 else self._ctx.load(v, 0).splat(w) for v in self._further]
        for out, result in zip(self._outputs, self._program(operands, w)):
            self._ctx.store(out, at, result)
