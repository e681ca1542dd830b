"""The GPU run's tooling, checked without a GPU: .ci/gpu-check parses, and .ci/gpu-report
turns what its stages printed (a finished race, one its limit cut short, the tests' outcome)
into the markdown report a GPU session commits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parent.parent / ".ci"

RACE = """GPU: NVIDIA H200
ranvier (cuda, bfloat16, bfloat16 activations) compiled the training step in 9.1s
  first step ranvier            0.12 s
  run 1 ranvier          600000 tokens/s  loss 10.4 (ln V = 10.373)
  run 1 pytorch          500000 tokens/s  loss 10.4 (ln V = 10.373)
  run 2 ranvier          620000 tokens/s  loss 10.3 (ln V = 10.373)
  run 2 pytorch          480000 tokens/s  loss 10.3 (ln V = 10.373)
ceilings measured here: bf16 GEMM 788,000 GFLOP/s (PyTorch's 8192³ product on NVIDIA H200), memory 4,300.0 GB/s (a copy, read + write)
gpu-result stories15M tokens/s=610000 vs-eager=1.24 vs-compile=n/a mfu=31.2% gpu=H200
cell train: 100.000 ms per compute on NVIDIA H200, by kernel
the slowest steps of ranvier's step, timed by events:

| step | kernel | op | µs | share | GFLOP/s | of GEMM | GB/s | of copy |
| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |
| 3 | Rows | SoftmaxCrossEntropyGrad train/x | 700.0 | 14.0% | 1.0 | 0.0% | 3000.0 | 69.8% |
"""


def test_the_gpu_check_script_parses():
    for script in ("gpu-check", "gpu-wheels"):
        assert subprocess.run(["bash", "-n", str(CI / script)], check=False).returncode == 0, script


def _report(tmp_path, logs: dict[str, str], report_name: str = "gpu-check.md") -> str:
    """.ci/gpu-report's report from stage logs (file name: text) of a run folder."""
    run = tmp_path / "run"
    run.mkdir()
    for name, text in logs.items():
        (run / name).write_text(text)
    report = tmp_path / report_name
    done = subprocess.run([sys.executable, str(CI / "gpu-report"), str(run), str(report)], check=False, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    return report.read_text()


def test_the_report_keeps_what_each_stage_printed_a_race_cut_short_too(tmp_path):
    text = _report(tmp_path, {
        "machine.log": "gpu: NVIDIA H200, 580.159.04, 143771 MiB\nptxas: /usr/local/cuda/bin/ptxas 13.0\n",
        "stages.log": "tests: 71 s of 130, exit 1\ntrain-stories15M:64:256: 80 s of 110, exit 0\n"
                      "train-stories110M:32:1024: 150 s of 150, cut at its limit\n",
        "tests.log": "....F\nFAILED tests/test_cuda_blas.py::test_x - AssertionError\n1 failed, 200 passed, 40 skipped in 70.12s\n",
        "train-stories15M:64:256.log": RACE,
        "train-stories110M:32:1024.log": RACE.split("  run 2", maxsplit=1)[0],  # cut after its first run
    }, "results/gpu-check.md")
    assert "- gpu: NVIDIA H200, 580.159.04, 143771 MiB" in text and "- train-stories110M:32:1024: 150 s of 150, cut at its limit" in text
    assert "1 failed, 200 passed, 40 skipped in 70.12s" in text and "- FAILED tests/test_cuda_blas.py::test_x" in text
    finished, cut = text.split("## Training: stories15M, batch 64 x 256")[1].split("## Training: stories110M, batch 32 x 1024")
    assert "| ranvier | 610,000.0 | 2 | 1.24 |" in finished and "| pytorch | 490,000.0 | 2 | 1.00 |" in finished
    assert "gpu-result stories15M tokens/s=610000 vs-eager=1.24" in finished
    assert "| 3 | Rows | SoftmaxCrossEntropyGrad train/x | 700.0 |" in finished
    assert "| ranvier | 600,000.0 | 1 | 1.20 |" in cut and "No gpu-result line: the race did not finish." in cut


def test_the_report_keeps_the_moe_race_and_its_gpu_result_line(tmp_path):
    section = _report(tmp_path, {"moe.log": RACE.replace("stories15M", "moe-15M")}).split("## MoE training: moe-15M (benchmarks/moe_train.py)")[1]
    assert "| ranvier | 610,000.0 | 2 | 1.24 |" in section and "gpu-result moe-15M tokens/s=610000 vs-eager=1.24" in section


ATTENTION = """CPU: x
GPU: NVIDIA H200
batch 32 x seq 1024, 12 heads (12 key/value) of 64, causal; ranvier (cuda, bfloat16 operands, bfloat16 products): \
cudnn: cuDNN[SDPA forward 32×1024×1024, 12 heads of 64, bfloat16, causal, scale 0.125; else AttentionMMA]; ranvier: AttentionMMA
  run 1 cudnn    forward     0.500 ms  backward     1.500 ms
  run 1 ranvier  forward     2.000 ms  backward     9.000 ms
cudnn    forward     0.500 ms (412.00 TFLOP/s), backward     1.500 ms (343.00 TFLOP/s)
ranvier  forward     2.000 ms (103.00 TFLOP/s), backward     9.000 ms ( 57.00 TFLOP/s)
cudnn        median     2.000 ms
cudnn is 1.10× faster than pytorch (median ms)
own/4sm is 1.05× faster than ranvier (median ms of the backward)
"""


def test_the_report_keeps_the_attention_race_and_what_ran_each_side(tmp_path):
    section = _report(tmp_path, {"attention.log": ATTENTION}).split("## Attention, stories110M's")[1]
    assert "cudnn: cuDNN[SDPA forward 32×1024×1024" in section and "- cudnn    forward     0.500 ms" in section
    assert "- cudnn        median     2.000 ms" in section and "- cudnn is 1.10× faster than pytorch" in section
    assert "- own/4sm is 1.05× faster than ranvier (median ms of the backward)" in section  # the bound key launch's race
    assert "run 1" not in section


def _gpu_kernels():
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("gpu_kernels", str(CI / "gpu-kernels"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_kernels", loader))
    loader.exec_module(module)
    return module


NCU_LOG = """==PROF== Connected to process 1234
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1234","python3","host","k_train_Gather","1","13","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,000,000"
"0","1234","python3","host","k_train_Gather","1","13","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","1,000,000"
"0","1234","python3","host","k_train_Gather","1","13","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,000"
"1","1234","python3","host","sm90_xmma_gemm_bf16bf16","1","13","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","4000000"
"1","1234","python3","host","sm90_xmma_gemm_bf16bf16","1","13","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"1","1234","python3","host","sm90_xmma_gemm_bf16bf16","1","13","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","4000"
"""


def test_the_kernel_table_reads_ncus_csv(tmp_path, monkeypatch):
    """A stand-in ncu that writes its CSV log: the kernels by time, each one's DRAM bytes
    over its time against the copy bandwidth; an ncu that reads nothing is quoted."""
    fake = tmp_path / "ncu"
    log = tmp_path / "log.csv"
    log.write_text(NCU_LOG)
    fake.write_text(f'#!/bin/sh\nwhile [ "$1" != --log-file ]; do shift; done\ncp {log} "$2"\n')
    fake.chmod(0o755)
    kernels = _gpu_kernels()
    lines = kernels.kernel_table(kernels.profile(str(fake)), 4e12, 15)
    assert lines[0] == "ncu read 2 launches of one step: 0.01 ms of kernels" and lines[1] == kernels.HEADING
    assert lines[5:] == ["| `sm90_xmma_gemm_bf16bf16` | 1 | 4.0 | 80.0% | 1000 | 25% |",
                         "| `k_train_Gather` | 1 | 1.0 | 20.0% | 2000 | 50% |"]
    fake.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM - The user does not have permission' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="ncu could not read the counters \\(exit 1\\): ==ERROR== ERR_NVGPUCTRPERM"):
        kernels.profile(str(fake))


def test_the_report_keeps_the_kernel_races_gpu_result_lines(tmp_path):
    """benchmarks/gpu_kernels.py's stage: the GPU and ceilings it printed, and a gpu-result
    line for each kernel it finished before its limit."""
    log = (
        "CPU: Intel Xeon\nGPU: NVIDIA H200 (sm_90, 132 multiprocessors), driver 580.159.04 (CUDA 13.0); torch 2.9.0 built for CUDA 12.8\n"
        "ceilings measured here: bf16 GEMM 790,000 GFLOP/s (ranvier's cuBLASLt product), memory 4,300.0 GB/s (a copy, read + write)\n"
        "x W1 [32768x768]·[768x2048] bf16    ranvier kernels: cuBLASLt (MatMul)\n"
        "gpu-result kernel/matmul-w1 us=180.2 TFLOP/s=572 roofline=72.4% vs-eager=1.01 vs-compile=0.99 gpu=H200\n")
    section = _report(tmp_path, {"kernel-race.log": log}).split(
        "## Kernels against PyTorch (benchmarks/gpu_kernels.py; its table: gpu-kernels.md)")[1]
    assert section.startswith("\n\n- GPU: NVIDIA H200 (sm_90, 132 multiprocessors), driver 580.159.04 (CUDA 13.0)")
    assert "```\ngpu-result kernel/matmul-w1 us=180.2 TFLOP/s=572 roofline=72.4% vs-eager=1.01 vs-compile=0.99 gpu=H200\n```" \
        in section
