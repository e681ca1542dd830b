"""Neural-network composites: Softmax LogSoftmax LayerNorm RMSNorm SoftmaxCrossEntropy Conv2D
MaxPool AvgPool, checked against formulas and naive loops written here; plus the check that
every registered op has a test."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
from helpers import FLOATS, as_f64, assert_mentions, check, random_array, run1, run_flow, shape_error

import ranvier
from ranvier.ops import nn_grad
from ranvier.ops.nn import loss_dtype

pytestmark = pytest.mark.filterwarnings("error")

TESTED_OPS = {"Softmax", "LogSoftmax", "LayerNorm", "RMSNorm", "SoftmaxCrossEntropy", "Conv2D", "MaxPool", "AvgPool"}


def _declared_tested_ops() -> set[str]:
    """The union of every `TESTED_OPS = {...}` / `TESTED_OPS |= {...}` in tests/test_*.py.

    A test module that covers ops declares them this way; the files are parsed, not
    imported, so this check stays cheap and independent of which tests were selected."""
    declared: set[str] = set()
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                targets = [node.target]
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == "TESTED_OPS" for t in targets):
                declared |= set(ast.literal_eval(node.value))
    return declared


def test_every_registered_op_has_a_test():
    tested = _declared_tested_ops()
    assert tested >= TESTED_OPS
    # ranvier's own ops: test modules may register ops of their own (test_vjp does).
    registered = {t for t, d in ranvier.ops.all_ops().items() if d.infer.__module__.startswith("ranvier.")}
    assert {"Add", "MatMul", "Softmax"} <= registered
    missing = sorted(registered - tested)
    assert not missing, (
        f"registered ops without a test: {missing}; test them and list them in a "
        f"TESTED_OPS = {{...}} set in their test module"
    )
    stale = sorted(tested - registered)
    assert not stale, f"TESTED_OPS lists ops that are not registered: {stale}"


# ---- Softmax / LogSoftmax ----------------------------------------------------------------------------


def _softmax(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


SOFTMAX_CASES = [((7,), -1), ((3, 13), -1), ((3, 13), 0), ((2, 5, 7), 1), ((2, 5, 7), -3), ((2, 5, 7), 2), ((1, 33), 1)]


@pytest.mark.parametrize("shape,axis", SOFTMAX_CASES, ids=[f"{'x'.join(map(str, s))}-ax{a}" for s, a in SOFTMAX_CASES])
@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_and_log_softmax(dtype, shape, axis):
    x = random_array(shape, dtype, seed=1, low=-6, high=6)
    soft, logsoft = run_flow(lambda f, a: (f.softmax(a, axis=axis), f.log_softmax(a, axis=axis)), [x])
    check(soft, _softmax(as_f64(x), axis), dtype)
    check(logsoft, _log_softmax(as_f64(x), axis), dtype)


def test_softmax_is_stable_for_large_logits():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1001.0]], np.float32)
    soft, logsoft = run_flow(lambda f, a: (a.softmax(), a.log_softmax()), [x])
    check(soft, _softmax(as_f64(x), -1), "float32")
    check(logsoft, _log_softmax(as_f64(x), -1), "float32")


# ---- LayerNorm / RMSNorm -----------------------------------------------------------------------------


def _layer_norm(x, gamma=None, beta=None, eps=1e-5):
    n = x.shape[-1]
    mean = x.sum(axis=-1, keepdims=True) / n
    var = ((x - mean) ** 2).sum(axis=-1, keepdims=True) / n
    y = (x - mean) / np.sqrt(var + eps)
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def _rms_norm(x, gamma=None, eps=1e-5):
    y = x / np.sqrt((x**2).sum(axis=-1, keepdims=True) / x.shape[-1] + eps)
    return y if gamma is None else y * gamma


@pytest.mark.parametrize("affine", ["none", "gamma", "gamma+beta"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_layer_norm(dtype, affine):
    x = random_array((3, 13), dtype, seed=2, low=-4, high=5)
    g = random_array((13,), dtype, seed=3, low=0.5, high=2)
    b = random_array((13,), dtype, seed=4)
    if affine == "none":
        out = run1(lambda f, a: f.layer_norm(a), x)
        expected = _layer_norm(as_f64(x))
    elif affine == "gamma":
        out = run1(lambda f, a, gg: f.layer_norm(a, gg), x, g)
        expected = _layer_norm(as_f64(x), as_f64(g))
    else:
        out = run1(lambda f, a, gg, bb: f.layer_norm(a, gg, bb), x, g, b)
        expected = _layer_norm(as_f64(x), as_f64(g), as_f64(b))
    check(out, expected, dtype)


def test_layer_norm_eps_and_rank3():
    x = random_array((2, 3, 7), "float64", seed=5, low=-0.01, high=0.01)  # small variance: eps matters
    g = random_array((7,), "float64", seed=6)
    outs = run_flow(lambda f, a, gg: (f.layer_norm(a, gg, eps=1e-3), f.layer_norm(a, gg)), [x, g])
    check(outs[0], _layer_norm(x, g, eps=1e-3), "float64")
    check(outs[1], _layer_norm(x, g), "float64")
    assert not np.allclose(outs[0], outs[1], rtol=1e-3)


@pytest.mark.parametrize("with_gamma", [False, True], ids=["plain", "gamma"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm(dtype, with_gamma):
    x = random_array((5, 33), dtype, seed=7, low=-3, high=3)
    g = random_array((33,), dtype, seed=8, low=0.5, high=2)
    if with_gamma:
        out = run1(lambda f, a, gg: a.rms_norm(gg), x, g)
        expected = _rms_norm(as_f64(x), as_f64(g))
    else:
        out = run1(lambda f, a: a.rms_norm(), x)
        expected = _rms_norm(as_f64(x))
    check(out, expected, dtype)


def test_rms_norm_eps():
    x = random_array((2, 7), "float64", seed=9, low=-0.01, high=0.01)
    out = run1(lambda f, a: f.rms_norm(a, eps=1e-2), x)
    check(out, _rms_norm(x, eps=1e-2), "float64")


# ---- SoftmaxCrossEntropy -------------------------------------------------------------------------------


def _cross_entropy(logits, probs, smoothing=0.0):
    classes = logits.shape[-1]
    probs = probs * (1 - smoothing) + smoothing / classes
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    return -(probs * (logits - lse)).sum(axis=-1)


def _one_hot(targets, classes):
    out = np.zeros((*targets.shape, classes))
    for idx, t in np.ndenumerate(targets):
        out[(*idx, int(t))] = 1.0
    return out


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("target_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_cross_entropy_integer_targets(dtype, target_dtype, smoothing):
    logits = random_array((7, 13), dtype, seed=10, low=-4, high=4)
    targets = np.random.default_rng(11).integers(0, 13, (7,)).astype(target_dtype)
    out = run1(lambda f, l, t: f.softmax_cross_entropy(l, t, label_smoothing=smoothing), logits, targets)
    # half-precision logits give float32 losses, to float32's tolerance
    check(out, _cross_entropy(as_f64(logits), _one_hot(targets, 13), smoothing), loss_dtype(dtype))


@pytest.mark.parametrize("smoothing", [0.0, 0.25])
@pytest.mark.parametrize("kind", ["one-hot", "probabilities"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_cross_entropy_probability_targets(dtype, kind, smoothing):
    logits = random_array((2, 3, 7), dtype, seed=12, low=-4, high=4)
    if kind == "one-hot":
        probs = _one_hot(np.random.default_rng(13).integers(0, 7, (2, 3)), 7)
    else:
        raw = np.random.default_rng(14).uniform(0.1, 1, (2, 3, 7))
        probs = raw / raw.sum(axis=-1, keepdims=True)
    target = probs.astype(logits.dtype)
    out = run1(lambda f, l, t: f.softmax_cross_entropy(l, t, label_smoothing=smoothing), logits, target)
    check(out, _cross_entropy(as_f64(logits), as_f64(target), smoothing), loss_dtype(dtype))


def test_cross_entropy_one_hot_matches_integer_targets():
    logits = random_array((5, 9), "float64", seed=15)
    targets = np.array([0, 8, 3, 3, 1], np.int32)
    a, b = run_flow(
        lambda f, l, t, p: (f.softmax_cross_entropy(l, t), f.softmax_cross_entropy(l, p)),
        [logits, targets, _one_hot(targets, 9)],
    )
    check(a, b, "float64")


@pytest.mark.parametrize("bad", [9, -1])
def test_cross_entropy_out_of_range_target_fails_at_compute(bad):
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    logits = f.var("logits", "float32", [3, 9])
    t = f.var("t", "int32", [3])
    f.softmax_cross_entropy(logits, t)
    data = ranvier.Compiler().compile(flow).cell("f").instance()
    data[logits][...] = random_array((3, 9), "float32", seed=16)
    data[t][...] = [0, bad, 2]
    with pytest.raises(ranvier.RanvierError) as info:
        data.compute()
    assert_mentions(str(info.value), "f/SoftmaxCrossEntropy", str(bad), "[0, 9)")


# ---- Conv2D and pooling -----------------------------------------------------------------------------


def _pad(x, ph, pw, fill):
    n, c, h, w = x.shape
    out = np.full((n, c, h + 2 * ph, w + 2 * pw), fill, dtype=np.float64)
    out[:, :, ph : ph + h, pw : pw + w] = x
    return out


def naive_conv2d(x, w, strides, padding):
    (sh, sw), (ph, pw) = strides, padding
    xp = _pad(x, ph, pw, 0.0)
    n, c, hp, wp = xp.shape
    o, _, kh, kw = w.shape
    ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    out = np.zeros((n, o, ho, wo))
    for b, oc, i, j in itertools.product(range(n), range(o), range(ho), range(wo)):
        total = 0.0
        for ic, di, dj in itertools.product(range(c), range(kh), range(kw)):
            total += xp[b, ic, i * sh + di, j * sw + dj] * w[oc, ic, di, dj]
        out[b, oc, i, j] = total
    return out


def naive_pool(x, kernel, strides, padding, kind):
    (kh, kw), (sh, sw), (ph, pw) = kernel, strides, padding
    xp = _pad(x, ph, pw, -np.inf if kind == "max" else 0.0)
    n, c, hp, wp = xp.shape
    ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    out = np.zeros((n, c, ho, wo))
    for b, ch, i, j in itertools.product(range(n), range(c), range(ho), range(wo)):
        window = [xp[b, ch, i * sh + di, j * sw + dj] for di in range(kh) for dj in range(kw)]
        # Average pooling counts the padding (PyTorch's count_include_pad=True).
        out[b, ch, i, j] = max(window) if kind == "max" else sum(window) / (kh * kw)
    return out


CONV_CASES = [
    # x shape, w shape, strides, padding
    ((2, 3, 7, 9), (4, 3, 3, 3), (1, 1), (0, 0)),
    ((2, 3, 7, 9), (4, 3, 3, 3), (2, 2), (1, 1)),
    ((1, 2, 8, 5), (3, 2, 2, 3), (2, 1), (1, 2)),
    ((1, 1, 5, 5), (1, 1, 5, 5), (1, 1), (0, 0)),
    ((3, 5, 6, 7), (2, 5, 1, 1), (1, 2), (0, 0)),
    ((1, 3, 4, 4), (2, 3, 3, 3), (3, 3), (2, 2)),
]


@pytest.mark.parametrize("xs,ws,strides,padding", CONV_CASES, ids=[f"case{i}" for i in range(len(CONV_CASES))])
def test_conv2d(xs, ws, strides, padding):
    x = random_array(xs, "float32", seed=17)
    w = random_array(ws, "float32", seed=18, low=-1, high=1)
    out = run1(lambda f, a, b: f.conv2d(a, b, strides=strides, padding=padding), x, w)
    check(out, naive_conv2d(as_f64(x), as_f64(w), strides, padding), "float32")


@pytest.mark.parametrize("dtype", FLOATS)
def test_conv2d_dtypes_and_scalar_attributes(dtype):
    x = random_array((1, 2, 7, 7), dtype, seed=19)
    w = random_array((3, 2, 3, 3), dtype, seed=20, low=-1, high=1)
    out = run1(lambda f, a, b: f.conv2d(a, b, strides=2, padding=1), x, w)
    check(out, naive_conv2d(as_f64(x), as_f64(w), (2, 2), (1, 1)), dtype)


def test_conv2d_with_constant_weights():
    x = random_array((1, 3, 5, 5), "float64", seed=21)
    w = random_array((2, 3, 3, 3), "float64", seed=22)
    out = run1(lambda f, a: f.conv2d(a, f.parameter("w", w), padding=1), x)
    check(out, naive_conv2d(x, w, (1, 1), (1, 1)), "float64")


POOL_CASES = [
    # ksize, strides (None: the window), padding
    ((2, 2), None, (0, 0)),
    ((3, 3), None, (1, 1)),
    ((3, 3), (1, 1), (0, 0)),
    ((3, 2), (2, 1), (1, 1)),
    ((2, 3), (1, 2), (0, 1)),
    ((1, 1), (2, 2), (0, 0)),
]


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("ksize,strides,padding", POOL_CASES, ids=[f"case{i}" for i in range(len(POOL_CASES))])
def test_pool(kind, ksize, strides, padding):
    x = random_array((2, 3, 7, 9), "float32", seed=23)
    method = "max_pool" if kind == "max" else "avg_pool"
    out = run1(lambda f, a: getattr(f, method)(a, ksize=ksize, strides=strides, padding=padding), x)
    check(out, naive_pool(as_f64(x), ksize, strides or ksize, padding, kind), "float32")


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_pool_dtypes(kind, dtype):
    x = random_array((1, 2, 5, 6), dtype, seed=24)
    method = "max_pool" if kind == "max" else "avg_pool"
    out = run1(lambda f, a: getattr(f, method)(a, ksize=3, strides=2, padding=1), x)
    check(out, naive_pool(as_f64(x), (3, 3), (2, 2), (1, 1), kind), dtype)


def test_max_pool_of_negative_values_ignores_padding():
    x = -random_array((1, 1, 4, 4), "float32", seed=25, low=1, high=5)
    out = run1(lambda f, a: f.max_pool(a, ksize=2, strides=2, padding=1), x)
    assert (out < 0).all()
    check(out, naive_pool(as_f64(x), (2, 2), (2, 2), (1, 1), "max"), "float32")


@pytest.mark.parametrize("mask", ["", "-avx512", "-avx512,-avx2"])
@pytest.mark.parametrize("ksize,strides,padding", [((3, 3), (2, 2), (1, 1)), ((2, 2), (1, 1), (0, 0)), ((3, 2), (3, 1), (1, 1)),
                                                   ((1, 1), (2, 2), (0, 0)), ((2, 2), (2, 2), (0, 0))])
@pytest.mark.parametrize("width", [75, 14, 9])
def test_max_pool_kernel_reads_windows_in_place_on_every_variant(mask, ksize, strides, padding, width):
    """MaxPool runs whole (`WindowMax`): rows wide enough for vectors of whole windows, and
    rows of fewer outputs than a vector's lanes (narrower vectors: a CNN's 14 × 14 pooled to
    7 × 7), strided and not, borders clipped; a NaN anywhere in a window is its maximum."""
    from ranvier.ops.nn import max_pool

    x = random_array((2, 3, 13, width), "float32", seed=26)
    x[0, 1, 4, width // 2] = x[1, 2, 0, 0] = x[1, 0, 12, width - 1] = np.nan
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    y = f.max_pool(f.var("x", "float32", list(x.shape)), ksize=ksize, strides=strides, padding=padding)
    y.var.out = True
    cell = ranvier.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f")
    assert [s.kernel for s in cell.steps] == ["WindowMax"]
    data = cell.instance()
    data["f/x"] = x
    data[y] = np.full(y.shape, -1234.0, np.float32)
    data.compute()
    want = max_pool(x.astype(np.float64), ksize, strides, padding)
    np.testing.assert_array_equal(np.array(data[y]), want.astype(np.float32))


# ---- errors ---------------------------------------------------------------------------------------------


def test_softmax_errors():
    message = shape_error(lambda f, a: f.softmax(a), [("x", "int32", [3, 4])])
    assert_mentions(message, "f/Softmax", "f/x: int32[3x4]", "floating-point")
    message = shape_error(lambda f, a: f.log_softmax(a, axis=2), [("x", "float32", [3, 4])])
    assert_mentions(message, "f/LogSoftmax", "f/x: float32[3x4]", "axis in [-2, 2)", "got 2")
    message = shape_error(lambda f, a: f.softmax(a), [("x", "float32", [])])
    assert_mentions(message, "f/Softmax", "rank >= 1")


def test_norm_errors():
    message = shape_error(lambda f, a, g: f.layer_norm(a, g), [("x", "float32", [3, 4]), ("g", "float32", [3])])
    assert_mentions(message, "f/LayerNorm", "f/x: float32[3x4]", "f/g: float32[3]", "shape [4]")
    message = shape_error(lambda f, a, g: f.rms_norm(a, g), [("x", "float32", [3, 4]), ("g", "float16", [4])])
    assert_mentions(message, "f/RMSNorm", "f/g: float16[4]", "one dtype")
    message = shape_error(lambda f, a: f.layer_norm(a), [("x", "int32", [3, 4])])
    assert_mentions(message, "f/LayerNorm", "floating-point")
    message = shape_error(lambda f, a: f.rms_norm(a, eps=-0.1), [("x", "float32", [3, 4])])
    assert_mentions(message, "f/RMSNorm", "eps >= 0", "-0.1")
    with pytest.raises(ranvier.RanvierError, match="beta"):
        flow = ranvier.Flow()
        f = ranvier.Builder(flow, "f")
        f.layer_norm(f.var("x", "float32", [3, 4]), beta=f.var("b", "float32", [4]))


def test_cross_entropy_errors():
    message = shape_error(lambda f, l, t: f.softmax_cross_entropy(l, t), [("l", "float32", [3, 5]), ("t", "int32", [4])])
    assert_mentions(message, "f/SoftmaxCrossEntropy", "f/l: float32[3x5]", "f/t: int32[4]", "[3]")
    message = shape_error(lambda f, l, t: f.softmax_cross_entropy(l, t), [("l", "float32", [3, 5]), ("t", "float32", [3, 4])])
    assert_mentions(message, "f/SoftmaxCrossEntropy", "f/t: float32[3x4]", "[3, 5]")
    message = shape_error(lambda f, l, t: f.softmax_cross_entropy(l, t), [("l", "float32", [3, 5]), ("t", "float64", [3, 5])])
    assert_mentions(message, "f/SoftmaxCrossEntropy", "f/t: float64[3x5]", "logits' dtype")
    message = shape_error(lambda f, l, t: f.softmax_cross_entropy(l, t, label_smoothing=1.5), [("l", "float32", [3, 5]), ("t", "int32", [3])])
    assert_mentions(message, "f/SoftmaxCrossEntropy", "label_smoothing", "1.5")
    message = shape_error(lambda f, l, t: f.softmax_cross_entropy(l, t), [("l", "int32", [3, 5]), ("t", "int32", [3])])
    assert_mentions(message, "f/SoftmaxCrossEntropy", "floating-point logits")


def test_conv2d_errors():
    message = shape_error(lambda f, a, w: f.conv2d(a, w), [("x", "float32", [1, 3, 8, 8]), ("w", "float32", [4, 2, 3, 3])])
    assert_mentions(message, "f/Conv2D", "f/x: float32[1x3x8x8]", "f/w: float32[4x2x3x3]", "matching C")
    message = shape_error(lambda f, a, w: f.conv2d(a, w), [("x", "float32", [3, 8, 8]), ("w", "float32", [4, 3, 3, 3])])
    assert_mentions(message, "f/Conv2D", "f/x: float32[3x8x8]", "[N, C, H, W]")
    message = shape_error(lambda f, a, w: f.conv2d(a, w), [("x", "float32", [1, 3, 2, 8]), ("w", "float32", [4, 3, 3, 3])])
    assert_mentions(message, "f/Conv2D", "window of 3")
    message = shape_error(lambda f, a, w: f.conv2d(a, w, strides=0), [("x", "float32", [1, 3, 8, 8]), ("w", "float32", [4, 3, 3, 3])])
    assert_mentions(message, "f/Conv2D", "strides (>= 1)")
    message = shape_error(lambda f, a, w: f.conv2d(a, w), [("x", "float32", [1, 3, 8, 8]), ("w", "int32", [4, 3, 3, 3])])
    assert_mentions(message, "f/Conv2D", "one dtype")


def test_pool_errors():
    message = shape_error(lambda f, a: f.max_pool(a, ksize=5), [("x", "float32", [1, 2, 4, 4])])
    assert_mentions(message, "f/MaxPool", "f/x: float32[1x2x4x4]", "window of 5")
    message = shape_error(lambda f, a: f.avg_pool(a, ksize=2, padding=2), [("x", "float32", [1, 2, 4, 4])])
    assert_mentions(message, "f/AvgPool", "padding at most half")
    message = shape_error(lambda f, a: f.max_pool(a), [("x", "float32", [2, 4, 4])])
    assert_mentions(message, "f/MaxPool", "f/x: float32[2x4x4]", "[N, C, H, W]")
    message = shape_error(lambda f, a: f.avg_pool(a), [("x", "int32", [1, 2, 4, 4])])
    assert_mentions(message, "f/AvgPool", "floating-point")


# ---- backward ops of the windowed ops (used by autodiff) -------------------------------------------------

TESTED_OPS |= {"Conv2DBackpropInput", "Conv2DBackpropFilter", "MaxPoolGrad", "AvgPoolGrad"}


def naive_conv2d_grads(x, w, dy, strides, padding):
    """dx and dw of y = conv2d(x, w) for an output gradient dy, by looping over every product."""
    (sh, sw), (ph, pw) = strides, padding
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    dx, dw = np.zeros(x.shape), np.zeros(w.shape)
    for b, oc, i, j in itertools.product(range(n), range(o), range(dy.shape[2]), range(dy.shape[3])):
        g = dy[b, oc, i, j]
        for ic, di, dj in itertools.product(range(c), range(kh), range(kw)):
            r, s = i * sh + di - ph, j * sw + dj - pw
            if 0 <= r < h and 0 <= s < wd:
                dx[b, ic, r, s] += g * w[oc, ic, di, dj]
                dw[oc, ic, di, dj] += g * x[b, ic, r, s]
    return dx, dw


def naive_pool_grad(x, dy, kernel, strides, padding, kind):
    (kh, kw), (sh, sw), (ph, pw) = kernel, strides, padding
    n, c, h, w = x.shape
    dx = np.zeros(x.shape)
    for b, ch, i, j in itertools.product(range(n), range(c), range(dy.shape[2]), range(dy.shape[3])):
        cells = [(i * sh + di - ph, j * sw + dj - pw) for di in range(kh) for dj in range(kw)]
        if kind == "avg":
            for r, s in cells:
                if 0 <= r < h and 0 <= s < w:
                    dx[b, ch, r, s] += dy[b, ch, i, j] / (kh * kw)
        else:
            inside = [(r, s) for r, s in cells if 0 <= r < h and 0 <= s < w]
            best = inside[0]
            for r, s in inside:  # the first maximum in row-major window order takes the gradient
                if x[b, ch, r, s] > x[b, ch][best]:
                    best = (r, s)
            dx[b, ch][best] += dy[b, ch, i, j]
    return dx


GRAD_CONV_CASES = [CONV_CASES[0], CONV_CASES[1], CONV_CASES[2], CONV_CASES[5], ((1, 2, 9, 8), (3, 2, 3, 2), (2, 3), (0, 1))]


@pytest.mark.parametrize("xs,ws,strides,padding", GRAD_CONV_CASES, ids=[f"case{i}" for i in range(len(GRAD_CONV_CASES))])
def test_conv2d_backprop(xs, ws, strides, padding):
    x = random_array(xs, "float64", seed=26)
    w = random_array(ws, "float64", seed=27)
    ho = (xs[2] + 2 * padding[0] - ws[2]) // strides[0] + 1
    wo = (xs[3] + 2 * padding[1] - ws[3]) // strides[1] + 1
    dy = random_array((xs[0], ws[0], ho, wo), "float64", seed=28)
    attrs = {"strides": list(strides), "padding": list(padding)}
    dx, dw = run_flow(
        lambda f, a, b, g: (
            f.op("Conv2DBackpropInput", [g, b], attrs={**attrs, "input_shape": list(xs)}),
            f.op("Conv2DBackpropFilter", [a, g], attrs={**attrs, "filter_shape": list(ws)}),
        ),
        [x, w, dy],
    )
    edx, edw = naive_conv2d_grads(x, w, dy, strides, padding)
    check(dx, edx, "float64")
    check(dw, edw, "float64")


@pytest.mark.parametrize("dtype,kernel", [("float32", "ConvTiles"), ("float64", None)])
def test_a_stride_one_input_gradient_is_a_convolution(dtype, kernel):
    """dx of a stride-1 convolution is dy convolved with the turned filters: on the CPU in
    float32 one convolution kernel (tiles, for its 3 filters), no windows scattered back; in float64 that convolution is
    itself decomposed (into im2col and a GEMM), never left to Python. Stride 2 keeps the
    scatter."""
    x_shape, w = [2, 3, 9, 7], random_array((4, 3, 3, 2), dtype, seed=32)
    for strides, padding in (([1, 1], [1, 0]), ([1, 1], [2, 1]), ([2, 2], [1, 1])):
        ho = (x_shape[2] + 2 * padding[0] - 3) // strides[0] + 1
        wo = (x_shape[3] + 2 * padding[1] - 2) // strides[1] + 1
        dy = random_array((2, 4, ho, wo), dtype, seed=33)
        attrs = {"strides": strides, "padding": padding, "input_shape": x_shape}
        result = run_flow(lambda f, b, g, attrs=attrs: f.op("Conv2DBackpropInput", [g, b], attrs=attrs), [w, dy])
        check(result[0], naive_conv2d_grads(np.zeros(x_shape), as_f64(w), as_f64(dy), strides, padding)[0], dtype)
        steps = ranvier.Compiler("cpu", cache=False).compile(result.flow).cell("f").steps
        assert all(s.variant != "python" for s in steps)
        kernels = {s.kernel for s in steps}
        if strides == [2, 2]:
            assert "StridedScatterAdd" in kernels
        else:
            assert "StridedScatterAdd" not in kernels and (kernel is None or kernel in kernels)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ws,strides,padding,planes", [
    ((4, 3, 3, 3), (2, 2), (1, 1), True),  # 17 × 17 outputs an image: each image's taps by one product, added plane by plane
    ((4, 3, 3, 2), (2, 3), (0, 1), True),  # rectangular filters and strides, padding on one axis
    ((4, 3, 1, 1), (2, 2), (0, 0), False),  # a 1 × 1 downsampling: no windows overlap, the rows' form
])
def test_a_strided_input_gradient_over_wide_images(ws, strides, padding, planes, dtype):
    """dx of a strided convolution whose images have many outputs: the filters times each
    image's dy give its taps' gradients channel by channel, scattered onto each plane
    (a product per image, no transpose of dy); narrow images and 1 × 1 filters keep the
    product of dy's rows."""
    x_shape = [2, 3, 33, 52]
    ho = (x_shape[2] + 2 * padding[0] - ws[2]) // strides[0] + 1
    wo = (x_shape[3] + 2 * padding[1] - ws[3]) // strides[1] + 1
    assert ho * wo >= nn_grad.PLANE_PRODUCT_COLUMNS
    w, dy = random_array(ws, dtype, seed=34), random_array((2, ws[0], ho, wo), dtype, seed=35)
    attrs = {"strides": list(strides), "padding": list(padding), "input_shape": x_shape}
    result = run_flow(lambda f, b, g: f.op("Conv2DBackpropInput", [g, b], attrs=attrs), [w, dy])
    check(result[0], naive_conv2d_grads(np.zeros(x_shape), as_f64(w), as_f64(dy), strides, padding)[0], dtype)
    steps = ranvier.Compiler("cpu", cache=False).compile(result.flow).cell("f").steps
    products = [s.op for s in steps if s.op.type == "MatMul"]
    assert len(products) == 1 and (products[0].inputs[1].rank == 3) == planes  # dy [N, O, Ho·Wo] read as it lies
    assert "StridedScatterAdd" in {s.kernel for s in steps}


