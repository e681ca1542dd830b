"""Attention fusion: scaled dot-product attention written out op by op, as exporters do,

    softmax(s · (c_q Q) @ (c_k Kᵀ) + addends) @ V,

becomes one Attention op, which a backend runs whole (a fused kernel that never stores
the scores) or decomposes back into its grouped GEMMs and a row softmax. A constant
causal mask (0 where key s ≤ t + S − T, −∞ elsewhere) becomes `causal`; the other
addends (a padding mask, a position bias) become the op's bias. Scalar constant factors
on Q, on Kᵀ or on the scores, and divisors, make the op's scale. A query whose every key
the mask hides then gets a row of zeros, as ONNX's Attention and PyTorch's SDPA give,
where the written-out softmax gave 0/0 = NaN.

Only a pattern whose scores and probabilities nothing else reads is fused (a training
step's backward reads them: there the op-by-op form stays), and only for queries, keys
and values of rank 4 [B, H, T, hd] or rank 3 [B·H, T, hd] (viewed as one batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import CompileError
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of
from .rewrite import erase, splice

_VIEWS = ("Reshape", "Transpose")


@dataclass
class _Match:
    """What the pattern under one probabilities-by-values MatMul holds."""

    q: Variable
    k: Variable | None  # K, or a view of it with other leading axes; None: only Kᵀ is there
    k_transposed: Variable | None  # Kᵀ, unless the product transposed K itself
    scale: float = 1.0
    addends: list[Variable] = field(default_factory=list)
    ops: list[Operation] = field(default_factory=list)  # the pattern's ops, from the softmax down

    @property
    def key(self) -> Variable:
        """K, or Kᵀ where only that is there."""
        key = self.k if self.k is not None else self.k_transposed
        if key is None:
            raise CompileError(f"attention over {self.q.name}: the pattern has neither K nor Kᵀ")
        return key

    @property
    def key_shape(self) -> list[int]:
        if self.k_transposed is None:
            return list(self.key.shape)
        kt = self.k_transposed.shape
        return [*kt[:-2], kt[-1], kt[-2]]


def fuse_attention(flow: Flow, func: Function, keep: set[str]) -> None:
    for product in [op for op in func.ops if op.type == "MatMul"]:
        if product.func is func:
            _fuse(flow, func, product, keep)


def _fuse(flow: Flow, func: Function, product: Operation, keep: set[str]) -> None:
    probabilities, guard = _unguarded(product.inputs[0], func, keep)
    softmax = _private_producer(probabilities, func, keep, readers=len(guard) + 1)
    if softmax is None or softmax.type != "Softmax" or _transposes(product) or not _over_last_axis(softmax):
        return
    match = _scores(softmax.inputs[0], func, keep)
    v = product.inputs[1]
    if match is None or match.q.rank not in (3, 4) or v.rank != match.q.rank:
        return
    scores = softmax.inputs[0]
    causal, bias = _split_addends(match.addends, scores)
    if not _shapes_fit(match, v, scores, bias):
        return
    expanded = [a.producer for a in bias if a.producer is not None and _unexpanded(a) is not a]
    b = Builder(flow, func)
    queries = b.wrap(match.q)
    if match.k is None:
        keys = b.wrap(match.key).transpose([*range(v.rank - 2), v.rank - 1, v.rank - 2])
    elif list(match.k.shape) != match.key_shape:
        keys = b.wrap(match.k).reshape(match.key_shape)
    else:
        keys = b.wrap(match.k)
    values = b.wrap(v)
    if queries.rank == 3:  # [B·H, T, hd]: one batch of B·H heads (a bias of rank 3 reads as [1, B·H, T, S])
        queries, keys, values = (x.reshape([1, *x.shape]) for x in (queries, keys, values))
    out = b.attention(queries, keys, values, _sum(b, bias), causal=causal, scale=match.scale)
    if out.rank != product.outputs[0].rank:
        out = out.reshape(product.outputs[0].shape)
    splice(flow, product, [out])
    _erase_unread(flow, [*guard, softmax, *match.ops, *expanded], keep)


def _unguarded(var: Variable, func: Function, keep: set[str]) -> tuple[Variable, list[Operation]]:
    """The probabilities under PyTorch's guard `where(p != p, 0, p)` (its exported SDPA
    zeroes the NaN rows of queries whose every key is masked), and the guard's ops; the
    fused op gives such rows zeros itself."""
    cond = _private_producer(var, func, keep)
    if cond is None or cond.type != "Cond":
        return var, []
    test, zero, p = cond.inputs
    check = _private_producer(test, func, keep)
    if check is None or check.type != "NotEqual" or list(check.inputs) != [p, p] or _one_constant(zero) != 0.0:
        return var, []
    return p, [cond, check]


def _scores(var: Variable, func: Function, keep: set[str]) -> _Match | None:
    """The pattern under the softmax's input: addends above scale factors above Q @ Kᵀ."""
    op = _private_producer(var, func, keep)
    if op is None:
        return None
    if op.type == "Add":
        for chain, addend in ((0, 1), (1, 0)):
            if list(op.inputs[chain].shape) == list(var.shape):
                match = _scores(op.inputs[chain], func, keep)
                if match is not None:
                    match.addends.append(op.inputs[addend])
                    match.ops.insert(0, op)
                    return match
        return None
    return _scaled_product(var, func, keep)


