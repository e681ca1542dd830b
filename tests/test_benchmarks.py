"""The side-by-side benchmarks run end to end (tiny shapes, one repetition) and print the
machine, both sides' medians and the ratio with its direction in words, so they cannot rot
between the times someone measures."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, script, *args], check=False, cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def assert_torch_compile_side(out: str, unit: str) -> None:
    """The training races on the CPU: the instructions PyTorch's libraries and Inductor
    ran, the compile times' caches in words, the torch.compile side's median and verdicts."""
    assert re.search(r"^PyTorch's CPU code: ATen kernels \[\w+\], products by .*, oneDNN \[.+\]; "
                     r"torch.compile: Inductor's generated C\+\+ \[.+\], products by ATen's$", out, re.MULTILINE), out
    assert "compile times with the caches as found (--cold-compile: a first run's)" in out
    assert re.search(rf"^torch.compile median +[\d.]+ {unit}$", out, re.MULTILINE)
    for verdict in (r"torch.compile is [\d.]+× (faster|slower) than pytorch", r"ranvier is [\d.]+× (faster|slower) than torch.compile"):
        assert re.search(rf"^{verdict} \(median {unit}\)$", out, re.MULTILINE), verdict


def assert_summary(lines: list[str], unit: str, sides=("ranvier", "pytorch")) -> None:
    """The machine first; each side's median; "ranvier is N× faster/slower than pytorch"."""
    assert lines[0].startswith("CPU: ") and " cores, ranvier kernels [" in lines[0] and "torch " in lines[0]
    for side in sides:
        assert any(line.startswith(f"{side:12s} median") and line.endswith(f" {unit}") for line in lines), side
    assert any(re.fullmatch(rf"ranvier is \d+\.\d\d× (faster|slower) than pytorch \(median {unit}\)", line) for line in lines)


def assert_bf16_side(out: str, unit: str) -> None:
    """Where this CPU runs bf16 products (AMX tiles, AVX512-BF16 pairs), the machine line says
    which and ranvier-bf16 races beside ranvier's float32, compared with it; elsewhere neither."""
    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.target import host_target

    bf16 = bf16_gemm(host_target())
    assert (f"+{bf16}]" in out.splitlines()[0]) == bool(bf16)
    compared = re.search(rf"^ranvier-bf16 is \d+\.\d\d× (faster|slower) than ranvier \(median {unit}\)$", out, re.MULTILINE)
    assert bool(compared) == bool(bf16)


@pytest.mark.slow
@pytest.mark.parametrize("script,preset", [("llama_train.py", "stories260K"), ("moe_train.py", "moe-tiny")])
def test_training_benchmark_prints_the_machine_both_sides_and_the_ratio(script, preset):
    out = run(script, "--preset", preset, "--batch", "2", "--seq", "16", "--steps", "2", "--repeats", "1")
    assert_summary(out.splitlines(), "tokens/s")
    assert re.search(r"ceilings measured here: fp32 GEMM [\d,]+ GFLOP/s .*memory [\d.,]+ GB/s", out)
    for side in ("ranvier", "pytorch"):
        assert re.search(rf"^{side} +[\d.]+ GFLOP/s of model arithmetic .*, \d+% of the GEMM ceiling$", out, re.MULTILINE), side
    if script == "llama_train.py":  # where ranvier's step spent its time, kernel by kernel; torch.compile beside eager
        assert re.search(r"^cell train: [\d.]+ ms per compute, by kernel$", out, re.MULTILINE)
        assert re.search(r"^  first step torch.compile +[\d.]+ s$", out, re.MULTILINE)
        assert_torch_compile_side(out, "tokens/s")
        assert_bf16_side(out, "tokens/s")
    if script == "moe_train.py":
        assert "routing skips 50% of the expert FLOPs" in out  # top-2 of 4
        assert "ranvier's step: matrix products" in out


