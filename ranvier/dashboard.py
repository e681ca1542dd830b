"""A live terminal dashboard for training: loss curve, speed, compute efficiency, where the
time goes, memory, and text sampled from the current weights.

`Dashboard.render()` builds the view from the latest state, so it can be shown live
(rich's Live, refreshed as steps report) or printed once (tests, logs).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """The last `width` values (averaged into that many buckets) as block characters."""
    if not values:
        return ""
    data = np.asarray(values, np.float64)
    buckets = np.array_split(data, min(width, len(data)))
    means = np.array([b.mean() for b in buckets])
    low, high = means.min(), means.max()
    scaled = np.zeros_like(means) if high == low else (means - low) / (high - low)
    return "".join(BLOCKS[round(s * (len(BLOCKS) - 1))] for s in scaled)


def measured_peak_gflops() -> float:
    """This machine's fp32 GEMM rate, measured once (the denominator of "share of peak")."""
    a = np.random.default_rng(0).random((768, 768), dtype=np.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * 768**3 / best / 1e9


@dataclass
class Dashboard:
    title: str
    total_steps: int
    compile_seconds: float
    peak_gflops: float
    peak_what: str = "fp32 GEMM"  # the product the peak was measured on
    losses: list[float] = field(default_factory=list)
    step: int = 0
    ms_per_step: float = 0.0
    tokens_per_second: float = 0.0
    gflops: float = 0.0
    validation: float | None = None
    kernel_groups: list[tuple[str, float]] = field(default_factory=list)
    sample: str = ""
    unit: str = "tokens"
    expert_load: list[float] = field(default_factory=list)  # a MoE's share of tokens per expert
    time_limit: float | None = None  # seconds the run may train

    def update(self, step: int, loss: float, seconds: float, tokens: int, flops: float) -> None:
        self.step = step
        self.losses.append(loss)
        self.ms_per_step = seconds * 1e3
        self.tokens_per_second = tokens / seconds
        self.gflops = flops / seconds / 1e9

    def set_profile(self, profile) -> None:
        """Share of the step's time per kernel kind, largest first."""
        totals: dict[str, float] = {}
        for step in profile.steps:
            totals[step.kernel] = totals.get(step.kernel, 0.0) + step.seconds
        whole = sum(totals.values()) or 1.0
        self.kernel_groups = sorted(((k, v / whole) for k, v in totals.items()), key=lambda kv: -kv[1])[:6]

    def render(self) -> Panel:
        stats = Table.grid(padding=(0, 2))
        stats.add_column(style="bold")
        stats.add_column()
        best = min(self.losses) if self.losses else float("nan")
        current = self.losses[-1] if self.losses else float("nan")
        rows = [
            ("step", f"{self.step}/{self.total_steps}" + (f"  (stops after {self.time_limit / 60:g} min)" if self.time_limit else "")),
            ("loss", f"{current:.4f}  (best {best:.4f})"),
            ("validation", f"{self.validation:.4f}" if self.validation is not None else "-"),
            ("ms/step", f"{self.ms_per_step:.1f}"),
            (f"{self.unit}/s", f"{self.tokens_per_second:,.0f}"),
            ("GFLOP/s", f"{self.gflops:.1f}  ({self.gflops / self.peak_gflops:.0%} of {self.peak_gflops:,.0f}: measured {self.peak_what})"),
            ("compile", f"{self.compile_seconds:.1f} s"),
            ("memory", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MB peak resident"),
        ]
        for name, value in rows:
            stats.add_row(name, value)
        kernels = Table(title="time per kernel", show_header=False, box=None, padding=(0, 1))
        for name, share in self.kernel_groups:
            kernels.add_row(Text(name), f"{share:6.1%}", "█" * round(share * 30))
        curve = Text(sparkline(self.losses), style="cyan")
        parts = [Text("loss", style="bold"), curve, stats, kernels]
        if self.expert_load:
            parts.append(self.render_expert_load())
        if self.sample:
            parts += [Text("sample", style="bold"), Text(self.sample, style="italic")]
        return Panel(Group(*parts), title=self.title)

    def render_expert_load(self) -> Table:
        """Each expert's share of the routed tokens, against the even share 1/E."""
        even = 1.0 / len(self.expert_load)
        ratio = max(self.expert_load) / even
        table = Table(title=f"expert load (max/mean {ratio:.2f})", show_header=False, box=None, padding=(0, 1))
        for expert, share in enumerate(self.expert_load):
            table.add_row(f"expert {expert}", f"{share:6.1%}", "█" * round(share / even * 10))
        return table

    def live(self) -> Live:
        return Live(self.render(), refresh_per_second=4, transient=False)


class Shown:
    """What training_display yields: `show(step, loss, seconds, record)` once per step, and
    `show.final(record)` with what is measured after the last step (the final validation
    loss), so that the dashboard's last frame shows the figures of the run's last line."""

    def __init__(self, step: Callable[[int, float, float, dict], None], final: Callable[[dict], None] = lambda record: None):
        self.step, self.final = step, final

    def __call__(self, step: int, loss: float, seconds: float, record: dict) -> None:
        self.step(step, loss, seconds, record)


@contextmanager
def training_display(
    total: int,
    *,
    progress: bool,
    dashboard: bool,
    title: str,
    compile_seconds: float,
    flops_per_step: float,
    items_per_step: int,
    unit: str,
    profile: Callable[[], object],
    sample: Callable[[], str] | None = None,
    sample_every: int = 200,
    seconds: float | None = None,
    done: int = 0,
    peak: Callable[[], tuple[float, str]] | None = None,
) -> Iterator[Shown]:
    """Yield `show`: the live dashboard on a terminal when asked for, otherwise the progress
    bar (plain lines when the output is not a terminal). `seconds`: the run's time limit, if
    it has one; `total` and `done`: the run's steps in all and before this session. `peak`
    measures the (GFLOP/s, what) the dashboard's share of peak is against, when it is shown
    (default: this machine's fp32 GEMM; a GPU run's is its device's product, its MFU)."""
    from .progress import training_progress

    if not (dashboard and progress and sys.stdout.isatty()):
        with training_progress(total, enabled=progress, every=20, seconds=seconds, done=done) as report:
            yield Shown(lambda step, loss, seconds, record: report(loss, **{
                f"{unit}/s": items_per_step / seconds, "ms/step": seconds * 1e3, "GFLOP/s": flops_per_step / seconds / 1e9}))
        return
    rate, what = peak() if peak is not None else (measured_peak_gflops(), "fp32 GEMM")
    board = Dashboard(title, total, compile_seconds, rate, what, unit=unit, time_limit=seconds)
    with board.live() as live:
        def show(step: int, loss: float, seconds: float, record: dict) -> None:
            board.update(step, loss, seconds, items_per_step, flops_per_step)
            board.validation = record.get("val_loss", board.validation)
            board.expert_load = record.get("expert_load", board.expert_load)
            if step % 20 == 0:
                board.set_profile(profile())
            if sample is not None and step % sample_every == 0:
                board.sample = sample()
            live.update(board.render())

        def final(record: dict) -> None:
            board.validation = record.get("val_loss", board.validation)
            live.update(board.render())

        yield Shown(show, final)
