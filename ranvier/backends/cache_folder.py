"""Where ranvier keeps what it makes once per machine: compiled code (compile_cache.py), the
machine's measurements (measured.py), prepared corpora. Every backend and job finds
the folder here, so none imports another's loader for it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$RANVIER_CACHE`, default ~/.cache/ranvier."""
    return Path(os.environ.get("RANVIER_CACHE", Path.home() / ".cache" / "ranvier"))
