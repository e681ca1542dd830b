"""The weights of a Llama as every format in `ranvier.interop` hands them over: ranvier's
names and [in, out] matrices, checked against the model's config."""

from __future__ import annotations

import numpy as np

from ..errors import RanvierError, name_mismatch
from ..models.llama import LlamaConfig


class InteropError(RanvierError):
    """A model or tokenizer file cannot be read or written in a foreign format."""


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """ranvier's weight names and shapes ([in, out] matrices) for a config."""
    c = config
    kv = c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings": (c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        shapes.update({
            f"layers.{i}.attention_norm": (c.dim,),
            f"layers.{i}.wq": (c.dim, c.dim),
            f"layers.{i}.wk": (c.dim, kv),
            f"layers.{i}.wv": (c.dim, kv),
            f"layers.{i}.wo": (c.dim, c.dim),
            f"layers.{i}.ffn_norm": (c.dim,),
            f"layers.{i}.w1": (c.dim, c.hidden_dim),
            f"layers.{i}.w2": (c.hidden_dim, c.dim),
            f"layers.{i}.w3": (c.dim, c.hidden_dim),
        })
    shapes["norm"] = (c.dim,)
    if not c.shared_classifier:
        shapes["output"] = (c.dim, c.vocab_size)
    return shapes


def check_weights(config: LlamaConfig, weights: dict[str, np.ndarray], source: str = "weights") -> dict[str, np.ndarray]:
    """The weights as float32 arrays, after checking names and shapes against the config."""
    expected = weight_shapes(config)
    missing = [k for k in expected if k not in weights]
    extra = [k for k in weights if k not in expected]
    if missing or extra:
        raise InteropError(
            f"{source} do not fit the Llama config: " + name_mismatch(missing, extra)
        )
    out = {}
    for key, shape in expected.items():
        array = np.asarray(weights[key])
        if array.shape != shape:
            raise InteropError(f"{source}: {key} has shape {list(array.shape)}, the config needs {list(shape)}")
        out[key] = np.ascontiguousarray(array, dtype=np.float32)
    return out


def config_from(source: str, **fields) -> LlamaConfig:
    try:
        return LlamaConfig(**fields)
    except RanvierError as error:
        raise InteropError(f"{source}: {error}") from None
    except TypeError as error:
        raise InteropError(f"{source}: {error}") from None


def torch_layout(array: np.ndarray) -> np.ndarray:
    """ranvier [in, out] → torch Linear [out, in] (and back: the transpose is its own inverse)."""
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32).T)
