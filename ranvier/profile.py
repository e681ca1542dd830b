"""Per-step profiles, as Myelin prints them: for each step its kernel, time, share of the
cell's time and achieved GFLOP/s."""

from __future__ import annotations

from dataclasses import dataclass

from .flow.graph import Operation


@dataclass
class StepTime:
    index: int
    kernel: str
    seconds: float
    flops: int
    op: Operation
    all_cores: float = 0.0  # of `seconds`, the time the step ran split over all the cores


class Profile:
    """Average time per compute of each step of a cell, over the computes since the last reset."""

    def __init__(self, cell_name: str, computes: int, steps: list[StepTime], device: str | None = None, timed: bool = True):
        self.cell_name = cell_name
        self.computes = computes
        self.steps = steps
        self.device = device  # the GPU the steps ran on (no share of CPU cores to show); None: the CPU
        self.timed = timed  # whether the steps were timed (a GPU's only from reset_profile() on)

    def _untimed(self) -> str:
        return (f"cell {self.cell_name}: {self.computes} computes on {self.device}, not timed: a GPU times steps from "
                "data.reset_profile() on (--profile)")

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def all_cores_share(self) -> float:
        """The share of the time spent split over all the cores (the worker pool's jobs);
        the rest ran on one core."""
        return min(1.0, sum(s.all_cores for s in self.steps) / self.total) if self.total > 0 else 0.0

    def by_kernel(self, top: int = 12) -> str:
        """Each kernel's time over all the steps it runs, largest first (the `top` of them):
        where a cell's time goes, at a glance. A GPU kernel's launch shapes are left out
        (`Map[sm_90 12 × 256]` counts as Map). Beside the arithmetic rate, the rate of the
        bytes its steps' inputs and outputs hold (each read or written once: the least
        traffic there is), which against the memory's bandwidth says how near a
        memory-bound kernel runs to its floor."""
        if not self.timed:
            return self._untimed()
        kernels: dict[str, tuple[float, int, int, int]] = {}
        for s in self.steps:
            name = s.kernel.split("[")[0]
            seconds, flops, moved, count = kernels.get(name, (0.0, 0, 0, 0))
            kernels[name] = (seconds + s.seconds, flops + s.flops, moved + moved_bytes(s.op), count + 1)
        total = self.total or 1e-30
        lines = [f"cell {self.cell_name}: {self.total * 1e3:.3f} ms per compute{f' on {self.device}' if self.device else ''}, by kernel",
                 f"  {'kernel':<24} {'steps':>5} {'time us':>10} {'share':>6} {'GFLOP/s':>8} {'GB/s':>8}"]
        for kernel, (seconds, flops, moved, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:top]:
            lines.append(f"  {kernel:<24} {count:>5} {seconds * 1e6:10.1f} {seconds / total * 100:5.1f}% {_rate(flops, seconds)} "
                         f"{_rate(moved, seconds)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        if not self.timed:
            return self._untimed()
        total = self.total or 1e-30
        where = f"on {self.device}" if self.device else f"{self.all_cores_share:.0%} of it on all cores"
        lines = [
            f"profile of cell {self.cell_name}: {self.computes} computes, {self.total * 1e3:.3f} ms per compute, {where}",
            f"  {'step':>4}  {'kernel':<24} {'time us':>9} {'share':>6} {'GFLOP/s':>8} {'' if self.device else 'cores':>5}  op",
        ]
        for s in sorted(self.steps, key=lambda s: -s.seconds):
            cores = f"{min(1.0, s.all_cores / s.seconds):5.0%}" if s.seconds > 0 and not self.device else f"{'':>5}"
            outs = ", ".join(v.name for v in s.op.outputs) or s.op.inputs[0].name
            lines.append(f"  {s.index:>4}  {s.kernel:<24} {s.seconds * 1e6:9.2f} {s.seconds / total * 100:5.1f}% {_rate(s.flops, s.seconds)} {cores}  "
                         f"{outs} = {s.op.type}")
        return "\n".join(lines)


def _rate(count: int, seconds: float) -> str:
    """Billions per second (GFLOP/s, GB/s) in a column 8 wide, blank for a step that counts
    none or took no time."""
    return f"{count / seconds / 1e9:8.1f}" if count and seconds > 0 else f"{'':>8}"


def moved_bytes(op: Operation) -> int:
    """The bytes an op's inputs and outputs hold, each variable once: the least traffic a
    kernel computing it has."""
    return sum(v.nbytes for v in {id(v): v for v in (*op.inputs, *op.outputs)}.values())
