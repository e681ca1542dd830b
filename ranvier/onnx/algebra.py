"""Converters of ONNX's math operators beyond `converters.py`'s table: the cumulative sum and
product, Einsum, AffineGrid, Det, Hardmax and the reductions that are a formula around a sum
(ReduceL1, ReduceL2, ReduceLogSum, ReduceLogSumExp), each as the ranvier ops of its
formula.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .. import dtypes
from .converters import _axes, _over_trailing_axes
from .indexing import last_axis
from .node import Node, converts


@converts("CumSum", "CumProd")
def cumulative(node: Node):
    """Output i along the axis combines inputs j ≤ i (j < i exclusive; j ≥ i, j > i in
    reverse): x spread over a new axis of the n outputs, masked by that triangle, and
    summed or multiplied over the inputs. It costs n times the input, where a scan would
    cost it once; the sequence lengths of position ids it mostly serves keep n small."""
    x = node.tensor(0)
    axis = node.constant(1, "axis").reshape(-1)
    if axis.size != 1 or axis.dtype.kind not in "iu":
        raise node.error(f"its axis (input 1) is {axis.dtype}[{axis.size}], not one integer")
    axis = node.axis(axis[0], x.rank)
    n = x.shape[axis]
    output, source = np.arange(n)[:, None], np.arange(n)[None, :]
    exclusive, reverse = bool(node.attr("exclusive", 0)), bool(node.attr("reverse", 0))
    if reverse:
        mask = source > output if exclusive else source >= output
    else:
        mask = source < output if exclusive else source <= output
    mask = node.b.const(mask.reshape([n, n] + [1] * (x.rank - axis - 1)))
    spread = x.reshape([*x.shape[:axis], 1, *x.shape[axis:]])
    if node.proto.op_type == "CumSum":
        return node.b.select(mask, spread).sum(axis=[axis + 1])
    return node.b.cond(mask, spread, node.b.const(1, x.dtype)).product(axis=[axis + 1])


@converts("Hardmax")
def hardmax(node: Node):
    """1 at the first maximum along the axis (opset 13; before it, along the input
    flattened from the axis on), 0 elsewhere."""
    x = node.tensor(0)

    def along(t, axis: int):
        moved, back = last_axis(t, axis)
        hot = moved.argmax(axis=moved.rank - 1, keepdims=False).one_hot(moved.shape[-1], x.dtype)
        return hot if back is None else hot.transpose(back)

    if node.opset >= 13:
        return along(x, node.axis(node.attr("axis", -1), x.rank))
    return _over_trailing_axes(x, node.axis(node.attr("axis", 1), x.rank), lambda flat: along(flat, flat.rank - 1))


def _log_sum_exp(x, axes: list[int], keepdims: bool):
    """log Σ exp(x) with the largest element taken out first, so exp does not overflow
    (an infinite largest one is left in: its log-sum-exp is itself, or NaN); over no
    elements, log 0 = -inf."""
    if any(x.shape[a] == 0 for a in axes):
        return x.exp().sum(axis=axes, keepdims=keepdims).log()
    peak = x.max(axis=axes, keepdims=True)
    shift = x.builder.cond((peak - peak).equal(0.0), peak, x.builder.const(0.0, x.dtype))
    total = (x - shift).exp().sum(axis=axes, keepdims=True).log() + shift
    return total if keepdims else total.reshape([d for i, d in enumerate(x.shape) if i not in axes])


_REDUCE_FORMULAS = {
    "ReduceL1": lambda x, axes, keepdims: x.abs().sum(axis=axes, keepdims=keepdims),
    "ReduceL2": lambda x, axes, keepdims: x.sum_squares(axis=axes, keepdims=keepdims).sqrt(),
    "ReduceLogSum": lambda x, axes, keepdims: x.sum(axis=axes, keepdims=keepdims).log(),
    "ReduceLogSumExp": _log_sum_exp,
}


@converts(*_REDUCE_FORMULAS)
def reduce_formula(node: Node):
    x = node.tensor(0)
    axes = _axes(node, x.rank, 18)
    if not axes and node.attr("noop_with_empty_axes", 0):  # axes omitted or empty
        return node.b.identity(x)
    formula = _REDUCE_FORMULAS[node.proto.op_type]
    return formula(x, axes or list(range(x.rank)), bool(node.attr("keepdims", 1)))


@converts("Det")
def det(node: Node):
    """The determinant of the trailing square matrices by Leibniz's formula, the sum over
    the n! permutations of signed products; n is at most 5 (120 terms)."""
    x = node.tensor(0)
    if x.rank < 2 or x.shape[-1] != x.shape[-2] or x.dtype not in dtypes.FLOAT_DTYPES:
        raise node.error(f"its input is {x.dtype}{x.shape}; Det takes float [..., n, n]")
    n = x.shape[-1]
    if n > 5:
        raise node.error(f"matrices of {n}x{n}: ranvier's Det sums permutations, for n up to 5")
    permutations = list(itertools.permutations(range(n)))
    signs = [round(np.linalg.det(np.eye(n)[list(p)])) for p in permutations]
    picks = np.asarray([[row * n + column for row, column in enumerate(p)] for p in permutations], np.int64)
    batch = x.shape[:-2]
    columns = x.reshape([math.prod(batch), n * n]).transpose([1, 0])  # the matrices' elements first, to gather
    terms = columns.gather(node.b.const(picks)).product(axis=[1])  # [n!, batch]
    total = (terms * node.b.const(np.asarray(signs, dtypes.to_numpy(x.dtype)).reshape(-1, 1))).sum(axis=[0])
    return total.reshape(batch)


@converts("AffineGrid")
def affine_grid(node: Node):
    """The sampling grid [N, (D,) H, W, 2 or 3] of theta [N, 2, 3] (or [N, 3, 4]): each
    output point's normalized coordinates (x first), with a 1 appended, times thetaᵀ.
    The size, which sets the grid's shape, must be known at load."""
    theta = node.tensor(0)
    size = node.ints(1, "size")
    spatial = size[2:]
    k = len(spatial)
    if k not in (2, 3) or theta.shape != [size[0], k, k + 1]:
        raise node.error(f"theta of shape {theta.shape} and size {size}: AffineGrid takes [N, 2, 3] with [N, C, H, W] "
                         "or [N, 3, 4] with [N, C, D, H, W]")
    if node.attr("align_corners", 0):
        axes = [np.linspace(-1.0, 1.0, n) for n in spatial]
    else:
        axes = [(2.0 * np.arange(n) + 1.0) / n - 1.0 for n in spatial]
    points = np.meshgrid(*axes, indexing="ij")[::-1]  # x (along the last axis) first
    base = np.stack([*points, np.ones(spatial)], axis=-1).reshape(-1, k + 1)
    grid = node.b.matmul(theta, node.b.const(base.T.astype(dtypes.to_numpy(theta.dtype))))  # [N, k, points]
    return grid.transpose([0, 2, 1]).reshape([size[0], *spatial, k])


