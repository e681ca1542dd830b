"""Conv2D by Winograd's F(2×2, 3×3) and F(4×4, 3×3) (kernels/winograd.py): the transform
matrices against the direct correlation in float64; the kernel in compiled cells against
PyTorch's float64 convolution for each vector variant and each form, with constant filters
(transformed once) and changing ones (transformed by each compute), at geometries that reach
every edge of its loops (outputs of odd sizes, tile rows padded to whole vectors, padding 0
to 2, a last block of fewer rows, channels past one slice of the GEMM's k), with a
Conv2DCalculate's program, and for each way of sharing the work out (images, blocks of tile
rows, filters); which form each convolution takes, and which convolutions it takes (with
the tiles' share of them, those of at most `conv.WINOGRAD_PAIRS`, turned off). In bf16
(WinogradConvDpbf16, AVX512-BF16: V in bf16 pairs, U rounded as the GEMM reads it) against
float64 F(2, 3) on the bf16-rounded U and V, for the same geometries, filters and shares."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_within_bound, random_array

import ranvier as rv
from ranvier.backends.cpu import sgemm
from ranvier.backends.cpu.backend import CPUCode
from ranvier.backends.cpu.kernels import conv, winograd
from ranvier.backends.cpu.target import host_target

MASKS = ["", "-avx512", "-avx512,-avx2"]


@pytest.fixture(autouse=True)
def _winograds_own(monkeypatch):
    """Every 3 × 3 stride-1 convolution here Winograd's: the tiles, tried first, would take
    those of few channels and filters (tests/test_conv_tiles.py)."""
    monkeypatch.setattr(conv, "WINOGRAD_PAIRS", 0)


FORMS = {form.name: form for form in winograd.FORMS}


@pytest.mark.parametrize("form", FORMS.values(), ids=list(FORMS))
def test_the_transforms_compute_a_tile_of_the_correlation(form):
    rng = np.random.default_rng(0)
    patch, taps = rng.standard_normal((form.patch, form.patch)), rng.standard_normal((3, 3))
    u = form.filter @ taps @ form.filter.T
    v = form.input_t @ patch @ form.input_t.T
    tile = form.output_t @ (u * v) @ form.output_t.T
    direct = np.array([[np.sum(patch[i : i + 3, j : j + 3] * taps) for j in range(form.tile)] for i in range(form.tile)])
    np.testing.assert_allclose(tile, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", FORMS.values(), ids=list(FORMS))
def test_transformed_filters_are_one_matrix_per_point(form):
    w = random_array((5, 3, 3, 3), "float32", seed=3)
    u = winograd.transformed_filters(w, form)
    assert u.shape == (form.points, 5, 3) and u.dtype == np.float32 and u.flags.c_contiguous
    want = np.einsum("ia,kcab,jb->kcij", form.filter, w.astype(np.float64), form.filter)
    np.testing.assert_allclose(u.reshape(form.patch, form.patch, 5, 3).transpose(2, 3, 0, 1), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("height", "width", "panel", "form", "group", "row_tiles"), [
    (8, 56, 24, "F(4x4, 3x3)", 8, 16),  # 14 tiles of 4: 16 either way, in vectors of 8
    (8, 28, 24, "F(4x4, 3x3)", 8, 8),
    (8, 56, 12, "F(4x4, 3x3)", 4, 16),  # SSE's panels of 12 hold vectors of 4 only
    (7, 7, 48, "F(2x2, 3x3)", 4, 4),  # 2 × 2 tiles of 4 padded to 2 × 4: more products than 4 × 4 of 2
    (2, 56, 24, "F(2x2, 3x3)", 4, 28),  # one row of tiles of 2: 28, seven vectors of 4 where 8s pad to 32
])
def test_each_convolution_takes_the_form_of_fewest_products(height, width, panel, form, group, row_tiles):
    """Tile rows are vectors of whichever group pads less; the form is whichever computes
    fewer products over its padded tiles."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.conv2d(f.var("x", "float32", [1, 2, height, width]), f.const(random_array((3, 2, 3, 3), "float32")), padding=1)
    geometry = winograd._geometry(y.var.producer, panel)
    assert (geometry.form.name, geometry.group, geometry.row_tiles) == (form, group, row_tiles)


