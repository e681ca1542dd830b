"""Token shards in llama2.c's format: headerless little-endian uint16 token ids (`.bin`).

A corpus is tokenized once (`pretokenize`) into numbered shards `data00.bin`,
`data01.bin`, ... plus `manifest.json`; training then reads them through numpy
memmaps (`TokenShards`), so a corpus larger than memory costs only the pages that
sampled windows touch. Shards written here load in llama2.c and the other way round.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from ..errors import RanvierError, brief, is_file_name, parse_json
from .corpus import entropy_from_counts
from .tokenizers import Tokenizer

TOKEN_DTYPE = np.dtype("<u2")
MAX_VOCAB = 1 << 16
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB per shard


class ShardError(RanvierError):
    """A token shard is missing, malformed, or does not fit the request made of it."""


def write_shard(path: str | os.PathLike, tokens: Sequence[int] | np.ndarray) -> int:
    """Write token ids as one shard (atomically) and return how many were written."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ShardError(
            f"shard {path}: expected a non-empty 1-D sequence of integer token ids, got {ids.dtype}{list(ids.shape)}"
        )
    bad = np.flatnonzero((ids < 0) | (ids >= MAX_VOCAB))
    if bad.size:
        raise ShardError(
            f"shard {path}: token id {int(ids[bad[0]])} at position {int(bad[0])} does not fit uint16 (0..{MAX_VOCAB - 1})"
        )
    atomic_write_bytes(path, ids.astype(TOKEN_DTYPE).tobytes())
    return int(ids.size)


