"""The CPU backend: pick kernels by CPU features, generate one native function per cell,
and run it with a single call per compute()."""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from ... import debug, dtypes
from ...errors import RanvierError
from ...flow.graph import Operation, Variable
from ...ops import is_view
from ...runtime import Cell, Instance, Step
from .. import compile_cache
from ..base import DEFAULT_OPTIONS, Capabilities, CompileOptions
from ..kernels import Kernel, Prepared, chosen_kernel
from ..reference import reference_kernel
from . import amx, bf16gemv, codegen, fpmode, jit, parallel_compile, q8gemm, sgemm
from .blas import blas_pointers, blas_thread_setter
from .codegen import FIRST_TABLE_SLOT, Layout
from .kernels import LIBRARY
from .kernels.conv import CONV_KERNEL, PAIRS_KERNEL
from .parallel import split_thresholds, thread_count
from .pool import bind_caller, pool
from .target import CPUTarget, host_target

_CALLBACK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int64)
# A cell of at least this much arithmetic binds its calling thread while it computes
# (pool.bind_caller): the three system calls cost ~5 us, 3% of the MNIST MLP's 0.18 ms bf16
# training step (109 MFLOP), noise beside a compute of a millisecond or more.
BIND_CALLER_FLOPS = 200e6
# The generated GEMMs a kernel may call (`Kernel.calls`), by their slot in a cell's table:
# each one's address on a target, made (compiled, or loaded from the cache) where a cell calls it.
GEMMS: dict[int, Callable[[CPUTarget], int]] = {
    codegen.BF16GEMM: amx.gemm_address,
    codegen.SGEMM_GENERATED: sgemm.gemm_address,
    codegen.SGEMM_ADD: sgemm.add_gemm_address,
    codegen.SGEMM_PACKED: sgemm.packed_gemm_address,
    codegen.SGEMM_PACKED_BF16: lambda target: sgemm.packed_gemm_address(target, narrow=True),
    codegen.DPBF16GEMV: bf16gemv.gemv_address,
    codegen.Q8GEMM: q8gemm.gemm_address,
    codegen.SGEMM_DPBF16: sgemm.pairs_gemm_address,
    codegen.SGEMM_PACKED_DPBF16: lambda target: sgemm.packed_gemm_address(target, pairs=True),
    codegen.SGEMM_WINDOWS: sgemm.windows_gemm_address,
    codegen.SGEMM_WINDOWS_DPBF16: lambda target: sgemm.windows_gemm_address(target, pairs=True),
    codegen.SGEMM_PACKED_DPBF16_PAIRED: lambda target: sgemm.packed_gemm_address(target, pairs=True, paired_a=True),
    codegen.SGEMM_WINDOWS_DPBF16_PAIRED: lambda target: sgemm.windows_gemm_address(target, pairs=True, paired_a=True),
}


@dataclass
class CPUCode:
    """A cell as the CPU backend compiled it (`Cell.native`): its machine code, loaded; the
    layout of the pointer table the code reads; where the code came from ("compiled", or
    the compile cache's "memory" or "disk"); and the steps it calls back into Python for
    (no native kernel runs them: each op's numpy reference does)."""

    code: jit.LoadedCode
    layout: Layout
    origin: str
    python_steps: list[int]

    @staticmethod
    def of(cell: Cell) -> CPUCode:
        """The CPU code of a cell the CPU backend compiled."""
        if not isinstance(cell.native, CPUCode):
            raise RanvierError(f"cell {cell.name} was compiled for the {cell.network.backend_name} backend, not for the CPU")
        return cell.native



def bf16_gemm(target: CPUTarget) -> str | None:
    """What runs `matmul="bfloat16"` products on `target` here: "amx-bf16" (AMX tiles, where
    the OS lets this process use them: asking is the first use), else "avx512bf16" (the
    generated GEMM on bf16 pairs, where it measures faster), else None (they stay float32)."""
    if amx.amx_usable(target):
        return "amx-bf16"
    return "avx512bf16" if sgemm.pairs_supported(target) else None