def _scaled_product(var: Variable, func: Function, keep: set[str]) -> _Match | None:
    """Q @ Kᵀ under scalar factors (no addend below a factor: it would be scaled too)."""
    op = _private_producer(var, func, keep)
    if op is None:
        return None
    scaled = _scalar_factor(op)
    if scaled is not None:
        match = _scaled_product(scaled[0], func, keep)
        if match is not None:
            match.scale *= scaled[1]
            match.ops.insert(0, op)
        return match
    if op.type != "MatMul" or attrs_of(op)["transpose_a"]:
        return None
    (q, q_scale, q_ops), (kt, k_scale, k_ops) = (_unscaled(x, func, keep) for x in op.inputs)
    if attrs_of(op)["transpose_b"]:
        return _Match(q, kt, None, q_scale * k_scale, [], [op, *q_ops, *k_ops])
    k, kt_ops = _untransposed(kt, func, keep)
    return _Match(q, k, kt, q_scale * k_scale, [], [op, *q_ops, *k_ops, *kt_ops])


def _unscaled(var: Variable, func: Function, keep: set[str]) -> tuple[Variable, float, list[Operation]]:
    """A value under the scalar factors only the product reads: (value, their product, ops)."""
    scale, ops = 1.0, []
    while (op := _private_producer(var, func, keep)) is not None and (scaled := _scalar_factor(op)) is not None:
        var, scale = scaled[0], scale * scaled[1]
        ops.append(op)
    return var, scale, ops


def _untransposed(kt: Variable, func: Function, keep: set[str]) -> tuple[Variable | None, list[Operation]]:
    """K (up to a reshape of its leading axes) when Kᵀ is K with its last two axes swapped
    by views the exporter wrote: a Transpose, maybe between Reshapes that merge or split
    the leading axes; None (the fused op transposes Kᵀ itself) otherwise."""
    ops: list[Operation] = []
    var = kt
    while (op := _private_producer(var, func, keep)) is not None and op.type in _VIEWS:
        ops.append(op)
        var = op.inputs[0]
        if list(var.shape[-2:]) == [kt.shape[-1], kt.shape[-2]] and _swaps_last_two(ops):
            return var, ops
        if len(ops) == 3:
            break
    return None, []


def _swaps_last_two(ops: list[Operation]) -> bool:
    """Whether a chain of views (from Kᵀ down) is one swap of the last two axes, the
    leading axes only merged or split around it."""
    transposes = [op for op in ops if op.type == "Transpose"]
    if len(transposes) != 1:
        return False
    perm = list(attrs_of(transposes[0])["perm"])
    rank = len(perm)
    if perm != [*range(rank - 2), rank - 1, rank - 2]:
        return False
    return all(list(op.inputs[0].shape[-2:]) == list(op.outputs[0].shape[-2:]) for op in ops if op.type == "Reshape")


