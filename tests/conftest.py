"""Fixtures the test modules share, and what a parallel run measures before it starts."""

from __future__ import annotations

import pytest
from fuzzing import watching

from ranvier.backends.cuda import device, driver
from ranvier.errors import RanvierError


def _gpu_found() -> bool:
    try:
        driver.find_device()
    except RanvierError:
        return False
    return True


@pytest.fixture(params=["emulator", "driver"])
def on_device(request, monkeypatch):
    """The device CUDA cells run on: the host emulator, or the GPU (where there is one)."""
    if request.param == "emulator":
        monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    elif not _gpu_found():
        pytest.skip("no NVIDIA GPU and driver here")
    else:
        monkeypatch.delenv(device.DEVICE_ENVIRONMENT, raising=False)
    return request.param


@pytest.fixture
def watched():
    """tracemalloc on and an alarm for a case that hangs, for fuzzing.within."""
    with watching():
        yield


def pytest_configure(config):
    """Before a run's pytest-xdist workers start, this process takes the machine's split
    thresholds (kept in the code cache's folder, then used by every later process) while
    the cores are idle: taken by a worker, with the others loading every core, they would
    be kept skewed. Kept already, they are only read."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        from ranvier.backends.cpu.parallel import split_thresholds

        split_thresholds()


def pytest_terminal_summary(terminalreporter):
    """The counts of ONNX's node conformance suite, where the run included it."""
    from node_suite_report import summarize

    summarize(terminalreporter)
