"""Conv2D as an implicit GEMM (kernels/conv.py): the generated GEMM packing a convolution's
windows straight from the image (`ranvier_sgemm_windows`) against float64 im2col products,
for each vector variant and every geometry class (strides, padding wider than the kernel's
reach, rectangular kernels, output rows shorter and longer than a vector, vectors over a
few output rows and over many, several slices of k and blocks of columns, a call starting
mid-row); its twin on bf16 pairs (`ranvier_sgemm_windows_dpbf16`, AVX512-BF16) against
float64 on the bf16-rounded operands; and the kernels in compiled cells against PyTorch's
float64 convolution, over batches shared out by image and single images cut into blocks,
in bf16 (ConvGemmDpbf16) where the CPU has the pairs and the choice is forced."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_within_bound, cell_against_pytorch, random_array

import ranvier as rv
from ranvier.backends.cpu import sgemm
from ranvier.backends.cpu.backend import CPUCode
from ranvier.backends.cpu.kernels import conv, winograd
from ranvier.backends.cpu.target import host_target

MASKS = ["", "-avx512", "-avx512,-avx2"]
needs_pairs = pytest.mark.skipif(not sgemm.pairs_supported(host_target()), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")

GEOMETRIES = [
    # channels, height, width, filters, (kernel), (strides), (padding)
    (3, 20, 20, 5, (3, 3), (1, 1), (1, 1)),  # rows of 20: vectors cross rows
    (4, 9, 7, 7, (3, 3), (2, 2), (1, 1)),  # stride 2, rows shorter than a vector
    (3, 30, 31, 8, (7, 7), (2, 2), (3, 3)),  # a ResNet stem
    (64, 14, 14, 20, (3, 3), (1, 1), (1, 1)),  # k = 576: several slices
    (5, 7, 7, 6, (1, 1), (2, 2), (0, 0)),  # a 1 × 1 downsampling
    (30, 8, 9, 13, (3, 2), (1, 1), (0, 1)),  # rectangular kernel, padding on one axis
    (2, 5, 6, 3, (3, 3), (3, 2), (2, 2)),  # padding as wide as the kernel reaches
    (2, 40, 48, 4, (3, 3), (1, 1), (1, 1)),  # rows a multiple of every vector width, n over several blocks
    (9, 7, 7, 5, (3, 3), (1, 1), (1, 1)),  # a 7 × 7 image: vectors over 2-4 output rows, a masked load each
    (6, 9, 4, 5, (3, 3), (1, 1), (1, 1)),  # rows of 4: vectors over more rows than that, one gather each
    (5, 28, 28, 6, (3, 3), (2, 2), (1, 1)),  # stride 2, rows of 14: vectors over 2-3 rows, two loads a row
    (7, 14, 14, 9, (1, 1), (2, 2), (0, 0)),  # stride 2, rows of 7 inside the image (a downsampling's)
    (5, 12, 6, 4, (3, 3), (2, 2), (1, 1)),  # stride 2, rows of 3: vectors over more rows, one gather each
]
PAIR_GEOMETRIES = [*GEOMETRIES,
                   (3, 9, 9, 4, (1, 1), (1, 1), (0, 0)),  # three taps: the last pair's second a zero
                   (113, 6, 6, 9, (3, 3), (1, 1), (1, 1)),  # 1,017 taps: two slices of k on pairs, the last pair odd
                   (7, 30, 30, 17, (5, 5), (1, 1), (2, 2))]  # 175 taps over 900 columns: blocks of columns


def _im2col(x: np.ndarray, kernel, strides, padding) -> tuple[np.ndarray, int]:
    """x [C, H, W] as B [C·KH·KW, Ho·Wo] in float64, and Wo."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, strides, padding
    c, h, w = x.shape
    padded = np.pad(x.astype(np.float64), ((0, 0), (ph, ph), (pw, pw)))
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    columns = np.empty((c, kh, kw, ho, wo))
    for i in range(kh):
        for j in range(kw):
            columns[:, i, j] = padded[:, i : i + sh * ho : sh, j : j + sw * wo : sw]
    return columns.reshape(c * kh * kw, ho * wo), wo


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"g{i}" for i in range(len(GEOMETRIES))])
def test_the_windows_gemm_matches_an_im2col_product_and_writes_only_c(geometry, mask):
    _check_windows_gemm(geometry, sgemm.windows_gemm_address(host_target(mask)), lambda values: values.astype(np.float64),
                        1e-6)


