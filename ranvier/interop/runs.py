"""Models wherever they come from: a `ranvier train llama|moe` run directory, a llama2.c
checkpoint with its tokenizer, a GGUF file, or a Hugging Face folder."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..data.tokenizers import load_tokenizer
from ..models.llama import LlamaConfig
from ..train.runs import load_model
from .gguf_file import import_gguf
from .hf import import_hf
from .llama2c import import_llama2c
from .tokenizer_bin import import_tokenizer_bin
from .weights import InteropError, check_weights

GGUF_MAGIC = b"GGUF"


def weights_from_run(run_dir: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The model config and latest checkpointed weights of a `ranvier train llama|moe` run directory."""
    config, weights, _ = load_model(Path(run_dir))
    return config, check_weights(config, {k: np.asarray(v, np.float32) for k, v in weights.items()}, f"the checkpoint in {run_dir}")


def load_any(model: str | os.PathLike, tokenizer: str | os.PathLike | None = None):
    """(config, weights, tokenizer) of a run directory, a llama2.c .bin (with its
    tokenizer.bin), a GGUF file (its own vocabulary, or `tokenizer`) or a Hugging Face folder
    (its tokenizer.model, or `tokenizer`)."""
    path = Path(model)
    if path.is_dir() and (path / "checkpoint").is_dir():
        config, weights, run_tokenizer = load_model(path)
        return config, weights, load_tokenizer(tokenizer) if tokenizer else run_tokenizer
    if path.is_file() and _is_gguf(path):
        config, weights, file_tokenizer = import_gguf(path)
        return config, weights, _tokenizer_file(tokenizer) if tokenizer else file_tokenizer
    if path.is_file():
        if tokenizer is None:
            raise InteropError(f"{path} is a llama2.c checkpoint: give its tokenizer.bin with --tokenizer")
        config, weights = import_llama2c(path)
        return config, weights, _tokenizer_file(tokenizer)
    if path.is_dir() and (path / "config.json").is_file():
        config, weights = import_hf(path)
        source = Path(tokenizer) if tokenizer else path / "tokenizer.model"
        if not source.is_file():
            raise InteropError(f"{path} has no tokenizer.model: give one with --tokenizer")
        return config, weights, load_tokenizer(source)
    raise InteropError(f"{path} is not a run directory, a llama2.c checkpoint, a GGUF file or a Hugging Face folder")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _tokenizer_file(path: str | os.PathLike):
    """A llama2.c tokenizer.bin, or any tokenizer file `load_tokenizer` reads."""
    return import_tokenizer_bin(path) if str(path).endswith(".bin") else load_tokenizer(path)