@converts("Einsum")
def einsum(node: Node):
    """Each operand's repeated letters reduced to their diagonal and its letters seen
    nowhere else summed; then the operands contracted left to right, each pair by one
    (batched) matrix product over the letters they share that nothing later needs."""
    operands = [node.tensor(i) for i in range(len(node.inputs))]
    terms, output = _einsum_terms(node, str(node.attr("equation")), [t.rank for t in operands])
    prepared = []
    for index, (t, letters) in enumerate(zip(operands, terms)):
        t, letters = _diagonal(node, t, letters)
        elsewhere = set(output).union(*(terms[j] for j in range(len(terms)) if j != index))
        alone = [i for i, letter in enumerate(letters) if letter not in elsewhere]
        if alone:
            t = t.sum(axis=alone)
            letters = [letter for i, letter in enumerate(letters) if i not in alone]
        prepared.append((t, letters))
    result, letters = prepared[0]
    for index in range(1, len(prepared)):
        later = set(output).union(*(terms[j] for j in range(index + 1, len(terms))))
        result, letters = _contract(node, (result, letters), prepared[index], later)
    if letters != output:
        result = result.transpose([letters.index(letter) for letter in output])
    return result


def _contract(node: Node, first, second, keep: set[str]):
    """Two operands (tensor, letters) as one over the letters in `keep`: a matrix
    product [batch, rows, shared] @ [batch, shared, columns] with the letters both have
    and keep as the batch, or, where a letter's sizes differ (a broadcast 1), the
    operands laid out along every letter, multiplied and the dropped letters summed."""
    (a, a_letters), (b, b_letters) = first, second
    size = dict(zip(a_letters, a.shape)) | dict(zip(b_letters, b.shape))
    batch = [c for c in a_letters if c in b_letters and c in keep]
    shared = [c for c in a_letters if c in b_letters and c not in keep]
    rows = [c for c in a_letters if c not in b_letters]
    columns = [c for c in b_letters if c not in a_letters]
    if all(a.shape[a_letters.index(c)] == b.shape[b_letters.index(c)] for c in batch + shared):
        def count(letters):
            return math.prod(size[c] for c in letters)

        left = _laid_out(a, a_letters, batch + rows + shared).reshape([count(batch), count(rows), count(shared)])
        right = _laid_out(b, b_letters, batch + shared + columns).reshape([count(batch), count(shared), count(columns)])
        together = batch + rows + columns
        return node.b.matmul(left, right).reshape([size[c] for c in together]), together
    order = batch + rows + columns + shared
    product = _laid_out(a, a_letters, order, spread=True) * _laid_out(b, b_letters, order, spread=True)
    dropped = list(range(len(order) - len(shared), len(order)))
    return (product.sum(axis=dropped) if dropped else product), order[:len(order) - len(shared)]


