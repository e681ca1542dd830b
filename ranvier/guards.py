"""Guard bytes around the memory kernels write: a test mode that catches a kernel writing
outside its buffer where it happens, rather than as a heap corrupted later or not at all.

With `RANVIER_GUARD_BYTES=1` every buffer `allocate` makes (an instance's data, each
global, the CUDA host emulator's device memory) has `GUARD` bytes of `PATTERN` on either
side, and `check()`, which every compute calls, raises `GuardBytesOverwritten` naming the
buffer whose guard bytes changed. A write a whole row before or after a buffer lands in
its guard; one far beyond it may still crash the process, which a test catches by
running the kernel in a child process. Without the variable nothing is guarded and
`check()` returns at once.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import numpy as np

from .errors import RanvierError

ENVIRONMENT = "RANVIER_GUARD_BYTES"
GUARD = 4096  # bytes on each side: a few rows of any tensor a test writes
PATTERN = 0xA5  # no float a kernel computes is likely to be all 0xA5 bytes


class GuardBytesOverwritten(RanvierError):
    """A kernel wrote outside the buffer it was given."""


@dataclass
class _Guarded:
    block: weakref.ref  # the whole allocation: guard, padding, the buffer, guard
    start: int  # where the buffer begins in it
    nbytes: int
    what: str


_guarded: list[_Guarded] = []


def enabled() -> bool:
    return os.environ.get(ENVIRONMENT, "") not in ("", "0")


def allocate(nbytes: int, alignment: int, fill: int = 0, what: str = "a buffer") -> np.ndarray:
    """`nbytes` bytes of `fill` starting on an `alignment` boundary (numpy promises only 16),
    with guard bytes on either side in the test mode; `what` names the buffer in an error."""
    guard = GUARD if enabled() else 0
    size = guard + nbytes + alignment + guard
    block = np.zeros(size, np.uint8) if fill == 0 else np.full(size, fill, np.uint8)  # zeros: pages untouched until written
    start = guard + (-(block.ctypes.data + guard)) % alignment
    if guard:
        block[:start] = PATTERN
        block[start + nbytes :] = PATTERN
        _guarded.append(_Guarded(weakref.ref(block), start, nbytes, what))
    return block[start : start + nbytes]


def check() -> None:
    """Raise if a kernel wrote into the guard bytes of a live buffer; the guards are
    restored, so the next check reports only new damage."""
    damaged = []
    for guarded in list(_guarded):
        block = guarded.block()
        if block is None:
            _guarded.remove(guarded)
            continue
        end = guarded.start + guarded.nbytes
        before = np.flatnonzero(block[: guarded.start] != PATTERN)
        after = np.flatnonzero(block[end:] != PATTERN)
        if before.size or after.size:
            where = []
            if before.size:
                where.append(f"{guarded.start - before[0]} bytes before it")
            if after.size:
                where.append(f"{after[-1] + 1} bytes after it")
            damaged.append(f"{guarded.what} ({guarded.nbytes} bytes; written up to {' and '.join(where)})")
            block[: guarded.start] = PATTERN
            block[end:] = PATTERN
    if damaged:
        raise GuardBytesOverwritten(f"a kernel wrote outside its memory: the guard bytes of {'; '.join(damaged)} changed")
