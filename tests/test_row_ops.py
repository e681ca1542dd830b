"""Every row op (`ROW_OPS`, filled by `@row_op` on its body in `ranvier/backends/llvm/rows.py`)
runs on both backends from that one declaration: natively on the CPU, as the kernel it names,
and in the GPU's kernels (their arithmetic compiled for the host, as tests/test_cuda_codegen.py
checks GPU code), each against the numpy reference on random rows, every output element
written (the GPU's outputs start as NaN, or -1 for integers)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import np_dtype, random_array, run_gpu_kernels_on_host

import ranvier as rv
from ranvier.backends.llvm.rows import ROW_OPS

ROWS = 6


def _vars(f, values, **shapes):
    """Variables of random values: name=(dtype, shape), or name=(dtype, shape, values)."""
    made = []
    for seed, (name, (dtype, shape, *given)) in enumerate(shapes.items()):
        made.append(f.var(name, dtype, shape))
        values[f"f/{name}"] = given[0] if given else random_array(shape, dtype, seed=seed + 1)
    return made


def _outputs(result):
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _row(op_type, attrs, **shapes):
    def build(f, values):
        return _outputs(f.op(op_type, _vars(f, values, **shapes), None, attrs))

    return build


def _labels():
    return np.array([3, 0, 49, 7, 1, 2], np.int32)


def _with_epilogue(row_op):
    """The row op's first output times another input plus one: the epilogue pass fuses the
    program into the row op (RMSNormCalculate and its kin)."""

    def build(f, values):
        first, *others = row_op(f, values)
        (scale,) = _vars(f, values, scale=(first.var.dtype, list(first.var.shape)))
        return [first * scale + 1.0, *others]

    return build


CASES = {
    "Softmax": _row("Softmax", {"axis": -1}, x=("float32", [2, 3, 7])),
    "LogSoftmax": _row("LogSoftmax", {"axis": -1}, x=("float64", [3, 40])),
    "LayerNorm": _row("LayerNorm", {"eps": 1e-5}, x=("float32", [ROWS, 48]), gamma=("float32", [48]), beta=("float32", [48])),
    "RMSNorm": _row("RMSNorm", {"eps": 1e-6}, x=("float32", [ROWS, 64]), gamma=("float32", [64])),
    "RMSNormGrad": _row("RMSNormGrad", {"eps": 1e-5}, x=("float32", [ROWS, 40]), dy=("float32", [ROWS, 40]),
                        gamma=("float32", [40])),
    "SoftmaxCrossEntropy": _row("SoftmaxCrossEntropy", {}, logits=("float32", [ROWS, 50]),
                                labels=("int32", [ROWS], _labels())),
    "SoftmaxCrossEntropyGrad": _row("SoftmaxCrossEntropyGrad", {"with_loss": True}, logits=("float32", [ROWS, 50]),
                                    labels=("int32", [ROWS], _labels()), dloss=("float32", [ROWS])),
    "TopK": _row("TopK", {"k": 3}, x=("float32", [5, 8])),
    "SoftmaxTopK": _row("SoftmaxTopK", {"k": 3}, x=("float32", [5, 8])),
    "SampleToken": _row("SampleToken", {}, logits=("float32", [2, 100]),
                        uniform=("float32", [2], np.array([0.3125, 0.71875], np.float32)),
                        temperature=("float32", [], np.float32(0.8)), top_k=("int32", [], np.int32(20)),
                        top_p=("float32", [], np.float32(0.9))),
    "Rotary": _row("Rotary", {}, x=("float32", [1, 3, 2, 16]), cos=("float32", [3, 8]), sin=("float32", [3, 8])),
}
CASES |= {
    "RMSNormCalculate": _with_epilogue(CASES["RMSNorm"]),
    "LayerNormCalculate": _with_epilogue(CASES["LayerNorm"]),
    "RMSNormGradCalculate": _with_epilogue(CASES["RMSNormGrad"]),
}


def test_every_row_op_has_a_case_here():
    assert set(CASES) == set(ROW_OPS)


def _close(got, want, name):
    if want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_a_row_op_runs_on_the_cpu_and_in_the_gpus_kernels_from_its_one_declaration(op_type):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    values: dict[str, np.ndarray] = {}
    outputs = CASES[op_type](f, values)
    for out in outputs:
        out.var.out = True
    results = {}
    for backend in ("reference", "cpu"):
        cell = rv.Compiler(backend).compile(flow).cell("f")
        data = cell.instance()
        for name, value in values.items():
            data[name] = value
        data.compute()
        results[backend] = {out.var.name: np.array(data[out.var.name]) for out in outputs}
    for name, want in results["reference"].items():
        _close(results["cpu"][name], want, f"cpu {name}")
    (step,) = [s for s in cell.steps if s.op.type == op_type]
    assert (step.kernel, step.variant) == (ROW_OPS[op_type].kernel, cell.backend.target.variant), str(cell)
    op = step.op
    inputs = values | {v.name: np.asarray(v.data).reshape(v.shape) for v in op.inputs if v.data is not None}
    got = run_gpu_kernels_on_host(op, inputs, fill=0xFF)
    assert got["status"][0] == 0
    for var in op.outputs:
        want = results["reference"][var.name]
        assert got[var.name].dtype == np_dtype(var.dtype)
        _close(got[var.name], want, f"gpu {var.name}")