class CPUBackend:
    name = "cpu"
    step_time_dtype = np.uint64  # cycles, from the counter the generated code reads

    def __init__(self, options: CompileOptions = DEFAULT_OPTIONS):
        self.target: CPUTarget = host_target(options.cpu)
        self.use_disk_cache = options.cache
        self.flush_denormals = options.denormals == "flush"
        if self.flush_denormals and not fpmode.is_x86(self.target.machine.triple):
            raise RanvierError(f"denormals='flush' sets x86's MXCSR; this CPU is {self.target.machine.triple}: use 'keep'")
        # bf16 GEMMs run on AMX tiles; without them (or the OS's permission) on AVX512-BF16's
        # dot products of pairs where the CPU has those; else products stay float32. Only a
        # compile that asks for bf16 asks the OS for the tile state. On any CPU, a constant
        # matrix may be kept in bf16 panels for the products by it that no bf16 GEMM takes
        # (a decode step's vector-matrix ones only stream it), or in int8 blocks.
        products = bf16_gemm(self.target) if options.matmul == "bfloat16" else None
        tiles, pairs = products == "amx-bf16", products == "avx512bf16"
        precisions = ("float32", "bfloat16") if products else ("float32",)
        self.capabilities = Capabilities(rewrites=True, matmul_precisions=precisions, narrow_weights=("bfloat16", "int8"),
                                         pools_convolution=self._pools_convolution)
        # products marked bf16 for their constant's panels never reach a bf16 GEMM elsewhere; a
        # row's product by such a constant streams pairs of bf16 through vdpbf16ps where it can.
        # Kernels that call a GEMM this compile does not run are passed over.
        passed_over = {*(() if tiles else (codegen.BF16GEMM,)),
                       *(() if pairs else (codegen.SGEMM_DPBF16, codegen.SGEMM_PACKED_DPBF16, codegen.SGEMM_WINDOWS_DPBF16,
                                           codegen.SGEMM_PACKED_DPBF16_PAIRED, codegen.SGEMM_WINDOWS_DPBF16_PAIRED)),
                       *(() if sgemm.pairs_supported(self.target) else (codegen.DPBF16GEMV,))}
        self.unavailable = {kernel.name for kernel in LIBRARY.kernels if kernel.calls & passed_over}

    def _pools_convolution(self, conv: Operation, pool: Operation) -> bool:
        """A convolution the windows GEMM multiplies (not Winograd's nor the tiles for few
        filters), and a float32 max pooling after it: ConvPool pools its bands."""
        return self.kernel(conv).name in (CONV_KERNEL, PAIRS_KERNEL) and pool.outputs[0].dtype == dtypes.DT_FLOAT32

    def kernel(self, op: Operation) -> Kernel:
        """The library's kernel for `op` on this target (a step keeps its own: `chosen_kernel`)."""
        return LIBRARY.choose(op, self.unavailable)

    # ---- compile time -----------------------------------------------------------------

    def runs_whole(self, op: Operation) -> bool:
        """Whether a native kernel supports the op as it is (else it decomposes)."""
        return LIBRARY.supports(op, self.unavailable)

    def choose(self, op: Operation) -> Step:
        chosen = self.kernel(op)
        return Step(op, chosen.name, self.target.variant if chosen.native else "python", chosen.cost(op), chosen=chosen)

    def workspace_bytes(self, step: Step) -> int:
        return chosen_kernel(step).workspace_bytes(step.op)

    def in_place(self, op: Operation, source: Variable, target: Variable) -> bool:
        """Whether the op's kernel may write `target` over `source` (see Kernel.in_place):
        asked of ops, before the memory plan, of the kernel the op's step has."""
        return self.kernel(op).may_write_over(op, source, target)

    def shares_storage(self, op: Operation) -> bool:
        """A reshape (or other view) of a local is its input's bytes: the copy kernel
        skips a copy onto itself (logits reshaped for the loss would otherwise be copied)."""
        return is_view(op) and op.type != "Identity"

    def finish(self, cell: Cell) -> None:
        """Generate (or fetch from the cache) the cell's native code."""
        table: list[Variable] = []
        for step in cell.steps:
            for v in [*step.op.inputs, *step.op.outputs]:
                if cell.slot(v) is None and all(t.name != v.name for t in table):
                    table.append(v)
        layout = Layout({s.var.name: s.offset for s in cell.slots}, table)
        for step in cell.steps:
            for prepared in chosen_kernel(step).prepared(step.op):
                if all((p.var.name, p.form) != (prepared.var.name, prepared.form) for p in layout.prepared):
                    layout.prepared.append(prepared)
        self._alias_views(cell, layout)
        description = self._describe(cell, layout)
        # the generator's sources: this backend, the shared LLVM layer, the op definitions
        # (their formulas are generated as code)
        mode = "flush denormals\n" if self.flush_denormals else ""
        key = jit.cache_key(f"{compile_cache.source_digest('backends/cpu', 'backends/llvm', 'ops')}\n{mode}{description}", self.target)

        def generate() -> bytes:
            return parallel_compile.compile_modules(self._modules(cell, layout), self.target)

        code, origin = compile_cache.cached_object(key, generate, self.use_disk_cache)
        python_steps = [i for i, s in enumerate(cell.steps) if s.variant == "python"]
        cell.native = CPUCode(jit.load_object(code, self.target, "cell"), layout, origin, python_steps)
        # Shown whether the code was generated now or came from the cache.
        for kind, what in (("llvm", "LLVM IR"), ("asm", "machine code")):
            if debug.enabled(kind):
                debug.dump(kind, f"cell {cell.name}: {what}", self.code(cell, kind))

    def _modules(self, cell: Cell, layout: Layout) -> list[ir.Module]:
        emitters = [chosen_kernel(step).emit for step in cell.steps]
        return codegen.build_modules(cell.name, self.target, cell.steps, layout, emitters, self.flush_denormals,
                                     parallel_compile.parts())

    def code(self, cell: Cell, kind: str) -> str:
        """The cell's LLVM IR ("llvm": as generated, before LLVM optimizes it) or its
        optimized machine code ("asm"), generated again from the cell's steps."""
        modules = self._modules(cell, CPUCode.of(cell).layout)
        if kind == "llvm":
            return "\n".join(map(str, modules))
        if kind == "asm":
            return "\n".join(jit.assembly(module, self.target) for module in modules)
        raise RanvierError(f"the CPU backend shows its code as 'llvm' or 'asm', not {kind!r}")

    @staticmethod
    def _alias_views(cell: Cell, layout: Layout) -> None:
        """A reshape (or other view) of a global reads the global's memory in place: copying
        a whole KV cache per decoded token to change its shape would cost more than the step."""
        for step in cell.steps:
            op = step.op
            if not is_view(op) or not op.outputs:
                continue
            source, view = op.inputs[0], op.outputs[0]
            if source.name in layout.offsets or view.name not in layout.offsets or view.name in cell.roles:
                continue
            layout.aliases[view.name] = layout.aliases.get(source.name, source)
            del layout.offsets[view.name]
            layout.table.append(view)

    @staticmethod
    def _describe(cell: Cell, layout: Layout) -> str:
        """Everything the generated code depends on, as text (the compile cache key)."""
        # Kernels split their work this many ways, from these sizes on.
        lines = [f"threads {thread_count()}, {split_thresholds() if thread_count() > 1 else 'never split'}"]
        for step in cell.steps:
            op = step.op
            lines.append(f"{step.kernel} {op.type} {sorted(op.attrs.items())}")
            for v in [*op.inputs, *op.outputs, *([step.workspace] if step.workspace else [])]:
                where = layout.offsets.get(v.name)
                place = f"@{where}" if where is not None else f"#{layout.slot(v)}"
                constant = hashlib.sha1(np.ascontiguousarray(v.data).tobytes()).hexdigest() if v.data is not None and v.size <= 16 else ""
                lines.append(f"  {v.name} {v.dtype}{list(v.shape)} {place} {constant}")
        lines += [f"prepared {p.var.name} as {p.form}" for p in layout.prepared]
        return "\n".join(lines)

    # ---- run time -----------------------------------------------------------------------

    def step_seconds(self, instance: Instance) -> np.ndarray:
        """The cycle counts the generated code accumulated, in seconds."""
        return instance.step_time.astype(np.float64) / jit.cycles_per_second()

    def peak_gflops(self, matmul: str, product_seconds: Callable[[int], float]) -> tuple[float, str] | None:
        return None  # this machine's fp32 GEMM (numpy's BLAS), whatever the run's precision

    def all_cores_seconds(self, instance: Instance) -> np.ndarray:
        return instance.all_cores_time.astype(np.float64) / jit.cycles_per_second()

    def bind(self, cell: Cell, instance: Instance) -> Callable[[], None]:
        native = CPUCode.of(cell)
        layout = native.layout
        status = np.zeros(1, np.int64)
        fallbacks = {i: reference_kernel(cell.steps[i].op, instance) for i in native.python_steps}
        errors: list[BaseException] = []

        def run_fallback(index: int) -> None:
            try:
                fallbacks[index]()
            except BaseException as error:  # noqa: BLE001  (cannot unwind through native frames)
                errors.append(error)
                status[0] = index + 1

        callback = _CALLBACK_TYPE(run_fallback)
        blas_sgemm, dgemm, sgemv, dgemv = blas_pointers()
        table = (ctypes.c_void_p * (FIRST_TABLE_SLOT + len(layout.table) + len(layout.prepared)))()
        table[codegen.DATA] = instance.buffer.ctypes.data
        table[codegen.STATUS] = status.ctypes.data
        table[codegen.PROFILE] = instance.step_time.ctypes.data
        table[codegen.ALL_CORES] = instance.all_cores_time.ctypes.data
        table[codegen.CALLBACK] = ctypes.cast(callback, ctypes.c_void_p).value
        table[codegen.SGEMM], table[codegen.DGEMM] = blas_sgemm, dgemm
        table[codegen.SGEMV], table[codegen.DGEMV] = sgemv, dgemv
        table[codegen.BLAS_THREADS] = blas_thread_setter()
        workers = pool()
        workers.ensure(thread_count() - 1)
        bind = thread_count() > 1 and sum(step.flops for step in cell.steps) >= BIND_CALLER_FLOPS
        table[codegen.POOL] = workers.run_address
        for slot in sorted({slot for step in cell.steps for slot in chosen_kernel(step).calls}):
            table[slot] = GEMMS[slot](self.target)
        for k, var in enumerate(layout.table):
            table[FIRST_TABLE_SLOT + k] = instance.view(layout.aliases.get(var.name, var)).ctypes.data
        def made(p: Prepared) -> np.ndarray:
            return cell.network.prepared(p.var, p.form, self.target.key(), lambda value: p.make(value, self.target))

        prepared = [made(p) for p in layout.prepared]
        for p, array in zip(layout.prepared, prepared):
            table[layout.prepared_slot(p.var, p.form)] = array.ctypes.data
        function = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native.code.address)
        # what the code reads, alive as long as `run` is (its default argument holds it)
        keep_alive = (callback, table, status, native.code, workers, prepared)

        def run(_keep_alive: tuple[object, ...] = keep_alive) -> None:
            mask = bind_caller() if bind else None
            try:
                function(ctypes.addressof(table))
            finally:
                if mask is not None:
                    os.sched_setaffinity(0, mask)
            if status[0]:
                step = cell.steps[int(status[0]) - 1]
                status[0] = 0
                cause = errors.pop() if errors else None
                errors.clear()
                if isinstance(cause, RanvierError):
                    raise cause
                if cause is not None:
                    raise RanvierError(f"{step.op.type} op {step.op.name} failed: {cause}") from cause
                # A native kernel met bad data (an index out of range): the reference
                # kernel of the step says exactly which value and what range.
                reference_kernel(step.op, instance)()
                raise RanvierError(f"{step.op.type} op {step.op.name} failed: an index is out of range")

        return run
