"""Conv2D by Winograd's minimal filtering F(m×m, 3×3) (Lavin and Gray, "Fast Algorithms for
Convolutional Neural Networks", 2016): a 3 × 3 convolution of stride 1 computes each m × m
tile of its output from the (m + 2) × (m + 2) patch of input under it as

    Y = Aᵀ [ U ⊙ V ] A,    U = G g Gᵀ (per filter k and channel c),   V = Bᵀ d B (per tile and c),

summing over the channels inside the ⊙: each of the (m + 2)² points ξ of the transformed tile
is a matrix product M[ξ] [K, tiles] = U[ξ] [K, C] · V[ξ] [C, tiles]. F(2×2, 3×3) does 16
multiplies per tile and channel pair where the direct convolution does 36 (2.25 times fewer),
F(4×4, 3×3) 36 where it does 144 (4 times fewer), for additions in the transforms and their
memory traffic; a convolution takes the form that computes fewer (`_form`), or on bf16
pairs F(2, 3) (`_on_pairs`). The filters are
an inference model's constants, so U is made once when the network is (a `Prepared` form of
the weights).

The output's tiles are taken a block of tile rows at a time, sized so the block's V and M stay
near the caches and the filters' U is read few times; where a whole image has fewer tiles than
that, a block takes several images, their tiles one after the other. Per block, on the calling
thread:

1. the input rows under the block are copied, every channel, into a scratch with their
   padding as zeros, so the transform reads them with plain vector loads;
2. the input transform reads a vector of `group` horizontally adjacent tiles at a time (each
   row of their patches is runs of loads split into m phases of columns) and stores V[ξ] as
   the generated GEMM's packed panels of B (sgemm.py: NR tiles by all C channels);
3. a call of `ranvier_sgemm_packed` per point makes M[ξ], reading U[ξ] in place;
4. the output transform writes each tile's m × m outputs into a scratch of whole tile rows
   (m interleaved vectors per output row), whose rows are then copied into the NCHW
   output less what lies past its edge; a Conv2DCalculate's program runs over the rows
   of output each call wrote.

The edges go through the scratches rather than masked loads and stores, which are slow on
AMD's cores (ResNet-18's first 3 × 3 convolution spent 0.39 ms in its transforms with masks,
0.29 ms without). A tile row is padded to a whole number of vectors of tiles,
4 or 8 (whichever pads less): the padding tiles compute what is never stored. Profiles
count the direct convolution's FLOPs, so the kernel's GFLOP/s is the rate a direct
convolution would need to match it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from llvmlite import ir

from .... import dtypes
from ....ops import attrs_of, unchanging_constant
from ...kernels import Prepared
from ...llvm.convert import bf16_pairs
from ...llvm.irutil import BYTE_PTR, F32, I32, I64, VOID, cache_line_aligned, for_range, i64
from ...llvm.values import Value
from .. import sgemm
from ..codegen import SGEMM_PACKED, SGEMM_PACKED_DPBF16, SGEMM_PACKED_DPBF16_PAIRED
from ..gemm_choice import packed_pairs_are_faster
from ..parallel import run_parts, shares, thread_count, worth_splitting
from .library import kernel
from .program import epilogue

WINOGRAD_KERNEL = "WinogradConv"
PAIRS_KERNEL = "WinogradConvDpbf16"  # its products on bf16 pairs: passed over where those do not run



@dataclass(frozen=True, eq=False)
class Form:
    """One of Winograd's algorithms F(m × m, 3 × 3): m outputs of a 3-tap filter from
    m + 2 inputs, along both axes, by its matrices Bᵀ (`input_t`), G and Aᵀ (`output_t`)."""

    name: str
    input_t: np.ndarray
    filter: np.ndarray
    output_t: np.ndarray

    @property
    def tile(self) -> int:
        """An output tile's edge."""
        return self.output_t.shape[0]

    @property
    def patch(self) -> int:
        """An input patch's edge."""
        return self.output_t.shape[1]

    @property
    def points(self) -> int:
        """Products per tile and channel pair: one GEMM each."""
        return self.patch * self.patch

    @property
    def prepared(self) -> str:
        """What constant filters are prepared as."""
        return f"Winograd {self.name} filters U[{self.points}, K, C]"

    @property
    def prepared_pairs(self) -> str:
        """What constant filters are prepared as for the GEMM on bf16 pairs."""
        return f"{self.prepared} in bf16 pairs"


F2 = Form("F(2x2, 3x3)",
          np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64),
          np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float64),
          np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64))
# Lavin and Gray's F(4, 3), interpolating at 0, ±1, ±2 and infinity: 2.25 products an output
# where F(2, 3) takes 4, for transforms whose coefficients reach 8: its error reached 4.2e-6
# of the direct convolution's bound (the sum of the products' magnitudes) in the tests, where
# F(2, 3)'s reached 2e-7.
F4 = Form("F(4x4, 3x3)",
          np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
                    [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], np.float64),
          np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
                    [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], np.float64),
          np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], np.float64))
FORMS = (F2, F4)

