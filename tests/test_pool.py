"""The worker pool: every part of every job runs exactly once, whoever calls, however
many parts, from several threads at once, after fork(); generated kernels split over it
at every thread count from 1 to the cores agree with the reference."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir

import ranvier as rv
from ranvier.backends.cpu import backend, jit
from ranvier.backends.cpu.parallel import split_thresholds, thread_count
from ranvier.backends.cpu.pool import BYTE_PTR, TASK, bind_caller, pool
from ranvier.backends.cpu.target import host_target

ROOT = Path(__file__).resolve().parent.parent
I32, I64 = ir.IntType(32), ir.IntType(64)


def part_function(name: str):
    """A module holding part `name`, whose block is (an int64 array, the part's index):
    (module, function, its builder, the array, the index)."""
    target = host_target()
    module = ir.Module(name)
    module.triple, module.data_layout = target.machine.triple, str(target.machine.target_data)
    function = ir.Function(module, TASK, name)
    b = ir.IRBuilder(function.append_basic_block())
    block = b.bitcast(function.args[0], ir.LiteralStructType([I64.as_pointer(), I64]).as_pointer())
    array = b.load(b.gep(block, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
    index = b.load(b.gep(block, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))
    return module, function, b, array, index


@pytest.fixture(scope="module")
def count_task():
    """A part that adds index + 1 to counts[index]; its block is (counts, index)."""
    target = host_target()
    module, _, b, counts, index = part_function("count_part")
    slot = b.gep(counts, [index])
    b.store(b.add(b.load(slot), b.add(index, ir.Constant(I64, 1))), slot)
    b.ret(ir.Constant(BYTE_PTR, None))
    return jit.load_object(jit.compile_object(module, target), target, "count_part")


def run_jobs(task, parts: int, jobs: int) -> np.ndarray:
    """`jobs` jobs of `parts` parts; the counts each part left."""
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(pool().run_address)
    counts = np.zeros(parts, np.int64)
    blocks = np.zeros((parts, 2), np.int64)
    blocks[:, 0], blocks[:, 1] = counts.ctypes.data, np.arange(parts)
    for _ in range(jobs):
        run(task.address, blocks.ctypes.data, parts, blocks.strides[0])
    return counts


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 64, 1000])
def test_every_part_runs_once_per_job(count_task, parts):
    pool().ensure(3)
    assert np.array_equal(run_jobs(count_task, parts, 300), 300 * np.arange(1, parts + 1))


def test_callers_on_several_threads_each_get_all_their_parts(count_task):
    """While one thread's job holds the pool, another's runs its parts itself."""
    pool().ensure(3)
    results: list[np.ndarray] = [None] * 4

    def call(k: int) -> None:
        results[k] = run_jobs(count_task, 5, 5000)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(np.array_equal(r, 5000 * np.arange(1, 6)) for r in results)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_forked_child_has_a_pool_of_its_own(count_task):
    pool().ensure(2)
    run_jobs(count_task, 4, 10)
    workers = pool().workers
    child = os.fork()
    if child == 0:  # the child: the parent's workers did not come along; it started as many
        ok = np.array_equal(run_jobs(count_task, 4, 1000), 1000 * np.arange(1, 5)) and pool().workers == workers
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.WEXITSTATUS(status) == 0


def test_workers_take_on_the_callers_floating_point_modes():
    """A caller that flushes denormals (FTZ and DAZ in its MXCSR) runs a job whose parts,
    on whichever thread, each record their thread and MXCSR, after spinning long enough
    that the caller cannot take them all: every part saw the flushing modes, on the workers
    too; a job from a caller that keeps denormals finds them cleared again."""
    from ranvier.backends.cpu import fpmode

    target = host_target()
    if not target.machine.triple.startswith("x86_64"):
        pytest.skip("MXCSR is x86's")
    module, part, b, records, index = part_function("record_part")
    clock = ir.Function(module, ir.FunctionType(I64, []), name="llvm.readcyclecounter")
    start = b.call(clock, [])
    spin, done = part.append_basic_block("spin"), part.append_basic_block("done")
    b.branch(spin)
    b.position_at_end(spin)
    b.cbranch(b.icmp_unsigned("<", b.sub(b.call(clock, []), start), ir.Constant(I64, 200_000)), spin, done)
    b.position_at_end(done)
    mode = b.alloca(I32)
    fpmode.read_mxcsr(b, mode)
    self_ = ir.Function(module, ir.FunctionType(I64, []), name="pthread_self")
    b.store(b.zext(b.load(mode), I64), b.gep(records, [b.mul(index, ir.Constant(I64, 2))]))
    b.store(b.call(self_, []), b.gep(records, [b.add(b.mul(index, ir.Constant(I64, 2)), ir.Constant(I64, 1))]))
    b.ret(ir.Constant(BYTE_PTR, None))
    run_type = ir.FunctionType(ir.VoidType(), [TASK.as_pointer(), BYTE_PTR, I64, I64])
    caller = ir.Function(module, ir.FunctionType(ir.VoidType(), [run_type.as_pointer(), BYTE_PTR, I64, I64, I64]), "run_with_flushing")
    b = ir.IRBuilder(caller.append_basic_block())
    run, blocks, count, stride, flush = caller.args
    saved = fpmode.flushing(b)
    with b.if_then(b.icmp_unsigned("==", flush, ir.Constant(I64, 0))):
        fpmode.write_mxcsr(b, saved)
    b.call(run, [part, blocks, count, stride])
    fpmode.write_mxcsr(b, saved)
    b.ret_void()
    code = jit.load_object(jit.compile_object(module, target), target, "run_with_flushing")
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(code.address)
    pool().ensure(2)
    parts, threads = 32, set()
    for flush in (1, 0) * 10:
        records = np.zeros((parts, 2), np.int64)
        blocks = np.zeros((parts, 2), np.int64)
        blocks[:, 0], blocks[:, 1] = records.ctypes.data, np.arange(parts)
        call(pool().run_address, blocks.ctypes.data, parts, blocks.strides[0], flush)
        flushing = (records[:, 0] & fpmode.FLUSH_BITS) == fpmode.FLUSH_BITS
        assert flushing.all() if flush else not flushing.any(), records[:, 0]
        threads |= set(records[:, 1])
    # a job finds the pool busy (another thread's) only now and then: over twenty, workers ran parts
    assert len(threads) >= min(2, thread_count()), "the workers ran no part"


_PINNING_SCRIPT = """
import os
from ranvier.backends.cpu.pool import pool

def allowed(tid):
    status = open(f"/proc/self/task/{tid}/status").read()
    return next(line.split(":")[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))

before = set(os.listdir("/proc/self/task"))
pool().ensure(3)
print(allowed(os.getpid()), *(allowed(tid) for tid in sorted(set(os.listdir("/proc/self/task")) - before, key=int)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"), reason="Linux affinity masks")
@pytest.mark.parametrize("pinned", [True, False])
def test_workers_are_bound_one_cpu_each_unless_told_not_to(pinned):
    """Worker i runs on the (i + 1)-th CPU of the process's mask, round again past its end
    (three workers on two CPUs: the second, the first, the second); with
    RANVIER_PIN_WORKERS=0 they keep the whole mask, as the caller does."""
    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANVIER_PIN_WORKERS="1" if pinned else "0")
    done = subprocess.run([sys.executable, "-c", _PINNING_SCRIPT], env=env, capture_output=True, text=True, check=True)
    caller, *workers = done.stdout.split()
    assert workers == ([str(cpus[(i + 1) % len(cpus)]) for i in range(3)] if pinned else [caller] * 3)


def _on_a_thread(function):
    """What `function` returns, called on a thread of its own (so binding it leaves the test's alone)."""
    found = []
    thread = threading.Thread(target=lambda: found.append(function()))
    thread.start()
    thread.join()
    return found[0]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="two CPUs to bind among")
def test_a_compute_binds_its_caller_to_the_first_cpu_and_gives_the_mask_back(monkeypatch):
    """While a cell computes, its calling thread runs on the CPU the workers leave free (the
    first of its mask); before and after, the thread has its own mask; with
    RANVIER_PIN_WORKERS=0 nothing is bound."""
    cpus = os.sched_getaffinity(0)

    def bound_then_restored():
        mask = bind_caller()
        during = os.sched_getaffinity(0)
        os.sched_setaffinity(0, mask)
        return mask, during

    assert _on_a_thread(bound_then_restored) == (cpus, {min(cpus)})
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [512, 512])  # past BIND_CALLER_FLOPS
    y = x @ x
    y.var.out = True
    instance = rv.Compiler().compile(flow).cell("f").instance()
    instance[x] = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)

    def computed_mask():
        os.sched_setaffinity(0, cpus)
        instance.compute()
        return os.sched_getaffinity(0)

    assert _on_a_thread(computed_mask) == cpus
    binds = []
    monkeypatch.setattr(backend, "bind_caller", lambda: binds.append(bound_then_restored()) or cpus)
    assert _on_a_thread(computed_mask) == cpus
    assert binds == [(cpus, {min(cpus)})], "the compute bound nothing"
    monkeypatch.undo()
    monkeypatch.setenv("RANVIER_PIN_WORKERS", "0")
    assert _on_a_thread(bind_caller) is None


