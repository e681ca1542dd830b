"""Text generation with a KV cache: a compiled prefill cell and a compiled decode cell.

Both cells run the same chunk computation — T new tokens at positions pos..pos+T−1 —
for T = the prefill width and T = 1. Each layer's keys and values live in resident
caches [kv_heads, max_seq, head_dim]. A chunk attends to the cached rows before pos
and, causally, to its own new keys and values (CachedAttention, which reads only those
pos rows: a step early in a long context reads little of its caches); then only its T
rows are written into the caches in place (AssignSlice), so a decode step costs O(1)
cache writes, not a copy of the cache. Rows at or past the current position (stale, or a
padded prompt chunk's padding) are never read until a later step overwrites them.

Each cell computes the logits of one chosen row only (the prompt's last, or the decoded
token's) and draws the next token from them with the SampleToken op: greedy (temperature 0), temperature,
top-k and top-p (nucleus), its settings inputs of the cell and its uniform number drawn
from a seeded numpy Generator, so runs are reproducible and `stream` reads back one token
id per step, not a vocabulary's logits to sample on the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from . import dtypes
from .compiler import Compiler
from .errors import RanvierError
from .flow.builder import Builder, Tensor
from .flow.graph import Flow, Variable
from .models.llama import Llama, rope_tables
from .ops.sampling import pick, sample_distribution
from .runtime import aligned_array, aligned_zeros

_UNIFORM_BITS = 24  # uniform numbers of float32's precision, so none rounds up to 1


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn (`ranvier.ops.sampling`): temperature ≤ 0 is greedy;
    top_k and top_p are off when None."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None

    def settings(self) -> list[np.ndarray]:
        """The SampleToken op's temperature, top_k and top_p inputs."""
        return [np.array(self.temperature, np.float32), np.array(self.top_k or 0, np.int32),
                np.array(1.0 if self.top_p is None else self.top_p, np.float32)]

    @staticmethod
    def draw(rng: np.random.Generator) -> np.float32:
        """A uniform number in [0, 1) for one token."""
        return np.float32(rng.integers(0, 1 << _UNIFORM_BITS) / (1 << _UNIFORM_BITS))

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """The next token from one row of logits, on the host, as the cells draw it."""
        temperature, top_k, top_p = (value.item() for value in self.settings())
        return pick(sample_distribution(logits, temperature, top_k, top_p), float(self.draw(rng)))


GREEDY = Sampling(temperature=0.0)


@dataclass(frozen=True)
class _CellVars:
    """A generator cell's inputs and outputs."""

    tokens: Variable
    position: Variable
    logits: Variable
    last: Variable
    drawing: list[Variable]  # uniform, temperature, top_k, top_p
    token: Variable


