"""One persistent pool of worker threads per process, shared by every generated kernel.

A kernel that splits its work into parts calls `ranvier_pool_run(task, blocks, count,
stride)` (through the cell's pointer table): part i is `task(blocks + i·stride)`. The
caller publishes the job, wakes the workers, claims parts itself like any worker, and
returns when every part has finished. Parts are claimed one at a time from a shared
counter, so a worker that starts late or a part that runs long balances out.

Why not a thread per part: starting and joining a thread costs tens of microseconds, so
only kernels of milliseconds were worth splitting. A pool's workers spin for about
1 ms after a job (a step's next kernel usually comes sooner), then sleep on a
condition variable; a job reaches spinning workers in well under a microsecond. Each
worker is bound to a CPU of its own (`PIN_ENVIRONMENT`), the first left to the callers.

The job lives in one 64-bit word, (job number << 32) | (next part << 16) | part count,
claimed by compare-and-swap: a worker late from one job can never claim a part of the
next, and the task, blocks and stride it reads after a claim cannot change before the
part is done (the caller waits for it). A second thread that calls while a job runs
(another cell on another Python thread, or a part that splits again) runs its parts
itself, in order. After fork() the child's pool has no workers; it starts its own.
On x86 a job also carries the caller's floating-point modes (MXCSR: flushing denormals or
not), which each worker takes on before it claims a part.

The machine code is built here with llvmlite like every kernel, compiled once per
process, and never unloaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import statistics
import threading
import time
from pathlib import Path

from llvmlite import ir

from .. import compile_cache
from . import fpmode, jit
from .target import CPUTarget, host_target

MAX_WORKERS = 255  # part counts stay below 2^16; workers beyond the cores would only wait
# Time-stamp counter ticks (~1 ms) a worker spins before it sleeps. 0.1 ms was enough back
# to back, but not after a pause: on a shared 2-core VM, ResNet-18 b1 called 0.2 s after its
# last call took 17.4-18.3 ms with 0.1 ms spins, 13.8-15.1 ms with 1 ms (13 ms back to back,
# three alternated runs; one thread alone showed no such pause cost). The likely cause: a
# worker woken on a vCPU the host has just rescheduled falls asleep again in the short gaps
# between that call's jobs, and each wake costs a job its start.
SPIN_TICKS = 1 << 21
SYNC_BYTES = 64  # room for a pthread mutex or condition variable (40 and 48 bytes on glibc x86-64)
CPU_SET_BYTES = 128  # glibc's cpu_set_t: CPUs 0 to 1023
# Workers are each bound to one CPU of the process's affinity mask, from its second on, unless
# this is "0". Left free, a worker woken after a pause was often placed on the caller's CPU
# and shared it for milliseconds: ResNet-18 b1 called 0.2 s after its last call took
# 20.8-22.4 ms with the worker free, 13.0-16.9 bound to either CPU (the caller then moved to
# the other; a 2-core VM, three alternated runs). Several processes on one machine bind their
# workers alike, so each of those CPUs takes one worker of each, and the callers float.
PIN_ENVIRONMENT = "RANVIER_PIN_WORKERS"
SYMBOLS = ("ranvier_pool_run", "ranvier_pool_grow", "ranvier_pool_forget", "ranvier_pool_nothing")

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
BYTE_PTR = I8.as_pointer()
TASK = ir.FunctionType(BYTE_PTR, [BYTE_PTR])
RUN = ir.FunctionType(ir.VoidType(), [TASK.as_pointer(), BYTE_PTR, I64, I64])


class _Emitter:
    """The pool's module: its state as globals, and the functions over it."""

    def __init__(self, target: CPUTarget):
        self.target = target
        self.module = module = ir.Module(name="ranvier_pool")
        module.triple = target.machine.triple
        module.data_layout = str(target.machine.target_data)
        self.job = self._global("job", I64)  # (number << 32) | (next << 16) | count
        self.number = self._global("number", I64)  # the last job's number: what workers wait on
        self.pending = self._global("pending", I64)  # parts of the job not yet finished
        self.busy = self._global("busy", I64)  # 1 while a caller owns the pool
        self.sleepers = self._global("sleepers", I64)
        self.workers = self._global("workers", I64)
        self.task = self._global("task", TASK.as_pointer())
        self.blocks = self._global("blocks", BYTE_PTR)
        self.stride = self._global("stride", I64)
        # the caller's floating-point modes (x86's MXCSR), which the workers take on for its job
        self.mxcsr = self._global("mxcsr", I32) if fpmode.is_x86(module.triple) else None
        self.mutex = self._global("mutex", ir.ArrayType(I8, SYNC_BYTES))
        self.cond = self._global("cond", ir.ArrayType(I8, SYNC_BYTES))
        self.threads = self._global("threads", ir.ArrayType(I64, MAX_WORKERS))
        void = ir.VoidType()
        sync = [BYTE_PTR, BYTE_PTR]
        self.libc = {
            name: ir.Function(module, type_, name=name)
            for name, type_ in {
                "pthread_create": ir.FunctionType(I32, [I64.as_pointer(), BYTE_PTR, TASK.as_pointer(), BYTE_PTR]),
                "pthread_detach": ir.FunctionType(I32, [I64]),
                "pthread_setaffinity_np": ir.FunctionType(I32, [I64, I64, BYTE_PTR]),
                "pthread_mutex_init": ir.FunctionType(I32, sync),
                "pthread_mutex_lock": ir.FunctionType(I32, [BYTE_PTR]),
                "pthread_mutex_unlock": ir.FunctionType(I32, [BYTE_PTR]),
                "pthread_cond_init": ir.FunctionType(I32, sync),
                "pthread_cond_wait": ir.FunctionType(I32, sync),
                "pthread_cond_broadcast": ir.FunctionType(I32, [BYTE_PTR]),
                "sched_yield": ir.FunctionType(I32, []),
            }.items()
        }
        self.ticks = ir.Function(module, ir.FunctionType(I64, []), name="llvm.readcyclecounter")
        x86 = fpmode.is_x86(module.triple)
        self.pause = ir.Function(module, ir.FunctionType(void, []), name="llvm.x86.sse2.pause") if x86 else None
        self.drain = self._drain()
        worker = self._worker()
        self._run()
        self._grow(worker)
        self._forget()
        _, b = self._function(SYMBOLS[3], TASK, exported=True)  # a part that does nothing: the cost of a job
        b.ret(ir.Constant(BYTE_PTR, None))

    def _global(self, name: str, type_: ir.Type) -> ir.GlobalVariable:
        variable = ir.GlobalVariable(self.module, type_, name=f"pool_{name}")
        variable.linkage = "internal"
        variable.initializer = ir.Constant(type_, None)
        variable.align = 64  # each its own cache line: workers poll some while others change
        return variable

    def _function(self, name: str, type_: ir.FunctionType, exported: bool) -> tuple[ir.Function, ir.IRBuilder]:
        function = ir.Function(self.module, type_, name=name)
        if not exported:
            function.linkage = "internal"
        return function, ir.IRBuilder(function.append_basic_block("entry"))

    @staticmethod
    def _load(b: ir.IRBuilder, pointer: ir.Value) -> ir.Value:
        return b.load_atomic(pointer, "seq_cst", 8)

    @staticmethod
    def _store(b: ir.IRBuilder, value, pointer: ir.Value) -> None:
        b.store_atomic(value if isinstance(value, ir.Value) else ir.Constant(I64, value), pointer, "seq_cst", 8)

    def _relax(self, b: ir.IRBuilder) -> None:
        if self.pause is not None:
            b.call(self.pause, [])

    def _sync(self, b: ir.IRBuilder, variable: ir.GlobalVariable) -> ir.Value:
        return b.bitcast(variable, BYTE_PTR)

    def _drain(self) -> ir.Function:
        """drain(number): claim and run parts of job `number` until none is left."""
        function, b = self._function("pool_drain", ir.FunctionType(ir.VoidType(), [I64]), exported=False)
        number = function.args[0]
        loop, claim, run, done = (function.append_basic_block(n) for n in ("loop", "claim", "run", "done"))
        b.branch(loop)
        b.position_at_end(loop)
        word = self._load(b, self.job)
        ours = b.icmp_unsigned("==", b.lshr(word, ir.Constant(I64, 32)), number)
        part = b.and_(b.lshr(word, ir.Constant(I64, 16)), ir.Constant(I64, 0xFFFF))
        left = b.icmp_unsigned("<", part, b.and_(word, ir.Constant(I64, 0xFFFF)))
        b.cbranch(b.and_(ours, left), claim, done)
        b.position_at_end(claim)
        swapped = b.cmpxchg(self.job, word, b.add(word, ir.Constant(I64, 1 << 16)), "seq_cst", "seq_cst")
        b.cbranch(b.extract_value(swapped, 1), run, loop)
        b.position_at_end(run)
        block = b.gep(b.load(self.blocks), [b.mul(part, b.load(self.stride))])
        b.call(b.load(self.task), [block])
        b.atomic_rmw("sub", self.pending, ir.Constant(I64, 1), "seq_cst")
        b.branch(loop)
        b.position_at_end(done)
        b.ret_void()
        return function

    def _worker(self) -> ir.Function:
        """A worker: wait for a new job number (spinning, then asleep), drain it, repeat."""
        function, b = self._function("pool_worker", TASK, exported=False)
        seen = b.alloca(I64)
        b.store(self._load(b, self.number), seen)
        wait, spin, sleep, check, doze, woke, work = (function.append_basic_block(n)
                                                      for n in ("wait", "spin", "sleep", "check", "doze", "woke", "work"))
        b.branch(wait)
        b.position_at_end(wait)
        start = b.call(self.ticks, [])
        b.branch(spin)
        b.position_at_end(spin)
        fresh = b.icmp_unsigned("!=", self._load(b, self.number), b.load(seen))
        spun = b.icmp_unsigned(">", b.sub(b.call(self.ticks, []), start), ir.Constant(I64, SPIN_TICKS))
        keep = function.append_basic_block("keep")
        b.cbranch(fresh, work, keep)
        b.position_at_end(keep)
        self._relax(b)
        b.cbranch(spun, sleep, spin)
        b.position_at_end(sleep)
        mutex, cond = self._sync(b, self.mutex), self._sync(b, self.cond)
        b.call(self.libc["pthread_mutex_lock"], [mutex])
        b.atomic_rmw("add", self.sleepers, ir.Constant(I64, 1), "seq_cst")
        b.branch(check)
        b.position_at_end(check)
        b.cbranch(b.icmp_unsigned("==", self._load(b, self.number), b.load(seen)), doze, woke)
        b.position_at_end(doze)
        b.call(self.libc["pthread_cond_wait"], [cond, mutex])
        b.branch(check)
        b.position_at_end(woke)
        b.atomic_rmw("sub", self.sleepers, ir.Constant(I64, 1), "seq_cst")
        b.call(self.libc["pthread_mutex_unlock"], [mutex])
        b.branch(work)
        b.position_at_end(work)
        number = self._load(b, self.number)
        b.store(number, seen)
        if self.mxcsr is not None:
            fpmode.write_mxcsr(b, self.mxcsr)
        b.call(self.drain, [number])
        b.branch(wait)
        return function

    def _run(self) -> None:
        """ranvier_pool_run(task, blocks, count, stride): every part, on the pool if it is free."""
        function, b = self._function(SYMBOLS[0], RUN, exported=True)
        task, blocks, count, stride = function.args
        inline, shared, signal, work, wait, relax, yield_, finish = (
            function.append_basic_block(n) for n in ("inline", "shared", "signal", "work", "wait", "relax", "yield", "finish"))
        idle = b.icmp_unsigned("==", self._load(b, self.workers), ir.Constant(I64, 0))
        single = b.icmp_unsigned("<=", count, ir.Constant(I64, 1))
        try_own = function.append_basic_block("try_own")
        b.cbranch(b.or_(idle, single), inline, try_own)
        b.position_at_end(try_own)
        owned = b.cmpxchg(self.busy, ir.Constant(I64, 0), ir.Constant(I64, 1), "seq_cst", "seq_cst")
        b.cbranch(b.extract_value(owned, 1), shared, inline)

        b.position_at_end(inline)
        index = b.alloca(I64)
        b.store(ir.Constant(I64, 0), index)
        inline_loop, inline_body, inline_done = (function.append_basic_block(n) for n in ("inline_loop", "inline_body", "inline_done"))
        b.branch(inline_loop)
        b.position_at_end(inline_loop)
        i = b.load(index)
        b.cbranch(b.icmp_unsigned("<", i, count), inline_body, inline_done)
        b.position_at_end(inline_body)
        b.call(task, [b.gep(blocks, [b.mul(i, stride)])])
        b.store(b.add(i, ir.Constant(I64, 1)), index)
        b.branch(inline_loop)
        b.position_at_end(inline_done)
        b.ret_void()

        b.position_at_end(shared)
        b.store(task, self.task)
        b.store(blocks, self.blocks)
        b.store(stride, self.stride)
        if self.mxcsr is not None:
            fpmode.read_mxcsr(b, self.mxcsr)
        self._store(b, count, self.pending)
        number = b.add(self._load(b, self.number), ir.Constant(I64, 1))
        number = b.and_(number, ir.Constant(I64, 0xFFFFFFFF))
        self._store(b, b.or_(b.shl(number, ir.Constant(I64, 32)), count), self.job)
        self._store(b, number, self.number)
        b.cbranch(b.icmp_unsigned("!=", self._load(b, self.sleepers), ir.Constant(I64, 0)), signal, work)
        b.position_at_end(signal)
        mutex = self._sync(b, self.mutex)
        b.call(self.libc["pthread_mutex_lock"], [mutex])
        b.call(self.libc["pthread_cond_broadcast"], [self._sync(b, self.cond)])
        b.call(self.libc["pthread_mutex_unlock"], [mutex])
        b.branch(work)
        b.position_at_end(work)
        b.call(self.drain, [number])
        start = b.call(self.ticks, [])
        b.branch(wait)
        # The parts left run on workers: spin while they finish, yielding the core once that
        # takes long (more threads than cores: a waiting worker may need this one).
        b.position_at_end(wait)
        b.cbranch(b.icmp_unsigned("==", self._load(b, self.pending), ir.Constant(I64, 0)), finish, relax)
        b.position_at_end(relax)
        self._relax(b)
        spun = b.icmp_unsigned(">", b.sub(b.call(self.ticks, []), start), ir.Constant(I64, SPIN_TICKS))
        b.cbranch(spun, yield_, wait)
        b.position_at_end(yield_)
        b.call(self.libc["sched_yield"], [])
        b.branch(wait)
        b.position_at_end(finish)
        self._store(b, 0, self.busy)
        b.ret_void()

    def _grow(self, worker: ir.Function) -> None:
        """ranvier_pool_grow(n, masks): start workers until n run (at most MAX_WORKERS),
        worker i bound to the CPUs of the i-th `CPU_SET_BYTES` of `masks` (unless NULL)."""
        function, b = self._function(SYMBOLS[1], ir.FunctionType(ir.VoidType(), [I64, BYTE_PTR]), exported=True)
        wanted, masks = function.args
        first = self._load(b, self.workers)
        with b.if_then(b.icmp_unsigned("==", first, ir.Constant(I64, 0))):
            self._init_sync(b)
        loop, body, done = (function.append_basic_block(n) for n in ("loop", "body", "done"))
        b.branch(loop)
        b.position_at_end(loop)
        count = self._load(b, self.workers)
        b.cbranch(b.icmp_unsigned("<", count, wanted), body, done)
        b.position_at_end(body)
        slot = b.gep(self.threads, [ir.Constant(I32, 0), count])
        status = b.call(self.libc["pthread_create"], [slot, ir.Constant(BYTE_PTR, None), worker, ir.Constant(BYTE_PTR, None)])
        started = function.append_basic_block("started")
        b.cbranch(b.icmp_signed("==", status, ir.Constant(I32, 0)), started, done)  # no more threads: run with fewer
        b.position_at_end(started)
        with b.if_then(b.icmp_unsigned("!=", masks, ir.Constant(BYTE_PTR, None))):
            mask = b.gep(masks, [b.mul(count, ir.Constant(I64, CPU_SET_BYTES))])
            b.call(self.libc["pthread_setaffinity_np"], [b.load(slot), ir.Constant(I64, CPU_SET_BYTES), mask])
        b.call(self.libc["pthread_detach"], [b.load(slot)])
        self._store(b, b.add(count, ir.Constant(I64, 1)), self.workers)
        b.branch(loop)
        b.position_at_end(done)
        b.ret_void()

    def _init_sync(self, b: ir.IRBuilder) -> None:
        none = ir.Constant(BYTE_PTR, None)
        b.call(self.libc["pthread_mutex_init"], [self._sync(b, self.mutex), none])
        b.call(self.libc["pthread_cond_init"], [self._sync(b, self.cond), none])

    def _forget(self) -> None:
        """ranvier_pool_forget(): a forked child's pool: no workers (they were the parent's), free."""
        _, b = self._function(SYMBOLS[2], ir.FunctionType(ir.VoidType(), []), exported=True)
        for variable in (self.workers, self.busy, self.sleepers, self.pending):
            self._store(b, 0, variable)
        b.ret_void()