def test_a_job_costs_far_less_than_a_thread_start():
    """Waking sleeping workers takes microseconds (pthread_create and join took tens)."""
    assert pool().job_seconds(2, asleep=False) < 20e-6
    assert pool().job_seconds(2, asleep=True) < 200e-6


def test_split_thresholds_are_measured_kept_and_overridable(tmp_path):
    code = ("from ranvier.backends.cpu.parallel import split_thresholds as s; t = s(); "
            "print(t.nbytes, t.flops, t.wake_seconds > 0)")
    env = dict(os.environ, RANVIER_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("RANVIER_SPLIT_BYTES", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert first[2] == "True" and all(int(v) & (int(v) - 1) == 0 for v in first[:2])  # powers of two
    (kept,) = tmp_path.glob("split-*.json")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split() == first
    fixed = subprocess.run([sys.executable, "-c", code], env=dict(env, RANVIER_SPLIT_BYTES="4096"), capture_output=True,
                           text=True, check=True).stdout.split()
    assert fixed == ["4096", "32768", "False"]
    kept.write_text("{not json")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).returncode == 0
    assert str(split_thresholds())


_SPLIT_SCRIPT = """
import os, sys
import numpy as np
threads, cores = int(sys.argv[1]), sorted(os.sched_getaffinity(0))
if threads <= len(cores):
    os.sched_setaffinity(0, cores[:threads])
else:  # more parts than this machine has cores (a 16-core host's code), its pool's threads sharing them
    os.sched_getaffinity = lambda pid: set(range(threads))
import ranvier as rv
from ranvier.backends.cpu.kernels import conv
from ranvier.backends.cpu.parallel import thread_count
assert thread_count() == int(sys.argv[1])
conv.WINOGRAD_PAIRS = 0  # the stride-1 convolution is Winograd's, not the tiles'
rng = np.random.default_rng(0)
shapes = {"a": [37, 29], "b": [29, 45], "at": [29, 37], "bt": [45, 29], "batch": [6, 37, 29], "other": [6, 29, 45],
          "v": [1, 29], "ka": [16, 777], "kb": [777, 40], "kat": [777, 16], "kbt": [40, 777], "x": [67, 131], "g": [131], "image": [1, 3, 12, 12], "images": [3, 3, 12, 12], "filters": [5, 3, 3, 3], "many": [20, 3, 3, 3]}
values = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
flow = rv.Flow()
f = rv.Builder(flow, "f")
h = {name: f.var(name, "float32", shape) for name, shape in shapes.items()}
outputs = [f.matmul(h["a"], h["b"]), f.matmul(h["at"], h["b"], transpose_a=True), f.matmul(h["a"], h["bt"], transpose_b=True),
           f.matmul(h["at"], h["bt"], transpose_a=True, transpose_b=True), f.matmul(h["batch"], h["other"]),
           f.matmul(h["batch"], h["b"]), f.matmul(h["v"], h["b"]), f.matmul(h["ka"], h["kb"]),
           f.matmul(h["kat"], h["kbt"], transpose_a=True, transpose_b=True), f.tanh(f.matmul(h["kat"], h["kb"], transpose_a=True) * 0.5 + 0.25),
           f.softmax(h["x"]), f.rms_norm(h["x"], h["g"]),
           f.tanh(h["x"] * 1.5 + 0.25), f.transpose(h["x"], [1, 0]), f.sum(h["x"], axis=0), f.sum(h["x"], axis=1),
           f.max(h["batch"], axis=1), f.mean(h["batch"], axis=[1, 2]), f.sum(h["x"]), f.max(h["batch"]), f.mean(h["x"]),
           f.sum_squares(h["x"]), f.sum_squares(h["x"], axis=0),
           f.conv2d(h["image"], h["filters"], padding=1), f.conv2d(h["images"], h["filters"], strides=2, padding=1),
           f.conv2d(h["images"], h["many"], strides=2, padding=1),
           f.max_pool(h["images"], ksize=3, strides=2, padding=1)]
winograd_output = len(outputs) - 4  # the stride-1 convolution
# products by constants (weights), which the generated GEMM reads from panels packed once
weights = {"w": rng.standard_normal((29, 45)).astype(np.float32), "wt": rng.standard_normal((70, 29)).astype(np.float32)}
constant_products = [f.matmul(h["a"], f.const(weights["w"])), f.matmul(h["a"], f.const(weights["wt"]), transpose_b=True),
                     f.matmul(h["batch"], f.const(weights["w"])), f.matmul(h["at"], f.const(weights["w"]), transpose_a=True),
                     f.matmul(h["v"], f.const(weights["w"]))]
outputs += constant_products
# rows looked up and their gradients summed back, an index repeated (ScatterAdd's parts own columns, not rows)
rows = f.const(np.array([3, 0, 3, 66, 7, 3, 12], np.int32))
outputs += [f.gather(h["x"], rows), f.scatter_add(rows, f.gather(h["x"], rows) * 2.0, 67)]
for o in outputs:
    o.var.out = True
results = []
for backend in ("cpu", "reference"):
    cell = rv.Compiler(backend, cpu=sys.argv[2] if backend == "cpu" else "", cache=False).compile(flow).cell("f")
    if backend == "cpu":
        wanted = "Gemm" if os.environ["RANVIER_GEMM"] == "generated" else "BlasGemm"
        assert sum(s.kernel == wanted for s in cell.steps) >= 5, [s.kernel for s in cell.steps]
        packed = sum(s.kernel == "PackedGemm" for s in cell.steps)
        assert packed == (4 if wanted == "Gemm" else 0), [s.kernel for s in cell.steps]
        # few filters: tiles over whole images, while there are as many images as parts
        few = "ConvTiles" if thread_count() <= shapes["images"][0] else "ConvGemm"
        # small images, two a part: stacked into one GEMM a group
        many = "ConvStackedGemm" if 2 * thread_count() <= shapes["images"][0] else "ConvGemm"
        assert sorted(s.kernel for s in cell.steps if s.op.type.startswith("Conv2D")) == sorted([few, many, "WinogradConv"])
        from ranvier.backends.cpu.kernels.matmul import gemm_parts
        cut_along_k = [s for s in cell.steps if s.op.type.startswith("MatMul")
                       and any(g.slice for part in gemm_parts(s.op, 16, slices=True) for g in part)]
        assert len(cut_along_k) == (3 if thread_count() > 1 else 0), [s.op.inputs[0].shape for s in cut_along_k]
    data = cell.instance()
    for name, value in values.items():
        data[h[name]] = value
    if backend == "cpu":
        for o in outputs:
            data[o] = np.full(o.shape, np.nan, np.float32)
    data.compute()
    results.append([np.array(data[o]) for o in outputs])
# the stride-1 convolution runs as Winograd's F(4, 3), whose transforms' roundings reach a
# few millionths of the sum of the products' magnitudes (here ~20)
for index, (got, want) in enumerate(zip(*results)):
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4 if index == winograd_output else 2e-5)
# the same products by constants with matmul="bfloat16": the weights' bf16 panels where those
# measured faster (always, with the generated GEMM forced), AMX tiles for rows where the CPU has them,
# else bf16 pairs where it has AVX512-BF16, as for a vector (these round A as well)
import ml_dtypes
cell = rv.Compiler("cpu", cpu=sys.argv[2], matmul="bfloat16", cache=False).compile(flow).cell("f")
kernel_of = {s.op.outputs[0].name: s.kernel for s in cell.steps}
a_in_bf16 = ("AmxGemm", "PackedGemmDpbf16", "Bf16Gemv")
assert sum(kernel_of[o.var.name] == "PackedGemmBf16" for o in constant_products) == (
    0 if os.environ["RANVIER_GEMM"] == "blas" else 5 - sum(kernel_of[o.var.name] in a_in_bf16 for o in constant_products))
data = cell.instance()
for name, value in values.items():
    data[h[name]] = value
for o in constant_products:
    data[o] = np.full(o.shape, np.nan, np.float32)
data.compute()

def rounded(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)

for o, (a, w, ta, tb) in zip(constant_products, [("a", "w", False, False), ("a", "wt", False, True), ("batch", "w", False, False),
                                                 ("at", "w", True, False), ("v", "w", False, False)]):
    kernel = kernel_of[o.var.name]
    x = rounded(values[a]) if kernel in a_in_bf16 else values[a].astype(np.float64)
    y = rounded(weights[w]) if kernel in (*a_in_bf16, "PackedGemmBf16") else weights[w].astype(np.float64)
    x, y = (np.swapaxes(x, -1, -2) if ta else x), (y.T if tb else y)
    got = np.array(data[o])
    assert np.isfinite(got).all() and np.all(np.abs(got - x @ y) <= 1e-5 * (np.abs(x) @ np.abs(y)) + 1e-30), kernel
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["generated", "blas"])
@pytest.mark.parametrize("mask", ["", "-avx512", "-avx512,-avx2"])
@pytest.mark.parametrize("threads", sorted({1, 2, 7, thread_count()}))
def test_kernels_split_over_every_thread_count_match_the_reference(threads, mask, gemm):
    """With splitting forced for the smallest ops, GEMMs (transposes, batches, broadcast,
    a vector, short products over a deep k cut along it, one with an epilogue; the
    generated GEMM and BLAS; products by constants on float32 panels, and on bf16 panels
    with matmul="bfloat16"), convolutions (one image in blocks, a batch by
    images), max pooling, row kernels, maps and reductions (by rows, by
    columns, across a middle axis), lookups and their scattered sums give the
    reference's results on 1, 2 and every core, and in 7 parts (ragged shares, parts
    looked up by number at run time) on the host's vectors."""
    if threads > thread_count() and (threads != 7 or mask):
        pytest.skip(f"this process may use {thread_count()} cores")
    env = dict(os.environ, RANVIER_SPLIT_BYTES="1024", RANVIER_GEMM=gemm, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _SPLIT_SCRIPT, str(threads), mask], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_profile_shows_the_time_each_step_ran_on_all_cores():
    import ranvier as rv

    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    large = f.var("large", "float32", [split_thresholds().nbytes // 4])
    small = f.var("small", "float32", [64])
    outputs = [f.tanh(large), f.tanh(small)]
    for o in outputs:
        o.var.out = True
    data = rv.Compiler(cache=False).compile(flow).cell("f").instance()
    data[large] = np.random.default_rng(0).standard_normal(large.shape).astype(np.float32)
    data[small] = np.random.default_rng(1).standard_normal(small.shape).astype(np.float32)
    for _ in range(5):
        data.compute()
    profile = data.profile()
    by_output = {s.op.outputs[0].name: s for s in profile.steps}
    split, alone = by_output[outputs[0].name], by_output[outputs[1].name]
    assert alone.all_cores == 0
    if thread_count() > 1:
        assert 0.5 * split.seconds < split.all_cores <= split.seconds
        assert 0 < profile.all_cores_share <= 1
    else:
        assert split.all_cores == 0 and profile.all_cores_share == 0
    assert f"{profile.all_cores_share:.0%} of it on all cores" in str(profile)


GEMM_PART_CASES = [
    ((128, 784), (784, 256), {}),
    ((784, 128), (784, 256), {"transpose_a": True}),
    ((128, 256), (784, 256), {"transpose_b": True}),
    ((37, 29), (45, 37), {"transpose_a": True, "transpose_b": True}),
    ((3, 100, 70), (3, 70, 90), {}),  # fewer products than cores: each cut into blocks
    ((4, 60, 70), (70, 33), {}),  # rows of a batch times one matrix: one GEMM
    ((1, 500), (500, 300), {}),  # a vector: columns only
    ((16, 1201), (1201, 40), {}),  # short and narrow over a deep k: cut along k
    ((1201, 16), (40, 1201), {"transpose_a": True, "transpose_b": True}),
]


def test_a_product_read_by_rows_after_it_is_cut_by_rows_where_it_stays_in_cache():
    """MNIST's weight gradient [784 × 256] (Adam reads it a share of rows per core) is cut
    into blocks of rows, not columns, though their tiles cost alike; a product too large to
    stay in a core's cache (an LM head's logits) is cut by its cost alone."""
    from ranvier.backends.cpu.kernels.matmul import gemm_grid

    assert gemm_grid(784, 256, 128, 2, 16) == [((0, 400), (0, 256)), ((400, 784), (0, 256))]
    assert gemm_grid(2048, 32000, 288, 2, 16) == [((0, 2048), (0, 16000)), ((0, 2048), (16000, 32000))]


def test_a_product_is_cut_along_k_where_its_blocks_of_c_would_cost_more():
    """MNIST's [128 × 784] · [784 × 256] by a weight the optimizer updates is cut along k on
    two cores (a block of columns would read rows of B written on the other core); the
    same product by a constant, a square one, a vector and too short a k are not."""
    from ranvier.backends.cpu.kernels.matmul import k_slices

    assert k_slices(128, 256, 784, 2, 16, b_written=True) == [(0, 392), (392, 784)]
    assert k_slices(288, 288, 2048, 2, 16, b_written=True) == [(0, 1024), (1024, 2048)]  # a weight gradient over tokens
    assert k_slices(128, 3072, 768, 2, 16, b_written=False) is None
    assert k_slices(1024, 1024, 1024, 2, 16, b_written=True) is None
    assert k_slices(1, 256, 784, 2, 16, b_written=True) is None
    assert k_slices(128, 256, 300, 2, 16, b_written=True) is None  # slices shallower than a block of k


@pytest.mark.parametrize("slices", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("case", range(len(GEMM_PART_CASES)))
def test_gemm_parts_compute_every_element_of_c_once(case, threads, slices, monkeypatch):
    """Carrying out a MatMul's calls as planned, with numpy, over the flat buffers (each
    call's offsets and the operands' leading dimensions) gives A·B, every element of C
    written by exactly one call of each slice of k (a product cut along k: slice 0 into C,
    the others into partial products laid out as C, summed after), and at most one part
    per core."""
    import ranvier as rv
    from ranvier.backends.cpu.kernels import matmul

    monkeypatch.setattr(matmul, "thread_count", lambda: threads)
    monkeypatch.setattr(matmul, "worth_splitting", lambda flops=0, nbytes=0: True)
    a_shape, b_shape, attrs = GEMM_PART_CASES[case]
    f = rv.Builder(rv.Flow(), "f")
    c = f.matmul(f.var("a", "float32", list(a_shape)), f.var("b", "float32", list(b_shape)), **attrs)
    op = c.var.producer
    rng = np.random.default_rng(case)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    ta, tb = attrs.get("transpose_a", False), attrs.get("transpose_b", False)
    lda, ldb, ldc = a_shape[-1], b_shape[-1], c.shape[-1]
    flat_a, flat_b = a.ravel(), b.ravel()
    result, writes = np.zeros(c.var.size), np.zeros(c.var.size, int)
    parts = matmul.gemm_parts(op, 16, slices)
    assert 1 <= len(parts) <= threads
    calls = [g for part in parts for g in part]
    count = 1 + max(g.slice for g in calls)
    assert count == 1 or (slices and len(parts) == count and all(g.k >= 256 for g in calls))
    for call in calls:
        def matrix(flat, offset, rows, columns, ld, transposed):
            stored = (columns, rows) if transposed else (rows, columns)
            block = np.lib.stride_tricks.as_strided(flat[offset:], stored, (ld * 8, 8))
            return block.T if transposed else block

        product = matrix(flat_a, call.a, call.m, call.k, lda, ta) @ matrix(flat_b, call.b, call.k, call.n, ldb, tb)
        for row in range(call.m):
            start = call.c + row * ldc
            result[start : start + call.n] += product[row]
            writes[start : start + call.n] += 1
    want = np.swapaxes(a, -1, -2) if ta else a
    want = want @ (np.swapaxes(b, -1, -2) if tb else b)
    assert (writes == count).all()
    np.testing.assert_allclose(result.reshape(c.shape), want, rtol=1e-12, atol=1e-12)


_CODE_SIZE_SCRIPT = """
import os, sys
parts = int(sys.argv[1])
os.sched_getaffinity = lambda pid: set(range(parts))  # code generated as for this many cores
import numpy as np
import ranvier as rv
flow = rv.Flow()
f = rv.Builder(flow, "f")
x, w, b = f.var("x", "float32", [512, 96]), f.var("w", "float32", [96, 160]), f.var("b", "float32", [160])
rows = f.const(np.arange(0, 512, 5, dtype=np.int32))
outputs = [f.tanh(x * 1.5 + 0.25), f.softmax(x), f.rms_norm(x, f.var("g", "float32", [96])), f.sum(x, axis=0),
           f.sum(x), f.gather(x, rows), f.relu(x @ w + b), f.max_pool(f.var("image", "float32", [4, 3, 16, 16]), ksize=2)]
for o in outputs:
    o.var.out = True
cell = rv.Compiler(cache=False).compile(flow).cell("f")
assert {s.kernel for s in cell.steps} >= {"Gemm", "SoftmaxRow", "RMSNormRow", "Reduce", "Gather", "WindowMax"}, [s.kernel for s in cell.steps]
print(str(cell.backend.code(cell, "llvm")).count(chr(10)))
"""


@pytest.mark.slow
def test_split_kernels_code_hardly_grows_with_the_parts():
    """Maps, row kernels, reductions (by columns, and a whole tensor's in pieces), gathers,
    pooling and a GEMM with its epilogue, every one split (splitting forced): their parts are
    emitted once, so code for 16 cores is barely more than for 2 (2,100 and 2,226 lines of
    LLVM IR here; 3,102 and 20,426 when each part was emitted apart)."""
    env = dict(os.environ, RANVIER_SPLIT_BYTES="1024", RANVIER_GEMM="generated", PYTHONPATH=str(ROOT))
    lines = {}
    for parts in (2, 16):
        done = subprocess.run([sys.executable, "-c", _CODE_SIZE_SCRIPT, str(parts)], env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        lines[parts] = int(done.stdout.strip())
    assert lines[16] <= 1.2 * lines[2], lines
