"""CachedAttention (a decoder's queries over a KV cache's live rows and its own new rows)
against a per-head numpy loop, on every backend, and its decomposition on the CUDA
backend's host emulator (the CPU runs it whole)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import assert_mentions, check, random_array, run_flow, shape_error

import ranvier as rv
from ranvier.backends.cuda import device

TESTED_OPS = {"CachedAttention"}

SHAPES = [  # (B, H, KV, T, S, hd, length); the CPU takes a key/value head of G·T ≥ 4 query rows as a block
    (1, 4, 2, 1, 16, 8, 5),  # a decode step, grouped-query heads: rows
    (1, 2, 2, 3, 12, 8, 4),  # a short chunk: rows, each seeing the new rows up to its own
    (2, 6, 3, 4, 20, 19, 0),  # a first prompt chunk: no cache rows yet; a ragged head size: blocks
    (1, 3, 1, 3, 9, 37, 9),  # multi-query, the cache full: a block
    (1, 2, 2, 5, 64, 64, 33),  # rows of whole vectors and a tail: blocks
]


def test_the_cpu_takes_a_key_value_heads_many_query_rows_as_a_block():
    kernels = []
    for shape in SHAPES:
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        handles = [f.var(f"x{i}", "float32" if i < 5 else "int32", list(x.shape)) for i, x in enumerate(inputs(shape, "float32"))]
        f.cached_attention(*handles).var.out = True
        (step,) = [s for s in rv.Compiler("cpu").compile(flow).cell("f").steps if s.op.type == "CachedAttention"]
        kernels.append(step.kernel)
    assert kernels == ["CachedAttentionRow"] * 2 + ["CachedAttentionBlock"] * 3


def naive(q, k, v, k_cache, v_cache, length, scale):
    """Loops over heads and queries, float64."""
    q, k, v, k_cache, v_cache = (np.asarray(a, np.float64) for a in (q, k, v, k_cache, v_cache))
    b, h, t, _ = q.shape
    groups = h // k.shape[1]
    out = np.zeros_like(q)
    for n in range(b):
        for head in range(h):
            g = head // groups
            keys = np.concatenate([k_cache[n, g, :length], k[n, g]])
            values = np.concatenate([v_cache[n, g, :length], v[n, g]])
            for i in range(t):
                seen = length + i + 1
                scores = np.array([scale * q[n, head, i] @ keys[j] for j in range(seen)])
                p = np.exp(scores - scores.max())
                out[n, head, i] = p / p.sum() @ values[:seen]
    return out


def inputs(shape, dtype):
    b, h, kv, t, s, hd, length = shape
    arrays = [random_array(x, dtype, seed=i) for i, x in enumerate([(b, h, t, hd), (b, kv, t, hd), (b, kv, t, hd),
                                                                    (b, kv, s, hd), (b, kv, s, hd)])]
    return [*arrays, np.array(length, np.int32)]


@pytest.fixture(params=["measured", "every core"])
def split(request, monkeypatch):
    """The split threshold as measured (these small ops run on one core) or at a byte
    (their query rows shared out over every core, each part with its own scores)."""
    if request.param == "every core":
        monkeypatch.setenv("RANVIER_SPLIT_BYTES", "1")
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cached_attention(dtype, shape, split):
    values = inputs(shape, dtype)
    (got,) = run_flow(lambda f, *x: [f.cached_attention(*x)], values)
    check(got, naive(*values[:5], shape[-1], 1.0 / math.sqrt(shape[5])), dtype)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]])
def test_its_decomposition_on_the_cuda_emulator(shape, monkeypatch):
    """The CUDA backend has no kernel of its own: the masked form runs there."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    values = inputs(shape, "float32")
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", "float32" if i < 5 else "int32", list(x.shape)) for i, x in enumerate(values)]
    out = f.cached_attention(*handles, scale=0.3)
    out.var.out = True
    data = rv.Compiler("cuda").compile(flow).cell("f").instance()
    assert "CachedAttention" not in {step.op.type for step in data.cell.steps}
    for handle, value in zip(handles, values):
        data[handle] = value
    data.compute()
    check(data[out], naive(*values[:5], shape[-1], 0.3), "float32")


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_cache_rows_past_the_length_are_never_read(backend, monkeypatch):
    """Rows from `length` on may hold anything (a stale step's, a padded chunk's): NaN
    there must not reach the output, as it would through a masked score or a zero weight
    (the CPU's kernel, and the decomposed form on the CUDA emulator)."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    shape = SHAPES[4]
    values = inputs(shape, "float32")
    length = shape[-1]
    for cache in values[3:5]:
        cache[:, :, length:] = np.nan
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", "float32" if i < 5 else "int32", list(x.shape)) for i, x in enumerate(values)]
    out = f.cached_attention(*handles)
    out.var.out = True
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    for handle, value in zip(handles, values):
        data[handle] = value
    data.compute()
    assert np.isfinite(data[out]).all()
    check(data[out], naive(*values[:5], length, 1.0 / math.sqrt(shape[5])), "float32")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("length", [-1, 17])
def test_a_length_outside_the_cache_is_an_error(backend, length):
    values = inputs((1, 2, 1, 1, 16, 8, 0), "float32")
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    handles = [f.var(f"x{i}", "float32" if i < 5 else "int32", list(x.shape)) for i, x in enumerate(values)]
    f.cached_attention(*handles).var.out = True
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    for handle, value in zip(handles, values):
        data[handle] = value
    data[handles[5]] = length
    with pytest.raises(rv.RanvierError, match="CachedAttention"):
        data.compute()


def test_cached_attention_shape_errors():
    def message(q, k, cache, length=("l", "int32", [])):
        return shape_error(lambda f, *x: f.cached_attention(*x), [("q", "float32", q), ("k", "float32", k), ("v", "float32", k),
                                                                   ("kc", "float32", cache), ("vc", "float32", cache), length])

    assert_mentions(message([1, 4, 1, 8], [1, 3, 1, 8], [1, 3, 16, 8]), "CachedAttention", "heads H a multiple of key/value heads KV")
    assert_mentions(message([1, 4, 2, 8], [1, 2, 1, 8], [1, 2, 16, 8]), "k and v [B, KV, T, hd] with q's B, T and hd")
    assert_mentions(message([1, 4, 1, 8], [1, 2, 1, 8], [1, 2, 16, 4]), "caches [B, KV, S, hd] with k's B, KV and hd")
    assert_mentions(message([1, 4, 1, 8], [1, 2, 1, 8], [1, 2, 16, 8], ("l", "float32", [])), "a scalar int32/int64 length")
