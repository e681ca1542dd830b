"""The graph IR (Flow, Variable, Operation, Function), the Builder, and .flow file I/O."""

from .builder import Builder, Tensor
from .elements import Blob, Connector, Function, Operation, Variable
from .flags import FuncFlags, OpFlags, VarFlags
from .graph import Flow

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
