"""Mixture-of-experts training throughput: ranvier vs PyTorch CPU eager on the same model, same run.

The moe-15M shape (dim 288, 6 layers, 6 query heads and one KV head, 8 SwiGLU experts of
512, top-2, vocab 4096) at batch 4 x seq 256 by default. Both sides train with AdamW and
the load-balancing loss on identical random token batches, alternating for several
repetitions; the median tokens/s of each and the ratio are printed, with the share of
expert FLOPs a dense evaluation of every expert would spend and routing skips (1 - k/E).
PyTorch runs its experts as Mixtral's eager code does: a loop over experts, each on the
tokens routed to it (index_add back, weighted). Both spend the same matrix-product FLOPs,
so the share of ranvier's step in matrix products, and their rate, is printed too: the
ratio cannot exceed what the rest of PyTorch's step costs it over ranvier's.
Run: python benchmarks/moe_train.py [--preset moe-15M] [--batch 4] [--seq 256] [--steps 5] [--repeats 3]
"""

from __future__ import annotations

import time

from common import machine, match_threads, race, token_batches, training_arguments


def ranvier_trainer(config, batch: int, seq: int):
    import ranvier as rv
    from ranvier.models.moe import MoE
    from ranvier.train.losses import softmax_cross_entropy
    from ranvier.train.optimizers import AdamW
    from ranvier.train.trainer import Trainer

    model = MoE(config, seed=0)
    flow = rv.Flow()
    f = rv.Builder(flow, "train")
    f.func.training = True
    tokens = f.var("tokens", rv.DT_INT32, [batch, seq])
    targets = f.var("targets", rv.DT_INT32, [batch, seq])
    params = model.parameters(f)
    logits = model(f, tokens, params)
    loss = softmax_cross_entropy(logits.reshape([batch * seq, config.vocab_size]), targets.reshape([batch * seq]))
    loss = loss + model.auxiliary_loss(f)
    optimizer = AdamW(lr=1e-4, beta2=0.95, weight_decay=0.1, decay_matrices_only=True)
    start = time.perf_counter()
    trainer = Trainer(loss, list(params.values()), optimizer, clip_norm=1.0, inputs=[tokens, targets])
    print(f"ranvier compiled the training step in {time.perf_counter() - start:.1f}s")
    return trainer


def torch_trainer(config, batch: int, seq: int):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    d, hd, h = config.dim, config.dim // config.n_heads, config.hidden_dim
    kv, experts = config.n_kv_heads * hd, config.n_experts

    def weight(*shape):
        return torch.nn.Parameter(torch.randn(*shape) * 0.02)

    params = {"emb": weight(config.vocab_size, d), "norm": torch.nn.Parameter(torch.ones(d))}
    for i in range(config.n_layers):
        params.update({f"{i}.{k}": v for k, v in {
            "an": torch.nn.Parameter(torch.ones(d)), "wq": weight(d, d), "wk": weight(d, kv), "wv": weight(d, kv),
            "wo": weight(d, d), "fn": torch.nn.Parameter(torch.ones(d)), "router": weight(d, experts),
            "w1": weight(experts, d, h), "w2": weight(experts, h, d), "w3": weight(experts, d, h)}.items()})
    freqs = config.rope_base ** (-torch.arange(0, hd, 2).float() / hd)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    cos, sin = torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.norm_eps) * g

    def rope(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    def moe(x, p):
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

    def forward(tokens):
        x = params["emb"][tokens]
        total_aux = 0.0
        for i in range(config.n_layers):
            p = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith(f"{i}.")}
            a = rms(x, p["an"])
            q = rope((a @ p["wq"]).view(batch, seq, config.n_heads, hd))
            k = rope((a @ p["wk"]).view(batch, seq, config.n_kv_heads, hd))
            v = (a @ p["wv"]).view(batch, seq, config.n_kv_heads, hd)
            groups = config.n_heads // config.n_kv_heads
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
            attention = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + attention.transpose(1, 2).reshape(batch, seq, d) @ p["wo"]
            y, aux = moe(rms(x, p["fn"]), p)
            x, total_aux = x + y, total_aux + aux
        return rms(x, params["norm"]) @ params["emb"].T, total_aux

    optimizer = torch.optim.AdamW(params.values(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        logits, aux = forward(torch.from_numpy(x).long())
        loss = F.cross_entropy(logits.view(-1, config.vocab_size), torch.from_numpy(y).long().view(-1)) + aux
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        optimizer.step()
        return loss.item()

    return step


GEMMS = {"MatMul", "GroupedMatMul", "GroupedMatMulWeightGrad"}


def gemm_share(profile) -> str:
    """Where ranvier's step goes: matrix products (the same FLOPs PyTorch spends) and the rest."""
    gemm = [s for s in profile.steps if s.op.type in GEMMS]
    seconds = sum(s.seconds for s in gemm)
    rate = sum(s.flops for s in gemm) / seconds / 1e9 if seconds else 0.0
    return (f"ranvier's step: matrix products {seconds / profile.total:.0%} of its time at {rate:.0f} GFLOP/s, "
            f"everything else {(profile.total - seconds) * 1e3:.0f} ms")


def main() -> None:
    import torch

    from ranvier.models.moe import PRESETS

    parser = training_arguments(__doc__.splitlines()[0], PRESETS, "moe-15M")
    args = parser.parse_args()
    config = PRESETS[args.preset]
    match_threads(torch)
    print(machine(torch))
    counts = config.counts()
    skipped = counts["experts"] * (1 - config.top_k / config.n_experts)
    print(f"{args.preset}: {counts['parameters'] / 1e6:.1f}M parameters, {counts['active'] / 1e6:.1f}M active; "
          f"{config.n_experts} experts, top-{config.top_k}: routing skips {1 - config.top_k / config.n_experts:.0%} "
          f"of the expert FLOPs a dense evaluation would spend ({6 * skipped / 1e9:.3f} GFLOP per token of training)")
    trainer = ranvier_trainer(config, args.batch, args.seq)
    sides = {"ranvier": lambda x, y: trainer.step([x, y]), "pytorch": torch_trainer(config, args.batch, args.seq)}
    batches = token_batches(config.vocab_size, args.batch, args.seq, args.steps)
    trainer.step(list(batches[0]))
    trainer.data.reset_profile()  # warm steps only
    race(sides, batches, args.repeats, config.vocab_size)
    print(gemm_share(trainer.profile()))


if __name__ == "__main__":
    main()