@pytest.mark.parametrize("dtype", FLOATS)
def test_conv2d_backprop_dtypes(dtype):
    x = random_array((1, 2, 6, 5), dtype, seed=29)
    w = random_array((3, 2, 3, 3), dtype, seed=30)
    dy = random_array((1, 3, 3, 3), dtype, seed=31)
    attrs = {"strides": [2, 2], "padding": [1, 1]}
    dx, dw = run_flow(
        lambda f, a, b, g: (
            f.op("Conv2DBackpropInput", [g, b], attrs={**attrs, "input_shape": [1, 2, 6, 5]}),
            f.op("Conv2DBackpropFilter", [a, g], attrs={**attrs, "filter_shape": [3, 2, 3, 3]}),
        ),
        [x, w, dy],
    )
    edx, edw = naive_conv2d_grads(as_f64(x), as_f64(w), as_f64(dy), (2, 2), (1, 1))
    # Sums of products of rounded values: compare relative to the gradient's scale.
    scale = {"float16": 5e-3, "bfloat16": 3e-2}.get(dtype)
    check(dx, edx, dtype, atol=None if scale is None else scale * np.abs(edx).max())
    check(dw, edw, dtype, atol=None if scale is None else scale * np.abs(edw).max())


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("ksize,strides,padding", POOL_CASES, ids=[f"case{i}" for i in range(len(POOL_CASES))])
def test_pool_grad(kind, ksize, strides, padding):
    g = np.random.default_rng(32)
    x = g.integers(-3, 4, (2, 3, 7, 9)).astype(np.float64)  # ties: the first maximum wins
    real_strides = strides or ksize
    ho = (7 + 2 * padding[0] - ksize[0]) // real_strides[0] + 1
    wo = (9 + 2 * padding[1] - ksize[1]) // real_strides[1] + 1
    dy = random_array((2, 3, ho, wo), "float64", seed=33)
    attrs = {"ksize": list(ksize), "padding": list(padding)}
    if strides is not None:
        attrs["strides"] = list(strides)
    if kind == "max":
        out = run1(lambda f, a, d: f.op("MaxPoolGrad", [a, d], attrs=attrs), x, dy)
    else:
        out = run1(lambda f, d: f.op("AvgPoolGrad", [d], attrs={**attrs, "input_shape": [2, 3, 7, 9]}), dy)
    check(out, naive_pool_grad(x, dy, ksize, real_strides, padding, kind), "float64")


