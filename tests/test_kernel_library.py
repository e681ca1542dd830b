"""The kernel libraries (`ranvier.backends.kernels`): the order kernels are tried in is their
ranks', not the order their modules registered them in; "can run" (`supports`) apart from
"measured faster" (`prefer`); and a step keeps the kernel chosen for it."""

from __future__ import annotations

import random

import numpy as np
import pytest

import ranvier as rv
from ranvier.backends.cpu.kernels import LIBRARY as CPU_LIBRARY
from ranvier.backends.cuda.library import LIBRARY as GPU_LIBRARY
from ranvier.backends.kernels import Kernel, KernelLibrary, chosen_kernel


def _relu():
    flow = rv.Flow()
    return rv.Builder(flow, "f").var("x", "float32", [2]).relu().producer


@pytest.mark.parametrize("library", [CPU_LIBRARY, GPU_LIBRARY], ids=["cpu", "cuda"])
def test_the_order_kernels_are_tried_in_does_not_depend_on_the_order_they_registered_in(library):
    rng = random.Random(0)
    for _ in range(5):
        shuffled = list(library.kernels)
        rng.shuffle(shuffled)
        again = KernelLibrary(library.name, library.fallback)
        for kernel in shuffled:
            again.register(kernel)
        assert [k.name for k in again.kernels] == [k.name for k in library.kernels]


def test_kernels_that_may_take_the_same_op_have_different_ranks():
    for library in (CPU_LIBRARY, GPU_LIBRARY):
        clashes = [(a.name, b.name) for i, a in enumerate(library.kernels) for b in library.kernels[i + 1:]
                   if a.rank == b.rank and a.overlaps(b)]
        assert not clashes, f"{library.name}: {clashes}"


def test_a_kernel_that_can_run_an_op_but_is_not_preferred_passes_it_to_the_next():
    asked = []

    def measured(op) -> bool:
        asked.append(op.name)
        return False

    library = KernelLibrary("test", Kernel("Fallback", None, lambda ctx, op: None, native=False))
    library.register(Kernel("Measured", frozenset({"Relu"}), lambda ctx, op: None, rank=1, prefer=measured))
    library.register(Kernel("Plain", frozenset({"Relu"}), lambda ctx, op: None, rank=2))
    library.register(Kernel("Unable", frozenset({"Relu"}), lambda ctx, op: None, supports=lambda op: False))
    op = _relu()
    assert library.choose(op).name == "Plain" and asked == [op.name]
    # where no kernel after it can, the one that can runs the op all the same
    alone = KernelLibrary("alone", library.fallback)
    alone.register(Kernel("Measured", frozenset({"Relu"}), lambda ctx, op: None, prefer=measured))
    assert alone.choose(op).name == "Measured" and alone.supports(op)


def test_a_step_keeps_the_kernel_chosen_for_it(monkeypatch):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [4, 8])
    y = (x.exp() + 1.0).sum(axis=1)
    y.var.out = True
    cell = rv.Compiler("cpu").compile(flow).cell("f")
    # the backend generates the steps' code from the kernels they keep, choosing none again
    monkeypatch.setattr(CPU_LIBRARY, "choose", lambda *args: pytest.fail("a kernel chosen again"))
    assert all(chosen_kernel(step).name == step.kernel for step in cell.steps)
    assert cell.backend.code(cell, "llvm")
    data = cell.instance()
    value = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    data[x] = value
    data.compute()
    np.testing.assert_allclose(data[y], (np.exp(value) + 1).sum(axis=1), rtol=1e-5)


def test_every_routine_a_cpu_kernel_calls_is_one_a_cells_table_can_hold():
    from ranvier.backends.cpu.backend import GEMMS

    calls = {slot for kernel in CPU_LIBRARY.kernels for slot in kernel.calls}
    assert calls == set(GEMMS)
