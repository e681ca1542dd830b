"""Transposes of leading axes moved across the products by a matrix next to them, into the
chains of views that fold-views makes one copy of.

x · B multiplies each row of x (its last axis) by the matrix B, and adding a bias row works
row by row too, so permuting x's leading axes permutes the result's the same way:
(Transpose x) · B = Transpose (x · B). PyTorch's MultiheadAttention at batch > 1 turns its
input [B, T, D] into [T, B, D] before the QKV product and its output back after the output
projection: two copies of the activations a layer (12.6 MB each in BERT-base at batch 32).
Moved below the QKV product and its bias, the first Transpose becomes the start of the head
split's chain of views; moved above the output projection, the second joins the chain that
merges the heads back (a Transpose and reshapes), and each chain is then one copy.

A Transpose is moved only where it lands right before an op that continues a chain of views
(a reshape, a Transpose, a Gather of one constant row, a Split): elsewhere it would stay a
copy of its own, and past the product it would copy the product's wider rows.
"""

from __future__ import annotations

from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of, is_view
from .rewrite import erase, splice

_ROW_WISE = ("Add", "Sub", "Mul", "Div")  # with an operand that is one row (a bias), broadcast over the leading axes


def move_transposes_past_products(flow: Flow, func: Function, keep: set[str]) -> None:
    """Sink each Transpose of leading axes below the products and bias rows that read it,
    and lift each one of a product's result above the product, where it then meets a chain
    of views (see the module)."""
    for op in [op for op in flow.op_order(func) if op.type == "Transpose"]:
        if op.func is func and _leading(op) is not None and not _sink(flow, func, op, keep):
            _lift(flow, func, op, keep)


def _leading(op: Operation) -> list[int] | None:
    """The Transpose's permutation, where it leaves the last axis in place, else None."""
    rank = op.inputs[0].rank
    perm = list(attrs_of(op)["perm"] or reversed(range(rank)))
    return perm if rank >= 2 and perm[-1] == rank - 1 else None


def _only_reader(var: Variable, func: Function, keep: set[str]) -> Operation | None:
    """The one op of `func` that reads `var`, where `var` is no result."""
    if len(var.consumers) != 1 or var.name in keep or var.out:
        return None
    (reader,) = var.consumers
    return reader if reader.func is func else None


def _row_product(op: Operation, x: Variable) -> bool:
    """Whether `op` is x · B for a matrix B, x's rows as they are."""
    attrs = attrs_of(op)
    return (op.type == "MatMul" and op.inputs[0] is x and op.inputs[1] is not x and op.inputs[1].rank == 2
            and not attrs["transpose_a"] and x.rank >= 2)


def _row_wise(op: Operation, x: Variable) -> bool:
    """Whether `op` combines x element by element with one row (a bias), giving x's shape."""
    if op.type not in _ROW_WISE or len(op.inputs) != 2 or op.outputs[0].shape != x.shape:
        return False
    others = [v for v in op.inputs if v is not x]
    return len(others) == 1 and others[0].rank <= x.rank and all(size == 1 for size in others[0].shape[:-1])


def _continues_views(op: Operation, x: Variable) -> bool:
    """Whether `op` reads x as a chain of views continues it (fold-views' ops)."""
    if op.inputs[0] is not x:
        return False
    if is_view(op) or op.type in ("Transpose", "Split"):
        return True
    return op.type == "Gather" and len(op.inputs) == 2 and op.inputs[1].rank == 0


def _sink(flow: Flow, func: Function, transpose: Operation, keep: set[str]) -> bool:
    """Move the Transpose below the products and bias rows that read it, one after another,
    where it then lands before an op that continues a chain of views."""
    perm = _leading(transpose)
    path, x = [], transpose.outputs[0]
    while (reader := _only_reader(x, func, keep)) is not None and (_row_product(reader, x) or _row_wise(reader, x)):
        path.append(reader)
        x = reader.outputs[0]
    landing = _only_reader(x, func, keep)
    if not path or landing is None or not _continues_views(landing, x):
        return False
    b = Builder(flow, func)
    value = b.wrap(transpose.inputs[0])
    moved = transpose.outputs[0]
    for op in path:
        inputs = [value.var if v is moved else v for v in op.inputs]
        value = b.wrap(b.op(op.type, inputs, None, dict(op.attrs)).var)
        moved = op.outputs[0]
    splice(flow, path[-1], [value.transpose(perm)])
    erase(flow, [*reversed(path[:-1]), transpose], [transpose.outputs[0], *(op.outputs[0] for op in path[:-1])])
    return True


def _lift(flow: Flow, func: Function, transpose: Operation, keep: set[str]) -> bool:
    """Move the Transpose of a product's result (or of a reshape of it that keeps its rows)
    above the product, where the product's x comes from a chain of views."""
    y = transpose.inputs[0]
    reshape = y.producer if y.producer is not None and y.producer.type == "Reshape" else None
    product_out = reshape.inputs[0] if reshape is not None else y
    product = product_out.producer
    if (product is None or product.func is not func or product.type != "MatMul" or _only_reader(y, func, keep) is None
            or _only_reader(product_out, func, keep) is None or not _row_product(product, product.inputs[0])):
        return False
    x = product.inputs[0]
    if x.producer is None or not (is_view(x.producer) or x.producer.type == "Transpose") or y.shape[-1] != product_out.shape[-1]:
        return False
    b = Builder(flow, func)
    rows: Tensor = b.wrap(x)
    if list(x.shape[:-1]) != list(y.shape[:-1]):
        rows = rows.reshape([*y.shape[:-1], x.shape[-1]])
    lifted = b.op("MatMul", [rows.transpose(_leading(transpose)).var, product.inputs[1]], None, dict(product.attrs))
    splice(flow, transpose, [lifted])
    erase(flow, [op for op in (reshape, product) if op is not None], list(dict.fromkeys([y, product_out])))
    return True
