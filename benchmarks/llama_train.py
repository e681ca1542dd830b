"""Llama training throughput: ranvier vs PyTorch CPU eager on the same model, same run.

The stories15M shape (dim 288, 6 layers, 6 heads, vocab 32000, hidden 768) at seq 256
by default; both sides train with AdamW on identical random token batches, alternating
for several repetitions, and the median tokens/s of each and the ratio are printed.
Where the CPU has AMX-BF16, ranvier also runs with mixed-precision matrix products.
Run: python benchmarks/llama_train.py [--preset stories15M] [--batch 4] [--seq 256] [--steps 5] [--checkpointed]
"""

from __future__ import annotations

import time

from common import machine, match_threads, race, token_batches, training_arguments


def ranvier_trainer(config, batch: int, seq: int, matmul: str = "float32", checkpointed: bool = False):
    import ranvier as rv
    from ranvier.models.llama import Llama
    from ranvier.train.losses import softmax_cross_entropy
    from ranvier.train.optimizers import AdamW
    from ranvier.train.trainer import Trainer

    model = Llama(config, seed=0)
    optimizer = AdamW(lr=1e-4, beta2=0.95, weight_decay=0.1, decay_matrices_only=True)

    def lm_loss(b, logits, targets):
        return softmax_cross_entropy(logits.reshape([batch * seq, config.vocab_size]), targets.reshape([batch * seq]))

    start = time.perf_counter()
    if checkpointed:
        from ranvier.train.stack import CheckpointedStack

        window = ("int32", [batch, seq])
        trainer = CheckpointedStack(model, window, window, lm_loss, optimizer, clip_norm=1.0, matmul=matmul)
    else:
        flow = rv.Flow()
        f = rv.Builder(flow, "train")
        tokens = f.var("tokens", rv.DT_INT32, [batch, seq])
        targets = f.var("targets", rv.DT_INT32, [batch, seq])
        params = model.parameters(f)
        loss = lm_loss(f, model(f, tokens, params), targets)
        trainer = Trainer(loss, list(params.values()), optimizer, clip_norm=1.0, inputs=[tokens, targets], matmul=matmul)
    kind = f"{matmul}, checkpointed" if checkpointed else matmul
    print(f"ranvier ({kind}) compiled the training step in {time.perf_counter() - start:.1f}s")
    return lambda x, y: trainer.step([x, y])


def torch_trainer(config, batch: int, seq: int):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    d, hd = config.dim, config.dim // config.n_heads
    kv = config.n_kv_heads * hd

    def linear(i, o):
        return torch.nn.Parameter(torch.randn(i, o) * 0.02)

    params = {"emb": linear(config.vocab_size, d), "norm": torch.nn.Parameter(torch.ones(d))}
    for i in range(config.n_layers):
        params.update({f"{i}.{k}": v for k, v in {
            "an": torch.nn.Parameter(torch.ones(d)), "wq": linear(d, d), "wk": linear(d, kv), "wv": linear(d, kv),
            "wo": linear(d, d), "fn": torch.nn.Parameter(torch.ones(d)), "w1": linear(d, config.hidden_dim),
            "w2": linear(config.hidden_dim, d), "w3": linear(d, config.hidden_dim)}.items()})
    freqs = config.rope_theta ** (-torch.arange(0, hd, 2).float() / hd)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    cos, sin = torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.norm_eps) * g

    def rope(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    def forward(tokens):
        x = params["emb"][tokens]
        for i in range(config.n_layers):
            p = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith(f"{i}.")}
            h = rms(x, p["an"])
            q = rope((h @ p["wq"]).view(batch, seq, config.n_heads, hd))
            k = rope((h @ p["wk"]).view(batch, seq, config.n_kv_heads, hd))
            v = (h @ p["wv"]).view(batch, seq, config.n_kv_heads, hd)
            groups = config.n_heads // config.n_kv_heads
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
            attention = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + attention.transpose(1, 2).reshape(batch, seq, d) @ p["wo"]
            h = rms(x, p["fn"])
            x = x + (F.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        return rms(x, params["norm"]) @ params["emb"].T

    optimizer = torch.optim.AdamW(params.values(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(torch.from_numpy(x).long()).view(-1, config.vocab_size), torch.from_numpy(y).long().view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        optimizer.step()
        return loss.item()

    return step


def main() -> None:
    from ranvier.models.llama import PRESETS

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
    sides = {"ranvier": ranvier_trainer(config, args.batch, args.seq, checkpointed=args.checkpointed)}
    if amx_usable(host_target()):
        sides["ranvier-bf16"] = ranvier_trainer(config, args.batch, args.seq, "bfloat16", args.checkpointed)
    sides["pytorch"] = torch_trainer(config, args.batch, args.seq)
    print(f"{args.preset}: {config.parameter_count() / 1e6:.1f}M parameters, batch {args.batch} x seq {args.seq}, "
          f"{config.flops_per_token(args.seq) / 1e6:.0f} MFLOP per token")
    race(sides, batches, args.repeats, config.vocab_size)


if __name__ == "__main__":
    main()
