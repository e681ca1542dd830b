"""Llama training throughput: ranvier vs PyTorch CPU eager on the same model, same run.

The stories15M shape (dim 288, 6 layers, 6 heads, vocab 32000, hidden 768) at seq 256
by default; both sides train with AdamW on identical random token batches, alternating
for several repetitions, and the median tokens/s of each and the ratio are printed.
Where the CPU has AMX-BF16, ranvier also runs with mixed-precision matrix products.
Run: python benchmarks/llama_train.py [--preset stories15M] [--batch 4] [--seq 256] [--steps 5] [--checkpointed]
"""

from __future__ import annotations

from common import (
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


def dense_feed_forward(config):
    """PyTorch's side of a dense layer: its weights, and (silu(x W1) ⊙ x W3) W2 with no
    auxiliary loss."""
    import torch.nn.functional as F

    d, h = config.dim, config.hidden_dim

    def weights(weight):
        return {"w1": weight(d, h), "w2": weight(h, d), "w3": weight(d, h)}

    def forward(x, p):
        return (F.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"], 0.0

    return weights, forward


def main() -> None:
    from ranvier.models.llama import PRESETS, Llama

    parser = training_arguments(__doc__.splitlines()[0], PRESETS, "stories15M")
    parser.add_argument("--checkpointed", action="store_true", help="ranvier trains through a CheckpointedStack")
    args = parser.parse_args()
    import torch

    from ranvier.backends.cpu.amx import amx_usable
    from ranvier.backends.cpu.target import host_target

    match_threads(torch)
    print(machine(torch))
    config = PRESETS[args.preset]
    batches = token_batches(config.vocab_size, args.batch, args.seq, args.steps)
    matmuls = ["float32", "bfloat16"] if amx_usable(host_target()) else ["float32"]
    sides = {name: stepper(ranvier_trainer(Llama(config, seed=0), args.batch, args.seq, matmul, args.checkpointed))
             for name, matmul in zip(("ranvier", "ranvier-bf16"), matmuls)}
    sides["pytorch"] = torch_trainer(config, args.batch, args.seq, *dense_feed_forward(config))
    print(f"{args.preset}: {config.parameter_count() / 1e6:.1f}M parameters, batch {args.batch} x seq {args.seq}, "
          f"{config.flops_per_token(args.seq) / 1e6:.0f} MFLOP per token")
    ceilings = measure_ceilings(megabytes=256, gemm_n=2048, repeats=3, torch=torch)
    race(sides, batches, args.repeats, config.vocab_size, config.flops_per_token(args.seq), ceilings)


if __name__ == "__main__":
    main()
