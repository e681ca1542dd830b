"""The rate a training run's share of peak is taken against (the dashboard's "GFLOP/s" row):
this machine's fp32 GEMM on the CPU, and on a GPU the device's own product in the run's
matrix precision, so that the share is the run's MFU."""

from __future__ import annotations

import os

import numpy as np

from .. import dtypes
from ..backends.cuda.device import DEVICE_ENVIRONMENT, EMULATOR
from ..compiler import Compiler
from ..dashboard import measured_peak_gflops
from ..flow.builder import Builder
from ..flow.graph import Flow


def measured_peak(backend: str, matmul: str = "float32") -> tuple[float, str]:
    """(GFLOP/s, what was measured) for a run on `backend` with matrix products in `matmul`."""
    return (measured_peak_gflops(), "fp32 GEMM") if backend == "cpu" else device_peak(backend, matmul)


def device_peak(backend: str, matmul: str = "float32", n: int | None = None) -> tuple[float, str]:
    """(GFLOP/s, what was measured) of an n × n × n product compiled for `backend` with the
    run's matrix-product precision: on a GPU the cuBLASLt product the training step's own
    products are, so a run's share of it is its MFU. Timed by the device's own clock on the
    product's step (best of 5), not the host's. n defaults to 8192 (256 on the host emulator)."""
    n = n or (256 if os.environ.get(DEVICE_ENVIRONMENT) == EMULATOR else 8192)
    flow = Flow()
    b = Builder(flow, "peak")
    a = b.var("a", dtypes.DT_FLOAT32, [n, n])
    total = b.sum(b.matmul(a, a))  # a scalar out: the product itself never leaves the device
    total.var.out = True
    data = Compiler(backend, matmul=matmul).compile(flow).cell("peak").instance()
    data[a] = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32) / np.sqrt(n)
    step = next(k for k, s in enumerate(data.cell.steps) if s.op.type.startswith("MatMul"))
    data.reset_profile()  # a GPU times its steps only when asked
    data.compute()
    best = float("inf")
    for _ in range(5):
        before = float(data.step_time[step])
        data.compute()
        best = min(best, float(data.step_time[step]) - before)
    return 2 * n**3 / best / 1e9, f"{matmul} GEMM on {backend}"