@pytest.mark.slow
def test_torch_training_benchmark_races_eager_and_torch_compile_on_each_model():
    """ResNet-18 and GPT-2 (tiny shapes): each side's compile time, then each side's median
    and ranvier's verdicts against PyTorch eager and torch.compile, and ranvier's kernels."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    out = run("torch_train.py", "--quick", "--steps", "1", "--repeats", "1")
    for unit in ("examples/s", "tokens/s"):
        assert_summary(out.splitlines(), unit, sides=("ranvier", "pytorch", "torch.compile"))
        assert_torch_compile_side(out, unit)
    assert len(re.findall(r"^  compile ranvier +[\d.]+ s  \(torch.export and the ONNX import [\d.]+ s, the cell [\d.]+ s\)$",
                          out, re.MULTILINE)) == 2
    assert len(re.findall(r"^  compile torch.compile +[\d.]+ s  \(its first step; its second [\d.]+ s\)$", out, re.MULTILINE)) == 2
    assert len(re.findall(r"^cell main: [\d.]+ ms per compute, by kernel$", out, re.MULTILINE)) == 2


@pytest.mark.slow
def test_compile_time_benchmark_prints_the_code_and_the_seconds_as_for_more_cores():
    out = run("compile_time.py", "--preset", "stories260K", "--batch", "2", "--seq", "16", "--cores", "3", "--repeats", "1")
    lines = out.splitlines()
    assert lines[0].startswith("CPU: ") and lines[0].endswith("; code generated as for 3 cores") and " 3 cores, " in lines[0]
    assert re.fullmatch(r"stories260K training step, batch 2 x seq 16: [\d,]+ lines of LLVM IR; compiled in [\d.]+ s "
                        r"\(median of 1\), \d+% of it in LLVM", lines[-1]), lines[-1]


@pytest.mark.slow
def test_compile_time_benchmark_splits_the_cuda_steps_compile_by_phase():
    """--backend cuda --quick: the CUDA step compiled with no GPU, its seconds by phase."""
    out = run("compile_time.py", "--backend", "cuda", "--quick")
    assert re.search(r"^stories260K CUDA training step, bfloat16 activations, batch 2 x seq 16: [\d,]+ lines of PTX, "
                     r"\d+ kernels; compiled in [\d.]+ s \(median of 1; the trainer, with its flow, gradient and "
                     r"optimizer, [\d.]+ s\)$", out, re.MULTILINE), out
    for phase in ("flow passes", "kernel choice, cuBLASLt plans", "memory plan", "GPU kernels built (LLVM IR)",
                  "PTX (IR printed, optimized, emitted)", "ptxas", "the rest (gradient, type checks, globals)"):
        assert re.search(rf"^  {re.escape(phase)} +-?[\d.]+ s +-?\d+%$", out, re.MULTILINE), phase
    assert "A GPU host adds loading the machine code onto the device" in out


@pytest.mark.slow
def test_training_benchmark_races_the_cuda_backend_with_and_without_graphs(monkeypatch):
    """On the host emulator here (PyTorch's sides then on the CPU): the GPU line, ranvier
    replaying graphs and launching kernel by kernel, PyTorch eager and through
    torch.compile (asked for: by default only on a GPU), each side's first step, and the
    verdicts against both PyTorch sides."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    out = run("llama_train.py", "--backend", "cuda", "--preset", "stories260K", "--batch", "2", "--seq", "16", "--steps", "1",
              "--repeats", "1", "--torch-compile")
    lines = out.splitlines()
    assert lines[1].startswith("GPU: ") and "ranvier (cuda, bfloat16) compiled the training step" in out
    assert_summary(lines, "tokens/s", sides=("ranvier", "rv-no-graph", "pytorch", "torch.compile"))
    for side in ("ranvier", "rv-no-graph", "pytorch", "torch.compile"):
        assert re.search(rf"^  first step {re.escape(side)} +[\d.]+ s$", out, re.MULTILINE), side
    assert re.search(r"^rv-no-graph is \d+\.\d\d× (faster|slower) than pytorch \(median tokens/s\)$", out, re.MULTILINE)
    assert re.search(r"^ranvier is \d+\.\d\d× (faster|slower) than torch.compile \(median tokens/s\)$", out, re.MULTILINE)
    assert re.search(r"^cell train: [\d.]+ ms per compute on host emulator.*, by kernel$", out, re.MULTILINE)
    assert re.search(r"^  Attention +\d+ +[\d.]+ +[\d.]+%", out, re.MULTILINE)
    assert re.search(r"^gpu-result stories260K tokens/s=\d+ vs-eager=\d+\.\d\d vs-compile=\d+\.\d\d mfu=[\d.]+% gpu=emulator$",
                     out, re.MULTILINE)
    table = out[out.index("the slowest steps of ranvier's step, timed by events:"):].splitlines()
    assert table[2].startswith("| step | kernel |") and len([line for line in table if line.startswith("| ")]) == 2 + 15


