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
and streams the reduced dimension `DEPTH` at a time through two shared tiles (A's 64
rows and B's 64 columns, each a row of `DEPTH` values padded by `PADDING` floats, so a
fragment's lanes fall on different banks); each warp packs its A fragments and each
8-column B fragment from them, then one mma per 16 of the depth. A tile's values come in
as 16-byte vector loads where the source's rows are a whole number of vectors (8 bfloat16
or 4 float32: then every vector is aligned, and wholly inside the product or wholly
outside), else one by one; values outside the product (past the depth, past a group's
rows) are zeros, read at a clamped index and selected away rather than branched around.

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
from typing import TYPE_CHECKING

from ... import dtypes
from ...flow.graph import Operation, Variable
from ...ops import attrs_of
from ..llvm.context import ir_of
from ..llvm.convert import widen
from ..llvm.irutil import storage_type, typed_pointer
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
COLUMNS = 64  # a block's columns of the product (B's columns)
DEPTH = 32  # the reduced dimension's values a pair of shared tiles holds
PADDING = 8  # floats after each row of a shared tile
VECTOR_BYTES = 16  # the widest global load, a vector of 8 bfloat16 or 4 float32
STRIDE = DEPTH + PADDING
THREADS = warps.WARP * WARPS
FLOAT = dtypes.DT_FLOAT32
OPS = ("GroupedMatMul", "GroupedMatMulWeightGrad")


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

def _lane(thread: Value) -> tuple[Value, Value, Value]:
    """A thread's warp, its lane's group g (the fragments' rows g and g + 8) and place q in it."""
    lane = thread % warps.WARP
    return thread // warps.WARP, lane // 4, lane % 4


