"""Mixture-of-experts ops: TopK, SoftmaxTopK, MoERoute, GroupedMatMul and its weight
gradient, MoECombine and its gradients, MoEAuxLoss. Expectations are computed here with
plain Python loops and float64 numpy, independently of the ops' references; run_flow runs
the reference and the CPU backend and checks every output element was written."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FLOATS, as_f64, assert_mentions, check, random_array, run_flow

import ranvier as rv

TESTED_OPS = {"TopK", "SoftmaxTopK", "MoERoute", "GroupedMatMul", "GroupedMatMulWeightGrad", "MoECombine", "MoECombineGrad",
              "MoEAuxLoss"}

RNG = np.random.default_rng(5)


def expected_top_k(x: np.ndarray, k: int):
    """Largest first, NaN as the largest, ties to the lower index: a plain sort per row."""
    flat = as_f64(x).reshape(-1, x.shape[-1])
    values, indices = [], []
    for row in flat:
        ranked = sorted(range(len(row)), key=lambda i: (-(np.inf if np.isnan(row[i]) else row[i]), i))[:k]
        indices.append(ranked)
        values.append([row[i] for i in ranked])
    shape = (*x.shape[:-1], k)
    return np.array(values).reshape(shape), np.array(indices).reshape(shape)


@pytest.mark.parametrize("dtype", [*FLOATS, "int32", "int8"])
@pytest.mark.parametrize("shape,k", [((7,), 3), ((5, 8), 2), ((2, 3, 16), 5), ((4, 9), 9), ((3, 33), 1)])
def test_top_k(dtype, shape, k):
    x = random_array(shape, dtype, seed=k, low=-20, high=20)
    values, indices = run_flow(lambda f, a: a.top_k(k), [x])
    want_values, want_indices = expected_top_k(x, k)
    np.testing.assert_array_equal(indices, want_indices)
    check(values, want_values, dtype)


def test_top_k_ties_and_nan():
    x = np.array([[1.0, 3.0, 3.0, -np.inf, 3.0], [np.nan, 2.0, np.inf, np.nan, -1.0], [-np.inf] * 5], np.float32)
    values, indices = run_flow(lambda f, a: a.top_k(4), [x])
    np.testing.assert_array_equal(indices, [[1, 2, 4, 0], [0, 2, 3, 1], [0, 1, 2, 3]])
    np.testing.assert_array_equal(values[0], [3, 3, 3, 1])
    assert np.isnan(values[1, 0]) and values[1, 1] == np.inf and np.isnan(values[1, 2]) and values[1, 3] == 2


def test_top_k_checks_k():
    flow = rv.Flow()
    x = rv.Builder(flow, "f").var("x", "float32", [3, 4])
    with pytest.raises(rv.ShapeError) as error:
        x.top_k(5)
    assert_mentions(str(error.value), "TopK", "k in [1, 4]")


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_top_k_direct_and_fused(dtype):
    """As an op of its own, and as the compiler's fusion of a softmax read by a TopK."""
    x = random_array((6, 8), dtype, seed=3, low=-4, high=4)
    probs, values, indices = run_flow(lambda f, a: f.op("SoftmaxTopK", [a], None, {"k": 3}), [x])
    e = np.exp(as_f64(x) - as_f64(x).max(axis=1, keepdims=True))
    want_probs = e / e.sum(axis=1, keepdims=True)
    check(probs, want_probs, dtype)
    want_values, want_indices = expected_top_k(want_probs, 3)
    check(values, want_values, dtype)
    if dtype in ("float32", "float64"):  # half precision may round near-ties differently
        np.testing.assert_array_equal(indices, want_indices)
    fused = run_flow(lambda f, a: [*a.softmax().top_k(3), a.softmax()], [x])
    for got, want in zip(fused, [values, indices, probs]):
        np.testing.assert_array_equal(got, want)


def test_the_router_softmax_and_top_k_fuse_into_one_step():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    logits = f.var("x", "float32", [10, 8])
    probs = logits.softmax()
    values, indices = probs.top_k(2)
    for t in (values, indices, probs.mean(axis=0)):
        t.var.out = True
    kernels = [s.kernel for s in rv.Compiler().compile(flow).cell("f").steps]
    assert "SoftmaxTopKRow" in kernels and "SoftmaxRow" not in kernels and "TopKRow" not in kernels


