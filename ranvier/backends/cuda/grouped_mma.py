"""A mixture-of-experts layer's grouped products on tensor cores: GroupedMatMul
(y[r, :] = x[r, :] · w[e(r)], rows grouped by expert) and GroupedMatMulWeightGrad
(dw[e] = x_eᵀ · dy_e over group e's rows), for bfloat16 operands
(`Compiler(precision="bfloat16")`'s activations) or float32 operands of a compile whose
matrix products run in bfloat16 (`Compiler(matmul="bfloat16")` marks the ops' precision).
Every product is a warp's `warps.mma` (bfloat16 inputs, float32 sums); other dtypes take
the element-per-thread kernel (`experts.py`).

Why not cuBLASLt's grouped products: the groups' sizes are the routing sort's output
(MoERoute's offsets), which lives on the device. A host-side grouped GEMM needs each
group's size to plan its launches, so the host would read the offsets back every step:
a copy and a wait in the middle of the step, which breaks the step's captured CUDA graph
and the rule that a step moves nothing between host and device (issue 52). So a block
here reads the offsets itself and finds its own tile.

Both kernels multiply tiles the same way (`_Tiles`): a block of `WARPS` warps holds a
64 × 64 tile of float32 sums, 16 rows a warp (the rows of an mma's A) as C fragments,
and streams the reduced dimension `DEPTH` at a time through shared tiles of bfloat16,
two buffers each (`warps.pipelined`: tile i + 1's copies run under tile i's products,
one barrier a tile). Each tile lies as its source does (`_Source`), so a thread copies
8 values contiguous in memory at a time: its lines are A's rows (or B's columns) each
`DEPTH` long where the source runs along the depth (x, a transposed w), else the
depth's lines each 64 long (w, and the weight gradient's x and dy), padded by 16 bytes
so the 8 lines an ldmatrix reads fall on different banks. Fragments come by
`warps.load_matrices` (ldmatrix), transposed where the tile's lines run across the
depth (an untransposed w; the weight gradient's x and dy): A's per 16 of the depth, B's per 8
columns, then one mma per 16 of the depth. A bfloat16 source whose lines are whole
16-byte chunks is copied by cp.async (every chunk aligned, wholly inside the depth or
wholly past it: those past it are copies of zeros, cp.async's source size 0); a float32
source is loaded as 16-byte vectors where its lines are whole vectors, rounded to
bfloat16 by the threads, and any other one value by value. Values past the depth (the
product's k, a group's rows in the weight gradient) are zeros on both sides; values
past the product's rows or columns (a group's last rows, w's last columns) are read at
a clamped index and feed only sums that are never written.

GroupedMatMul: a block per (tile of 64 rows within one group, tile of 64 output columns).
Tiles never straddle groups: a block walks the group offsets, counting each group's
tiles, to find its group and first row; rows past the group's end are read clamped and
never written. The rows past the last group (dropped at capacity) are one more group
whose tiles write zeros. Blocks number at most ⌈rows / 64⌉ + experts per column tile
(each group adds at most one part-filled tile); those past the last tile do nothing.
GroupedMatMulWeightGrad: a block per (expert, 64 × 64 tile of dw[e]), streaming the
expert's rows; an expert no row chose gets zeros. Bad offsets set the status word (as
`routing.group_bounds` says) and leave their group out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ..llvm.context import Array
from ..llvm.routing import group_bounds
from ..llvm.values import Value, index_value
from . import warps
from .blocks import BlockProgram
from .library import LIBRARY, Generator

if TYPE_CHECKING:
    from llvmlite import ir

    from .kernels import ThreadContext  # what a kernel's element is written in (it imports this)

WARPS = 4
ROWS = 16 * WARPS  # a block's rows of the product (A's rows, 16 a warp)
COLUMNS = 64  # a block's columns of the product (B's columns); a tile's lines across the depth
DEPTH = 32  # the reduced dimension's values a streamed tile holds
PADDING = 8  # bfloat16 (16 bytes) after each line of a shared tile, so the 8 lines an ldmatrix reads fall on different banks
CHUNK = warps.CHUNK  # bfloat16 a thread moves into a tile at a time (`warps.copy_chunk`)
THREADS = warps.WARP * WARPS
FLOAT = dtypes.DT_FLOAT32
OPS = ("GroupedMatMul", "GroupedMatMulWeightGrad")
assert ROWS == COLUMNS  # a tile's shape depends only on how its source lies (`_Source`)


def supports(op: Operation) -> bool:
    """Bfloat16 operands, or float32 ones whose products may round to bfloat16 (the op's
    precision); any shape and any group offsets."""
    if op.type not in OPS:
        return False
    operands = {v.dtype for v in (*op.inputs[:2], *op.outputs)}
    rounded = attrs_of(op)["precision"] == "bfloat16" and operands == {FLOAT}
    return rounded or operands == {dtypes.DT_BFLOAT16}


def _tiles(size: int, tile: int) -> int:
    return -(-size // tile)


def launches(op: Operation) -> list[tuple[int, Callable[[ThreadContext, ir.Value], None], int]]:
    if op.type == "GroupedMatMul":
        x, w, _ = op.inputs
        blocks = (_tiles(x.shape[0], ROWS) + w.shape[0]) * _tiles(op.outputs[0].shape[1], COLUMNS)
        kernel = _product
    else:
        experts, p, q = op.outputs[0].shape
        blocks = experts * _tiles(p, ROWS) * _tiles(q, COLUMNS)
        kernel = _weight_gradient

    def block(ctx: ThreadContext, index: ir.Value) -> None:
        kernel(BlockProgram(ctx, THREADS, ctx.on_gpu), op, index_value(ctx.b, index))

    return [(blocks, block, THREADS)]


# ---- a block's 64 × 64 product ----------------------------------------------------------

class _Tiles:
    """A block's 64 × 64 float32 sums (`COLUMNS` / 8 C fragments a thread) of A · B over
    the depth, A and B streamed `DEPTH` at a time through double-buffered shared tiles of
    bfloat16, each tile laid out as its source lies (`_Source`): A's fragments come by
    ldmatrix (.trans where the tile holds A's columns as lines), B's likewise."""

    def __init__(self, program: BlockProgram, a: _Source, b: _Source):
        self.program, self.sources = program, (a, b)
        self.tiles = [program.shared(dtypes.DT_INT32, 2 * source.words) for source in self.sources]  # two buffers each
        self.a_words = program.private(dtypes.DT_INT32, DEPTH // 16 * 4)
        self.b_words = program.private(dtypes.DT_INT32, DEPTH // 16 * 2)
        self.sums = program.private(FLOAT, COLUMNS // 8 * 4)
        with program.phase(wait=False):
            for i in range(self.sums.count):
                self.sums.store(i, program.ctx.constant(FLOAT, 0.0))

    def stream(self, count: Value) -> None:
        """sums += A · B over `count` tiles of the depth, tile i + 1's copies made while
        tile i's products run (`warps.pipelined`)."""
        copies = sum(source.copies_per_thread for source in self.sources if source.copied)
        warps.pipelined(self.program, count, max(copies, 1), self.fill, self.multiply)

    def fill(self, step: Value, buffer: Value, copies: warps.AsyncCopies) -> None:
        """The running thread's share of tile `step` of A and B into `buffer`: chunks of 8
        values along a line, consecutive threads taking consecutive chunks of the source
        (coalesced reads). A source read as 16-byte vectors has its chunks unrolled, so
        that all their loads are in flight at once; the others' are a loop (cp.async's
        copies run on their own, and a value-by-value chunk's loads are many already),
        whose addresses LLVM then keeps in no registers across the products."""
        program, ctx = self.program, self.program.ctx
        for source, tile in zip(self.sources, self.tiles):
            pieces = source.lines * source.length // CHUNK
            if source.copied or source.lanes == 1:
                with ctx.loop(program.thread, pieces, step=program.threads, name="piece") as piece:
                    self._chunk(source, tile, piece, step, buffer, copies)
            else:
                for first in range(0, pieces, program.threads):
                    self._chunk(source, tile, program.thread + first, step, buffer, copies)

    def _chunk(self, source: _Source, tile: Array, piece: Value, step: Value, buffer: Value, copies: warps.AsyncCopies) -> None:
        """Chunk `piece` of `source`'s tile `step` into `buffer` (`warps.copy_chunk`: by
        cp.async where the source is copied, zeros where the chunk is past the depth; else
        loaded `lanes` values at a time, rounded to bfloat16 and stored by the thread)."""
        line, position, word = source.chunk(piece, buffer)
        warps.copy_chunk(self.program, copies, tile, word, source.var,
                         lambda first, lanes: source.at(step, line, position + first, lanes), source.lanes)

    def multiply(self, step: Value, buffer: Value) -> None:
        """sums += A · B over the buffer's tiles: each warp's A fragments of its 16 rows (one
        ldmatrix a 16 of the depth), then per 8 columns their B fragments over the depth
        (one ldmatrix) and one product per 16 of the depth."""
        program = self.program
        (a, b), (a_tile, b_tile) = self.sources, self.tiles

        def a_row(thread: Value) -> Value:  # matrix i: A's rows 8·(i mod 2) on, depth 8·(i // 2) on, of the warp's 16
            lane = thread % warps.WARP
            word: Value = buffer * a.words + a.word(thread // warps.WARP * 16 + lane // 8 % 2 * 8, lane // 16 * 8, lane % 8)
            return word

        def b_row(thread: Value) -> Value:  # matrix i: depth 8·i on, of the first 8 columns
            lane = thread % warps.WARP
            word: Value = buffer * b.words + b.word(0, lane // 8 * 8, lane % 8)
            return word

        for chunk in range(DEPTH // 16):  # the immediate offsets: 16 of the depth (A), 8 columns (B)
            warps.load_matrices(program, (self.a_words, chunk * 4), a_tile, a_row, transpose=not a.along_depth,
                                offset=a.word(0, chunk * 16))
        for j in range(COLUMNS // 8):
            warps.load_matrices(program, (self.b_words, 0), b_tile, b_row, transpose=not b.along_depth,
                                offset=b.word(j * 8, 0))
            for chunk in range(DEPTH // 16):
                warps.mma(program, (self.sums, j * 4), (self.a_words, chunk * 4), (self.b_words, chunk * 2), (self.sums, j * 4))

    def store(self, first_row: Value, rows: Value, first_column: Value, columns: int,
              write: Callable[[Value, Value, Value], None]) -> None:
        """`write(row, column, sum)` for each of the block's sums inside `rows` rows from
        `first_row` and `columns` columns (a phase)."""
        program, ctx = self.program, self.program.ctx
        with program.phase(wait=False) as thread:
            warp, group, place = warps.lane_of(thread)
            for j in range(COLUMNS // 8):
                for i in range(4):  # C[g + 8·(i // 2)][2q + i % 2] of the 8 columns
                    row = warp * 16 + group + 8 * (i // 2)
                    column = first_column + j * 8 + place * 2 + i % 2
                    with ctx.when((row < rows) & (column < columns)):
                        write(first_row + row, column, self.sums.load(j * 4 + i))


@dataclass(frozen=True)
class _Source:
    """Where a shared tile's values come from: `var`, whose next element in memory is the
    tile's next along the depth (`along_depth`: the tile's lines are the product's 64
    rows or columns, each `DEPTH` long) or else its next row or column (the lines are the
    depth's, each 64 long), in lines of `width` elements; `place(step, index, depth,
    lanes)` gives the element offset of the vector of `lanes` values at (row or column
    `index`, `depth`) of tile `step`, clamped inside `var`, and whether they are inside
    the product's depth (else zeros). Values past the product's rows or columns are read
    clamped: they reach only sums never written."""

    var: Variable
    along_depth: bool
    width: int
    place: Callable[[Value, Value, Value, int], tuple[Value, Value]]

    @property
    def lines(self) -> int:
        return ROWS if self.along_depth else DEPTH

    @property
    def length(self) -> int:
        return DEPTH if self.along_depth else ROWS

    @property
    def stride(self) -> int:
        """32-bit words from one line of the tile to the next: `length` bfloat16 and the padding."""
        return (self.length + PADDING) // 2

    @property
    def words(self) -> int:
        return self.lines * self.stride

    @overload
    def word(self, index: int, depth: int, lines_on: int = 0) -> int: ...

    @overload
    def word(self, index: Value | int, depth: Value | int, lines_on: Value | int = 0) -> Value | int: ...

    def word(self, index: Value | int, depth: Value | int, lines_on: Value | int = 0) -> Value | int:
        """The tile's word of its row or column `index` at `depth` (even), `lines_on` lines on."""
        line, place = (index, depth) if self.along_depth else (depth, index)
        word: Value | int = (line + lines_on) * self.stride + place // 2
        return word

    def chunk(self, piece: Value, buffer: Value) -> tuple[Value, Value, Value]:
        """Chunk `piece` of the tile (8 values of a line, in order): its line, the place of
        its first value along the line, and its first word in `buffer`."""
        chunks = self.length // CHUNK
        line, position = piece // chunks, piece % chunks * CHUNK
        word: Value = buffer * self.words + line * self.stride + position // 2
        return line, position, word

    def at(self, step: Value, line: Value, position: Value, lanes: int) -> tuple[Value, Value]:
        """`place` of the vector of `lanes` values from `position` along tile line `line`."""
        return self.place(step, line, position, lanes) if self.along_depth else self.place(step, position, line, lanes)

    @property
    def copied(self) -> bool:
        """Copied by cp.async (`warps.copy_chunk`): bfloat16 lines a whole number of 16-byte
        chunks (every chunk aligned, and wholly inside the product's depth or wholly outside)."""
        return self.var.dtype == dtypes.DT_BFLOAT16 and self.lanes == CHUNK

    @property
    def copies_per_thread(self) -> int:
        return -(-self.lines * self.length // CHUNK // THREADS)

    @property
    def lanes(self) -> int:
        """Values a thread loads as one 16-byte vector (8 bfloat16 or 4 float32) where the
        lines' width allows it (every vector aligned: tiles start at multiples of 8), else 1."""
        lanes = warps.vector_lanes(self.var.dtype)
        return lanes if self.width % lanes == 0 else 1


# ---- the kernels ------------------------------------------------------------------------

def _find_tile(ctx: ThreadContext, offsets: Variable, experts: int, rows: int, tile: Value) -> tuple[Value, Value, Value]:
    """(group, first row, stop) of the block's row tile `tile`, counting each group's tiles
    in order: group `experts` is the rows past the last group; −1 past the last tile."""
    group, first, stop = (ctx.local(dtypes.DT_INT64, initial=initial) for initial in (-1, 0, 0))
    seen = ctx.local(dtypes.DT_INT64, initial=0)

    def count(e: Value, start: Value, end: Value, good: Value) -> None:
        tiles = good.where((end - start + (ROWS - 1)) // ROWS, 0)
        with ctx.when((seen.value <= tile) & (tile < seen.value + tiles)):
            group.set(e)
            first.set(start + (tile - seen.value) * ROWS)
            stop.set(end)
        seen.set(seen.value + tiles)

    with ctx.loop(0, experts, name="e") as e:
        count(e, *group_bounds(ctx, offsets, e, rows))
    last = ctx.load(offsets, experts).cast(dtypes.DT_INT64)
    count(ctx.index(experts), last, ctx.index(rows), (last >= 0) & (last <= rows))
    return group.value, first.value, stop.value


def _product(program: BlockProgram, op: Operation, index: Value) -> None:
    """GroupedMatMul: the block's tile of rows of one group by its tile of columns."""
    ctx = program.ctx
    x, w, offsets = op.inputs
    y = op.outputs[0]
    transposed = attrs_of(op)["transpose_b"]
    rows, k = x.shape
    experts, n = w.shape[0], y.shape[1]
    column_tiles = _tiles(n, COLUMNS)
    group, first, stop = _find_tile(ctx, offsets, experts, rows, index // column_tiles)
    first_column = index % column_tiles * COLUMNS
    matrix = group.minimum(experts - 1) * (k * n)

    def row_place(step: Value, row: Value, p: Value, lanes: int) -> tuple[Value, Value]:
        depth = step * DEPTH + p
        return (first + row).minimum(stop - 1) * k + depth.minimum(k - lanes), depth < k

    def weight_place(step: Value, column: Value, p: Value, lanes: int) -> tuple[Value, Value]:
        depth = step * DEPTH + p
        if transposed:  # w[e] is [n, k]: the depth runs along its rows
            return matrix + (first_column + column).minimum(n - 1) * k + depth.minimum(k - lanes), depth < k
        return matrix + depth.minimum(k - 1) * n + (first_column + column).minimum(n - lanes), depth < k

    tiles = _Tiles(program, _Source(x, True, k, row_place), _Source(w, transposed, k if transposed else n, weight_place))
    # an expert's group multiplies; the rows past the last group (and no tile) do not
    tiles.stream(((group >= 0) & (group < experts)).where(ctx.index(_tiles(k, DEPTH)), 0))
    with ctx.when(group >= 0):
        tiles.store(first, stop - first, first_column, n, lambda r, j, total: ctx.store(y, r * n + j, total))


def _weight_gradient(program: BlockProgram, op: Operation, index: Value) -> None:
    """GroupedMatMulWeightGrad: the block's 64 × 64 tile of one expert's dw (dwᵀ where
    transposed: then dy's columns are the tile's rows and x's its columns)."""
    ctx = program.ctx
    x, dy, offsets = op.inputs
    dw = op.outputs[0]
    _, p, q = dw.shape
    left, right = (dy, x) if attrs_of(op)["transpose"] else (x, dy)  # [rows, p] and [rows, q]
    row_tiles, column_tiles = _tiles(p, ROWS), _tiles(q, COLUMNS)
    e, within = index // (row_tiles * column_tiles), index % (row_tiles * column_tiles)
    first_row, first_column = within // column_tiles * ROWS, within % column_tiles * COLUMNS
    start, stop, good = group_bounds(ctx, offsets, e, x.shape[0])

    def source(var: Variable, first: Value, width: int) -> _Source:
        def place(step: Value, i: Value, d: Value, lanes: int) -> tuple[Value, Value]:
            r = start + step * DEPTH + d
            return r.minimum(stop - 1) * width + (first + i).minimum(width - lanes), r < stop

        return _Source(var, False, width, place)

    tiles = _Tiles(program, source(left, first_row, p), source(right, first_column, q))
    tiles.stream(good.where((stop - start + (DEPTH - 1)) // DEPTH, 0))
    tiles.store(first_row, ctx.index(p) - first_row, first_column, q,
                lambda i, j, total: ctx.store(dw, (e * p + i) * q + j, total))


LIBRARY.register(Generator("GroupedProductMMA", frozenset(OPS), launches, supports=supports, rank=85))