@pytest.mark.slow
def test_moe_training_benchmark_races_the_cuda_backend_against_pytorch_eager(monkeypatch):
    """On the host emulator here: ranvier with and without graphs against PyTorch eager,
    the gpu-result line, ranvier's step by kernel with the grouped products on tensor
    cores; the GPU's flags are refused on the CPU."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    out = run("moe_train.py", "--backend", "cuda", "--preset", "moe-tiny", "--batch", "2", "--seq", "16", "--steps", "1",
              "--repeats", "1")
    lines = out.splitlines()
    assert "ranvier (cuda, bfloat16) compiled the training step" in out
    assert_summary(lines, "tokens/s", sides=("ranvier", "rv-no-graph", "pytorch"))
    assert re.search(r"^gpu-result moe-tiny tokens/s=\d+ vs-eager=\d+\.\d\d vs-compile=n/a mfu=[\d.]+% gpu=emulator$",
                     out, re.MULTILINE)
    assert re.search(r"^cell train: [\d.]+ ms per compute on host emulator.*, by kernel$", out, re.MULTILINE)
    assert re.search(r"^  GroupedProductMMA +\d+ +[\d.]+ +[\d.]+%", out, re.MULTILINE)
    assert "ranvier's step: matrix products" in out
    done = subprocess.run([sys.executable, "moe_train.py", "--matmul", "bfloat16"], check=False, cwd=BENCHMARKS,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "are for --backend cuda" in done.stderr


@pytest.mark.slow
def test_training_benchmark_stores_activations_in_bfloat16_on_the_cuda_backend_where_asked(monkeypatch):
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    out = run("llama_train.py", "--backend", "cuda", "--preset", "stories260K", "--batch", "2", "--seq", "16", "--steps", "1",
              "--repeats", "1", "--precision", "bfloat16", "--no-torch-compile")
    assert "ranvier (cuda, bfloat16, bfloat16 activations) compiled the training step" in out
    assert_summary(out.splitlines(), "tokens/s", sides=("ranvier", "rv-no-graph", "pytorch"))
    done = subprocess.run([sys.executable, "llama_train.py", "--precision", "bfloat16"], check=False, cwd=BENCHMARKS,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--precision bfloat16 is for --backend cuda" in done.stderr


@pytest.mark.slow
def test_onnx_inference_benchmark_races_onnx_runtime_and_openvino_on_each_model():
    """Each model's sides (ranvier in float32 and with bf16 products, ONNX Runtime,
    OpenVINO where installed) with their times and errors, each ranvier side's verdict
    against each peer and its time by kernel."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    openvino = importlib.util.find_spec("openvino") is not None
    out = run("onnx_inference.py", "--quick", "--batches", "1", "--repeats", "1", "--matmul", "bfloat16", "--profile")
    lines = out.splitlines()
    assert lines[0].startswith("CPU: ") and " cores, ranvier kernels [" in lines[0]
    assert re.match(r"ceilings measured here: fp32 GEMM [\d,]+ GFLOP/s .*memory [\d.,]+ GB/s", lines[1])
    assert lines[2].startswith("ONNX Runtime ")
    if openvino:
        assert re.fullmatch(r"OpenVINO [\d.]+: CPU plugin, \d+ threads \(INFERENCE_NUM_THREADS\), its default precision "
                            r"\(INFERENCE_PRECISION_HINT\) and \w+ hint", lines[3]), lines[3]
    else:
        assert lines[3] == "OpenVINO: not installed (pip install openvino), its side left out"
    peers = ["onnxruntime", "openvino"] if openvino else ["onnxruntime"]
    bounds = {"ranvier": ("onnxruntime", 1e-5), "ranvier-bf16": ("ranvier's float32", 2e-2), "openvino": ("ranvier's float32", 5e-2)}
    for model in ("bert-base", "resnet18", "gpt2-small", "vit-b16"):
        first = lines.index(next(line for line in lines if line.startswith(f"{model}, batch 1: ")))
        assert re.fullmatch(rf"{model}, batch 1: [\d.]+ GFLOP" + ("; OpenVINO in (bf16|f32|f16)" if openvino else ""), lines[first])
        rows = {line.split()[0]: line for line in lines[first + 1:first + 3 + len(peers)]}
        assert list(rows) == ["ranvier", "ranvier-bf16", *peers], rows
        for side, row in rows.items():
            found = re.fullmatch(rf"  {side} +[\d.]+ ms +[\d.]+ items/s +\d+% of the fp32 GEMM ceiling"
                                 r"(?:; max rel. error (\S+) against (.+))?", row)
            assert found, row
            if side in bounds:
                assert found[2] == bounds[side][0] and float(found[1]) < bounds[side][1], row
        verdicts = lines[first + 3 + len(peers):first + 3 + 3 * len(peers)]
        assert [tuple(line.split()[i] for i in (0, 5)) for line in verdicts] == [
            (ours, peer) for ours in ("ranvier", "ranvier-bf16") for peer in peers], verdicts
        for line in verdicts:
            assert re.fullmatch(r"  \S+ is [\d.]+× (faster|slower) than (\S+) \(median time: [\d.]+ of \2's\)", line), line
        profiles = [line for line in lines[first + 3 + 3 * len(peers):] if " per compute, by kernel" in line][:2]
        assert [line.split("'s cell main: ")[0] for line in profiles] == ["  ranvier", "  ranvier-bf16"], profiles


