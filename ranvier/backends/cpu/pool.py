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
worker is bound to a CPU of its own (`PIN_ENVIRONMENT`), the first left to the callers,
and a cell's compute binds its calling thread to that first CPU while it runs
(`bind_caller`).

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
from typing import Any

from llvmlite import ir

from ...dtypes import DT_BOOL, DT_INT32, DT_UINT8, DT_UINT64
from .. import compile_cache
from ..llvm.pointers import Pointer, PointerVariable, null
from ..llvm.values import Value, call, choose, forever, local, loop
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
    def _word(b: ir.IRBuilder, variable: ir.GlobalVariable) -> Pointer:
        """One of the pool's 64-bit words (read and written atomically, but for the job's
        task, blocks and stride, which only change while no part runs)."""
        return Pointer(b, variable, DT_UINT64)

    def _ticks(self, b: ir.IRBuilder) -> Value:
        return call(b, self.ticks, dtype=DT_UINT64)

    def _relax(self, b: ir.IRBuilder) -> None:
        if self.pause is not None:
            call(b, self.pause)

    def _libc(self, b: ir.IRBuilder, name: str, *arguments: Any) -> Value:
        return call(b, self.libc[name], *arguments, dtype=DT_INT32)

    def _sync(self, b: ir.IRBuilder, variable: ir.GlobalVariable) -> Pointer:
        """The mutex or condition variable, as the byte pointer pthreads takes."""
        return Pointer(b, variable, DT_UINT8).view(DT_UINT8)  # from [SYNC_BYTES x i8]*

    def _drain(self) -> ir.Function:
        """drain(number): claim and run parts of job `number` until none is left."""
        function, b = self._function("pool_drain", ir.FunctionType(ir.VoidType(), [I64]), exported=False)
        number = Value(b, function.args[0], DT_UINT64)
        job = self._word(b, self.job)
        with forever(b, "claim") as leave_if:
            word = job.load_atomic()
            ours = word.shift_right(32).equal(number)
            part = word.shift_right(16) & 0xFFFF
            leave_if(~(ours & (part < (word & 0xFFFF))))
            with b.if_then(job.compare_exchange(word, word + (1 << 16)).ir):
                task, blocks = b.load(self.task), PointerVariable(b, self.blocks, DT_UINT8).value
                call(b, task, blocks + part * self._word(b, self.stride).load())
                self._word(b, self.pending).atomic_sub(1)
        b.ret_void()
        return function

    def _worker(self) -> ir.Function:
        """A worker: wait for a new job number (spinning, then asleep), drain it, repeat."""
        function, b = self._function("pool_worker", TASK, exported=False)
        number = self._word(b, self.number)
        seen = local(b, DT_UINT64, initial=number.load_atomic())
        with forever(b, "job"):  # never left: a worker serves for the life of the process
            start = self._ticks(b)
            with forever(b, "spin") as leave_if:
                leave_if(number.load_atomic().not_equal(seen.value))
                self._relax(b)
                leave_if(self._ticks(b) - start > SPIN_TICKS)
            with b.if_then(number.load_atomic().equal(seen.value).ir):  # spun long enough without a job: sleep
                mutex, cond = self._sync(b, self.mutex), self._sync(b, self.cond)
                self._libc(b, "pthread_mutex_lock", mutex)
                self._word(b, self.sleepers).atomic_add(1)
                with forever(b, "doze") as leave_if:
                    leave_if(number.load_atomic().not_equal(seen.value))
                    self._libc(b, "pthread_cond_wait", cond, mutex)
                self._word(b, self.sleepers).atomic_sub(1)
                self._libc(b, "pthread_mutex_unlock", mutex)
            fresh = number.load_atomic()
            seen.set(fresh)
            if self.mxcsr is not None:
                fpmode.write_mxcsr(b, self.mxcsr)
            call(b, self.drain, fresh)
        b.unreachable()
        return function

    def _run(self) -> None:
        """ranvier_pool_run(task, blocks, count, stride): every part, on the pool if it is free."""
        function, b = self._function(SYMBOLS[0], RUN, exported=True)
        task = function.args[0]
        blocks = Pointer(b, function.args[1], DT_UINT8)
        count, stride = (Value(b, argument, DT_UINT64) for argument in function.args[2:])
        idle = self._word(b, self.workers).load_atomic().equal(0)
        # a job of one part, or no workers: run inline; else own the pool, unless another caller does
        not_owned = Value(b, ir.Constant(ir.IntType(1), 0), DT_BOOL)
        owned = choose(idle | (count <= 1), lambda: not_owned, lambda: self._word(b, self.busy).compare_exchange(0, 1))
        with b.if_else(owned.ir) as (shared, inline):
            with inline, loop(b, 0, count, name="inline") as i:
                call(b, task, blocks + i * stride)
            with shared:
                self._publish(b, task, blocks, count, stride)
        b.ret_void()

    def _publish(self, b: ir.IRBuilder, task: ir.Value, blocks: Pointer, count: Value, stride: Value) -> None:
        """The job on the pool, owned by this caller: published, the workers woken, its parts
        claimed here too, and waited for until the last is done."""
        b.store(task, self.task)
        PointerVariable(b, self.blocks, DT_UINT8).set(blocks)
        self._word(b, self.stride).store(stride)
        if self.mxcsr is not None:
            fpmode.read_mxcsr(b, self.mxcsr)
        self._word(b, self.pending).store_atomic(count)
        number = (self._word(b, self.number).load_atomic() + 1) & 0xFFFFFFFF
        self._word(b, self.job).store_atomic(number.shift_left(32) | count)
        self._word(b, self.number).store_atomic(number)
        with b.if_then(self._word(b, self.sleepers).load_atomic().not_equal(0).ir):
            mutex = self._sync(b, self.mutex)
            self._libc(b, "pthread_mutex_lock", mutex)
            self._libc(b, "pthread_cond_broadcast", self._sync(b, self.cond))
            self._libc(b, "pthread_mutex_unlock", mutex)
        call(b, self.drain, number)
        # The parts left run on workers: spin while they finish, yielding the core once that
        # takes long (more threads than cores: a waiting worker may need this one).
        start = self._ticks(b)
        with forever(b, "wait") as leave_if:
            leave_if(self._word(b, self.pending).load_atomic().equal(0))
            self._relax(b)
            with b.if_then((self._ticks(b) - start > SPIN_TICKS).ir):
                self._libc(b, "sched_yield")
        self._word(b, self.busy).store_atomic(0)

    def _grow(self, worker: ir.Function) -> None:
        """ranvier_pool_grow(n, masks): start workers until n run (at most MAX_WORKERS),
        worker i bound to the CPUs of the i-th `CPU_SET_BYTES` of `masks` (unless NULL)."""
        function, b = self._function(SYMBOLS[1], ir.FunctionType(ir.VoidType(), [I64, BYTE_PTR]), exported=True)
        wanted, masks = Value(b, function.args[0], DT_UINT64), Pointer(b, function.args[1], DT_UINT8)
        workers = self._word(b, self.workers)
        with b.if_then(workers.load_atomic().equal(0).ir):
            self._init_sync(b)
        threads = Pointer(b, self.threads, DT_UINT64).view(DT_UINT64)
        with forever(b, "grow") as leave_if:
            count = workers.load_atomic()
            leave_if(count >= wanted)
            slot = threads + count
            started = self._libc(b, "pthread_create", slot, null(b, DT_UINT8), worker, null(b, DT_UINT8))
            leave_if(started.not_equal(0))  # no more threads: run with fewer
            with b.if_then(masks.address().not_equal(0).ir):
                self._libc(b, "pthread_setaffinity_np", slot.load(), CPU_SET_BYTES, masks + count * CPU_SET_BYTES)
            self._libc(b, "pthread_detach", slot.load())
            workers.store_atomic(count + 1)
        b.ret_void()

    def _init_sync(self, b: ir.IRBuilder) -> None:
        self._libc(b, "pthread_mutex_init", self._sync(b, self.mutex), null(b, DT_UINT8))
        self._libc(b, "pthread_cond_init", self._sync(b, self.cond), null(b, DT_UINT8))

    def _forget(self) -> None:
        """ranvier_pool_forget(): a forked child's pool: no workers (they were the parent's), free."""
        _, b = self._function(SYMBOLS[2], ir.FunctionType(ir.VoidType(), []), exported=True)
        for variable in (self.workers, self.busy, self.sleepers, self.pending):
            self._word(b, variable).store_atomic(0)
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


