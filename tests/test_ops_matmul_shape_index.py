"""MatMul; the shape ops Reshape Transpose Concat Split Slice BroadcastTo ExpandDims Squeeze;
and the indexing ops Gather ScatterAdd OneHot."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import (
    ALL,
    INTS,
    NUMERIC,
    UNSIGNED_INTS,
    as_f64,
    assert_mentions,
    check,
    np_dtype,
    random_array,
    run1,
    run_flow,
    shape_error,
)

import ranvier

pytestmark = pytest.mark.filterwarnings("error")

TESTED_OPS = {
    "MatMul", "Reshape", "Transpose", "Concat", "Split", "Slice", "BroadcastTo", "ExpandDims", "Squeeze",
    "Gather", "ScatterAdd", "OneHot",
}


# ---- MatMul ----------------------------------------------------------------------------------------


def naive_matmul(a, b):
    """[..., M, K] @ [..., K, N] with broadcast batches, by explicit sums over K."""
    a, b = np.asarray(a), np.asarray(b)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, (*batch, *a.shape[-2:])).reshape(-1, *a.shape[-2:])
    b = np.broadcast_to(b, (*batch, *b.shape[-2:])).reshape(-1, *b.shape[-2:])
    m, k, n = a.shape[1], a.shape[2], b.shape[2]
    out = np.zeros((a.shape[0], m, n), dtype=a.dtype)
    for kk in range(k):
        out += a[:, :, kk : kk + 1] * b[:, kk : kk + 1, :]
    return out.reshape(*batch, m, n)


def _mm_inputs(dtype, sa, sb, seed=1):
    if dtype in INTS:
        low, high = (0, 3) if dtype in UNSIGNED_INTS else (-3, 3)
    else:
        low, high = -2, 2
    return random_array(sa, dtype, seed=seed, low=low, high=high), random_array(sb, dtype, seed=seed + 1, low=low, high=high)


def _as_exact(a, dtype):
    return a.astype(np.int64) if dtype in INTS else as_f64(a)


@pytest.mark.parametrize("dtype", NUMERIC)
def test_matmul_dtypes(dtype):
    a, b = _mm_inputs(dtype, (7, 13), (13, 5))
    out = run1(lambda f, x, y: f.matmul(x, y), a, b)
    check(out, naive_matmul(_as_exact(a, dtype), _as_exact(b, dtype)), dtype)


@pytest.mark.parametrize("transpose_b", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("transpose_a", [False, True], ids=["a", "aT"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_matmul_transposes(dtype, transpose_a, transpose_b):
    m, k, n = 7, 13, 5
    a, b = _mm_inputs(dtype, (k, m) if transpose_a else (m, k), (n, k) if transpose_b else (k, n), seed=3)
    out = run1(lambda f, x, y: f.matmul(x, y, transpose_a=transpose_a, transpose_b=transpose_b), a, b)
    ea, eb = _as_exact(a, dtype), _as_exact(b, dtype)
    expected = naive_matmul(ea.T if transpose_a else ea, eb.T if transpose_b else eb)
    check(out, expected, dtype)


BATCH_CASES = [
    ((2, 7, 13), (13, 5)),
    ((7, 13), (3, 13, 5)),
    ((2, 7, 13), (2, 13, 5)),
    ((3, 1, 7, 5), (4, 5, 6)),
    ((1, 3, 2), (4, 1, 2, 9)),
    ((1, 1), (1, 1)),
]


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("sa,sb", BATCH_CASES, ids=[f"{'x'.join(map(str, a))}@{'x'.join(map(str, b))}" for a, b in BATCH_CASES])
def test_matmul_batch_broadcasting(sa, sb, transpose):
    a, b = _mm_inputs("float64", sa, sb, seed=5)
    if transpose:  # the same product written as aᵀᵀ @ bᵀᵀ
        at, bt = np.swapaxes(a, -1, -2).copy(), np.swapaxes(b, -1, -2).copy()
        out = run1(lambda f, x, y: f.matmul(x, y, transpose_a=True, transpose_b=True), at, bt)
    else:
        out = run1(lambda f, x, y: x @ y, a, b)
    check(out, naive_matmul(a, b), "float64")


def test_matmul_with_constant_weights():
    a = random_array((3, 7), "float32", seed=7)
    w = random_array((7, 33), "float32", seed=8)
    out = run1(lambda f, x: x @ f.array("w", w), a)
    check(out, naive_matmul(as_f64(a), as_f64(w)), "float32")


def test_matmul_inner_dimension_error():
    message = shape_error(lambda f, a, b: f.matmul(a, b), [("a", "float32", [2, 3]), ("b", "float32", [4, 5])])
    assert_mentions(message, "f/MatMul", "f/a: float32[2x3]", "f/b: float32[4x5]", "inner dimensions", "K=3", "K=4")


def test_matmul_transposed_inner_dimension_error():
    message = shape_error(lambda f, a, b: f.matmul(a, b, transpose_b=True), [("a", "float32", [2, 3]), ("b", "float32", [3, 5])])
    assert_mentions(message, "f/MatMul", "f/b: float32[3x5]", "K=3", "K=5")


def test_matmul_rank_dtype_and_batch_errors():
    message = shape_error(lambda f, a, b: a @ b, [("a", "float32", [3]), ("b", "float32", [3, 5])])
    assert_mentions(message, "f/MatMul", "f/a: float32[3]", "rank 2")
    message = shape_error(lambda f, a, b: a @ b, [("a", "float32", [2, 3]), ("b", "float16", [3, 5])])
    assert_mentions(message, "f/MatMul", "f/b: float16[3x5]", "one dtype")
    message = shape_error(lambda f, a, b: a @ b, [("a", "bool", [2, 3]), ("b", "bool", [3, 5])])
    assert_mentions(message, "f/MatMul", "numeric")
    message = shape_error(lambda f, a, b: a @ b, [("a", "float32", [2, 4, 3]), ("b", "float32", [3, 3, 5])])
    assert_mentions(message, "f/MatMul", "f/a: float32[2x4x3]", "f/b: float32[3x3x5]", "broadcast")


# ---- Reshape / Transpose / ExpandDims / Squeeze / BroadcastTo ---------------------------------------


RESHAPES = [((3, 7, 5), [105]), ((3, 7, 5), [-1, 5]), ((3, 7, 5), [7, -1]), ((3, 7, 5), [5, 3, 7]),
            ((105,), [3, 5, -1]), ((1,), []), ((), [1, 1]), ((2, 0), [0, 5])]


@pytest.mark.parametrize("shape,target", RESHAPES, ids=[f"{s}->{t}" for s, t in RESHAPES])
def test_reshape(shape, target):
    x = random_array(shape, "float32", seed=11)
    out = run1(lambda f, a: f.reshape(a, target), x)
    size = int(np.prod(shape))
    known = int(np.prod([d for d in target if d != -1])) if target else 1
    final = [size // known if d == -1 else d for d in target]
    check(out, as_f64(x).reshape(final), "float32", rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL)
def test_shape_ops_keep_every_dtype(dtype):
    x = random_array((3, 1, 7), dtype, seed=12, low=1, high=9)
    outs = run_flow(
        lambda f, a: (
            a.reshape([7, 3]),
            a.transpose([2, 0, 1]),
            a.expand_dims(0),
            a.squeeze(),
            a.broadcast_to([2, 3, 5, 7]),
            a.slice([1, 0, 2], [2, 1, 4]),
            f.concat([a, a], axis=1),
            a.split(7, axis=-1)[3],
        ),
        [x],
    )
    expected = [
        x.reshape(7, 3), x.transpose(2, 0, 1), x[None], x[:, 0, :], np.broadcast_to(x, (2, 3, 5, 7)),
        x[1:3, 0:1, 2:6], np.concatenate([x, x], axis=1), x[:, :, 3:4],
    ]
    for out, e in zip(outs, expected):
        check(out, e, dtype, rtol=0, atol=0)


PERMS = [None, [0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1], [2, 0, 1], [1, 2, 0]]


@pytest.mark.parametrize("perm", PERMS, ids=[str(p) for p in PERMS])
def test_transpose(perm):
    x = random_array((3, 7, 5), "float32", seed=13)
    out = run1(lambda f, a: f.transpose(a, perm), x)
    order = perm if perm is not None else [2, 1, 0]
    expected = np.empty([x.shape[p] for p in order], np.float32)
    for idx in itertools.product(*[range(d) for d in x.shape]):
        expected[tuple(idx[p] for p in order)] = x[idx]
    check(out, expected, "float32", rtol=0, atol=0)


def test_transpose_rank4_and_matrix_shorthands():
    x = random_array((2, 3, 5, 7), "float16", seed=14)
    y = random_array((5, 13), "float16", seed=15)
    outs = run_flow(lambda f, a, b: (a.transpose([3, 1, 0, 2]), b.T, f.t(b)), [x, y])
    check(outs[0], np.moveaxis(x, [3, 1, 0, 2], [0, 1, 2, 3]), "float16", rtol=0, atol=0)
    check(outs[1], y.T, "float16", rtol=0, atol=0)
    check(outs[2], y.T, "float16", rtol=0, atol=0)


def test_transposes_chained_through_reused_memory():
    """Intermediates may be written over inputs that die at the op (in-place); results must not suffer."""
    x = random_array((7, 13), "float32", seed=16)
    out = run1(lambda f, a: (a.exp().T.reshape([13, 7]).T + 1).neg().T, x)
    check(out, (-(np.exp(as_f64(x)) + 1)).T, "float32")


@pytest.mark.parametrize("axis,shape", [(0, [1, 3, 7]), (1, [3, 1, 7]), (2, [3, 7, 1]), (-1, [3, 7, 1]), (-3, [1, 3, 7])])
def test_expand_dims(axis, shape):
    x = random_array((3, 7), "int32", seed=17)
    out = run1(lambda f, a: f.expand_dims(a, axis), x)
    check(out, x.reshape(shape), "int32")


@pytest.mark.parametrize("axis,shape", [(None, [3, 7]), (0, [3, 1, 7, 1]), ([0, 2], [3, 7, 1]), (-1, [1, 3, 1, 7]), ([], [3, 7])])
def test_squeeze(axis, shape):
    x = random_array((1, 3, 1, 7, 1), "float32", seed=18)
    out = run1(lambda f, a: f.squeeze(a, axis), x)
    check(out, as_f64(x).reshape(shape), "float32", rtol=0, atol=0)


@pytest.mark.parametrize("shape,target", [((), [3, 5]), ((5,), [3, 5]), ((3, 1), [3, 5]), ((1, 5), [2, 3, 5]), ((3, 1, 5), [3, 7, 5]), ((2, 3), [2, 3])])
def test_broadcast_to(shape, target):
    x = random_array(shape, "float32", seed=19)
    out = run1(lambda f, a: f.broadcast_to(a, target), x)
    expected = np.empty(target)
    offset = len(target) - len(shape)
    for idx in itertools.product(*[range(d) for d in target]):
        src = tuple(0 if shape[i] == 1 else idx[i + offset] for i in range(len(shape)))
        expected[idx] = x[src]
    check(out, expected, "float32", rtol=0, atol=0)


def test_reshape_errors():
    message = shape_error(lambda f, a: f.reshape(a, [4, 4]), [("x", "float32", [3, 5])])
    assert_mentions(message, "f/Reshape", "f/x: float32[3x5]", "15 elements", "[4, 4]")
    message = shape_error(lambda f, a: f.reshape(a, [-1, -1]), [("x", "float32", [3, 5])])
    assert_mentions(message, "f/Reshape", "at most one -1")
    message = shape_error(lambda f, a: f.reshape(a, [4, -1]), [("x", "float32", [3, 5])])
    assert_mentions(message, "f/Reshape", "divide 15")
    message = shape_error(lambda f, a, s: f.op("Reshape", [a, s]), [("x", "float32", [3, 5]), ("s", "int32", [2])])
    assert_mentions(message, "f/Reshape", "constant")


def test_transpose_bad_perm_error():
    message = shape_error(lambda f, a: f.transpose(a, [0, 0, 1]), [("x", "float32", [3, 7, 5])])
    assert_mentions(message, "f/Transpose", "f/x: float32[3x7x5]", "permutation of 0..2", "[0, 0, 1]")
    message = shape_error(lambda f, a: f.transpose(a, [1, 0]), [("x", "float32", [3, 7, 5])])
    assert_mentions(message, "f/Transpose", "permutation")


def test_expand_squeeze_broadcast_errors():
    message = shape_error(lambda f, a: f.expand_dims(a, 3), [("x", "float32", [3, 7])])
    assert_mentions(message, "f/ExpandDims", "f/x: float32[3x7]", "axis in [-3, 2]", "got 3")
    message = shape_error(lambda f, a: f.squeeze(a, 1), [("x", "float32", [1, 3])])
    assert_mentions(message, "f/Squeeze", "f/x: float32[1x3]", "size 1")
    message = shape_error(lambda f, a: f.squeeze(a, 2), [("x", "float32", [1, 3])])
    assert_mentions(message, "f/Squeeze", "axis in [-2, 2)")
    message = shape_error(lambda f, a: f.broadcast_to(a, [3, 4]), [("x", "float32", [3, 5])])
    assert_mentions(message, "f/BroadcastTo", "f/x: float32[3x5]", "[3, 4]")
    message = shape_error(lambda f, a: f.broadcast_to(a, [5]), [("x", "float32", [3, 5])])
    assert_mentions(message, "f/BroadcastTo", "[5]")
    message = shape_error(lambda f, a: f.broadcast_to(a, [-1, 5]), [("x", "float32", [1, 5])])
    assert_mentions(message, "f/BroadcastTo", "[-1, 5]")


# ---- Concat / Split / Slice --------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_concat(axis, count):
    base = [3, 4, 5]
    parts = []
    for i in range(count):
        shape = list(base)
        shape[axis] = [2, 7, 1][i]
        parts.append(random_array(shape, "float32", seed=20 + i))
    out = run_flow(lambda f, *xs: f.concat(list(xs), axis=axis), parts)[0]
    # Place each part by hand along the axis.
    total = sum(p.shape[axis] for p in parts)
    shape = list(base)
    shape[axis] = total
    expected = np.empty(shape, np.float32)
    start = 0
    for p in parts:
        index = [slice(None)] * 3
        index[axis] = slice(start, start + p.shape[axis])
        expected[tuple(index)] = p
        start += p.shape[axis]
    check(out, expected, "float32", rtol=0, atol=0)


def test_concat_of_constants_and_inputs():
    x = random_array((2, 3), "int64", seed=24)
    c = np.arange(9, dtype=np.int64).reshape(3, 3) + 100
    out = run1(lambda f, a: f.concat([f.array("c", c), a, a], axis=0), x)
    check(out, np.vstack([c, x, x]), "int64")


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("count", [1, 3, 7])
def test_split_count(count, axis):
    shape = [21, 21, 21]
    x = random_array(shape, "float32", seed=25)
    outs = run_flow(lambda f, a: f.split(a, count, axis=axis), [x])
    assert len(outs) == count
    step = shape[axis] // count
    for i, out in enumerate(outs):
        index = [slice(None)] * 3
        index[axis] = slice(i * step, (i + 1) * step)
        check(out, x[tuple(index)], "float32", rtol=0, atol=0)


@pytest.mark.parametrize("sizes,axis", [([2, 5, 6], 1), ([13], 1), ([0, 13], -1), ([1, 1, 1], 0), ([4, 9], 1)])
def test_split_sizes(sizes, axis):
    x = random_array((3, 13), "bfloat16", seed=26)
    outs = run_flow(lambda f, a: f.split(a, sizes, axis=axis), [x])
    assert [o.shape[axis] for o in outs] == sizes
    bounds = np.cumsum([0, *sizes])
    for out, lo, hi in zip(outs, bounds[:-1], bounds[1:]):
        index = [slice(None)] * 2
        index[axis] = slice(lo, hi)
        check(out, x[tuple(index)], "bfloat16", rtol=0, atol=0)


def test_split_then_concat_roundtrip():
    x = random_array((4, 33), "float64", seed=27)
    out = run1(lambda f, a: f.concat(list(reversed(f.split(a, [10, 3, 20], axis=1))), axis=1), x)
    check(out, np.hstack([x[:, 13:], x[:, 10:13], x[:, :10]]), "float64", rtol=0, atol=0)


@pytest.mark.parametrize("begin,size", [([0, 0, 0], [3, 7, 5]), ([1, 2, 3], [2, 4, 2]), ([0, 6, 0], [-1, -1, -1]),
                                        ([2, 0, 4], [1, 7, 1]), ([1, 3, 0], [0, 2, 5]), ([3, 0, 0], [-1, 2, 1])])
def test_slice(begin, size):
    x = random_array((3, 7, 5), "float32", seed=28)
    out = run1(lambda f, a: f.slice(a, begin, size), x)
    ends = [d if s == -1 else b + s for b, s, d in zip(begin, size, x.shape)]
    expected = np.array(
        [[[x[i, j, k] for k in range(begin[2], ends[2])] for j in range(begin[1], ends[1])] for i in range(begin[0], ends[0])],
        dtype=np.float32,
    ).reshape([e - b for b, e in zip(begin, ends)])
    check(out, expected, "float32", rtol=0, atol=0)


def test_concat_errors():
    message = shape_error(lambda f, a, b: f.concat([a, b], axis=1), [("a", "float32", [2, 3]), ("b", "float32", [4, 5])])
    assert_mentions(message, "f/Concat", "f/a: float32[2x3]", "f/b: float32[4x5]", "agree except on axis 1")
    message = shape_error(lambda f, a, b: f.concat([a, b], axis=0), [("a", "float32", [2, 3]), ("b", "int32", [2, 3])])
    assert_mentions(message, "f/Concat", "f/b: int32[2x3]", "one dtype")
    message = shape_error(lambda f, a, b: f.concat([a, b], axis=2), [("a", "float32", [2, 3]), ("b", "float32", [2, 3])])
    assert_mentions(message, "f/Concat", "axis in [-2, 2)", "got 2")
    message = shape_error(lambda f, a, b: f.concat([a, b], axis=0), [("a", "float32", []), ("b", "float32", [])])
    assert_mentions(message, "f/Concat", "f/a: float32", "rank")


def test_split_errors():
    message = shape_error(lambda f, a: f.split(a, 4, axis=1), [("x", "float32", [3, 13])])
    assert_mentions(message, "f/Split", "f/x: float32[3x13]", "divides dimension 13", "got 4")
    message = shape_error(lambda f, a: f.split(a, [5, 5], axis=1), [("x", "float32", [3, 13])])
    assert_mentions(message, "f/Split", "add up to dimension 13", "[5, 5]")
    message = shape_error(lambda f, a: f.split(a, 2, axis=-3), [("x", "float32", [3, 14])])
    assert_mentions(message, "f/Split", "axis in [-2, 2)")


def test_slice_errors():
    message = shape_error(lambda f, a: f.slice(a, [0, 5], [3, 3]), [("x", "float32", [3, 7])])
    assert_mentions(message, "f/Slice", "f/x: float32[3x7]", "[5:8]", "dimension 1 of size 7")
    message = shape_error(lambda f, a: f.slice(a, [0], [3]), [("x", "float32", [3, 7])])
    assert_mentions(message, "f/Slice", "one entry per dimension (2)")
    message = shape_error(lambda f, a: f.slice(a, [-1, 0], [1, 1]), [("x", "float32", [3, 7])])
    assert_mentions(message, "f/Slice", "dimension 0")
    message = shape_error(lambda f, a: f.slice(a, [0, 8], [3, -1]), [("x", "float32", [3, 7])])
    assert_mentions(message, "f/Slice", "[8:7]", "dimension 1 of size 7")


# ---- Gather / ScatterAdd / OneHot ---------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", ALL)
def test_gather_dtypes(dtype, index_dtype):
    params = random_array((11, 5), dtype, seed=31, low=1, high=9)
    indices = np.array([3, 0, 10, 3, 7, 7, 1], np_dtype(index_dtype))
    out = run1(lambda f, p, i: f.gather(p, i), params, indices)
    check(out, np.stack([params[int(i)] for i in indices]), dtype, rtol=0, atol=0)


@pytest.mark.parametrize("pshape,ishape", [((11,), (7,)), ((11, 5), ()), ((11, 5), (2, 3)), ((13, 2, 3), (4,)), ((1, 33), (5,))])
def test_gather_shapes(pshape, ishape):
    params = random_array(pshape, "float32", seed=32)
    indices = np.random.default_rng(33).integers(0, pshape[0], ishape).astype(np.int32)
    out = run1(lambda f, p, i: f.gather(p, i), params, indices)
    expected = np.array([params[int(i)] for i in indices.reshape(-1)], np.float32).reshape(*ishape, *pshape[1:])
    check(out, expected, "float32", rtol=0, atol=0)


def test_gather_from_a_constant_embedding():
    table = random_array((17, 4), "float32", seed=34)
    ids = np.array([[16, 0], [5, 5]], np.int32)
    out = run1(lambda f, i: f.gather(f.parameter("emb", table), i), ids)
    check(out, np.array([[table[16], table[0]], [table[5], table[5]]]), "float32", rtol=0, atol=0)


def test_gather_and_scatter_with_python_numbers():
    table = random_array((5, 3), "float32", seed=39)
    outs = run_flow(lambda f, p: (f.gather(p, 3), f.scatter_add(2, 1.5, rows=4)), [table])
    check(outs[0], table[3], "float32", rtol=0, atol=0)
    check(outs[1], [0, 0, 1.5, 0], "float32", rtol=0, atol=0)


@pytest.mark.parametrize("bad", [11, -1, 1000])
def test_gather_out_of_range_fails_at_compute(bad):
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    p = f.var("p", "float32", [11, 5])
    i = f.var("i", "int32", [3])
    f.gather(p, i)
    data = ranvier.Compiler().compile(flow).cell("f").instance()
    data[p][...] = random_array((11, 5), "float32", seed=35)
    data[i][...] = [1, bad, 2]
    with pytest.raises(ranvier.RanvierError) as info:
        data.compute()
    assert_mentions(str(info.value), "Gather", "f/Gather", str(bad), "[0, 11)")


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", NUMERIC)
def test_scatter_add_dtypes(dtype, index_dtype):
    rows = 6
    indices = np.array([4, 0, 4, 4, 2, 0, 5, 4, 1], np_dtype(index_dtype))  # repeats accumulate
    updates = random_array((9, 3), dtype, seed=36, low=1, high=5)
    out = run1(lambda f, i, u: f.scatter_add(i, u, rows=rows), indices, updates)
    acc = np.zeros((rows, 3), np.int64 if dtype in INTS else np.float64)
    for k, r in enumerate(indices):
        acc[int(r)] += updates[k].astype(acc.dtype)
    check(out, acc, dtype)
    if dtype == "float32":
        assert not out[3].any()  # untouched rows are zero


@pytest.mark.parametrize("ishape,ushape", [((), (5,)), ((7,), (7,)), ((2, 3), (2, 3, 4)), ((4,), (4, 2, 3))])
def test_scatter_add_shapes(ishape, ushape):
    rows = 5
    indices = np.random.default_rng(37).integers(0, rows, ishape).astype(np.int32)
    updates = random_array(ushape, "float64", seed=38)
    out = run1(lambda f, i, u: f.scatter_add(i, u, rows=rows), indices, updates)
    tail = ushape[len(ishape):]
    acc = np.zeros((rows, *tail))
    flat_updates = updates.reshape(-1, *tail)
    for k, r in enumerate(indices.reshape(-1)):
        acc[int(r)] += flat_updates[k]
    check(out, acc, "float64")


def test_scatter_add_out_of_range_fails_at_compute():
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    i = f.var("i", "int32", [2])
    u = f.var("u", "float32", [2, 3])
    f.scatter_add(i, u, rows=4)
    data = ranvier.Compiler().compile(flow).cell("f").instance()
    data[i][...] = [0, 4]
    data[u][...] = 1
    with pytest.raises(ranvier.RanvierError) as info:
        data.compute()
    assert_mentions(str(info.value), "f/ScatterAdd", "4", "[0, 4)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "uint8", "bool"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_one_hot(dtype, index_dtype):
    depth = 7
    indices = np.array([[0, 6, 3], [3, -1, 7]], np_dtype(index_dtype))  # -1 and 7 are out of range: zero rows
    out = run1(lambda f, i: f.one_hot(i, depth, dtype=dtype), indices)
    expected = np.zeros((2, 3, depth))
    for (a, b), v in np.ndenumerate(indices):
        if 0 <= v < depth:
            expected[a, b, v] = 1
    check(out, expected, dtype, rtol=0, atol=0)


def test_one_hot_default_dtype_and_scalar_index():
    out = run1(lambda f, i: f.one_hot(i, 5), np.array(2, np.int32))
    check(out, [0, 0, 1, 0, 0], "float32", rtol=0, atol=0)


def test_index_errors():
    message = shape_error(lambda f, p, i: f.gather(p, i), [("p", "float32", [5, 3]), ("i", "float32", [4])])
    assert_mentions(message, "f/Gather", "f/p: float32[5x3]", "f/i: float32[4]", "int32/int64 indices")
    message = shape_error(lambda f, p, i: f.gather(p, i), [("p", "float32", []), ("i", "int32", [4])])
    assert_mentions(message, "f/Gather", "rank >= 1")
    message = shape_error(lambda f, i, u: f.scatter_add(i, u, rows=5), [("i", "int32", [4]), ("u", "float32", [3, 2])])
    assert_mentions(message, "f/ScatterAdd", "f/i: int32[4]", "f/u: float32[3x2]", "[4]")
    message = shape_error(lambda f, i, u: f.scatter_add(i, u, rows=5), [("i", "float32", [3]), ("u", "float32", [3, 2])])
    assert_mentions(message, "f/ScatterAdd", "int32/int64 indices")
    message = shape_error(lambda f, i, u: f.scatter_add(i, u, rows=5), [("i", "int32", [3]), ("u", "bool", [3, 2])])
    assert_mentions(message, "f/ScatterAdd", "f/u: bool[3x2]", "numeric")
    message = shape_error(lambda f, i: f.one_hot(i, 0), [("i", "int32", [3])])
    assert_mentions(message, "f/OneHot", "f/i: int32[3]", "positive attribute depth")
    message = shape_error(lambda f, i: f.one_hot(i, 4), [("i", "float32", [3])])
    assert_mentions(message, "f/OneHot", "int32/int64 indices")


# ---- zero-size tensors -------------------------------------------------------------------------------


def test_zero_size_tensors():
    a = random_array((0, 5), "float32", seed=40)
    m = random_array((3, 0), "float32", seed=41)
    w = random_array((0, 4), "float32", seed=42)
    x = random_array((3, 5), "float32", seed=43)
    outs = run_flow(
        lambda f, ea, em, ew, ex: (
            ea.exp(),
            ea + f.const(np.ones(5, np.float32)),
            em @ ew,
            f.concat([ea, ex], axis=0),
            f.gather(ex, f.const(np.zeros(0, np.int32))),
            ea.sum(axis=0),
        ),
        [a, m, w, x],
    )
    check(outs[0], np.zeros((0, 5)), "float32")
    check(outs[1], np.zeros((0, 5)), "float32")
    check(outs[2], np.zeros((3, 4)), "float32")  # an empty inner dimension sums to zero
    check(outs[3], x, "float32")
    check(outs[4], np.zeros((0, 5)), "float32")
    check(outs[5], np.zeros(5), "float32")