@pytest.mark.parametrize(("channels", "size", "form"), [
    (64, 56, "F(4x4, 3x3)"),  # 224 tiles of 4 for 64 × 64 filters: 32 tiles' worth of bytes
    (128, 28, "F(2x2, 3x3)"),  # 56 tiles of 4 for 128 × 128 filters (64 tiles' worth)
    (256, 14, "F(2x2, 3x3)"),
])
def test_filters_that_would_outweigh_their_tiles_keep_the_smaller_form(channels, size, form):
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [1, channels, size, size])
    y = f.conv2d(x, f.const(random_array((channels, channels, 3, 3), "float32")), padding=1)
    assert winograd._geometry(y.var.producer, 48).form.name == form


@pytest.fixture(params=list(FORMS))
def form(request, monkeypatch):
    """Every convolution computed in this form, whatever its size would choose."""
    monkeypatch.setattr(winograd, "_form", lambda op: FORMS[request.param])
    return FORMS[request.param]


def _cell(shape, filters, padding, mask="", calculate=False, seed=0, matmul="float32", constant=True):
    """A cell convolving a variable x with filters, constant or (not `constant`) a variable
    set here (and, if `calculate`, a bias, a residual and a ReLU after), its output, and the
    float64 expectation and error bound: the direct convolution's, or where the products
    run on pairs (`matmul="bfloat16"` where the CPU has them) F(2, 3)'s on bf16 U and V."""
    x_value = random_array(shape, "float32", seed=seed)
    w_value = random_array(filters, "float32", seed=seed + 1, low=-1, high=1)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", shape)
    y = f.conv2d(x, f.const(w_value) if constant else f.var("w", "float32", filters), strides=1, padding=padding)
    tx, tw = torch.tensor(x_value, dtype=torch.float64), torch.tensor(w_value, dtype=torch.float64)
    if matmul == "bfloat16" and sgemm.pairs_supported(host_target(mask)):
        want, bound = (torch.tensor(v) for v in _pairs_f2(x_value, w_value, padding, constant))
    else:
        want = torch.nn.functional.conv2d(tx, tw, padding=padding)
        bound = torch.nn.functional.conv2d(tx.abs(), tw.abs(), padding=padding)
    if calculate:
        bias = random_array((filters[0], 1, 1), "float32", seed=seed + 2)
        residual = random_array(want.shape, "float32", seed=seed + 3)
        y = f.relu(y + f.const(bias) + f.const(residual))
        want = torch.relu(want + torch.tensor(bias, dtype=torch.float64) + torch.tensor(residual, dtype=torch.float64))
        bound = bound + torch.tensor(np.abs(bias) + np.abs(residual), dtype=torch.float64)
    y.var.out = True
    cell = rv.Compiler("cpu", cpu=mask, cache=False, matmul=matmul).compile(flow).cell("f")
    data = cell.instance()
    data[x] = x_value
    if not constant:
        data["f/w"] = w_value
    return cell, data, y, want.numpy(), bound.numpy()


def _bf16(values) -> np.ndarray:
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _transformed32(matrix: np.ndarray, square: np.ndarray) -> np.ndarray:
    """matrix · square · matrixᵀ over the first two axes of `square`, in float32 as the kernel
    computes it (its own `_apply_both`, on numpy arrays), [points, ...]."""
    values = winograd._apply_both(matrix, [list(row) for row in square.astype(np.float32)])
    return np.stack([value for row in values for value in row])


