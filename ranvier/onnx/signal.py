"""ONNX's window functions (HannWindow, HammingWindow, BlackmanWindow): cosine sums of
a size known at load, computed there in float64 as the constant they are."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from .. import dtypes
from .node import Node, converts, onnx_dtype

# Each window's coefficients a_k of sum_k (-1)^k a_k cos(2πkn / N).
_COSINE_SUMS = {"HannWindow": [0.5, 0.5], "HammingWindow": [25 / 46, 21 / 46], "BlackmanWindow": [0.42, 0.5, 0.08]}


@converts(*_COSINE_SUMS)
def cosine_window(node: Node):
    size = node.constant(0, "size")
    if size.size != 1 or size.dtype.kind not in "iu" or int(size.reshape(())) < 0:
        raise node.error(f"its size {size.tolist()} is not one integer >= 0")
    size = int(size.reshape(()))
    dtype = onnx_dtype(int(node.attr("output_datatype", TensorProto.FLOAT)), f"{node.label}'s output_datatype")
    # A periodic window (the default) is the first `size` points of one of size + 1.
    period = size if node.attr("periodic", 1) else size - 1
    n = np.arange(size, dtype=np.float64)
    window = sum((-1) ** k * a * np.cos(2 * math.pi * k * n / max(period, 1))
                 for k, a in enumerate(_COSINE_SUMS[node.proto.op_type]))
    return np.asarray(window, dtypes.to_numpy(dtype))