def pretokenize(
    texts: Iterable[str],
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    on_shard: Callable[[Path, int], None] | None = None,
) -> dict:
    """Tokenize documents into `out_dir/data00.bin, data01.bin, ...` and write the manifest.

    Each non-empty document becomes BOS + its tokens (as llama2.c does), so a model
    learns where documents start; documents run on across shard boundaries and every
    shard but the last holds exactly `shard_tokens` tokens. The tokenizer is saved
    beside the shards and `manifest.json` records it with the token counts and the
    unigram entropy, so the folder says everything needed to train on it.
    `on_shard(path, tokens)` is called after each shard is written (for progress).
    """
    if tokenizer.vocab_size > MAX_VOCAB:
        raise ShardError(f"a {tokenizer.vocab_size}-token vocabulary does not fit uint16 shards (at most {MAX_VOCAB})")
    if shard_tokens <= 0:
        raise ShardError(f"shard_tokens must be positive, got {shard_tokens}")
    out = Path(out_dir)
    if out.is_dir() and any(out.glob("*.bin")):
        raise ShardError(
            f"{out} already holds .bin shards; pretokenize into an empty folder (or delete them) so old and new shards do not mix"
        )
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    shards: list[dict] = []
    pending: list[np.ndarray] = []
    pending_tokens = 0
    documents = 0

    def flush(size: int) -> None:
        nonlocal pending, pending_tokens, counts
        tokens = np.concatenate(pending)
        path = out / f"data{len(shards):02d}.bin"
        write_shard(path, tokens[:size])
        counts += np.bincount(tokens[:size], minlength=tokenizer.vocab_size)
        shards.append({"file": path.name, "tokens": size})
        rest = tokens[size:]
        pending, pending_tokens = ([rest] if rest.size else []), int(rest.size)
        if on_shard is not None:
            on_shard(path, size)

    for text in texts:
        if not text:
            continue
        ids = np.asarray(tokenizer.encode(text, bos=True, eos=False), dtype=np.int64)
        bad = ids[(ids < 0) | (ids >= tokenizer.vocab_size)]
        if bad.size:
            raise ShardError(
                f"document {documents}: the tokenizer produced id {int(bad[0])} outside its vocabulary of {tokenizer.vocab_size}"
            )
        pending.append(ids.astype(TOKEN_DTYPE))
        pending_tokens += ids.size
        documents += 1
        while pending_tokens >= shard_tokens:
            flush(shard_tokens)
    if pending_tokens:
        flush(pending_tokens)
    if not shards:
        raise ShardError("pretokenize: the corpus has no non-empty documents")
    tokenizer_file = "tokenizer.model" if tokenizer.kind == "sentencepiece" else "tokenizer.json"
    tokenizer.save(out / tokenizer_file)
    manifest = {
        "format": "uint16-le",
        "tokenizer": {"kind": tokenizer.kind, "file": tokenizer_file, "vocab_size": tokenizer.vocab_size,
                      "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "documents": documents,
        "tokens": int(counts.sum()),
        "unigram_entropy": entropy_from_counts(counts),
        "shards": shards,
    }
    atomic_write_bytes(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
    return manifest


def _natural_key(path: Path) -> list:
    """data2.bin before data10.bin, whatever the zero padding."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _read_manifest(path: Path) -> dict:
    """A shard manifest, with the fields reading shards relies on checked."""
    manifest = parse_json(path.read_bytes(), ShardError, f"{path} is not a valid shard manifest")
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not shards:
        raise ShardError(f"{path} is not a valid shard manifest: it has no 'shards' list")
    if manifest.get("format", "uint16-le") != "uint16-le":
        raise ShardError(f"{path}: format {brief(manifest['format'])} is not 'uint16-le'")
    for i, shard in enumerate(shards):
        file = shard.get("file") if isinstance(shard, dict) else None
        if not is_file_name(file):
            raise ShardError(f"{path}: shards[{i}] names {brief(file)}, not a file in {path.parent}")
        tokens = shard.get("tokens", 0)
        if type(tokens) is not int or tokens < 0:
            raise ShardError(f"{path}: shards[{i}] has tokens {brief(tokens)}, not a count")
    return manifest


def _shard_paths(source: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[list[Path], dict | None]:
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if root.is_file():
            return [root], None
        if not root.is_dir():
            raise ShardError(f"token shard file or folder {root} does not exist")
        manifest_path = root / MANIFEST
        if manifest_path.is_file():
            manifest = _read_manifest(manifest_path)
            return [root / shard["file"] for shard in manifest["shards"]], manifest
        paths = sorted(root.glob("*.bin"), key=_natural_key)
        if not paths:
            raise ShardError(f"{root} holds no .bin token shards")
        return paths, None
    paths = [Path(p) for p in source]
    if not paths:
        raise ShardError("no token shards given")
    return paths, None


def _open_shard(path: Path, manifest: Path | None = None, tokens: int | None = None) -> np.ndarray:
    """A shard's memmap; `tokens` is its count in `manifest`, the file that named it."""
    where = f"token shard {path}" + (f" (named by {manifest})" if manifest else "")
    if not path.is_file():
        raise ShardError(f"{where} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise ShardError(f"{where} is empty")
    if size % TOKEN_DTYPE.itemsize:
        raise ShardError(
            f"{where} has {size} bytes, an odd count: expected uint16 tokens (2 bytes each); truncated or not a shard?"
        )
    if tokens is not None and size != tokens * TOKEN_DTYPE.itemsize:
        raise ShardError(f"{where} holds {size // TOKEN_DTYPE.itemsize:,} tokens, but the manifest's tokens "
                         f"field says {tokens:,}: truncated, or not the shard it names")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


class TokenShards:
    """Token shards read through memmaps, sampled as random training windows.

    `source` is a folder (its manifest's shards in order, else every `.bin` in natural
    order), one shard file, or a list of shard files. Windows never cross a shard
    boundary, as shards need not be contiguous text.
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike]):
        paths, self.manifest = _shard_paths(source)
        self.names = [str(p) for p in paths]
        if self.manifest is None:
            self.shards = [_open_shard(p) for p in paths]
        else:
            listed = self.manifest["shards"]
            manifest = Path(source) / MANIFEST
            self.shards = [_open_shard(p, manifest, entry.get("tokens")) for p, entry in zip(paths, listed)]

    @classmethod
    def _from_views(cls, names: list[str], shards: list[np.ndarray], manifest: dict | None) -> TokenShards:
        split = cls.__new__(cls)
        split.names, split.shards, split.manifest = names, shards, manifest
        return split

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return f"TokenShards({len(self.shards)} shards, {self.num_tokens} tokens)"

    def sample(self, batch: int, seq: int, rng: np.random.Generator, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`batch` random windows of seq+1 tokens: inputs x = window[:-1], targets y = window[1:].

        Every window start in every shard is equally likely, and the same seeded
        Generator state gives the same batch. Both arrays are int32 [batch, seq].
        rows: read only these rows of the batch (a data-parallel rank's share); the
        Generator advances as for the whole batch, so every rank stays in step.
        """
        if batch <= 0 or seq <= 0:
            raise ShardError(f"batch and seq must be positive, got batch={batch} seq={seq}")
        starts_per_shard = np.array([max(len(s) - seq, 0) for s in self.shards], dtype=np.int64)
        total = int(starts_per_shard.sum())
        if total == 0:
            longest = max(len(s) for s in self.shards)
            raise ShardError(
                f"windows of {seq + 1} tokens (seq={seq} plus the target) do not fit in any shard; the longest has {longest} tokens"
            )
        ends = np.cumsum(starts_per_shard)
        draws = rng.integers(0, total, size=batch)[rows or slice(None)]
        shard_index = np.searchsorted(ends, draws, side="right")
        windows = np.empty((len(draws), seq + 1), dtype=np.int32)
        for row, (k, draw) in enumerate(zip(shard_index, draws)):
            start = int(draw - (ends[k] - starts_per_shard[k]))
            windows[row] = self.shards[k][start : start + seq + 1]
        return windows[:, :-1], windows[:, 1:]

    def split(self, *, fraction: float | None = None, shards: int | None = None) -> tuple[TokenShards, TokenShards]:
        """(train, validation): validation is the last `shards` shards, or the last `fraction` of all tokens."""
        if (fraction is None) == (shards is None):
            raise ShardError("split: give exactly one of fraction= or shards=")
        if shards is not None:
            if not 0 < shards < len(self.shards):
                raise ShardError(
                    f"split: cannot hold out {shards} of {len(self.shards)} shards (train and validation both need one)"
                )
            cut = len(self.shards) - shards
            return (TokenShards._from_views(self.names[:cut], self.shards[:cut], self.manifest),
                    TokenShards._from_views(self.names[cut:], self.shards[cut:], self.manifest))
        if not 0 < fraction < 1:
            raise ShardError(f"split: fraction must be between 0 and 1, got {fraction}")
        keep = self.num_tokens - round(fraction * self.num_tokens)
        if keep <= 0 or keep >= self.num_tokens:
            raise ShardError(f"split: a fraction of {fraction} of {self.num_tokens} tokens leaves one side empty")
        train: tuple[list[str], list[np.ndarray]] = ([], [])
        validation: tuple[list[str], list[np.ndarray]] = ([], [])
        for name, shard in zip(self.names, self.shards):
            head = min(max(keep, 0), len(shard))
            if head:
                train[0].append(name)
                train[1].append(shard[:head])
            if head < len(shard):
                validation[0].append(name)
                validation[1].append(shard[head:])
            keep -= len(shard)
        return (TokenShards._from_views(*train, self.manifest), TokenShards._from_views(*validation, self.manifest))

    def validate(self, vocab_size: int, chunk: int = 1 << 22) -> None:
        """Raise if any token id is >= vocab_size (a shard made with another tokenizer), reading in chunks."""
        for name, shard in zip(self.names, self.shards):
            for offset in range(0, len(shard), chunk):
                block = shard[offset : offset + chunk]
                bad = np.flatnonzero(block >= vocab_size)
                if bad.size:
                    position = offset + int(bad[0])
                    raise ShardError(
                        f"token shard {name}: id {int(shard[position])} at token {position} is outside the "
                        f"tokenizer's vocabulary of {vocab_size}; were these shards made with another tokenizer?"
                    )
