"""The most memory ranvier allocates for one thing whose size it was given rather than
chose: a value an ONNX model computes at load, a cell's instance, a model's parameters
from a run's config. A size past the limit is refused before anything is allocated, with
an error naming what asked for it: a 100-byte file claiming a 4 TB tensor gets one line,
not the operating system swapping, its OOM killer, or numpy's MemoryError traceback.

`RANVIER_MAX_MEMORY_MB` sets the limit. By default it is half the machine's memory: one
allocation larger than that leaves too little for the copies beside it (a model's weights
are read, then held by the network; an instance sits beside its inputs), so it would end
in swapping or the OOM killer anyway, while everything that can run stays allowed.
"""

from __future__ import annotations

import os

from .errors import RanvierError

ENVIRONMENT = "RANVIER_MAX_MEMORY_MB"
FALLBACK_BYTES = 8 << 30  # where the operating system does not say how much memory it has


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_BYTES


def memory_limit() -> int:
    """The most bytes of one allocation sized by a file or a config (see the module's doc)."""
    setting = os.environ.get(ENVIRONMENT)
    if setting is None:
        return physical_memory() // 2
    try:
        megabytes = float(setting)
    except ValueError:
        megabytes = -1.0
    if not megabytes > 0 or megabytes == float("inf"):
        raise RanvierError(f"{ENVIRONMENT}={setting!r} is not a positive number of megabytes")
    return int(megabytes * 2**20)


def byte_size(nbytes: int) -> str:
    """1536 → "1.5 KiB": a size for a message."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    power = min((nbytes.bit_length() - 1) // 10, 5)
    return f"{nbytes / 1024**power:.2f}".rstrip("0").rstrip(".") + f" {'KMGTP'[power - 1]}iB"


def check_allocation(nbytes: int, what: str, error: type[RanvierError] = RanvierError) -> None:
    """Refuse `what` (naming the node, variable or config fields it comes from, e.g. "ONNX
    node 'x' (Expand, opset 17): its output 'y', float32[10x10]") when its `nbytes` are
    past the limit."""
    limit = memory_limit()
    if nbytes > limit:
        raise error(f"{what}: {byte_size(nbytes)}, past ranvier's memory limit of {byte_size(limit)} ({ENVIRONMENT} sets it)")
