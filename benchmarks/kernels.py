"""Times single ops on ranvier cpu, numpy and PyTorch eager vs machine ceilings; run: python benchmarks/kernels.py"""

# Ops: a fused elementwise chain gelu(x*a + b)*c + x (exact, erf GELU everywhere; numpy takes erf
# from SciPy), softmax over the last axis, layer norm with gamma/beta, per-row softmax
# cross-entropy with int64 targets, Adam's update over moments decayed into subnormals (ranvier
# flushing them, as its trainers compile; the peers computing with them), float32 GEMM
# (square and MLP-shaped; again with ranvier in mixed
# precision, bf16 inputs and float32 sums on AMX, where the CPU has it), the MNIST CNN's
# 5 × 5 convolutions over a batch: the second one forward, its input gradient's (a convolution
# of 16 channels into 8) and both filter gradients, and a small CIFAR-style 3 × 3 convolution
# (numpy as an einsum over the padded input's windows). Options: --repeats N,
# --warmup N, --quick (smaller sizes for a smoke run).
#
# Each round times every implementation once, in turn (`time_in_turns`: each timed call after
# untimed ones of its own, long enough for the previous implementation's thread pool to go quiet),
# so noise on a shared machine hits all of them alike. The table shows the median,
# the time relative to ranvier, and the achieved GB/s (memory-bound ops: inputs read once plus
# outputs written once) or GFLOP/s (GEMM) as a fraction of the ceiling measured at start: memory
# bandwidth from the median np.copyto of 256 MiB arrays (read + write bytes), peak fp32 GEMM from the
# best of several 2048^3 matmuls in numpy and in torch. A row faster than its ceiling (a small
# operand in cache beats main memory; an AMX bf16 GEMM beats fp32) is its own ceiling: the column
# never passes 100%. ranvier's time is data.compute() on inputs already in its instance; numpy and
# torch allocate their outputs, as their natural expressions do. ranvier's and torch's results are
# checked against numpy's before timing. Each op ends with how ranvier's median compares with
# numpy's and torch's.

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.special
import torch
import torch.nn.functional as F
from common import SETTLE_SECONDS, Ceilings, comparison, machine, measure_ceilings, time_in_turns

import ranvier as rv
from ranvier.backends.cpu.backend import bf16_gemm
from ranvier.backends.cpu.target import host_target
from ranvier.runtime import Cell

IMPLS = ("ranvier", "numpy", "torch")
SQRT1_2 = np.float32(1 / math.sqrt(2))


@dataclass
class Benchmark:
    """One op: a callable per implementation, how much work one call does, and the cell's kernels."""

    name: str
    runs: dict[str, Callable[[], object]]
    work: float  # bytes moved (memory-bound) or floating-point operations (GEMM)
    compute_bound: bool
    kernels: str
    rtol: float = 1e-4
    atol: float = 1e-5


BenchmarkAndResult = tuple[Benchmark, Callable[[], np.ndarray]]  # and a call giving ranvier's output


# ---- ranvier helpers ----------------------------------------------------------------------------


def compile_cell(flow: rv.Flow, matmul: str = "float32", denormals: str = "keep") -> tuple[Cell, str]:
    """Compile function f of the flow on the cpu backend; the cell and its steps' kernels."""
    cell = rv.Compiler("cpu", matmul=matmul, denormals=denormals).compile(flow).cell("f")
    kernels = " + ".join(s.label for s in cell.steps)
    return cell, kernels


def ranvier_run(
    cell: Cell, inputs: dict[rv.Tensor, np.ndarray], output: rv.Tensor
) -> tuple[Callable[[], np.ndarray], Callable[[], None]]:
    """An instance loaded with the inputs; a call that computes and returns the output, and one that only computes."""
    data = cell.instance()
    for var, value in inputs.items():
        data[var] = value

    def result() -> np.ndarray:
        data.compute()
        return data[output]

    return result, data.compute


# ---- benchmarks ---------------------------------------------------------------------------------


def bench_elementwise(rows: int, cols: int, rng: np.random.Generator) -> BenchmarkAndResult:
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    a, b, c = (rng.standard_normal(cols, dtype=np.float32) for _ in range(3))
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    vx = f.var("x", rv.DT_FLOAT, [rows, cols])
    va, vb, vc = (f.var(n, rv.DT_FLOAT, [cols]) for n in "abc")
    vy = f.add(f.mul(f.gelu(f.add(f.mul(vx, va), vb)), vc), vx, name="y")
    cell, kernels = compile_cell(flow)
    result, compute = ranvier_run(cell, {vx: x, va: a, vb: b, vc: c}, vy)

    def numpy_run() -> np.ndarray:
        t = x * a + b
        return 0.5 * t * (1 + scipy.special.erf(t * SQRT1_2)) * c + x

    tx, ta, tb, tc = (torch.from_numpy(v) for v in (x, a, b, c))
    return Benchmark(
        f"gelu(x*a+b)*c+x [{rows}x{cols}]",
        {"ranvier": compute, "numpy": numpy_run, "torch": lambda: F.gelu(tx * ta + tb) * tc + tx},
        work=2 * x.nbytes + 3 * a.nbytes,
        compute_bound=False,
        kernels=kernels,
    ), result