def _pairs_f2(x: np.ndarray, w: np.ndarray, padding: int, constant: bool) -> tuple[np.ndarray, np.ndarray]:
    """F(2, 3) in float64 on U and V rounded to bf16, each as the kernel makes it in float32:
    V by the input transform, U prepared (a `constant`'s, in float64) or by the filter
    transform; and the sum of its terms' magnitudes through the output transform's."""
    form = winograd.F2
    (images, _, height, width), filters = x.shape, w.shape[0]
    out_height, out_width = height + 2 * padding - 2, width + 2 * padding - 2
    rows, columns = -(-out_height // 2), -(-out_width // 2)
    padded = np.zeros((images, x.shape[1], 2 * rows + 2, 2 * columns + 2), np.float32)
    padded[:, :, padding : padding + height, padding : padding + width] = x
    u = winograd.transformed_filters(w, form) if constant else _transformed32(form.filter, w.transpose(2, 3, 0, 1))
    u = _bf16(u).reshape(4, 4, filters, -1)
    want, bound = np.zeros((2, images, filters, 2 * rows, 2 * columns))
    for i in range(rows):
        for j in range(columns):
            patch = padded[:, :, 2 * i : 2 * i + 4, 2 * j : 2 * j + 4].transpose(2, 3, 0, 1)
            v = _bf16(_transformed32(form.input_t, patch)).reshape(4, 4, images, -1)
            for total, (a, uu, vv) in zip((want, bound), ((form.output_t, u, v), (np.abs(form.output_t), np.abs(u), np.abs(v)))):
                total[:, :, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2] = np.einsum("ai,ijkc,ijnc,bj->nkab", a, uu, vv, a)
    return want[:, :, :out_height, :out_width], bound[:, :, :out_height, :out_width]


def _check(data, y, want, bound) -> None:
    for sentinel in (np.nan, 7.0):  # an element never written keeps one of them
        data[y] = np.full(y.shape, sentinel, np.float32)
        data.compute()
        got = np.array(data[y])
        assert np.isfinite(got).all()
        # the transforms add a few roundings of values a few times the inputs': F(2, 3) erred
        # up to 2e-7 of the bound, F(4, 3), whose coefficients reach 8, up to 4.2e-6
        assert_within_bound(got, want, bound, 1e-5)


GEOMETRIES = [
    ((1, 3, 8, 8), (4, 3, 3, 3), 1),  # one vector of tiles, half of it padding
    ((2, 5, 11, 13), (7, 5, 3, 3), 1),  # odd output: last tile row and column half outside
    ((1, 6, 9, 17), (9, 6, 3, 3), 0),  # no padding: 7 × 15 outputs
    ((1, 4, 10, 10), (3, 4, 3, 3), 2),  # padding wider than one: 12 × 12 outputs
    ((1, 300, 6, 6), (5, 300, 3, 3), 1),  # channels past one slice of the GEMM's k
    ((1, 8, 40, 70), (12, 8, 3, 3), 1),  # several blocks, the last one shorter
    ((1, 4, 1, 1), (3, 4, 3, 3), 1),  # one pixel: a tile all padding but one output
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"g{i}" for i in range(len(GEOMETRIES))])
def test_winograd_convolution_matches_pytorch(geometry, mask, form):
    cell, data, y, want, bound = _cell(*geometry, mask=mask)
    (step,) = cell.steps
    assert step.kernel == winograd.WINOGRAD_KERNEL and step.variant != "python"
    _check(data, y, want, bound)


@pytest.mark.parametrize("mask", ["", "-avx512,-avx2"])
def test_a_calculate_after_the_convolution_runs_over_the_rows_each_part_wrote(mask, form):
    cell, data, y, want, bound = _cell((1, 32, 30, 30), (24, 32, 3, 3), 1, mask=mask, calculate=True)
    assert [step.kernel for step in cell.steps] == [winograd.WINOGRAD_KERNEL]
    _check(data, y, want, bound)


