"""Llama training throughput: ranvier vs PyTorch eager on the same model, same run.

The stories15M shape (dim 288, 6 layers, 6 heads, vocab 32000, hidden 768) at seq 256
by default; both sides train with AdamW on identical random token batches, alternating
for several repetitions, and the median tokens/s of each and the ratio are printed.
Where the CPU has AMX-BF16 or AVX512-BF16, ranvier also runs with mixed-precision matrix
products ("ranvier-bf16", compared with ranvier's float32 too). On
the CPU, PyTorch also trains through torch.compile (Inductor's C++ kernels; the
"torch.compile" side, its first step the compile: --no-torch-compile leaves it out), and
the instructions each side's libraries run are printed. Compile times are as the caches
find them; --cold-compile compiles both sides with nothing cached.

With --backend cuda, ranvier's CUDA backend races PyTorch eager under bf16 autocast on
the GPU (ranvier's products in bf16 too, unless --matmul says otherwise), and ranvier
runs twice: replaying each step as one CUDA graph, and launching kernel by kernel
(RANVIER_CUDA_GRAPHS=0: the "rv-no-graph" side), so the graph's saving shows. Where
PyTorch sees a GPU, PyTorch also runs through torch.compile there (bf16 autocast; without
a GPU, --torch-compile races it on the CPU: the host emulator's check). Each
side's model arithmetic is shown against the GPU's measured bf16 GEMM rate and, for GPUs
with a datasheet bf16 peak, as the MFU against that; the race ends with a `gpu-result` line
(tokens/s, ranvier's ratio to eager and to torch.compile, MFU) that .ci/gpu-check keeps. The
issue's shapes: --preset stories15M --batch 64 --seq 256, and --preset stories110M --batch 32
--seq 1024.
Run: python benchmarks/llama_train.py [--preset stories15M] [--batch 4] [--seq 256] [--steps 5] [--checkpointed]
     (a --seq past the preset's window lengthens its rotary tables: --batch 2 --seq 1024 races long-context attention)
     [--backend cuda] [--matmul float32|tfloat32|bfloat16] [--precision float32|bfloat16|float16]
     [--torch-compile | --no-torch-compile] [--cold-compile]
"""

from __future__ import annotations

import dataclasses

from common import (
    TORCH_COMPILE,
    WARM_CACHES,
    cold_caches,
    comparison,
    compile_options,
    datasheet_peak,
    gpu_race_end,
    gpu_sides,
    machine,
    match_threads,
    measure_ceilings,
    race,
    ranvier_trainer,
    slowest_steps,
    stepper,
    token_batches,
    torch_features,
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
    from ranvier.backends import MATMUL_PRECISIONS, PRECISIONS
    from ranvier.models.llama import PRESETS, Llama

    parser = training_arguments(__doc__.splitlines()[0], PRESETS, "stories15M")
    parser.add_argument("--checkpointed", action="store_true", help="ranvier trains through a CheckpointedStack")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--matmul", default=None, choices=MATMUL_PRECISIONS,
                        help="ranvier's matrix products (default: float32, and bfloat16 beside it on CPUs with AMX-BF16 "
                             "or AVX512-BF16, as with bfloat16; bfloat16 on cuda)")
    parser.add_argument("--precision", default="float32", choices=PRECISIONS,
                        help="with --backend cuda, what ranvier stores activations in (bfloat16, float16: half the "
                             "bytes, parameters and optimizer state still float32)")
    compile_options(parser, "on the CPU; with --backend cuda, where PyTorch sees a GPU")
    args = parser.parse_args()
    if args.precision != "float32" and (args.backend != "cuda" or args.checkpointed):
        parser.error(f"--precision {args.precision} is for --backend cuda, without --checkpointed")
    compile_times = cold_caches() if args.cold_compile else WARM_CACHES
    import torch

    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.target import host_target

    match_threads(torch)
    print(machine(torch))
    # a window past the preset's (long-context attention) only needs longer rotary tables
    config = dataclasses.replace(PRESETS[args.preset], max_seq_len=max(args.seq, PRESETS[args.preset].max_seq_len))
    batches = token_batches(config.vocab_size, args.batch, args.seq, args.steps)
    datasheet = None
    if args.backend == "cuda":
        first_trainer, sides, ceilings = gpu_sides(args, config, Llama(config, seed=0), dense_feed_forward(config), torch,
                                                   args.checkpointed)
        datasheet = datasheet_peak(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    else:
        torch_compile = args.torch_compile is not False
        print(torch_features(torch, torch_compile))
        print(compile_times)
        both = bf16_gemm(host_target()) and args.matmul in (None, "bfloat16")
        matmuls = ["float32", "bfloat16"] if both else [args.matmul or "float32"]
        trainers = [ranvier_trainer(Llama(config, seed=0), args.batch, args.seq, matmul, args.checkpointed) for matmul in matmuls]
        first_trainer = trainers[0]
        sides = {name: stepper(trainer) for name, trainer in zip(("ranvier", "ranvier-bf16"), trainers)}
        sides["pytorch"] = torch_trainer(config, args.batch, args.seq, *dense_feed_forward(config))
        if torch_compile:
            sides[TORCH_COMPILE] = torch_trainer(config, args.batch, args.seq, *dense_feed_forward(config), compiled=True)
        ceilings = measure_ceilings(megabytes=256, gemm_n=2048, repeats=3, torch=torch)
    print(f"{args.preset}: {config.parameter_count() / 1e6:.1f}M parameters, batch {args.batch} x seq {args.seq}, "
          f"{config.flops_per_token(args.seq) / 1e6:.0f} MFLOP per token")
    medians = race(sides, batches, args.repeats, config.vocab_size, config.flops_per_token(args.seq), ceilings, datasheet)
    if args.backend == "cuda":
        gpu_race_end(args.preset, medians, config.flops_per_token(args.seq), ceilings, datasheet, first_trainer, batches, torch)
    if "ranvier-bf16" in medians:
        print(f"{comparison('ranvier-bf16', medians['ranvier-bf16'], 'ranvier', medians['ranvier'], True)} (median tokens/s)")
    for trainer in trainers if args.backend == "cpu" else [first_trainer]:  # where each step spends its time
        profile = trainer.profile()
        print(profile.by_kernel())
        if profile.timed:
            print(slowest_steps(profile, ceilings))


if __name__ == "__main__":
    main()
