"""The AMX bfloat16 GEMM (ranvier/backends/cpu/amx.py), called through ctypes on numpy arrays.

Each product is checked against a float64 product of the bfloat16-rounded inputs: the
kernel's only other error is float32 accumulation, so the error bound is a small multiple
of float32 precision times |op(A)|·|op(B)|. Every operand sits inside a bigger buffer whose
surroundings are NaN (inputs) or a sentinel (C): a read outside op(A) or op(B) would turn
results into NaN, a write outside C's m × n region would change the sentinel, and C starts
as NaN so that an element never written shows.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_within_bound

from ranvier.backends.cpu import amx
from ranvier.backends.cpu.target import host_target
from ranvier.errors import RanvierError

pytestmark = pytest.mark.skipif(
    not amx.amx_usable(host_target()),
    reason="needs AMX-TILE, AMX-BF16 and AVX512-BF16, and Linux's permission for the AMX tile state",
)

SHAPES = [  # m, n, k
    (1, 1, 1), (1, 7, 3), (16, 16, 32), (17, 33, 65), (31, 47, 100),
    (128, 256, 784), (100, 10, 256), (256, 784, 128), (2048, 288, 768),
    (33, 49, 1000),  # several slices of k (each adding to C) with edge tiles
    (40, 2090, 600),  # B in two chunks (of up to 1 MiB packed), the second one odd
]
TRANSPOSES = [(False, False), (True, False), (False, True), (True, True)]
SENTINEL = np.float32(-7.25)
RTOL = 1e-5  # of the elementwise bound |op(A)|·|op(B)|: float32 accumulation, with slack


@pytest.fixture(scope="module")
def gemm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        # Generated code goes to a cache of this test session, never the user's.
        patch.setenv("RANVIER_CACHE", str(tmp_path_factory.getbasetemp() / "ranvier-cache"))
        return amx.GEMM_CTYPE(amx.gemm_address(host_target()))


def embedded(rng: np.random.Generator, rows: int, columns: int, pad: int) -> np.ndarray:
    """A random normal rows × columns matrix, a view into a buffer with `pad` NaN columns
    on the right and a NaN row above and below."""
    buffer = np.full((rows + 2, columns + pad), np.nan, np.float32)
    buffer[1:-1, :columns] = rng.standard_normal((rows, columns))
    return buffer[1:-1, :columns]


def multiply(gemm, ta: bool, tb: bool, m: int, n: int, k: int, pad: int = 0, seed: int = 0) -> None:
    """Run the kernel on random operands (leading dimensions `pad` beyond their rows) and
    check C and everything around it."""
    rng = np.random.default_rng(seed)
    a = embedded(rng, *((k, m) if ta else (m, k)), pad)
    b = embedded(rng, *((n, k) if tb else (k, n)), pad)
    c_buffer = np.full((m + 2, n + pad), SENTINEL, np.float32)
    c_buffer[1:-1, :n] = np.nan
    c = c_buffer[1:-1, :n]
    # A deliberately misaligned workspace: the kernel aligns it itself.
    workspace = np.empty(amx.workspace_bytes(m, n, k) + 1, np.uint8)
    gemm(int(ta), int(tb), m, n, k,
         a.ctypes.data, a.strides[0] // 4, b.ctypes.data, b.strides[0] // 4, c.ctypes.data, c.strides[0] // 4,
         workspace.ctypes.data + 1)

    def rounded(x: np.ndarray, transpose: bool) -> np.ndarray:
        x = x.astype(ml_dtypes.bfloat16).astype(np.float64)
        return x.T if transpose else x

    op_a, op_b = rounded(a, ta), rounded(b, tb)
    assert not np.isnan(c).any(), "elements of C left unwritten"
    assert_within_bound(c, op_a @ op_b, np.abs(op_a) @ np.abs(op_b), RTOL, slack=0.0, what="C")
    outside = np.ones(c_buffer.shape, bool)
    outside[1:-1, :n] = False
    assert (c_buffer[outside] == SENTINEL).all(), "written outside C"


@pytest.mark.parametrize("ta,tb", TRANSPOSES, ids=["NN", "TN", "NT", "TT"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_float64_product_of_rounded_inputs(gemm, m, n, k, ta, tb):
    multiply(gemm, ta, tb, m, n, k)


@pytest.mark.parametrize("ta,tb", TRANSPOSES, ids=["NN", "TN", "NT", "TT"])
@pytest.mark.parametrize("m,n,k,pad", [(1, 7, 3, 1), (17, 33, 65, 5), (31, 47, 100, 16), (100, 10, 256, 3),
                                       (20, 36, 800, 7)])
def test_leading_dimensions_beyond_the_rows(gemm, m, n, k, pad, ta, tb):
    multiply(gemm, ta, tb, m, n, k, pad=pad, seed=1)


def test_workspace_bytes():
    # Alignment, then A and B padded to 16 rows or columns and 32 values of k, 2 bytes each.
    assert amx.workspace_bytes(1, 1, 1) == 64 + (16 + 16) * 32 * 2
    assert amx.workspace_bytes(17, 33, 65) == 64 + (32 + 48) * 96 * 2
    # One slice of k (1000 values: two slices of 512) for A and B.
    assert amx.workspace_bytes(33, 49, 1000) == 64 + (48 + 64) * 512 * 2
    # A slice of k (600 values: two slices of 320), and one chunk of B: 102 panels fit in 1 MiB.
    assert amx.workspace_bytes(40, 2090, 600) == 64 + (48 + 102 * 16) * 320 * 2


def test_refuses_a_target_without_amx():
    assert not amx.amx_usable(host_target("-avx512"))
    with pytest.raises(RanvierError, match="AMX"):
        amx.gemm_address(host_target("-avx512"))
