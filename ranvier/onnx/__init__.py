"""ONNX models in and out of ranvier: `load(path) -> Flow` and `save(flow, path)`.

Needs the `onnx` package (`pip install 'ranvier[onnx]'`); ranvier itself does not import it.
"""

from .importer import load, read_model
from .node import OnnxError

__all__ = ["OnnxError", "load", "read_model"]
