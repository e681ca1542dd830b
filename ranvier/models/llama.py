"""Llama-2 language models (llama2.c's architecture), built on the IR.

Token embedding → n_layers × [RMSNorm → attention with rotary embeddings (grouped /
multi-query when n_kv_heads < n_heads) → residual, RMSNorm → SwiGLU → residual] →
RMSNorm → output projection (shared with the embedding or separate).

Weights are stored [in, out] so a layer is `x @ W`; rotary embeddings rotate the
pairs (2i, 2i+1) of each head as llama2.c does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import RanvierError
from ..flow.builder import Builder, Tensor
from ..limits import check_allocation
from .module import Module


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    shared_classifier: bool = True

    def __post_init__(self):
        sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len")
        for field in sizes:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RanvierError(f"Llama config: {field} must be a positive integer, not {value!r}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise RanvierError(f"Llama config: norm_eps {self.norm_eps} and rope_theta {self.rope_theta} must be positive")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise RanvierError(
                f"Llama config: dim {self.dim} must divide into n_heads {self.n_heads}, "
                f"and n_heads into n_kv_heads {self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise RanvierError(f"Llama config: the head size {self.dim // self.n_heads} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_base(self) -> float:
        """The θ of the rotary frequencies θ^(−2i/head_dim)."""
        return self.rope_theta

    def attention_parameter_count(self) -> int:
        """One layer's attention projections and its two norms."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        return 2 * d + 2 * d * d + 2 * d * kv

    def outside_parameter_count(self) -> int:
        """The embedding, the final norm and (unless shared) the output projection."""
        return self.vocab_size * self.dim + self.dim + (0 if self.shared_classifier else self.dim * self.vocab_size)

    def parameter_count(self) -> int:
        swiglu = 3 * self.dim * self.hidden_dim
        return self.outside_parameter_count() + self.n_layers * (self.attention_parameter_count() + swiglu)

    def active_parameter_count(self) -> int:
        """The parameters each token passes through: all of a dense model's."""
        return self.parameter_count()

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward ≈ 3 × forward): 6 · active
        parameters plus attention."""
        return 6 * self.active_parameter_count() + 12 * self.n_layers * self.dim * seq_len


PRESETS = {
    # llama2.c's Stories models.
    "stories260K": LlamaConfig(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172, max_seq_len=512),
    "stories15M": LlamaConfig(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, hidden_dim=768, max_seq_len=256),
    "stories42M": LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=32000, hidden_dim=1376, max_seq_len=1024),
    "stories110M": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, hidden_dim=2048, max_seq_len=1024),
}


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of position × θ^(−2i/head_dim), shape [seq_len, head_dim/2]."""
    check_allocation(4 * seq_len * head_dim, f"rotary tables for {seq_len:,} positions of head size {head_dim}")
    frequencies = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq_len), frequencies)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class Llama(Module):
    name = "llama"
    sizes = ("dim", "n_layers", "hidden_dim", "vocab_size")  # the config's fields the parameter count grows with

    def __init__(self, config: LlamaConfig, seed: int = 0, allocate: bool = True):
        super().__init__(seed, allocate)
        self.config = config
        c = config
        self.reserve(c.parameter_count(), ", ".join(f"{field} {getattr(c, field)}" for field in self.sizes))
        kv = c.n_kv_heads * c.head_dim
        # llama2.c's initialization: N(0, 0.02), residual projections scaled by 1/√(2·layers).
        self.residual_std = 0.02 / math.sqrt(2 * c.n_layers)
        self.normal("tok_embeddings", (c.vocab_size, c.dim))
        for i in range(c.n_layers):
            self.ones(f"layers.{i}.attention_norm", (c.dim,))
            self.normal(f"layers.{i}.wq", (c.dim, c.dim))
            self.normal(f"layers.{i}.wk", (c.dim, kv))
            self.normal(f"layers.{i}.wv", (c.dim, kv))
            self.normal(f"layers.{i}.wo", (c.dim, c.dim), self.residual_std)
            self.ones(f"layers.{i}.ffn_norm", (c.dim,))
            self.feed_forward_parameters(i)
        self.ones("norm", (c.dim,))
        if not c.shared_classifier:
            self.normal("output", (c.dim, c.vocab_size))

    def feed_forward_parameters(self, i: int) -> None:
        """Layer i's SwiGLU weights (a MoE model puts its experts here)."""
        self.swiglu_parameters(f"layers.{i}.", self.config.hidden_dim)

    def swiglu_parameters(self, prefix: str, hidden: int, experts: tuple[int, ...] = ()) -> None:
        """w1, w2 and w3 of a SwiGLU of width `hidden` under `prefix`; `experts` stacks
        that many of them (a MoE layer's [E, ...] arrays)."""
        d = self.config.dim
        self.normal(prefix + "w1", (*experts, d, hidden))
        self.normal(prefix + "w2", (*experts, hidden, d), self.residual_std)
        self.normal(prefix + "w3", (*experts, d, hidden))

    def describe(self) -> dict:
        return {"model": "llama", **asdict(self.config)}

    def auxiliary_loss(self, b: Builder) -> Tensor | None:
        """Terms the layers add to the training loss in b's function: none in a dense model."""
        return None

    def expert_loads(self, b: Builder) -> list[Tensor]:
        """Tokens each expert received, per routed layer built in b's function: none here."""
        return []

    # ---- the forward pass ------------------------------------------------------------------

    def forward(self, b: Builder, tokens: Tensor, p) -> Tensor:
        """tokens [B, T] int32 → logits [B, T, vocab]."""
        x = self.embed(b, tokens, p)
        for i in range(self.config.n_layers):
            x = self.layer(b, x, self.layer_parameters(p, i))
        return self.head(b, x, p)

    # The three stages a CheckpointedStack compiles separately: the layers are identical,
    # so one compiled layer serves them all.

    @property
    def depth(self) -> int:
        return self.config.n_layers

    def embed(self, b: Builder, tokens: Tensor, p) -> Tensor:
        """tokens [B, T] int32 → the first layer's input [B, T, dim]."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise RanvierError(f"Llama: sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        return b.gather(p["tok_embeddings"], tokens)

    @staticmethod
    def layer_parameters(p, i: int) -> dict:
        """Layer i's parameters keyed without their "layers.i." prefix (wq, w1, ...)."""
        prefix = f"layers.{i}."
        return {key[len(prefix):]: value for key, value in p.items() if key.startswith(prefix)}

    def layer(self, b: Builder, x: Tensor, w: dict) -> Tensor:
        """One transformer block: x + attention(norm(x)), then + feed_forward(norm(·))."""
        c = self.config
        rope = self.rope(b, x.shape[1])
        x = x + self.attention(b, b.rms_norm(x, w["attention_norm"], c.norm_eps), w, rope)
        return x + self.feed_forward(b, b.rms_norm(x, w["ffn_norm"], c.norm_eps), w)

    def rope(self, b: Builder, seq: int) -> tuple[Tensor, Tensor]:
        """The rotary tables as constants of b's function, made once and shared by its layers."""
        tables = rope_tables(self.config.head_dim, seq, self.config.rope_base)
        result = []
        for part, table in zip(("cos", "sin"), tables):
            name = f"{b.func.name}/rope{seq}x{self.config.head_dim}.{part}"
            var = b.flow.vars.get(name)
            result.append(b.wrap(var) if var is not None else b.array(f"rope{seq}x{self.config.head_dim}.{part}", table))
        return result[0], result[1]

    def head(self, b: Builder, x: Tensor, p) -> Tensor:
        """The last layer's output → logits [B, T, vocab]."""
        x = b.rms_norm(x, p["norm"], self.config.norm_eps)
        if self.config.shared_classifier:
            return b.matmul(x, p["tok_embeddings"], transpose_b=True)
        return x @ p["output"]

    def attention(self, b: Builder, x: Tensor, w: dict, rope) -> Tensor:
        """Causal self-attention as one fused op (grouped when n_kv_heads < n_heads)."""
        c = self.config
        batch, seq, _ = x.shape
        hd = c.head_dim
        q = b.rotary((x @ w["wq"]).reshape([batch, seq, c.n_heads, hd]), *rope)
        k = b.rotary((x @ w["wk"]).reshape([batch, seq, c.n_kv_heads, hd]), *rope)
        v = (x @ w["wv"]).reshape([batch, seq, c.n_kv_heads, hd])
        out = b.attention(q, k, v, heads_first=False)  # [B, T, heads, hd], as the projections give them
        return out.reshape([batch, seq, c.dim]) @ w["wo"]

    def feed_forward(self, b: Builder, x: Tensor, w: dict) -> Tensor:
        return swiglu(b, x, w["w1"], w["w2"], w["w3"])


def swiglu(b: Builder, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """(silu(x W1) ⊙ x W3) W2."""
    return (b.silu(x @ w1) * (x @ w3)) @ w2

