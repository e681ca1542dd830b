"""The stories110M training step's hottest GPU kernels, each alone, against PyTorch eager and torch.compile on the same GPU.

Each kernel kind of the bf16 step (.ci/cuda-step-floor stories110M bfloat16 lists them:
the products, the SwiGLU maps, RMSNorm forward and gradient, the AdamW update with
clipping, attention, rotary, the LM head's cross-entropy rows, alone and with the chunk's
products, the embedding's gather and scatter-add) is built as a flow of its own at the step's shapes (batch 32 x 1,024, dim
768, hidden 2,048, vocab 32,000, 12 heads; the cross-entropy over one of the LM head's
chunks of 4,160 rows), in the dtypes the step has them, so that the compiler makes the
step's kernel of it (the printed kernels say which). PyTorch computes the same on the
same GPU, in its own words (the formulas a PyTorch training step's autograd runs, SDPA,
fused AdamW), eagerly and through torch.compile.

Before anything is timed, each kernel's outputs at tiny shapes (--quick's) are compared
with ranvier's numpy reference, and so are PyTorch's; on a GPU ranvier's outputs at the
step's shapes are then compared with PyTorch eager's: a wrong kernel fails the benchmark
and is never timed. The inputs are the network's parameters, sent to the device once.
ranvier's time is its kernel's steps' own, by the device's events (the instance's
profile: no copies, no launch gaps); PyTorch's by CUDA events around
--calls back-to-back calls. Each side's median of --repeats rounds, the sides taking
turns. Per kernel it prints the time, the rate (GB/s for the memory-bound, the bytes each
step's inputs and outputs hold, each once: ranvier's cost model; TFLOP/s for the products
and attention, from the ops' own FLOP counts) as a share of the ceilings measured first
(a device-to-device copy, and the bf16 GEMM of ranvier's cuBLASLt product), and ranvier's
speed over each PyTorch side's (above 1: ranvier is faster). The table goes to
benchmarks/results/gpu/gpu-kernels.md (rewritten after each kernel, so that a run cut
short keeps what it measured), and each kernel ends with a `gpu-result kernel/NAME` line.

With --backend emulator every kernel runs on the CUDA backend's host emulator instead
(with --quick: the tiny shapes), checked against the reference the same way; PyTorch's
formulas are checked on the CPU, and its sides are not timed where it sees no GPU.
Run: python benchmarks/gpu_kernels.py [--kernels rmsnorm,adamw,...] [--repeats 5] [--calls 10] [--out FILE.md]
     python benchmarks/gpu_kernels.py --backend emulator --quick     (every kernel checked and run on this CPU)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import TORCH_COMPILE, Ceilings, compiles, gpu_label, machine, measure_ceilings, measure_gpu_ceilings

import ranvier as rv
from ranvier import dtypes
from ranvier.atomic import atomic_write
from ranvier.backends.cuda.code import CUDACode
from ranvier.backends.cuda.device import DEVICE_ENVIRONMENT, EMULATOR
from ranvier.errors import RanvierError
from ranvier.jobs.peak import measured_peak
from ranvier.ops import is_view
from ranvier.profile import moved_bytes
from ranvier.train.optimizers import AdamW
from ranvier.train.trainer import assign_all, step_updates

RESULTS = Path(__file__).resolve().parent / "results" / "gpu" / "gpu-kernels.md"
TABLE_HEADING = "the stories110M step's kernels alone, against PyTorch on the same GPU:"
EPS = 1e-5  # the Llama presets' norm_eps


@dataclass(frozen=True)
class Shapes:
    """A Llama training step's shapes: tokens [batch, seq], the residual stream's width,
    the feed-forward's, the vocabulary, attention heads, the LM head's chunk of rows, and
    the layers whose parameters the optimizer updates."""

    batch: int
    seq: int
    dim: int
    hidden: int
    vocab: int
    heads: int
    chunk: int
    layers: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_size(self) -> int:
        return self.dim // self.heads


STORIES110M = Shapes(batch=32, seq=1024, dim=768, hidden=2048, vocab=32000, heads=12, chunk=4160, layers=12)
TINY = Shapes(batch=2, seq=16, dim=64, hidden=96, vocab=300, heads=2, chunk=24, layers=1)  # --quick, and every check


@dataclass
class Case:
    """One kernel: its inputs, the flow that makes it (`build` adds its ops on the inputs'
    handles and returns its outputs), PyTorch's formula for the same outputs (`torch_fn`,
    on a dict of tensors), and whether its rate is FLOPs (a product) or bytes."""

    name: str
    title: str
    inputs: dict[str, np.ndarray]
    build: Callable[[rv.Builder, dict[str, rv.Tensor]], list[rv.Tensor]]
    torch_fn: Callable[[dict], tuple]
    compute_bound: bool = False
    tolerance: float = 2e-2
    torch_prepare: Callable[[dict], dict] | None = None  # the tensors made ready once (an optimizer's state)


# ---- the kernels ------------------------------------------------------------------------------


def _bf16(array: np.ndarray) -> np.ndarray:
    return array.astype(dtypes.to_numpy("bfloat16"))


RANDOM_BLOCK = 1_048_573  # a prime: a large input repeats a block of this many normals, unaligned to any row


def _normal(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """N(0, scale²) float32 values of `shape`; past a block's size, the block repeated
    (drawing the step's ~10⁹ normals took half a minute of the stage's budget)."""
    size = int(np.prod(shape))
    block = rng.standard_normal(min(size, RANDOM_BLOCK), dtype=np.float32) * np.float32(scale)
    return np.resize(block, size).reshape(shape)


def _flat_views(f: rv.Builder, inputs: dict[str, rv.Tensor], names: str, shape: list[int]) -> list[rv.Tensor]:
    """The named inputs reshaped, so that maps reading them read a value the function
    computes, as the step's maps read its products: the fuse pass then makes sibling maps
    one kernel, as it does in the step. (The reshapes of the network's parameters are
    copies; they are not the kernel, and not timed.)"""
    return [inputs[name].reshape(shape) for name in names.split()]


def products(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """The step's kinds of product: a feed-forward product, an attention projection (q, k
    and v are three such: its rate beside the feed-forward's wider one says what joining
    them into one product would gain), one adding the float32 residual stream in its
    epilogue, a weight's gradient (the activations transposed) and the LM head's chunk of
    logits (the table transposed)."""
    x, h = _bf16(_normal(rng, [s.tokens, s.dim])), _bf16(_normal(rng, [s.tokens, s.hidden]))
    w1, wo = _bf16(_normal(rng, [s.dim, s.hidden], 0.02)), _bf16(_normal(rng, [s.dim, s.dim], 0.02))
    residual = _normal(rng, [s.tokens, s.dim])
    table = _bf16(_normal(rng, [s.vocab, s.dim], 0.02))
    rows = _bf16(_normal(rng, [s.chunk, s.dim]))
    return [
        Case("matmul-w1", f"x W1 [{s.tokens}x{s.dim}]·[{s.dim}x{s.hidden}] bf16", {"x": x, "w1": w1},
             lambda f, v: [f.matmul(v["x"], v["w1"])], lambda t: (t["x"] @ t["w1"],), compute_bound=True),
        Case("matmul-q", f"x Wq [{s.tokens}x{s.dim}]·[{s.dim}x{s.dim}] bf16", {"x": x, "wq": wo},
             lambda f, v: [f.matmul(v["x"], v["wq"])], lambda t: (t["x"] @ t["wq"],), compute_bound=True),
        Case("matmul-residual", f"r + x Wo [{s.tokens}x{s.dim}]·[{s.dim}x{s.dim}] bf16, r fp32",
             {"x": x, "wo": wo, "residual": residual},
             lambda f, v: [v["residual"] + f.matmul(v["x"], v["wo"]).cast("float32")],
             lambda t: (t["residual"] + (t["x"] @ t["wo"]).float(),), compute_bound=True),
        Case("matmul-dw", f"dW2 = hᵀ dy [{s.hidden}x{s.tokens}]·[{s.tokens}x{s.dim}] bf16", {"h": h, "dy": x},
             lambda f, v: [f.matmul(v["h"], v["dy"], transpose_a=True)], lambda t: (t["h"].T @ t["dy"],),
             compute_bound=True, tolerance=5e-2),
        Case("lm-head", f"LM head chunk x Eᵀ [{s.chunk}x{s.dim}]·[{s.dim}x{s.vocab}] bf16", {"x": rows, "table": table},
             lambda f, v: [f.matmul(v["x"], v["table"], transpose_b=True)], lambda t: (t["x"] @ t["table"].T,),
             compute_bound=True),
    ]


def swiglu(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """silu(x W1) ⊙ x W3, and its gradient: d(x W1) and d(x W3) from the hidden's gradient, one map each."""
    shape = [s.batch, s.seq, s.hidden]
    a, b, dh = (_bf16(_normal(rng, [s.tokens * s.hidden], 2.0)) for _ in range(3))

    def forward(f, v):
        a, b = _flat_views(f, v, "a b", shape)
        return [f.silu(a) * b]

    def gradient(f, v):
        a, b, dh = _flat_views(f, v, "a b dh", shape)
        sigmoid = f.sigmoid(a)
        return [dh * b * (sigmoid * (1.0 + a * (1.0 - sigmoid))), dh * f.silu(a)]

    def torch_forward(t):
        import torch.nn.functional as F

        return (F.silu(t["a"]) * t["b"],)

    def torch_gradient(t):
        import torch

        a, b, dh = t["a"], t["b"], t["dh"]
        sigmoid = torch.sigmoid(a)
        return dh * b * (sigmoid * (1 + a * (1 - sigmoid))), dh * a * sigmoid

    return [
        Case("swiglu", f"SwiGLU silu(a)·b [{s.batch}x{s.seq}x{s.hidden}] bf16", {"a": a, "b": b}, forward, torch_forward),
        Case("swiglu-grad", f"SwiGLU gradient [{s.batch}x{s.seq}x{s.hidden}] bf16", {"a": a, "b": b, "dh": dh}, gradient,
             torch_gradient),
    ]


