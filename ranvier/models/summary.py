"""What a language-model preset amounts to, from its shapes alone: parameters (all and
active per token), training FLOPs per token, memory, and the size of its flow. No
weights are allocated, so the founding design's 5.9-billion-parameter MoE is summarized
in a moment on any machine."""

from __future__ import annotations

from ..flow.builder import Builder
from ..flow.graph import Flow
from . import LANGUAGE_MODELS, MoE, language_model


def find_preset(name: str):
    for family, (presets, _) in LANGUAGE_MODELS.items():
        if name in presets:
            return family, presets[name]
    known = ", ".join(name for presets, _ in LANGUAGE_MODELS.values() for name in presets)
    raise KeyError(f"unknown preset {name!r}; presets: {known}")


def _gigabytes(count: float) -> str:
    return f"{count / 1e9:,.2f} GB"


def summary(name: str, seq: int | None = None) -> str:
    family, config = find_preset(name)
    seq = seq or config.max_seq_len
    model = language_model(config, allocate=False)
    flow = Flow()
    b = Builder(flow, "forward")
    model(b, b.var("tokens", "int32", [1, seq]))
    parameters = model.parameter_count()
    active = config.active_parameter_count()
    kv_bytes = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 4
    lines = [
        f"{name}: {family}, {config.n_layers} layers, dim {config.dim}, {config.n_heads} query heads of "
        f"{config.head_dim} / {config.n_kv_heads} KV head{'s' if config.n_kv_heads > 1 else ''}, vocab {config.vocab_size}",
    ]
    if isinstance(model, MoE):
        lines.append(f"  experts            {config.n_experts} of hidden {config.hidden_dim}, top-{config.top_k}"
                     + (f", a shared expert of {config.shared_hidden}" if config.shared_hidden else "")
                     + (f", every {config.moe_every} layers" if config.moe_every > 1 else ""))
    lines += [
        f"  parameters         {parameters / 1e6:,.1f}M",
        f"  active per token   {active / 1e6:,.1f}M" + (f" ({active / parameters:.0%})" if active != parameters else ""),
        f"  training FLOPs     {config.flops_per_token(seq) / 1e9:,.2f} GFLOP per token at sequence {seq} "
        "(6 x active parameters + attention)",
        f"  weights            {_gigabytes(4 * parameters)} float32, {_gigabytes(2 * parameters)} bfloat16",
        f"  training state     {_gigabytes(16 * parameters)} (float32 weights, gradients, AdamW moments)",
        f"  KV cache           {kv_bytes / 1024:,.1f} KiB per token, {_gigabytes(kv_bytes * config.max_seq_len)} "
        f"for a {config.max_seq_len}-token context",
        f"  forward flow       {len(flow.ops)} ops, {len(flow.vars)} variables, built without weights",
    ]
    return "\n".join(lines)