def build_module(target: CPUTarget) -> ir.Module:
    return _Emitter(target).module


class Pool:
    """The process's pool: the address generated code calls, and its size."""

    def __init__(self, code: jit.LoadedCode):
        self._code = code  # the machine code and the pool's state live as long as this
        self.run_address = code.address
        self._grow = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(code.address_of(SYMBOLS[1]))
        self._forget = ctypes.CFUNCTYPE(None)(code.address_of(SYMBOLS[2]))
        self._nothing = code.address_of(SYMBOLS[3])
        self._lock = threading.Lock()
        self.workers = 0
        os.register_at_fork(after_in_child=self._after_fork)

    def ensure(self, workers: int) -> None:
        """At least `workers` threads beside the callers (never more than MAX_WORKERS)."""
        workers = min(workers, MAX_WORKERS)
        with self._lock:
            if workers > self.workers:
                masks = _worker_masks(workers)
                self._grow(workers, masks)
                self.workers = workers

    def job_seconds(self, parts: int, asleep: bool) -> float:
        """The time a job of `parts` empty parts adds over running one inline: publishing
        it, waking the workers (spinning, or `asleep` after a pause) and waiting for them.
        The two are timed in alternation and the median of their differences is taken:
        after a pause even the inline call runs cold, and a shared machine's noise comes
        in bursts that a difference of neighbours cancels."""
        run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(self.run_address)
        blocks = ctypes.create_string_buffer(parts)
        self.ensure(parts - 1)
        repeats = 1 if asleep else 1000

        def seconds(count: int) -> float:
            if asleep:
                time.sleep(SPIN_TICKS / jit.cycles_per_second() * 20)
            start = time.perf_counter()
            for _ in range(repeats):
                run(self._nothing, blocks, count, 1)
            return (time.perf_counter() - start) / repeats

        for _ in range(3):  # workers awake and spinning, code and data in cache
            seconds(parts)
        differences = [seconds(parts) - seconds(1) for _ in range(100 if asleep else 15)]
        return max(0.0, statistics.median(differences))

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._forget()
        wanted, self.workers = self.workers, 0
        self.ensure(wanted)


def _worker_masks(workers: int) -> ctypes.Array | None:
    """A cpu_set_t per worker, worker i's holding the (i + 1)-th CPU of this process's
    affinity mask (round the mask again past its end); None where workers stay free (the
    environment says so, or this system has no affinity masks)."""
    if os.environ.get(PIN_ENVIRONMENT, "1") == "0" or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if cpus[-1] >= 8 * CPU_SET_BYTES:
        return None
    masks = (ctypes.c_uint8 * (CPU_SET_BYTES * workers))()
    for worker in range(workers):
        cpu = cpus[(worker + 1) % len(cpus)]
        masks[worker * CPU_SET_BYTES + cpu // 8] |= 1 << cpu % 8
    return masks


@functools.cache
def pool() -> Pool:
    """The process's pool, compiled at the first call (in milliseconds: not worth a disk cache entry)."""
    target = host_target()
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = jit.cache_key(f"ranvier_pool\n{digest}", target)
    code, _ = compile_cache.cached_object(key, lambda: jit.compile_object(build_module(target), target), use_disk=False)
    return Pool(jit.load_object(code, target, SYMBOLS[0]))