def _torch_rms(x, g):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g


def rms_norm(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """RMSNorm of the float32 residual stream into bf16, and its gradient with the
    residual's gradient added (float32, and in bf16 for the next product) and the gain's
    terms (dy · x̂, summed over rows later)."""
    shape = [s.batch, s.seq, s.dim]
    x, residual = _normal(rng, shape), _normal(rng, shape)
    gain, dy = 1.0 + _normal(rng, [s.dim], 0.1), _bf16(_normal(rng, shape))

    def forward(f, v):
        return [f.rms_norm(v["x"], v["gain"], eps=EPS).cast("bfloat16")]

    def gradient(f, v):
        dx, terms = f.op("RMSNormGrad", [v["x"], v["dy"], v["gain"]], None, {"eps": EPS})
        total = v["residual"] + dx
        return [total, total.cast("bfloat16"), terms]

    def torch_gradient(t):
        import torch

        x, dy, g = t["x"], t["dy"].float(), t["gain"]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        xhat, dxhat = x * rstd, dy * g
        total = t["residual"] + rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        return total, total.bfloat16(), dy * xhat

    return [
        Case("rmsnorm", f"RMSNorm [{s.batch}x{s.seq}x{s.dim}] fp32 -> bf16", {"x": x, "gain": gain}, forward,
             lambda t: (_torch_rms(t["x"], t["gain"]).bfloat16(),)),
        Case("rmsnorm-grad", f"RMSNorm gradient + residual [{s.batch}x{s.seq}x{s.dim}]",
             {"x": x, "dy": dy, "gain": gain, "residual": residual}, gradient, torch_gradient),
    ]


def rotary(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """q or k [B, T, heads, head size] in bf16, each pair of features turned by its position's angle."""
    x = _bf16(_normal(rng, [s.batch, s.seq, s.heads, s.head_size]))
    angles = np.outer(np.arange(s.seq), 10000.0 ** (-np.arange(0, s.head_size, 2) / s.head_size))
    cos, sin = _bf16(np.cos(angles)), _bf16(np.sin(angles))

    def torch_rotary(t):
        import torch

        x, cos, sin = t["x"], t["cos"][:, None, :], t["sin"][:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        return (torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2),)

    return [Case("rotary", f"rotary [{s.batch}x{s.seq}x{s.heads}x{s.head_size}] bf16", {"x": x, "cos": cos, "sin": sin},
                 lambda f, v: [f.op("Rotary", [v["x"], v["cos"], v["sin"]])], torch_rotary)]


def _torch_cross_entropy(logits, targets, scale):
    """The per-row loss of bf16 logits (in float32, as autocast computes it) and their
    gradient scaled by `scale`, in bf16."""
    import torch

    logits = logits.float()
    rows = torch.arange(logits.shape[0], device=logits.device)
    loss = torch.logsumexp(logits, -1) - logits[rows, targets.long()]
    grad = torch.softmax(logits, -1)
    grad[rows, targets.long()] -= 1
    return (grad * scale[:, None]).bfloat16(), loss


def cross_entropy(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """One of the LM head's chunks of rows: the bf16 logits' per-row loss and their
    gradient, scaled by the mean's 1/tokens, in one pass (the step's row kernel); and
    the whole chunk: its logits' product, that pass, and the products of the rows' and
    the table's gradients."""
    logits = _bf16(_normal(rng, [s.chunk, s.vocab], 2.0))
    rows, table = _bf16(_normal(rng, [s.chunk, s.dim])), _bf16(_normal(rng, [s.vocab, s.dim], 0.05))
    targets = rng.integers(0, s.vocab, s.chunk, dtype=np.int32)
    scale = np.full(s.chunk, 1.0 / s.tokens, np.float32)

    def pass_(f, v):
        grad, loss = f.op("SoftmaxCrossEntropyGrad", [v["logits"], v["targets"], v["scale"]], None, {"with_loss": True})
        return [grad, loss]

    def chunk(f, v):
        logits = f.matmul(v["x"], v["table"], transpose_b=True)
        grad, loss = f.op("SoftmaxCrossEntropyGrad", [logits, v["targets"], v["scale"]], None, {"with_loss": True})
        return [loss, f.matmul(grad, v["table"]), f.matmul(grad, v["x"], transpose_a=True)]

    def torch_chunk(t):
        grad, loss = _torch_cross_entropy(t["x"] @ t["table"].T, t["targets"], t["scale"])
        return loss, grad @ t["table"], grad.T @ t["x"]

    return [
        Case("cross-entropy", f"cross-entropy loss and gradient [{s.chunk}x{s.vocab}] bf16",
             {"logits": logits, "targets": targets, "scale": scale}, pass_,
             lambda t: _torch_cross_entropy(t["logits"], t["targets"], t["scale"]), tolerance=3e-2),
        Case("lm-head-loss", f"LM head chunk with its loss and gradients [{s.chunk}x{s.dim}]·[{s.dim}x{s.vocab}] bf16",
             {"x": rows, "table": table, "targets": targets, "scale": scale}, chunk, torch_chunk, compute_bound=True,
             tolerance=5e-2),
    ]


def embedding(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """The token embedding's gather (float32 table) and its gradient's scatter-add."""
    table = _normal(rng, [s.vocab, s.dim], 0.02)
    tokens = rng.integers(0, s.vocab, (s.batch, s.seq), dtype=np.int32)
    updates = _normal(rng, [s.batch, s.seq, s.dim])

    def torch_scatter(t):
        import torch

        total = torch.zeros(s.vocab, s.dim, device=t["updates"].device)
        return (total.index_add_(0, t["tokens"].long().flatten(), t["updates"].flatten(0, 1)),)

    return [
        Case("gather", f"embedding gather [{s.vocab}x{s.dim}] by [{s.batch}x{s.seq}] fp32", {"table": table, "tokens": tokens},
             lambda f, v: [f.gather(v["table"], v["tokens"])], lambda t: (t["table"][t["tokens"].long()],)),
        Case("scatter-add", f"embedding gradient scatter-add [{s.batch}x{s.seq}x{s.dim}] -> [{s.vocab}x{s.dim}] fp32",
             {"tokens": tokens, "updates": updates},
             lambda f, v: [f.scatter_add(v["tokens"], v["updates"], s.vocab)], torch_scatter, tolerance=1e-4),
    ]


def attention(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """Causal attention over [B, T, heads, head size] bf16 rows, forward; and forward with its
    gradient (each side's backward reads its forward's output and softmax statistics, so
    both sides run both passes)."""
    shape = [s.batch, s.seq, s.heads, s.head_size]
    q, k, v, dout = (_bf16(_normal(rng, shape)) for _ in range(4))
    flops_note = f"[{s.batch}x{s.seq}x{s.heads}x{s.head_size}] bf16, causal"

    def forward(f, t):
        return [f.attention(t["q"], t["k"], t["v"], heads_first=False)]

    def both(f, t):
        out, statistics = f.attention(t["q"], t["k"], t["v"], heads_first=False, statistics=True)
        dq, dk, dv = f.op("AttentionGrad", [t["q"], t["k"], t["v"], out, statistics, t["dout"]], None, {"heads_first": False})
        return [out, dq, dk, dv]

    def torch_forward(t):
        import torch.nn.functional as F

        q, k, v = (t[name].transpose(1, 2) for name in "qkv")
        return (F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2),)

    def torch_both(t):
        import torch

        q, k, v = (t[name].detach().requires_grad_() for name in "qkv")
        with torch.enable_grad():
            (out,) = torch_forward({"q": q, "k": k, "v": v})
            grads = torch.autograd.grad(out, (q, k, v), t["dout"])
        return (out.detach(), *grads)

    return [
        Case("attention", f"attention forward {flops_note}", {"q": q, "k": k, "v": v}, forward, torch_forward,
             compute_bound=True),
        Case("attention-grad", f"attention forward and gradient {flops_note}", {"q": q, "k": k, "v": v, "dout": dout}, both,
             torch_both, compute_bound=True, tolerance=5e-2),
    ]


def adamw(s: Shapes, rng: np.random.Generator) -> list[Case]:
    """The optimizer's step over every parameter of the model, as the step has it: the
    global gradient norm, clipping at 1, AdamW (β2 0.95, weight decay 0.1 on matrices),
    every write guarded by the gradients being finite. PyTorch's: clip_grad_norm_ and
    AdamW fused into one kernel on a GPU, as its training step runs them."""
    shapes = {"tok_embeddings": [s.vocab, s.dim], "norm": [s.dim]}
    for layer in range(s.layers):
        shapes |= {f"{layer}.{name}": [s.dim, s.dim] for name in ("wq", "wk", "wv", "wo")}
        shapes |= {f"{layer}.w1": [s.dim, s.hidden], f"{layer}.w3": [s.dim, s.hidden], f"{layer}.w2": [s.hidden, s.dim],
                   f"{layer}.attention_norm": [s.dim], f"{layer}.ffn_norm": [s.dim]}
    inputs = {name: _normal(rng, shape, 0.02) for name, shape in shapes.items()}
    inputs |= {f"{name}.grad": _normal(rng, shape, 1e-3) for name, shape in shapes.items()} | {"lr": np.array(1e-4, np.float32)}
    elements = sum(int(np.prod(shape)) for shape in shapes.values())

    def build(f, v):
        params = [v[name] for name in shapes]
        optimizer = AdamW(lr=1e-4, beta2=0.95, weight_decay=0.1, decay_matrices_only=True)
        updates = step_updates(f, params, [v[f"{name}.grad"] for name in shapes], optimizer, v["lr"], None, None, clip_norm=1.0)
        assign_all(f, updates.updates)
        return params

    def prepare(t):
        import torch

        params = [torch.nn.Parameter(t[name]) for name in shapes]
        for param, name in zip(params, shapes):
            param.grad = t[f"{name}.grad"]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=params[0].is_cuda)
        return {"params": params, "optimizer": optimizer}

    def torch_fn(t):
        import torch

        torch.nn.utils.clip_grad_norm_(t["params"], 1.0)
        t["optimizer"].step()
        return tuple(p.detach() for p in t["params"])

    return [Case("adamw", f"AdamW with clipping, {len(shapes)} tensors, {elements / 1e6:.1f}M fp32 parameters", inputs, build,
                 torch_fn, tolerance=1e-5, torch_prepare=prepare)]


# the kernels and the family that makes each, in the order of the step's floor (.ci/cuda-step-floor):
# the most time first, so that a run cut short has measured those
KERNELS: dict[str, Callable[[Shapes, np.random.Generator], list[Case]]] = {
    "matmul-w1": products, "matmul-dw": products, "lm-head": products, "matmul-residual": products, "swiglu-grad": swiglu,
    "swiglu": swiglu, "rmsnorm-grad": rms_norm, "adamw": adamw, "attention-grad": attention, "rotary": rotary,
    "cross-entropy": cross_entropy, "lm-head-loss": cross_entropy, "rmsnorm": rms_norm, "attention": attention,
    "gather": embedding, "scatter-add": embedding, "matmul-q": products}


def cases(shapes: Shapes, names: list[str]) -> Iterator[Case]:
    """The named kernels' cases in turn, a family's inputs made when its first is asked for."""
    made: dict[str, Case] = {}
    for name in names:
        if name not in made:
            made |= {case.name: case for case in KERNELS[name](shapes, np.random.default_rng(0))}
        yield made.pop(name)


# ---- ranvier's side ---------------------------------------------------------------------------


@dataclass
class Compiled:
    """A case's flow compiled for the CUDA backend, its instance loaded with the inputs."""

    data: rv.Instance
    outputs: list[rv.Tensor]
    steps: list[int]  # the steps timed: those that launch kernels, but for views (an input's reshape)
    kernels: str  # their kernels
    work: float  # their FLOPs (a product) or bytes moved, by ranvier's cost model, per compute


def compile_case(case: Case, backend: str) -> Compiled:
    """The case's flow on `backend` ("cuda" or "reference"). Its inputs are the network's
    parameters: on a device they are sent before the first compute and stay there, so a
    compute moves nothing (a cell's inputs would be copied in every time)."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    outputs = case.build(f, {name: f.parameter(name, value) for name, value in case.inputs.items()})
    for output in outputs:
        if not output.var.is_global:
            output.var.out = True
    cell = rv.Compiler(backend, matmul="bfloat16").compile(flow).cell("f")
    data = cell.instance()
    if backend != "cuda":
        return Compiled(data, outputs, [], "", 0.0)
    timed = [index for index, step in enumerate(cell.steps) if CUDACode.of(cell).kernels[index] and not is_view(step.op)]
    work = sum(cell.steps[i].flops if case.compute_bound else moved_bytes(cell.steps[i].op) for i in timed)
    kernels = " + ".join(dict.fromkeys(f"{cell.steps[i].kernel.split('[')[0]} ({cell.steps[i].op.type})" for i in timed))
    return Compiled(data, outputs, timed, kernels, float(work))


def values(compiled: Compiled) -> list[np.ndarray]:
    """The outputs after a compute, as float64 (a parameter's from the network)."""
    data = compiled.data
    return [np.asarray(data.cell.network[o.name] if o.var.is_global else data[o], np.float64) for o in compiled.outputs]


def ranvier_timer(compiled: Compiled, calls: int) -> Callable[[], float]:
    """A round of `calls` computes, timed by the backend's clock on the kernel's steps alone
    (events on a GPU): seconds per compute."""
    data = compiled.data

    def run() -> float:
        data.reset_profile()
        for _ in range(calls):
            data.compute()
        steps = data.profile().steps
        return sum(steps[index].seconds for index in compiled.steps)

    return run


# ---- PyTorch's side ---------------------------------------------------------------------------


def torch_inputs(case: Case, torch, device: str) -> dict:
    """The case's inputs as PyTorch tensors on `device`, bf16 kept bf16, made ready by the
    case's `torch_prepare` (an optimizer and its state)."""
    def tensor(value: np.ndarray):
        if value.dtype == dtypes.to_numpy("bfloat16"):
            return torch.from_numpy(value.astype(np.float32)).to(device).bfloat16()
        return torch.from_numpy(value.copy()).to(device)

    tensors = {name: tensor(value) for name, value in case.inputs.items()}
    return case.torch_prepare(tensors) if case.torch_prepare else tensors


def as_float64(tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy().astype(np.float64)


# ---- the check before timing ------------------------------------------------------------------


def check(case: Case, torch, device: str | None) -> None:
    """ranvier's outputs on the CUDA backend, and PyTorch's formula's on `device` (None:
    not checked), against the numpy reference (`agree`)."""
    ours, reference = compile_case(case, "cuda"), compile_case(case, "reference")
    ours.data.compute()
    reference.data.compute()
    wanted = values(reference)
    agree(case, "ranvier's", ours.outputs, values(ours), wanted, "the numpy reference")
    if device is not None:
        theirs = [as_float64(t) for t in case.torch_fn(torch_inputs(case, torch, device))]
        agree(case, "pytorch's", ours.outputs, theirs, wanted, "the numpy reference")


def agree(case: Case, side: str, outputs: list[rv.Tensor], got: list[np.ndarray], wanted: list[np.ndarray],
          other: str) -> None:
    """Raise naming the kernel and the output where `got` differs from `wanted` by more than
    the case's tolerance (relative to each value plus the output's largest), or where it
    holds a non-finite value: an element left unwritten (the emulator's fresh memory is NaN)."""
    for output, actual, expected in zip(outputs, got, wanted, strict=True):
        actual = actual.reshape(expected.shape)  # a pass may have folded an output's view away
        scale = float(np.abs(expected).max()) or 1.0
        error = np.abs(actual - expected)
        if not np.isfinite(actual).all() or (error > case.tolerance * (np.abs(expected) + scale)).any():
            worst = float(np.nanmax(error)) if np.isfinite(actual).any() else float("nan")
            raise RanvierError(f"{case.name}: {side} {output.name.split('/')[-1]} {list(actual.shape)} differs from {other} "
                               f"(largest difference {worst:.3g}, largest value {scale:.3g}, non-finite "
                               f"{int((~np.isfinite(actual)).sum())}): a wrong kernel is not timed")


# ---- the race -----------------------------------------------------------------------------------


def race(case: Case, compiled: Compiled, torch, on_gpu: bool, repeats: int, calls: int) -> dict[str, float]:
    """Seconds per call of each side, the median of `repeats` rounds in which the sides
    take turns (each round `calls` calls); PyTorch's sides only on a GPU, where ranvier's
    outputs are first checked against PyTorch eager's at these shapes."""
    sides: dict[str, Callable[[], float]] = {"ranvier": ranvier_timer(compiled, calls)}
    if on_gpu:
        tensors = torch_inputs(case, torch, "cuda")
        # at the timed shapes, where the reference would take too long, ranvier's first
        # compute against PyTorch eager's first call (checked against the reference above)
        compiled.data.compute()
        agree(case, "ranvier's", compiled.outputs, values(compiled), [as_float64(t) for t in case.torch_fn(tensors)],
              "PyTorch eager's at the timed shapes")
        timed = event_timer(torch)
        sides["pytorch"] = lambda: timed(lambda: case.torch_fn(tensors), calls)
        compiled_fn = torch.compile(case.torch_fn)
        start = time.perf_counter()
        if compiles(lambda: compiled_fn(tensors)):
            print(f"{case.name}: {TORCH_COMPILE} compiled PyTorch's side in {time.perf_counter() - start:.1f} s", flush=True)
            sides[TORCH_COMPILE] = lambda: timed(lambda: compiled_fn(tensors), calls)
    for run in sides.values():  # a first round untimed: graphs captured, caches warm
        run()
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            times[name].append(sides[name]())
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def event_timer(torch) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of `calls` back-to-back calls, by CUDA events around them."""
    def timed(run: Callable[[], object], calls: int) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            run()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / calls

    return timed


# ---- the report ---------------------------------------------------------------------------------


@dataclass
class Row:
    case: Case
    kernels: str
    work: float
    seconds: dict[str, float]

    def rate(self, side: str) -> float:
        return self.work / self.seconds[side]

    def versus(self, peer: str) -> str:
        """ranvier's speed over the peer's (above 1: ranvier is faster), n/a where the peer did not run."""
        return f"{self.seconds[peer] / self.seconds['ranvier']:.2f}" if peer in self.seconds else "n/a"


def rate_text(rate: float, compute_bound: bool) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if compute_bound else f"{rate / 1e9:,.0f} GB/s"


def ceiling_of(case: Case, ceilings: Ceilings) -> float:
    return ceilings.gemm if case.compute_bound else ceilings.bandwidth


def printed(row: Row, ceilings: Ceilings) -> list[str]:
    """A kernel's lines: each side's time and rate against the ceiling, the verdicts."""
    ceiling = ceiling_of(row.case, ceilings)
    lines = [f"{row.case.title}    ranvier kernels: {row.kernels}"]
    for side, seconds in row.seconds.items():
        verdict = "" if side == "ranvier" else f"   ranvier {row.versus(side)}× its speed"
        lines.append(f"  {side:14s} {seconds * 1e6:10.1f} µs {rate_text(row.rate(side), row.case.compute_bound):>14s} "
                     f"{row.rate(side) / ceiling:6.1%} of the {'GEMM' if row.case.compute_bound else 'copy'} ceiling{verdict}")
    return lines


def gpu_result(row: Row, ceilings: Ceilings, gpu: str) -> str:
    """The kernel's line for .ci/gpu-check, in the form of issue 52's: "gpu-result
    kernel/rmsnorm us=41.2 GB/s=3391 roofline=78.9% vs-eager=1.85 vs-compile=1.02 gpu=H200"."""
    unit, scale = ("TFLOP/s", 1e12) if row.case.compute_bound else ("GB/s", 1e9)
    return (f"gpu-result kernel/{row.case.name} us={row.seconds['ranvier'] * 1e6:.1f} {unit}={row.rate('ranvier') / scale:.0f} "
            f"roofline={row.rate('ranvier') / ceiling_of(row.case, ceilings):.1%} vs-eager={row.versus('pytorch')} "
            f"vs-compile={row.versus(TORCH_COMPILE)} gpu={gpu_label(gpu)}")


def markdown(heading: list[str], rows: list[Row], ceilings: Ceilings, gpu: str) -> str:
    def microseconds(row: Row, side: str) -> str:
        return f"{row.seconds[side] * 1e6:.1f}" if side in row.seconds else "-"

    lines = ["# GPU kernels of a stories110M training step against PyTorch", "",
             "Written by `benchmarks/gpu_kernels.py` (`.ci/gpu-check`'s kernel-race stage).", "",
             *(f"- {line}" for line in heading), "", TABLE_HEADING, "",
             "| kernel | ranvier's kernels | ranvier µs | rate | of ceiling | eager µs | vs eager | compiled µs | vs compile |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row.case.title} | {row.kernels} | {microseconds(row, 'ranvier')} | "
                     f"{rate_text(row.rate('ranvier'), row.case.compute_bound)} | "
                     f"{row.rate('ranvier') / ceiling_of(row.case, ceilings):.1%} | {microseconds(row, 'pytorch')} | "
                     f"{row.versus('pytorch')} | {microseconds(row, TORCH_COMPILE)} | {row.versus(TORCH_COMPILE)} |")
    lines += ["", "vs eager, vs compile: ranvier's speed over PyTorch's (above 1: ranvier is faster).", "", "```",
              *(gpu_result(row, ceilings, gpu) for row in rows), "```", ""]
    return "\n".join(lines)


# ---- the machine and its ceilings -------------------------------------------------------------------


def gpu_line(torch, emulated: bool) -> tuple[str, str]:
    """The line naming the GPU, its driver and CUDA versions and PyTorch's; and the GPU's short name."""
    if emulated:
        return ("GPU: none: ranvier's kernels run on the CUDA backend's host emulator (this CPU); PyTorch's sides are "
                "checked on the CPU and not timed"), "emulator"
    from ranvier.backends.cuda.driver import DRIVER_LIBRARY, find_device

    device = find_device()
    version = ctypes.c_int()
    ctypes.CDLL(DRIVER_LIBRARY).cuDriverGetVersion(ctypes.byref(version))
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], check=True,
                                capture_output=True, text=True, timeout=60).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        driver = "its version unread (no nvidia-smi)"
    seen = f"built for CUDA {torch.version.cuda}" if torch.cuda.is_available() else "sees no CUDA device: its sides are not run"
    return (f"GPU: {device}, driver {driver} (CUDA {version.value // 1000}.{version.value % 1000 // 10}); "
            f"torch {torch.__version__} {seen}"), device.name


def gpu_ceilings(torch, on_gpu: bool) -> tuple[Ceilings, str]:
    """The copy bandwidth (a device-to-device copy on a GPU; the host's on the emulator) and
    the bf16 GEMM rate of ranvier's own cuBLASLt product (the products' ceiling); and a
    line with PyTorch's GEMM rate beside it, where it has a GPU."""
    gflops, what = measured_peak("cuda", "bfloat16")
    if on_gpu:
        measured = measure_gpu_ceilings(torch)
        aside = f"PyTorch's bf16 GEMM here: {measured.gemm / 1e12:,.0f} TFLOP/s ({measured.gemm_source})"
    else:
        measured = measure_ceilings(megabytes=64, gemm_n=256, repeats=3)
        aside = "PyTorch's GEMM not measured: no GPU"
    return Ceilings(measured.bandwidth, gflops * 1e9, "bf16 GEMM", f"ranvier's cuBLASLt product, {what}"), aside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=["cuda", EMULATOR],
                        help="where ranvier's kernels run: the GPU, or the CUDA backend's host emulator")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the checks'), for a smoke run")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"which, in order (default all: {','.join(KERNELS)})")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, each side timed once a round (median)")
    parser.add_argument("--calls", type=int, default=10, help="calls timed together in a round")
    parser.add_argument("--out", type=Path, default=None,
                        help="the markdown table (default on a GPU: benchmarks/results/gpu/gpu-kernels.md; on the "
                             "emulator none)")
    args = parser.parse_args()
    names = [name.strip() for name in args.kernels.split(",") if name.strip()]
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        parser.error(f"no kernel {', '.join(unknown)}: the kernels are {', '.join(KERNELS)}")
    emulated = args.backend == EMULATOR
    if emulated:
        os.environ[DEVICE_ENVIRONMENT] = EMULATOR
    out = args.out if args.out is not None or emulated else RESULTS
    import torch

    on_gpu = not emulated and torch.cuda.is_available()
    heading = [machine(torch)]
    try:
        line, gpu = gpu_line(torch, emulated)
        heading.append(line)
        ceilings, aside = gpu_ceilings(torch, on_gpu)
    except RanvierError as error:
        sys.exit(f"gpu_kernels: {error}")
    shapes = TINY if args.quick else STORIES110M
    heading += [str(ceilings), aside,
                f"shapes: batch {shapes.batch} x {shapes.seq}, dim {shapes.dim}, hidden {shapes.hidden}, vocab {shapes.vocab}, "
                f"{shapes.heads} heads, the LM head in chunks of {shapes.chunk} rows; each side's median of {args.repeats} "
                f"rounds of {args.calls} calls, by {'CUDA events' if not emulated else 'the host clock'}"]
    print("\n".join(heading), flush=True)
    if not on_gpu:
        print(f"PyTorch eager and {TORCH_COMPILE}: not timed, {'on the emulator' if emulated else 'PyTorch sees no CUDA device'}")
    checked_on = "cuda" if on_gpu else "cpu"
    rows: list[Row] = []
    for case, tiny in zip(cases(shapes, names), cases(TINY, names)):
        try:
            check(tiny, torch, checked_on)
        except RanvierError as error:
            sys.exit(f"gpu_kernels: {error}")
        compiled = compile_case(case, "cuda")
        try:
            seconds = race(case, compiled, torch, on_gpu, args.repeats, args.calls)
        except RanvierError as error:
            sys.exit(f"gpu_kernels: {error}")
        row = Row(case, compiled.kernels, compiled.work, seconds)
        rows.append(row)
        print("\n".join(printed(row, ceilings)), flush=True)
        print(gpu_result(row, ceilings, gpu), flush=True)
        if out is not None:
            text = markdown(heading, rows, ceilings, gpu)
            atomic_write(out, lambda file, text=text: file.write(text.encode()))
        del compiled
        if on_gpu:
            torch.cuda.empty_cache()
    if out is not None:
        print(f"the table: {out}")


if __name__ == "__main__":
    main()
