"""Turning a cell's LLVM module into callable machine code, with a compile cache.

Code is optimized with LLVM's new pass manager (-O3, without its auto-vectorizer and
unroller: kernels are explicit vector loops) for the target CPU and emitted
as an object file, which MCJIT loads. Object files are cached in memory and on disk
(`$RANVIER_CACHE`, default ~/.cache/ranvier), keyed by the cell's description, the
CPU and its features, and ranvier's version, so a second process skips code generation
entirely. The cache writes atomically; an unreadable entry is regenerated.

Loaded code lives as long as something uses it: `load_object` returns a `LoadedCode`
that owns its execution engine (and the memory LLVM mapped for it), shared by every
cell compiled to the same object code and freed with the last of them. The in-memory
cache of object files is bounded too (`MEMORY_CACHE_BYTES`), so a process that
compiles many different networks keeps a flat footprint. The sources are read once per
process (`source_digest`): a generator changed while it runs (a constant patched to
compare two settings in one process) keeps its key, so such an experiment clears
`_MEMORY_CACHE` and points `$RANVIER_CACHE` elsewhere before each compile, or it times
the first setting's code twice.

The disk cache is capped (`$RANVIER_CACHE_MAX_MB`, default 512): writing evicts the
least recently used entries (oldest modification time; a read hit touches its entry)
until the total fits. Checking means listing the whole folder, so a process checks at
its first write and then after each 1/16 of the cap it writes: the folder may exceed the
cap by that much per process meanwhile. Processes share the folder safely: a reader
whose entry another process evicts meanwhile reads nothing and compiles again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir

from ...atomic import atomic_write_bytes
from ...version import __version__
from ..cache_folder import cache_dir
from .measured import unreadable
from .target import CPUTarget

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


def generated_function(symbol: str, generator: Path, target: CPUTarget, build: Callable[[CPUTarget], ir.Module]) -> LoadedCode:
    """A function generated once per process (a GEMM the cells call through their pointer
    table), compiled for `target` and cached in memory and on disk like cell code, under
    a key of its generator's source and the IR helpers' (irutil, convert), so editing any recompiles it."""
    digest = hashlib.sha256()
    for path in (generator, *(Path(__file__).parent.parent / "llvm" / name for name in ("irutil.py", "convert.py"))):
        digest.update(path.read_bytes())
    code, _ = cached_object(cache_key(f"{symbol}\n{digest.hexdigest()}", target), lambda: compile_object(build(target), target))
    return load_object(code, target, symbol)


@functools.cache
def source_digest(*folders: str) -> str:
    """A digest of a code generator's sources (the Python files under `folders` of the
    package): compiled code cached under it is made anew when any of them changes."""
    digest = hashlib.sha256()
    package = Path(__file__).parents[2]
    for folder in folders:
        for path in sorted((package / folder).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(description: str, target: CPUTarget) -> str:
    # (names a .flow file held as bytes that are not UTF-8 are read as surrogates: encoded as they are)
    return hashlib.sha256(f"{__version__}\n{target.key()}\n{description}".encode(errors="surrogatepass")).hexdigest()


def compile_object(module: ir.Module, target: CPUTarget) -> bytes:
    """Machine code for `module`, optimized."""
    return compile_text(str(module), target=target)


def assembly(module: ir.Module, target: CPUTarget) -> str:
    """The machine code compile_object makes of `module`, as assembly text."""
    return str(target.machine.emit_assembly(_optimized(str(module), target=target)))


def compile_text(*texts: str, target: CPUTarget) -> bytes:
    """Machine code for modules' IR texts, linked into one module and optimized."""
    return bytes(target.machine.emit_object(_optimized(*texts, target=target)))


def _optimized(*texts: str, target: CPUTarget) -> llvm.ModuleRef:
    parsed = llvm.parse_assembly(texts[0])
    for text in texts[1:]:
        parsed.link_in(llvm.parse_assembly(text))
    parsed.verify()
    options = llvm.create_pipeline_tuning_options(speed_level=3)
    # Kernels are vectorized by construction; LLVM's loop vectorizer and unroller only
    # multiply code (loops have small constant trip counts) and compile time, not speed.
    options.loop_vectorization = False
    options.slp_vectorization = False
    options.loop_unrolling = False
    builder = llvm.create_pass_builder(target.machine, options)
    builder.getModulePassManager().run(parsed, builder)
    return parsed


_BUNDLE = b"ranvier-objects-1\n"


def bundle(objects: list[bytes]) -> bytes:
    """Several object files as one piece of code (a cell compiled in parts): cached and
    loaded as one, the calls between them linked when it is loaded."""
    if len(objects) == 1:
        return objects[0]
    sizes = b"".join(len(o).to_bytes(8, "little") for o in objects)
    return _BUNDLE + len(objects).to_bytes(4, "little") + sizes + b"".join(objects)


def unbundled(code: bytes) -> list[bytes]:
    """The object files of `code` (one, or a bundle's)."""
    if not code.startswith(_BUNDLE):
        return [code]
    at = len(_BUNDLE) + 4
    count = int.from_bytes(code[len(_BUNDLE) : at], "little")
    sizes = [int.from_bytes(code[at + 8 * k : at + 8 * k + 8], "little") for k in range(count)]
    at += 8 * count
    objects = []
    for size in sizes:
        objects.append(code[at : at + size])
        at += size
    return objects


class LoadedCode:
    """Object code loaded as machine code; the code is unmapped when this is collected,
    so whoever calls into it (a cell, a cached helper) must hold a reference."""

    def __init__(self, code: bytes, target: CPUTarget, symbol: str):
        self._engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), target.new_machine())
        for part in unbundled(code):  # the engine's linker resolves the parts' calls to each other
            self._engine.add_object_file(llvm.ObjectFileRef.from_data(part))
        self._engine.finalize_object()
        self.address: int = self._engine.get_function_address(symbol)
        self.digest = hashlib.sha256(code).hexdigest()  # names this machine code (measurements of it are kept under it)

    def address_of(self, symbol: str) -> int:
        """Another exported function of the same code."""
        return int(self._engine.get_function_address(symbol))


_LOADED: weakref.WeakValueDictionary[tuple[bytes, str], LoadedCode] = weakref.WeakValueDictionary()


def load_object(code: bytes, target: CPUTarget, symbol: str) -> LoadedCode:
    """`code` loaded into this process, shared with every live holder of the same code."""
    key = (hashlib.sha256(code).digest() + target.key().encode(), symbol)
    loaded = _LOADED.get(key)
    if loaded is None:
        loaded = _LOADED[key] = LoadedCode(code, target, symbol)
    return loaded


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


@functools.cache
def cycles_per_second() -> float:
    """The rate of the cycle counter the generated code reads (llvm.readcyclecounter)."""
    module = ir.Module(name="clock")
    counter = ir.Function(module, ir.FunctionType(ir.IntType(64), []), name="llvm.readcyclecounter")
    function = ir.Function(module, ir.FunctionType(ir.IntType(64), []), name="cycles")
    builder = ir.IRBuilder(function.append_basic_block())
    builder.ret(builder.call(counter, []))
    from .target import host_target

    target = host_target()
    loaded = load_object(compile_object(module, target), target, "cycles")
    read = ctypes.CFUNCTYPE(ctypes.c_uint64)(loaded.address)
    start_cycles, start = read(), time.perf_counter()
    time.sleep(0.05)
    return float(read() - start_cycles) / (time.perf_counter() - start)
