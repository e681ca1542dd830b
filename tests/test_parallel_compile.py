"""A cell compiled in parts (`backends/cpu/parallel_compile.py`): its steps spread over
several LLVM modules, each past the first compiled by a worker process, the objects
bundled, cached and linked as one; the cell computes what the one-module cell computes."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import random_array

import ranvier as rv
from ranvier.backends import compile_cache
from ranvier.backends.cpu import jit, parallel_compile
from ranvier.backends.cpu.parallel import SPLIT_ENVIRONMENT, split_thresholds, thread_count


@pytest.fixture(autouse=True)
def _thresholds_read_again_after():
    """The split thresholds this module's steps fix are dropped after each test (the next
    reads the machine's own again)."""
    yield
    split_thresholds.cache_clear()


def _training_step(f):
    """An MLP's training step on 32 × 40 inputs: products, GELU, softmax cross-entropy,
    its gradient and Adam (a few dozen steps)."""
    from ranvier.train.losses import softmax_cross_entropy
    from ranvier.train.optimizers import Adam
    from ranvier.train.trainer import Trainer

    f.func.training = True
    x, labels = f.var("x", "float32", [32, 40]), f.var("labels", "int32", [32])
    w1 = f.array("w1", random_array([40, 64], "float32", seed=1) * 0.2)
    w2 = f.array("w2", random_array([64, 10], "float32", seed=2) * 0.2)
    loss = softmax_cross_entropy(f.gelu(x @ w1) @ w2, labels)
    return Trainer(loss, [w1, w2], Adam(lr=1e-2), inputs=[x, labels], backend="cpu")


def _losses(monkeypatch, parts: int, worker_lines: int) -> tuple[list[float], int, str, int]:
    """Five steps' losses of the step compiled in `parts` modules, how many workers
    compiled parts of it, its IR and how many object files its machine code is."""
    monkeypatch.setenv(SPLIT_ENVIRONMENT, "4096")  # the same kernels split over threads each time
    split_thresholds.cache_clear()  # read again, from the setting
    made = []  # the code compiled, each cell's
    monkeypatch.setattr(compile_cache, "cached_object", lambda key, generate, use_disk=True: (made.append(generate()) or made[-1], "compiled"))
    monkeypatch.setattr(parallel_compile, "parts", lambda: parts)
    monkeypatch.setattr(parallel_compile, "WORKER_LINES", worker_lines)
    started = []
    start = parallel_compile._start
    monkeypatch.setattr(parallel_compile, "_start", lambda text, target: started.append(1) or start(text, target))
    flow = rv.Flow()
    trainer = _training_step(rv.Builder(flow, "train"))
    rng = np.random.default_rng(3)
    batches = [[rng.standard_normal((32, 40)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int32)] for _ in range(5)]
    losses = [trainer.step(batch) for batch in batches]
    cell = trainer.network.cell("train")
    return losses, len(started), cell.backend.code(cell, "llvm"), len(jit.unbundled(max(made, key=len)))


def test_a_step_compiled_by_workers_trains_as_the_one_module_step(monkeypatch):
    """Three modules, two of them compiled by worker processes: the same losses bit for
    bit (each step's function is the same code wherever it is compiled)."""
    one, workers_one, code_one, objects_one = _losses(monkeypatch, parts=1, worker_lines=0)
    three, workers_three, code_three, objects_three = _losses(monkeypatch, parts=3, worker_lines=0)
    assert (workers_one, objects_one, workers_three, objects_three) == (0, 1, 2, 3)
    assert three == one
    internal = re.findall(r'define internal void @"(step\d+)"', code_one)
    assert internal and len(re.findall(r'^define void @"cell"', code_one, re.MULTILINE)) == 1
    shared = re.findall(r'define void @"(step\d+)"', code_three)  # each part's steps, called from the cell's part
    assert sorted(shared) == sorted(internal) and code_three.count('define void @"cell"') == 1
    if thread_count() > 1:  # kernels split over threads, their parts' functions in their modules
        assert re.search(r'define internal i8\* @"step\d+_part', code_three)


def test_small_cells_compile_their_parts_here_as_one(monkeypatch):
    """Under WORKER_LINES lines of IR a worker's start would cost more than it saves: the
    parts are linked into one module and compiled here, one object."""
    one, _, _, _ = _losses(monkeypatch, parts=1, worker_lines=0)
    two, workers, _, objects = _losses(monkeypatch, parts=2, worker_lines=10**9)
    assert (workers, objects) == (0, 1) and two == one


def test_a_failing_worker_leaves_its_module_to_this_process(monkeypatch):
    """A worker that cannot compile (here: one that exits at once) costs only time."""
    one, _, _, _ = _losses(monkeypatch, parts=1, worker_lines=0)
    monkeypatch.setattr(parallel_compile, "_SERVE", "import sys; sys.exit(3)")
    two, workers, _, objects = _losses(monkeypatch, parts=2, worker_lines=0)
    assert (workers, objects) == (1, 2) and two == one


@pytest.mark.parametrize("count", [1, 3])
def test_a_bundle_gives_back_its_objects(count):
    objects = [bytes([k]) * (5 + k) for k in range(count)]
    code = jit.bundle(objects)
    assert jit.unbundled(code) == objects
    assert (code == objects[0]) == (count == 1)  # a single object is stored as it is