@pytest.mark.slow
def test_mnist_benchmark_says_which_side_is_faster_and_how_far_each_is_from_the_ceiling():
    out = run("mnist_mlp.py", "--steps", "20", "--repeats", "1")
    assert_summary(out.splitlines(), "s")
    assert_torch_compile_side(out, "s")
    assert re.search(r"ceilings measured here: fp32 GEMM [\d,]+ GFLOP/s .*memory [\d.,]+ GB/s", out)
    for side in ("ranvier", "pytorch", "torch.compile"):
        assert re.search(rf"^{re.escape(side)} +[\d.]+ GFLOP/s, \d+% of the GEMM ceiling$", out, re.MULTILINE), side
    for side in ("ranvier", "torch.compile"):  # each compiles before its timed steps; eager has nothing to compile
        assert re.search(rf"^{re.escape(side)} +median accuracy [\d.]+, compiled in [\d.]+ s in its first run$", out,
                         re.MULTILINE), side
    assert re.search(r"^pytorch +median accuracy [\d.]+$", out, re.MULTILINE)
    assert_bf16_side(out, "s")


@pytest.mark.slow
def test_generate_benchmark_races_pytorch_with_a_kv_cache_on_the_same_weights():
    """ranvier in float32 and with bf16 weights, against PyTorch's float32 decoder."""
    out = run("generate.py", "--presets", "stories260K", "--tokens", "8", "--repeats", "1")
    assert_summary(out.splitlines(), "tokens/s", sides=("ranvier", "ranvier-bf16", "pytorch"))
    assert re.search(r"compiled: ranvier in [\d.]+s, ranvier-bf16 in [\d.]+s; ", out)
    assert "ranvier and pytorch: the same greedy tokens for the first 8 of 8" in out
    assert re.search(r"^ranvier-bf16 and pytorch: the same greedy tokens for the first \d of 8$", out, re.MULTILINE)
    assert re.search(r"^ranvier-bf16 is \d+\.\d\d× (faster|slower) than pytorch \(median tokens/s\)$", out, re.MULTILINE)
    assert re.search(r"^ceilings measured here: .*, memory [\d.]+ GB/s \(a copy, read \+ write\)$", out, re.MULTILINE)
    streamed = {side: float(megabytes) for side, megabytes in
                re.findall(r"^(\S+) +([\d.]+) MB a token, +[\d.]+ GB/s, \d+% of the memory ceiling$", out, re.MULTILINE)}
    assert set(streamed) == {"ranvier", "ranvier-bf16", "pytorch"}
    assert streamed["ranvier"] == streamed["pytorch"] > streamed["ranvier-bf16"] >= streamed["ranvier"] / 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_attention_benchmark_times_both_passes_of_each_side(backend, monkeypatch):
    """ranvier's attention steps by the backend's clock (the CUDA backend on the host
    emulator here: its tensor-core kernels, on the cudnn side too, which the emulator does
    not claim, and bound to 3 blocks a multiprocessor) against PyTorch's SDPA, both passes, the ratio."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    out = run("attention.py", "--backend", backend, "--batch", "1", "--seq", "70", "--heads", "2", "--kv-heads", "1",
              "--head-size", "32", "--repeats", "1", "--steps", "1", "--key-blocks", "3")
    lines = out.splitlines()
    kernels = "AttentionMMA" if backend == "cuda" else "Attention"
    operands = "bfloat16" if backend == "cuda" else "float32"
    assert re.search(rf"ranvier \({backend}, {operands} operands, (bfloat16|float32) products\): .*ranvier: {kernels}", out), out
    for side in ("cudnn", "ranvier", "own/3sm", "pytorch") if backend == "cuda" else ("ranvier", "pytorch"):
        assert re.search(rf"^{side} +forward +[\d.]+ ms \( *[\d.]+ TFLOP/s\), backward +[\d.]+ ms", out, re.MULTILINE), side
    assert_summary(lines, "ms")
    # the key launch bound to 3 blocks a multiprocessor against the same kernels unbound (a GPU's race alone)
    assert ("own/3sm is" in out and "than ranvier (median ms of the backward)" in out) == (backend == "cuda")


@pytest.mark.slow
def test_generate_benchmark_decodes_on_the_cuda_backend(monkeypatch):
    """On the host emulator here: ranvier's cells on the CUDA backend, PyTorch's decoder on
    the CPU (it sees no GPU), the same greedy tokens."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    out = run("generate.py", "--presets", "stories260K", "--tokens", "8", "--repeats", "1", "--backend", "cuda")
    lines = out.splitlines()
    assert lines[1] == "GPU: none that PyTorch sees; its side runs on the CPU"
    assert re.match(r"stories260K: .*, ranvier \(cuda\) compiled: ranvier in [\d.]+s; PyTorch on cpu; ", lines[2])
    assert_summary(lines, "tokens/s")
    assert "ranvier and pytorch: the same greedy tokens for the first 8 of 8" in out


