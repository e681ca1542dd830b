"""ConvTiles (kernels/conv.py): a convolution of few filters multiplied by tiles of filters ×
vectors of positions, which read each image's windows from its padded planes (stride 1) or
from a copy of them in scratch (other strides), against
PyTorch's float64 convolution, on every vector variant, with the images shared out over one,
two and three parts; whole tiles and narrower or lower ones at the edges, output positions
past the last whole vector, strides, padding, rectangular filters, and a Conv2DCalculate's
bias, residual and ReLU run over each image's output. Which convolutions it takes: few
filters (more with stride 1), and at least an image for each part."""

from __future__ import annotations

import pytest
import torch
from helpers import cell_against_pytorch, random_array

import ranvier as rv
from ranvier.backends.cpu.kernels import conv, winograd

MASKS = ["", "-avx512", "-avx512,-avx2"]

CASES = [
    # x, filters, strides, padding
    ((3, 1, 28, 28), (8, 1, 5, 5), (1, 1), (2, 2)),  # the MNIST CNN's first: 784 positions, whole tiles of filters
    ((4, 16, 14, 14), (8, 16, 5, 5), (1, 1), (2, 2)),  # its input gradient: 196 positions, a last vector of 4
    ((2, 8, 14, 14), (16, 8, 5, 5), (1, 1), (2, 2)),  # its second
    ((3, 3, 11, 13), (5, 3, 3, 3), (1, 1), (1, 1)),  # a filter past the whole tiles, 143 positions
    ((2, 4, 9, 7), (3, 4, 3, 3), (2, 2), (1, 1)),  # stride 2, fewer filters than a tile, 20 positions
    ((3, 2, 8, 5), (13, 2, 2, 3), (2, 1), (1, 2)),  # rectangular filters, padding wider on one axis
    ((2, 5, 7, 7), (1, 5, 1, 1), (2, 2), (0, 0)),  # one filter, a 1 × 1 downsampling: 16 positions
    ((2, 3, 9, 8), (6, 3, 3, 5), (1, 1), (0, 2)),  # padding on one axis only, rectangular filters
    ((2, 6, 10, 9), (41, 6, 7, 7), (1, 1), (3, 3)),  # 41 filters past 16: planes only, a last tile of one filter
    ((3, 7, 6, 5), (64, 7, 1, 1), (1, 1), (0, 0)),  # 1 × 1 unpadded: the planes are the image, 64 filters
    ((2, 2, 12, 3), (9, 2, 4, 2), (1, 1), (1, 0)),  # even filters, padded rows wider than the output
]


@pytest.fixture(autouse=True)
def _no_winograd(monkeypatch):
    """The tiles on every geometry here, 3 × 3 filters of stride 1 included (which
    Winograd's kernel would otherwise take)."""
    monkeypatch.setattr(winograd, "_MAX_PAIRS", 0)


def _cell(shape, filters, strides, padding, mask: str, fused: bool):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w = f.var("x", "float32", shape), f.var("w", "float32", filters)
    y = f.conv2d(x, w, strides=strides, padding=padding)
    if fused:
        y = f.relu(y + f.var("bias", "float32", [1, filters[0], 1, 1]) + f.var("skip", "float32", y.shape))
    y.var.out = True
    return rv.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f"), y


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_the_tiles_match_pytorch_and_write_every_output(case, mask, parts, monkeypatch):
    shape, filters, strides, padding = case
    if parts > shape[0]:
        pytest.skip("a part per image at most")
    monkeypatch.setattr(conv, "thread_count", lambda: parts)
    monkeypatch.setattr(conv, "worth_splitting", lambda flops=0, nbytes=0: True)
    fused = parts == 2  # the epilogue once per case and variant
    cell, y = _cell(shape, filters, strides, padding, mask, fused)
    (step,) = cell.steps
    assert step.kernel == conv.TILES_KERNEL and step.variant != "python"
    images = conv._tile_parts(step.op)
    assert images[0][0] == 0 and images[-1][1] == shape[0] and (len(images) > 1) == (parts > 1)
    values = {"x": random_array(shape, "float32", seed=1), "w": random_array(filters, "float32", seed=2, low=-1, high=1)}
    if fused:
        values["bias"] = random_array([1, filters[0], 1, 1], "float32", seed=3)
        values["skip"] = random_array(y.shape, "float32", seed=4)

    def convolved(x, w, bias=None, skip=None):
        product = torch.nn.functional.conv2d(x, w, stride=strides, padding=padding)
        return torch.relu(product + bias + skip) if fused else product

    cell_against_pytorch(cell, y, values, convolved, tol=2e-6)


def test_many_filters_or_fewer_images_than_parts_stay_on_the_implicit_gemm(monkeypatch):
    monkeypatch.setattr(conv, "thread_count", lambda: 2)
    monkeypatch.setattr(conv, "worth_splitting", lambda flops=0, nbytes=0: True)
    kernels = {}
    for name, shape, filters, strides in [("few", (2, 3, 9, 9), (conv.FEW_FILTERS, 3, 3, 3), (2, 2)),
                                          ("many", (2, 3, 9, 9), (conv.FEW_FILTERS + 1, 3, 3, 3), (2, 2)),
                                          ("more on planes", (2, 3, 9, 9), (conv.PLANE_FILTERS, 3, 3, 3), (1, 1)),
                                          ("too many on planes", (2, 3, 9, 9), (conv.PLANE_FILTERS + 1, 3, 3, 3), (1, 1)),
                                          ("one image", (1, 3, 9, 9), (4, 3, 3, 3), (1, 1))]:
        cell, _ = _cell(shape, filters, strides, (1, 1), "", fused=False)
        kernels[name] = cell.steps[0].kernel
    assert kernels == {"few": conv.TILES_KERNEL, "many": "ConvGemm", "more on planes": conv.TILES_KERNEL,
                       "too many on planes": "ConvGemm", "one image": "ConvGemm"}


def test_the_printed_cell_names_the_tiles():
    cell, _ = _cell((1, 3, 8, 8), (4, 3, 3, 3), (2, 2), (1, 1), "", fused=False)
    assert conv.TILES_KERNEL in str(cell)


def test_a_three_by_three_convolution_of_few_channels_and_filters_takes_the_tiles_before_winograd(monkeypatch):
    monkeypatch.setattr(winograd, "_MAX_PAIRS", 256 * 256)
    monkeypatch.setattr(conv, "thread_count", lambda: 2)
    monkeypatch.setattr(conv, "worth_splitting", lambda flops=0, nbytes=0: True)
    few, _ = _cell((2, 8, 9, 9), (conv.WINOGRAD_PAIRS // 8, 8, 3, 3), (1, 1), (1, 1), "", fused=False)
    more, _ = _cell((2, 8, 9, 9), (conv.WINOGRAD_PAIRS // 8 + 1, 8, 3, 3), (1, 1), (1, 1), "", fused=False)
    assert (few.steps[0].kernel, more.steps[0].kernel) == (conv.TILES_KERNEL, "WinogradConv")
