"""What the fuzz tests share: each case runs under a watch (the `watched` fixture of
conftest.py: tracemalloc on, and an alarm that interrupts a case that hangs) and must end
in its value or a RanvierError, never another exception, a hang or an allocation past
what its input warrants.

tracemalloc sees Python's and numpy's allocations, in every thread: a reader that sized
an array from a header it had not checked is caught even where the operating system lets
the allocation through untouched.
"""

from __future__ import annotations

import signal
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from ranvier.errors import RanvierError


class Hang(BaseException):  # not an Exception, so no handler under test can swallow it
    """Raised by the alarm in a case that runs too long."""


@contextmanager
def watching() -> Iterator[None]:
    """tracemalloc on, and SIGALRM raising Hang (what the `watched` fixture holds)."""

    def alarm(signum, frame):
        raise Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        yield
    finally:
        if started:
            tracemalloc.stop()
        signal.signal(signal.SIGALRM, previous)


def within(call: Callable[[], object], limit: int, timeout: float, label: str) -> RanvierError | None:
    """Run `call` under the watch: None when it returns, the RanvierError it raised. Fails
    on any other exception, on still running after `timeout` seconds, and on allocating
    more than `limit` bytes twice: a case over the limit is run again, so that the
    interpreter's own one-off growth is not taken for the case's. (pathlib interns each
    name it parses; a fuzzed checkpoint's ever-new names grew the table of interned strings,
    and its resize, 7.7 MB, fell in whichever case added the name that crossed a size.)"""
    for _ in range(2):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            call()
            outcome = None
        except RanvierError as error:
            outcome = error
        except Hang:
            pytest.fail(f"{label}: still running after {timeout} s")
        except Exception as error:
            raise AssertionError(f"{label}: {type(error).__name__}: {error}") from error
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        grown = tracemalloc.get_traced_memory()[1] - before
        if grown <= limit:
            return outcome
    raise AssertionError(f"{label}: allocated {grown:,} bytes, more than the {limit:,} this input warrants")