@pytest.mark.slow
def test_kernels_benchmark_compares_each_op_and_stays_under_its_ceiling():
    out = run("kernels.py", "--quick", "--repeats", "1")
    lines = out.splitlines()
    assert lines[0].startswith("CPU: ") and "1 rounds, each implementation in turn timing one call after 2+" in lines[1]
    shares = [float(line.rsplit(None, 1)[1].rstrip("%")) for line in lines if re.match(r"  (ranvier|numpy|torch) +\d", line)]
    # a share under 0.05% prints as 0.0% (numpy's loops under load)
    assert shares and all(0 <= share <= 100.0 for share in shares)
    verdicts = [line for line in lines if line.startswith("  ranvier is ")]
    assert len(verdicts) == len(shares) // 3
    assert all(re.fullmatch(r"  ranvier is [\d.]+× (faster|slower) than numpy, [\d.]+× (faster|slower) than torch \(median time\)", v)
               for v in verdicts)


@pytest.mark.slow
def test_data_parallel_benchmark_scales_both_sides_over_mpi_ranks():
    pytest.importorskip("mpi4py")
    from ranvier.distributed.launch import find_mpiexec
    from ranvier.errors import RanvierError

    try:
        find_mpiexec()
    except RanvierError:
        pytest.skip("no MPI launcher")
    out = run("data_parallel.py", "--workers", "1,2,3", "--preset", "stories260K", "--batch", "2", "--seq", "16",
              "--steps", "2", "--repeats", "1")
    lines = out.splitlines()
    assert lines[0].startswith("CPU: ") and " cores, ranvier kernels [" in lines[0]
    rows = {int(line.split()[0]): line for line in lines if re.match(r" +[123] +\d+ \| ", line)}
    assert sorted(rows) == [1, 2, 3]
    assert re.search(r"\| +\d+ +100% +- +- \| +\d+ +100%$", rows[1])
    for n in (2, 3):
        assert re.search(r"\| +\d+ +\d+% +[\d.]+ms +\d+% \| +\d+ +\d+%$", rows[n]), rows[n]
        assert re.search(rf"^{n} ranks: ranvier is [\d.]+× (faster|slower) than pytorch \(median tokens/s\)$", out, re.MULTILINE)
    assert "gradients all-reduced per step: " in out
    assert ("share cores (oversubscribed)" in out) == (len(os.sched_getaffinity(0)) < 3)


def test_a_gpu_race_ends_with_its_gpu_result_line():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from common import gpu_result
    finally:
        sys.path.remove(str(BENCHMARKS))
    medians = {"ranvier": 1230.4, "rv-no-graph": 1100.0, "pytorch": 1000.0, "torch.compile": 1414.0}
    assert gpu_result("stories15M", medians, 1e9, 4e13, "NVIDIA H200") == \
        "gpu-result stories15M tokens/s=1230 vs-eager=1.23 vs-compile=0.87 mfu=3.1% gpu=H200"
    del medians["torch.compile"]
    assert "vs-compile=n/a mfu" in gpu_result("stories110M", medians, 1e9, 4e13, "NVIDIA H100 80GB HBM3")