def expected_route(choices: np.ndarray, experts: int, capacity: int):
    tokens, k = choices.shape
    rows_of = [[] for _ in range(experts)]
    counts = [0] * experts
    for t in range(tokens):
        for j in range(k):
            e = int(choices[t, j])
            counts[e] += 1
            if capacity == 0 or len(rows_of[e]) < capacity:
                rows_of[e].append((t, j))
    offsets = np.cumsum([0] + [len(r) for r in rows_of])
    total = tokens * k if capacity == 0 else min(tokens * k, experts * capacity)
    order = np.zeros(total, np.int64)
    slot = np.zeros((tokens, k), np.int64)
    kept = np.zeros((tokens, k), bool)
    for e, assigned in enumerate(rows_of):
        for position, (t, j) in enumerate(assigned):
            row = offsets[e] + position
            order[row], slot[t, j], kept[t, j] = t, row, True
    return order, slot, offsets, kept, np.array(counts)


@pytest.mark.parametrize("tokens,k,experts,capacity", [(13, 2, 5, 0), (40, 2, 8, 6), (7, 1, 3, 0), (9, 3, 4, 2), (16, 4, 4, 4)])
def test_moe_route(tokens, k, experts, capacity):
    choices = np.stack([RNG.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    if experts > 3:
        choices[: tokens // 2, 0] = 1  # a popular expert, so capacity bites
    got = run_flow(lambda f, c: f.moe_route(c, experts=experts, capacity=capacity), [choices])
    for name, value, want in zip(("order", "slot", "offsets", "kept", "counts"), got, expected_route(choices, experts, capacity)):
        np.testing.assert_array_equal(value, want, err_msg=name)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_moe_route_refuses_an_expert_out_of_range(backend):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    choices = f.var("c", "int32", [3, 2])
    outputs = f.moe_route(choices, experts=4)
    for t in outputs:
        t.var.out = True
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    data[choices] = np.array([[0, 1], [2, 4], [3, 0]], np.int32)
    with pytest.raises(rv.RanvierError, match="MoERoute"):
        data.compute()


def _offsets(rows: int, experts: int, used: int, seed: int) -> np.ndarray:
    """Group bounds over the first `used` rows, with empty groups among them."""
    cuts = np.sort(np.random.default_rng(seed).integers(0, used + 1, experts - 1))
    cuts[len(cuts) // 2] = cuts[len(cuts) // 2 - 1] if len(cuts) > 1 else cuts[0]  # an empty group
    return np.concatenate([[0], cuts, [used]]).astype(np.int32)


def expected_grouped(x, w, offsets, transpose_b):
    y = np.zeros((x.shape[0], w.shape[1] if transpose_b else w.shape[2]))
    for e in range(w.shape[0]):
        for r in range(offsets[e], offsets[e + 1]):
            matrix = as_f64(w[e]).T if transpose_b else as_f64(w[e])
            y[r] = as_f64(x[r]) @ matrix
    return y


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("rows,used", [(24, 24), (30, 21)])
def test_grouped_matmul(dtype, transpose_b, rows, used):
    experts, k, n = 5, 7, 9
    x = random_array((rows, k), dtype, seed=1)
    w = random_array((experts, n, k) if transpose_b else (experts, k, n), dtype, seed=2)
    offsets = _offsets(rows, experts, used, seed=rows)
    (y,) = run_flow(lambda f, a, b, o: [f.grouped_matmul(a, b, o, transpose_b=transpose_b)], [x, w, offsets])
    check(y, expected_grouped(x, w, offsets, transpose_b), dtype)
    assert not y[used:].any()  # rows past the last group are zero


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_matmul_weight_grad(dtype, transpose):
    rows, experts, k, n = 26, 4, 6, 5
    x, dy = random_array((rows, k), dtype, seed=3), random_array((rows, n), dtype, seed=4)
    offsets = _offsets(rows, experts, 22, seed=9)
    (dw,) = run_flow(lambda f, a, d, o: [f.grouped_matmul_weight_grad(a, d, o, experts, transpose=transpose)], [x, dy, offsets])
    want = np.zeros((experts, n, k) if transpose else (experts, k, n))
    for e in range(experts):
        for r in range(offsets[e], offsets[e + 1]):
            outer = np.outer(as_f64(x[r]), as_f64(dy[r]))
            want[e] += outer.T if transpose else outer
    check(dw, want, dtype)


def _expected_pair(x, w, dy, offsets, transpose):
    """float64 y of each group through its expert's matrix, and each expert's gradient."""
    want_y, want_dw = np.zeros((x.shape[0], dy.shape[1])), np.zeros(w.shape)
    for e in range(w.shape[0]):
        group = slice(offsets[e], offsets[e + 1])
        want_y[group] = as_f64(x[group]) @ (as_f64(w[e]).T if transpose else as_f64(w[e]))
        outer = as_f64(x[group]).T @ as_f64(dy[group])
        want_dw[e] = outer.T if transpose else outer
    return want_y, want_dw


def _check_grouped_pair(sizes: tuple[int, int, int, int, int], transpose: bool, dtype: str, seed: int) -> None:
    """A grouped product and its weight gradient over (rows, used rows, experts, k, n), with
    unequal groups, an empty one and dropped rows, against float64: every group whole,
    rows past the last group zero, unchosen experts' gradients zero."""
    rows, used, experts, k, n = sizes
    x, dy = random_array((rows, k), dtype, seed=seed), random_array((rows, n), dtype, seed=seed + 1)
    w = random_array((experts, n, k) if transpose else (experts, k, n), dtype, seed=seed + 2)
    offsets = _offsets(rows, experts, used, seed=seed + 3)
    y, dw = run_flow(lambda f, a, b, d, o: [f.grouped_matmul(a, b, o, transpose_b=transpose),
                                            f.grouped_matmul_weight_grad(a, d, o, experts, transpose=transpose)],
                     [x, w, dy, offsets])
    want_y, want_dw = _expected_pair(x, w, dy, offsets, transpose)
    check(y, want_y, dtype)
    check(dw, want_dw, dtype)
    assert not y[used:].any()


@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_gemms_split_over_the_pool(transpose):
    """Products above the split threshold, the experts claimed by the pool's parts."""
    _check_grouped_pair((640, 600, 6, 256, 509), transpose, "float64", seed=6)


@pytest.mark.parametrize("gemm", ["generated", "blas"])
@pytest.mark.parametrize("threads", [2, 3, 16])
def test_grouped_gemm_work_items_claimed_by_the_parts(threads, gemm, monkeypatch):
    """Each piece of an expert's product is a work item the parts claim at run time, as
    many pieces as give each part 4 items: 5 experts' 331 columns go in 2, 3 and 7
    pieces (the last one ragged) for 2, 3 and 16 parts, more parts than the pool has
    threads."""
    from ranvier.backends.cpu import parallel
    from ranvier.backends.cpu.kernels import moe

    monkeypatch.setenv("RANVIER_GEMM", gemm)
    monkeypatch.setenv("RANVIER_SPLIT_BYTES", "1024")
    monkeypatch.setattr(moe, "thread_count", lambda: threads)
    monkeypatch.setattr(parallel, "thread_count", lambda: threads)
    parallel.split_thresholds.cache_clear()
    try:
        for transpose in (False, True):
            _check_grouped_pair((200, 190, 5, 40, 331), transpose, "float32", seed=13)
    finally:  # the next test measures (or reads) its own thresholds again
        parallel.split_thresholds.cache_clear()


@pytest.mark.parametrize("gemm", ["generated", "blas"])
def test_grouped_gemm_claims_the_largest_groups_first(gemm, monkeypatch):
    """The parts claim the experts largest group first, ties by number: groups of equal
    sizes (two of 40 rows, three empty) each computed once, none skipped."""
    from ranvier.backends.cpu import parallel
    from ranvier.backends.cpu.kernels import moe

    monkeypatch.setenv("RANVIER_GEMM", gemm)
    monkeypatch.setenv("RANVIER_SPLIT_BYTES", "1024")
    monkeypatch.setattr(moe, "thread_count", lambda: 3)
    monkeypatch.setattr(parallel, "thread_count", lambda: 3)
    parallel.split_thresholds.cache_clear()
    offsets = np.cumsum([0, 5, 40, 0, 40, 0, 17, 0]).astype(np.int32)  # 7 experts, 102 of 110 rows
    x, dy = random_array((110, 24), "float32", seed=21), random_array((110, 50), "float32", seed=22)
    w = random_array((7, 24, 50), "float32", seed=23)
    try:
        y, dw = run_flow(lambda f, a, b, d, o: [f.grouped_matmul(a, b, o), f.grouped_matmul_weight_grad(a, d, o, 7)],
                         [x, w, dy, offsets])
    finally:
        parallel.split_thresholds.cache_clear()
    want_y, want_dw = _expected_pair(x, w, dy, offsets, False)
    check(y, want_y, "float32")
    check(dw, want_dw, "float32")


@pytest.mark.parametrize("gemm,kernels", [("generated", ["GroupedGemm", "GroupedGemmWeightGrad"]),
                                          ("blas", ["GroupedBlasGemm", "GroupedBlasGemmWeightGrad"])])
@pytest.mark.parametrize("transpose", [False, True])
def test_float32_grouped_gemms_through_either_gemm(transpose, gemm, kernels, monkeypatch):
    """float32 groups go through ranvier's generated GEMM where it measured faster
    (RANVIER_GEMM fixes the choice here), else BLAS: the same results either way."""
    monkeypatch.setenv("RANVIER_GEMM", gemm)
    rows, used, experts, k, n = 300, 280, 5, 70, 131
    x, dy = random_array((rows, k), "float32", seed=6), random_array((rows, n), "float32", seed=7)
    w = random_array((experts, n, k) if transpose else (experts, k, n), "float32", seed=8)
    offsets = _offsets(rows, experts, used, seed=12)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    hx, hw, hd = f.var("x", "float32", [rows, k]), f.var("w", "float32", list(w.shape)), f.var("dy", "float32", [rows, n])
    ho = f.var("offsets", "int32", [experts + 1])
    y = f.grouped_matmul(hx, hw, ho, transpose_b=transpose)
    dw = f.grouped_matmul_weight_grad(hx, hd, ho, experts, transpose=transpose)
    y.var.out = dw.var.out = True
    cell = rv.Compiler("cpu", cache=False).compile(flow).cell("f")
    assert [s.kernel for s in cell.steps] == kernels
    data = cell.instance()
    for handle, value in [(hx, x), (hw, w), (hd, dy), (ho, offsets.astype(np.int32))]:
        data[handle] = value
    data[y], data[dw] = np.full(y.shape, np.nan, np.float32), np.full(dw.shape, np.nan, np.float32)
    data.compute()
    want_y, want_dw = _expected_pair(x, w, dy, offsets, transpose)
    check(data[y], want_y, "float32", rtol=1e-5, atol=1e-4)
    check(data[dw], want_dw, "float32", rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("offsets", [[0, 4, 9], [1, 3, 6], [0, 4, 2], [-1, 2, 6]],
                         ids=["past the rows", "not from 0", "falling", "negative"])
def test_grouped_matmul_refuses_bad_offsets(backend, offsets):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w, o = f.var("x", "float32", [6, 3]), f.var("w", "float32", [2, 3, 4]), f.var("o", "int32", [3])
    y = f.grouped_matmul(x, w, o)
    y.var.out = True
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    data[x], data[w] = RNG.standard_normal((6, 3)), RNG.standard_normal((2, 3, 4))
    data[o] = np.array(offsets, np.int32)
    with pytest.raises(rv.RanvierError, match="GroupedMatMul"):
        data.compute()


def test_grouped_matmul_checks_shapes():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w, o = f.var("x", "float32", [6, 3]), f.var("w", "float32", [2, 5, 4]), f.var("o", "int32", [3])
    with pytest.raises(rv.ShapeError) as error:
        f.grouped_matmul(x, w, o)
    assert_mentions(str(error.value), "GroupedMatMul", "inner dimension")


def _combine_inputs(rows: int, tokens: int, k: int, width: int, dtype: str, seed: int):
    """Expert rows, slots (some rows chosen twice, some never) and weights, and a d y."""
    slot = np.random.default_rng(seed).integers(0, rows, (tokens, k)).astype(np.int32)
    slot[0, 0] = slot[-1, -1]  # a row two choices share
    return (random_array((rows, width), dtype, seed=seed + 1), slot, random_array((tokens, k), dtype, seed=seed + 2),
            random_array((tokens, width), dtype, seed=seed + 3))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows,tokens,k,width", [(7, 4, 2, 5), (40, 19, 3, 37), (64, 32, 2, 48)])
def test_moe_combine_and_its_gradients(dtype, rows, tokens, k, width):
    out, slot, weights, dy = _combine_inputs(rows, tokens, k, width, dtype, seed=rows)
    y, d_rows, d_weights = run_flow(lambda f, r, s, w, g: [f.moe_combine(r, s, w), *f.moe_combine_grad(g, r, s, w)],
                                    [out, slot, weights, dy])
    want_y, want_rows, want_weights = np.zeros((tokens, width)), np.zeros((rows, width)), np.zeros((tokens, k))
    for t in range(tokens):
        for j in range(k):
            row = slot[t, j]
            want_y[t] += as_f64(weights)[t, j] * as_f64(out)[row]
            want_rows[row] += as_f64(weights)[t, j] * as_f64(dy)[t]
            want_weights[t, j] = as_f64(dy)[t] @ as_f64(out)[row]
    check(y, want_y, dtype)
    check(d_rows, want_rows, dtype)
    check(d_weights, want_weights, dtype)
    assert not d_rows[sorted(set(range(rows)) - set(slot.reshape(-1)))].any()  # rows no token chose


def test_moe_combine_decomposes_into_gathers_and_a_scatter():
    """A backend without its kernels (the CUDA one) runs the ops as Gather, products and
    sums, and ScatterAdd: the same results."""
    from ranvier.compiler.decompose import decompose

    out, slot, weights, dy = _combine_inputs(9, 6, 2, 4, "float64", seed=3)
    results = []
    for whole in (True, False):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        r, s, w, g = (f.var(name, rv.dtypes.from_numpy(a.dtype), list(a.shape)) for name, a in zip("rswg", (out, slot, weights, dy)))
        outputs = [f.moe_combine(r, s, w), *f.moe_combine_grad(g, r, s, w)]
        for t in outputs:
            t.var.out = True
        if not whole:
            decompose(flow, flow.func("f"), lambda op: False)
            assert not {"MoECombine", "MoECombineGrad"} & {op.type for op in flow.func("f").ops}
        data = rv.Compiler("reference").compile(flow).cell("f").instance()
        for var, value in zip((r, s, w, g), (out, slot, weights, dy)):
            data[var] = value
        data.compute()
        results.append([np.array(data[t]) for t in outputs])
    for whole, parts in zip(*results):
        np.testing.assert_allclose(parts, whole, rtol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_moe_combine_refuses_a_slot_out_of_range(backend):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    r, s, w = f.var("r", "float32", [5, 3]), f.var("s", "int32", [2, 2]), f.var("w", "float32", [2, 2])
    y = f.moe_combine(r, s, w)
    y.var.out = True
    data = rv.Compiler(backend).compile(flow).cell("f").instance()
    data[r], data[w] = RNG.standard_normal((5, 3)), RNG.standard_normal((2, 2))
    data[s] = np.array([[0, 1], [5, 2]], np.int32)  # 5: past the 5 rows
    with pytest.raises(rv.RanvierError, match="MoECombine"):
        data.compute()


def test_moe_combine_checks_shapes():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    r, s, w = f.var("r", "float32", [5, 3]), f.var("s", "int32", [2, 3]), f.var("w", "float32", [2, 2])
    with pytest.raises(rv.ShapeError) as error:
        f.moe_combine(r, s, w)
    assert_mentions(str(error.value), "MoECombine", "int32 slots")


@pytest.mark.parametrize("dtype", FLOATS)
def test_load_balancing_loss(dtype):
    probs = random_array((12, 4), dtype, seed=6, low=0.01, high=1.0)
    counts = np.array([9, 3, 0, 12], np.int32)
    (loss,) = run_flow(lambda f, p, c: [f.load_balancing_loss(p, c)], [probs, counts])
    want = 4 * sum(counts[i] / 12 * as_f64(probs)[:, i].mean() for i in range(4))
    check(loss, want, dtype)


def test_load_balancing_loss_is_k_for_uniform_routing_and_the_expert_count_for_collapse():
    uniform = np.full((8, 4), 0.25, np.float64)
    (balanced,) = run_flow(lambda f, p, c: [f.load_balancing_loss(p, c)], [uniform, np.array([2, 2, 2, 2], np.int32)])
    (balanced_top2,) = run_flow(lambda f, p, c: [f.load_balancing_loss(p, c)], [uniform, np.array([4, 4, 4, 4], np.int32)])
    collapsed = np.zeros((8, 4))
    collapsed[:, 2] = 1.0
    (worst,) = run_flow(lambda f, p, c: [f.load_balancing_loss(p, c)], [collapsed, np.array([0, 0, 8, 0], np.int32)])
    assert balanced == pytest.approx(1.0) and balanced_top2 == pytest.approx(2.0) and worst == pytest.approx(4.0)