def bench_softmax(rows: int, cols: int, rng: np.random.Generator) -> BenchmarkAndResult:
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    vx = f.var("x", rv.DT_FLOAT, [rows, cols])
    vy = f.softmax(vx, name="y")
    cell, kernels = compile_cell(flow)
    result, compute = ranvier_run(cell, {vx: x}, vy)

    def numpy_run() -> np.ndarray:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    tx = torch.from_numpy(x)
    return Benchmark(
        f"softmax [{rows}x{cols}]",
        {"ranvier": compute, "numpy": numpy_run, "torch": lambda: F.softmax(tx, dim=-1)},
        work=2 * x.nbytes,
        compute_bound=False,
        kernels=kernels,
        atol=1e-7,
    ), result


def bench_layer_norm(rows: int, cols: int, rng: np.random.Generator) -> BenchmarkAndResult:
    eps = 1e-5
    x = rng.standard_normal((rows, cols), dtype=np.float32) * 3 + 1
    gamma, beta = (rng.standard_normal(cols, dtype=np.float32) for _ in range(2))
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    vx = f.var("x", rv.DT_FLOAT, [rows, cols])
    vg, vb = f.var("gamma", rv.DT_FLOAT, [cols]), f.var("beta", rv.DT_FLOAT, [cols])
    vy = f.layer_norm(vx, vg, vb, eps=eps, name="y")
    cell, kernels = compile_cell(flow)
    result, compute = ranvier_run(cell, {vx: x, vg: gamma, vb: beta}, vy)

    def numpy_run() -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        var = x.var(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * gamma + beta

    tx, tg, tb = (torch.from_numpy(v) for v in (x, gamma, beta))
    return Benchmark(
        f"layer_norm [{rows}x{cols}]",
        {"ranvier": compute, "numpy": numpy_run, "torch": lambda: F.layer_norm(tx, (cols,), tg, tb, eps)},
        work=2 * x.nbytes + gamma.nbytes + beta.nbytes,
        compute_bound=False,
        kernels=kernels,
        atol=1e-4,
    ), result


def bench_cross_entropy(rows: int, classes: int, rng: np.random.Generator) -> BenchmarkAndResult:
    logits = rng.standard_normal((rows, classes), dtype=np.float32) * 4
    target = rng.integers(0, classes, rows, dtype=np.int64)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    vl = f.var("logits", rv.DT_FLOAT, [rows, classes])
    vt = f.var("target", rv.DT_INT64, [rows])
    vy = f.softmax_cross_entropy(vl, vt, name="y")
    cell, kernels = compile_cell(flow)
    result, compute = ranvier_run(cell, {vl: logits, vt: target}, vy)
    row = np.arange(rows)

    def numpy_run() -> np.ndarray:
        top = logits.max(axis=-1)
        lse = np.log(np.exp(logits - top[:, None]).sum(axis=-1)) + top
        return lse - logits[row, target]

    tl, tt = torch.from_numpy(logits), torch.from_numpy(target)
    return Benchmark(
        f"softmax_xent [{rows}x{classes}]",
        {"ranvier": compute, "numpy": numpy_run, "torch": lambda: F.cross_entropy(tl, tt, reduction="none")},
        work=logits.nbytes + target.nbytes + rows * 4,
        compute_bound=False,
        kernels=kernels,
    ), result


def bench_adam_decayed(n: int, rng: np.random.Generator) -> BenchmarkAndResult:
    """Adam's update of an embedding table most of whose rows no batch used for long: their
    moments have decayed below 1e-38 (subnormal) and their gradient is 0; a tenth of the
    rows is live. ranvier compiled as its trainers compile (denormals flushed); numpy and
    PyTorch compute with the subnormals, as they do by default."""
    lr, beta1, beta2, eps = 1e-3, 0.9, 0.999, 1e-8
    live = rng.random(n) < 0.1
    w = rng.standard_normal(n, dtype=np.float32)
    g = np.where(live, rng.standard_normal(n), 0.0).astype(np.float32)
    m = (rng.standard_normal(n) * np.where(live, 1e-2, 1e-39)).astype(np.float32)
    v = (rng.random(n) * np.where(live, 1e-4, 1e-39)).astype(np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    vw, vg, vm, vv = (f.var(name, rv.DT_FLOAT, [n]) for name in "wgmv")
    m2, v2 = vm * beta1 + vg * (1 - beta1), vv * beta2 + vg * vg * (1 - beta2)
    vy = f.sub(vw, m2 * lr / (f.sqrt(v2) + eps), name="y")
    m2.var.out = v2.var.out = True
    cell, kernels = compile_cell(flow, denormals="flush")
    result, compute = ranvier_run(cell, {vw: w, vg: g, vm: m, vv: v}, vy)

    def numpy_run() -> np.ndarray:
        m2, v2 = m * np.float32(beta1) + g * np.float32(1 - beta1), v * np.float32(beta2) + g * g * np.float32(1 - beta2)
        return w - m2 * np.float32(lr) / (np.sqrt(v2) + np.float32(eps))

    tw, tg, tm, tv = (torch.from_numpy(x) for x in (w, g, m, v))

    def torch_run():
        m2, v2 = tm * beta1 + tg * (1 - beta1), torch.addcmul(tv * beta2, tg, tg, value=1 - beta2)
        return torch.addcdiv(tw, m2, v2.sqrt() + eps, value=-lr)

    return Benchmark(
        f"adam, moments decayed below 1e-38 [{n}]",
        {"ranvier": compute, "numpy": numpy_run, "torch": torch_run},
        work=7 * w.nbytes,
        compute_bound=False,
        kernels=kernels,
    ), result


def bench_gemm(m: int, k: int, n: int, rng: np.random.Generator, matmul: str = "float32") -> BenchmarkAndResult:
    """ranvier with float32 or mixed-precision (bf16 inputs, float32 sums) products;
    the peers stay float32, so the bf16 result is checked to bf16 rounding."""
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    va, vb = f.var("a", rv.DT_FLOAT, [m, k]), f.var("b", rv.DT_FLOAT, [k, n])
    vy = f.matmul(va, vb, name="y")
    cell, kernels = compile_cell(flow, matmul)
    result, compute = ranvier_run(cell, {va: a, vb: b}, vy)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return Benchmark(
        f"gemm [{m}x{k}]@[{k}x{n}]" + (" ranvier in bf16" if matmul == "bfloat16" else ""),
        {"ranvier": compute, "numpy": lambda: a @ b, "torch": lambda: torch.matmul(ta, tb)},
        work=2 * m * k * n,
        compute_bound=True,
        kernels=kernels,
        atol=1e-3 if matmul == "float32" else 0.02 * k**0.5,
    ), result


def _conv_windows(x: np.ndarray, size: int, padding: int) -> np.ndarray:
    """x [N, C, H, W] as its windows [N, C, H', W', size, size] (stride 1), a view."""
    padded = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    return np.lib.stride_tricks.sliding_window_view(padded, (size, size), axis=(2, 3))


def bench_conv(images: int, channels: int, side: int, filters: int, rng: np.random.Generator,
               filter_gradient: bool = False, size: int = 5) -> BenchmarkAndResult:
    """A `size` × `size` convolution of stride 1 and "same" padding (the MNIST CNN's 5 × 5),
    or its filter gradient: dw from the input and the output's gradient, as a training step
    computes it."""
    padding = size // 2
    x = rng.standard_normal((images, channels, side, side), dtype=np.float32)
    w = rng.standard_normal((filters, channels, size, size), dtype=np.float32)
    dy = rng.standard_normal((images, filters, side, side), dtype=np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    vx = f.var("x", rv.DT_FLOAT, list(x.shape))
    if filter_gradient:
        second, value = f.var("dy", rv.DT_FLOAT, list(dy.shape)), dy
        vy = f.op("Conv2DBackpropFilter", [vx, second],
                  attrs={"strides": [1, 1], "padding": [padding, padding], "filter_shape": list(w.shape)})
    else:
        second, value = f.var("w", rv.DT_FLOAT, list(w.shape)), w
        vy = f.conv2d(vx, second, padding=padding)
    vy.var.out = True
    cell, kernels = compile_cell(flow)
    result, compute = ranvier_run(cell, {vx: x, second: value}, vy)
    tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))
    if filter_gradient:
        runs = {"numpy": lambda: np.einsum("nchwij,nohw->ocij", _conv_windows(x, size, padding), dy, optimize=True),
                "torch": lambda: torch.nn.grad.conv2d_weight(tx, list(w.shape), tdy, padding=padding)}
        name = f"conv {size}x{size} filter gradient [{images}x{channels}x{side}x{side}] -> [{filters}x{channels}x{size}x{size}]"
    else:
        runs = {"numpy": lambda: np.einsum("nchwij,ocij->nohw", _conv_windows(x, size, padding), w, optimize=True),
                "torch": lambda: F.conv2d(tx, tw, padding=padding)}
        name = f"conv {size}x{size} [{images}x{channels}x{side}x{side}] * [{filters}x{channels}x{size}x{size}]"
    return Benchmark(
        name,
        {"ranvier": compute, **runs},
        work=2 * images * filters * side * side * channels * size * size,
        compute_bound=True,
        kernels=kernels,
        rtol=1e-3,
        atol=1e-2,
    ), result


# ---- running and reporting ----------------------------------------------------------------------


def verify(bench: Benchmark, ranvier_result: Callable[[], np.ndarray]) -> None:
    """ranvier's and torch's results must match numpy's, or the benchmark stops."""
    expected = np.asarray(bench.runs["numpy"]())
    checks = {"ranvier": np.array(ranvier_result()), "torch": bench.runs["torch"]().numpy()}
    for impl, actual in checks.items():
        message = f"{bench.name}: {impl} vs numpy"
        np.testing.assert_allclose(actual, expected, rtol=bench.rtol, atol=bench.atol, err_msg=message)


def report(bench: Benchmark, times: dict[str, list[float]], ceilings: Ceilings) -> list[str]:
    """Table rows: a heading with ranvier's kernels, then median, min, ratio, rate, fraction of
    ceiling, then how ranvier compares with each peer."""
    unit, ceiling = ("GFLOP/s", ceilings.gemm) if bench.compute_bound else ("GB/s", ceilings.bandwidth)
    medians = {impl: statistics.median(times[impl]) for impl in IMPLS}
    ceiling = max(ceiling, bench.work / min(medians.values()))
    lines = [f"{bench.name}    ranvier kernels: {bench.kernels}"]
    for impl, median in medians.items():
        rate = bench.work / median
        lines.append(
            f"  {impl:8s} {median * 1e3:9.3f} {min(times[impl]) * 1e3:9.3f} {median / medians['ranvier']:8.2f}x"
            f" {rate / 1e9:9.1f} {unit:8s} {100 * rate / ceiling:6.1f}%"
        )
    verdicts = (comparison("ranvier", medians["ranvier"], peer, medians[peer], higher_is_better=False) for peer in IMPLS[1:])
    lines.append("  " + ", ".join(verdicts).replace(", ranvier is", ",") + " (median time)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="rounds, each timing one call of every implementation (default 20; 5 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls, at the least, before each timed one (default 5; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes for a fast smoke run")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    rows = 512 if args.quick else 4096
    square = 256 if args.quick else 1024
    images = 16 if args.quick else 128
    rng = np.random.default_rng(0)

    print(machine(torch))
    print(
        f"numpy {np.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"ranvier backend cpu; {repeats} rounds, each implementation in turn timing one call after {warmup}+ "
        f"untimed ones and {SETTLE_SECONDS:g} s of them; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    ceilings = measure_ceilings(megabytes=256, gemm_n=2048, repeats=5 if args.quick else 10, torch=torch)
    print(
        f"ceilings: memory bandwidth {ceilings.bandwidth / 1e9:.1f} GB/s (median np.copyto of 256 MiB, read+write); "
        f"fp32 GEMM {ceilings.gemm / 1e9:.1f} GFLOP/s (best numpy or torch 2048^3 matmul); a row faster than its ceiling counts as its own ceiling"
    )
    print()
    print(f"  {'impl':8s} {'median ms':>9s} {'min ms':>9s} {'vs rv':>9s} {'rate':>9s} {'unit':8s} {'of ceil':>7s}")

    benchmarks = [
        lambda: bench_elementwise(rows, 1024, rng),
        lambda: bench_softmax(rows, 1024, rng),
        lambda: bench_layer_norm(rows, 1024, rng),
        lambda: bench_cross_entropy(rows, 1000, rng),
        lambda: bench_adam_decayed(rows * 1024, rng),
        lambda: bench_gemm(square, square, square, rng),
        lambda: bench_gemm(128, 784, 256, rng),
        lambda: bench_conv(images, 8, 14, 16, rng),
        lambda: bench_conv(images, 16, 14, 8, rng),
        lambda: bench_conv(images, 8, 14, 16, rng, filter_gradient=True),
        lambda: bench_conv(images, 1, 28, 8, rng, filter_gradient=True),
        lambda: bench_conv(images // 2, 16, 32, 16, rng, size=3),
    ]
    if bf16_gemm(host_target()):
        benchmarks += [lambda: bench_gemm(square, square, square, rng, "bfloat16"), lambda: bench_gemm(128, 784, 256, rng, "bfloat16")]
    for make in benchmarks:
        bench, ranvier_result = make()
        verify(bench, ranvier_result)
        times = time_in_turns(bench.runs, warmup, repeats)
        print("\n".join(report(bench, times, ceilings)), flush=True)
    print()
    print("vs rv = median time / ranvier's median time (above 1: ranvier is faster); of ceil = rate / ceiling")


if __name__ == "__main__":
    main()
