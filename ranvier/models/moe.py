"""Mixture-of-experts transformers: a Llama whose feed-forward layers are routed experts.

Token embedding → n_layers × [RMSNorm → multi-query attention (one KV head by default)
with NTK-scaled rotary embeddings → residual, RMSNorm → MoE layer → residual] → RMSNorm
→ output projection.

A MoE layer sends each token through a softmax router to its top-k SwiGLU experts and
adds their outputs weighted by the router (the top-k probabilities, renormalized to sum
to one as Mixtral does): the tokens are sorted by expert and each expert runs one GEMM
over its own tokens (`GroupedMatMul`), so no work is done for experts a token was not
routed to. An optional shared expert sees every token; `moe_every` > 1 interleaves
dense SwiGLU layers.

The training loss adds, per MoE layer, α · E · Σᵢ fᵢ·Pᵢ (fᵢ the fraction of tokens routed
to expert i, Pᵢ its mean router probability; Switch and Mixtral's load balancing) and an
optional router z-loss β · mean(logsumexp(router logits)²). The model records them while
it builds a function: `auxiliary_loss(b)` is their sum for b's function, and
`expert_loads(b)` the per-layer token counts, for metrics.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import RanvierError
from ..flow.builder import Builder, Tensor
from ..flow.graph import Function
from .llama import Llama, LlamaConfig, swiglu


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama configuration plus the experts. `hidden_dim` is each expert's SwiGLU width."""

    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 1  # every n-th layer is MoE (1: all), the others dense SwiGLU of dense_hidden
    dense_hidden: int = 0  # 0: hidden_dim
    shared_hidden: int = 0  # a shared expert's width (0: none)
    rope_scaling: float = 1.0  # NTK-aware scaling of the rotary base, for contexts longer than trained
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    capacity_factor: float = 0.0  # in training, rows per expert = ceil(factor · tokens · k / E); 0: no limit
    normalize_top_k: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise RanvierError(f"MoE config: top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
        if self.moe_every < 1 or self.dense_hidden < 0 or self.shared_hidden < 0:
            raise RanvierError("MoE config: moe_every must be >= 1, dense_hidden and shared_hidden >= 0")
        if self.rope_scaling < 1.0 or self.aux_loss_weight < 0 or self.z_loss_weight < 0 or self.capacity_factor < 0:
            raise RanvierError("MoE config: rope_scaling must be >= 1; the loss weights and capacity_factor >= 0")

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    @property
    def rope_base(self) -> float:
        """NTK-aware scaling: θ · s^(d/(d−2)) stretches the low frequencies by s and keeps
        the highest, so a model reaches s times its trained context."""
        d = self.head_dim
        return self.rope_theta * self.rope_scaling ** (d / (d - 2))

    def counts(self) -> dict[str, int]:
        """Parameters in all and active per token (k of the E experts), from the shapes alone."""
        d = self.dim
        expert = 3 * d * self.hidden_dim
        moe_layers = self.n_layers // self.moe_every  # the layers is_moe picks, counted without a loop over them
        dense_layers = self.n_layers - moe_layers
        common = (self.outside_parameter_count() + self.n_layers * self.attention_parameter_count()
                  + dense_layers * 3 * d * (self.dense_hidden or self.hidden_dim)
                  + moe_layers * (d * self.n_experts + 3 * d * self.shared_hidden))
        return {
            "parameters": common + moe_layers * self.n_experts * expert,
            "active": common + moe_layers * self.top_k * expert,
            "experts": moe_layers * self.n_experts * expert,
        }

    def parameter_count(self) -> int:
        return self.counts()["parameters"]

    def active_parameter_count(self) -> int:
        return self.counts()["active"]

    def capacity(self, tokens: int) -> int:
        return 0 if not self.capacity_factor else math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)


