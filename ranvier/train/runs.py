"""A language-model training run's directory as the library reads it back: its saved
config (config.json: the kind of run and its settings, checked), its tokenizer and its
trained model. The jobs that write run directories are the application's (`ranvier.jobs`);
`interop` loads a model from one through `load_model`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import ClassVar, TypeVar

import numpy as np

from ..data.tokenizers import ByteTokenizer, CharTokenizer, SentencePieceTokenizer, load_tokenizer
from ..errors import RanvierError, parse_json
from ..models import LANGUAGE_MODELS
from ..models.llama import Llama, LlamaConfig
from .checkpoint import load_checkpoint
from .settings import check_settings

Config = TypeVar("Config")

# Each kind of run with its article, as messages name it.
KINDS = {"mnist": ("an", "MNIST"), "llama": ("a", "llama"), "moe": ("a", "moe"), "onnx": ("an", "ONNX")}


def _runs(kinds: tuple[str, ...]) -> str:
    """ "a llama or moe run" """
    return f"{KINDS[kinds[0]][0]} {' or '.join(KINDS[kind][1] for kind in kinds)} run"


@dataclass
class LlamaRunConfig:
    """The settings of a `ranvier train llama|moe` run, as its config.json holds them."""

    preset: str = "stories260K"
    model: str = "llama"  # or "moe": the family the preset belongs to
    corpus: str | None = None
    data: str | None = None  # a folder of token shards (from `ranvier data pretokenize`) instead of a corpus
    shards: list[dict] | None = None  # the shard files trained on: {"path", "bytes", "mtime_ns"}
    steps: int | None = 2000  # None: as many as fit in `minutes`
    minutes: float | None = None  # plan the steps to fit this training time
    batch: int = 16
    seq: int = 128
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    accumulate: int = 1
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 500
    sample_every: int = 200
    max_corpus_bytes: int | None = None
    seed: int = 0
    backend: str = "cpu"
    cpu: str = ""
    matmul: str = "float32"  # what ran: "bfloat16" is mixed-precision matrix products on AMX
    matmul_requested: str | None = None  # what --matmul asked for
    precision: str = "float32"  # what activations are stored in: "bfloat16" or "float16" on a GPU (not checkpointed)
    checkpointed: bool = False  # stream the layers through a CheckpointedStack
    zero: bool = False  # ZeRO-1 over data-parallel workers (a resume may change it)

    # The settings above 0, and those 0 or more, as a saved config.json is checked.
    POSITIVE: ClassVar[set[str]] = {"steps", "minutes", "batch", "seq", "lr", "clip", "accumulate", "eval_every",
                                    "eval_batches", "checkpoint_every", "sample_every", "max_corpus_bytes"}
    NON_NEGATIVE: ClassVar[set[str]] = {"min_lr", "warmup", "weight_decay"}


def kind_of(saved: object) -> str | None:
    """A saved config's run kind; runs written before config.json recorded it are known by
    their keys. None: not a ranvier run's config (a Hugging Face config.json, say)."""
    if not isinstance(saved, dict):
        kind = None
    elif "kind" in saved:
        kind = saved["kind"]
    elif "preset" in saved:
        kind = saved.get("model", "llama")
    else:
        kind = "mnist" if "optimizer" in saved and "hidden" in saved else None
    return kind if isinstance(kind, str) else None


def read_saved(path: Path) -> object:
    """A config.json's contents, or an error naming it where it is not JSON."""
    return parse_json(path.read_bytes(), RanvierError, f"{path} is not JSON")


def check_kind(run_dir: Path, kinds: tuple[str, ...], command: str | None = None) -> dict:
    """The saved config of `run_dir`, a run of one of `kinds`, or an error naming what it is
    and what `command` (when given) needs."""
    path = run_dir / "config.json"
    if not run_dir.is_dir():
        raise RanvierError(f"{run_dir} is not a run directory: {'no such folder' if not run_dir.exists() else 'not a folder'}")
    if not path.is_file():
        raise RanvierError(f"{run_dir} is not a run directory: config.json is missing")
    saved = read_saved(path)
    kind = kind_of(saved)
    if kind not in kinds:
        what = _runs((kind,)) if kind in KINDS else "not a ranvier run directory (its config.json names no kind of run)"
        needs = f"{command} needs {_runs(kinds)}" if command else f"expected {_runs(kinds)}"
        raise RanvierError(f"{run_dir} is {what}; {needs}")
    return saved


def read_config(run_dir: Path, kind: type[Config], kinds: tuple[str, ...]) -> Config:
    """The job config saved in `run_dir/config.json`, which must be a run of one of `kinds`."""
    saved = check_kind(run_dir, kinds)
    saved.pop("kind", None)
    unknown = set(saved) - {f.name for f in fields(kind)}
    if unknown:
        raise RanvierError(f"{run_dir / 'config.json'} has settings this ranvier does not know: {', '.join(sorted(unknown))}")
    check_settings(run_dir / "config.json", kind, saved)
    return kind(**saved)


def run_tokenizer(run_dir: Path) -> Path:
    """The run's tokenizer file: tokenizer.model (SentencePiece), or tokenizer.json."""
    model = run_dir / "tokenizer.model"
    return model if model.exists() or not (run_dir / "tokenizer.json").exists() else run_dir / "tokenizer.json"


def family_of(config: LlamaRunConfig) -> tuple[dict[str, LlamaConfig], type[Llama]]:
    """The presets and model class of the run's model family."""
    if config.model not in LANGUAGE_MODELS:
        raise RanvierError(f"unknown model family {config.model!r}; choose one of {', '.join(LANGUAGE_MODELS)}")
    return LANGUAGE_MODELS[config.model]


def model_config_for(config: LlamaRunConfig, vocab_size: int) -> LlamaConfig:
    """The preset's architecture with the run's vocabulary (and room for its sequence length)."""
    preset = family_of(config)[0][config.preset]
    return type(preset)(**{**asdict(preset), "vocab_size": vocab_size, "max_seq_len": max(preset.max_seq_len, config.seq)})


def read_run(run_dir: Path) -> LlamaRunConfig:
    return read_config(run_dir, LlamaRunConfig, tuple(LANGUAGE_MODELS))


def load_model(run_dir: Path) -> tuple[LlamaConfig, dict[str, np.ndarray], ByteTokenizer | CharTokenizer | SentencePieceTokenizer]:
    """(LlamaConfig, weights with ranvier keys, tokenizer) of a trained run directory."""
    config = read_run(run_dir)
    tokenizer = load_tokenizer(run_tokenizer(run_dir))
    arrays, _ = load_checkpoint(run_dir / "checkpoint")
    prefix = f"{family_of(config)[1].name}/"
    weights = {name[len(prefix):]: array for name, array in arrays.items() if name.startswith(prefix) and name.count("/") == 1}
    return model_config_for(config, tokenizer.vocab_size), weights, tokenizer