def _scalar_factor(op: Operation) -> tuple[Variable, float] | None:
    """(x, c) for x · c, c · x or x / (1/c), with the constant of one element."""
    if op.type not in ("Mul", "Div") or len(op.inputs) != 2:
        return None
    x, constant = op.inputs
    if op.type == "Mul" and _one_constant(x) is not None:
        x, constant = constant, x
    value = _one_constant(constant)
    if value is None or list(x.shape) != list(op.outputs[0].shape) or (op.type == "Div" and value == 0):
        return None
    return x, value if op.type == "Mul" else 1.0 / value


def _one_constant(var: Variable) -> float | None:
    if not var.constant or var.size != 1:
        return None
    return float(np.asarray(var.data).reshape(-1)[0])


def _split_addends(addends: list[Variable], scores: Variable) -> tuple[bool, list[Variable]]:
    """(causal, the other addends): a constant causal mask among them becomes the flag."""
    for i, addend in enumerate(addends):
        if _is_causal_mask(addend, scores):
            return True, addends[:i] + addends[i + 1:]
    return False, addends


def _is_causal_mask(var: Variable, scores: Variable) -> bool:
    if not var.constant or var.rank < 2 or list(var.shape[-2:]) != list(scores.shape[-2:]):
        return False
    queries, keys = scores.shape[-2:]
    if queries > keys:
        return False
    if var.data is None:
        return False
    data = np.asarray(var.data, np.float64).reshape(-1, queries, keys)
    hidden = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
    lowest = np.finfo(var.data.dtype).min if np.issubdtype(var.data.dtype, np.floating) else -np.inf
    return bool(np.all(data[:, ~hidden] == 0) and np.all(data[:, hidden] <= lowest))


def _shapes_fit(match: _Match, v: Variable, scores: Variable, bias: list[Variable]) -> bool:
    """Q [.., T, hd], K [.., S, hd], V [.., S, hd] of one dtype and the same leading
    axes, and addends of that dtype that broadcast to the scores without growing them."""
    q, key = match.q, match.key_shape
    if not q.dtype == match.key.dtype == v.dtype == scores.dtype:
        return False
    if key != list(v.shape) or list(v.shape[:-2]) != list(q.shape[:-2]) or v.shape[-1] != q.shape[-1]:
        return False
    return all(x.dtype == scores.dtype and x.rank <= scores.rank
               and all(d in (1, n) for d, n in zip(reversed(x.shape), reversed(scores.shape))) for x in bias)


def _sum(b: Builder, addends: list[Variable]) -> Tensor | None:
    if not addends:
        return None
    total = b.wrap(_unexpanded(addends[0]))
    for addend in addends[1:]:
        total = total + b.wrap(_unexpanded(addend))
    return total


def _unexpanded(var: Variable) -> Variable:
    """A mask before the exporter broadcast it to the scores' shape (the op broadcasts)."""
    op = var.producer
    if op is not None and op.type == "BroadcastTo" and op.inputs[0].rank == var.rank:
        return op.inputs[0]
    return var


def _erase_unread(flow: Flow, ops: list[Operation], keep: set[str]) -> None:
    """Remove the pattern's ops whose results nothing reads any more, top down."""
    for op in ops:
        if op.func is not None and not any(v.consumers or v.name in keep for v in op.outputs):
            erase(flow, [op], op.outputs)


def _private_producer(var: Variable, func: Function, keep: set[str], readers: int = 1) -> Operation | None:
    """The op of `func` that computes `var`, when only the pattern reads it (`readers`
    reads) and it is no result."""
    op = var.producer
    if op is None or op.func is not func or len(var.consumers) != readers or var.name in keep or var.out:
        return None
    return op


def _over_last_axis(softmax: Operation) -> bool:
    rank = softmax.inputs[0].rank
    return bool(attrs_of(softmax)["axis"] % rank == rank - 1)


def _transposes(product: Operation) -> bool:
    attrs = attrs_of(product)
    return bool(attrs["transpose_a"] or attrs["transpose_b"])
