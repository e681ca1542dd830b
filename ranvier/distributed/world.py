"""The processes of a data-parallel run and the collectives between them.

A `World` is one process's view of the run: its rank, how many ranks there are, which of
them share its machine, and the few collectives training needs (sum in place, gather
buffers, share small Python values, wait for everyone). The single-process world does
nothing and costs nothing, so trainers call the same methods with or without MPI.

`MPIWorld` runs them on MPI (mpi4py over MPICH, Open MPI or the system's MPI). Every
collective is started non-blocking and waited for with a deadline: a rank that died or
hangs turns into a `WorkerLost` error naming the collective and the timeout, never a
hang. An uncaught exception in any rank aborts the whole job (MPI_Abort), because a rank
that just exits leaves the others blocked in MPI_Finalize.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import time

import numpy as np

from ..errors import RanvierError

DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait for the slowest rank (a cold compile included)


class WorkerLost(RanvierError):
    """Another rank of a data-parallel run stopped answering: it died, hangs or was cut off."""


class World:
    """A run of one process: every collective is the identity."""

    rank = 0
    size = 1
    local_rank = 0  # among the ranks on this machine
    local_size = 1

    @property
    def is_root(self) -> bool:
        """Rank 0: the rank that writes files and shows progress."""
        return self.rank == 0

    def rows(self, total: int) -> slice:
        """This rank's contiguous share of `total` rows (a global batch split over ranks)."""
        if total % self.size:
            raise RanvierError(f"a batch of {total} rows does not split evenly over {self.size} data-parallel workers; "
                               f"use a batch that is a multiple of {self.size}")
        share = total // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def sum_(self, buffer: np.ndarray, what: str) -> None:
        """Replace `buffer` (contiguous) with its elementwise sum over every rank."""

    def broadcast_(self, buffer: np.ndarray, what: str) -> None:
        """Replace `buffer` (contiguous) with rank 0's."""

    def allgather_into(self, part: np.ndarray, whole: np.ndarray, counts: list[int], what: str) -> None:
        """Concatenate every rank's `part` (rank r's has counts[r] elements) into `whole`."""
        whole[: part.size] = part.ravel()

    def share(self, value: object, what: str, root: int = 0) -> object:
        """The root's `value` (any picklable object), on every rank."""
        return value

    def gather(self, value: object, what: str) -> list[object]:
        """Every rank's `value`, by rank, on every rank."""
        return [value]

    def collect(self, value: object, what: str) -> list[object] | None:
        """Every rank's `value`, by rank, on rank 0; None on the others."""
        return [value]

    def barrier(self, what: str) -> None:
        """Return once every rank has got here."""

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (no clean-up), with this exit code."""
        raise SystemExit(code)


class MPIWorld(World):
    """The ranks of an MPI job (COMM_WORLD)."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = timeout
        # Which ranks share this machine, and the cores each may use.
        self.hosts = self.gather((MPI.Get_processor_name(), sorted(_cores())), "finding the ranks on each machine")
        neighbours = [rank for rank, (host, _) in enumerate(self.hosts) if host == self.hosts[self.rank][0]]
        self.local_rank, self.local_size = neighbours.index(self.rank), len(neighbours)

    def _wait(self, request, what: str) -> None:
        """Wait for a non-blocking collective, spinning briefly, then sleeping in naps that
        grow to 0.1 ms, until the deadline. MPI progresses only while it is called, so
        each round of a collective's protocol can cost a nap: longer naps (1 ms) made a
        step of small gradient buckets 2× slower; shorter ones cost a core's time."""
        deadline = time.monotonic() + self.timeout
        nap = 0.0
        while not request.Test():
            if time.monotonic() > deadline:
                message = (f"rank {self.rank} of {self.size}: {what} did not complete within {self.timeout:g} s; "
                           "another rank has died, hangs or was cut off (see its output)")
                # Said now, not only in the traceback: mpiexec tears the job down as this rank
                # exits and can drop the last line it printed (seen under load).
                print(message, file=sys.stderr, flush=True)
                raise WorkerLost(message)
            if nap:
                time.sleep(nap)
            nap = min(1e-4, nap * 2 or 1e-6)

    def sum_(self, buffer: np.ndarray, what: str) -> None:
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM), what)

    def broadcast_(self, buffer: np.ndarray, what: str) -> None:
        self._wait(self.comm.Ibcast(buffer, root=0), what)

    def allgather_into(self, part: np.ndarray, whole: np.ndarray, counts: list[int], what: str) -> None:
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        self._wait(self.comm.Iallgatherv(part.ravel(), [whole, (counts, offsets)]), what)

    def gather(self, value: object, what: str) -> list[object]:
        data = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self._wait(self.comm.Iallgather(np.array([data.size], np.int64), sizes), what)
        whole = np.empty(int(sizes.sum()), np.uint8)
        self.allgather_into(data, whole, sizes.tolist(), what)
        ends = np.cumsum(sizes)
        return [pickle.loads(whole[end - size : end].tobytes()) for size, end in zip(sizes, ends)]

    def collect(self, value: object, what: str) -> list[object] | None:
        data = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self._wait(self.comm.Igather(np.array([data.size], np.int64), sizes, root=0), what)
        if self.rank != 0:
            self._wait(self.comm.Igatherv(data, None, root=0), what)
            return None
        whole = np.empty(int(sizes.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        self._wait(self.comm.Igatherv(data, [whole, (sizes.tolist(), offsets)], root=0), what)
        return [pickle.loads(whole[start : start + size].tobytes()) for start, size in zip(offsets, sizes.tolist())]

    def share(self, value: object, what: str, root: int = 0) -> object:
        data = pickle.dumps(value if self.rank == root else None, protocol=pickle.HIGHEST_PROTOCOL)
        size = np.array([len(data)], np.int64)
        self._wait(self.comm.Ibcast(size, root=root), what)
        buffer = np.frombuffer(bytearray(data), np.uint8) if self.rank == root else np.empty(int(size[0]), np.uint8)
        self._wait(self.comm.Ibcast(buffer, root=root), what)
        return value if self.rank == root else pickle.loads(buffer.tobytes())

    def barrier(self, what: str) -> None:
        self._wait(self.comm.Ibarrier(), what)

    def abort(self, code: int = 1) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)


def launched_by_mpi() -> bool:
    """Whether this process is a rank started by an MPI launcher (MPICH's Hydra, Open MPI,
    Slurm's PMI), from the variables each sets."""
    return any(name in os.environ for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))