@pytest.mark.parametrize("dtype", FLOATS)
def test_pool_grad_dtypes(dtype):
    x = random_array((1, 2, 5, 6), dtype, seed=34)
    dy = random_array((1, 2, 3, 3), dtype, seed=35)
    attrs = {"ksize": [3, 3], "strides": [2, 2], "padding": [1, 1]}
    dmax, davg = run_flow(
        lambda f, a, d: (f.op("MaxPoolGrad", [a, d], attrs=attrs), f.op("AvgPoolGrad", [d], attrs={**attrs, "input_shape": [1, 2, 5, 6]})),
        [x, dy],
    )
    check(dmax, naive_pool_grad(as_f64(x), as_f64(dy), (3, 3), (2, 2), (1, 1), "max"), dtype)
    check(davg, naive_pool_grad(as_f64(x), as_f64(dy), (3, 3), (2, 2), (1, 1), "avg"), dtype)


def test_backprop_op_errors():
    conv = {"strides": [1, 1], "padding": [0, 0]}
    message = shape_error(
        lambda f, g, w: f.op("Conv2DBackpropInput", [g, w], attrs={**conv, "input_shape": [1, 3, 8, 8]}),
        [("dy", "float32", [1, 4, 5, 6]), ("w", "float32", [4, 3, 3, 3])],
    )
    assert_mentions(message, "f/Conv2DBackpropInput", "f/dy: float32[1x4x5x6]", "f/w: float32[4x3x3x3]")
    message = shape_error(
        lambda f, g, w: f.op("Conv2DBackpropInput", [g, w], attrs={**conv, "input_shape": [2, 3, 8, 8]}),
        [("dy", "float32", [1, 4, 6, 6]), ("w", "float32", [4, 3, 3, 3])],
    )
    assert_mentions(message, "f/Conv2DBackpropInput", "f/dy: float32[1x4x6x6]")
    message = shape_error(
        lambda f, x, g: f.op("Conv2DBackpropFilter", [x, g], attrs={**conv, "filter_shape": [4, 3, 3, 3]}),
        [("x", "float32", [1, 3, 8, 8]), ("dy", "float32", [1, 4, 7, 6])],
    )
    assert_mentions(message, "f/Conv2DBackpropFilter", "f/x: float32[1x3x8x8]", "f/dy: float32[1x4x7x6]")
    message = shape_error(
        lambda f, x, g: f.op("Conv2DBackpropFilter", [x, g], attrs={**conv, "filter_shape": [4, 2, 3, 3]}),
        [("x", "float32", [1, 3, 8, 8]), ("dy", "float32", [1, 4, 6, 6])],
    )
    assert_mentions(message, "f/Conv2DBackpropFilter", "filter_shape")
    message = shape_error(
        lambda f, x, g: f.op("MaxPoolGrad", [x, g], attrs={"ksize": [2, 2]}),
        [("x", "float32", [1, 3, 8, 8]), ("dy", "float32", [1, 3, 4, 1])],
    )
    assert_mentions(message, "f/MaxPoolGrad", "f/x: float32[1x3x8x8]", "f/dy: float32[1x3x4x1]")
    message = shape_error(
        lambda f, g: f.op("AvgPoolGrad", [g], attrs={"ksize": [2, 2], "input_shape": [1, 3, 8, 8]}),
        [("dy", "float32", [1, 3, 3, 4])],
    )
    assert_mentions(message, "f/AvgPoolGrad", "f/dy: float32[1x3x3x4]")
    message = shape_error(
        lambda f, g: f.op("AvgPoolGrad", [g], attrs={"ksize": [2, 2], "input_shape": [1, 3, 8]}),
        [("dy", "float32", [1, 3, 4, 4])],
    )
    assert_mentions(message, "f/AvgPoolGrad", "input_shape")


