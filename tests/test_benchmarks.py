"""The side-by-side benchmarks run end to end (tiny shapes, one repetition) and print the
machine, both sides and the ratio, so they cannot rot between the times someone measures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, script, *args], check=False, cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script,preset", [("llama_train.py", "stories260K"), ("moe_train.py", "moe-tiny")])
def test_training_benchmark_prints_the_machine_both_sides_and_the_ratio(script, preset):
    out = run(script, "--preset", preset, "--batch", "2", "--seq", "16", "--steps", "2", "--repeats", "1")
    lines = out.splitlines()
    assert lines[0].startswith("CPU: ") and " cores, ranvier kernels [" in lines[0] and "torch " in lines[0]
    for side in ("ranvier", "pytorch"):
        assert any(line.startswith(f"{side:12s} median") and line.endswith("tokens/s") for line in lines), side
    assert any(line.startswith("ratio ranvier/pytorch = ") for line in lines)
    if script == "moe_train.py":
        assert "routing skips 50% of the expert FLOPs" in out  # top-2 of 4
        assert "ranvier's step: matrix products" in out


@pytest.mark.slow
def test_onnx_inference_benchmark_races_onnx_runtime_on_each_model():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = run("onnx_inference.py", "--quick", "--batches", "1", "--repeats", "1")
    lines = out.splitlines()
    assert lines[0].startswith("CPU: ") and " cores, ranvier kernels [" in lines[0]
    assert lines[1].startswith("ONNX Runtime ")
    for model in ("bert-base", "resnet18", "gpt2-small"):
        row = next(line for line in lines if line.startswith(model))
        assert ("faster" in row or "slower" in row) and "max rel. error" in row
        assert float(row.split("max rel. error ")[1].rstrip(")")) < 1e-5, row
