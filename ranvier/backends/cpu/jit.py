"""Turning a cell's LLVM module into callable machine code.

Code is optimized with LLVM's new pass manager (-O3, without its auto-vectorizer and
unroller: kernels are explicit vector loops) for the target CPU and emitted as an object
file, which MCJIT loads. Object files are kept in the compile cache (`backends/compile_cache.py`),
keyed by the cell's description, the CPU and its features, and ranvier's version
(`cache_key`).

Loaded code lives as long as something uses it: `load_object` returns a `LoadedCode`
that owns its execution engine (and the memory LLVM mapped for it), shared by every
cell compiled to the same object code and freed with the last of them.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import hashlib
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir

from ...version import __version__
from ..compile_cache import cached_object
from .target import CPUTarget


def generated_function(symbol: str, generator: Path, target: CPUTarget, build: Callable[[CPUTarget], ir.Module]) -> LoadedCode:
    """A function generated once per process (a GEMM the cells call through their pointer
    table), compiled for `target` and cached in memory and on disk like cell code, under
    a key of the sources its code is made of (`generator_sources`), so editing any recompiles it."""
    digest = hashlib.sha256()
    for path in generator_sources(generator):
        digest.update(path.read_bytes())
    code, _ = cached_object(cache_key(f"{symbol}\n{digest.hexdigest()}", target), lambda: compile_object(build(target), target))
    return load_object(code, target, symbol)


def generator_sources(generator: Path) -> list[Path]:
    """The generator and the backend modules it imports, directly or through one another:
    the IR helpers, the Values and pointers it is written over, a sibling generator whose
    layout or instructions it shares (bf16gemv.py's panels are sgemm.py's)."""
    backends = Path(__file__).resolve().parent.parent
    found: list[Path] = []
    pending = [generator.resolve()]
    while pending:
        path = pending.pop()
        if path in found:
            continue
        found.append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            package = path.parents[node.level - 1].joinpath(*(node.module or "").split("."))
            for candidate in (package.with_suffix(".py"), *(package / f"{alias.name}.py" for alias in node.names)):
                if candidate.is_file() and backends in candidate.parents:
                    pending.append(candidate)
    return sorted(found)


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