class _Tiles:
    """A block's privates and shared tiles: A's `ROWS` rows and B's `COLUMNS` columns of
    `DEPTH` values each, and the thread's sums (`COLUMNS` / 8 C fragments)."""

    def __init__(self, program: BlockProgram):
        self.program = program
        self.a, self.b = program.shared(FLOAT, ROWS * STRIDE), program.shared(FLOAT, COLUMNS * STRIDE)
        self.a_words = program.private(dtypes.DT_INT32, DEPTH // 16 * 4)
        self.b_words = program.private(dtypes.DT_INT32, DEPTH // 16 * 2)
        self.sums = program.private(FLOAT, COLUMNS // 8 * 4)

    def zero(self) -> None:
        with self.program.phase(wait=False):
            for i in range(self.sums.count):
                self.sums.store(i, self.program.ctx.constant(FLOAT, 0.0))

    def fill(self, a: _Source, b: _Source) -> None:
        """One phase: the block's threads fill A's tile from `a` and B's from `b`, a vector
        of `lanes` values at a time, consecutive threads taking consecutive vectors of
        the source (coalesced reads)."""
        program, ctx = self.program, self.program.ctx
        with program.phase() as thread:
            for tile, rows, source in ((self.a, ROWS, a), (self.b, COLUMNS, b)):
                lanes = source.lanes
                with ctx.loop(thread, rows * DEPTH // lanes, step=program.threads, name="v") as v:
                    if source.along_depth:
                        row, depth = v // (DEPTH // lanes), v % (DEPTH // lanes) * lanes
                    else:
                        row, depth = v % (rows // lanes) * lanes, v // (rows // lanes)
                    at, inside = source.place(row, depth, lanes)
                    values = inside.where(_load(ctx, source.var, at, lanes).cast(FLOAT), 0.0)
                    for lane in range(lanes):
                        place = row * STRIDE + depth + lane if source.along_depth else (row + lane) * STRIDE + depth
                        tile.store(place, values.lane(lane) if lanes > 1 else values)

    def multiply(self) -> None:
        """sums += A · Bᵀ over the tiles' depth: each warp packs its 16 rows of A, then per
        8 columns of B their fragment and one product per 16 of the depth."""
        program = self.program
        with program.phase(wait=False) as thread:
            warp, group, place = _lane(thread)
            for chunk in range(DEPTH // 16):
                for word in range(4):  # rows g, g + 8, g, g + 8; depth 2q, 2q, 2q + 8, 2q + 8 (and one more each)
                    at = (warp * 16 + group + 8 * (word % 2)) * STRIDE + chunk * 16 + place * 2 + 8 * (word // 2)
                    self.a_words.store(chunk * 4 + word, warps.pack(program, self.a.load(at + 1), self.a.load(at)))
        for j in range(COLUMNS // 8):
            with program.phase(wait=False) as thread:
                _, group, place = _lane(thread)
                for chunk in range(DEPTH // 16):
                    for word in range(2):  # column g; depth 2q (and 2q + 1), 2q + 8 (and 2q + 9)
                        at = (j * 8 + group) * STRIDE + chunk * 16 + place * 2 + 8 * word
                        self.b_words.store(chunk * 2 + word, warps.pack(program, self.b.load(at + 1), self.b.load(at)))
            for chunk in range(DEPTH // 16):
                warps.mma(program, (self.sums, j * 4), (self.a_words, chunk * 4), (self.b_words, chunk * 2), (self.sums, j * 4))
        with program.phase():  # every warp done with the tiles before the next fill
            pass

    def store(self, first_row: Value, rows: Value, first_column: Value, columns: int,
              write: Callable[[Value, Value, Value], None]) -> None:
        """`write(row, column, sum)` for each of the block's sums inside `rows` rows from
        `first_row` and `columns` columns (a phase)."""
        program, ctx = self.program, self.program.ctx
        with program.phase(wait=False) as thread:
            warp, group, place = _lane(thread)
            for j in range(COLUMNS // 8):
                for i in range(4):  # C[g + 8·(i // 2)][2q + i % 2] of the 8 columns
                    row = warp * 16 + group + 8 * (i // 2)
                    column = first_column + j * 8 + place * 2 + i % 2
                    with ctx.when((row < rows) & (column < columns)):
                        write(first_row + row, column, self.sums.load(j * 4 + i))


@dataclass(frozen=True)
class _Source:
    """Where a shared tile's values come from: `var`, whose next element in memory is the
    tile's next along the depth (`along_depth`) or else its next row, in rows of `width`
    elements; `place(tile row, depth, lanes)` gives the element offset of the vector of
    `lanes` values from there (clamped inside `var`) and whether they are inside the
    product (else zeros)."""

    var: Variable
    along_depth: bool
    width: int
    place: Callable[[Value, Value, int], tuple[Value, Value]]

    @property
    def lanes(self) -> int:
        """Values a thread loads as one 16-byte vector (8 bfloat16 or 4 float32) where the
        rows' width allows it (every vector aligned: tiles start at multiples of 8), else 1."""
        lanes = VECTOR_BYTES // dtypes.itemsize(self.var.dtype)
        return lanes if self.width % lanes == 0 else 1


def _load(ctx: ThreadContext, var: Variable, at: Value, lanes: int) -> Value:
    """`lanes` elements of `var` from element `at`, a multiple of the lanes: one aligned
    vector load (`ld.global.v4`)."""
    if lanes == 1:
        return ctx.load(var, at)
    b = ctx.b
    pointer = typed_pointer(b, ctx.pointer(var), ir_of(at), storage_type(var.dtype), lanes)
    raw = b.load(pointer, align=VECTOR_BYTES)
    return Value(b, widen(b, raw, var.dtype, lanes), var.dtype)


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
    tiles = _Tiles(program)
    tiles.zero()
    matrix = group.minimum(experts - 1) * (k * n)
    # an expert's group multiplies; the rows past the last group (and no tile) do not
    with ctx.loop(0, ((group >= 0) & (group < experts)).where(ctx.index(_tiles(k, DEPTH)), 0), name="depth") as step:
        depth = step * DEPTH

        def row_place(row: Value, p: Value, lanes: int) -> tuple[Value, Value]:
            return (first + row).minimum(stop - 1) * k + (depth + p).minimum(k - lanes), depth + p < k

        def weight_place(column: Value, p: Value, lanes: int) -> tuple[Value, Value]:
            if transposed:  # w[e] is [n, k]: the depth runs along its rows
                return matrix + (first_column + column).minimum(n - 1) * k + (depth + p).minimum(k - lanes), depth + p < k
            return matrix + (depth + p).minimum(k - 1) * n + (first_column + column).minimum(n - lanes), depth + p < k

        tiles.fill(_Source(x, True, k, row_place), _Source(w, transposed, k if transposed else n, weight_place))
        tiles.multiply()
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
    tiles = _Tiles(program)
    tiles.zero()
    with ctx.loop(0, good.where((stop - start + (DEPTH - 1)) // DEPTH, 0), name="depth") as step:
        r = start + step * DEPTH

        def source(var: Variable, first: Value, width: int) -> _Source:
            def place(i: Value, d: Value, lanes: int) -> tuple[Value, Value]:
                return (r + d).minimum(stop - 1) * width + (first + i).minimum(width - lanes), r + d < stop

            return _Source(var, False, width, place)

        tiles.fill(source(left, first_row, p), source(right, first_column, q))
        tiles.multiply()
    tiles.store(first_row, ctx.index(p) - first_row, first_column, q,
                lambda i, j, total: ctx.store(dw, (e * p + i) * q + j, total))


LIBRARY.register(Generator("GroupedProductMMA", frozenset(OPS), launches, supports=supports, rank=85))
