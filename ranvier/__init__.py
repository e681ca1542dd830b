"""ranvier: a neural-network JIT compiler and trainer.

The API follows SLING's Myelin, so `import ranvier as myelin` runs Myelin examples:
build a Flow with a Builder, compile it into a Network, and compute Cell instances.
"""

from . import nn
from .compiler import Compiler
from .dtypes import (
    DT_BFLOAT16,
    DT_BOOL,
    DT_DOUBLE,
    DT_FLOAT,
    DT_FLOAT16,
    DT_FLOAT32,
    DT_FLOAT64,
    DT_HALF,
    DT_INT,
    DT_INT8,
    DT_INT16,
    DT_INT32,
    DT_INT64,
    DT_UINT8,
    DT_UINT16,
    DT_UINT32,
    DT_UINT64,
)
from .errors import CompileError, FlowFileError, RanvierError, ShapeError, UnknownOpError
from .flow import Blob, Builder, Connector, Flow, Function, Operation, Tensor, Variable
from .handles import Channel, TensorHandle
from .runtime import Cell, Instance, Network
from .version import __version__


def from_torch(module, example_inputs, dims=None, function: str = "main", trainable: bool = False) -> Flow:
    """A PyTorch module's forward pass as a flow, through torch.export and ONNX (see
    `ranvier.onnx.from_torch`; `trainable=True` for a flow to train); needs torch, onnx
    and onnxscript."""
    from .onnx import from_torch as convert

    return convert(module, example_inputs, dims, function, trainable)


__all__ = [
    "DT_BFLOAT16",
    "DT_BOOL",
    "DT_DOUBLE",
    "DT_FLOAT",
    "DT_FLOAT16",
    "DT_FLOAT32",
    "DT_FLOAT64",
    "DT_HALF",
    "DT_INT",
    "DT_INT8",
    "DT_INT16",
    "DT_INT32",
    "DT_INT64",
    "DT_UINT8",
    "DT_UINT16",
    "DT_UINT32",
    "DT_UINT64",
    "Blob",
    "Builder",
    "Cell",
    "Channel",
    "CompileError",
    "Compiler",
    "Connector",
    "Flow",
    "FlowFileError",
    "Function",
    "Instance",
    "Network",
    "Operation",
    "RanvierError",
    "ShapeError",
    "Tensor",
    "TensorHandle",
    "UnknownOpError",
    "Variable",
    "__version__",
    "from_torch",
    "nn",
]
