"""Fixtures the test modules share."""

from __future__ import annotations

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