PRESETS = {
    # Tests and quick runs: four layers of four experts, top-2, one KV head (stories260K-sized).
    "moe-tiny": MoEConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=1, vocab_size=512, hidden_dim=96, max_seq_len=512,
                          n_experts=4, top_k=2),
    # CPU training: a stories15M-sized trunk, 8 experts top-2 (about 15M active parameters).
    "moe-15M": MoEConfig(dim=288, n_layers=6, n_heads=6, n_kv_heads=1, vocab_size=4096, hidden_dim=512,
                         max_seq_len=256, n_experts=8, top_k=2),
    # The founding design: 32 blocks of hidden 768, 12 query heads of 64 and one KV head (MQA),
    # SwiGLU experts of 6144, top-4. Its 5.9B total and 1.8B active parameters name 13 experts
    # (the text's expert count is garbled): 13 × 32 × 3·768·6144 = 5.9B; 4 of them, 1.8B.
    "moe-5.9B": MoEConfig(dim=768, n_layers=32, n_heads=12, n_kv_heads=1, vocab_size=32000, hidden_dim=6144,
                          max_seq_len=4096, n_experts=13, top_k=4, shared_classifier=False),
}


class MoE(Llama):
    name = "moe"
    sizes = (*Llama.sizes, "n_experts")

    def __init__(self, config: MoEConfig, seed: int = 0, allocate: bool = True):
        self._aux: dict[Function, list[Tensor]] = {}
        self._loads: dict[Function, list[Tensor]] = {}
        super().__init__(config, seed, allocate)

    def feed_forward_parameters(self, i: int) -> None:
        c: MoEConfig = self.config
        prefix = f"layers.{i}."
        if not c.is_moe(i):
            self.swiglu_parameters(prefix, c.dense_hidden or c.hidden_dim)
            return
        self.normal(prefix + "router", (c.dim, c.n_experts))
        self.swiglu_parameters(prefix + "experts.", c.hidden_dim, (c.n_experts,))
        if c.shared_hidden:
            self.swiglu_parameters(prefix + "shared.", c.shared_hidden)

    def describe(self) -> dict:
        return {"model": "moe", **asdict(self.config)}

    def feed_forward(self, b: Builder, x: Tensor, w: dict) -> Tensor:
        return self.experts(b, x, w) if "router" in w else super().feed_forward(b, x, w)

    def experts(self, b: Builder, x: Tensor, w: dict) -> Tensor:
        """The MoE layer on x [B, T, dim]: route, run each expert on its tokens, combine."""
        c: MoEConfig = self.config
        shape = x.shape
        tokens = math.prod(shape[:-1])
        rows = x.reshape([tokens, c.dim])
        logits = rows @ w["router"]
        probs = logits.softmax()
        weights, choices = probs.top_k(c.top_k)
        if c.normalize_top_k:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        # Capacity is a training device (it bounds an expert's work per step); inference
        # routes every token.
        capacity = c.capacity(tokens) if b.func.training else 0
        order, slot, offsets, kept, counts = b.moe_route(choices, experts=c.n_experts, capacity=capacity)
        sorted_rows = rows.gather(order)
        gate = b.grouped_matmul(sorted_rows, w["experts.w1"], offsets)
        up = b.grouped_matmul(sorted_rows, w["experts.w3"], offsets)
        out = b.grouped_matmul(gate.silu() * up, w["experts.w2"], offsets)
        y = b.moe_combine(out, slot, kept.select(weights))
        if c.shared_hidden:
            y = y + swiglu(b, rows, w["shared.w1"], w["shared.w2"], w["shared.w3"])
        self._record(b, probs, counts, logits)
        return y.reshape(shape)

    def _record(self, b: Builder, probs: Tensor, counts: Tensor, logits: Tensor) -> None:
        c: MoEConfig = self.config
        terms = self._aux.setdefault(b.func, [])
        if c.aux_loss_weight:
            terms.append(b.load_balancing_loss(probs, counts) * c.aux_loss_weight)
        if c.z_loss_weight:
            peak = logits.max(axis=-1, keepdims=True)
            log_sum_exp = (logits - peak).exp().sum(axis=-1).log() + peak.reshape([logits.shape[0]])
            terms.append((log_sum_exp * log_sum_exp).mean() * c.z_loss_weight)
        self._loads.setdefault(b.func, []).append(counts)

    def auxiliary_loss(self, b: Builder) -> Tensor | None:
        """The sum of the auxiliary losses the MoE layers built in b's function (None if none)."""
        terms = self._aux.get(b.func, [])
        total = None
        for term in terms:
            total = term if total is None else total + term
        return total

    def expert_loads(self, b: Builder) -> list[Tensor]:
        """Tokens routed to each expert [E] (int32), per MoE layer built in b's function."""
        return list(self._loads.get(b.func, []))