def _laid_out(t, letters: list[str], order: list[str], spread: bool = False):
    """t with its axes in `order`'s order; with `spread`, a 1 for each letter of `order`
    it lacks (to broadcast against the other operand)."""
    present = [c for c in order if c in letters]
    if present != letters:
        t = t.transpose([letters.index(c) for c in present])
    if spread and len(present) != len(order):
        t = t.reshape([t.shape[present.index(c)] if c in present else 1 for c in order])
    return t


def _diagonal(node: Node, t, letters: list[str]):
    """t with each letter repeated in `letters` kept once: the elements where both axes
    agree, the others masked to 0 and summed away."""
    letters = list(letters)
    for j in range(len(letters)):
        i = letters.index(letters[j])
        if i == j:
            continue
        n = t.shape[i]
        eye = np.eye(n, dtype=bool).reshape([n if axis in (i, j) else 1 for axis in range(t.rank)])
        t = node.b.select(node.b.const(eye), t).sum(axis=[j])
        letters[j] = None
    return t, [letter for letter in letters if letter is not None]


def _einsum_terms(node: Node, equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Each operand's letters and the output's, "..." spelled out as letters the equation
    does not use (as many as the operand's extra axes, aligned to the right)."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(ranks):
        raise node.error(f"equation {equation!r} has {len(terms)} operands; the node has {len(ranks)} inputs")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in equation]
    widths = [rank - len(term.replace("...", "")) if "..." in term else 0 for term, rank in zip(terms, ranks)]
    ellipsis = free[:max(widths, default=0)]
    spelled = []
    for term, width, rank in zip(terms, widths, ranks):
        head, dots, tail = term.partition("...")
        letters = list(head) + (ellipsis[len(ellipsis) - width:] if dots else []) + list(tail)
        if len(letters) != rank or not all(c.isalpha() for c in letters):
            raise node.error(f"term {term!r} of equation {equation!r} does not spell its rank-{rank} operand")
        spelled.append(letters)
    if arrow:
        head, dots, tail = output.partition("...")
        result = list(head) + (ellipsis if dots else []) + list(tail)
    else:  # numpy's implicit output: the ellipsis, then the letters seen once, alphabetically
        counts = {c: sum(t.count(c) for t in spelled) for t in spelled for c in t}
        result = ellipsis + sorted(c for c, count in counts.items() if count == 1 and c not in ellipsis)
    if any(c not in {c for t in spelled for c in t} for c in result) or len(set(result)) != len(result):
        raise node.error(f"the output of equation {equation!r} names letters no operand has, or one twice")
    return spelled, result
