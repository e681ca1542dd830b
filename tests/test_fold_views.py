"""compiler/views.py: chains of Transposes, Gathers of one constant row and Splits, with
reshapes between them, folded into one StridedView. The strides a reshape of a strided view
takes against numpy's no-copy reshape; compiled chains against the numpy reference
(outputs filled with NaN first), and which ops remain: an attention layer's head split as
PyTorch's MultiheadAttention exports it and as GPT-2's does (a Split), a reshape no view
can take (the chain starts again after it), an intermediate read elsewhere or kept (the
chain ends there), a chain whose result reads its input across rows (left alone)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import cpu_steps_against_reference
from numpy.lib.stride_tricks import as_strided

from ranvier.compiler.views import _reshaped


def _random_view(rng: np.random.Generator) -> np.ndarray:
    """A view of a fresh array: its axes permuted, some stepped or cut."""
    shape = rng.integers(1, 5, size=rng.integers(1, 5))
    view = np.arange(math.prod(shape) * 4).reshape(*shape[:-1], shape[-1] * 4)
    view = view[..., :: rng.integers(1, 5)][..., : shape[-1]]
    return view.transpose(rng.permutation(view.ndim))


def _factorings(size: int, rng: np.random.Generator) -> tuple[int, ...]:
    """A random shape of `size` elements, size-1 axes among them."""
    shape = []
    while size > 1:
        factor = int(rng.choice([d for d in range(2, size + 1) if size % d == 0]))
        shape.append(factor)
        size //= factor
        if rng.random() < 0.2:
            shape.append(1)
    return tuple(shape) or (1,)


@pytest.mark.parametrize("seed", range(300))
def test_a_reshape_of_a_view_is_a_view_exactly_where_numpy_reshapes_without_copying(seed):
    rng = np.random.default_rng(seed)
    view = _random_view(rng)
    new_shape = _factorings(view.size, rng)
    strides = _reshaped(view.shape, tuple(s // view.itemsize for s in view.strides), new_shape)
    try:
        expected = np.reshape(view, new_shape, copy=False)
    except ValueError:
        expected = None
    if expected is None:
        assert strides is None
        return
    assert strides is not None
    flat = view.base if view.base is not None else view
    offset = (view.__array_interface__["data"][0] - flat.__array_interface__["data"][0]) // view.itemsize
    got = as_strided(flat.reshape(-1)[offset:], new_shape, [s * view.itemsize for s in strides])
    np.testing.assert_array_equal(got, expected)


def _run(build, shape):
    """The chain `build` makes of x on the CPU, against the reference; the CPU cell's op types."""
    return [step.op.type for step in cpu_steps_against_reference(build, shape, tolerance=1e-6)]  # copies exact, an exp to its last bits


def _row(f, index: int):
    return f.const(np.array(index, np.int64))


