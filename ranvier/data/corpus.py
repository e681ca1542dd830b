"""A text corpus every user already has: the Python standard library's own source.

Tens of megabytes of real, varied text are on every machine that runs ranvier, so a
language model can be trained and tested offline with nothing downloaded. Any text
file or folder can be given instead. `unigram_entropy` gives the loss a model that
ignores context entirely would reach: the baseline a trained language model must beat.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ..errors import RanvierError

# Suffixes read from a folder given as a corpus.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")

# Folder names never read: tests (deliberately odd files, and not representative code),
# third-party packages, caches, and hidden folders (checked separately).
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


class CorpusError(RanvierError):
    """A corpus file or folder is missing, empty or not text."""


def stdlib_dir() -> Path:
    """Where this interpreter's standard-library source lives."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not (path / "os.py").is_file():
        raise CorpusError(
            f"the Python standard library source was not found at {path} (an embedded or frozen Python?); "
            "give a text file or folder instead"
        )
    return path


def corpus_files(path: str | os.PathLike | None = None, suffixes: Iterable[str] = TEXT_SUFFIXES) -> list[Path]:
    """The files of a corpus, sorted by relative path so every run reads them in the same order.

    `path` None means the standard library's `*.py` files; a file is itself; a folder
    means its files with the given suffixes, outside test, package and hidden folders.
    """
    if path is None:
        root, suffixes = stdlib_dir(), (".py",)
    else:
        root = Path(path)
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise CorpusError(f"corpus {root} does not exist")
    wanted = tuple(suffixes)
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned in place so that os.walk never descends into them (site-packages can be huge).
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS and not d.startswith(".")]
        files.extend(Path(folder, name) for name in names if name.endswith(wanted))
    if not files:
        raise CorpusError(f"corpus folder {root} holds no {'/'.join(wanted)} files")
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def iter_documents(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> Iterator[str]:
    """Each file of the corpus as one document (UTF-8), stopping after `max_bytes` bytes of text.

    The document that crosses the cap is cut at a character boundary, so the total is
    at most `max_bytes` UTF-8 bytes.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise CorpusError(f"max_bytes must be positive, got {max_bytes}")
    remaining = max_bytes
    for file in corpus_files(path):
        data = file.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise CorpusError(f"corpus file {file} is not UTF-8 text: {error}") from None
        if remaining is not None:
            if len(data) > remaining:
                text = data[:remaining].decode("utf-8", errors="ignore")  # drops only a character cut in half
            remaining -= min(len(data), remaining)
        if text:
            yield text
        if remaining == 0:
            return


def read_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> str:
    """The whole corpus as one string, documents separated by a newline.

    See `iter_documents`; the separators are not counted in `max_bytes`.
    """
    return "\n".join(iter_documents(path, max_bytes))


def entropy_from_counts(counts: np.ndarray) -> float:
    """Shannon entropy, in nats, of the distribution given by occurrence counts."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        raise CorpusError("entropy of an empty distribution")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def unigram_entropy(token_ids: Iterable[int] | np.ndarray) -> float:
    """Entropy of the token frequencies, in nats per token.

    A model predicting each token from its frequency alone reaches this cross-entropy
    loss; a language model that uses context must go below it.
    """
    ids = np.asarray(token_ids if isinstance(token_ids, np.ndarray) else list(token_ids))
    if ids.size == 0:
        raise CorpusError("unigram entropy of an empty token sequence")
    if not np.issubdtype(ids.dtype, np.integer):
        raise CorpusError(f"unigram entropy needs integer token ids, got {ids.dtype}")
    if ids.min() < 0:
        raise CorpusError(f"unigram entropy: negative token id {int(ids.min())}")
    return entropy_from_counts(np.bincount(ids.ravel().astype(np.int64)))