def test_an_mfu_is_quoted_against_the_datasheet_peak_of_the_gpu_named():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from common import datasheet_peak
    finally:
        sys.path.remove(str(BENCHMARKS))
    flops, which = datasheet_peak("NVIDIA H100 80GB HBM3")
    assert flops == 989.4e12 and which == "NVIDIA H100 80GB HBM3's 989 TFLOP/s datasheet bf16"
    assert datasheet_peak("NVIDIA H200")[0] == 989.4e12 and datasheet_peak("NVIDIA H100 PCIe")[0] == 756.5e12
    assert datasheet_peak("NVIDIA GeForce RTX 4090") is None


@pytest.mark.slow
def test_gpu_kernel_benchmark_checks_and_runs_every_kernel_on_the_emulator(tmp_path):
    """--backend emulator --quick: each of the step's kernels checked against the numpy
    reference (PyTorch's formulas on the CPU too), run on the host emulator, one line of
    figures per side and a gpu-result line each; the markdown table with a row each."""
    table = tmp_path / "gpu-kernels.md"
    out = run("gpu_kernels.py", "--backend", "emulator", "--quick", "--repeats", "1", "--calls", "1", "--out", str(table))
    lines = out.splitlines()
    assert lines[0].startswith("CPU: ") and lines[1].startswith("GPU: none: ranvier's kernels run on the CUDA backend's host")
    assert re.match(r"ceilings measured here: bf16 GEMM [\d,]+ GFLOP/s \(ranvier's cuBLASLt product.*memory [\d.,]+ GB/s", lines[2])
    assert "PyTorch eager and torch.compile: not timed, on the emulator" in out
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from gpu_kernels import KERNELS
    finally:
        sys.path.remove(str(BENCHMARKS))
    results = re.findall(r"^gpu-result kernel/(\S+) us=[\d.]+ (?:GB/s|TFLOP/s)=\d+ roofline=[\d.]+% vs-eager=n/a "
                         r"vs-compile=n/a gpu=emulator$", out, re.MULTILINE)
    assert results == list(KERNELS)
    assert len(re.findall(r"^  ranvier +[\d.]+ µs +[\d,.]+ (GB/s|TFLOP/s) +[\d.]+% of the (copy|GEMM) ceiling$", out, re.MULTILINE)) \
        == len(KERNELS)
    text = table.read_text()
    assert "the stories110M step's kernels alone, against PyTorch on the same GPU:" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| kernel", "| ---"))]
    assert len(rows) == len(KERNELS) and "| Rows (RMSNormGradCalculate) |" in text and "| Map (Calculate) |" in text


def test_gpu_kernel_benchmark_never_times_a_kernel_that_differs_from_the_reference(monkeypatch):
    """A kernel that writes nothing (the emulator's launches skipped: its outputs keep the
    fresh memory's NaN) fails the check, naming the kernel, before anything is timed."""
    import torch

    from ranvier.backends.cuda.emulator import HostEmulator
    from ranvier.errors import RanvierError

    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_kernels
    finally:
        sys.path.remove(str(BENCHMARKS))
    (case,) = gpu_kernels.cases(gpu_kernels.TINY, ["rmsnorm"])
    gpu_kernels.check(case, torch, "cpu")  # the kernel as compiled agrees
    monkeypatch.setattr(HostEmulator, "launch", lambda self, code, kernel, shape, addresses: None)
    with pytest.raises(RanvierError, match=r"rmsnorm: ranvier's Cast:0 \[2, 16, 64\] differs from the numpy reference .* "
                                           r"non-finite 2048\): a wrong kernel is not timed"):
        gpu_kernels.check(case, torch, "cpu")


def test_a_race_calls_its_sides_in_a_new_order_each_round():
    """No side always follows the same one (a call finds the cores as the last call left
    them): over the rounds each side comes after each other side, every side is called
    once a round after its warm-up, and the medians are its own calls'."""
    from ranvier import modelrun

    calls: list[str] = []
    sides = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    times = modelrun.race(sides, repeats=24, settle=0.0)
    assert set(times) == set(sides)
    assert calls[:4] == list("abcd")  # the warm-ups
    rounds = [calls[4 + 4 * r: 8 + 4 * r] for r in range(24)]
    assert all(sorted(order) == list("abcd") for order in rounds)
    followed = {(before, after) for before, after in itertools.pairwise(calls[4:]) if before != after}
    assert followed == {(before, after) for before in "abcd" for after in "abcd" if before != after}