# A block's V and M, as bytes: a block takes the fewest tile rows that reach this, so the
# GEMMs' panels and rows are long enough to run near their peak, while V and M stay in the
# caches between the transforms and the products.
_BLOCK_BYTES = 512 << 10
# On bf16 pairs, where a part takes several whole images, a block fills this much instead: ResNet-18's
# 128-channel 28 × 28 convolutions at batch 32 took blocks of 4 tile rows (64 tiles: a panel
# of 48 and one of 16 a product) at 512 KiB; in blocks of 12 rows (192 tiles, four whole
# panels) they ran in 0.90-0.92 of the time, of 6 (two panels) 0.95, of 8 or 14 (a part-filled
# panel) 0.96 (alone, alternated in one process; Zen 5, two cores, shared). Its other
# convolutions' blocks are the filters' to size (`wanted_rows`).
_PAIRS_BLOCK_BYTES = 3 << 20
# Above this many filter × channel pairs the transformed filters (F(2, 3)'s, 64 bytes a pair,
# which so many channels take: `_form`) come from memory: ResNet-18's 512 × 512 convolutions (16 MB of U) took 1.2 times the direct
# convolution's time at batch 1 and the same at batch 8 on an AVX2 EPYC; its 256 × 256
# ones 0.7 times. With this many images U is read once per image from the last-level
# cache instead: on an AVX-512 Xeon the 512 × 512 ones took 0.8 times the direct
# convolution's time at batch 8 and 32 (alone, and the same at batch 1 in ResNet-18).
_MAX_PAIRS = 256 * 256
_MANY_IMAGES = 8


def transformed_filters(w: np.ndarray, form: Form) -> np.ndarray:
    """U[ξ, k, c] = (G · w[k, c] · Gᵀ)[ξ] for filters w [K, C, 3, 3]: [points, K, C] float32,
    computed in float64."""
    u = np.einsum("ia,kcab,jb->ijkc", form.filter, w.astype(np.float64), form.filter)
    return np.ascontiguousarray(u.reshape(form.points, *w.shape[:2]), np.float32)