@needs_pairs
@pytest.mark.parametrize("paired", [False, True], ids=["float-filters", "paired-filters"])
@pytest.mark.parametrize("geometry", PAIR_GEOMETRIES, ids=[f"g{i}" for i in range(len(PAIR_GEOMETRIES))])
def test_the_windows_gemm_on_bf16_pairs_matches_float64_on_the_rounded_operands_and_writes_only_c(geometry, paired):
    """Filters and windows rounded to the nearest bf16, products exact, sums float32; the
    filters float32 (rounded as the GEMM goes) or rounded ahead of time (`sgemm.paired_rows`,
    read in place by `ranvier_sgemm_windows_dpbf16_paired`)."""
    _check_windows_gemm(geometry, sgemm.windows_gemm_address(host_target(), pairs=True, paired_a=paired),
                        lambda values: values.astype(ml_dtypes.bfloat16).astype(np.float64), 1e-5, paired)


def _check_windows_gemm(geometry, address: int, rounded, tolerance: float, paired: bool = False) -> None:
    """The GEMM at `address` on the image's windows, from several first columns, against
    the float64 product of the `rounded` operands, within `tolerance` of the sum of the
    products' magnitudes; every element of C written, nothing outside it. `paired`: the
    filters passed as `sgemm.paired_rows` makes them."""
    c, h, w, o, kernel, strides, padding = geometry
    gemm = sgemm.WINDOWS_CTYPE(address)
    rng = np.random.default_rng(sum(geometry[:4]))
    image = rng.standard_normal((c, h, w)).astype(np.float32)
    columns, wo = _im2col(rounded(image), kernel, strides, padding)
    k, n = columns.shape
    weights = rng.standard_normal((o, k + 3)).astype(np.float32)  # lda wider than a row
    want = rounded(weights[:, :k]) @ columns
    bound = np.abs(rounded(weights[:, :k])) @ np.abs(columns)
    geometry_array = np.array([h, w, *kernel, *strides, *padding, wo, 1], np.int64)
    paired_filters = sgemm.paired_rows(weights[:, :k])
    for first in sorted({0, 8, min(n - 1, 17)}):  # a part's columns start anywhere in a row
        out = np.full((o + 1, n + 5), np.nan, np.float32)
        workspace = np.empty(sgemm.workspace_bytes(n - first, k), np.uint8)
        filters, lda = (paired_filters, sgemm.paired_row_slots(k)) if paired else (weights, weights.shape[1])
        gemm(o, n - first, k, filters.ctypes.data, lda, image.ctypes.data, geometry_array.ctypes.data, first,
             out.ctypes.data, out.shape[1], workspace.ctypes.data)
        got = out[:o, : n - first]
        assert np.isfinite(got).all(), "every element of C written"
        assert_within_bound(got, want[:, first:], bound[:, first:], tolerance)
        frame = out.copy()
        frame[:o, : n - first] = 0
        assert np.isnan(frame[o:]).all() and np.isnan(frame[:, n - first :]).all(), "nothing outside C written"


@pytest.fixture(autouse=True)
def _no_winograd(monkeypatch):
    """The implicit GEMM on every geometry here, 3 × 3 filters of stride 1 included (which
    Winograd's kernel would otherwise take: tests/test_winograd.py), and few filters (which
    ConvTiles would: tests/test_conv_tiles.py)."""
    monkeypatch.setattr(winograd, "_MAX_PAIRS", 0)
    monkeypatch.setattr(conv, "FEW_FILTERS", 0)
    monkeypatch.setattr(conv, "PLANE_FILTERS", 0)


