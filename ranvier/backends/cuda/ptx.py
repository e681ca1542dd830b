"""PTX from LLVM IR, and PTX checked by NVIDIA's assembler.

GPU kernels are LLVM IR like the CPU's, built from the same formulas on the same IR values
(`ranvier.backends.llvm`); LLVM's NVPTX back end, which llvmlite carries, turns them into
PTX, the GPU's portable assembly, that the driver compiles for the device when a module
loads. `ptxas` (from the CUDA toolkit or the `nvidia-cuda-nvcc` wheel) assembles PTX
ahead of time: without a GPU it still proves each generated kernel valid for an
architecture, and says how many registers a thread of it takes.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir

from ...errors import RanvierError

TRIPLE = "nvptx64-nvidia-cuda"
ARCHITECTURE = "sm_90"  # Hopper (H100, H200): the GPUs this project is lent
# PTX ISA 8.0: what CUDA 12.0 and later drivers load, and the first with sm_90.
PTX_FEATURES = "+ptx80"


@functools.cache
def _initialize() -> None:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()


@functools.cache
def target_machine(architecture: str = ARCHITECTURE) -> llvm.TargetMachine:
    """LLVM's NVPTX code generator for one GPU architecture ("sm_80", "sm_90", ...)."""
    if not re.fullmatch(r"sm_\d+a?", architecture):
        raise RanvierError(f"GPU architecture {architecture!r}: expected a name like 'sm_90'")
    _initialize()
    return llvm.Target.from_triple(TRIPLE).create_target_machine(cpu=architecture, features=PTX_FEATURES, opt=3)


def gpu_module(name: str, architecture: str = ARCHITECTURE) -> ir.Module:
    """An empty module for GPU kernels: NVPTX's triple and data layout."""
    module = ir.Module(name)
    module.triple = TRIPLE
    module.data_layout = str(target_machine(architecture).target_data)
    return module


def mark_kernel(module: ir.Module, function: ir.Function, threads: int = 0, blocks_per_multiprocessor: int = 0) -> None:
    """Make `function` a kernel entry point (`.entry` in PTX), launchable from the host, with
    its launch bounds (CUDA's `__launch_bounds__`) where it has them: at most `threads`
    threads a block (`.maxntid`: ptxas may then keep a register budget for that block size
    alone), and at least `blocks_per_multiprocessor` such blocks resident on a
    multiprocessor at once (`.minnctapersm`: ptxas caps a thread's registers at 65,536 /
    (threads · blocks), spilling if it must). 0: no bound."""
    annotations = module.add_named_metadata("nvvm.annotations")
    bounds = {"kernel": 1, "maxntidx": threads, "minctasm": blocks_per_multiprocessor if threads else 0}
    for name, value in bounds.items():
        if value:
            annotations.add(module.add_metadata([function, name, ir.Constant(ir.IntType(32), value)]))


def emit_ptx(module: ir.Module, architecture: str = ARCHITECTURE) -> str:
    """The module optimized and written as PTX for `architecture`."""
    machine = target_machine(architecture)
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    builder.getModulePassManager().run(parsed, builder)
    return str(machine.emit_assembly(parsed))


def ptxas_path() -> str | None:
    """NVIDIA's PTX assembler: on the PATH (a CUDA toolkit), else a CUDA wheel's."""
    found = shutil.which("ptxas")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    return wheel_ptxas(list(spec.submodule_search_locations or []) if spec else [])


def wheel_ptxas(roots: list[str]) -> str | None:
    """ptxas inside the `nvidia` namespace package at `roots`: nvidia/cu13/bin (the
    nvidia-cuda-nvcc 13 wheel) or nvidia/cuda_nvcc/bin (its CUDA 12 wheel)."""
    for root in roots:
        for candidate in sorted(Path(root).glob("*/bin/ptxas")):
            return str(candidate)
    return None


@dataclass(frozen=True)
class Assembled:
    """A kernel module assembled for one architecture: the machine code (a cubin) and
    what ptxas reported of each kernel (registers per thread, spilled bytes)."""

    cubin: bytes
    report: str

    def registers(self, kernel: str) -> int:
        """Registers a thread of `kernel` uses (more limit how many threads run at once)."""
        match = re.search(rf"Compiling entry function '{re.escape(kernel)}'.*?Used (\d+) registers", self.report, re.DOTALL)
        if match is None:
            raise RanvierError(f"ptxas reported nothing for kernel {kernel!r}")
        return int(match.group(1))


@functools.cache
def ptxas_version() -> str:
    """The assembler's version line (its machine code and register counts depend on it), or
    "" where there is none."""
    ptxas = ptxas_path()
    if ptxas is None:
        return ""
    done = subprocess.run([ptxas, "--version"], check=False, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


@functools.cache
def _splits(ptxas: str) -> bool:
    """Whether this ptxas can spread its work over threads (-split-compile, CUDA 12.4 on)."""
    done = subprocess.run([ptxas, "--help"], check=False, capture_output=True, text=True)
    return "split-compile" in done.stdout


def assemble(ptx: str, architecture: str = ARCHITECTURE) -> Assembled:
    """Assemble PTX for `architecture` with ptxas; a kernel it rejects raises, with its message."""
    ptxas = ptxas_path()
    if ptxas is None:
        raise RanvierError("ptxas was not found: install the CUDA toolkit or `pip install nvidia-cuda-nvcc`")
    with tempfile.TemporaryDirectory(prefix="ranvier-ptx-") as folder:
        source, cubin = Path(folder) / "kernels.ptx", Path(folder) / "kernels.cubin"
        source.write_text(ptx)
        threads = ["-split-compile", "0"] if _splits(ptxas) else []  # optimize on every core
        done = subprocess.run([ptxas, f"-arch={architecture}", "-v", *threads, str(source), "-o", str(cubin)],
                              check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise RanvierError(f"ptxas rejected the generated PTX for {architecture}:\n{done.stderr.strip()}")
        return Assembled(cubin.read_bytes(), done.stderr)
