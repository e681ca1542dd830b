"""TinyStories (Eldan & Li, 2023), the corpus llama2.c trains its small Llama models on.

The archive holds 50 JSON shards (`data00.json` ... `data49.json`), each a list of
objects whose "story" field is one short story. The steps mirror llama2.c's
tinystories.py: download and unpack, train a vocabulary on a sample of the shards,
pretokenize every story (BOS first) into uint16 token shards.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..atomic import atomic_write
from .mnist import DatasetError
from .shards import DEFAULT_SHARD_TOKENS, pretokenize
from .tokenizers import SentencePieceTokenizer, Tokenizer, train_sentencepiece

URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz"
ARCHIVE = "TinyStories_all_data.tar.gz"
JSON_DIR = "TinyStories_all_data"
VOCAB_SHARDS = 10  # llama2.c trains its custom vocabularies on the first 10 of the 50 shards


class DownloadError(DatasetError):
    """A dataset could not be fetched (no network, HTTP error, interrupted or corrupt download)."""


def _download(url: str, target: Path, progress: bool, timeout: float) -> None:
    hint = "TinyStories needs network access; fetch the archive elsewhere and pass its unpacked folder instead (--json-dir)"
    try:
        response = urllib.request.urlopen(url, timeout=timeout)
    except (urllib.error.URLError, OSError) as error:
        raise DownloadError(f"could not download {url}: {getattr(error, 'reason', error)}. {hint}") from None
    with response:
        total = int(response.headers.get("Content-Length") or 0) or None
        received = 0
        columns = (
            TextColumn(f"[bold]download {target.name}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
        )
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("download", total=total)

            def write(file) -> None:
                nonlocal received
                while chunk := response.read(1 << 20):
                    file.write(chunk)
                    received += len(chunk)
                    bar.update(task, advance=len(chunk))
                if total is not None and received != total:
                    raise DownloadError(f"download of {url} ended after {received} of {total} bytes. {hint}")

            try:
                atomic_write(target, write)
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as error:
                raise DownloadError(f"download of {url} was interrupted: {error}. {hint}") from None


def _extract_json(archive: Path, json_dir: Path) -> None:
    """Unpack the archive's .json files into json_dir, all or nothing (via a temporary folder renamed at the end)."""
    partial = json_dir.with_name(f".{json_dir.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)  # left by an earlier, interrupted extraction of ours
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".json"):
                    # Flattened to the bare file name, so no member can write outside json_dir.
                    source = tar.extractfile(member)
                    atomic_write(partial / Path(member.name).name, lambda f, source=source: shutil.copyfileobj(source, f))
    except (tarfile.TarError, EOFError, OSError) as error:
        raise DownloadError(f"{archive} is not a readable .tar.gz archive ({error}); delete it and download again") from None
    if not partial.is_dir():
        raise DownloadError(f"{archive} holds no .json files; is it the TinyStories archive?")
    os.replace(partial, json_dir)


def download_tinystories(dest: str | os.PathLike, url: str = URL, progress: bool = True, timeout: float = 60.0) -> Path:
    """Fetch and unpack the TinyStories archive into `dest`; return the folder of JSON shards.

    Steps already done (archive present, folder unpacked) are skipped, so an
    interrupted run can simply be repeated.
    """
    dest = Path(dest)
    archive = dest / ARCHIVE
    if not archive.is_file():
        _download(url, archive, progress, timeout)
    json_dir = dest / JSON_DIR
    if not json_dir.is_dir():
        _extract_json(archive, json_dir)
    return json_dir


def story_files(json_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The JSON shards of a folder (sorted), or the given file or files."""
    if isinstance(json_dir_or_files, (str, os.PathLike)):
        root = Path(json_dir_or_files)
        if root.is_dir():
            files = sorted(root.glob("*.json"))
            if not files:
                raise DatasetError(f"TinyStories folder {root} holds no .json shards")
            return files
        json_dir_or_files = [root]
    files = [Path(f) for f in json_dir_or_files]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DatasetError(f"TinyStories shards not found: {', '.join(missing) or 'none given'}")
    return files


def iter_stories(json_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike]) -> Iterator[str]:
    """Each entry's "story" field, stripped of surrounding whitespace (as llama2.c does); empty stories are skipped."""
    for file in story_files(json_dir_or_files):
        try:
            entries = json.loads(file.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise DatasetError(f"TinyStories shard {file} is not valid JSON: {error}") from None
        if not isinstance(entries, list):
            raise DatasetError(f"TinyStories shard {file}: expected a JSON list of stories, got {type(entries).__name__}")
        for index, entry in enumerate(entries):
            story = entry.get("story") if isinstance(entry, dict) else None
            if not isinstance(story, str):
                raise DatasetError(f"TinyStories shard {file}: entry {index} is not an object with a string 'story' field")
            story = story.strip()
            if story:
                yield story


def train_tinystories_vocab(
    json_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike],
    vocab_size: int,
    output_prefix: str | os.PathLike,
    shards: int = VOCAB_SHARDS,
) -> SentencePieceTokenizer:
    """Train a SentencePiece vocabulary on the stories of the first `shards` JSON shards, as llama2.c's train_vocab."""
    return train_sentencepiece(iter_stories(story_files(json_dir_or_files)[:shards]), vocab_size, "bpe", output_prefix)


def pretokenize_tinystories(
    json_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    on_shard: Callable[[Path, int], None] | None = None,
) -> dict:
    """Every story as BOS + tokens into uint16 shards in `out_dir` (see `shards.pretokenize`); returns the manifest."""
    return pretokenize(iter_stories(json_dir_or_files), tokenizer, out_dir, shard_tokens, on_shard)