def _conv_cell(shape, filters, strides, padding, mask: str = "", matmul: str = "float32", constant: bool = False):
    """A cell convolving x by filters w: a variable, or (`constant`) _filters' values."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w = f.var("x", "float32", shape), f.const(_filters(filters)) if constant else f.var("w", "float32", filters)
    y = f.conv2d(x, w, strides=strides, padding=padding)
    y.var.out = True
    return rv.Compiler("cpu", cpu=mask, cache=False, matmul=matmul).compile(flow).cell("f"), y


CASES = [
    ((3, 4, 11, 13), (6, 4, 3, 3), (1, 1), (1, 1)),  # a batch: images shared out
    ((1, 16, 30, 30), (40, 16, 3, 3), (1, 1), (1, 1)),  # one image: its output cut into blocks
    ((2, 3, 23, 21), (8, 3, 7, 7), (2, 2), (3, 3)),
    ((1, 8, 9, 9), (5, 8, 1, 1), (2, 2), (0, 0)),
    ((1, 2, 8, 5), (3, 2, 2, 3), (2, 1), (1, 2)),
    ((2, 5, 12, 14), (7, 5, 1, 1), (2, 2), (0, 0)),  # 1 × 1 of stride 2: a plane of the pixels it reads, each image's
    ((1, 6, 13, 11), (10, 6, 1, 1), (2, 3), (0, 0)),  # of strides 2 and 3 (a column at a time), one image cut into blocks
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_conv2d_runs_as_one_implicit_gemm_and_matches_pytorch(case, mask):
    shape, filters, strides, padding = case
    cell, y = _conv_cell(shape, filters, strides, padding, mask)
    (step,) = cell.steps
    assert step.kernel == "ConvGemm" and step.variant != "python"
    _check_against_pytorch(cell, y, case, pairs=False, tol=2e-6)


def _filters(shape) -> np.ndarray:
    return random_array(shape, "float32", seed=2, low=-1, high=1)


def _check_against_pytorch(cell, y, case, pairs: bool, constant: bool = False, tol: float = 1e-5) -> None:
    """The cell's convolution of random x and w (`case`: shapes, strides, padding; w the
    cell's `constant` where it is one) against PyTorch's float64 one (of the bf16-rounded x
    and w where it ran on `pairs`), every element written (NaN first)."""
    shape, filters, strides, padding = case
    values = {"x": random_array(shape, "float32", seed=1), "w": _filters(filters)}
    cell_against_pytorch(cell, y, values, lambda x, w: torch.nn.functional.conv2d(x, w, stride=strides, padding=padding),
                         constants=["w"] if constant else [], bf16=["x", "w"] if pairs else [], tol=tol)


@pytest.mark.parametrize("constant", [False, True], ids=["variable", "constant"])
@pytest.mark.parametrize("mask", ["", "-avx512bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_conv2d_in_bf16_runs_on_pairs_where_the_cpu_has_them(case, mask, constant, monkeypatch):
    """matmul="bfloat16", the choice forced to the pairs: where the CPU has AVX512-BF16 a
    convolution takes ConvGemmDpbf16 and matches PyTorch's float64 convolution of the
    bf16-rounded x and w (constant filters rounded into pairs once, with the network);
    masked (or on a CPU without them) it stays ConvGemm in float32."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    shape, filters, strides, padding = case
    cell, y = _conv_cell(shape, filters, strides, padding, mask, matmul="bfloat16", constant=constant)
    pairs = sgemm.pairs_supported(host_target(mask))
    (step,) = cell.steps
    assert step.kernel == ("ConvGemmDpbf16" if pairs else "ConvGemm")
    assert [p.form for p in CPUCode.of(cell).layout.prepared] == ([conv.PAIRED_FILTERS] if pairs and constant else [])
    _check_against_pytorch(cell, y, case, pairs, constant)


def _small_calls_on_two_parts(monkeypatch, call_bytes: int) -> None:
    """Calls of at most `call_bytes` of output, columns a multiple of 16, on two parts; the
    GEMM on pairs where the precision allows."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    monkeypatch.setattr(conv, "CALL_BYTES", call_bytes)
    monkeypatch.setattr(conv, "_CALL_UNIT", 16)
    monkeypatch.setattr(conv, "thread_count", lambda: 2)
    monkeypatch.setattr(conv, "worth_splitting", lambda flops, nbytes: True)


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
@pytest.mark.parametrize(("call_bytes", "calls"), [(4480, 1), (3200, 2)])
def test_a_batchs_image_takes_the_fewest_calls_that_each_write_at_most_the_call_bytes(call_bytes, calls, matmul, monkeypatch):
    """2 images of 8 filters by 12 × 11 outputs (4,224 bytes an image), in calls of columns a
    multiple of 16: one call where an image's output fits, else the fewest that fit, every
    element written (NaN first)."""
    _small_calls_on_two_parts(monkeypatch, call_bytes)
    case = (2, 3, 23, 21), (8, 3, 7, 7), (2, 2), (3, 3)
    cell, y = _conv_cell(*case, matmul=matmul)
    (step,) = cell.steps
    parts = conv._parts(step.op)
    assert [[call[0] for call in part] for part in parts] == [[0] * calls, [1] * calls]
    assert all(4 * call[2] * call[4] <= call_bytes and (call[4] % 16 == 0 or call[3] + call[4] == 132) for part in parts for call in part)
    _check_against_pytorch(cell, y, case, step.kernel == "ConvGemmDpbf16")


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_a_strided_1x1_convolution_multiplies_a_plane_of_the_pixels_its_stride_reads(matmul, monkeypatch):
    """ResNet's downsampling (1 × 1, stride 2, no padding): each part copies an image's
    pixels under the stride into a plane once, however many calls of the image it makes
    (here two an image, 3 images on 2 parts), and the GEMM reads that plane as one row of
    positions; every element written (NaN first), against PyTorch's float64 convolution."""
    _small_calls_on_two_parts(monkeypatch, 4 * 9 * 64)
    case = (3, 6, 19, 21), (9, 6, 1, 1), (2, 2), (0, 0)
    cell, y = _conv_cell(*case, matmul=matmul)
    (step,) = cell.steps
    assert conv.geometry_values(step.op) == [1, 110, 1, 1, 1, 1, 0, 0, 110, 1]  # 10 x 11 outputs in a row
    assert [[call[0] for call in part] for part in conv._parts(step.op)] == [[0, 0, 1, 1], [2, 2]]
    _check_against_pytorch(cell, y, case, step.kernel == "ConvGemmDpbf16")