@dataclass(frozen=True)
class _Geometry:
    """Sizes of one convolution, as the kernel's loops use them, and the form computing it."""

    form: Form
    channels: int
    filters: int
    height: int
    width: int
    pad_height: int
    pad_width: int
    out_height: int
    out_width: int
    group: int  # tiles per vector of the transforms
    panel: int  # NR: tiles per packed panel of V
    pairs: bool = False  # V in bf16 pairs of channels, for the GEMM on pairs
    batch: int = 1  # the most images a call takes: whole images, several a block where one has few tiles

    @property
    def depth(self) -> int:
        """The channels V holds: on pairs, rounded up to even (the last pair's second zeros)."""
        return self.channels + self.channels % 2 if self.pairs else self.channels

    @property
    def tile_rows(self) -> int:
        return -(-self.out_height // self.form.tile)

    @property
    def row_tiles(self) -> int:
        """Tiles per tile row, padded to whole vectors."""
        return -(-self.out_width // (self.form.tile * self.group)) * self.group

    @property
    def wanted_rows(self) -> int:
        """Tile rows a block wants: enough for V and M to fill _BLOCK_BYTES (_PAIRS_BLOCK_BYTES on
        pairs where a part takes several whole images), and enough that the
        transformed filters, read once a block, move no more bytes per tile than V and M do
        (K·C / P ≤ K + C for P tiles a block): 256 × 256 filters take 128 tiles a block."""
        per_row = 4 * self.form.points * (self.channels + self.filters) * self.row_tiles
        filter_tiles = self.channels * self.filters // (self.channels + self.filters)
        block_bytes = _PAIRS_BLOCK_BYTES if self.pairs and self.batch > 1 else _BLOCK_BYTES
        return max(-(-block_bytes // per_row), -(-filter_tiles // self.row_tiles))

    @property
    def block_rows(self) -> int:
        """Tile rows per block of one image: the wanted ones, at most the image's."""
        return max(1, min(self.tile_rows, self.wanted_rows))

    @property
    def block_images(self) -> int:
        """Images a block takes: one, or where a whole image has fewer tiles than a block
        wants, as many as make them up (at most `batch`), so the filters' U is read once for
        them all: ResNet-18's 512 × 512 filters (16 MB of U, for 16 tiles a 7 × 7 image)
        were read from memory for every image."""
        return max(1, min(self.batch, -(-self.wanted_rows // self.tile_rows)))

    @property
    def image_rows(self) -> int:
        """Tile rows a block holds: its images' rows."""
        return self.block_images * self.block_rows

    @property
    def block_tiles(self) -> int:
        return self.image_rows * self.row_tiles

    @property
    def v_floats(self) -> int:
        """Floats (or slots of a bf16 pair) from one point's V to the next: the block's tiles
        in whole panels, by all channels (`_staggered`)."""
        return _staggered(-(-self.block_tiles // self.panel) * self.panel * (self.depth // 2 if self.pairs else self.depth))

    @property
    def m_floats(self) -> int:
        """Floats from one point's M to the next: filters × the block's tiles in whole cache
        lines (`_staggered`)."""
        return _staggered(self.filters * _whole_lines(self.block_tiles))

    @property
    def product_columns(self) -> int:
        """The columns an image's products on pairs take: each block's tiles in whole vectors
        of 16."""
        rows = [min(self.block_rows, self.tile_rows - top) for top in range(0, self.tile_rows, self.block_rows)]
        return sum(_whole_lines(r * self.row_tiles) for r in rows)

    @property
    def patch_rows(self) -> int:
        """Input rows under a block's tiles."""
        return self.form.tile * self.block_rows + self.form.patch - self.form.tile

    @property
    def patch_width(self) -> int:
        """A row of input under a tile row, its padding included, and room for the
        transform's last loads (a tile's edge past the row's last tile)."""
        return self.form.tile * (self.row_tiles + 1)

    @property
    def image_patch_floats(self) -> int:
        """An image's input rows under a block."""
        return self.depth * self.patch_rows * self.patch_width

    @property
    def patch_floats(self) -> int:
        return self.block_images * self.image_patch_floats

    @property
    def workspace_bytes(self) -> int:
        """A part's scratch: V and M of every point, the block's input rows and output rows,
        and room to align V to a cache line."""
        tile = self.form.tile
        return 64 + 4 * (self.form.points * (self.v_floats + self.m_floats) + self.patch_floats
                         + self.filters * tile * self.image_rows * tile * self.row_tiles)


_LINE_FLOATS = 16  # floats in a cache line


def _whole_lines(floats: int) -> int:
    """`floats` rounded up to whole cache lines (of `_LINE_FLOATS`)."""
    return -(-floats // _LINE_FLOATS) * _LINE_FLOATS


_COPY_LANES = 16  # floats a move of the block's rows takes: an AVX-512 vector (two or four of the narrower targets')


def _staggered(floats: int) -> int:
    """`floats` rounded up to whole 4 KiB pages plus one cache line: the transforms touch
    the same place in every point (16 or 36) at once, and streams a multiple of 4 KiB apart
    would share one set of the L1 cache (8 ways) and evict each other."""
    return -(-floats // 1024) * 1024 + 16


def _form(op) -> Form:
    """The form whose tiles, padded to whole vectors of 4, take the fewest products, among
    those with enough tiles an image that their transformed filters, read once per image at
    least, move no more bytes per tile than V and M do (K·C / tiles ≤ K + C): F(4, 3) but on
    small images, whose tiles of 4 would mostly compute padding (a 7 × 7 output is 2 × 4 of
    them, 288 products a channel pair, where F(2, 3)'s 4 × 4 tiles take 256), and on ones
    with many channels, whose 36 points' filters would be read for few tiles (ResNet-18's
    256-channel 14 × 14 convolutions took 0.94-1.04 ms in F(4, 3), 0.78-0.85 in F(2, 3), at
    batch 1 on 2 cores of an Emerald Rapids Xeon; its 64-channel 56 × 56 ones 0.52-0.57
    against 0.77-0.80). The same on every target, as the filters prepared in it are."""
    filters, channels = op.inputs[1].shape[:2]
    height, width = op.outputs[0].shape[2:]

    def tiles(form: Form) -> int:
        return -(-height // form.tile) * -(-width // (4 * form.tile)) * 4

    usable = [form for form in FORMS if tiles(form) >= filters * channels // (filters + channels)] or [F2]
    return min(usable, key=lambda form: tiles(form) * form.points)


def _geometry(op, panel: int, pairs: bool = False) -> _Geometry:
    """`op`'s sizes, for the packed GEMM's panels of `panel` tiles (`pairs`: of bf16 pairs,
    in F(2, 3): `_on_pairs`)."""
    (_, channels, height, width), (filters, *_), (_, _, out_height, out_width) = (v.shape for v in (*op.inputs[:2], op.outputs[0]))
    pad_height, pad_width = attrs_of(op)["padding"]
    form = F2 if pairs else _form(op)
    # vectors of 8 tiles where they waste no more tiles on padding than vectors of 4 (28 tiles
    # a row are 7 vectors of 4, or 4 of 8 with 4 padding); SSE's panels of 12 hold 4s only
    tiles = -(-out_width // form.tile)
    group = 8 if panel % 8 == 0 and -(-tiles // 8) * 8 <= -(-tiles // 4) * 4 else 4
    images, threads = op.inputs[0].shape[0], _threads(op)
    batch = -(-images // threads) if images >= threads else 1
    geometry = _Geometry(form, channels, filters, height, width, pad_height, pad_width, out_height, out_width, group, panel,
                         pairs, batch)
    if pairs and panel % _LINE_FLOATS == 0:
        # the products on pairs run over a block's tiles in whole vectors of 16: the transforms
        # take vectors of 16 tiles where that adds no columns to them (ResNet-18's 28-tile rows
        # at batch 1: in vectors of 4, blocks of 3 rows, 84 tiles in 96 columns; of 16, blocks
        # of 2 rows of 32: 0.89-0.93 of the time)
        wide = replace(geometry, group=_LINE_FLOATS)
        if wide.product_columns <= geometry.product_columns:
            return wide
    return geometry


def _supported(op) -> bool:
    """A float32 3 × 3 convolution of stride 1, not so wide that its transformed filters
    come from memory for every block of a few images."""
    x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
    attrs = attrs_of(op)
    return (x.dtype == w.dtype == dtypes.DT_FLOAT32 and tuple(w.shape[2:]) == (3, 3) and tuple(attrs["strides"]) == (1, 1)
            and (w.shape[0] * w.shape[1] <= _MAX_PAIRS or x.shape[0] >= _MANY_IMAGES) and y.size > 0
            and math.prod(x.shape[1:]) < 1 << 31)


def _filter_bytes(op, form: Form) -> int:
    """The workspace's room for U in `form` made at run time: filters that change (a training
    step's, or an input gradient's turned filters), 64 bytes of it for alignment; none for
    constants."""
    w = op.inputs[1]
    return 0 if unchanging_constant(w) else 64 + 4 * form.points * w.shape[0] * w.shape[1]


_FILTER_UNIT = 8  # filters in a part's share: whole strips of the GEMM's tiles (MR is 4 or 8)


def _threads(op) -> int:
    """The worker-pool parts the convolution is worth."""
    flops = 2 * op.outputs[0].size * math.prod(op.inputs[1].shape[1:])
    return thread_count() if worth_splitting(flops, op.inputs[0].nbytes) else 1


def _parts(op, g: _Geometry) -> list[list[tuple[int, int, int, int, int, int]]]:
    """The calls per worker-pool part, each (first image, first tile row, last tile row,
    first filter, last filter, images): whole images shared out when there are at least as
    many as cores (a call's images one block, `_Geometry.block_images`), else each image's
    tile rows in even shares (whole blocks each made ResNet-18's 14 rows of F(4, 3) tiles 8
    and 6), or where it has fewer blocks than its share of the cores, its filters (each
    part then transforms the whole input, and reads only its filters' U)."""
    images, threads = op.inputs[0].shape[0], _threads(op)
    if images >= threads:
        return [[(i, 0, g.tile_rows, 0, g.filters, min(g.block_images, last - i)) for i in range(first, last, g.block_images)]
                for first, last in shares(images, threads)]
    per_image = max(1, threads // images)
    if -(-g.tile_rows // g.block_rows) >= per_image:
        return [[(i, first, last, 0, g.filters, 1)] for i in range(images)
                for first, last in shares(g.tile_rows, per_image)]
    return [[(i, 0, g.tile_rows, first, last, 1)] for i in range(images) for first, last in shares(g.filters, per_image, _FILTER_UNIT)]


def _workspace_bytes(op, pairs: bool = False) -> int:
    """U where it is made at run time, and the parts' scratch for any target's panel width
    (`pairs`: AVX-512's, the only one with the GEMM on pairs)."""
    geometries = [_geometry(op, _PAIRS_PANEL, pairs=True)] if pairs else [_geometry(op, panel) for panel in sgemm.PANEL_WIDTHS]
    return _filter_bytes(op, geometries[0].form) + max(len(_parts(op, g)) * g.workspace_bytes for g in geometries)


_PAIRS_PANEL = 48  # NR of the GEMM on bf16 pairs, AVX-512's


def _prepared(op) -> list[Prepared]:
    """Constant filters' U, made once with the network."""
    w, form = op.inputs[1], _form(op)
    return [Prepared(w, form.prepared, lambda value, target: transformed_filters(value, form))] if unchanging_constant(w) else []


def _paired_prepared(op) -> list[Prepared]:
    """Constant filters' U for the GEMM on pairs: rounded into bf16 pairs of channels once
    (`sgemm.paired_rows`, a row per point and filter), half the bytes of the float32 U it
    would round call by call (ResNet-18's 256-channel ones: 4 MB, from memory at batch 1).
    In F(2, 3), the only form on pairs (`_on_pairs`)."""
    w, form = op.inputs[1], F2
    if not unchanging_constant(w):
        return []
    return [Prepared(w, form.prepared_pairs,
                     lambda value, target: sgemm.paired_rows(transformed_filters(value, form).reshape(-1, w.shape[1])))]


def _transform_filters(ctx, op, form: Form, target) -> None:
    """U = G · w · Gᵀ of every filter and channel pair into `target(ctx)` ([points, K, C]),
    the filters shared out over the cores: a step's first job, before the tiles read it."""
    w = op.inputs[1]
    filters, channels = w.shape[:2]
    threads = thread_count() if worth_splitting(nbytes=form.points * 4 * filters * channels) else 1

    def part(first: int, last: int):
        def emit(ctx) -> None:
            u = target(ctx)
            with ctx.loop(first, last, name="filter_k") as k, ctx.loop(0, channels, name="filter_c") as c:
                taps = [[ctx.load(w, (k * channels + c) * 9 + 3 * a + column) for column in range(3)] for a in range(3)]
                for point, value in enumerate(v for row in _apply_both(form.filter, taps) for v in row):
                    ctx.b.store(value.ir, ctx.b.gep(u, [(k * channels + c + point * filters * channels).ir]))

        return emit

    run_parts(ctx, [part(first, last) for first, last in shares(filters, threads)])


_GEMM = ir.FunctionType(VOID, [I64] * 4 + [F32.as_pointer(), I64, F32.as_pointer(), F32.as_pointer(), I64])
# the first image, the first filter's U[0], its output plane, first and last tile row, filters, images, scratch,
# the packed GEMM
_TILES = ir.FunctionType(VOID, [F32.as_pointer(), F32.as_pointer(), F32.as_pointer(), I64, I64, I64, I64, BYTE_PTR,
                                _GEMM.as_pointer()])


def _on_pairs(op) -> bool:
    """A convolution marked for bf16 products: on pairs it takes F(2, 3) whichever form float32
    would take (`_geometry`). F(4, 3)'s transforms, whose coefficients reach 8, magnify bf16's
    rounding of U and V: a 64-channel 56 × 56 convolution erred by 6.7e-2 of its output's
    largest magnitude, where F(2, 3) on pairs erred by 4e-3 at 128 and 256 channels (rounding
    x and w to bf16 alone: 2.3e-3); F(3, 3) by 2e-2 (its points 0, ±1 and 2 or 1/2, in
    numpy). And F(2, 3) on pairs is the faster: ResNet-18's 64-channel 56 × 56 convolution
    took 0.87-0.91 of F(4, 3)'s time in float32 at batch 1, 0.90 at batch 32 (alone,
    alternated in one process; Zen 5, two cores, shared)."""
    return _supported(op) and attrs_of(op)["precision"] == "bfloat16"


def _pairs_faster(op) -> bool:
    """Whether its GEMM on V in bf16 pairs measured faster than the one on float32 V, on the
    largest call a part makes (a block's tiles, in whole vectors, by its filters)."""
    g = _geometry(op, _PAIRS_PANEL, pairs=True)
    filters = max(last - first for part in _parts(op, g) for _, _, _, first, last, _ in part)
    return packed_pairs_are_faster(filters, _whole_lines(g.block_tiles), g.channels)


@kernel(PAIRS_KERNEL, {"Conv2D", "Conv2DCalculate"}, supports=_on_pairs, rank=20, prefer=_pairs_faster,
        workspace=lambda op: _workspace_bytes(op, pairs=True), prepares=_paired_prepared,
        calls=frozenset({SGEMM_PACKED_DPBF16, SGEMM_PACKED_DPBF16_PAIRED}))
def winograd_conv_pairs(ctx, op) -> None:
    """WinogradConv with V in bf16 pairs of channels (each rounded to nearest even as the input
    transform stores it) and its products on `ranvier_sgemm_packed_dpbf16`, U rounded as the
    GEMM reads it (constant filters' U rounded once, `_paired_prepared`, and read by its
    `_paired` twin): float32 transforms and sums."""
    _winograd(ctx, op, pairs=True)


@kernel(WINOGRAD_KERNEL, {"Conv2D", "Conv2DCalculate"}, supports=_supported, rank=30, workspace=_workspace_bytes, prepares=_prepared,
        calls=frozenset({SGEMM_PACKED}))
def winograd_conv(ctx, op) -> None:
    _winograd(ctx, op, pairs=False)


def _winograd(ctx, op, pairs: bool) -> None:
    x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
    g = _geometry(op, sgemm.panel_width(ctx.target), pairs)
    made_here = _filter_bytes(op, g.form)
    paired = pairs and not made_here  # U in bf16 pairs, its rows `u_row` slots long
    u_row = sgemm.paired_row_slots(g.channels) if paired else g.channels
    tiles = _Emitter(ctx.module, g, u_row).tiles_function()
    image_size, out_size = math.prod(x.shape[1:]), math.prod(y.shape[1:])
    plane = g.out_height * g.out_width
    slot = (SGEMM_PACKED_DPBF16_PAIRED if paired else SGEMM_PACKED_DPBF16) if pairs else SGEMM_PACKED

    def transformed(ctx) -> ir.Value:
        """U: the constant's prepared form, or the workspace's start (aligned) where it is made."""
        if not made_here:
            return ctx.prepared(w, g.form.prepared_pairs if paired else g.form.prepared, F32)
        return cache_line_aligned(ctx.b, ctx.address(ctx.workspace), F32.as_pointer())

    if made_here:
        _transform_filters(ctx, op, g.form, transformed)

    def part(calls, number: int):
        def emit(ctx) -> None:
            b = ctx.b
            gemm = b.bitcast(ctx.table_entry(slot), _GEMM.as_pointer())
            filters = transformed(ctx)
            scratch = b.gep(ctx.address(ctx.workspace), [i64(made_here + number * g.workspace_bytes)])
            for first_image, first, last, first_filter, last_filter, images in calls:
                b.call(tiles, [ctx.element_pointer(x, first_image * image_size), b.gep(filters, [i64(first_filter * u_row)]),
                               ctx.element_pointer(y, first_image * out_size + first_filter * plane), i64(first), i64(last),
                               i64(last_filter - first_filter), i64(images), scratch, gemm])
                top, bottom = g.form.tile * first, min(g.form.tile * last, g.out_height)
                for image in range(first_image, first_image + images):
                    epilogue(ctx, op, image * out_size + first_filter * plane + top * g.out_width, last_filter - first_filter,
                             (bottom - top) * g.out_width)

        return emit

    run_parts(ctx, [part(calls, number) for number, calls in enumerate(_parts(op, g))])


def _apply(matrix: np.ndarray, values: list[Value]) -> list[Value]:
    """matrix · values, the values a column of vectors: each row a signed sum of them."""
    rows = []
    for row in matrix:
        terms = sorted(((c, v) for c, v in zip(row, values, strict=True) if c != 0), key=lambda t: t[0] < 0)
        first, total = terms[0]
        total = total if first == 1 else total * float(first)
        for coefficient, value in terms[1:]:
            total = total + value if coefficient == 1 else total - value if coefficient == -1 else total + value * float(coefficient)
        rows.append(total)
    return rows


def _apply_both(matrix: np.ndarray, square: list[list[Value]]) -> list[list[Value]]:
    """matrix · square · matrixᵀ, the square a list of rows."""
    columns = [_apply(matrix, [row[s] for row in square]) for s in range(len(square[0]))]  # columns[s][i]
    return [_apply(matrix, [column[i] for column in columns]) for i in range(matrix.shape[0])]


class _Emitter:
    """The function computing a call's images' output (`tiles_function`)."""

    def __init__(self, module: ir.Module, g: _Geometry, u_row: int):
        self.module, self.g, self.form = module, g, g.form
        self.u_row = u_row  # U's elements (or slots of bf16 pairs) from one filter's row to the next
        self.vector = ir.VectorType(F32, g.group)
        self.ints = ir.VectorType(I32, g.group)

    def tiles_function(self) -> ir.Function:
        """The function computing `images` images from the first's output over a range of
        tile rows (all of them where the images are more than one), a block at a time: a
        block is some of an image's tile rows or, `g.block_images` of them, whole images,
        their tiles one after the other in V and M."""
        g = self.g
        function = ir.Function(self.module, _TILES, name=self.module.get_unique_name("winograd_tiles"))
        function.linkage = "internal"
        image, filters, out, first_row, last_row, filter_count, images, scratch, gemm = function.args
        b = self.b = ir.IRBuilder(function.append_basic_block("entry"))
        # on pairs, a channel's transformed tiles wait here for the next channel's
        self.first_of_pair = b.alloca(self.vector, i64(self.form.points)) if g.pairs else None
        v = cache_line_aligned(b, scratch, F32.as_pointer())
        points = self.form.points
        m = b.gep(v, [i64(points * g.v_floats)])
        patches = b.gep(m, [i64(points * g.m_floats)])
        tiles_out = b.gep(patches, [i64(g.patch_floats)])
        image_floats, out_floats = g.channels * g.height * g.width, g.filters * g.out_height * g.out_width
        with for_range(b, i64(0), images, step=g.block_images, name="image_block") as first_image, \
                for_range(b, first_row, last_row, step=g.block_rows, name="block") as top:
            block_images = b.sub(images, first_image)
            block_images = b.select(b.icmp_signed("<", block_images, i64(g.block_images)), block_images, i64(g.block_images))
            rows = b.sub(last_row, top)
            rows = b.select(b.icmp_signed("<", rows, i64(g.block_rows)), rows, i64(g.block_rows))
            count = b.mul(b.mul(block_images, rows), i64(g.row_tiles))
            # M's rows start on cache lines, and the products run over whole vectors of tiles
            # (those past the block's computed from V's unwritten lanes, never read): 84 tiles
            # took a last panel of 36 through the GEMM's edge buffer; as 96, about 0.8 of the time
            stride = b.and_(b.add(count, i64(_LINE_FLOATS - 1)), i64(-_LINE_FLOATS))
            with for_range(b, i64(0), block_images, name="gather_image") as j:
                self.gather_rows(b.gep(image, [b.mul(b.add(first_image, j), i64(image_floats))]), top, rows,
                                 b.gep(patches, [b.mul(j, i64(g.image_patch_floats))]))
            with for_range(b, i64(0), block_images, name="tile_image") as j, for_range(b, i64(0), rows, name="tile_row") as row, \
                    for_range(b, i64(0), i64(g.row_tiles), step=g.group, name="tile") as column:
                index = b.add(b.mul(b.add(b.mul(j, rows), row), i64(g.row_tiles)), column)
                self.input_transform(b.gep(patches, [b.mul(j, i64(g.image_patch_floats))]), row, column, index, v)
            with for_range(b, i64(0), i64(points), name="point") as point:
                b.call(gemm, [i64(0), filter_count, stride, i64(g.channels), b.gep(filters, [b.mul(point, i64(g.filters * self.u_row))]),
                              i64(self.u_row), b.gep(v, [b.mul(point, i64(g.v_floats))]), b.gep(m, [b.mul(point, i64(g.m_floats))]),
                              stride])
            with for_range(b, i64(0), filter_count, name="filter") as k, \
                    for_range(b, i64(0), b.mul(block_images, rows), name="out_row") as row, \
                    for_range(b, i64(0), i64(g.row_tiles), step=g.group, name="out_tile") as column:
                at = b.add(b.mul(k, stride), b.add(b.mul(row, i64(g.row_tiles)), column))
                self.output_transform(m, at, tiles_out, k, row, column)
            with for_range(b, i64(0), block_images, name="scatter_image") as j:
                self.scatter_rows(b.gep(tiles_out, [b.mul(b.mul(j, rows), i64(g.form.tile * g.form.tile * g.row_tiles))]), top, rows,
                                  filter_count, b.gep(out, [b.mul(b.add(first_image, j), i64(out_floats))]))
        b.ret_void()
        return function

    # ---- moving rows between the image and the block's scratch ------------------------------

    def copy(self, source: ir.Value | None, target: ir.Value, count: int) -> None:
        """`count` floats from `source` (zeros if None) to `target`: whole vectors of
        `_COPY_LANES`, then the rest in halving vectors and single floats (a 56-float row of
        F(2, 3)'s vectors of 4 took 14 moves, now 4)."""
        b = self.b

        def move(at: ir.Value, lanes: int) -> None:
            kind = ir.VectorType(F32, lanes) if lanes > 1 else F32
            zero = ir.Constant(F32, 0.0)
            value = (ir.Constant(kind, [zero] * lanes) if lanes > 1 else zero) if source is None else \
                b.load(b.bitcast(b.gep(source, [at]), kind.as_pointer()), align=4)
            b.store(value, b.bitcast(b.gep(target, [at]), kind.as_pointer()), align=4)

        whole = count // _COPY_LANES * _COPY_LANES
        if whole:
            with for_range(b, i64(0), i64(whole), step=_COPY_LANES, name="copy") as at:
                move(at, _COPY_LANES)
        at, lanes = whole, _COPY_LANES
        while at < count:
            while lanes > count - at:
                lanes //= 2
            move(i64(at), lanes)
            at += lanes

    def gather_rows(self, image: ir.Value, top: ir.Value, rows: ir.Value, patches: ir.Value) -> None:
        """The input rows under the block's tiles, every channel, into `patches` with their
        padding as zeros (the image's column x at x + pad_width): the transform reads them
        without masks. On pairs, an odd channel count's last pair has a channel of zeros."""
        b, g, tile = self.b, self.g, self.form.tile
        with for_range(b, i64(0), i64(g.depth), name="gather_channel") as c, \
                for_range(b, i64(0), b.add(b.mul(rows, i64(tile)), i64(self.form.patch - tile)), name="gather_row") as r:
            y = b.add(b.sub(b.mul(top, i64(tile)), i64(g.pad_height)), r)
            target = b.gep(patches, [b.mul(b.add(b.mul(c, i64(g.patch_rows)), r), i64(g.patch_width))])
            inside_image = b.and_(b.icmp_unsigned("<", y, i64(g.height)), b.icmp_signed("<", c, i64(g.channels)))
            with b.if_else(inside_image) as (inside, outside):
                with inside:
                    self.copy(None, target, g.pad_width)
                    source = b.gep(image, [b.add(b.mul(c, i64(g.height * g.width)), b.mul(y, i64(g.width)))])
                    self.copy(source, b.gep(target, [i64(g.pad_width)]), g.width)
                    self.copy(None, b.gep(target, [i64(g.pad_width + g.width)]), g.patch_width - g.pad_width - g.width)
                with outside:
                    self.copy(None, target, g.patch_width)

    def scatter_rows(self, tiles_out: ir.Value, top: ir.Value, rows: ir.Value, filters: ir.Value, out: ir.Value) -> None:
        """The block's output rows of the call's filters, from `tiles_out` into the image's output
        (the tiles' columns and rows past its edge left out)."""
        b, g, tile = self.b, self.g, self.form.tile
        out_rows = b.mul(rows, i64(tile))
        left = b.sub(i64(g.out_height), b.mul(top, i64(tile)))  # the output's rows from the block's first
        out_rows = b.select(b.icmp_signed("<", left, out_rows), left, out_rows)
        with for_range(b, i64(0), filters, name="scatter_filter") as k, for_range(b, i64(0), out_rows, name="scatter_row") as r:
            source = b.gep(tiles_out, [b.mul(b.add(b.mul(k, i64(tile * g.image_rows)), r), i64(tile * g.row_tiles))])
            y = b.add(b.mul(top, i64(tile)), r)
            self.copy(source, b.gep(out, [b.add(b.mul(k, i64(g.out_height * g.out_width)), b.mul(y, i64(g.out_width)))]), g.out_width)

    # ---- the transforms ---------------------------------------------------------------------

    def pick(self, vectors: list[ir.Value], order: ir.Constant) -> ir.Value:
        """The lanes `order` names of vectors of equal lanes (a power of two of them) joined
        end to end."""
        b = self.b
        while len(vectors) > 1:
            lanes = 2 * vectors[0].type.count
            joined = ir.Constant(ir.VectorType(I32, lanes), list(range(lanes)))
            vectors = [b.shuffle_vector(vectors[i], vectors[i + 1], joined) for i in range(0, len(vectors), 2)]
        return b.shuffle_vector(vectors[0], ir.Constant(vectors[0].type, ir.Undefined), order)

    def input_transform(self, patches: ir.Value, row: ir.Value, tile: ir.Value, index: ir.Value, v: ir.Value) -> None:
        """V of the `group` tiles from `tile` in the block's tile row `row`, every channel,
        into the panels at tile `index` of the block; on pairs, two channels at a time, each
        point's two vectors rounded to bf16 and interleaved into a row of the panel's pairs."""
        b, g, form = self.b, self.g, self.form
        group, step = g.group, form.tile
        # A tile's patch column j lies `step` columns after the previous tile's: a row of
        # the group's patches is read as runs of step·group floats from column `base` (0,
        # then step), each split into its step phases, phase p the columns base + p
        bases = range(0, form.patch, step)
        phases = [ir.Constant(self.ints, [phase + step * e for e in range(group)]) for phase in range(step)]
        panel, lane = b.sdiv(index, i64(g.panel)), b.srem(index, i64(g.panel))
        target = b.add(b.mul(panel, i64(g.panel * (g.depth // 2 if g.pairs else g.depth))), lane)
        first = b.add(b.mul(b.mul(row, i64(step)), i64(g.patch_width)), b.mul(tile, i64(step)))

        def transformed(c: ir.Value) -> list[Value]:
            """Each point's V of channel c."""
            corner = b.gep(patches, [b.add(b.mul(c, i64(g.patch_rows * g.patch_width)), first)])
            patch = []
            for r in range(form.patch):
                columns = []
                for base in bases:
                    run = [b.load(b.bitcast(b.gep(corner, [i64(r * g.patch_width + base + i * group)]), self.vector.as_pointer()),
                                  align=4) for i in range(step)]
                    columns += [Value(b, self.pick(run, phases[phase]), dtypes.DT_FLOAT32)
                                for phase in range(min(step, form.patch - base))]
                patch.append(columns)
            return [value for row_ in _apply_both(form.input_t, patch) for value in row_]

        if not g.pairs:
            with for_range(b, i64(0), i64(g.channels), name="channel") as c:
                at = b.add(target, b.mul(c, i64(g.panel)))
                for point, value in enumerate(transformed(c)):
                    pointer = b.gep(v, [b.add(at, i64(point * g.v_floats))])
                    b.store(value.ir, b.bitcast(pointer, self.vector.as_pointer()), align=4)
            return
        slots = ir.VectorType(I32, group)
        with for_range(b, i64(0), i64(g.depth // 2), name="channel_pair") as c:
            for point, value in enumerate(transformed(b.mul(c, i64(2)))):
                b.store(value.ir, b.gep(self.first_of_pair, [i64(point)]))
            at = b.add(target, b.mul(c, i64(g.panel)))
            for point, value in enumerate(transformed(b.add(b.mul(c, i64(2)), i64(1)))):
                pairs = bf16_pairs(b, b.load(b.gep(self.first_of_pair, [i64(point)])), value.ir, interleave=True)
                pointer = b.gep(v, [b.add(at, i64(point * g.v_floats))])
                b.store(pairs, b.bitcast(pointer, slots.as_pointer()), align=4)

    def output_transform(self, m: ir.Value, at: ir.Value, tiles_out: ir.Value, k: ir.Value, row: ir.Value, tile: ir.Value) -> None:
        """The tile × tile outputs of filter k for the `group` tiles from `tile` in the block's
        tile row `row`, from their products at `at` of each point's M, into `tiles_out`."""
        b, g, form = self.b, self.g, self.form
        group, size, patch = g.group, form.tile, form.patch
        points = []
        for point in range(form.points):
            pointer = b.gep(m, [b.add(at, i64(point * g.m_floats))])
            points.append(Value(b, b.load(b.bitcast(pointer, self.vector.as_pointer()), align=4), dtypes.DT_FLOAT32))
        y = _apply_both(form.output_t, [points[r * patch : (r + 1) * patch] for r in range(patch)])
        # output row a of the group's tiles: tile e's column j (y[a][j]'s lane e) at size·e + j
        interleave = ir.Constant(ir.VectorType(I32, size * group), [(p % size) * group + p // size for p in range(size * group)])
        width = size * g.row_tiles
        corner = b.add(b.mul(b.add(b.mul(k, i64(size * g.image_rows)), b.mul(row, i64(size))), i64(width)), b.mul(tile, i64(size)))
        for a in range(size):
            value = self.pick([y[a][j].ir for j in range(size)], interleave)
            pointer = b.gep(tiles_out, [b.add(corner, i64(a * width))])
            b.store(value, b.bitcast(pointer, value.type.as_pointer()), align=4)
