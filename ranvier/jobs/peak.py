"""The rate a training run's share of peak is taken against (the dashboard's "GFLOP/s" row):
what the run's backend says its peak is (`Backend.peak_gflops`: on a GPU the device's own
product in the run's matrix precision, so that the share is the run's MFU), else this
machine's fp32 GEMM."""

from __future__ import annotations

import numpy as np

from .. import dtypes
from ..compiler import Compiler
from ..dashboard import measured_peak_gflops
from ..flow.builder import Builder
from ..flow.graph import Flow


def measured_peak(backend: str, matmul: str = "float32") -> tuple[float, str]:
    """(GFLOP/s, what was measured) for a run on `backend` with matrix products in `matmul`."""
    compiler = Compiler(backend, matmul=matmul)
    figure = compiler.backend.peak_gflops(matmul, lambda n: product_seconds(compiler, n))
    return figure if figure is not None else (measured_peak_gflops(), "fp32 GEMM")


def product_seconds(compiler: Compiler, n: int) -> float:
    """The time of an n × n × n product compiled by `compiler` (on a GPU the cuBLASLt
    product the training step's own products are), by the backend's own clock on the
    product's step, not the host's: the best of 5 computes."""
    flow = Flow()
    b = Builder(flow, "peak")
    a = b.var("a", dtypes.DT_FLOAT32, [n, n])
    total = b.sum(b.matmul(a, a))  # a scalar out: the product itself never leaves the device
    total.var.out = True
    data = compiler.compile(flow).cell("peak").instance()
    data[a] = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32) / np.sqrt(n)
    step = next(k for k, s in enumerate(data.cell.steps) if s.op.type.startswith("MatMul"))
    data.reset_profile()  # a GPU times its steps only when asked
    data.compute()
    best = float("inf")
    for _ in range(5):
        before = float(compiler.backend.step_seconds(data)[step])
        data.compute()
        best = min(best, float(compiler.backend.step_seconds(data)[step]) - before)
    return best