PHASE_CASES = [  # (case, phase planes' height and width)
    (((3, 16, 28, 28), (24, 16, 3, 3), (2, 2), (1, 1)), (15, 15)),  # ResNet's first convolution of a stage (56 -> 28 at 1/2)
    (((3, 5, 13, 11), (7, 5, 3, 3), (2, 2), (1, 1)), (8, 7)),  # odd height and width
    (((2, 4, 12, 9), (6, 4, 3, 3), (2, 2), (0, 0)), (6, 5)),  # no padding: the last row and column never read
    (((2, 3, 17, 14), (5, 3, 3, 3), (3, 3), (1, 1)), (6, 5)),  # stride 3: 9 planes, one row each a tap reads
    (((3, 6, 15, 15), (9, 6, 5, 5), (2, 2), (2, 2)), (10, 10)),  # 5 x 5: a reach of 3 rows and columns in a plane
]


@pytest.mark.parametrize(("matmul", "mask"), [("float32", ""), ("float32", "-avx512"), ("float32", "-avx512,-avx2"),
                                              ("bfloat16", ""), ("bfloat16", "-avx512bf16")])
@pytest.mark.parametrize(("case", "planes"), PHASE_CASES, ids=[f"case{i}" for i in range(len(PHASE_CASES))])
def test_a_strided_convolution_multiplies_phase_planes_of_its_image(case, planes, matmul, mask, monkeypatch):
    """A convolution of stride s and a filter larger than 1 x 1 (ResNet's 3 x 3 stride-2
    ones): each part splits an image's padded channels into s x s phase planes once, however
    many calls of the image it makes (of 16 columns here, 3 or 2 images on 2 parts), and the GEMM reads
    each tap's positions as a run of one plane, stride 1; every element written (NaN
    first), against PyTorch's float64 convolution (of the bf16-rounded x and w on pairs)."""
    _small_calls_on_two_parts(monkeypatch, 4 * case[1][0] * 16)
    cell, y = _conv_cell(*case, mask=mask, matmul=matmul)
    (step,) = cell.steps
    (_, _, kernel_height, kernel_width), s = case[1], case[2][0]
    out_width = y.shape[3]
    assert conv.geometry_values(step.op) == [*planes, kernel_height, kernel_width, 1, 1, 0, 0, out_width, s]
    assert all(len({call[0] for call in part}) < len(part) for part in conv._parts(step.op))  # an image's calls share its planes
    _check_against_pytorch(cell, y, case, step.kernel == "ConvGemmDpbf16")


def test_other_dtypes_decompose_into_the_im2col_product():
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.conv2d(f.var("x", "float64", [1, 2, 6, 6]), f.var("w", "float64", [3, 2, 3, 3]), padding=1)
    y.var.out = True
    kernels = [s.kernel for s in rv.Compiler("cpu", cache=False).compile(flow).cell("f").steps]
    assert "ConvGemm" not in kernels and any("Gemm" in k for k in kernels)


def test_the_printed_cell_names_the_convolution_kernel():
    cell, _ = _conv_cell((1, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1))
    assert "ConvGemm" in str(cell)
