"""ZeRO-1: each rank keeps the optimizer state of its own share of the parameters.

Every rank still computes and averages every gradient (so clipping and the finiteness
test see the global gradient), but the update cell of rank r updates only the parameters
r owns and holds only their optimizer state: Adam's two moments, twice the parameters'
size, are split over the ranks. After the update, the owners' new values are gathered
into every rank's copy of the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .world import World


def owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank owning each parameter (by element count): largest first, each to the rank
    owning the fewest elements so far (ties to the lowest rank), so shares come out even."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return owner


class ParameterGather:
    """Copies every parameter from its owner into all ranks, one all-gather per dtype."""

    def __init__(self, world: World, params: Sequence[np.ndarray], owner: Sequence[int]):
        self.world = world
        self.groups = []
        for dtype in dict.fromkeys(p.dtype for p in params):
            # Each rank's part is its owned parameters of this dtype, in order; the whole
            # is the parts of ranks 0, 1, … one after the other.
            by_rank = [[i for i, (p, o) in enumerate(zip(params, owner)) if p.dtype == dtype and o == r] for r in range(world.size)]
            counts = [sum(params[i].size for i in group) for group in by_rank]
            self.groups.append((by_rank, counts, np.empty(counts[world.rank], dtype), np.empty(sum(counts), dtype)))

    def __call__(self, params: Sequence[np.ndarray]) -> None:
        """Gather into `params`, the parameters' arrays as they are now (in the order given
        at the start; a device's globals are fetched afresh after each update): this
        rank's own are read, every other rank's written."""
        for by_rank, counts, part, whole in self.groups:
            offset = 0
            for i in by_rank[self.world.rank]:
                part[offset : offset + params[i].size] = params[i].reshape(-1)
                offset += params[i].size
            self.world.allgather_into(part, whole, counts, f"the all-gather of the updated parameters ({whole.nbytes:,} bytes)")
            offset = 0
            for rank, group in enumerate(by_rank):
                for i in group:
                    p = params[i]
                    if rank != self.world.rank:
                        p[...] = whole[offset : offset + p.size].reshape(p.shape)
                    offset += p.size
