"""Models built on the IR: an MLP and a small CNN (here), Llama-2 (`ranvier.models.llama`)
and mixture-of-experts transformers (`ranvier.models.moe`)."""

from .cnn import CNN
from .llama import PRESETS as LLAMA_PRESETS
from .llama import Llama, LlamaConfig
from .mlp import MLP
from .module import Module
from .moe import PRESETS as MOE_PRESETS
from .moe import MoE, MoEConfig

# Language-model families: their presets and model class, by name (`ranvier train llama|moe`).
LANGUAGE_MODELS = {"llama": (LLAMA_PRESETS, Llama), "moe": (MOE_PRESETS, MoE)}


def language_model(config: LlamaConfig, seed: int = 0, allocate: bool = True) -> Llama:
    """The model a configuration describes (a MoEConfig makes a MoE)."""
    return (MoE if isinstance(config, MoEConfig) else Llama)(config, seed, allocate)


__all__ = ["CNN", "LANGUAGE_MODELS", "MLP", "Llama", "LlamaConfig", "MoE", "MoEConfig", "Module", "language_model"]
