"""Conv-pool fusion: a Conv2DCalculate of one output (a convolution and its epilogue: a
folded batch norm's scale and shift, a ReLU) whose output only a MaxPool reads becomes one
Conv2DCalculateMaxPool, so a backend can pool the convolution's output in bands while they
are in cache and never store the whole of it: ResNet-18's stem at batch 32 writes 102 MB
that the pooling reads back.

It applies only where the convolution's output is read by nothing else: in a training
step the max pool's gradient and the epilogue's (a ReLU's) read it too, so the pass leaves
training steps alone. A backend says which pairs it runs so (`Capabilities.pools_convolution`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..flow.graph import Flow, Function, Operation
from ..ops.fused import CONV_CALCULATE, CONV_POOL, conv_pool_attrs
from .rewrite import fuse


def fuse_conv_pools(flow: Flow, func: Function, keep: set[str], accepts: Callable[[Operation, Operation], bool]) -> None:
    """Replace each Conv2DCalculate and the MaxPool that alone reads its one output by one
    Conv2DCalculateMaxPool, where `accepts(convolution, pool)`."""
    for conv in [op for op in func.ops if op.type == CONV_CALCULATE]:
        product = conv.outputs[0]
        if len(conv.outputs) != 1 or product.name in keep or product.out or len(product.consumers) != 1:
            continue
        pool = product.consumers[0]
        if pool.type != "MaxPool" or pool.func is not func or not accepts(conv, pool):
            continue
        fuse(flow, func, [conv, pool], CONV_POOL, conv.inputs, pool.outputs, conv_pool_attrs(conv.attrs, pool.attrs),
             dropped=[product])
