"""Launch shapes: how many blocks of how many threads run a kernel on a given GPU.

A map kernel's grid-stride loop computes any size with any grid, so the shape is chosen
for the device: blocks of 256 threads (eight warps: enough to hide a load's latency, few
enough that a block's registers fit), and no more blocks than the multiprocessors hold at
once — every thread then stays resident, and a large map loops instead of paying for
blocks that would wait their turn. How many blocks a multiprocessor holds is bounded by
its threads, by its registers, which ptxas reports per kernel (`ptx.Assembled`), and by
the shared memory a block kernel's arrays take (`GPUKernel.shared_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import RanvierError

WARP = 32
THREADS_PER_BLOCK = 256


@dataclass(frozen=True)
class Multiprocessor:
    """What one streaming multiprocessor holds at once (threads and registers the same from
    Volta to Hopper; shared memory Hopper's)."""

    threads: int = 2048
    registers: int = 65536
    blocks: int = 32
    register_unit: int = 256  # registers are given to a warp in units of this many
    shared_memory: int = 228 * 1024  # bytes, for all its blocks
    shared_per_block: int = 227 * 1024  # bytes one block may have (the rest: the driver's reserve)
    shared_reserve: int = 1024  # bytes the driver keeps of each resident block's


@dataclass(frozen=True)
class LaunchShape:
    blocks: int
    threads: int

    def __str__(self) -> str:
        return f"{self.blocks} × {self.threads}"


def resident_blocks(threads: int, registers: int, sm: Multiprocessor = Multiprocessor(), shared: int = 0) -> int:
    """Blocks of `threads` threads, each thread using `registers` and the block `shared`
    bytes of shared memory, one multiprocessor runs at once."""
    warps = -(-threads // WARP)
    per_warp = -(-registers * WARP // sm.register_unit) * sm.register_unit
    by_registers = sm.registers // (per_warp * warps) if registers else sm.blocks
    by_shared = sm.shared_memory // (shared + sm.shared_reserve) if shared else sm.blocks
    return max(0, min(sm.threads // (warps * WARP), by_registers, by_shared, sm.blocks))


def check_shared_memory(kernel: str, shared: int, limit: int, device: str) -> None:
    """A kernel whose block wants more shared memory than `device` gives one (`limit`
    bytes) is an error that names it."""
    if shared > limit:
        raise RanvierError(f"kernel {kernel} needs {shared} bytes of shared memory a block, but {device} gives a block "
                           f"at most {limit} bytes")


def map_launch(elements: int, multiprocessors: int, registers: int, sm: Multiprocessor = Multiprocessor()) -> LaunchShape:
    """The launch shape of a map over `elements` on a GPU of `multiprocessors`, its kernel
    using `registers` per thread: a small map gets one thread per element (whole warps)."""
    if elements < 1 or multiprocessors < 1:
        raise RanvierError(f"a launch needs elements and multiprocessors; got {elements} and {multiprocessors}")
    threads = min(THREADS_PER_BLOCK, -(-elements // WARP) * WARP)
    return block_launch(-(-elements // threads), threads, multiprocessors, registers, sm)


def block_launch(blocks: int, threads: int, multiprocessors: int, registers: int,
                 sm: Multiprocessor = Multiprocessor(), shared: int = 0) -> LaunchShape:
    """The launch shape of `blocks` blocks of `threads` threads (and `shared` bytes of
    shared memory each): no more blocks than the multiprocessors hold at once (the
    kernel's grid-stride loop takes the rest)."""
    fitting = resident_blocks(threads, registers, sm, shared)
    if fitting == 0:
        raise RanvierError(f"a block of {threads} threads at {registers} registers each and {shared} bytes of shared "
                           f"memory does not fit a multiprocessor ({sm.registers} registers, {sm.shared_memory} bytes)")
    return LaunchShape(min(blocks, multiprocessors * fitting), threads)


def covering_launch(elements: int, threads: int, registers: int, sm: Multiprocessor = Multiprocessor()) -> LaunchShape:
    """The launch shape of a kernel without a grid-stride loop (`GPUKernel.one_pass`): a
    block of `threads` per element (a block kernel's), or with `threads` 0 a thread per
    element in blocks as a map's; every element its own, however many blocks that takes."""
    if elements < 1:
        raise RanvierError(f"a launch needs elements; got {elements}")
    per_block = threads or min(THREADS_PER_BLOCK, -(-elements // WARP) * WARP)
    if resident_blocks(per_block, registers, sm) == 0:
        raise RanvierError(f"a block of {per_block} threads at {registers} registers each does not fit a "
                           f"multiprocessor ({sm.registers} registers)")
    return LaunchShape(elements if threads else -(-elements // per_block), per_block)