SPLITS = {
    "images": ((3, 16, 20, 20), (16, 16, 3, 3)),
    "tile rows": ((1, 64, 56, 56), (64, 64, 3, 3)),
    "filters": ((1, 256, 14, 14), (256, 256, 3, 3)),
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_each_way_of_sharing_the_work_out(split, monkeypatch, form):
    """Two parts as on a 2-core machine, whatever this one has: whole images, ranges of
    tile rows (halves, not whole blocks: 8 and 6 of F(4, 3)'s 14), or (an image of fewer
    blocks than parts) ranges of filters."""
    monkeypatch.setattr(winograd, "thread_count", lambda: 2)
    monkeypatch.setattr(winograd, "worth_splitting", lambda flops, nbytes: True)
    shape, filters = SPLITS[split]
    cell, data, y, want, bound = _cell(shape, filters, 1, calculate=True, seed=len(split))
    op = next(step.op for step in cell.steps if step.kernel == winograd.WINOGRAD_KERNEL)
    g = winograd._geometry(op, sgemm.panel_width(cell.backend.target))
    parts = winograd._parts(op, g)
    assert len(parts) == 2
    rows, filter_ranges = ({call[i] for part in parts for call in part} for i in (slice(1, 3), slice(3, 5)))
    images = [image for part in parts for first, *_, count in part for image in range(first, first + count)]
    if split == "images":
        assert images == [0, 1, 2] and len(filter_ranges) == 1
    elif split == "tile rows":
        assert rows == {(0, g.tile_rows // 2), (g.tile_rows // 2, g.tile_rows)} and len(filter_ranges) == 1
    else:
        assert len(rows) == 1 and filter_ranges == {(0, 128), (128, 256)}
    _check(data, y, want, bound)


def _several_images_a_block(cell, kernel: str) -> None:
    """The cell's one step is `kernel`, in two parts whose whole images go several to a
    block, a part's last block with fewer images than the others."""
    (step,) = cell.steps
    assert step.kernel == kernel
    g = winograd._geometry(step.op, sgemm.panel_width(cell.backend.target), pairs=kernel == winograd.PAIRS_KERNEL)
    parts = winograd._parts(step.op, g)
    assert len(parts) == 2 and g.block_images > 1
    assert any(images < g.block_images for part in parts for *_, images in part)


MANY_SMALL_IMAGES = ((7, 24, 5, 6), (20, 24, 3, 3))  # 4 and 3 images a part; 3 × 4 tiles an image


@pytest.mark.parametrize("mask", MASKS)
def test_images_of_few_tiles_go_several_to_a_block(mask, monkeypatch, form):
    """Whole images of fewer tiles than a block wants are transformed and multiplied together
    (their filters' U read once for them all), a Calculate after each image."""
    monkeypatch.setattr(winograd, "thread_count", lambda: 2)
    monkeypatch.setattr(winograd, "worth_splitting", lambda flops=0, nbytes=0: True)
    cell, data, y, want, bound = _cell(*MANY_SMALL_IMAGES, 1, mask=mask, calculate=True, seed=4)
    _several_images_a_block(cell, winograd.WINOGRAD_KERNEL)
    _check(data, y, want, bound)


PAIR_GEOMETRIES = [*GEOMETRIES, ((1, 128, 28, 28), (128, 128, 3, 3), 1)]


@pytest.mark.parametrize("constant", [True, False], ids=["constant", "changing"])
@pytest.mark.parametrize("mask", ["", "-avx512bf16"])
@pytest.mark.parametrize("geometry", PAIR_GEOMETRIES, ids=[f"g{i}" for i in range(len(PAIR_GEOMETRIES))])
def test_in_bf16_its_products_run_on_pairs_where_the_cpu_has_them(geometry, mask, constant, monkeypatch):
    """matmul="bfloat16", the choice forced to the pairs: F(2, 3) on V in bf16 pairs
    (WinogradConvDpbf16) where the CPU has AVX512-BF16, odd channel counts' last pair half
    zeros, filters constant (U prepared, on pairs in bf16 pairs of channels) or changing (U
    made by each compute); masked (or on a CPU without them) WinogradConv in float32."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    monkeypatch.setattr(winograd, "_form", lambda op: winograd.F2)
    cell, data, y, want, bound = _cell(*geometry, mask=mask, matmul="bfloat16", constant=constant)
    pairs = sgemm.pairs_supported(host_target(mask))
    (step,) = cell.steps
    assert step.kernel == (winograd.PAIRS_KERNEL if pairs else winograd.WINOGRAD_KERNEL)
    forms = [p.form for p in CPUCode.of(cell).layout.prepared]
    assert forms == ([f"{winograd.F2.prepared}{' in bf16 pairs' if pairs else ''}"] if constant else [])
    _check(data, y, want, bound)


def _on_pairs_in_two_parts(monkeypatch) -> None:
    """F(2, 3) on pairs (skipped where the CPU has none), in two parts as on a 2-core machine."""
    if not sgemm.pairs_supported(host_target()):
        pytest.skip("this CPU has no AVX512-BF16 (vdpbf16ps)")
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    monkeypatch.setattr(winograd, "_form", lambda op: winograd.F2)
    monkeypatch.setattr(winograd, "thread_count", lambda: 2)
    monkeypatch.setattr(winograd, "worth_splitting", lambda flops=0, nbytes=0: True)


@pytest.mark.parametrize("split", list(SPLITS))
def test_on_pairs_each_way_of_sharing_the_work_out(split, monkeypatch):
    """As `test_each_way_of_sharing_the_work_out`, with a Calculate after, on pairs."""
    _on_pairs_in_two_parts(monkeypatch)
    shape, filters = SPLITS[split]
    cell, data, y, want, bound = _cell(shape, filters, 1, calculate=True, seed=len(split), matmul="bfloat16")
    (step,) = cell.steps
    assert step.kernel == winograd.PAIRS_KERNEL
    assert len(winograd._parts(step.op, winograd._geometry(step.op, sgemm.panel_width(cell.backend.target), pairs=True))) == 2
    _check(data, y, want, bound)


@pytest.mark.parametrize("constant", [True, False], ids=["constant", "changing"])
def test_on_pairs_images_of_few_tiles_go_several_to_a_block(constant, monkeypatch):
    _on_pairs_in_two_parts(monkeypatch)
    cell, data, y, want, bound = _cell(*MANY_SMALL_IMAGES, 1, calculate=True, seed=4, matmul="bfloat16", constant=constant)
    _several_images_a_block(cell, winograd.PAIRS_KERNEL)
    _check(data, y, want, bound)


@pytest.mark.parametrize(("images", "rows"), [(32, 12), (1, 4)])
def test_on_pairs_a_part_of_several_images_takes_larger_blocks(images, rows, monkeypatch):
    """ResNet-18's 128-channel 28 × 28 convolution on pairs in two parts: at batch 32 its
    blocks are 12 tile rows (_PAIRS_BLOCK_BYTES: 192 tiles, four whole panels), at batch 1
    (a part takes some of an image's rows) 4, as in float32."""
    _on_pairs_in_two_parts(monkeypatch)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.conv2d(f.var("x", "float32", [images, 128, 28, 28]), f.const(random_array((128, 128, 3, 3), "float32")), padding=1)
    y.var.out = True
    (step,) = rv.Compiler("cpu", cache=False, matmul="bfloat16").compile(flow).cell("f").steps
    assert step.kernel == winograd.PAIRS_KERNEL
    assert winograd._geometry(step.op, 48, pairs=True).block_rows == rows


@pytest.mark.parametrize(("images", "group", "rows"), [(1, 16, 2), (32, 4, 14)])
def test_on_pairs_tiles_go_16_to_a_vector_where_the_products_take_no_more_columns(images, group, rows, monkeypatch):
    """The products on pairs run over a block's tiles in whole vectors of 16: ResNet-18's
    28-tile rows are transformed 16 tiles a vector (rows of 32) where its blocks take as many
    columns either way (batch 1, two cores: blocks of 2 rows, 64 columns; in vectors of 4,
    blocks of 3 rows, 84 tiles in 96 columns), and 4 where those would take more (batch 32:
    14 rows, 392 tiles in 400 columns, where rows of 32 take 448)."""
    monkeypatch.setattr(winograd, "thread_count", lambda: 2)
    monkeypatch.setattr(winograd, "worth_splitting", lambda flops=0, nbytes=0: True)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    y = f.conv2d(f.var("x", "float32", [images, 64, 56, 56]), f.const(random_array((64, 64, 3, 3), "float32")), padding=1)
    g = winograd._geometry(y.var.producer, 48, pairs=True)
    assert (g.group, g.block_rows) == (group, rows)


@pytest.mark.parametrize("mask", ["", "-avx512bf16"])
def test_in_bf16_on_pairs_a_convolution_takes_the_smaller_form(mask, monkeypatch):
    """F(4, 3)'s transforms magnify bf16's rounding of U and V (kernels/winograd.py): a
    convolution whose float32 form is F(4, 3) (ResNet-18's 64-channel 56 × 56 ones) runs
    F(2, 3) on pairs where the CPU has them, its U prepared in that form; masked, F(4, 3) in
    float32."""
    monkeypatch.setenv("RANVIER_GEMM", "generated")
    monkeypatch.setattr(winograd, "_form", lambda op: winograd.F4)
    cell, data, y, want, bound = _cell((1, 8, 12, 12), (8, 8, 3, 3), 1, mask=mask, matmul="bfloat16")
    pairs = sgemm.pairs_supported(host_target(mask))
    (step,) = cell.steps
    assert step.kernel == (winograd.PAIRS_KERNEL if pairs else winograd.WINOGRAD_KERNEL)
    forms = [p.form for p in CPUCode.of(cell).layout.prepared]
    assert forms == [winograd.F2.prepared_pairs if pairs else winograd.F4.prepared]
    _check(data, y, want, bound)


def test_other_convolutions_are_the_implicit_gemms():
    """Strides, other kernel sizes and filters too wide for their transforms to stay in the
    caches keep the direct convolution, unless the batch has enough images to read them
    once per image from the last-level cache."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [1, 8, 12, 12])
    wide = f.const(random_array((512, 512, 3, 3), "float32"))
    outputs = [
        f.conv2d(x, f.const(random_array((4, 8, 3, 3), "float32")), strides=2, padding=1),
        f.conv2d(x, f.const(random_array((4, 8, 5, 5), "float32")), padding=2),
        f.conv2d(f.var("wide", "float32", [1, 512, 4, 4]), wide, padding=1),
        f.conv2d(f.var("batch", "float32", [8, 512, 4, 4]), wide, padding=1),
    ]
    for output in outputs:
        output.var.out = True
    cell = rv.Compiler("cpu", cache=False).compile(flow).cell("f")
    assert [step.kernel for step in cell.steps] == ["ConvTiles"] * 2 + ["ConvGemm", "WinogradConv"]  # 4 filters: tiles
    images = random_array((8, 512, 4, 4), "float32")
    data, reference = cell.instance(), rv.Compiler("reference").compile(flow).cell("f").instance()
    for instance in (data, reference):
        instance["f/batch"] = images
        instance.compute()
    np.testing.assert_allclose(data[outputs[3]], reference[outputs[3]], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("mask", ["", "-avx512,-avx2"])
def test_filters_that_change_are_transformed_at_every_compute(mask, monkeypatch, form):
    """A training step's filters (a variable, shared out over two parts) are transformed by
    the step itself: a new value is used by the next compute."""
    monkeypatch.setattr(winograd, "thread_count", lambda: 2)
    monkeypatch.setattr(winograd, "worth_splitting", lambda flops=0, nbytes=0: True)
    shape, filters = (2, 6, 10, 9), (5, 6, 3, 3)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x, w = f.var("x", "float32", shape), f.var("w", "float32", filters)
    y = f.conv2d(x, w, padding=1)
    y.var.out = True
    cell = rv.Compiler("cpu", cpu=mask, cache=False).compile(flow).cell("f")
    assert [step.kernel for step in cell.steps] == [winograd.WINOGRAD_KERNEL]
    data = cell.instance()
    data[x] = x_value = random_array(shape, "float32", seed=5)
    tx = torch.tensor(x_value, dtype=torch.float64)
    for seed in (6, 7):
        data[w] = w_value = random_array(filters, "float32", seed=seed, low=-1, high=1)
        tw = torch.tensor(w_value, dtype=torch.float64)
        want = torch.nn.functional.conv2d(tx, tw, padding=1).numpy()
        bound = torch.nn.functional.conv2d(tx.abs(), tw.abs(), padding=1).numpy()
        _check(data, y, want, bound)


def test_the_printed_cell_names_the_winograd_kernel():
    cell, *_ = _cell((1, 3, 8, 8), (4, 3, 3, 3), 1)
    assert winograd.WINOGRAD_KERNEL in str(cell)
