"""Conv2D over batches of small images as one windows GEMM per group of stacked images
(kernels/conv_stacked.py): against PyTorch's float64 convolution, in float32 and on bf16 pairs
(against float64 on the bf16-rounded operands), over geometries whose padding rows separate
the images, strides whose rows of an image do not divide evenly, groups that leave a part's
last images fewer, and a Conv2DCalculate's program run over each image's output; every
element written (NaN first). What Winograd's kernel takes, 1 × 1 filters, large images and
fewer than two images a core are not stacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import cell_against_pytorch, random_array

import ranvier as rv
from ranvier.backends.cpu import sgemm
from ranvier.backends.cpu.backend import CPUCode
from ranvier.backends.cpu.kernels import conv, conv_stacked, winograd
from ranvier.backends.cpu.parallel import thread_count
from ranvier.backends.cpu.target import host_target

CASES = [
    # (images, channels, height, width), (filters, channels, kernel), strides, padding
    ((9, 6, 7, 7), (70, 6, 5, 5), (1, 1), (2, 2)),  # a 7 × 7 image: four dropped rows between images
    ((8, 5, 14, 14), (72, 5, 3, 3), (2, 2), (1, 1)),  # stride 2: an image's 16 padded rows, 8 of output
    ((7, 4, 9, 7), (80, 4, 3, 3), (2, 2), (1, 1)),  # 11 padded rows rounded up to 12 for the stride
    ((10, 3, 5, 6), (70, 3, 3, 2), (1, 2), (1, 0)),  # a rectangular filter, padding on one axis
    ((9, 3, 11, 13), (70, 3, 3, 3), (3, 3), (1, 1)),  # stride 3: 13 padded rows rounded up to 15, 9 phase planes
    ((8, 4, 9, 9), (72, 4, 3, 3), (2, 2), (0, 0)),  # stride 2 unpadded: the last row and column never read
    ((8, 3, 10, 11), (70, 3, 5, 5), (2, 2), (2, 2)),  # 5 x 5 of stride 2: a reach of 3 rows in a phase plane
]


def _cell(case, matmul: str, mask: str = "", relu: bool = False, constant: bool = False):
    """The convolution's cell; its filters a variable or (`constant`) _filters' values."""
    shape, filters, strides, padding = case
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w = f.var("x", "float32", shape), f.const(_filters(filters)) if constant else f.var("w", "float32", filters)
    y = f.conv2d(x, w, strides=strides, padding=padding)
    if relu:
        y = f.relu(y)
    y.var.out = True
    return rv.Compiler("cpu", cpu=mask, cache=False, matmul=matmul).compile(flow).cell("f"), y


def _filters(shape) -> np.ndarray:
    return random_array(shape, "float32", seed=2, low=-1, high=1)


def _check(case, cell, y, pairs: bool, tolerance: float, relu: bool = False, constant: bool = False) -> None:
    shape, filters, strides, padding = case

    def convolved(x, w):
        product = torch.nn.functional.conv2d(x, w, stride=strides, padding=padding)
        return torch.relu(product) if relu else product

    values = {"x": random_array(shape, "float32", seed=1), "w": _filters(filters)}
    cell_against_pytorch(cell, y, values, convolved, constants=["w"] if constant else [], bf16=["x", "w"] if pairs else [],
                         tol=tolerance)


def _kernel(cell) -> str:
    (step,) = [s for s in cell.steps if s.op.type.startswith("Conv2D")]
    return step.kernel


@pytest.mark.parametrize("mask", ["", "-avx512", "-avx512,-avx2"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_a_batch_of_small_images_is_stacked_into_one_gemm_a_group_and_matches_pytorch(case, mask):
    cell, y = _cell(case, "float32", mask)
    assert _kernel(cell) == conv_stacked.KERNEL
    _check(case, cell, y, False, 2e-6)


@pytest.mark.skipif(not sgemm.pairs_supported(host_target()), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")
@pytest.mark.parametrize("constant", [False, True], ids=["variable", "constant"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_stacked_images_on_bf16_pairs_match_float64_on_the_rounded_operands(case, constant, monkeypatch):
    """Constant filters rounded into pairs once, with the network (conv.paired_filters)."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")  # the pairs, whatever this machine measures
    cell, y = _cell(case, "bfloat16", constant=constant)
    assert _kernel(cell) == conv_stacked.PAIRS_KERNEL
    assert [p.form for p in CPUCode.of(cell).layout.prepared] == ([conv.PAIRED_FILTERS] if constant else [])
    _check(case, cell, y, True, 1e-5, constant=constant)


@pytest.mark.parametrize("case", [c for c in CASES if c[2][0] == c[2][1] > 1], ids=str)
def test_stacked_images_of_a_stride_are_split_into_phase_planes(case):
    """A stride s in both directions: the tall image is each channel's s x s phase planes
    (conv.phase_planes), an image's rows from its output rows' place, read with stride 1."""
    cell, _ = _cell(case, "float32")
    s, plane_height, plane_width = conv.phase_planes(cell.steps[0].op)
    stack = conv_stacked._stack(cell.steps[0].op)
    assert conv_stacked._geometry_values(cell.steps[0].op) == [
        (stack.group - 1) * stack.out_rows + plane_height, plane_width, *case[1][2:], 1, 1, 0, 0, stack.out_width, s]


def test_a_fused_program_runs_over_each_stacked_image():
    case = CASES[1]
    cell, y = _cell(case, "float32", relu=True)
    assert _kernel(cell) == conv_stacked.KERNEL and len(cell.steps) == 1
    _check(case, cell, y, False, 2e-6, relu=True)


def test_one_image_a_core_large_images_1x1_filters_and_winograds_are_not_stacked():
    (_, channels, height, width), filters, strides, padding = CASES[1]
    few = ((2 * thread_count() - 1, channels, height, width), filters, strides, padding)
    large = ((8, channels, 40, 40), filters, strides, padding)
    downsampling = ((8, channels, height, width), (filters[0], channels, 1, 1), strides, (0, 0))
    for case in (few, large, downsampling):
        assert _kernel(_cell(case, "float32")[0]) == conv.CONV_KERNEL
    winograds = ((8, channels, 7, 7), (filters[0], channels, 3, 3), (1, 1), (1, 1))
    assert _kernel(_cell(winograds, "float32")[0]) == winograd.WINOGRAD_KERNEL