class Generator:
    """Prefill and decode cells for a Llama with the given weights (ranvier keys, [in, out]).

    `matmul="bfloat16"` lets products round their inputs to bf16 where the backend gains by
    it: the weights become the cells' constants, and the CPU keeps each matrix in bf16 GEMM
    panels, packed once, so a decode step (which only streams its weights) reads half the
    bytes per token. `matmul="int8"` keeps each matrix as q8_0 blocks instead (32 int8 along k
    with a float16 scale, llama.cpp's layout) and quantizes each product's rows likewise, int32
    sums of the blocks' products (on VNNI where the CPU has it): a little over a quarter of
    float32's bytes. In float32 they stay parameters: packed panels of them would double the
    weights' memory for the prompt's products alone (a decode step's products stream the
    matrices in place: `Gemv`).

    The network keeps no copy of its own: the model's initial arrays (aligned, as models
    make them; given `weights` are copied once where they are not) are its weights, so a
    write to either reaches the other, and with bf16 products they become read-only. (On
    a GPU the device keeps its own copy: a write must go through `generator.network[name]`
    to reach it.)"""

    def __init__(
        self,
        model: Llama,
        weights: Mapping[str, np.ndarray] | None = None,
        prefill: int = 32,
        backend: str = "cpu",
        matmul: str = "float32",
    ):
        self.config = c = model.config
        if weights is not None:
            missing = sorted(set(model.initial) - set(weights))
            if missing:
                raise RanvierError(f"generator weights lack {', '.join(missing[:5])}")
            model.initial = {key: aligned_array(weights[key], np.float32) for key in model.initial}
        self.model = model
        self.prefill_width = min(prefill, c.max_seq_len)
        flow = Flow()
        self.cells = {}
        for name, width in (("prefill", self.prefill_width), ("decode", 1)):
            b = Builder(flow, name)
            tokens = b.var("tokens", dtypes.DT_INT32, [1, width])
            position = b.var("position", dtypes.DT_INT32, [])
            # the row whose logits the cell gives and draws the next token from: the chunk's last real token
            last = b.var("last", dtypes.DT_INT32, [1])
            logits = self._chunk(b, tokens, position, last)
            drawing = [b.var("uniform", dtypes.DT_FLOAT32, [1]), b.var("temperature", dtypes.DT_FLOAT32, []),
                       b.var("top_k", dtypes.DT_INT32, []), b.var("top_p", dtypes.DT_FLOAT32, [])]
            token, _ = b.sample_token(logits, *drawing)
            logits.var.out = token.var.out = True
            self.cells[name] = _CellVars(tokens.var, position.var, logits.var, last.var, [t.var for t in drawing], token.var)
        if matmul != "float32":
            for key in model.initial:
                flow.vars[f"{model.name}/{key}"].learnable = False
        start = time.perf_counter()
        self.network = Compiler(backend, matmul=matmul).compile(flow, share_data=True)
        self.compile_seconds = time.perf_counter() - start
        self.instances = {name: self.network.cell(name).instance() for name in self.cells}

    # ---- the graph ---------------------------------------------------------------------------

    def _cache(self, b: Builder, name: str) -> Tensor:
        c = self.config
        var_name = f"cache/{name}"
        if var_name not in b.flow.vars:
            var = b.flow.add_var(var_name, dtypes.DT_FLOAT32, [c.n_kv_heads, c.max_seq_len, c.head_dim])
            var.set_data(aligned_zeros(var.shape, np.float32))
            var.nogradient = True
        return b.wrap(b.flow.vars[var_name])

    def _chunk(self, b: Builder, tokens: Tensor, position: Tensor, last: Tensor) -> Tensor:
        """The logits [1, vocab] after row `last` of a chunk of tokens at `position`. Only that
        row goes through the final norm and the classifier: a prompt's other rows' logits are
        never read, and for a 128-token prompt of stories110M their product by the 32,000-word
        classifier was an eighth of the prefill's time."""
        c = self.config
        p = self.model.parameters(b)
        width = tokens.shape[1]
        offsets = np.arange(width, dtype=np.int32)
        positions = b.const(offsets) + position  # [T]
        cos, sin = (b.const(t) for t in rope_tables(c.head_dim, c.max_seq_len, c.rope_base))
        rope = tuple(b.gather(t, positions) for t in (cos, sin))  # [T, hd/2]
        x = b.gather(p["tok_embeddings"], tokens)
        for i in range(c.n_layers):
            w = {key.split(".", 2)[2]: value for key, value in p.items() if key.startswith(f"layers.{i}.")}
            h = b.rms_norm(x, w["attention_norm"], c.norm_eps)
            x = x + self._attention(b, h, w, rope, i, position)
            x = x + self.model.feed_forward(b, b.rms_norm(x, w["ffn_norm"], c.norm_eps), w)
        x = b.rms_norm(b.gather(x.reshape([width, c.dim]), last), p["norm"], c.norm_eps)
        return b.matmul(x, p["tok_embeddings"], transpose_b=True) if c.shared_classifier else x @ p["output"]

    def _attention(self, b, x, w, rope, layer, position) -> Tensor:
        """The chunk's queries over the cache's first `position` rows and the chunk's own
        keys (CachedAttention: only the rows in use are read); the chunk's keys and values
        then go into the caches at `position`."""
        c = self.config
        width, hd = x.shape[1], c.head_dim
        q = b.rotary((x @ w["wq"]).reshape([1, width, c.n_heads, hd]), *rope).transpose([0, 2, 1, 3])
        new, caches = [], []
        for name, projection, rotated in (("k", "wk", True), ("v", "wv", False)):
            chunk = (x @ w[projection]).reshape([1, width, c.n_kv_heads, hd])
            chunk = (b.rotary(chunk, *rope) if rotated else chunk).transpose([0, 2, 1, 3])  # [1, KV, T, hd]
            cache = self._cache(b, f"{layer}/{name}")
            new.append(chunk)
            caches.append(cache.reshape([1, c.n_kv_heads, c.max_seq_len, hd]))
            # Runs after every read of the cache in this cell (the compiler orders writes last).
            b.op("AssignSlice", [cache, chunk.reshape([c.n_kv_heads, width, hd]), position], None, {"axis": 1})
        out = b.cached_attention(q, *new, *caches, position)  # [1, H, T, hd]
        return out.transpose([0, 2, 1, 3]).reshape([1, width, c.dim]) @ w["wo"]

    # ---- running ---------------------------------------------------------------------------

    def _run(self, name: str, tokens: np.ndarray, position: int, last: int = 0, sampling: Sampling = GREEDY,
             uniform: float = 0.0):
        """Compute a chunk at `position`, drawing the token after row `last`; the instance."""
        cell = self.cells[name]
        data = self.instances[name]
        data[cell.tokens] = tokens.reshape(1, -1)
        data[cell.position] = position
        data[cell.last] = last
        for var, value in zip(cell.drawing, [np.array([uniform], np.float32), *sampling.settings()], strict=True):
            data[var] = value
        data.compute()
        return data

    def _prefill(self, prompt: list[int], **drawing):
        """Feed the prompt from position 0 in chunks; the last chunk's instance."""
        if not prompt:
            raise RanvierError("generation needs a prompt of at least one token (e.g. BOS)")
        if len(prompt) > self.config.max_seq_len:
            raise RanvierError(f"the prompt has {len(prompt)} tokens; the model holds at most {self.config.max_seq_len}")
        width = self.prefill_width
        for start in range(0, len(prompt), width):
            chunk = prompt[start : start + width]
            padded = np.zeros(width, np.int32)
            padded[: len(chunk)] = chunk
            data = self._run("prefill", padded, start, last=len(chunk) - 1, **drawing)
        return data

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """Feed the prompt from position 0; returns the logits after its last token."""
        data = self._prefill(prompt)
        return np.array(data[self.cells["prefill"].logits][0])

    def decode(self, token: int, position: int) -> np.ndarray:
        """Feed one token at `position`; returns the logits after it."""
        return np.array(self._run("decode", np.array([token], np.int32), position)[self.cells["decode"].logits][0])

    def stream(self, prompt: list[int], max_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
               eos: int | None = None) -> Iterator[int]:
        """Yield generated tokens one by one until `max_tokens`, EOS or the context is full."""
        rng = np.random.default_rng(seed)
        token = int(self._prefill(prompt, sampling=sampling, uniform=sampling.draw(rng))[self.cells["prefill"].token][0])
        position = len(prompt)
        for _ in range(max_tokens):
            if eos is not None and token == eos:
                return
            yield token
            if position >= self.config.max_seq_len:
                return
            data = self._run("decode", np.array([token], np.int32), position, sampling=sampling, uniform=sampling.draw(rng))
            token = int(data[self.cells["decode"].token][0])
            position += 1
