"""ONNX models in and out of ranvier: `load(path) -> Flow`, `save(flow, path)`, and
`from_torch(module, example_inputs) -> Flow` through torch.export.

Needs the `onnx` package (`pip install 'ranvier[onnx]'`); ranvier itself does not import it.
"""

from .exporter import save
from .from_torch import from_torch
from .importer import load, read_model
from .node import OnnxError, ValueNeeded

__all__ = ["OnnxError", "ValueNeeded", "from_torch", "load", "read_model", "save"]
