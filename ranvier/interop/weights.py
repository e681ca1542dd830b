"""The weights of a language model (Llama or MoE) as every format in `ranvier.interop`
hands them over: ranvier's names and [in, out] matrices, checked against the model's config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..errors import RanvierError, name_mismatch
from ..models import language_model
from ..models.llama import LlamaConfig
from ..models.moe import MoEConfig


class InteropError(RanvierError):
    """A model or tokenizer file cannot be read or written in a foreign format."""


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """ranvier's weight names and shapes ([in, out] matrices) for a config: the model's own."""
    return dict(language_model(config, allocate=False).shapes)


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


def config_from(source: str, kind: type[LlamaConfig] = LlamaConfig, **fields) -> LlamaConfig:
    try:
        return kind(**fields)
    except RanvierError as error:
        raise InteropError(f"{source}: {error}") from None
    except TypeError as error:
        raise InteropError(f"{source}: {error}") from None


def oversized_fields(config: LlamaConfig, fits: Callable[[LlamaConfig], bool]) -> list[str]:
    """The size fields of a config that `fits` (a file's size, say) refuses on their own: with
    every other size at its smallest, the config still does not fit. So an error can name the
    header field a file cannot hold, not only the total it implies."""
    # dim 2 with one head: the smallest head a rotary embedding takes (its size must be even).
    smallest = {"dim": 2, "n_heads": 1, "n_kv_heads": 1, "hidden_dim": 1, "n_layers": 1, "vocab_size": 1, "max_seq_len": 1}
    sizes = ["dim", "hidden_dim", "n_layers", "vocab_size", "max_seq_len"]
    if isinstance(config, MoEConfig):
        smallest |= {"n_experts": 1, "top_k": 1}
        sizes.append("n_experts")
    return [name for name in sizes if not fits(replace(config, **{**smallest, name: getattr(config, name)}))]


def torch_layout(array: np.ndarray) -> np.ndarray:
    """ranvier [in, out] → torch Linear [out, in] (and back: the transpose is its own inverse)."""
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32).T)
