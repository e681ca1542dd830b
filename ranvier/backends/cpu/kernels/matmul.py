"""MatMul: float32 through ranvier's generated GEMM (sgemm.py) where it measured faster
for the shape, else, and float64, through the vendor BLAS (OpenBLAS, via SciPy), called
directly from generated code; a float32 row times a matrix (a decode step's) by streaming
the matrix in place (`Gemv`); one with a side of a few columns or steps of k (a
classifier's, and its gradients) with an accumulator per column (`ThinGemm`); float32 in
mixed precision through the AMX bf16 GEMM, or where the CPU has AVX512-BF16 and no AMX
tiles through the generated GEMM on bf16 pairs where it measured faster (`GemmDpbf16`,
`PackedGemmDpbf16` on a constant's pairs packed once); a row times a constant in bf16 on
AVX512-BF16's dot products of pairs (`Bf16Gemv`); a product by a constant in int8 (q8_0
blocks, `Q8Gemm`);
other dtypes through a generated triple loop.

Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so BLAS is called with
the operands swapped. Batch dimensions (broadcast as numpy does) loop around the call.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from dataclasses import dataclass

from llvmlite import ir

from .... import dtypes
from ....flow.graph import Variable
from ....ops import attrs_of, unchanging_constant
from ...kernels import Prepared
from ...llvm.irutil import F32, F64, I8, I16, I32, I64, VOID, i64, storage_type
from ...llvm.loops import fold_lanes, for_vectors
from ...llvm.rows import Row, row_dot
from ...llvm.strided import contiguous_strides
from ...llvm.values import Value
from .. import bf16gemv, q8gemm, sgemm
from ..amx import workspace_bytes
from ..codegen import (
    BF16GEMM,
    BLAS_THREADS,
    DGEMM,
    DGEMV,
    DPBF16GEMV,
    Q8GEMM,
    SGEMM,
    SGEMM_DPBF16,
    SGEMM_GENERATED,
    SGEMM_PACKED,
    SGEMM_PACKED_BF16,
    SGEMM_PACKED_DPBF16,
    SGEMV,
)
from ..gemm_choice import generated_is_faster, pairs_are_faster
from ..parallel import each_part, run_parts, share_out, shares, thread_count, worth_splitting
from ..target import host_target
from .library import kernel
from .program import FUSED_PRODUCTS, epilogue


def _batch_offsets(batch, a_batch, b_batch):
    """Per-batch-element offsets (in matrices) of A and B under numpy broadcasting."""
    def strides_for(shape):
        shape = [1] * (len(batch) - len(shape)) + list(shape)
        own = contiguous_strides(shape)
        return [0 if d == 1 else s for d, s in zip(shape, own)]

    sa, sb = strides_for(a_batch), strides_for(b_batch)
    result = []
    for index in itertools.product(*[range(d) for d in batch]):
        result.append((sum(i * s for i, s in zip(index, sa)), sum(i * s for i, s in zip(index, sb))))
    return result or [(0, 0)]


def single_threaded_blas(ctx) -> None:
    """Keep BLAS on the calling thread: parallel GEMMs are split over the worker pool."""
    b = ctx.b
    setter = b.bitcast(ctx.table_entry(BLAS_THREADS), ir.FunctionType(VOID, [I32]).as_pointer())
    b.call(setter, [ir.Constant(I32, 1)])


def _dims(op):
    a, b = op.inputs[:2]
    attrs = attrs_of(op)
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if tb else b.shape[-1]
    return ta, tb, m, k, n


def _gemms(op) -> tuple[bool, bool, int, int, int, list[tuple[int, int]]]:
    """(ta, tb, m, k, n, per-GEMM matrix offsets of A and B). A batch of row blocks times
    one shared matrix (x[B, T, K] @ W) is a single GEMM over all B·T rows."""
    a, b, c = op.inputs[0], op.inputs[1], op.outputs[0]
    ta, tb, m, k, n = _dims(op)
    if b.rank == 2 and not ta and a.rank > 2:
        return ta, tb, a.size // k, k, n, [(0, 0)]
    return ta, tb, m, k, n, _batch_offsets(c.shape[:-2], a.shape[:-2], b.shape[:-2])


AMX_KERNEL = "AmxGemm"
# Every GEMM kernel also runs a MatMul fused with the Calculate after it: the program runs
# over each block of the product right after the call that wrote it (`epilogue`).
MATMUL_OPS = {"MatMul", "MatMulCalculate"}


def _bfloat16_precision(op) -> bool:
    return attrs_of(op)["precision"] == "bfloat16"


@dataclass(frozen=True)
class _Gemm:
    """One GEMM call: its sizes, where its A, B and C start (elements), and the first
    column of op(B) it reads (where its panels start when B comes packed)."""

    m: int
    n: int
    k: int
    a: int
    b: int
    c: int
    column: int = 0
    slice: int = 0  # of k: slice 0 writes C, slice s > 0 partial product s (`_run_calls`)


_PACKING_WEIGHT = 8  # a row of A read or a column of B packed costs about this many multiply-adds
# An element that one core wrote and another reads costs about this many multiply-adds: its
# cache line crosses from one core's cache to the other's. Only while what a core wrote is
# still in its cache: past this many bytes it comes from memory wherever it was written.
_CROSSING_WEIGHT = 16
_CACHED_BYTES = 1 << 20  # of a core's L2: 512 KiB on the AVX2 EPYCs, 2 MiB on the Xeons


def _crossing(elements: int, others: int, shares: int) -> int:
    """The cost of reading `elements` float32 values of which `others` in `shares` were
    written on other cores."""
    return _CROSSING_WEIGHT * elements * others // shares if 4 * elements <= _CACHED_BYTES else 0


def _block_cost(rows: int, columns: int, depth: int) -> int:
    """A block of C over `depth` steps of k, in multiply-adds: its rows times its columns
    rounded up to whole panels of the generated GEMM (48 columns with AVX-512; a narrow
    last panel runs a narrower tile, measured at half to two thirds of a whole one's
    time, so this errs against ragged blocks), plus the packing of its rows of A and
    columns of B."""
    panel = sgemm.panel_width(host_target())
    return depth * (rows * -(-columns // panel) * panel + _PACKING_WEIGHT * (rows + columns))


def _grid_block_cost(rows: int, columns: int, depth: int, column_blocks: int) -> int:
    """`_block_cost`, plus the block's elements of C that the ops after the product read on
    other cores: those (an activation, a reduction, the optimizer's update of a weight by
    its gradient) share C out by rows, so a block of 1/column_blocks of C's columns has
    all but that share of its rows read elsewhere."""
    return _block_cost(rows, columns, depth) + _crossing(rows * columns, column_blocks - 1, column_blocks)


def gemm_grid(m: int, n: int, k: int, parts: int, unit: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """C[m, n] (over k) cut into at most `parts` blocks (row range, column range), edges
    multiples of `unit`: the most blocks, then the cheapest largest block
    (`_grid_block_cost`)."""
    grids = []
    for across in range(1, parts + 1):
        rows, columns = shares(m, across, unit), shares(n, parts // across, unit)
        rank = (len(rows) * len(columns), -max(_grid_block_cost(r1 - r0, c1 - c0, k, len(columns)) for r0, r1 in rows for c0, c1 in columns))
        grids.append((rank, rows, columns))
    _, rows, columns = max(grids, key=lambda grid: grid[0])  # the first of the best
    return [(r, c) for r in rows for c in columns]


def k_slices(m: int, n: int, k: int, parts: int, unit: int, b_written: bool) -> list[tuple[int, int]] | None:
    """k cut into a slice per part, each part computing all of C[m, n] over its slice, where
    that costs less than `gemm_grid`'s blocks over all of k: each part packs and reads
    only its slice of A and B, and the partial products are then added up, a share of
    rows per part (each element crossing between cores: `_CROSSING_WEIGHT`). A short, wide
    product's columns cut across parts make each read all of A and leave it a ragged last
    tile; its k cut does neither. Where B is `b_written` in the step (a parameter the
    optimizer updates, its parts each writing a share of the rows), a block of the grid
    reads its columns of every row, most written on other cores; a slice of k reads the
    rows its own core wrote. A slice is at least the GEMM's block of k deep (a shallower
    one writes its tiles of C more often than it multiplies into them). None where the
    grid is cheaper, or k too short to cut."""
    count = min(parts, k // sgemm.KC)
    if m == 1 or count < 2:
        return None
    depths = shares(k, count)
    grid = gemm_grid(m, n, k, parts, unit)
    column_blocks = len({c for _, c in grid})

    def block_cost(rows: int, columns: int) -> int:
        return _grid_block_cost(rows, columns, k, column_blocks) + (_crossing(k * columns, parts - 1, parts) if b_written else 0)

    grid_rank = (len(grid), -max(block_cost(r1 - r0, c1 - c0) for (r0, r1), (c0, c1) in grid))
    sliced_cost = _block_cost(m, n, depths[0][1]) + _CROSSING_WEIGHT * m * n * (len(depths) - 1) // len(depths)
    return depths if (len(depths), -sliced_cost) > grid_rank else None


def gemm_parts(op, unit: int, slices: bool = False) -> list[list[_Gemm]]:
    """The calls of a MatMul, in one list per worker-pool part. A batch of at least as
    many products as cores is shared out whole; otherwise each product's C is cut into
    a grid of blocks (`gemm_grid`), each a call of its own, so a single large product uses
    every core through the pool while the GEMM itself runs on one thread. With `slices`
    (a kernel that adds up partial products: `_run_calls`), a single product may instead
    be cut along k (`k_slices`). With an epilogue, a call is cut further into blocks of
    columns that fit the L2 (`_epilogue_blocks`); a product cut along k runs it after the sum."""
    a, b = op.inputs[0], op.inputs[1]
    ta, tb, m, k, n, batches = _gemms(op)
    a_size, b_size, lda, ldb = a.shape[-2] * a.shape[-1], b.shape[-2] * b.shape[-1], a.shape[-1], b.shape[-1]
    threads = thread_count() if worth_splitting(2 * m * n * k * len(batches), max(a.nbytes, b.nbytes)) else 1
    depths = k_slices(m, n, k, threads, unit, not unchanging_constant(b)) if slices and len(batches) == 1 and threads > 1 else None
    if depths:
        return [[_Gemm(m, n, p1 - p0, p0 * lda if ta else p0, p0 if tb else p0 * ldb, 0, 0, number)]
                for number, (p0, p1) in enumerate(depths)]
    if len(batches) >= threads:
        calls = [_Gemm(m, n, k, oa * a_size, ob * b_size, index * m * n) for index, (oa, ob) in enumerate(batches)]
        parts = [calls[first:last] for first, last in shares(len(calls), threads)]
    else:
        parts = []
        for index, (oa, ob) in enumerate(batches):
            for (r0, r1), (c0, c1) in gemm_grid(m, n, k, threads // len(batches), unit):
                parts.append([_Gemm(r1 - r0, c1 - c0, k, oa * a_size + (r0 if ta else r0 * lda),
                                    ob * b_size + (c0 * ldb if tb else c0), index * m * n + r0 * n + c0, c0)])
    if op.type != "MatMulCalculate":
        return parts
    itemsize = dtypes.itemsize(op.outputs[0].dtype)
    return [[block for g in part for block in _epilogue_blocks(g, ldb, tb, itemsize)] for part in parts]


_EPILOGUE_BYTES = 256 << 10  # a block of the product its epilogue reads while it is in L2
_EPILOGUE_UNIT = 96  # columns: whole panels of the generated GEMM on every target (12, 24, 48)


def _epilogue_blocks(g: _Gemm, ldb: int, tb: bool, itemsize: int) -> list[_Gemm]:
    """A call cut into calls over blocks of at most `_EPILOGUE_BYTES` of C (whole panels of
    columns), so the epilogue after each reads C from L2 rather than from memory. Each
    block reads all of A again (BLAS packs it again): worth it only while A's rows are
    shorter than twice a block's (k < 2 · width), else the call stays whole."""
    width = max(_EPILOGUE_UNIT, _EPILOGUE_BYTES // (itemsize * g.m) // _EPILOGUE_UNIT * _EPILOGUE_UNIT)
    if g.k >= 2 * width:
        return [g]
    return [_Gemm(g.m, min(width, g.n - j), g.k, g.a, g.b + (j * ldb if tb else j), g.c + j, g.column + j)
            for j in range(0, g.n, width)]


_FLOAT_UNIT = 16  # edges of the blocks of C a float32 or float64 part computes


def amx_parts(op) -> list[list[_Gemm]]:
    """The bf16 GEMM's calls per part, blocks in multiples of its 32-row tiles."""
    return gemm_parts(op, 32)


def _share(parts: list[list[_Gemm]], call_bytes) -> int:
    """The workspace each part gets: enough for its largest call."""
    return max(call_bytes(g) for part in parts for g in part)


def _amx_call_bytes(g: _Gemm) -> int:
    return workspace_bytes(g.m, g.n, g.k)


def amx_workspace_bytes(op) -> int:
    """The packing scratch of a bf16 MatMul: one share per thread."""
    parts = amx_parts(op)
    return len(parts) * _share(parts, _amx_call_bytes)


class GeneratedGemm:
    """A generated GEMM as generated code calls it, with `Blas.gemm`'s arguments: the
    float32 one (sgemm.py) or the bf16 AMX one (`slot` in the pointer table: they take
    the same arguments), packing B in part `number`'s `share` of the step's workspace.
    Sizes and leading dimensions may be Python ints or run-time int64 Values."""

    _TYPE = ir.FunctionType(VOID, [I64] * 5 + [F32.as_pointer(), I64, F32.as_pointer(), I64, F32.as_pointer(), I64,
                                               I8.as_pointer()])

    def __init__(self, ctx, slot: int, number: int | Value, share: int):
        self.b = ctx.b
        self._function = self.b.bitcast(ctx.table_entry(slot), self._TYPE.as_pointer())
        self._scratch = self.b.gep(ctx.address(ctx.workspace), [ctx.index(number * share).ir])

    def gemm(self, ta: bool, tb: bool, m, n, k, a: ir.Value, lda, b: ir.Value, ldb, c: ir.Value, ldc) -> None:
        """C[m, n] = op(A)[m, k] · op(B)[k, n] (row-major, C overwritten)."""
        def size(value) -> ir.Value:
            return value.ir if isinstance(value, Value) else i64(value)

        self.b.call(self._function, [i64(int(ta)), i64(int(tb)), size(m), size(n), size(k), a, size(lda), b, size(ldb), c,
                                     size(ldc), self._scratch])


class PackedGemm:
    """The generated GEMM on a B already in panels (`sgemm.pack_panels`, or at run time
    `sgemm.pack_at_run_time`), as generated code calls it: C[m, n] = op(A)[m, k] · B;
    `narrow`: on bf16 panels; `pairs`: on bf16 pairs."""

    def __init__(self, ctx, narrow: bool = False, pairs: bool = False):
        self.b = ctx.b
        panels = (I16 if narrow or pairs else F32).as_pointer()
        function = ir.FunctionType(VOID, [I64] * 4 + [F32.as_pointer(), I64, panels, F32.as_pointer(), I64])
        slot = SGEMM_PACKED_DPBF16 if pairs else SGEMM_PACKED_BF16 if narrow else SGEMM_PACKED
        self._function = self.b.bitcast(ctx.table_entry(slot), function.as_pointer())

    def gemm(self, ta: bool, m, n, k, a: ir.Value, lda, panels: ir.Value, c: ir.Value, ldc) -> None:
        """`panels` as any pointer: a scratch holding them is typed float32."""
        def size(value) -> ir.Value:
            return value.ir if isinstance(value, Value) else i64(value)

        panels = self.b.bitcast(panels, self._function.type.pointee.args[6])
        self.b.call(self._function, [i64(int(ta)), size(m), size(n), size(k), a, size(lda), panels, c, size(ldc)])


def panel_floats(columns: int, k: int) -> int:
    """Floats the panels of `columns` columns of k rows take, on any target."""
    return max(-(-columns // nr) * nr * k for nr in sgemm.PANEL_WIDTHS)


def _slice_count(parts: list[list[_Gemm]]) -> int:
    return 1 + max(g.slice for part in parts for g in part)


def _partials_bytes(op, parts: list[list[_Gemm]]) -> int:
    """Workspace for the partial products of slices 1.. of k (none where k is not cut)."""
    g = parts[0][0]
    return (_slice_count(parts) - 1) * g.m * g.n * dtypes.itemsize(op.outputs[0].dtype)


def _run_calls(ctx, op, parts: list[list[_Gemm]], emit_call, partials_at: int, fixed=lambda g: (),
               calls_run_epilogue: bool = False) -> None:
    """Each part's calls (`emit_call(ctx, number, g, c)` emits the part's GEMM for call g
    into C at pointer c), each followed by the op's epilogue over the block it wrote
    (`calls_run_epilogue`: emit_call runs it itself, over each of the blocks it writes).
    Where k is cut into slices, slice 0 writes C and slice s partial product s (in the
    workspace from byte `partials_at`); a second job then adds the partials into C, a share
    of rows per part, and runs the epilogue over those rows. Parts whose calls differ only
    in numbers the code takes at run time (a block's rows, where it starts) are emitted
    once (`each_part`): `fixed(g)` is what `emit_call`'s code is made from, and an
    epilogue's columns are fixed too."""
    c = op.outputs[0]
    count = _slice_count(parts)
    m, n = parts[0][0].m, parts[0][0].n
    storage = storage_type(c.dtype).as_pointer()

    def partial_at(ctx, number: int | Value) -> ir.Value:
        """Where partial product `number` (a slice of k past the first) starts in the workspace."""
        at = ctx.index(partials_at + (number - 1) * m * n * dtypes.itemsize(c.dtype))
        return ctx.b.gep(ctx.address(ctx.workspace), [at.ir])

    def partial(ctx, number: int) -> Variable:
        return ctx.scratch(f"{c.name}/partial{number}", c.dtype, m * n, partial_at(ctx, number))

    def target(ctx, g: _Gemm) -> ir.Value:
        if isinstance(g.slice, int):
            return ctx.element_pointer(c, g.c) if g.slice == 0 else ctx.pointer(partial(ctx, g.slice))
        slice_at = ctx.b.bitcast(partial_at(ctx, g.slice), storage)
        return ctx.b.select(ctx.b.icmp_signed("==", g.slice.ir, i64(0)), ctx.element_pointer(c, g.c), slice_at)

    def compute(ctx, number: int | Value, calls: list[_Gemm]) -> None:
        for g in calls:
            emit_call(ctx, number, g, target(ctx, g))
            if count == 1 and not calls_run_epilogue:
                epilogue(ctx, op, g.c, g.m, g.n)

    def add_up(ctx, first: int | Value, last: int | Value) -> None:
        epilogue(ctx, op, first * n, last - first, n, [partial(ctx, number) for number in range(1, count)])

    calls = len(parts[0])
    with_epilogue = count == 1 and op.type in FUSED_PRODUCTS
    alike = all(len(part) == calls for part in parts) and all(
        len({(fixed(part[j]), part[j].n if with_epilogue else None) for part in parts}) == 1 for j in range(calls))
    if alike:
        fields = [field.name for field in dataclasses.fields(_Gemm)]
        each_part(ctx, [tuple(getattr(g, name) for g in part for name in fields) for part in parts],
                  lambda ctx, number, *values: compute(ctx, number, [
                      _Gemm(*values[j * len(fields) : (j + 1) * len(fields)]) for j in range(calls)]))
    else:
        run_parts(ctx, [functools.partial(compute, number=number, calls=part) for number, part in enumerate(parts)])
    if count > 1:
        share_out(ctx, m, count, add_up)


def _generated_call_bytes(g: _Gemm) -> int:
    """The workspace of a call of the generated GEMM, on float32 or on bf16 pairs."""
    return sgemm.workspace_bytes(g.n, g.k)


def _generated_workspace_bytes(op) -> int:
    parts = gemm_parts(op, _FLOAT_UNIT, slices=True)
    return len(parts) * _share(parts, _generated_call_bytes) + _partials_bytes(op, parts)


def _call_generated(ctx, op, slot: int, parts: list[list[_Gemm]], share: int) -> None:
    """The calls of a generated GEMM (`slot`: see GeneratedGemm), each part with `share`
    bytes of the step's workspace, the partial products of a product cut along k after them."""
    a, b, c = op.inputs[0], op.inputs[1], op.outputs[0]
    ta, tb = _gemms(op)[:2]

    def call(ctx, number: int, g: _Gemm, target: ir.Value) -> None:
        GeneratedGemm(ctx, slot, number, share).gemm(ta, tb, g.m, g.n, g.k, ctx.element_pointer(a, g.a), a.shape[-1],
                                                     ctx.element_pointer(b, g.b), b.shape[-1], target, c.shape[-1])

    _run_calls(ctx, op, parts, call, len(parts) * share)


def _bfloat16_products(op) -> bool:
    """Products with rows in bf16, on AMX tiles (the backend passes this kernel over on
    targets without them); a vector's product by a constant comes marked for bf16 panels
    (`narrow_weights`), and where those are not faster the streamed GEMV beats the tiles."""
    return _bfloat16_precision(op) and _gemms(op)[2] > 1


@kernel(AMX_KERNEL, MATMUL_OPS, supports=_bfloat16_products, rank=10, workspace=amx_workspace_bytes,
        calls=frozenset({BF16GEMM}))
def amx_matmul(ctx, op) -> None:
    parts = amx_parts(op)
    _call_generated(ctx, op, BF16GEMM, parts, _share(parts, _amx_call_bytes))


PAIRS_KERNEL = "GemmDpbf16"
PAIRS_PACKED_KERNEL = "PackedGemmDpbf16"


def _on_pairs(op, packed: bool) -> bool:
    """A float32 product with rows in bf16, not a thin one (ThinGemm's: a 48-column panel
    would be mostly padding), by a constant matrix (`packed`: its pairs packed once, for a
    product of one batch) or not."""
    if not (_bfloat16_products(op) and _float32(op) and _thin_shape(op) is None and _by_constant(op) == packed):
        return False
    return not packed or len(_gemms(op)[5]) == 1


def _pairs_faster(op, packed: bool) -> bool:
    """Whether the GEMM on bf16 pairs measured faster than the float32 GEMM the product
    takes otherwise, on the largest call a part makes, as it makes it."""
    ta, tb = _gemms(op)[:2]
    calls = [g for part in gemm_parts(op, _FLOAT_UNIT, slices=not packed) for g in part]
    largest = max(calls, key=lambda g: g.m * g.n * g.k)
    lda, ldb = op.inputs[0].shape[-1], op.inputs[1].shape[-1]
    return pairs_are_faster(ta, tb, largest.m, largest.n, largest.k, lda, ldb, packed)


@kernel(PAIRS_KERNEL, MATMUL_OPS, supports=lambda op: _on_pairs(op, packed=False), rank=20,
        prefer=lambda op: _pairs_faster(op, packed=False), workspace=_generated_workspace_bytes,
        calls=frozenset({SGEMM_DPBF16}))
def pairs_matmul(ctx, op) -> None:
    """The generated GEMM on bf16 pairs (vdpbf16ps), both operands packed into pairs as it
    goes: a product of activations (a training step's, forward and backward)."""
    parts = gemm_parts(op, _FLOAT_UNIT, slices=True)
    _call_generated(ctx, op, SGEMM_DPBF16, parts, _share(parts, _generated_call_bytes))


@kernel(PAIRS_PACKED_KERNEL, MATMUL_OPS, supports=lambda op: _on_pairs(op, packed=True), rank=30,
        prefer=lambda op: _pairs_faster(op, packed=True), prepares=lambda op: [_panels_of_b(op, pairs=True)],
        calls=frozenset({SGEMM_PACKED_DPBF16}))
def pairs_packed_matmul(ctx, op) -> None:
    """The generated GEMM on bf16 pairs, B's pairs packed once when the network was made
    (an inference model's weights), A's strips as it goes."""
    _call_packed(ctx, op, pairs=True)


THIN = 12  # columns (or steps of k) a thin product keeps in registers, an accumulator (or a factor) each


def _thin_shape(op) -> str | None:
    """How a float32 product with a thin side is computed, or None: "dot" (n ≤ THIN, op(A)'s
    rows contiguous along k), "across" (n ≤ THIN, op(A) = Aᵀ: C's rows contiguous in A's rows)
    or "depth" (k ≤ THIN)."""
    ta, _, m, k, n, batches = _gemms(op)
    if not _float32(op) or len(batches) != 1 or m < 2:
        return None
    if n <= THIN:
        return "across" if ta else "dot"
    return "depth" if k <= THIN else None


def _thin_form(op) -> str | None:
    """`_thin_shape`, but for a product by a constant whose precision lets it round its inputs
    to bf16: that is left to the bf16 kernels (panels or AMX tiles), as the user asked. One
    with rows in bf16 is AMX's, which come first; on bf16 pairs, thin ones are left here."""
    return None if _bfloat16_precision(op) and _by_constant(op) else _thin_shape(op)


def _packs_b(op) -> bool:
    """Whether each part first copies op(B) in the layout its form reads: Bᵀ's rows along k
    for "dot", op(B)'s rows along n for "depth"."""
    tb = _gemms(op)[1]
    form = _thin_form(op)
    return (form == "dot" and not tb) or (form == "depth" and tb)


def _thin_parts(op) -> list[list[_Gemm]]:
    """C's rows shared out, whole vectors of them where "across" reads them as vectors."""
    ta, _, m, k, n, _ = _gemms(op)
    lda = op.inputs[0].shape[-1]
    threads = thread_count() if worth_splitting(2 * m * n * k, max(op.inputs[0].nbytes, op.inputs[1].nbytes)) else 1
    unit = host_target().lanes(4) if ta else 1
    return [[_Gemm(last - first, n, k, first if ta else first * lda, 0, first * n)] for first, last in shares(m, threads, unit)]


def _thin_share(op) -> int:
    """Workspace bytes per part: op(B) packed, cache-line aligned."""
    _, _, _, k, n, _ = _gemms(op)
    return -(-k * n * 4 // 64) * 64 if _packs_b(op) else 0


@kernel("ThinGemm", MATMUL_OPS, supports=lambda op: _thin_form(op) is not None, rank=40,
        workspace=lambda op: len(_thin_parts(op)) * _thin_share(op))
def thin_matmul(ctx, op) -> None:
    """A product with a side of at most `THIN` (a classifier's few columns, or few steps of
    k: its gradients), where a GEMM's 24- or 48-column panels would be mostly padding: every
    lane of every multiply-add is C's, each of C's thin rows or columns an accumulator in a
    register. "dot": per row of C, n dot products along k, the row of A read once; "across":
    vectors of C's rows (a row of A read in place) times each of op(B)'s n factors; "depth":
    per row of C, its k factors times op(B)'s rows. Parts take C's rows; each packs op(B)
    first where its form reads it in the other layout (k × n floats, few)."""
    a, b, c = op.inputs[0], op.inputs[1], op.outputs[0]
    ta, tb, _, k, n, _ = _gemms(op)
    lda, ldb = a.shape[-1], b.shape[-1]
    form, f32 = _thin_form(op), dtypes.DT_FLOAT32
    lanes = ctx.lanes_for([f32])
    share = _thin_share(op)

    def b_at(p, j):
        """The element index of op(B)[p, j] in B."""
        return j * ldb + p if tb else p * ldb + j

    def call(ctx, number, g: _Gemm, target: ir.Value) -> None:
        out = ctx.scratch(f"{op.name}/c", f32, c.size, ctx.b.bitcast(target, I8.as_pointer()))
        source, source_at = b, b_at
        if share:
            packed = ctx.scratch(f"{op.name}/b", f32, k * n,
                                 ctx.b.gep(ctx.address(ctx.workspace), [ctx.index(number * share).ir]))
            packed_at = (lambda p, j: j * k + p) if form == "dot" else (lambda p, j: p * n + j)
            with ctx.loop(0, k, name="pk") as p, ctx.loop(0, n, name="pn") as j:
                ctx.store(packed, packed_at(p, j), ctx.load(b, b_at(p, j)))
            source, source_at = packed, packed_at
        if form == "dot":
            _dot_rows(ctx, g, a, lda, source, source_at, out, lanes)
        elif form == "across":
            _rows_across(ctx, g, a, lda, source, source_at, out, lanes)
        else:
            _depth_rows(ctx, g, a, lda, ta, source, source_at, out)

    parts = _thin_parts(op)
    _run_calls(ctx, op, parts, call, len(parts) * share)


def _dot_rows(ctx, g: _Gemm, a, lda: int, bt, bt_at, out, lanes: int) -> None:
    """C[i, j] = A[i, :] · Bᵀ[j, :] for the call's rows, Bᵀ's rows contiguous along k."""
    f32 = dtypes.DT_FLOAT32
    whole = g.k - g.k % lanes
    with ctx.loop(0, g.m, name="i") as i:
        sums = [ctx.local(f32, lanes, 0.0) for _ in range(g.n)]
        tails = [ctx.local(f32, 1, 0.0) for _ in range(g.n)]

        def step(p, width: int, into) -> None:
            x = ctx.load(a, g.a + i * lda + p, width)
            for j, total in enumerate(into):
                total.set(x.mul_add(ctx.load(bt, bt_at(p, j), width), total.value))

        if whole:
            with ctx.loop(0, whole, step=lanes, name="p") as p:
                step(p, lanes, sums)
        if whole < g.k:
            with ctx.loop(whole, g.k, name="pt") as p:
                step(p, 1, tails)
        for j in range(g.n):
            ctx.store(out, i * g.n + j, fold_lanes(sums[j].value, operator.add) + tails[j].value)


def _rows_across(ctx, g: _Gemm, a, lda: int, b, b_at, out, lanes: int) -> None:
    """C[i:i+w, j] = Σ_p A[p, i:i+w] · op(B)[p, j]: op(A) = Aᵀ, so C's rows lie along A's rows."""
    f32 = dtypes.DT_FLOAT32

    def rows(i, width: int) -> None:
        sums = [ctx.local(f32, width, 0.0) for _ in range(g.n)]
        with ctx.loop(0, g.k, name="p") as p:
            x = ctx.load(a, g.a + p * lda + i, width)
            for j, total in enumerate(sums):
                total.set(x.mul_add(ctx.load(b, b_at(p, j)).splat(width), total.value))
        for j, total in enumerate(sums):
            value = total.value
            for r in range(width):
                ctx.store(out, (i + r) * g.n + j, value.lane(r) if width > 1 else value)

    for_vectors(ctx, 0, g.m, lanes, rows)


def _depth_rows(ctx, g: _Gemm, a, lda: int, ta: bool, b, b_at, out) -> None:
    """C[i, :] = Σ_p op(A)[i, p] · op(B)[p, :], op(B)'s rows contiguous along n."""
    with ctx.loop(0, g.m, name="i") as i:
        factors = [ctx.load(a, g.a + (p * lda + i if ta else i * lda + p)) for p in range(g.k)]
        Row(ctx, i * g.n, g.n, dtypes.DT_FLOAT32).each(lambda at, w: ctx.store(out, at, functools.reduce(
            lambda total, p: factors[p].splat(w).mul_add(ctx.load(b, b_at(p, at - i * g.n), w), total),
            range(1, g.k), factors[0].splat(w) * ctx.load(b, b_at(0, at - i * g.n), w))))


def _range_starts(op, size) -> dict[tuple[int, int], int]:
    """Where each call's columns start in B's packed form, each range of columns `size(columns)`
    elements after the previous one's (`pack_panels`' `ranges`)."""
    starts, at = {}, 0
    for first, last in _column_ranges(op):
        starts[first, last] = at
        at += size(last - first)
    return starts


PAIRS_GEMV_KERNEL = "Bf16Gemv"  # the backend passes it over on targets without AVX512-BF16


def _row_by_narrow_constant(op) -> bool:
    """One row times a constant matrix that its precision lets be rounded to bf16: a decode
    step's product, which only streams the matrix."""
    _, _, m, _, _, batches = _gemms(op)
    return _bfloat16_precision(op) and _by_constant(op) and m == 1 and len(batches) == 1


def _pairs_gemv_workspace_bytes(op) -> int:
    return len(gemm_parts(op, _FLOAT_UNIT)) * bf16gemv.workspace_bytes(_gemms(op)[3])


@kernel(PAIRS_GEMV_KERNEL, MATMUL_OPS, supports=_row_by_narrow_constant, rank=50, prepares=lambda op: [_panels_of_b(op, pairs=True)],
        workspace=_pairs_gemv_workspace_bytes, calls=frozenset({DPBF16GEMV}))
def pairs_gemv(ctx, op) -> None:
    """`ranvier_gemv_dpbf16` (bf16gemv.py) on the constant B's bf16 pairs packed when the
    network was made: each part rounds x to bf16 pairs and streams its columns' panels
    through vdpbf16ps, float32 sums: near a plain read's rate (bf16gemv.py), where widening
    the bf16 panels to float32 (`PackedGemmBf16`) kept fewer of the matrix's lines in flight."""
    a = op.inputs[0]
    k = _gemms(op)[3]
    panels = _panels_of_b(op, pairs=True)
    parts = gemm_parts(op, _FLOAT_UNIT)
    share = bf16gemv.workspace_bytes(k)
    starts = _range_starts(op, lambda columns: sgemm.panels_size(columns, k, ctx.target, pairs=True))
    function = ir.FunctionType(VOID, [I64, I64, F32.as_pointer(), I32.as_pointer(), F32.as_pointer(), I8.as_pointer()])

    def call(ctx, number, g: _Gemm, target: ir.Value) -> None:
        b = ctx.b
        packed = b.gep(ctx.prepared(panels.var, panels.form, I16), [i64(starts[g.column, g.column + g.n])])
        scratch = b.gep(ctx.address(ctx.workspace), [ctx.index(number * share).ir])
        gemv = b.bitcast(ctx.table_entry(DPBF16GEMV), function.as_pointer())
        b.call(gemv, [i64(g.n), i64(k), ctx.element_pointer(a, g.a), b.bitcast(packed, I32.as_pointer()), target, scratch])

    _run_calls(ctx, op, parts, call, len(parts) * share, fixed=lambda g: (g.column, g.n))


NARROW_PACKED_KERNEL = "PackedGemmBf16"


def _narrow_constant(op) -> bool:
    """A product of one batch by a constant matrix that its precision lets be rounded to
    bf16 (marked for `narrow_weights`: where no AMX tiles take it, or it is a vector's, a
    decode step's)."""
    return _bfloat16_precision(op) and _by_constant(op) and len(_gemms(op)[5]) == 1


@kernel(NARROW_PACKED_KERNEL, MATMUL_OPS, supports=_narrow_constant, rank=60,
        prefer=lambda op: _chose_generated(op, packed=True, narrow=True), prepares=lambda op: [_panels_of_b(op, narrow=True)],
        calls=frozenset({SGEMM_PACKED_BF16}))
def narrow_packed_matmul(ctx, op) -> None:
    """The generated GEMM on the constant B's panels packed in bf16 when the network was
    made: half the bytes a product streams, which is all a vector-matrix product does."""
    _call_packed(ctx, op, narrow=True)


def _float32(op) -> bool:
    return op.inputs[0].dtype == dtypes.DT_FLOAT32 and op.inputs[1].dtype == dtypes.DT_FLOAT32


def _chose_generated(op, packed: bool, narrow: bool = False) -> bool:
    """Not a vector times a matrix (`Gemv` streams it best) unless on bf16 panels (`narrow`:
    half the bytes to stream), and the generated GEMM measured faster than BLAS on the
    largest call a part makes, as it makes it."""
    ta, tb = _gemms(op)[:2]
    calls = [g for part in gemm_parts(op, _FLOAT_UNIT, slices=not packed) for g in part]
    largest = max(calls, key=lambda g: g.m * g.n * g.k)
    lda, ldb = op.inputs[0].shape[-1], op.inputs[1].shape[-1]
    return (narrow or largest.m > 1) and generated_is_faster(ta, tb, largest.m, largest.n, largest.k, lda, ldb, packed,
                                                             narrow)


INT8_KERNEL = "Q8Gemm"


def _int8_products(op) -> bool:
    """A product by a constant matrix marked int8 (`narrow_weights`), whatever its rows: the
    q8_0 panels are the only copy of the matrix a product in int8 reads."""
    return attrs_of(op)["precision"] == "int8" and _by_constant(op) and len(_gemms(op)[5]) == 1


def _q8_panels(op) -> Prepared:
    """The constant B quantized to q8_0 along k and packed once, each call's columns apart."""
    transposed = bool(attrs_of(op)["transpose_b"])
    ranges = _column_ranges(op)
    return Prepared(op.inputs[1], f"q8_0 panels{' of Bᵀ' if transposed else ''}, columns {ranges}",
                    lambda value, target: q8gemm.pack_panels(value, transposed, target, ranges))


def _q8_call_bytes(g: _Gemm) -> int:
    return q8gemm.workspace_bytes(g.m, g.k)


def _q8_workspace_bytes(op) -> int:
    """Each part's call quantizes its rows of A into its share."""
    parts = gemm_parts(op, _FLOAT_UNIT)
    return len(parts) * _share(parts, _q8_call_bytes)


@kernel(INT8_KERNEL, MATMUL_OPS, supports=_int8_products, rank=70, prepares=lambda op: [_q8_panels(op)], workspace=_q8_workspace_bytes,
        calls=frozenset({Q8GEMM}))
def int8_matmul(ctx, op) -> None:
    """`ranvier_q8_gemm` (q8gemm.py) on the constant B's q8_0 panels packed when the network
    was made: each call quantizes its rows of A to q8_0 blocks, then sums the blocks'
    products in int32 (vpdpbusd where the CPU has VNNI) and their scaled sums in float32.
    A decode step's row reads about a quarter of the float32 matrix's bytes."""
    a, c = op.inputs[0], op.outputs[0]
    k = _gemms(op)[3]
    panels = _q8_panels(op)
    parts = gemm_parts(op, _FLOAT_UNIT)
    share = _share(parts, _q8_call_bytes)
    starts = _range_starts(op, lambda columns: q8gemm.panels_bytes(columns, k, ctx.target))
    function = ir.FunctionType(VOID, [I64] * 3 + [F32.as_pointer(), I64, I8.as_pointer(), F32.as_pointer(), I64,
                                                  I8.as_pointer()])

    def call(ctx, number, g: _Gemm, target: ir.Value) -> None:
        b = ctx.b
        packed = b.gep(ctx.prepared(panels.var, panels.form, I8), [i64(starts[g.column, g.column + g.n])])
        scratch = b.gep(ctx.address(ctx.workspace), [ctx.index(number * share).ir])
        gemm = b.bitcast(ctx.table_entry(Q8GEMM), function.as_pointer())
        b.call(gemm, [ctx.index(g.m).ir, i64(g.n), i64(k), ctx.element_pointer(a, g.a), i64(a.shape[-1]), packed, target,
                      i64(c.shape[-1]), scratch])

    _run_calls(ctx, op, parts, call, len(parts) * share, fixed=lambda g: (g.column, g.n))


PACKED_KERNEL = "PackedGemm"


def _column_ranges(op) -> list[tuple[int, int]]:
    """The columns of op(B) each call reads, each range once, in the order calls come."""
    ranges = [(g.column, g.column + g.n) for part in gemm_parts(op, _FLOAT_UNIT) for g in part]
    return list(dict.fromkeys(ranges))


def _panels_of_b(op, narrow: bool = False, pairs: bool = False) -> Prepared:
    """A constant B packed once into the generated GEMM's panels (`narrow`: in bf16; `pairs`:
    in bf16 pairs), each call's columns apart (so a part's columns need not start on a panel)."""
    transposed = bool(attrs_of(op)["transpose_b"])
    ranges = _column_ranges(op)
    kind = "bf16 pair " if pairs else "bf16 " if narrow else ""
    form = f"sgemm {kind}panels{' of Bᵀ' if transposed else ''}, columns {ranges}"
    return Prepared(op.inputs[1], form,
                    lambda value, target: sgemm.pack_panels(value, transposed, target, ranges, narrow, pairs))


def _by_constant(op) -> bool:
    """A float32 product by an unchanging constant matrix."""
    b = op.inputs[1]
    return _float32(op) and b.rank == 2 and unchanging_constant(b)


@kernel(PACKED_KERNEL, MATMUL_OPS, supports=_by_constant, rank=80, prefer=lambda op: _chose_generated(op, packed=True),
        prepares=lambda op: [_panels_of_b(op)], calls=frozenset({SGEMM_PACKED}))
def packed_matmul(ctx, op) -> None:
    """The generated GEMM, B read from panels packed when the network was made: the
    product's steps skip the packing the workspace version does every call."""
    _call_packed(ctx, op, narrow=False)


# A packed product's parts are cut along their rows into up to this many pieces each, the
# pool's threads claiming pieces as they finish: with a part per core, a core the host lends
# elsewhere for a while (a shared VM), or a worker woken late, leaves the other idle at the end.
_CLAIMED_PIECES = 4
# ...pieces of at least this many rows, so that each still reads B's panels for many strips of A
_CLAIMED_ROWS = 512


def claimed_pieces(parts: list[list[_Gemm]], ta: bool, lda: int, ldc: int, unit: int) -> list[list[_Gemm]]:
    """Each part (its calls over the same rows of A and C) cut along its rows into pieces of
    at least `_CLAIMED_ROWS` rows (a multiple of `unit`), a part each, in order. B packed
    ahead of time is read in place by every call, so a piece adds no packing, only a pass
    over its panels: on one Zen 5 core, 2,048 rows of BERT-base's products in 4 calls took
    0.88-0.98 of one call's time. On its batch-32 products (4,096 rows) on two Zen 5 cores
    shared with other work, where a part per core read 2x a core's rate only when the other
    core was free, 8 pieces took 0.85-0.95 of 2 parts' time (alternated rounds, medians)."""
    if len(parts) == 1:  # on one core: nothing to balance
        return parts
    pieces = []
    for part in parts:
        rows = part[0].m
        count = min(_CLAIMED_PIECES, rows // _CLAIMED_ROWS) if all(g.m == rows for g in part) else 1
        for r0, r1 in shares(rows, max(1, count), unit):
            pieces.append([dataclasses.replace(g, m=r1 - r0, a=g.a + (r0 if ta else r0 * lda), c=g.c + r0 * ldc) for g in part])
    return pieces


def _call_packed(ctx, op, narrow: bool = False, pairs: bool = False) -> None:
    """Each part's calls of the generated GEMM on the constant B's panels (`narrow`: bf16;
    `pairs`: bf16 pairs), each part cut in pieces the cores claim as they finish
    (`claimed_pieces`)."""
    a, c = op.inputs[0], op.outputs[0]
    ta, _, _, k, _, _ = _gemms(op)
    panels = _panels_of_b(op, narrow, pairs)
    starts, at = {}, 0
    for first, last in _column_ranges(op):
        starts[first, last] = at
        at += sgemm.panels_size(last - first, k, ctx.target, pairs)

    lda, ldc = a.shape[-1], c.shape[-1]
    parts = claimed_pieces(gemm_parts(op, _FLOAT_UNIT), ta, lda, ldc, _FLOAT_UNIT)
    most_rows: dict[tuple[int, int], int] = {}  # the most rows of the calls of each range of columns
    for g in (g for part in parts for g in part):
        most_rows[g.column, g.n] = max(g.m, most_rows.get((g.column, g.n), 0))

    def by_blocks(g: _Gemm) -> bool:
        """Whether call g computes C a block at a time, the epilogue after each: where it
        has one and more rows than a block's. A call of fewer (a batch-1 product's) stays
        whole: C comes back from L3 as cheaply, and the GEMM asks for each block's panels
        while it computes the one before, across the call's blocks but not from one call
        to the next (4,096 rows as blocks took 0.93-0.97 of the time, 128 rows 1.02-1.03)."""
        return op.type in FUSED_PRODUCTS and most_rows[g.column, g.n] > _epilogue_tiles(ctx.target, g.n)[1]

    def call(ctx, number: int, g: _Gemm, target: ir.Value) -> None:
        packed = ctx.prepared(panels.var, panels.form, I16 if narrow or pairs else F32)
        gemm = PackedGemm(ctx, narrow, pairs)
        start = starts[g.column, g.column + g.n]
        if not by_blocks(g):
            gemm.gemm(ta, g.m, g.n, k, ctx.element_pointer(a, g.a), lda, ctx.b.gep(packed, [i64(start)]), target, ldc)
            epilogue(ctx, op, g.c, g.m, g.n)  # (none for a plain product)
            return
        width, rows = _epilogue_tiles(ctx.target, g.n)
        block_panels = sgemm.panels_size(width, k, ctx.target, pairs)  # (width: whole panels)

        def blocks(first: Value | int, columns: int) -> None:
            """The block of C from column `first`, `columns` wide, `rows` at a time."""
            at_panels = ctx.b.gep(packed, [ctx.index(start + first // width * block_panels).ir])
            with ctx.loop(0, g.m, step=rows, name="epilogue_rows") as r0:
                count = (g.m - r0).minimum(rows)
                a_at = ctx.element_pointer(a, g.a + (r0 if ta else r0 * lda))
                gemm.gemm(ta, count, columns, k, a_at, lda, at_panels, ctx.element_pointer(c, g.c + r0 * ldc + first), ldc)
                epilogue(ctx, op, g.c + r0 * ldc + first, count, columns)

        whole = g.n // width  # the GEMM's own blocks of columns, in its order, the last narrower
        with ctx.loop(0, whole, name="epilogue_columns") as block:
            blocks(block * width, width)
        if g.n % width:
            blocks(whole * width, g.n % width)

    _run_calls(ctx, op, parts, call, 0, fixed=lambda g: (g.column, g.n),  # its panels' start
               calls_run_epilogue=True)


def _epilogue_tiles(target, columns: int) -> tuple[int, int]:
    """(columns, rows) of the blocks of C a packed product's call with an epilogue computes
    one at a time: the GEMM's own block of columns (`sgemm.block_columns`, which its loops
    take one after another anyway: a call per block changes nothing in what it reads), and
    rows that hold `_EPILOGUE_BYTES` of them, so the epilogue reads the block from L2 where
    over a call's whole rows it read C back from memory (a power of two: whole strips of the
    GEMM's tiles)."""
    width = min(columns, sgemm.block_columns(target, packed=True))
    return width, 1 << max(4, (_EPILOGUE_BYTES // (4 * width)).bit_length() - 1)


GENERATED_KERNEL = "Gemm"


def _generated_faster(op) -> bool:
    """Products by constants are the packed kernel's or BLAS's: packing B every call
    cannot beat packing it once."""
    return not _by_constant(op) and _chose_generated(op, packed=False)


@kernel(GENERATED_KERNEL, MATMUL_OPS, supports=_float32, rank=90, prefer=_generated_faster, workspace=_generated_workspace_bytes,
        calls=frozenset({SGEMM_GENERATED}))
def generated_matmul(ctx, op) -> None:
    """ranvier's own float32 GEMM (sgemm.py), where it measured faster than BLAS."""
    parts = gemm_parts(op, _FLOAT_UNIT, slices=True)
    _call_generated(ctx, op, SGEMM_GENERATED, parts, _share(parts, _generated_call_bytes))


def _float32_or_64(op) -> bool:
    return op.inputs[0].dtype in (dtypes.DT_FLOAT32, dtypes.DT_FLOAT64)


class Blas:
    """The vendor BLAS's gemm and gemv as generated code calls them: through the pointer
    table, with Fortran's by-reference arguments. Operands are row-major, so C = op(A)·op(B)
    is the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: A and B swap places. Sizes and leading
    dimensions may be Python ints or run-time int64 Values (a group's row count)."""

    def __init__(self, ctx, dtype: str):
        self.ctx, self.b = ctx, ctx.b
        self.element = F32 if dtype == dtypes.DT_FLOAT32 else F64
        pointer, i32p, chp = self.element.as_pointer(), I32.as_pointer(), I8.as_pointer()
        self._gemm_type = ir.FunctionType(VOID, [chp, chp, i32p, i32p, i32p, pointer, pointer, i32p, pointer, i32p, pointer, pointer, i32p])
        self._gemv_type = ir.FunctionType(VOID, [chp, i32p, i32p, pointer, pointer, i32p, pointer, i32p, pointer, pointer, i32p])
        self._gemm_slot, self._gemv_slot = (SGEMM, SGEMV) if self.element is F32 else (DGEMM, DGEMV)

    def _ref(self, type_: ir.Type, value) -> ir.Value:
        """A pointer to `value` (BLAS takes every argument by reference)."""
        with self.b.goto_entry_block():
            slot = self.b.alloca(type_)
        if isinstance(value, Value):
            value = self.b.trunc(value.ir, type_) if value.ir.type != type_ else value.ir
        elif not isinstance(value, ir.Value):
            value = ir.Constant(type_, value)
        self.b.store(value, slot)
        return slot

    def _trans(self, transposed: bool) -> ir.Value:
        return self._ref(I8, ord("T" if transposed else "N"))

    def gemm(self, ta: bool, tb: bool, m, n, k, a: ir.Value, lda, b: ir.Value, ldb, c: ir.Value, ldc, add: bool = False) -> None:
        """C[m, n] = op(A)[m, k] · op(B)[k, n] (row-major; C overwritten, or with `add` added to)."""
        gemm = self.b.bitcast(self.ctx.table_entry(self._gemm_slot), self._gemm_type.as_pointer())
        self.b.call(gemm, [
            self._trans(tb), self._trans(ta), self._ref(I32, n), self._ref(I32, m), self._ref(I32, k),
            self._ref(self.element, 1.0), b, self._ref(I32, ldb), a, self._ref(I32, lda),
            self._ref(self.element, 1.0 if add else 0.0), c, self._ref(I32, ldc),
        ])

    def vector_matrix(self, tb: bool, n, k, x: ir.Value, b: ir.Value, ldb, y: ir.Value) -> None:
        """y[n] = x[k] · op(B)[k, n]: GEMV streams the matrix once, where GEMM would first pack it."""
        gemv = self.b.bitcast(self.ctx.table_entry(self._gemv_slot), self._gemv_type.as_pointer())
        rows, columns = (k, n) if tb else (n, k)
        one = self._ref(I32, 1)
        self.b.call(gemv, [
            self._trans(tb), self._ref(I32, rows), self._ref(I32, columns), self._ref(self.element, 1.0),
            b, self._ref(I32, ldb), x, one, self._ref(self.element, 0.0), y, one,
        ])


ROWS_AT_ONCE = 4  # rows of the matrix one pass over a vector-matrix product's output adds in


def _vector_times_matrix(op) -> bool:
    """One float32 row times a matrix: a decode step's product, which only streams the matrix."""
    _, _, m, _, _, batches = _gemms(op)
    return _float32(op) and m == 1 and len(batches) == 1


def _vector_parts(op) -> list[list[_Gemm]]:
    """A plain B is cut along k, each part streaming its own contiguous rows of the matrix
    into a partial product (`_run_calls` adds them up); Bᵀ's rows are C's columns, cut
    into a contiguous range per part."""
    _, tb, _, k, n, _ = _gemms(op)
    threads = thread_count() if worth_splitting(2 * n * k, op.inputs[1].nbytes) else 1
    if tb:
        return [[_Gemm(1, last - first, k, 0, first * k, first, first)] for first, last in shares(n, threads, _FLOAT_UNIT)]
    return [[_Gemm(1, n, last - first, first, first * n, 0, 0, number)] for number, (first, last) in
            enumerate(shares(k, threads, ROWS_AT_ONCE))]


@kernel("Gemv", MATMUL_OPS, supports=_vector_times_matrix, rank=100,
        workspace=lambda op: _partials_bytes(op, _vector_parts(op)))
def vector_matrix(ctx, op) -> None:
    """y = x · B streamed in place: for B, `ROWS_AT_ONCE` of its rows at a time are scaled
    by their elements of x and added into y (kept in L1) in vectors, so each part reads its
    rows of the matrix once, in order; for Bᵀ, each element of y is the dot product of x
    with a row. Against OpenBLAS's GEMV on a 2-core AVX2 EPYC, each of 40 matrices from L3
    (`k × n`, both cores): 768 × 768 in 90 µs against 101, 768 × 288 in 37 against 62,
    2048 × 768 in 233 against 294; stories110M's float32 decode streamed 25.6 GB/s a token
    against 21.9, a copy's ceiling there 23-29 (benchmarks/generate.py)."""
    a, b, c = op.inputs[0], op.inputs[1], op.outputs[0]
    tb = _gemms(op)[1]
    f32 = dtypes.DT_FLOAT32

    def call(ctx, number, g: _Gemm, target: ir.Value) -> None:
        y = ctx.scratch(f"{op.name}/y", f32, c.shape[-1], ctx.b.bitcast(target, I8.as_pointer()))
        if tb:
            with ctx.loop(0, g.n, name="j") as j:
                ctx.store(y, j, row_dot(ctx, g.k, b, g.b + j * g.k, a, g.a))
            return
        columns = Row(ctx, ctx.index(0), g.n, f32)
        columns.each(lambda i, w: ctx.store(y, i, ctx.constant(f32, 0.0, w)))

        def add_rows(first: Value, count: int) -> None:
            scales = [ctx.load(a, g.a + first + r) for r in range(count)]
            columns.each(lambda i, w: ctx.store(y, i, functools.reduce(
                operator.add, (scales[r].splat(w) * ctx.load(b, g.b + (first + r) * b.shape[-1] + i, w) for r in range(count)),
                ctx.load(y, i, w))))

        whole = g.k // ROWS_AT_ONCE * ROWS_AT_ONCE
        with ctx.loop(0, whole, step=ROWS_AT_ONCE, name="p") as p:
            add_rows(p, ROWS_AT_ONCE)
        with ctx.loop(whole, g.k, name="pt") as p:
            add_rows(p, 1)

    _run_calls(ctx, op, _vector_parts(op), call, 0)


def _blas_workspace_bytes(op) -> int:
    return _partials_bytes(op, gemm_parts(op, _FLOAT_UNIT, slices=True))


@kernel("BlasGemm", MATMUL_OPS, supports=_float32_or_64, rank=110, workspace=_blas_workspace_bytes)
def blas_matmul(ctx, op) -> None:
    """One BLAS call per product, or per block of a large product's C or slice of its k
    (`gemm_parts`), the parts run over the worker pool with BLAS on one thread: BLAS's own
    pool would compete with ours for the cores, and wake for every product."""
    a, b, c = op.inputs[0], op.inputs[1], op.outputs[0]
    ta, tb = _gemms(op)[:2]
    single_threaded_blas(ctx)

    def call(ctx, number: int, g: _Gemm, target: ir.Value) -> None:
        blas = Blas(ctx, a.dtype)
        pa, pb = ctx.element_pointer(a, g.a), ctx.element_pointer(b, g.b)
        if g.m == 1:  # a vector times a matrix (a decode step)
            blas.vector_matrix(tb, g.n, g.k, pa, pb, b.shape[-1], target)
        else:
            blas.gemm(ta, tb, g.m, g.n, g.k, pa, a.shape[-1], pb, b.shape[-1], target, c.shape[-1])

    _run_calls(ctx, op, gemm_parts(op, _FLOAT_UNIT, slices=True), call, 0, fixed=lambda g: (g.m == 1,))


@kernel("LoopMatMul", MATMUL_OPS, rank=120)
def loop_matmul(ctx, op) -> None:
    """Any numeric dtype: a plain triple loop accumulating in the compute type."""
    a, b, c = op.inputs[0], op.inputs[1], op.outputs[0]
    ta, tb, m, k, n = _dims(op)
    a_cols, b_cols = a.shape[-1], b.shape[-1]
    a_size, b_size = a.shape[-2] * a_cols, b.shape[-2] * b_cols
    acc = ctx.local(c.dtype)
    for index, (oa, ob) in enumerate(_batch_offsets(c.shape[:-2], a.shape[:-2], b.shape[:-2])):
        with ctx.loop(0, m, name="m") as i, ctx.loop(0, n, name="n") as j:
            acc.set(ctx.constant(c.dtype, 0))
            with ctx.loop(0, k, name="k") as p:
                a_index = oa * a_size + (p * a_cols + i if ta else i * a_cols + p)
                b_index = ob * b_size + (j * b_cols + p if tb else p * b_cols + j)
                acc.set(acc.value + ctx.load(a, a_index) * ctx.load(b, b_index))
            ctx.store(c, index * m * n + i * n + j, acc.value)
    epilogue(ctx, op, 0, c.size // n, n)
