"""Progress display for long work: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _items(fields: dict) -> list[str]:
    return [f"{name} {value:,.1f}" if isinstance(value, float) else f"{name} {value}" for name, value in fields.items()]


def expected_steps(total: int, count: int, elapsed: float, seconds: float | None) -> int:
    """The steps a run will make: all `total`, or, under a time limit of `seconds`, as many
    as fit at the rate so far."""
    if seconds is None or count == 0:
        return total
    return min(total, count + int(count / max(elapsed, 1e-9) * max(seconds - elapsed, 0.0)))


BAR_WIDTH = 20


def fit(items: list[str], width: int) -> str:
    """As many of `items` (most important first) as fit in `width` columns, two spaces apart."""
    shown = []
    for item in items:
        if len("  ".join([*shown, item])) > width:
            break
        shown.append(item)
    return "  ".join(shown)


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


@contextmanager
def training_progress(total: int, enabled: bool = True, every: int = 100, seconds: float | None = None,
                      console: Console | None = None, done: int = 0) -> Iterator[Callable[..., None]]:
    """Yield `report(loss, **fields)`, called once per step; shows step, loss, steps/s, ETA
    and any extra fields (tokens/s, ms/step, ...). Under a time limit (`seconds`) the total
    and ETA are those of the steps that fit in it. `done`: steps made before (a resumed
    run), so that steps count from where it stands, as its metrics do.

    On a terminal: a bar, the step and the ETA always, then as many of loss, steps/s, the
    fields in their order and the elapsed time as fit the width; the loss and fields are the
    last step's, steps/s the run's. Otherwise a line every `every` steps whose loss, steps/s,
    fields and ETA are all means over the steps since the line before.
    """
    start = time.perf_counter()
    count = done
    if not enabled:
        yield lambda loss, **fields: None
        return
    if console is None and not sys.stderr.isatty():
        since, losses, sums = start, [], {}

        def report_plain(loss: float, **fields) -> None:
            nonlocal count, since, losses, sums
            count += 1
            losses.append(loss)
            for name, value in fields.items():
                sums[name] = sums.get(name, 0.0) + value
            if count % every == 0 or count == total:
                now = time.perf_counter()
                rate = len(losses) / max(now - since, 1e-9)
                expected = expected_steps(total, count, max(now - start, 1e-9), seconds)
                means = {name: value / len(losses) for name, value in sums.items()}
                extra = f" {'  '.join(_items(means))}" if means else ""
                print(f"step {count}/{expected} loss {sum(losses) / len(losses):.4f} {rate:.1f} steps/s "
                      f"eta {(expected - count) / rate:.0f}s{extra}", file=sys.stderr, flush=True)
                since, losses, sums = now, [], {}

        print(f"(every {every} steps: loss, steps/s, ETA and rates are means over the steps since the line before)",
              file=sys.stderr, flush=True)
        yield report_plain
        return
    columns = (BarColumn(bar_width=BAR_WIDTH), MofNCompleteColumn(), TextColumn("eta"), TimeRemainingColumn(),
               TextColumn("{task.fields[stats]}"))
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=total, completed=done, stats="")

        def report(loss: float, **fields) -> None:
            nonlocal count
            count += 1
            elapsed = max(time.perf_counter() - start, 1e-9)
            expected = expected_steps(total, count, elapsed, seconds)
            # What the bar, "step/total", "eta" and its time take, with a space between columns.
            fixed = BAR_WIDTH + 2 * len(str(expected)) + 1 + len("eta") + len("-:--:--") + 4
            items = [f"loss {loss:.4f}", f"{(count - done) / elapsed:.1f} steps/s", *_items(fields), f"elapsed {_clock(elapsed)}"]
            progress.update(task, advance=1, total=expected, stats=fit(items, progress.console.width - fixed - 1))

        yield report
