"""ONNX's RotaryEmbedding (opset 23): each head's first rotary_embedding_dim features
turned by their position's angles, in halves or interleaved pairs.

ranvier's Rotary op takes one cos/sin table row per position, shared by the batch, and
pairs features interleaved; ONNX's tables are read per batch item (position_ids [B, S],
or tables [B, S, D/2] given whole) and pair halves by default, so the turn is written
out as the products it is: x1·cos − x2·sin and x1·sin + x2·cos.
"""

from __future__ import annotations

from ..flow.builder import Tensor
from .node import Node, converts


def _heads_last(node: Node, x: Tensor) -> Tensor:
    """x as [B, S, heads, head size]."""
    heads = int(node.attr("num_heads", 0))
    if x.rank == 4:  # [B, heads, S, head size]
        return x.transpose([0, 2, 1, 3])
    if x.rank != 3 or heads < 1 or x.shape[2] % heads:
        raise node.error(f"its input of shape {x.shape} is not [B, heads, S, head size], nor [B, S, hidden] with "
                         f"num_heads ({heads}) dividing hidden")
    return x.reshape([*x.shape[:2], heads, x.shape[2] // heads])


def _tables(node: Node, batch: int, length: int, half: int) -> tuple[Tensor, Tensor]:
    """cos and sin of each item's positions, [B, S, 1, half] (one row for every head)."""
    tables = []
    positions = node.tensor(3) if node.optional(3) is not None else None
    for index, name in ((1, "cos_cache"), (2, "sin_cache")):
        table = node.tensor(index)
        if positions is not None:
            if table.rank != 2 or table.shape[1] != half or positions.shape != [batch, length]:
                raise node.error(f"its {name} of shape {table.shape} with position_ids of shape {positions.shape} is "
                                 f"not [positions, {half}] read at [{batch}, {length}] positions")
            table = node.b.gather(table, positions)
        elif table.shape != [batch, length, half]:
            raise node.error(f"its {name} of shape {table.shape} is not [{batch}, {length}, {half}] "
                             "(one row per token, without position_ids)")
        tables.append(table.reshape([batch, length, 1, half]))
    return tables[0], tables[1]


@converts("RotaryEmbedding")
def rotary_embedding(node: Node):
    x = node.tensor(0)
    work = _heads_last(node, x)
    batch, length, heads, size = work.shape
    rotated = int(node.attr("rotary_embedding_dim", 0)) or size
    if rotated % 2 or rotated > size:
        raise node.error(f"rotary_embedding_dim {rotated} is not an even number of at most the head size {size}")
    half = rotated // 2
    cos, sin = _tables(node, batch, length, half)
    turned = work if rotated == size else node.b.slice(work, [0, 0, 0, 0], [batch, length, heads, rotated])
    interleaved = bool(node.attr("interleaved", 0))
    if interleaved:
        first, second = (p.reshape([batch, length, heads, half])
                         for p in turned.reshape([batch, length, heads, half, 2]).split(2, axis=4))
    else:
        first, second = turned.split(2, axis=3)
    real, imaginary = first * cos - second * sin, first * sin + second * cos
    if interleaved:
        pairs = [t.reshape([batch, length, heads, half, 1]) for t in (real, imaginary)]
        y = node.b.concat(pairs, 4).reshape([batch, length, heads, rotated])
    else:
        y = node.b.concat([real, imaginary], 3)
    if rotated < size:
        kept = node.b.slice(work, [0, 0, 0, rotated], [batch, length, heads, size - rotated])
        y = node.b.concat([y, kept], 3)
    return y.transpose([0, 2, 1, 3]) if x.rank == 4 else y.reshape(x.shape)
