"""What the benchmarks share: the machine line printed beside every figure, the machine's
measured ceilings (fp32 GEMM and memory bandwidth) that say how far a figure is from
the limit, the summary every benchmark ends with (each side's median, then "ranvier is 2.30× faster than
pytorch"), the two sides of a language-model training race (ranvier's step and a PyTorch
eager one of the same trunk, with the caller's feed-forward layers) and the race itself
(alternating repetitions, medians, ratios against PyTorch)."""

from __future__ import annotations

import argparse
import atexit
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ranvier.modelrun import comparison  # one wording for every verdict, the CLI's too


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(torch=None) -> str:
    """CPU, the cores this process may use, the kernel variant ranvier generates (with what
    runs bf16 products: AMX tiles or AVX512-BF16 pairs) and, given the torch module, the
    threads PyTorch runs."""
    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.parallel import thread_count
    from ranvier.backends.cpu.target import host_target

    target = host_target()
    bf16 = bf16_gemm(target)
    variant = target.variant + (f"+{bf16}" if bf16 else "")
    line = f"CPU: {cpu_model()} ({target.name}), {thread_count()} cores, ranvier kernels [{variant}]"
    if torch is not None:
        line += f"; torch {torch.__version__} with {torch.get_num_threads()} threads"
    return line


def torch_features(torch, compiled: bool = False) -> str:
    """Which instructions each of PyTorch's CPU libraries runs here, in their own words:
    ATen's vectorized kernels (elementwise, SDPA), MKL (float32 matrix products: the build
    and the processors its code path is for, as MKL_VERBOSE names them), oneDNN
    (convolutions, bf16 products: its ISA, as ONEDNN_VERBOSE names it) and, where
    `compiled`, the vector ISA of Inductor's generated C++ (its products stay ATen's)."""
    probe = ("import torch\n"
             "a = torch.randn(64, 64)\n"
             "a @ a\n"  # MKL's sgemm
             "torch.nn.functional.linear(a.bfloat16(), a.bfloat16())\n")  # a oneDNN primitive
    verbose = {**os.environ, "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], check=False, env=verbose, capture_output=True, text=True, timeout=300).stdout
    mkl = re.search(r"^MKL_VERBOSE (oneMKL [^,]*?) Product build \d+ for Intel\(R\) 64 architecture (.*?), Lnx", out, re.MULTILINE)
    onednn = re.search(r"^onednn_verbose,.*,cpu,isa:(.*)$", out, re.MULTILINE)
    if mkl:
        products = f"{mkl[1]} (its path for {mkl[2]!r})"
    else:
        products = "MKL (it named no path)" if torch.backends.mkl.is_available() else "its BLAS (not MKL)"
    line = (f"PyTorch's CPU code: ATen kernels [{torch.backends.cpu.get_cpu_capability()}], products by {products}, "
            f"oneDNN [{onednn[1] if onednn else 'it named no ISA'}]")
    if compiled:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        line += f"; {TORCH_COMPILE}: Inductor's generated C++ [{pick_vec_isa() or 'no vector ISA'}], products by ATen's"
    return line


def cold_caches() -> str:
    """Point ranvier's code cache and Inductor's at empty folders for the rest of this
    process (removed at exit), so each side's first compile is a user's first run's:
    ranvier keeps what it measured of this machine (its GEMM choices, split thresholds),
    as a user's second model would. Call it before torch is imported. Returns the words
    the benchmark prints about its compile times."""
    from ranvier.backends.cache_folder import cache_dir

    folder = Path(tempfile.mkdtemp(prefix="cold-compile-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "ranvier").mkdir()
    for measured in cache_dir().glob("*.json"):
        shutil.copy(measured, folder / "ranvier")
    os.environ["RANVIER_CACHE"] = str(folder / "ranvier")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    return "compile times cold: nothing compiled was cached"


WARM_CACHES = "compile times with the caches as found (--cold-compile: a first run's)"


@dataclass
class Ceilings:
    bandwidth: float  # bytes per second
    gemm: float  # floating-point operations per second
    gemm_kind: str = "fp32 GEMM"
    gemm_source: str = "the best BLAS matmul"

    def __str__(self) -> str:
        return (f"ceilings measured here: {self.gemm_kind} {self.gemm / 1e9:,.0f} GFLOP/s ({self.gemm_source}), "
                f"memory {self.bandwidth / 1e9:,.1f} GB/s (a copy, read + write)")

    def against(self, flops: float, seconds: dict[str, float]) -> str:
        """These ceilings, and each side's rate doing `flops` in its `seconds`, as a share of the GEMM ceiling."""
        rates = [f"{name:12s} {flops / time / 1e9:9.1f} GFLOP/s, {flops / time / self.gemm:.0%} of the GEMM ceiling"
                 for name, time in seconds.items()]
        return "\n".join([str(self), *rates])


SETTLE_SECONDS = 0.15  # how long a turn runs untimed before its timed call


def time_in_turns(runs: dict[str, Callable[[], object]], warmup: int, repeats: int,
                  settle: float = SETTLE_SECONDS) -> dict[str, list[float]]:
    """Seconds per call of each callable, timed in turns: each of `repeats` rounds gives
    every callable a turn, the order rotating from round to round. A turn runs its callable
    back to back, untimed, for `settle` seconds and at least `warmup` calls, then times one
    call: the steady state a loop of such calls reaches, as in a training step.

    Timing each call right after another implementation's measured that implementation's
    thread pool instead: numpy's OpenBLAS and PyTorch's OpenMP threads keep spinning for up
    to ~0.1 s after their last call, and on a 2-core machine they took the cores a
    multithreaded kernel called next needed (ranvier's MNIST product ran 3-5× slower there
    than in a loop of its own calls).
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            run = runs[name]
            start, calls = time.perf_counter(), 0
            while calls < max(1, warmup) or time.perf_counter() - start < settle:
                run()
                calls += 1
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def measure_ceilings(megabytes: int, gemm_n: int, repeats: int, torch=None) -> Ceilings:
    """Memory bandwidth (median copy, read + write bytes) and peak fp32 GEMM (the best
    matmul of numpy's BLAS and, given the torch module, torch's, whichever is faster here)."""
    src = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copy = time_in_turns({"copy": lambda: np.copyto(dst, src)}, 2, repeats, settle=0)["copy"]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((gemm_n, gemm_n), dtype=np.float32)
    b = rng.standard_normal((gemm_n, gemm_n), dtype=np.float32)
    matmuls: dict[str, Callable[[], object]] = {"numpy": lambda: a @ b}
    if torch is not None:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        matmuls["torch"] = lambda: ta @ tb
    gemm = time_in_turns(matmuls, 2, repeats)
    return Ceilings(bandwidth=2 * src.nbytes / statistics.median(copy), gemm=2 * gemm_n**3 / min(map(min, gemm.values())))


def measure_gpu_ceilings(torch, n: int = 8192, repeats: int = 5) -> Ceilings:
    """The GPU's bf16 GEMM rate (PyTorch's n × n × n product: the peak an MFU is taken
    against) and its memory bandwidth (a device-to-device copy), each the best of `repeats`."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    source = torch.empty(1 << 28, device="cuda", dtype=torch.float32)
    target = torch.empty_like(source)

    def best(run) -> float:
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    gemm = 2 * n**3 / best(lambda: a @ b)
    bandwidth = 2 * source.numel() * 4 / best(lambda: target.copy_(source))
    return Ceilings(bandwidth, gemm, "bf16 GEMM", f"PyTorch's {n}³ product on {torch.cuda.get_device_name()}")


def summary(medians: dict[str, float], unit: str, higher_is_better: bool, peer: str = "pytorch", digits: int = 0) -> None:
    """Print each side's median, how each side other than `peer` compares with it, and
    how ranvier compares with torch.compile where that races too."""
    for name, value in medians.items():
        print(f"{name:12s} median {value:9.{digits}f} {unit}")
    for name, value in medians.items():
        if name != peer and peer in medians:
            print(f"{comparison(name, value, peer, medians[peer], higher_is_better)} (median {unit})")
    if TORCH_COMPILE in medians and "ranvier" in medians:
        print(f"{comparison('ranvier', medians['ranvier'], TORCH_COMPILE, medians[TORCH_COMPILE], higher_is_better)} "
              f"(median {unit})")


def training_arguments(description: str, presets, default: str) -> argparse.ArgumentParser:
    """The options every training benchmark takes: the model preset and the step's shape."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default=default, choices=sorted(presets))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def compile_options(parser: argparse.ArgumentParser, torch_compile_default: str = "on") -> None:
    """The options of a training race's compile: a torch.compile side, and cold caches."""
    parser.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                        help=f"race PyTorch through torch.compile (Inductor) too (default: {torch_compile_default})")
    parser.add_argument("--cold-compile", action="store_true",
                        help="compile each side with nothing cached, as a first run does (ranvier keeps what it "
                             "measured of the machine)")


def match_threads(torch) -> None:
    """PyTorch runs as many threads as ranvier splits its kernels into (the cores this
    process may use), so neither side gets more of the machine."""
    from ranvier.backends.cpu.parallel import thread_count

    torch.set_num_threads(thread_count())


Step = Callable[[np.ndarray, np.ndarray], float]


def ranvier_trainer(model, batch: int, seq: int, matmul: str = "float32", checkpointed: bool = False, backend: str = "cpu",
                    precision: str = "float32"):
    """ranvier's training step of a language model on [batch, seq] token windows: AdamW,
    clipping at 1, the model's auxiliary losses added; a Trainer, or a CheckpointedStack,
    on `backend`, its activations stored in `precision` (a Trainer's). Prints the compile
    time; returns the trainer (`trainer.step([x, y])`)."""
    import ranvier as rv
    from ranvier.train.losses import softmax_cross_entropy
    from ranvier.train.optimizers import AdamW
    from ranvier.train.options import TrainOptions
    from ranvier.train.trainer import Trainer

    vocab = model.config.vocab_size
    optimizer = AdamW(lr=1e-4, beta2=0.95, weight_decay=0.1, decay_matrices_only=True)
    options = TrainOptions(clip_norm=1.0, matmul=matmul, backend=backend, precision=precision)

    def lm_loss(b, logits, targets):
        return softmax_cross_entropy(logits.reshape([batch * seq, vocab]), targets.reshape([batch * seq]))

    start = time.perf_counter()
    if checkpointed:
        from ranvier.train.stack import CheckpointedStack

        window = ("int32", [batch, seq])
        trainer = CheckpointedStack(model, window, window, lm_loss, optimizer, options)
    else:
        flow = rv.Flow()
        f = rv.Builder(flow, "train")
        f.func.training = True
        tokens = f.var("tokens", rv.DT_INT32, [batch, seq])
        targets = f.var("targets", rv.DT_INT32, [batch, seq])
        params = model.parameters(f)
        loss = lm_loss(f, model(f, tokens, params), targets)
        aux = model.auxiliary_loss(f)
        if aux is not None:
            loss = loss + aux
        trainer = Trainer(loss, list(params.values()), optimizer, options, inputs=[tokens, targets])
    kind = f"{backend}, {matmul}" + (", checkpointed" if checkpointed else "") + (f", {precision} activations" if precision != "float32" else "")
    print(f"ranvier ({kind}) compiled the training step in {time.perf_counter() - start:.1f}s")
    return trainer


def stepper(trainer) -> Step:
    """A race side of a ranvier trainer."""
    return lambda x, y: trainer.step([x, y])


def torch_trainer(config, batch: int, seq: int, feed_forward_weights: Callable, feed_forward: Callable,
                  wrap: Callable | None = None, device: str = "cpu", bf16: bool = False, compiled: bool = False) -> Step:
    """PyTorch eager training of config's trunk as ranvier builds it (RMSNorm, rotary
    attention with grouped key/value heads through SDPA, the embedding as the head):
    AdamW (β2 0.95, weight decay 0.1), clipping at 1. Each layer's feed-forward is the
    caller's: `feed_forward_weights(weight)` makes its parameters (`weight(*shape)` draws
    N(0, 0.02²)), `feed_forward(x, p)` returns its output and an auxiliary loss.
    `wrap(module)`, given, returns the module the step calls instead (DistributedDataParallel).
    On `device` ("cuda": a GPU, where AdamW runs fused); `bf16`: the forward pass and loss
    under bf16 autocast; `compiled`: the model through torch.compile (the first step compiles it)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    d, hd = config.dim, config.dim // config.n_heads
    kv = config.n_kv_heads * hd

    def weight(*shape):
        return torch.nn.Parameter(torch.randn(*shape, device=device) * 0.02)

    def ones():
        return torch.nn.Parameter(torch.ones(d, device=device))

    params = torch.nn.ParameterDict({"emb": weight(config.vocab_size, d), "norm": ones()})
    for i in range(config.n_layers):
        layer = {"an": ones(), "wq": weight(d, d), "wk": weight(d, kv), "wv": weight(d, kv), "wo": weight(d, d), "fn": ones(),
                 **feed_forward_weights(weight)}
        params.update({f"{i}_{k}": v for k, v in layer.items()})
    freqs = config.rope_base ** (-torch.arange(0, hd, 2, device=device).float() / hd)
    angles = torch.outer(torch.arange(seq, device=device).float(), freqs)
    cos, sin = torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.norm_eps) * g

    def rope(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = params

        def forward(self, tokens):
            x = params["emb"][tokens]
            total_aux = 0.0
            for i in range(config.n_layers):
                p = {k.split("_", 1)[1]: v for k, v in params.items() if k.startswith(f"{i}_")}
                h = rms(x, p["an"])
                q = rope((h @ p["wq"]).view(batch, seq, config.n_heads, hd))
                k = rope((h @ p["wk"]).view(batch, seq, config.n_kv_heads, hd))
                v = (h @ p["wv"]).view(batch, seq, config.n_kv_heads, hd)
                groups = config.n_heads // config.n_kv_heads
                k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
                attention = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
                x = x + attention.transpose(1, 2).reshape(batch, seq, d) @ p["wo"]
                y, aux = feed_forward(rms(x, p["fn"]), p)
                x, total_aux = x + y, total_aux + aux
            return rms(x, params["norm"]) @ params["emb"].T, total_aux

    model = Model()
    module = wrap(model) if wrap is not None else model
    if compiled:
        module = torch.compile(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device == "cuda")

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits, aux = module(torch.from_numpy(x).to(device).long())
            loss = F.cross_entropy(logits.view(-1, config.vocab_size), torch.from_numpy(y).to(device).long().view(-1)) + aux
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    return step


def race(sides: dict[str, Step], batches: list[tuple[np.ndarray, np.ndarray]], repeats: int, vocab_size: int,
         flops_per_token: int, ceilings: Ceilings, datasheet: tuple[float, str] | None = None) -> dict[str, float]:
    """Train every side on the same token batches, the sides alternating each repetition
    (so the machine's slow and fast spells fall on all of them); print each side's first
    step (a torch.compile side compiles in it: where it cannot, one line says why and the
    side is left out), each run, the median tokens/s per side, the model arithmetic that
    rate does against the machine's GEMM ceiling (and against the `datasheet` peak,
    (FLOP/s, device), where given: the MFU), and how each side compares with "pytorch"
    (and ranvier with "torch.compile"). Returns the medians."""
    tokens = sum(x.size for x, _ in batches)
    sides = dict(sides)
    for name, step in list(sides.items()):
        start = time.perf_counter()
        if name == TORCH_COMPILE and not compiles(lambda step=step: step(*batches[0])):
            del sides[name]
            continue
        print(f"  first step {name:13s} {time.perf_counter() - start:9.2f} s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(repeats):
        for name, step in sides.items():
            start = time.perf_counter()
            losses = [step(x, y) for x, y in batches]
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"  run {repeat + 1} {name:13s} {rates[name][-1]:9.0f} tokens/s  loss {losses[-1]:.3f} "
                  f"(ln V = {math.log(vocab_size):.3f})", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    summary(medians, "tokens/s", higher_is_better=True)
    print(ceilings)
    for name, rate in medians.items():
        achieved = rate * flops_per_token
        mfu = f", MFU {achieved / datasheet[0]:.0%} of {datasheet[1]}" if datasheet else ""
        print(f"{name:13s} {achieved / 1e9:9.1f} GFLOP/s of model arithmetic "
              f"({flops_per_token / 1e6:,.1f} MFLOP per token), {achieved / ceilings.gemm:.0%} of the GEMM ceiling{mfu}")
    return medians


TORCH_COMPILE = "torch.compile"  # the race side of PyTorch through torch.compile


def gpu_sides(args, config, model, feed_forward: tuple[Callable, Callable], torch, checkpointed: bool = False):
    """ranvier training `model` on the CUDA backend (its products in `args.matmul`,
    bfloat16 by default; activations in `args.precision`), replaying graphs and launching
    kernel by kernel (the "rv-no-graph" side), and PyTorch eager with the
    `feed_forward` (weights, forward) layers, and through torch.compile (where asked, or by
    default where PyTorch sees a GPU), under bf16 autocast on the GPU (on the CPU in
    float32 where PyTorch sees no GPU, as with ranvier's host emulator: then only that the
    script runs is shown); the trainer, the sides and the GPU's ceilings."""
    from ranvier.backends.cuda.resident import GRAPHS_ENVIRONMENT

    on_gpu = torch.cuda.is_available()
    print(f"GPU: {torch.cuda.get_device_name()}" if on_gpu else "GPU: none that PyTorch sees; its side runs on the CPU")
    trainer = ranvier_trainer(model, args.batch, args.seq, args.matmul or "bfloat16", checkpointed, backend="cuda",
                              precision=args.precision)

    def without_graphs(x, y):
        os.environ[GRAPHS_ENVIRONMENT] = "0"
        try:
            return trainer.step([x, y])
        finally:
            del os.environ[GRAPHS_ENVIRONMENT]

    device = "cuda" if on_gpu else "cpu"
    sides = {"ranvier": stepper(trainer), "rv-no-graph": without_graphs,
             "pytorch": torch_trainer(config, args.batch, args.seq, *feed_forward, device=device, bf16=on_gpu)}
    if args.torch_compile if args.torch_compile is not None else on_gpu:
        sides[TORCH_COMPILE] = torch_trainer(config, args.batch, args.seq, *feed_forward, device=device, bf16=on_gpu,
                                             compiled=True)
    ceilings = measure_gpu_ceilings(torch) if on_gpu else measure_ceilings(megabytes=64, gemm_n=1024, repeats=3, torch=torch)
    return trainer, sides, ceilings


def gpu_race_end(model: str, medians: dict[str, float], flops_per_token: float, ceilings: Ceilings,
                 datasheet: tuple[float, str] | None, trainer, batches, torch) -> None:
    """After a GPU race: its `gpu-result` line, then the trainer's steps again, each timed
    (a GPU times each step only when asked, which costs: steps of their own, after the race)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "emulator"
    print(gpu_result(model, medians, flops_per_token, datasheet[0] if datasheet else ceilings.gemm, gpu), flush=True)
    trainer.reset_profile()
    for x, y in batches:
        trainer.step([x, y])


def compiles(first_call: Callable[[], object]) -> bool:
    """Make a torch.compile side's first call (its compile); False, with one line why,
    where Inductor cannot compile it here (no C++ compiler, an op it does not lower)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        first_call()
    except TorchDynamoException as error:
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        print(f"  {TORCH_COMPILE} left out: Inductor could not compile here ({reason.strip()})", flush=True)
        return False
    return True
# Dense bf16 tensor-core peaks from NVIDIA's datasheets, by the device name's words: what
# an MFU is quoted against (6N FLOP per token plus attention's).
DATASHEET_BF16 = {"H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12, "H200": 989.4e12, "H100 NVL": 835.5e12,
                  "H100 PCIe": 756.5e12, "A100": 312e12}


def datasheet_peak(device_name: str) -> tuple[float, str] | None:
    """(bf16 FLOP/s, which) of a GPU NVIDIA gives a dense bf16 peak for, else None."""
    for words, flops in DATASHEET_BF16.items():
        if words in device_name:
            return flops, f"{device_name}'s {flops / 1e12:,.0f} TFLOP/s datasheet bf16"
    return None


SLOWEST_STEPS = "the slowest steps of ranvier's step, timed by events:"  # heads the table .ci/gpu-report keeps


def slowest_steps(profile, ceilings: Ceilings, count: int = 15) -> str:
    """A markdown table of the `count` steps that take a profile's compute the most time:
    each one's kernel, achieved FLOP/s and bytes/s (its inputs and outputs, each once: the
    least it moves) against the measured ceilings."""
    from ranvier.profile import moved_bytes

    lines = [SLOWEST_STEPS, "", "| step | kernel | op | µs | share | GFLOP/s | of GEMM | GB/s | of copy |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    total = profile.total or 1e-30
    for step in sorted(profile.steps, key=lambda s: -s.seconds)[:count]:
        seconds = step.seconds or 1e-30
        flops, moved = step.flops / seconds, moved_bytes(step.op) / seconds
        lines.append(f"| {step.index} | {step.kernel} | {step.op.type} {step.op.name} | {step.seconds * 1e6:.1f} | "
                     f"{step.seconds / total:.1%} | {flops / 1e9:.1f} | {flops / ceilings.gemm:.1%} | {moved / 1e9:.1f} | "
                     f"{moved / ceilings.bandwidth:.1%} |")
    return "\n".join(lines)


def gpu_result(model: str, medians: dict[str, float], flops_per_token: float, peak: float, gpu: str) -> str:
    """The line a GPU race ends with, which .ci/gpu-check keeps: "gpu-result stories15M
    tokens/s=123456 vs-eager=1.23 vs-compile=0.87 mfu=31.2% gpu=H200" (ratios: ranvier's
    tokens/s over the peer's, n/a where it did not run; the MFU against `peak` FLOP/s)."""
    ours = medians["ranvier"]

    def versus(peer: str) -> str:
        return f"{ours / medians[peer]:.2f}" if peer in medians else "n/a"

    return (f"gpu-result {model} tokens/s={ours:.0f} vs-eager={versus('pytorch')} vs-compile={versus(TORCH_COMPILE)} "
            f"mfu={ours * flops_per_token / peak:.1%} gpu={gpu_label(gpu)}")


def gpu_label(gpu: str) -> str:
    """A GPU's name as a gpu-result line ends with it: "NVIDIA H100 80GB HBM3" as "H100-80GB-HBM3"."""
    return gpu.removeprefix("NVIDIA ").replace(" ", "-")


def token_batches(vocab_size: int, batch: int, seq: int, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` (tokens, targets) pairs of random token ids, identical for every side."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab_size, (batch, seq), dtype=np.int32), rng.integers(0, vocab_size, (batch, seq), dtype=np.int32))
            for _ in range(count)]
