"""llama2.c checkpoints (`run.c` reads them).

  * version 0 ("legacy"): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
    vocab_size — negative when the classifier is not shared —, max_seq_len), then float32
    arrays: token embedding, attention norms, wq, wk, wv, wo, ffn norms, w1, w2, w3, final
    norm, the RoPE cos and sin tables [max_seq_len, head_size/2] (written, skipped on
    import), then the classifier when it is not shared.
  * version 1 (export.py's version1_export): a 256-byte header — uint32 magic "ak42",
    int32 version 1, the 7 int32 parameters, a uint8 shared-classifier flag, zeros — then
    attention norms, ffn norms, final norm, token embedding, wq, wk, wv, wo, w1, w2, w3 and
    the classifier when it is not shared.
  Matrices are torch Linear weights [out, in], layer after layer; ranvier keeps [in, out].
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..atomic import atomic_write
from ..models.llama import LlamaConfig, rope_tables
from ..models.moe import MoEConfig
from .weights import InteropError, check_weights, config_from, oversized_fields, torch_layout, weight_shapes

MAGIC = 0x616B3432  # "ak42"
V1_HEADER_BYTES = 256
LEGACY_HEADER_BYTES = 7 * 4
LLAMA2C_NORM_EPS = 1e-5
LLAMA2C_ROPE_THETA = 10000.0


def _llama2c_arrays(config: LlamaConfig, weights: dict[str, np.ndarray], version: int) -> list[np.ndarray]:
    c, w = config, weights
    L = range(c.n_layers)

    def layers(name: str, linear: bool) -> list[np.ndarray]:
        return [torch_layout(w[f"layers.{i}.{name}"]) if linear else w[f"layers.{i}.{name}"] for i in L]

    matrices = [array for name in ("wq", "wk", "wv", "wo") for array in layers(name, True)]
    ffn = [array for name in ("w1", "w2", "w3") for array in layers(name, True)]
    classifier = [] if c.shared_classifier else [torch_layout(w["output"])]
    if version == 0:
        cos, sin = rope_tables(c.head_dim, c.max_seq_len, LLAMA2C_ROPE_THETA)
        return [w["tok_embeddings"], *layers("attention_norm", False), *matrices, *layers("ffn_norm", False), *ffn,
                w["norm"], cos, sin, *classifier]
    return [*layers("attention_norm", False), *layers("ffn_norm", False), w["norm"], w["tok_embeddings"],
            *matrices, *ffn, *classifier]


def export_llama2c(config: LlamaConfig, weights: dict[str, np.ndarray], path: str | os.PathLike, version: int = 0) -> Path:
    """Write a llama2.c checkpoint (version 0 = legacy, run.c's format; 1 = export.py's version 1)."""
    if version not in (0, 1):
        raise InteropError(f"llama2.c checkpoint version must be 0 (legacy) or 1, not {version!r}")
    if isinstance(config, MoEConfig):
        raise InteropError("llama2.c holds dense Llama models, not mixtures of experts; "
                           "export a MoE as a Hugging Face MixtralForCausalLM folder (ranvier export hf)")
    if config.norm_eps != LLAMA2C_NORM_EPS or config.rope_theta != LLAMA2C_ROPE_THETA:
        raise InteropError(
            f"llama2.c fixes norm_eps at {LLAMA2C_NORM_EPS:g} and rope_theta at {LLAMA2C_ROPE_THETA:g}; "
            f"this model has {config.norm_eps:g} and {config.rope_theta:g}, which the file cannot record"
        )
    weights = check_weights(config, weights)
    c = config
    params = (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len)
    if version == 0:
        vocab = c.vocab_size if c.shared_classifier else -c.vocab_size
        header = struct.pack("<7i", *params[:5], vocab, params[6])
    else:
        header = struct.pack("<Ii7iB", MAGIC, 1, *params, int(c.shared_classifier))
        header += b"\0" * (V1_HEADER_BYTES - len(header))
    arrays = _llama2c_arrays(c, weights, version)

    def write(f):
        f.write(header)
        for array in arrays:
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())

    atomic_write(path, write)
    return Path(path)


def _llama2c_float_count(config: LlamaConfig, version: int) -> int:
    c = config
    count = c.parameter_count()
    if version == 0:
        count += c.max_seq_len * c.head_dim  # cos and sin tables, head_dim/2 each
    return count


def import_llama2c(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Read a llama2.c checkpoint of version 0 (legacy) or 1, told apart by the version-1 magic."""
    path = Path(path)
    if not path.is_file():
        raise InteropError(f"llama2.c checkpoint {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(V1_HEADER_BYTES)
    if len(head) < LEGACY_HEADER_BYTES:
        raise InteropError(f"{path} is not a llama2.c checkpoint: {size} bytes, shorter than any header")
    if struct.unpack_from("<I", head)[0] == MAGIC:
        if len(head) < V1_HEADER_BYTES:
            raise InteropError(f"{path}: truncated llama2.c header ({size} bytes, a version-1 header is {V1_HEADER_BYTES})")
        version = struct.unpack_from("<i", head, 4)[0]
        if version != 1:
            raise InteropError(
                f"{path}: llama2.c checkpoint version {version} is not supported (only 0 = legacy and 1 = float32; "
                "version 2 is llama2.c's int8-quantized format)"
            )
        params = struct.unpack_from("<7i", head, 8)
        shared = bool(head[36])
        vocab = params[5]
        offset = V1_HEADER_BYTES
        kind = "version-1"
    else:
        version = 0
        params = struct.unpack_from("<7i", head, 0)
        shared = params[5] > 0
        vocab = abs(params[5])
        offset = LEGACY_HEADER_BYTES
        kind = f"legacy (no version-1 magic 0x{MAGIC:08x})"
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")
    values = dict(zip(names, (*params[:5], vocab, params[6])))
    bad = [f"{name}={value}" for name, value in values.items() if value < 1]
    if bad:
        raise InteropError(f"{path} is not a llama2.c checkpoint: read as {kind}, its header has non-positive {', '.join(bad)}")
    config = config_from(f"{path} is not a valid llama2.c checkpoint: read as {kind}, its header says", **values, norm_eps=LLAMA2C_NORM_EPS,
                     rope_theta=LLAMA2C_ROPE_THETA, shared_classifier=shared)

    def needed(c: LlamaConfig) -> int:
        return offset + 4 * _llama2c_float_count(c, version)

    expected = needed(config)
    too_large = oversized_fields(config, lambda c: needed(c) <= size) if size < expected else []
    if too_large:
        raise InteropError(
            f"{path}: the {kind} llama2.c header says {', '.join(f'{k} {values[k]:,}' for k in too_large)}, but the "
            f"file holds {size:,} bytes (the header needs {expected:,}): corrupt, or not a llama2.c checkpoint"
        )
    if size != expected:
        raise InteropError(
            f"{path}: the {kind} llama2.c header ({', '.join(f'{k}={v}' for k, v in values.items())}, "
            f"{'shared' if shared else 'separate'} classifier) needs {expected} bytes, the file has {size} "
            f"({'truncated' if size < expected else 'extra data'})"
        )
    data = np.memmap(path, dtype="<f4", mode="r", offset=offset)
    position = 0

    def take(*shape: int) -> np.ndarray:
        nonlocal position
        n = int(np.prod(shape))
        array = np.array(data[position:position + n], dtype=np.float32).reshape(shape)
        position += n
        return array

    c = config
    kv = c.n_kv_heads * c.head_dim
    L = c.n_layers
    weights: dict[str, np.ndarray] = {}

    def per_layer(name: str, *shape: int, linear: bool = False) -> None:
        for i in range(L):
            array = take(*shape)
            weights[f"layers.{i}.{name}"] = torch_layout(array) if linear else array

    def matrices() -> None:
        per_layer("wq", c.dim, c.dim, linear=True)
        per_layer("wk", kv, c.dim, linear=True)
        per_layer("wv", kv, c.dim, linear=True)
        per_layer("wo", c.dim, c.dim, linear=True)

    def ffn() -> None:
        per_layer("w1", c.hidden_dim, c.dim, linear=True)
        per_layer("w2", c.dim, c.hidden_dim, linear=True)
        per_layer("w3", c.hidden_dim, c.dim, linear=True)

    if version == 0:
        weights["tok_embeddings"] = take(c.vocab_size, c.dim)
        per_layer("attention_norm", c.dim)
        matrices()
        per_layer("ffn_norm", c.dim)
        ffn()
        weights["norm"] = take(c.dim)
        take(c.max_seq_len * c.head_dim)  # RoPE cos and sin tables: recomputed, not stored
    else:
        per_layer("attention_norm", c.dim)
        per_layer("ffn_norm", c.dim)
        weights["norm"] = take(c.dim)
        weights["tok_embeddings"] = take(c.vocab_size, c.dim)
        matrices()
        ffn()
    if not shared:
        weights["output"] = torch_layout(take(c.vocab_size, c.dim))
    return config, {key: weights[key] for key in weight_shapes(config)}
