"""What comes back from the device after every compute, in one copy of a few bytes.

A compute must end by reading its status words (did a kernel meet a label or index out of
range?), and a training step's host reads its loss and a flag or two after every compute.
Each of those would be a copy of its own: a driver call and a wait of several
microseconds apiece, with the arena's 64-byte alignment keeping any two of them apart. So
an instance's mailbox, a small device allocation of its own, holds both side by side:

- a status word (int64) for each step whose kernels check their data (`GPUKernel.fails`:
  a lookup, a scatter, a cross-entropy; three steps of a Llama's training step), which a
  kernel that meets bad data sets to 1. Kernels that check nothing are handed a spare word
  past the copied bytes, which they never write.
- the cell's small outputs (`SMALL_OUTPUT_BYTES` at most each: a loss, a norm, a finite
  flag, a sampled token), 8-byte aligned, which live here instead of at their arena
  offsets: every kernel that reads or writes one is handed its address here.

After each compute one copy brings the mailbox back: the status words are checked, and
each small output is written into the instance's host view, so reading it costs nothing.
Status words are zeroed once, and again only after one was found set.
"""

from __future__ import annotations

import numpy as np

from ...runtime import Cell, Slot
from .blas import Gemm
from .code import CUDACode
from .device import GPU

SMALL_OUTPUT_BYTES = 8  # an output this small (one or two scalars) comes back with the status words
WORD = 8  # bytes of a status word, and the alignment of the small outputs after them


class Mailbox:
    """An instance's status words and small outputs on the device (module docstring)."""

    def __init__(self, cell: Cell, gpu: GPU):
        self.gpu = gpu
        kernels = CUDACode.of(cell).kernels
        self.failing = [index for index in range(len(cell.steps))
                        if any(not isinstance(kernel, Gemm) and kernel.fails for kernel in kernels.get(index, []))]
        at = WORD * len(self.failing)
        self.outputs: list[tuple[Slot, int]] = []  # each small output's slot and place in the mailbox
        self.placed: dict[int, int] = {}  # arena offset of a small output (and of its views) -> place in the mailbox
        for slot in cell.slots:
            small = cell.roles.get(slot.var.name) == "output" and slot.var.nbytes <= SMALL_OUTPUT_BYTES
            if small and slot.offset not in self.placed:
                self.placed[slot.offset] = at
                self.outputs.append((slot, at))
                at += WORD
        self.host = np.zeros(at, np.uint8)  # the copied bytes: status words, then the small outputs
        self.address = gpu.allocate(at + WORD)  # and the spare status word of kernels that check nothing
        gpu.zero(self.address, at + WORD)
        self._status_words = {index: self.address + WORD * k for k, index in enumerate(self.failing)}

    def status_word(self, step: int) -> int:
        """Where step `step`'s kernels set their status word."""
        return self._status_words.get(step, self.address + self.host.nbytes)

    def address_of(self, slot: Slot) -> int | None:
        """A small output's (or a view of one's) device address, or None for any other slot."""
        place = self.placed.get(slot.offset)
        return None if place is None else self.address + place

    def receive(self, host_buffer: np.ndarray) -> int | None:
        """Copy the mailbox back (after the compute's launches), write each small output into
        `host_buffer` (the instance's) at its arena offset; the first step whose status word
        is set, or None."""
        if not self.host.nbytes:
            return None
        self.gpu.download(self.address, self.host)
        for slot, place in self.outputs:
            host_buffer[slot.offset : slot.offset + slot.var.nbytes] = self.host[place : place + slot.var.nbytes]
        words = self.host[: WORD * len(self.failing)].view(np.int64)
        failed = np.flatnonzero(words)
        if not failed.size:
            return None
        self.gpu.zero(self.address, words.nbytes)  # the next compute starts clean
        return int(self.failing[failed[0]])
