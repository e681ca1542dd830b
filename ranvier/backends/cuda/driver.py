"""Finding a GPU: the CUDA driver library, loaded with ctypes (no CUDA Python package
needed to ask), and its first device's name, compute capability and multiprocessors.
Whatever is missing — the library, a working driver, a device — is named in the error."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import RanvierError

DRIVER_LIBRARY = "libcuda.so.1"
# CUdevice_attribute values (cuda.h)
_MULTIPROCESSOR_COUNT, _CAPABILITY_MAJOR, _CAPABILITY_MINOR = 16, 75, 76


@dataclass(frozen=True)
class Device:
    name: str
    capability: tuple[int, int]
    multiprocessors: int

    @property
    def architecture(self) -> str:
        """The PTX target for this device, e.g. "sm_90"."""
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def __str__(self) -> str:
        return f"{self.name} ({self.architecture}, {self.multiprocessors} multiprocessors)"


def _error_name(library, code: int) -> str:
    name = ctypes.c_char_p()
    if library.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"error {code}"


def find_device(load: Callable[[str], object] = ctypes.CDLL) -> Device:
    """The first CUDA device through the driver (`load` opens the library: a test may pass a
    stand-in), or a RanvierError that says what is missing."""
    try:
        library = load(DRIVER_LIBRARY)
    except OSError as error:
        raise RanvierError(f"the CUDA backend needs an NVIDIA GPU and its driver: {DRIVER_LIBRARY} could not be "
                           f"loaded ({error}); use --backend cpu") from None

    def check(code: int, what: str) -> None:
        if code != 0:
            raise RanvierError(f"the CUDA driver failed to {what}: {_error_name(library, code)}")

    check(library.cuInit(0), "start")
    count = ctypes.c_int()
    check(library.cuDeviceGetCount(ctypes.byref(count)), "count the devices")
    if count.value == 0:
        raise RanvierError("the CUDA driver is installed but sees no GPU; use --backend cpu")
    device = ctypes.c_int()
    check(library.cuDeviceGet(ctypes.byref(device), 0), "open device 0")
    name = ctypes.create_string_buffer(256)
    check(library.cuDeviceGetName(name, len(name), device), "name device 0")
    values = []
    for attribute in (_CAPABILITY_MAJOR, _CAPABILITY_MINOR, _MULTIPROCESSOR_COUNT):
        value = ctypes.c_int()
        check(library.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), "describe device 0")
        values.append(value.value)
    return Device(name.value.decode(), (values[0], values[1]), values[2])
