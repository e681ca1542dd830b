"""The graph IR (Flow, Variable, Operation, Function), the Builder, and .flow file I/O."""

from .builder import Builder, Tensor
from .flags import FuncFlags, OpFlags, VarFlags
from .graph import Blob, Connector, Flow, Function, Operation, Variable

__all__ = [
    "Blob",
    "Builder",
    "Connector",
    "Flow",
    "FuncFlags",
    "Function",
    "OpFlags",
    "Operation",
    "Tensor",
    "VarFlags",
    "Variable",
]
