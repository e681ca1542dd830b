"""The compile cache: generated code (object files, PTX), kept in memory and on disk, under a
key its backend makes of what the code is generated from (`source_digest` of the generator's
sources, the cell's description, the target). Shared by every backend, so none imports
another's loader for it.

Entries are cached in memory (`MEMORY_CACHE_BYTES`, least recently used first out, so a
process that compiles many different networks keeps a flat footprint) and on disk
(`$RANVIER_CACHE`, default ~/.cache/ranvier), so a second process skips code generation
entirely. The cache writes atomically; an unreadable entry is regenerated. The sources are
read once per process (`source_digest`): a generator changed while it runs (a constant
patched to compare two settings in one process) keeps its key, so such an experiment clears
`_MEMORY_CACHE` and points `$RANVIER_CACHE` elsewhere before each compile, or it times the
first setting's code twice.

The disk cache is capped (`$RANVIER_CACHE_MAX_MB`, default 512): writing evicts the
least recently used entries (oldest modification time; a read hit touches its entry)
until the total fits. Checking means listing the whole folder, so a process checks at
its first write and then after each 1/16 of the cap it writes: the folder may exceed the
cap by that much per process meanwhile. Processes share the folder safely: a reader
whose entry another process evicts meanwhile reads nothing and compiles again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_write_bytes
from .cache_folder import cache_dir
from .measured import unreadable

# Object files by cache key, least recently used first; holds at most MEMORY_CACHE_BYTES.
_MEMORY_CACHE: OrderedDict[str, bytes] = OrderedDict()
MEMORY_CACHE_BYTES = 64 * 2**20


DEFAULT_CACHE_MAX_MB = 512


def cache_max_bytes() -> int:
    return int(float(os.environ.get("RANVIER_CACHE_MAX_MB", DEFAULT_CACHE_MAX_MB)) * 2**20)


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    size: int
    mtime: float  # when it was last written or read: the LRU order


def cache_entries() -> list[CacheEntry]:
    """The disk cache's entries, least recently used first (others' temporary files excluded)."""
    entries = []
    with contextlib.suppress(FileNotFoundError):
        for item in os.scandir(cache_dir()):
            if not item.name.endswith(".o"):
                continue
            try:
                stat = item.stat()
            except FileNotFoundError:  # evicted by another process as we listed
                continue
            entries.append(CacheEntry(Path(item.path), stat.st_size, stat.st_mtime))
    return sorted(entries, key=lambda entry: entry.mtime)


def prune_cache(max_bytes: int) -> int:
    """Evict least recently used entries until the cache holds at most `max_bytes`; the
    number evicted."""
    entries = cache_entries()
    total = sum(entry.size for entry in entries)
    evicted = 0
    for entry in entries:
        if total <= max_bytes:
            break
        with contextlib.suppress(FileNotFoundError):  # another process evicted it first
            entry.path.unlink()
            evicted += 1
        total -= entry.size
    return evicted


def clear_cache() -> tuple[int, int]:
    """Delete every entry (a process compiling meanwhile just writes its own again), and
    the machine's measurements that do not read as such (the others are kept: see
    measured.py); the number of files and bytes deleted."""
    entries = cache_entries()
    if cache_dir().is_dir():
        entries += [CacheEntry(path, path.stat().st_size, 0.0) for path in unreadable(cache_dir())]
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            entry.path.unlink()
    return len(entries), sum(entry.size for entry in entries)


def describe_cache() -> str:
    """Where the cache is, its entries, size against the cap, oldest and newest use."""
    entries = cache_entries()
    size = sum(entry.size for entry in entries)
    lines = [f"cache: {cache_dir()}",
             f"entries: {len(entries):,}, {size / 2**20:,.1f} MB of {cache_max_bytes() / 2**20:,.0f} MB "
             f"(RANVIER_CACHE_MAX_MB; least recently used entries go first)"]
    if entries:
        oldest, newest = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.mtime)) for e in (entries[0], entries[-1]))
        lines.append(f"least recently used: {oldest}, most recently used: {newest}")
    kept = sorted(path.name for path in cache_dir().glob("*.json")) if cache_dir().is_dir() else []
    if kept:  # measured once per machine (measured.py); clearing the code keeps them
        lines.append(f"this machine's measurements (split thresholds, GEMM choices): {', '.join(kept)}")
    return "\n".join(lines)


@functools.cache
def source_digest(*folders: str) -> str:
    """A digest of a code generator's sources (the Python files under `folders` of the
    package): compiled code cached under it is made anew when any of them changes."""
    digest = hashlib.sha256()
    package = Path(__file__).parents[1]
    for folder in folders:
        for path in sorted((package / folder).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()


_MAGIC = b"ranvier-object-1\n"


def _read_entry(path: Path) -> bytes | None:
    """The object code of a cache file, or None when it is not an intact entry: LLVM would
    crash the process on a truncated or corrupt object file, so it is checked first."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    header = len(_MAGIC) + 32
    if not raw.startswith(_MAGIC) or len(raw) <= header:
        return None
    digest, code = raw[len(_MAGIC) : header], raw[header:]
    return code if hashlib.sha256(code).digest() == digest else None


def cached_object(key: str, generate: Callable[[], bytes], use_disk: bool = True) -> tuple[bytes, str]:
    """The object code for `key`, and where it came from: "memory", "disk" or "compiled"."""
    if key in _MEMORY_CACHE:
        _MEMORY_CACHE.move_to_end(key)
        return _MEMORY_CACHE[key], "memory"
    path = cache_dir() / f"{key}.o"
    if use_disk and path.is_file():
        code = _read_entry(path)
        if code is not None:
            _remember(key, code)
            with contextlib.suppress(OSError):  # mark it recently used; atimes are often off (noatime)
                os.utime(path)
            return code, "disk"
    code = generate()
    _remember(key, code)
    if use_disk:
        # A read-only or full cache directory only costs the next process a compile.
        with contextlib.suppress(OSError):
            atomic_write_bytes(path, _MAGIC + hashlib.sha256(code).digest() + code)
            _PRUNING.wrote(len(code))
    return code, "compiled"


class _PruneSchedule:
    """When this process lists the folder to enforce the cap: at its first write, then
    after each 1/16 of the cap it writes."""

    unpruned: int | None = None  # bytes written since the last pruning; None before the first

    def wrote(self, size: int) -> None:
        cap = cache_max_bytes()
        if self.unpruned is not None:
            self.unpruned += size
            if self.unpruned < cap // 16:
                return
        prune_cache(cap)
        self.unpruned = 0


_PRUNING = _PruneSchedule()


def _remember(key: str, code: bytes) -> None:
    _MEMORY_CACHE[key] = code
    total = sum(map(len, _MEMORY_CACHE.values()))
    while total > MEMORY_CACHE_BYTES and len(_MEMORY_CACHE) > 1:
        total -= len(_MEMORY_CACHE.popitem(last=False)[1])