def _heads(f, qkv, which: int):
    """PyTorch's MultiheadAttention export: q, k or v of QKV [T, B, 3, D] as [B, H, T, D/H]."""
    t, b, _, d = qkv.shape
    part = f.gather(qkv.reshape([1, t, b, 3, d]).transpose([3, 1, 2, 0, 4]).reshape([3, t, b, d]), _row(f, which))
    return part.reshape([t, b * 4, d // 4]).transpose([1, 0, 2]).reshape([b, 4, t, d // 4])


def test_the_head_split_of_an_exported_attention_is_one_copy_a_head():
    """QKV's Transpose, read by three Gathers, and each Gather, its reshapes (one merging the
    batch with the heads, which no stride reads in QKV) and the head split's Transpose are
    one StridedView of QKV a head: QKV's Transpose is not made."""
    types = _run(lambda f, x: [_heads(f, x, which) for which in range(3)], [5, 2, 3, 16])
    assert types.count("StridedView") == 3 and "Gather" not in types and "Transpose" not in types


def test_a_reshape_no_view_can_take_starts_the_chain_again():
    """[4, 6] transposed, merged whole and cut into rows of 3: a row would straddle two of
    the source's columns, so no view reads it; the Transposes before and after are each
    their own copy (one each: nothing to fold)."""
    types = _run(lambda f, x: [x.transpose([1, 0]).reshape([24]).reshape([8, 3]).transpose([1, 0])], [4, 6])
    assert "StridedView" not in types and types.count("Transpose") == 2


def test_axes_merged_without_strides_and_split_again_are_a_view():
    """[4, 6] transposed and merged whole has no strides, but split back into [6, 4] and
    transposed again it reads x in order: no copy at all."""
    types = _run(lambda f, x: [x.transpose([1, 0]).reshape([24]).reshape([6, 4]).transpose([1, 0]).exp()], [4, 6])
    assert "Transpose" not in types and "StridedView" not in types


def test_a_view_that_ends_with_axes_merged_is_one_strided_view_reshaped():
    """[2, 3, 4] with its first axes swapped, merged into [6, 1, 4] and transposed: no stride
    reads the 6 in x (3 rows of 4 inside 2 of 12), so one StridedView reads [3, 2, 4] and a
    reshape (no copy) makes it [1, 6, 4]: one copy, not two Transposes."""
    types = _run(lambda f, x: [x.transpose([1, 0, 2]).reshape([24]).reshape([6, 1, 4]).transpose([1, 0, 2])], [2, 3, 4])
    assert types.count("StridedView") == 1 and "Transpose" not in types


def test_two_transposes_with_a_reshape_between_are_one_copy():
    types = _run(lambda f, x: [x.transpose([1, 0, 2]).reshape([5, 3, 2, 2]).transpose([2, 0, 1, 3])], [3, 5, 4])
    assert types == ["StridedView"]


def test_an_intermediate_read_elsewhere_is_made_and_the_chain_ends_there():
    def build(f, x):
        middle = x.transpose([1, 0, 2, 3])
        return [f.gather(middle, _row(f, 2)).transpose([1, 0, 2]), middle.exp()]

    types = _run(build, [3, 4, 5, 2])
    assert sorted(types) == ["Exp", "StridedView", "Transpose"]  # the Gather and Transpose after it: one copy


def test_a_result_in_the_middle_of_a_chain_is_made():
    def build(f, x):
        middle = x.transpose([1, 0, 2, 3])
        return [f.gather(middle, _row(f, 1)).transpose([1, 0, 2]), middle]

    types = _run(build, [3, 4, 5, 2])
    assert sorted(types) == ["StridedView", "Transpose"]


def test_a_chain_that_moves_the_innermost_axis_stays_a_chain():
    """Its Transpose is copied in tiles; a StridedView would read a column at a time."""
    types = _run(lambda f, x: [f.gather(x.transpose([2, 0, 1]), _row(f, 1)).transpose([1, 0])], [6, 4, 3])
    assert "StridedView" not in types and "Gather" in types


def test_a_split_into_heads_is_one_copy_a_part():
    """GPT-2's export: QKV Split along its features, each part's heads split by a Transpose."""

    def build(f, x):
        return [part.reshape([2, 5, 2, 4]).transpose([0, 2, 1, 3]) for part in f.split(x, [8, 8, 8], axis=-1)]

    types = _run(build, [2, 5, 24])
    assert types == ["StridedView"] * 3


def test_a_split_with_a_part_read_as_it_is_stays():
    def build(f, x):
        first, second = f.split(x, 2, axis=1)
        return [first.reshape([2, 3, 2, 4]).transpose([0, 2, 1, 3]), second.exp()]

    types = _run(build, [2, 6, 8])
    assert sorted(types) == ["Exp", "Split", "StridedView"]


def test_a_transpose_that_moves_only_axes_of_one_element_is_a_reshape():
    """At batch 1, MultiheadAttention's turn of [batch, sequence, features] to [sequence,
    batch, features] reads x in order: a reshape, no copy (nor a chain of two such)."""
    assert "Transpose" not in _run(lambda f, x: [x.transpose([1, 0, 2]).exp()], [1, 5, 4])
    assert _run(lambda f, x: [x.transpose([1, 0, 2]).reshape([5, 2, 2]).transpose([1, 0, 2]).exp()], [1, 5, 4]) == [
        "StridedView", "Exp"]
    assert "Transpose" not in _run(lambda f, x: [x.transpose([2, 1, 0, 3]).exp()], [1, 5, 1, 4])
