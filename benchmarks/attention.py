"""Attention forward and backward: ranvier's kernels vs PyTorch's scaled_dot_product_attention, same shapes, same run.

A Llama's attention: rows [B, T, heads, hd], causal, grouped key/value heads. ranvier's
Attention and AttentionGrad are two compiled cells, each timed by the backend's own clock
per step (the device's events on a GPU), its steps summed; PyTorch's SDPA forward and backward
(FlashAttention on a GPU, in bfloat16 as autocast runs it; float32 on the CPU) are timed
around a synchronize. On cuda two ranvier sides race: "cudnn", the steps cuDNN's fused
attention runs (the label says when the device's cuDNN refused them and the own kernels
ran instead), and "ranvier", the own tensor-core kernels (RANVIER_CUDNN=0 at their
compile); their operands are --dtype: bfloat16 on cuda by default (float32 operands with
--matmul bfloat16 run on the own kernels alone, cuDNN taking none), float32 on the CPU.
--key-blocks N adds a side "own/Nsm": the own kernels with the gradient's key launch bound
to N blocks a multiprocessor (RANVIER_ATTENTION_GRAD_BLOCKS_PER_SM=N: registers capped,
ptxas spilling the rest), a race of spills against occupancy.
ranvier's products run in --matmul: bfloat16 by default on cuda, float32 on the CPU.
Medians of --repeats rounds, each of --steps computes per side, alternating. FLOPs: the
causal half of 4·B·H·T²·hd forward and 2.5 times that backward (FlashAttention's own count).
Run: python benchmarks/attention.py [--backend cuda] [--batch 32] [--seq 1024] [--heads 12] [--kv-heads 12]
     [--head-size 64] [--repeats 5] [--steps 10] [--matmul float32|bfloat16] [--dtype float32|bfloat16]
     [--key-blocks N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np
from common import comparison, machine, match_threads, summary

import ranvier as rv

CUDNN = "RANVIER_CUDNN"  # "0": the own attention kernels
KEY_BLOCKS = "RANVIER_ATTENTION_GRAD_BLOCKS_PER_SM"  # the own gradient's key launch's blocks a multiprocessor


def ranvier_side(args, matmul: str, environment: dict[str, str] | None = None):
    """A function timing `steps` computes of each pass's cell: (forward, backward) seconds
    per compute, summed over the cell's steps; and the kernels each pass ran. A pass is a
    cell of its own, so it is timed whole whether the backend runs the op whole or
    decomposes it into products and a softmax. `environment`: settings the compile runs
    under (RANVIER_CUDNN=0: the own kernels)."""
    flow = rv.Flow()
    shapes = {"q": [args.batch, args.seq, args.heads, args.head_size], "k": [args.batch, args.seq, args.kv_heads, args.head_size],
              "v": [args.batch, args.seq, args.kv_heads, args.head_size], "dout": [args.batch, args.seq, args.heads, args.head_size]}
    passes = {"forward": "Attention", "backward": "AttentionGrad"}
    # The forward as training runs it, with its statistics, which the backward reads beside its output
    operands = {"forward": ("q", "k", "v"), "backward": ("q", "k", "v", "out", "statistics", "dout")}
    shapes |= {"out": shapes["q"], "statistics": [args.batch, args.heads, args.seq]}
    types = {"statistics": "float32"}
    for name, op_type in passes.items():
        f = rv.Builder(flow, name)
        attrs = {"heads_first": False, **({"statistics": True} if name == "forward" else {})}
        inputs = [f.var(t, types.get(t, args.dtype), shapes[t]) for t in operands[name]]
        for output in f.op(op_type, inputs, None, attrs):
            output.var.out = True
    asked = {name: os.environ.get(name) for name in (CUDNN, KEY_BLOCKS)}
    for name in asked:
        os.environ.pop(name, None)
    os.environ.update(environment or {})
    try:
        network = rv.Compiler(args.backend, matmul=matmul).compile(flow)
    finally:
        for name, value in asked.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    rng = np.random.default_rng(0)
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32
    values = {t: rng.standard_normal(shapes[t]).astype(dtype) for t in ("q", "k", "v", "dout")}
    instances, kernels = {}, []
    for name, op_type in passes.items():
        cell = network.cell(name)
        data = instances[name] = cell.instance()
        for t in operands[name]:
            data[f"{name}/{t}"] = values[t]
        data.compute()  # (a cuDNN step the device refused is labelled so once its instance is bound)
        if name == "forward":  # the backward's out and statistics: the forward's
            values["out"], values["statistics"] = (np.array(data[f"forward/Attention:{i}"]) for i in range(2))
        whole = [step.label for step in cell.steps if step.op.type == op_type]
        kernels.append(", ".join(whole) if whole else
                       f"{op_type} decomposed into {', '.join(sorted({step.kernel for step in cell.steps}))}")

    def run() -> tuple[float, float]:
        seconds = []
        for data in instances.values():
            data.reset_profile()
            for _ in range(args.steps):
                data.compute()
            seconds.append(data.profile().total)
        return seconds[0], seconds[1]

    return run, "; ".join(kernels)


def torch_side(args, torch, device: str):
    """The same for PyTorch's SDPA (bfloat16 on a GPU, float32 on the CPU)."""
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator(device="cpu").manual_seed(0)

    def tensor(heads: int, grad: bool):
        x = torch.randn(args.batch, heads, args.seq, args.head_size, generator=generator).to(device=device, dtype=dtype)
        return x.requires_grad_(grad)

    q, k, v = tensor(args.heads, True), tensor(args.kv_heads, True), tensor(args.kv_heads, True)
    dout = tensor(args.heads, False)
    gqa = args.kv_heads != args.heads

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def run() -> tuple[float, float]:
        forward = backward = 0.0
        for _ in range(args.steps):
            synchronize()
            start = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            synchronize()
            middle = time.perf_counter()
            out.backward(dout)
            synchronize()
            forward, backward = forward + middle - start, backward + time.perf_counter() - middle
            q.grad = k.grad = v.grad = None
        return forward / args.steps, backward / args.steps

    run()  # warm up
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--matmul", default=None, choices=["float32", "bfloat16"],
                        help="ranvier's products (default: bfloat16 on cuda, float32 on the CPU)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="ranvier's operands (default: bfloat16 on cuda, float32 on the CPU)")
    parser.add_argument("--key-blocks", type=int, default=None,
                        help="on cuda, also race the own kernels with the gradient's key launch bound to this many blocks "
                        "a multiprocessor")
    args = parser.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    args.dtype = args.dtype or ("bfloat16" if args.backend == "cuda" else "float32")
    import torch

    match_threads(torch)
    print(machine(torch))
    device = "cuda" if args.backend == "cuda" and torch.cuda.is_available() else "cpu"
    if args.backend == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}" if device == "cuda" else "GPU: none that PyTorch sees; its side runs on the CPU")
    matmul = args.matmul or ("bfloat16" if args.backend == "cuda" else "float32")
    sides, kernels = {}, {}
    if args.backend == "cuda":
        sides["cudnn"], kernels["cudnn"] = ranvier_side(args, matmul)
    sides["ranvier"], kernels["ranvier"] = ranvier_side(args, matmul, {CUDNN: "0"})
    bound = f"own/{args.key_blocks}sm" if args.key_blocks and args.backend == "cuda" else None
    if bound:
        sides[bound], kernels[bound] = ranvier_side(args, matmul, {CUDNN: "0", KEY_BLOCKS: str(args.key_blocks)})
    sides["pytorch"] = torch_side(args, torch, device)
    forward_flops = 2 * args.batch * args.heads * args.seq * args.seq * args.head_size  # the causal half of 4·B·H·T²·hd
    print(f"batch {args.batch} x seq {args.seq}, {args.heads} heads ({args.kv_heads} key/value) of {args.head_size}, causal; "
          f"ranvier ({args.backend}, {args.dtype} operands, {matmul} products): "
          f"{'; '.join(f'{side}: {ran}' for side, ran in kernels.items())}; pytorch: SDPA on {device} in "
          f"{'bfloat16' if device == 'cuda' else 'float32'}")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name, run in sides.items():
            times[name].append(run())
            forward, backward = times[name][-1]
            print(f"  run {repeat + 1} {name:8s} forward {forward * 1e3:9.3f} ms  backward {backward * 1e3:9.3f} ms", flush=True)
    medians, backwards = {}, {}
    for name, values in times.items():
        forward, backward = (statistics.median(v[i] for v in values) for i in range(2))
        medians[name], backwards[name] = (forward + backward) * 1e3, backward * 1e3
        print(f"{name:8s} forward {forward * 1e3:9.3f} ms ({forward_flops / forward / 1e12:6.2f} TFLOP/s), backward "
              f"{backward * 1e3:9.3f} ms ({2.5 * forward_flops / backward / 1e12:6.2f} TFLOP/s)")
    summary(medians, "ms", higher_is_better=False, digits=3)
    if bound:  # the bound key launch against the same kernels unbound: the backward is all it changes
        print(f"{comparison(bound, backwards[bound], 'ranvier', backwards['ranvier'], False)} (median ms of the backward)")


if __name__ == "__main__":
    main()
