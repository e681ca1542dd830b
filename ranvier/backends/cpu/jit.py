"""Turning a cell's LLVM module into callable machine code, with a compile cache.

Code is optimized with LLVM's new pass manager (-O3, without its auto-vectorizer and
unroller: kernels are explicit vector loops) for the target CPU and emitted
as an object file, which MCJIT loads. Object files are cached in memory and on disk
(`$RANVIER_CACHE`, default ~/.cache/ranvier), keyed by the cell's description, the
CPU and its features, and ranvier's version, so a second process skips code generation
entirely. The cache writes atomically; an unreadable entry is regenerated.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir

from ...atomic import atomic_write_bytes
from ...version import __version__
from .target import CPUTarget

_MEMORY_CACHE: dict[str, bytes] = {}
_ENGINES: list[llvm.ExecutionEngine] = []  # loaded code must outlive every cell that uses it


def cache_dir() -> Path:
    return Path(os.environ.get("RANVIER_CACHE", Path.home() / ".cache" / "ranvier"))


def cache_key(description: str, target: CPUTarget) -> str:
    return hashlib.sha256(f"{__version__}\n{target.key()}\n{description}".encode()).hexdigest()


def compile_object(module: ir.Module, target: CPUTarget) -> bytes:
    return target.machine.emit_object(_optimized(module, target))


def assembly(module: ir.Module, target: CPUTarget) -> str:
    """The machine code compile_object makes of `module`, as assembly text."""
    return target.machine.emit_assembly(_optimized(module, target))


def _optimized(module: ir.Module, target: CPUTarget) -> llvm.ModuleRef:
    parsed = llvm.parse_assembly(str(module))
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


def load_object(code: bytes, target: CPUTarget, symbol: str) -> int:
    """Load an object file into a fresh engine and return the address of `symbol`."""
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), target.machine)
    engine.add_object_file(llvm.ObjectFileRef.from_data(code))
    engine.finalize_object()
    _ENGINES.append(engine)
    return engine.get_function_address(symbol)


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
        return _MEMORY_CACHE[key], "memory"
    path = cache_dir() / f"{key}.o"
    if use_disk and path.is_file():
        code = _read_entry(path)
        if code is not None:
            _MEMORY_CACHE[key] = code
            return code, "disk"
    code = generate()
    _MEMORY_CACHE[key] = code
    if use_disk:
        # A read-only or full cache directory only costs the next process a compile.
        with contextlib.suppress(OSError):
            atomic_write_bytes(path, _MAGIC + hashlib.sha256(code).digest() + code)
    return code, "compiled"


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
    read = ctypes.CFUNCTYPE(ctypes.c_uint64)(load_object(compile_object(module, target), target, "cycles"))
    start_cycles, start = read(), time.perf_counter()
    time.sleep(0.05)
    return (read() - start_cycles) / (time.perf_counter() - start)
