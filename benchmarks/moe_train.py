"""Mixture-of-experts training throughput: ranvier vs PyTorch eager on the same model, same run.

The moe-15M shape (dim 288, 6 layers, 6 query heads and one KV head, 8 SwiGLU experts of
512, top-2, vocab 4096) at batch 4 x seq 256 by default. Both sides train with AdamW and
the load-balancing loss on identical random token batches, alternating for several
repetitions; the median tokens/s of each and the ratio are printed, with the share of
expert FLOPs a dense evaluation of every expert would spend and routing skips (1 - k/E).
PyTorch runs its experts as Mixtral's eager code does: a loop over experts, each on the
tokens routed to it (index_add back, weighted). Both spend the same matrix-product FLOPs,
so the share of ranvier's step in matrix products, and their rate, is printed too: the
ratio cannot exceed what the rest of PyTorch's step costs it over ranvier's.
With --backend cuda, ranvier's CUDA backend (its products in bf16 unless --matmul says
otherwise: the grouped expert products on tensor cores) races PyTorch eager under bf16
autocast on the same GPU, ranvier replaying each step as one CUDA graph and launching
kernel by kernel ("rv-no-graph"), as benchmarks/llama_train.py does; the race ends with a
`gpu-result` line (the issue's target: moe-15M at 1.5× PyTorch eager bf16) and ranvier's
step by kernel. Without a GPU it runs on the host emulator (PyTorch's side on the CPU):
only that the script runs is shown.
Run: python benchmarks/moe_train.py [--preset moe-15M] [--batch 4] [--seq 256] [--steps 5] [--repeats 3]
     [--backend cuda] [--matmul float32|tfloat32|bfloat16] [--precision float32|bfloat16|float16]
     [--torch-compile | --no-torch-compile]
"""

from __future__ import annotations

from common import (
    compile_options,
    datasheet_peak,
    gpu_race_end,
    gpu_sides,
    machine,
    match_threads,
    measure_ceilings,
    race,
    ranvier_trainer,
    stepper,
    token_batches,
    torch_trainer,
    training_arguments,
)


def mixtral_feed_forward(config):
    """PyTorch's side of a MoE layer, as Mixtral's eager code runs it: the router's
    softmax and top-k (renormalized), then a loop over the experts, each on the tokens
    routed to it, added back weighted (index_add); the load-balancing loss beside it."""
    import torch
    import torch.nn.functional as F

    d, h, experts = config.dim, config.hidden_dim, config.n_experts

    def weights(weight):
        return {"router": weight(d, experts), "w1": weight(experts, d, h), "w2": weight(experts, h, d),
                "w3": weight(experts, d, h)}

    def forward(x, p):
        rows = x.reshape(-1, d)
        probs = F.softmax(rows @ p["router"], dim=-1)
        weights, choices = torch.topk(probs, config.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(rows)
        for e in range(experts):
            token, slot = torch.where(choices == e)
            if token.numel():
                chosen = rows[token]
                y = (F.silu(chosen @ p["w1"][e]) * (chosen @ p["w3"][e])) @ p["w2"][e]
                out = out.index_add(0, token, y * weights[token, slot, None])
        counts = torch.bincount(choices.reshape(-1), minlength=experts).to(rows.dtype)
        aux = config.aux_loss_weight * experts * (counts / rows.shape[0] * probs.mean(0)).sum()
        return out.view_as(x), aux

    return weights, forward


GEMMS = {"MatMul", "MatMulCalculate", "GroupedMatMul", "GroupedMatMulWeightGrad"}  # a product with its epilogue counts as one


def gemm_share(profile) -> str:
    """Where ranvier's step goes: matrix products (the same FLOPs PyTorch spends) and the rest."""
    gemm = [s for s in profile.steps if s.op.type in GEMMS]
    seconds = sum(s.seconds for s in gemm)
    rate = sum(s.flops for s in gemm) / seconds / 1e9 if seconds else 0.0
    return (f"ranvier's step: matrix products {seconds / profile.total:.0%} of its time at {rate:.0f} GFLOP/s, "
            f"everything else {(profile.total - seconds) * 1e3:.0f} ms")


def main() -> None:
    from ranvier.backends import MATMUL_PRECISIONS, PRECISIONS
    from ranvier.models.moe import PRESETS, MoE

    parser = training_arguments(__doc__.splitlines()[0], PRESETS, "moe-15M")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--matmul", default=None, choices=MATMUL_PRECISIONS,
                        help="with --backend cuda, ranvier's matrix products (default bfloat16)")
    parser.add_argument("--precision", default="float32", choices=PRECISIONS,
                        help="with --backend cuda, what ranvier stores activations in")
    compile_options(parser, "with --backend cuda, where PyTorch sees a GPU")
    args = parser.parse_args()
    if args.backend != "cuda" and (args.matmul or args.precision != "float32" or args.torch_compile):
        parser.error("--matmul, --precision and --torch-compile are for --backend cuda")
    import torch

    config = PRESETS[args.preset]
    match_threads(torch)
    print(machine(torch))
    counts = config.counts()
    skipped = counts["experts"] * (1 - config.top_k / config.n_experts)
    print(f"{args.preset}: {counts['parameters'] / 1e6:.1f}M parameters, {counts['active'] / 1e6:.1f}M active; "
          f"{config.n_experts} experts, top-{config.top_k}: routing skips {1 - config.top_k / config.n_experts:.0%} "
          f"of the expert FLOPs a dense evaluation would spend ({6 * skipped / 1e9:.3f} GFLOP per token of training)")
    batches = token_batches(config.vocab_size, args.batch, args.seq, args.steps)
    flops = config.flops_per_token(args.seq)
    if args.backend == "cuda":
        trainer, sides, ceilings = gpu_sides(args, config, MoE(config, seed=0), mixtral_feed_forward(config), torch)
        datasheet = datasheet_peak(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
        medians = race(sides, batches, args.repeats, config.vocab_size, flops, ceilings, datasheet)
        gpu_race_end(args.preset, medians, flops, ceilings, datasheet, trainer, batches, torch)
        print(trainer.profile().by_kernel())
    else:
        trainer = ranvier_trainer(MoE(config, seed=0), args.batch, args.seq)
        sides = {"ranvier": stepper(trainer), "pytorch": torch_trainer(config, args.batch, args.seq, *mixtral_feed_forward(config))}
        trainer.step(list(batches[0]))
        trainer.data.reset_profile()  # warm steps only
        ceilings = measure_ceilings(megabytes=256, gemm_n=2048, repeats=3, torch=torch)
        race(sides, batches, args.repeats, config.vocab_size, flops, ceilings)
    print(gemm_share(trainer.profile()))


if __name__ == "__main__":
    main()
