"""Progress display for long work: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _extras(fields: dict) -> str:
    return "  ".join(f"{name} {value:,.1f}" if isinstance(value, float) else f"{name} {value}" for name, value in fields.items())


def expected_steps(total: int, count: int, elapsed: float, seconds: float | None) -> int:
    """The steps a run will make: all `total`, or, under a time limit of `seconds`, as many
    as fit at the rate so far."""
    if seconds is None or count == 0:
        return total
    return min(total, count + int(count / max(elapsed, 1e-9) * max(seconds - elapsed, 0.0)))


@contextmanager
def training_progress(total: int, enabled: bool = True, every: int = 100, seconds: float | None = None) -> Iterator[Callable[..., None]]:
    """Yield `report(loss, **fields)`, called once per step; shows step, loss, steps/s, ETA
    and any extra fields (tokens/s, ms/step, ...). Under a time limit (`seconds`) the total
    and ETA are those of the steps that fit in it."""
    start = time.perf_counter()
    count = 0
    if not enabled:
        yield lambda loss, **fields: None
        return
    if not sys.stderr.isatty():
        def report_plain(loss: float, **fields) -> None:
            nonlocal count
            count += 1
            if count % every == 0 or count == total:
                elapsed = max(time.perf_counter() - start, 1e-9)
                rate = count / elapsed
                expected = expected_steps(total, count, elapsed, seconds)
                eta = (expected - count) / rate
                extra = f" {_extras(fields)}" if fields else ""
                print(f"step {count}/{expected} loss {loss:.4f} {rate:.1f} steps/s eta {eta:.0f}s{extra}", file=sys.stderr, flush=True)

        yield report_plain
        return
    columns = (
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:.1f} steps/s"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[extra]}"),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("train", total=total, loss=float("nan"), rate=0.0, extra="")

        def report(loss: float, **fields) -> None:
            nonlocal count
            count += 1
            elapsed = max(time.perf_counter() - start, 1e-9)
            progress.update(task, advance=1, total=expected_steps(total, count, elapsed, seconds), loss=loss,
                            rate=count / elapsed, extra=_extras(fields))

        yield report
