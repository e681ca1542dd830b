"""ONNX's DepthToSpace and SpaceToDepth: blocks of channels moved to and from blocks of
pixels, each one reshape, transpose and reshape."""

from __future__ import annotations

from .node import Node, converts

# Where the block's two axes and the channels sit after the reshape, by mode: DCR
# (depth, column, row: the block outermost) or CRD (the channels outermost).
_DEPTH_TO_SPACE = {"DCR": [0, 3, 4, 1, 5, 2], "CRD": [0, 1, 4, 2, 5, 3]}
_SPACE_TO_DEPTH = {"DCR": [0, 3, 5, 1, 2, 4], "CRD": [0, 1, 3, 5, 2, 4]}


def _block(node: Node) -> int:
    size = int(node.attr("blocksize"))
    if size < 1:
        raise node.error(f"blocksize {size} must be at least 1")
    return size


def _mode(node: Node) -> str:
    mode = node.attr("mode", "DCR")
    if mode not in _DEPTH_TO_SPACE:
        raise node.error(f"mode {mode!r} is not DCR or CRD")
    return mode


@converts("DepthToSpace")
def depth_to_space(node: Node):
    x, b, mode = node.tensor(0), _block(node), _mode(node)
    if x.rank != 4 or x.shape[1] % (b * b):
        raise node.error(f"its input of shape {x.shape} is not [N, C, H, W] with C divisible by blocksize² ({b * b})")
    n, c, h, w = x.shape
    split = [n, b, b, c // (b * b), h, w] if mode == "DCR" else [n, c // (b * b), b, b, h, w]
    return x.reshape(split).transpose(_DEPTH_TO_SPACE[mode]).reshape([n, c // (b * b), h * b, w * b])


@converts("SpaceToDepth")
def space_to_depth(node: Node):
    x, b, mode = node.tensor(0), _block(node), _mode(node)
    if x.rank != 4 or x.shape[2] % b or x.shape[3] % b:
        raise node.error(f"its input of shape {x.shape} is not [N, C, H, W] with H and W divisible by blocksize {b}")
    n, c, h, w = x.shape
    blocks = x.reshape([n, c, h // b, b, w // b, b]).transpose(_SPACE_TO_DEPTH[mode])
    return blocks.reshape([n, c * b * b, h // b, w // b])
