"""The graph IR (Flow, Variable, Operation, Function), the Builder, and .flow file I/O."""

from .builder import Builder, Tensor
from .graph import Blob, Connector, Flow, FuncFlags, Function, Operation, OpFlags, Variable, VarFlags

__all__ = [
    "Blob", "Builder", "Connector", "Flow", "FuncFlags", "Function",
    "OpFlags", "Operation", "Tensor", "Variable", "VarFlags",
]
