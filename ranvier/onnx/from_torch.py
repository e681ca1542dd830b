"""PyTorch modules as flows: torch.export traces the module, ONNX carries the graph over.

`torch.onnx.export(..., dynamo=True)` runs `torch.export` and lowers its ATen graph to
ONNX; the importer then reads that model like any other. PyTorch stays optional: it is
imported only here, when called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import RanvierError
from ..flow.graph import Flow
from .importer import load


def from_torch(module, example_inputs: Sequence, dims: Mapping[str, int] | None = None, function: str = "main") -> Flow:
    """The module's forward pass on inputs shaped like `example_inputs` as a flow. Call
    `module.eval()` first for inference (dropout off, batch norm on running statistics).
    The flow's inputs are named after the forward's arguments."""
    try:
        import torch
    except ImportError:
        raise RanvierError("from_torch needs PyTorch (pip install torch)") from None
    if not isinstance(module, torch.nn.Module):
        raise RanvierError(f"from_torch takes a torch.nn.Module, not {type(module).__name__}")
    try:
        program = torch.onnx.export(module, tuple(example_inputs), dynamo=True, verbose=False)
    except ImportError as error:
        raise RanvierError(f"torch.onnx.export needs {error.name or 'onnxscript'} (pip install onnxscript)") from None
    except Exception as error:  # noqa: BLE001  (torch.export raises many kinds for untraceable code)
        raise RanvierError(f"torch.export could not trace {type(module).__name__}: {type(error).__name__}: {str(error)[:400]}") from None
    return load(program.model_proto, dims=dims, function=function)
