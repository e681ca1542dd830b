"""Fixtures the test modules share, and where a parallel run keeps its code cache."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

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


# A run over several pytest-xdist workers gives them a code cache of their own, removed when
# the run ends. The cache folder also keeps this machine's measurements (GEMM choices, split
# thresholds), taken once and then used by every later process; taken while the other workers
# load every core, they would be kept skewed in the user's cache.
_PARALLEL_CACHE = "_ranvier_parallel_cache"


def pytest_configure(config):
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None) or "RANVIER_CACHE" in os.environ:
        return  # a worker (it inherits the folder), a serial run, or a cache named by the user
    folder = tempfile.mkdtemp(prefix="ranvier-tests-")
    os.environ["RANVIER_CACHE"] = folder  # the workers start after this, with this environment
    setattr(config, _PARALLEL_CACHE, folder)


def pytest_unconfigure(config):
    folder = getattr(config, _PARALLEL_CACHE, None)
    if folder is not None:
        del os.environ["RANVIER_CACHE"]
        shutil.rmtree(folder, ignore_errors=True)