def bind_caller() -> set[int] | None:
    """Bind the calling thread to the first CPU of its affinity mask, the one the workers
    leave to callers (`_worker_masks`), and return the mask to restore after the compute;
    None where nothing was bound (workers stay free, one CPU, no affinity masks). Left free,
    the caller was at times placed on a worker's CPU after other processes ran, and shared
    it until the scheduler moved one of them: stories110M's bf16 prefill (128 tokens, ~40
    ms), each call after a 2-thread numpy process, ran under 2,800 tokens/s in 7 of 16 calls
    free (medians 3,069 and 2,871 in two runs of 8) and in 1 of 16 bound (3,397 and 3,365;
    a 2-core VM, the two alternated). Bound for the compute only, so the user's thread, and
    any thread it starts later, keeps its own mask."""
    if os.environ.get(PIN_ENVIRONMENT, "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        return None
    os.sched_setaffinity(0, {min(mask)})
    return mask


@functools.cache
def pool() -> Pool:
    """The process's pool, compiled at the first call (in milliseconds: not worth a disk cache entry)."""
    target = host_target()
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = jit.cache_key(f"ranvier_pool\n{digest}", target)
    code, _ = compile_cache.cached_object(key, lambda: jit.compile_object(build_module(target), target), use_disk=False)
    return Pool(jit.load_object(code, target, SYMBOLS[0]))