@functools.cache
def current_world() -> World:
    """This process's world: the MPI job it was launched in, or a single process.

    The first call of an MPI rank initializes MPI, makes an uncaught exception abort the
    whole job, and gives each rank on a machine its own share of the machine's cores (so
    N ranks on one host do not each start a thread per core)."""
    if not launched_by_mpi():
        return World()
    try:
        world = MPIWorld(float(os.environ.get("RANVIER_DP_TIMEOUT", DEFAULT_TIMEOUT)))
    except ImportError as error:
        raise RanvierError("this process was started by mpiexec, and data-parallel training needs mpi4py: "
                           "pip install 'ranvier[mpi]'") from error
    _abort_on_uncaught(world)
    _share_cores(world)
    return world


def _abort_on_uncaught(world: World) -> None:
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        world.abort(1)

    sys.excepthook = hook


def _cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _share_cores(world: MPIWorld) -> None:
    """Pin this rank to its contiguous share of the cores its machine's ranks may use, where
    the launcher left them all the same cores (a launcher that bound them is obeyed)."""
    host, cores = world.hosts[world.rank]
    masks = [mask for other, mask in world.hosts if other == host]
    if world.local_size == 1 or len(cores) < world.local_size or any(mask != cores for mask in masks):
        return
    share = len(cores) // world.local_size
    mine = cores[world.local_rank * share : (world.local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
