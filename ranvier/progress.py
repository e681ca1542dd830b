"""Progress display for long work: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def training_progress(total: int, enabled: bool = True, every: int = 100) -> Iterator[Callable[[float], None]]:
    """Yield `report(loss)`, called once per step; shows step, loss, steps/s and ETA."""
    start = time.perf_counter()
    count = 0
    if not enabled:
        yield lambda loss: None
        return
    if not sys.stderr.isatty():
        def report_plain(loss: float) -> None:
            nonlocal count
            count += 1
            if count % every == 0 or count == total:
                rate = count / max(time.perf_counter() - start, 1e-9)
                eta = (total - count) / rate
                print(f"step {count}/{total} loss {loss:.4f} {rate:.1f} steps/s eta {eta:.0f}s", file=sys.stderr, flush=True)

        yield report_plain
        return
    columns = (
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:.1f} steps/s"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("train", total=total, loss=float("nan"), rate=0.0)

        def report(loss: float) -> None:
            nonlocal count
            count += 1
            rate = count / max(time.perf_counter() - start, 1e-9)
            progress.update(task, advance=1, loss=loss, rate=rate)

        yield report
