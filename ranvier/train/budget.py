"""`--minutes`: a run's step count fitted to a time budget, from the step time measured
on the run itself, so that its learning-rate schedule can be planned to end with the budget."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..distributed import current_world

WARMUP_STEPS = 10  # steps timed to measure the rate


def plan_steps(run_step: Callable[[], object], done: int, minutes: float, cap: int | None = None) -> tuple[int, str]:
    """Run warm-up steps, then return the run's total step count that fits in `minutes`
    (counted from this call) and a line saying how it was planned.

    The first step is not timed: it pays for first-touch page faults and for starting
    worker threads. `done`: steps the run had already made; `cap`: at most this many in all.
    """
    if cap is not None and cap - done < 2:
        return cap, f"--minutes {minutes:g}: --steps {cap} leaves too few steps to time"
    start = time.perf_counter()
    warmup = 1 + WARMUP_STEPS if cap is None else min(1 + WARMUP_STEPS, cap - done)
    run_step()
    timed_from = time.perf_counter()
    for _ in range(warmup - 1):
        run_step()
    now = time.perf_counter()
    rate = (warmup - 1) / max(now - timed_from, 1e-9)
    fits = done + warmup + int(max(0.0, minutes * 60 - (now - start)) * rate)
    total = fits if cap is None else min(cap, fits)
    note = (f"--minutes {minutes:g}: {rate:,.1f} steps/s measured over {warmup - 1} warm-up steps, "
            f"planning {total - done:,} steps" + (f" (to step {total:,})" if done else ""))
    if total < fits:
        note += f"; --steps {cap} stops it sooner"
    # The ranks of a data-parallel run measure different rates; they take rank 0's plan.
    return current_world().share((total, note), "sharing rank 0's step plan")
