"""LM-head chunking: a training step's logits = x·W (or x·Wᵀ, a tied embedding) feeding a
softmax cross-entropy are computed a chunk of rows at a time, so the [tokens, vocab]
logits and their gradient are never stored whole (the fused linear cross-entropy of LLM
trainers). Per chunk of rows, in order:

    logits_c = x_c · W          its per-example loss, and d logits_c (one row pass)
    d x_c    = d logits_c · Wᵀ   (the rows of d x)
    d W     += d logits_cᵀ · x_c

each an op every backend already runs (its GEMM, cuBLASLt on the GPU; the cross-entropy
row kernel), so the memory plan needs a chunk's logits and gradient, not the whole step's
(stories110M at 32 × 1,024 tokens, bf16: 2.9 GiB less on the GPU, in 8 chunks). The chunks' losses and
d x rows are joined after (tokens and tokens × dim: small beside the logits). Each chunk
reads and writes d W once more: `chunk_rows` keeps chunks large enough to repay it.

Only a step whose logits nothing else reads (not an output: a step that returns them,
generation's, keeps the op-by-op form), whose logits' gradient only the head's two
products read, and where the loss's gradient does not itself depend on the loss."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import dtypes
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Function, Operation, Variable
from ..ops import attrs_of, is_view
from .rewrite import depends_on, erase, splice

# The logits of one chunk take at most about this many bytes (float32: 2,048 rows of a
# 32,000-word vocabulary). On the CPU each chunk's products run 2-4% slower than the
# whole head's with bf16 products (stories15M, batch 16, chunks of 2,048 rows: 0.97 of the
# unchunked step's tokens/s; batch 8 in 576-row chunks 0.95-0.97), so only logits past
# this size are chunked, where memory counts more...
CHUNK_BYTES = 256 << 20
# ...and a chunk has at least this many rows per feature of x: each chunk reads and writes
# d W (vocab × dim floats) once more, which fewer rows would not repay.
ROWS_PER_FEATURE = 2


def chunk_rows(rows: int, vocab: int, dim: int, itemsize: int) -> int:
    """Rows per chunk for `rows` logits of `vocab` classes from `dim` features: whole
    multiples of 64 within `CHUNK_BYTES`, at least `ROWS_PER_FEATURE` · dim; `rows`
    itself (one chunk: no rewrite) where the logits are no larger than a chunk."""
    budget = max(64, CHUNK_BYTES // (vocab * itemsize) // 64 * 64)
    return min(rows, max(budget, ROWS_PER_FEATURE * dim))


def _base(var: Variable, func: Function) -> tuple[Variable, list[Operation]]:
    """The variable `var` views (through reshapes), and the view ops between them."""
    views = []
    while var.producer is not None and var.producer.func is func and is_view(var.producer):
        views.append(var.producer)
        var = var.producer.inputs[0]
    return var, views


def _readers(var: Variable, func: Function) -> tuple[list[Operation], list[Operation]]:
    """The ops of func reading `var` other than views, through its views; and those views."""
    found, views = [], []
    for consumer in var.consumers:
        if consumer.func is not func:
            continue
        if is_view(consumer):
            views.append(consumer)
            more, deeper = _readers(consumer.outputs[0], func)
            found += more
            views += deeper
        else:
            found.append(consumer)
    return found, views


@dataclass
class _Head:
    """A matched LM head: the logits' product, the loss and its gradient, and the products
    reading the gradient (`rows_of`: a block of d x's rows per chunk; `summed`: a sum over
    the chunks, d W)."""

    product: Operation
    loss: Operation | None
    gradient: Operation
    rows_of: list[Operation] = field(default_factory=list)
    summed: list[Operation] = field(default_factory=list)
    views: list[Operation] = field(default_factory=list)  # of the logits and of their gradient

    @property
    def x(self) -> Variable:
        return self.product.inputs[0]

    @property
    def dim(self) -> int:
        return self.x.shape[-1]


def _match(gradient: Operation, func: Function, keep: set[str]) -> _Head | None:
    logits, target, upstream = gradient.inputs
    source, _ = _base(logits, func)
    product = source.producer
    if (product is None or product.func is not func or product.type != "MatMul" or attrs_of(product)["transpose_a"]
            or product.inputs[1].rank != 2 or logits.rank != 2 or logits.shape[0] != product.inputs[0].size // product.inputs[0].shape[-1]):
        return None
    readers, views = _readers(source, func)
    losses = [op for op in readers if op.type == "SoftmaxCrossEntropy" and list(op.inputs) == [logits, target]
              and op.attrs == {k: v for k, v in gradient.attrs.items() if k != "with_loss"}]
    if sorted(map(id, readers)) != sorted(map(id, [gradient, *losses])) or len(losses) > 1 or len(gradient.outputs) != 1:
        return None
    loss = losses[0] if losses else None
    if loss is not None and depends_on(upstream, loss.outputs[0], func):
        return None
    head = _Head(product, loss, gradient, views=views)
    products, grad_views = _readers(gradient.outputs[0], func)
    head.views += grad_views
    if any(v.name in keep for op in [product, gradient, *head.views] for v in op.outputs):
        return None
    x_base = _base(head.x, func)[0]
    for op in products:
        kind = _kind(op, gradient.outputs[0], x_base, func)
        if kind is None:
            return None
        (head.rows_of if kind == "rows" else head.summed).append(op)
    return head


def _kind(op: Operation, grad: Variable, x: Variable, func: Function) -> str | None:
    """How a product reads the logits' gradient [rows, vocab]: "rows" (d logits · B: a row
    of its output per row), "summed" (contracting over the rows with x's rows: d W), or
    None (any other product, or another op: the head is left as it is)."""
    if op.type != "MatMul":
        return None
    attrs = attrs_of(op)
    bases = [_base(v, func)[0] for v in op.inputs]
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    if bases[0] is grad and bases[1] is not grad and bases[1] is not x and not ta and op.inputs[1].rank == 2:
        return "rows" if op.inputs[0].shape[-1] == grad.shape[1] else None
    flat = all(v.rank == 2 for v in op.inputs)
    if flat and bases == [grad, x] and ta and not tb and op.inputs[1].shape[0] == grad.shape[0]:
        return "summed"
    if flat and bases == [x, grad] and ta and not tb and op.inputs[0].shape[0] == grad.shape[0]:
        return "summed"
    return None


def chunk_lm_head(flow: Flow, func: Function, keep: set[str]) -> None:
    """Chunk each LM head of `func` (module docstring) whose logits exceed a chunk; `keep`
    names the variables that must stay visible."""
    for gradient in [op for op in func.ops if op.type == "SoftmaxCrossEntropyGrad"]:
        head = _match(gradient, func, keep) if gradient.func is func else None
        if head is None:
            continue
        rows, vocab = gradient.inputs[0].shape
        step = chunk_rows(rows, vocab, head.dim, dtypes.itemsize(gradient.inputs[0].dtype))
        if step < rows:
            _chunk(flow, func, head, step)


def _rows(t: Tensor, first: int, count: int) -> Tensor:
    sliced: Tensor = t.builder.slice(t, begin=[first, *[0] * (t.rank - 1)], size=[count, *t.shape[1:]])
    return sliced


def _chunk(flow: Flow, func: Function, head: _Head, step: int) -> None:
    b = Builder(flow, func)
    logits, target, upstream = (b.wrap(v) for v in head.gradient.inputs)
    rows = logits.shape[0]
    x = b.wrap(head.x)
    if x.rank != 2:
        x = x.reshape([rows, head.dim])
    weight = b.wrap(head.product.inputs[1])
    grad_base = head.gradient.outputs[0]
    losses: list[Tensor] = []
    blocks: list[list[Tensor]] = [[] for _ in head.rows_of]
    sums: list[Tensor | None] = [None] * len(head.summed)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        x_c, target_c, upstream_c = (_rows(t, first, count) for t in (x, target, upstream))
        logits_c = b.op("MatMul", [x_c, weight], None, dict(head.product.attrs))
        if head.loss is not None:
            losses.append(b.op("SoftmaxCrossEntropy", [logits_c, target_c], None, dict(head.loss.attrs)))
        grad_c = b.op("SoftmaxCrossEntropyGrad", [logits_c, target_c, upstream_c], None, dict(head.gradient.attrs))
        for k, op in enumerate(head.rows_of):
            blocks[k].append(b.op("MatMul", [grad_c, b.wrap(op.inputs[1])], None, dict(op.attrs)))
        for k, op in enumerate(head.summed):
            operands = [grad_c if _base(v, func)[0] is grad_base else x_c for v in op.inputs]
            part = b.op("MatMul", operands, None, dict(op.attrs))
            total = sums[k]
            sums[k] = part if total is None else total + part
    if head.loss is not None:
        splice(flow, head.loss, [b.concat(losses, axis=0)])
    for op, parts in zip(head.rows_of, blocks):
        splice(flow, op, [b.concat(parts, axis=0).reshape(op.outputs[0].shape)])
    for op, total in zip(head.summed, sums):
        if total is not None:
            splice(flow, op, [total])
    dropped = [head.product, *head.views, head.gradient]
    erase(flow, dropped, [v for op in dropped for v in op.outputs])

