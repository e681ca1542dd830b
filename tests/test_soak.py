"""Compiled code is freed with its network: many compiles and many computes in one
process keep memory and the number of memory mappings flat.

Each loaded cell owns an LLVM execution engine, which maps memory for its code; before
engines were freed with their cells, every compiled network left two mappings behind
and a process aborted (`LLVM ERROR: Unable to allocate section memory!`) after about
32,500 compiles.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections import OrderedDict

import numpy as np
import pytest

import ranvier as rv
from ranvier.backends import compile_cache


def mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# Mappings the rest of the process may add meanwhile (malloc arenas, numpy's caches):
# a leak of one or two mappings per compile exceeds this within the first hundred.
LEEWAY = 32

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc to count mappings")


def small_network(width: int, seed: int) -> tuple[rv.Network, rv.Variable, rv.Variable, np.ndarray]:
    """A two-op network (input x, output y) whose code depends on `width`, computed once
    on random input `data`: (network, x, y, data)."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", rv.DT_FLOAT, [1, width])
    y = f.tanh(f.mul(x, x))
    y.var.out = True
    network = rv.Compiler("cpu").compile(flow)
    instance = network.cell("f").instance()
    data = np.random.default_rng(seed).standard_normal((1, width)).astype(np.float32)
    instance[x] = data
    instance.compute()
    np.testing.assert_allclose(instance[y], np.tanh(data * data), rtol=1e-5, atol=1e-6)
    return network, x.var, y.var, data


def soak(compiles: int, widths: int) -> tuple[int, int]:
    """Compile and drop `compiles` networks cycling through `widths` different codes; the
    growth in mappings and resident bytes from the first cycle's end to the last's."""
    for i in range(widths):  # the first cycle fills the caches and numpy's allocator
        small_network(4 + i, i)
    gc.collect()
    maps, rss = mappings(), resident_bytes()
    for i in range(compiles):
        small_network(4 + i % widths, i)
    gc.collect()
    return mappings() - maps, resident_bytes() - rss


def test_dropped_networks_unmap_their_code():
    grown_maps, _ = soak(compiles=300, widths=7)
    assert grown_maps <= LEEWAY, f"{grown_maps} memory mappings left behind by 300 dropped networks"


def test_cells_with_the_same_code_share_one_engine():
    first, *_ = small_network(9, 0)
    second, *_ = small_network(9, 1)
    assert first.cell("f").native.code is second.cell("f").native.code
    code = weakref.ref(first.cell("f").native.code)
    del first, second
    gc.collect()
    assert code() is None, "the engine outlived every network that used it"


def test_memory_cache_of_object_code_is_bounded(monkeypatch):
    monkeypatch.setattr(compile_cache, "_MEMORY_CACHE", OrderedDict())
    monkeypatch.setattr(compile_cache, "MEMORY_CACHE_BYTES", 1)  # keeps only the newest entry
    for width in (5, 6, 7):
        small_network(width, width)
    assert len(compile_cache._MEMORY_CACHE) == 1


def test_network_survives_a_million_computes_with_flat_memory():
    network, x, y, data = small_network(8, 0)
    instance = network.cell("f").instance()
    instance[x] = data
    for _ in range(1000):
        instance.compute()
    gc.collect()
    maps, rss = mappings(), resident_bytes()
    for _ in range(1_000_000):
        instance.compute()
    gc.collect()
    np.testing.assert_allclose(instance[y], np.tanh(data * data), rtol=1e-5, atol=1e-6)
    assert mappings() - maps <= LEEWAY
    assert resident_bytes() - rss < 1 << 20, f"resident memory grew {resident_bytes() - rss:,} bytes"


@pytest.mark.slow
def test_fifty_thousand_compiles_keep_memory_flat():
    grown_maps, grown_bytes = soak(compiles=50_000, widths=7)
    assert grown_maps <= LEEWAY, f"{grown_maps} memory mappings left behind by 50,000 dropped networks"
    assert grown_bytes < 16 << 20, f"resident memory grew {grown_bytes:,} bytes over 50,000 compiles"
