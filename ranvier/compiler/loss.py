"""Loss fusion: a training step's cross-entropy and its gradient read the same logits, so
the gradient op also computes the loss (its `with_loss` second output) and the forward
op goes: one read of the logits instead of two (131 MB per stories15M step)."""

from __future__ import annotations

from ..flow.graph import Flow, Function, Operation
from .rewrite import depends_on


def _key(op: Operation) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    return op.inputs[0].name, op.inputs[1].name, tuple(sorted(op.attrs.items()))


def fuse_loss_with_gradient(flow: Flow, func: Function) -> None:
    """Only where the gradient's upstream value does not itself depend on the loss."""
    forward = {_key(op): op for op in func.ops if op.type == "SoftmaxCrossEntropy"}
    for op in list(func.ops):
        if op.type != "SoftmaxCrossEntropyGrad" or len(op.outputs) != 1:
            continue
        loss_op = forward.get(_key(op))
        if loss_op is None or depends_on(op.inputs[2], loss_op.outputs[0], func):
            continue
        del forward[_key(op)]  # one gradient op takes the loss over
        loss = loss_op.outputs[0]
        flow.remove_op(loss_op)
        op.set_attr("with_loss", True)
        op.add_output(loss)
