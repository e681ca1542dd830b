"""Averaging gradients over the ranks, in buckets, on a thread beside the backward pass.

The trainer hands over gradient buffers as soon as the backward pass has finished them
(a CheckpointedStack: one layer at a time, while the next layer's backward runs). A
thread of the reducer's own packs small buffers into buckets of about `bucket_bytes`
(one collective per bucket instead of one per tensor; a large buffer is summed in place),
sums each bucket over the ranks and writes the mean back. The compiled cells release the
GIL, so the thread's collectives run while they compute. `wait()` returns when every
submitted buffer holds its mean, and records how much of the communication the
trainer's own work hid.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import RanvierError
from .world import World

BUCKET_BYTES = 1 << 22  # 4 MiB: large enough to amortise a collective's latency, small enough to start early


@dataclass
class ReduceTimes:
    """One step's communication: the thread's busy seconds and the trainer's wait."""

    communicating: float = 0.0
    waiting: float = 0.0

    @property
    def hidden(self) -> float:
        """The share of the communication that ran while the trainer computed."""
        if self.communicating <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.waiting / self.communicating))


class GradientReducer:
    """Replaces submitted gradient buffers with their mean over the world's ranks."""

    def __init__(self, world: World, bucket_bytes: int = BUCKET_BYTES):
        self.world = world
        self.bucket_bytes = bucket_bytes
        self.times = ReduceTimes()
        self._buckets: list[np.ndarray] = []  # packing buffers, reused step after step
        self._submitted = 0  # buckets handed to the thread this step
        self._work: queue.Queue = queue.Queue()
        self._done = threading.Semaphore(0)
        self._failure: BaseException | None = None
        self._busy = 0.0
        self._thread = threading.Thread(target=self._run, name="ranvier-allreduce", daemon=True)
        self._thread.start()

    def submit(self, arrays: Sequence[np.ndarray]) -> None:
        """Start averaging these buffers (contiguous; not to be touched until `wait`)."""
        group: list[np.ndarray] = []
        size = 0
        for array in arrays:
            if not array.flags.c_contiguous:
                raise ValueError(f"the reducer sums buffers in place and needs them contiguous, got strides {array.strides}")
            if group and (size + array.nbytes > self.bucket_bytes or array.dtype != group[0].dtype):
                self._enqueue(group)
                group, size = [], 0
            group.append(array)
            size += array.nbytes
        if group:
            self._enqueue(group)

    def _enqueue(self, group: list[np.ndarray]) -> None:
        index = self._submitted
        self._submitted += 1
        if len(group) == 1:
            self._work.put((index, group, None))
            return
        elements = sum(a.size for a in group)
        if index == len(self._buckets):
            self._buckets.append(np.empty(0, group[0].dtype))
        if self._buckets[index].size != elements or self._buckets[index].dtype != group[0].dtype:
            self._buckets[index] = np.empty(elements, group[0].dtype)
        self._work.put((index, group, self._buckets[index]))

    def _run(self) -> None:
        while True:
            index, group, bucket = self._work.get()
            try:
                if self._failure is None:
                    start = time.perf_counter()
                    self._reduce(index, group, bucket)
                    self._busy += time.perf_counter() - start
            except (RanvierError, RuntimeError, ValueError) as error:  # MPI's are RuntimeErrors; wait() raises them
                self._failure = error
            self._done.release()

    def _reduce(self, index: int, group: list[np.ndarray], bucket: np.ndarray | None) -> None:
        mean = 1.0 / self.world.size
        what = f"the all-reduce of gradient bucket {index} ({sum(a.nbytes for a in group):,} bytes)"
        if bucket is None:
            (array,) = group
            self.world.sum_(array.reshape(-1), what)
            array *= mean
            return
        offset = 0
        for array in group:
            bucket[offset : offset + array.size] = array.reshape(-1)
            offset += array.size
        self.world.sum_(bucket, what)
        offset = 0
        for array in group:
            np.multiply(bucket[offset : offset + array.size].reshape(array.shape), mean, out=array)
            offset += array.size

    def wait(self) -> ReduceTimes:
        """Block until every submitted buffer holds its mean; this step's times."""
        start = time.perf_counter()
        for _ in range(self._submitted):
            self._done.acquire()
        self.times = ReduceTimes(self._busy, time.perf_counter() - start)
        self._submitted, self._busy = 0, 0.0
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        return self.times