# ---- Assign (state) ---------------------------------------------------------------------------------------

TESTED_OPS |= {"Assign"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_assign_overwrites_a_parameter_after_its_readers(dtype):
    flow = ranvier.Flow()
    f = ranvier.Builder(flow, "f")
    initial = random_array((3, 5), dtype, seed=36, low=1, high=9)
    new = random_array((3, 5), dtype, seed=37, low=1, high=9)
    p = f.parameter("p", initial)
    v = f.var("v", dtype, [3, 5])
    before = f.identity(p)  # reads p; Assign must run after it
    assert f.op("Assign", [p, v]) == ()
    before.var.out = True
    network = ranvier.Compiler().compile(flow)
    data = network.cell("f").instance()
    data[v][...] = new
    data.compute()
    check(data[before], initial, dtype, rtol=0, atol=0)
    check(network[p], new, dtype, rtol=0, atol=0)


def test_assign_errors():
    message = shape_error(lambda f, p, v: f.op("Assign", [p, v]), [("p", "float32", [3]), ("v", "float32", [4])])
    assert_mentions(message, "f/Assign", "f/p: float32[3]", "f/v: float32[4]", "float32[3]")
    message = shape_error(lambda f, p, v: f.op("Assign", [p, v]), [("p", "float32", [3]), ("v", "float64", [3])])
    assert_mentions(message, "f/Assign", "f/v: float64[3]")
