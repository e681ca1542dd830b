"""The CUDA driver library, loaded with ctypes (no CUDA Python package needed): finding a
GPU (its first device's name, compute capability and multiprocessors; whatever is missing
— the library, a working driver, a device — is named in the error), and `DriverGPU`, the
device as the runtime uses it (`device.GPU`)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any  # a loaded library (or a test's stand-in): its functions found by name

import numpy as np

from ...errors import RanvierError
from ...runtime import Cell
from .blas import CublasLt, Gemm, Prepared
from .code import CUDACode
from .cudnn_attention import CudnnAttention, Sdpa
from .kernels import GPUKernel
from .launch import LaunchShape, Multiprocessor, check_shared_memory

DRIVER_LIBRARY = "libcuda.so.1"
# CUdevice_attribute values (cuda.h)
_MULTIPROCESSOR_COUNT, _CAPABILITY_MAJOR, _CAPABILITY_MINOR = 16, 75, 76
_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # a block's shared memory at most, dynamic included
# CUfunction_attribute: the dynamic shared memory a function's launches may pass (past 48 KB
# only once set)
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# CUjit_option values (cuda.h): where the driver's PTX compiler writes its errors
_JIT_ERROR_LOG_BUFFER, _JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 5, 6
_LOG_BYTES = 1 << 14
# CUstreamCaptureMode: this thread may make no unsafe call (an allocation, a synchronous
# copy) while it captures; other threads (another library's) may go on as they please
_CAPTURE_THREAD_LOCAL = 1
# CUevent_record_flags: an event recorded while a stream is captured becomes a node of the
# graph (recorded at each replay) only with this flag; without it the capture takes it as
# an edge between streams and the event is never recorded (its times are then refused)
_EVENT_RECORD_DEFAULT, _EVENT_RECORD_EXTERNAL = 0, 1


@dataclass
class DriverKernels:
    """A cell's code loaded by the driver (`DriverGPU.load`): each kernel's function, each
    product prepared by cuBLASLt, and each claimed attention step's graph built by cuDNN
    or why cuDNN refused it, by name."""

    functions: dict[str, ctypes.c_void_p]
    products: dict[str, Prepared]
    attention: dict[str, Callable[[list[int]], None] | str] = field(default_factory=dict)


@dataclass(frozen=True)
class Device:
    name: str
    capability: tuple[int, int]
    multiprocessors: int
    shared_per_block: int = Multiprocessor().shared_per_block  # bytes of shared memory a block may have

    @property
    def architecture(self) -> str:
        """The PTX target for this device, e.g. "sm_90"."""
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def __str__(self) -> str:
        return f"{self.name} ({self.architecture}, {self.multiprocessors} multiprocessors)"


def _error_name(library: Any, code: int) -> str:
    name = ctypes.c_char_p()
    if library.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"error {code}"


def find_device(load: Callable[[str], Any] = ctypes.CDLL) -> Device:
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
    for attribute in (_CAPABILITY_MAJOR, _CAPABILITY_MINOR, _MULTIPROCESSOR_COUNT, _SHARED_MEMORY_PER_BLOCK_OPTIN):
        value = ctypes.c_int()
        check(library.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), "describe device 0")
        values.append(value.value)
    return Device(name.value.decode(), (values[0], values[1]), values[2], values[3])


class DriverGPU:
    """Device 0 through the CUDA driver API (ctypes): its primary context, memory by
    cuMemAlloc, each cell's PTX loaded by the driver (which compiles it for the device),
    kernels launched on a stream of ours and products run there by cuBLASLt (`blas`),
    claimed attention by cuDNN (`cudnn_attention`, in the same primary context),
    CUDA events as timing marks, a compute's launches captured as a CUDA graph and
    replayed. Checked on an H100 (.ci/gpu-check: the CUDA tests and every op's tests there)."""

    host_memory = False

    def __init__(self, load: Callable[[str], Any] = ctypes.CDLL):
        self._load = load
        self._blas: CublasLt | None = None  # `_cublas()`
        self._sdpa: CudnnAttention | str | None = None  # `_cudnn()`: cuDNN, or why it could not start
        self.device = find_device(load)
        self.name = str(self.device)
        self._library = load(DRIVER_LIBRARY)
        device, context = ctypes.c_int(), ctypes.c_void_p()
        self._check(self._library.cuDeviceGet(ctypes.byref(device), 0), "open device 0")
        self._check(self._library.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "make a context")
        self._check(self._library.cuCtxSetCurrent(context), "use its context")
        self._context = context
        # kernels and timing marks go on a stream of their own: only such a stream can be
        # captured as a graph (its flags 0: ordered with the default stream's copies)
        self._stream = ctypes.c_void_p()
        self._check(self._library.cuStreamCreate(ctypes.byref(self._stream), 0), "make a stream")
        self.capturing = False  # whether launches and marks now go into a graph

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RanvierError(f"the CUDA driver failed to {what}: {_error_name(self._library, code)}")

    def allocate(self, nbytes: int) -> int:
        address = ctypes.c_uint64()
        self._check(self._library.cuMemAlloc_v2(ctypes.byref(address), ctypes.c_size_t(max(1, nbytes))),
                    f"allocate {nbytes} bytes of device memory")
        return address.value

    def release(self, address: int) -> None:
        self._check(self._library.cuMemFree_v2(ctypes.c_uint64(address)), "free device memory")

    def upload(self, address: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        self._check(self._library.cuMemcpyHtoD_v2(ctypes.c_uint64(address), ctypes.c_void_p(host.ctypes.data),
                                                   ctypes.c_size_t(host.nbytes)), "copy to the device")

    def download(self, address: int, host: np.ndarray) -> None:
        self._check(self._library.cuMemcpyDtoH_v2(ctypes.c_void_p(host.ctypes.data), ctypes.c_uint64(address),
                                                   ctypes.c_size_t(host.nbytes)), "copy from the device")

    def zero(self, address: int, nbytes: int) -> None:
        self._check(self._library.cuMemsetD8_v2(ctypes.c_uint64(address), ctypes.c_ubyte(0), ctypes.c_size_t(nbytes)),
                    "zero device memory")

    def load(self, cell: Cell) -> DriverKernels:
        """The cell's kernels: the machine code ptxas made for this device's architecture
        at compile time, or else its PTX compiled by the driver (a failure quotes the
        driver's compile log), each kernel of dynamic shared memory allowed its bytes (a
        kernel that wants more than the device gives a block fails, naming it); and its
        products prepared by cuBLASLt."""
        module = ctypes.c_void_p()
        log = ctypes.create_string_buffer(_LOG_BYTES)
        options = (ctypes.c_int * 2)(_JIT_ERROR_LOG_BUFFER, _JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(_LOG_BYTES))
        native = CUDACode.of(cell)
        image, what = (native.cubin, "machine code") if native.cubin else (native.ptx.encode(), "PTX")
        code = self._library.cuModuleLoadDataEx(ctypes.byref(module), ctypes.c_char_p(image), 2, options, values)
        if code != 0:
            raise RanvierError(f"the CUDA driver failed to load cell {cell.name}'s {what}: {_error_name(self._library, code)}"
                               + (f"\n{log.value.decode(errors='replace')}" if log.value else ""))
        loaded = DriverKernels({}, {})
        for launches in native.kernels.values():
            for kernel in launches:
                if isinstance(kernel, Gemm):
                    loaded.products[kernel.name] = self._cublas().prepare(kernel.plan)
                    continue
                if kernel.name in loaded.functions:  # shared by steps of the same signature
                    continue
                function = ctypes.c_void_p()
                self._check(self._library.cuModuleGetFunction(ctypes.byref(function), module, kernel.name.encode()),
                            f"find kernel {kernel.name}")
                check_shared_memory(kernel.name, kernel.shared_bytes, self.device.shared_per_block, self.name)
                if kernel.dynamic_shared_bytes:
                    self._check(self._library.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                                 kernel.dynamic_shared_bytes),
                                f"allow kernel {kernel.name} {kernel.dynamic_shared_bytes} bytes of dynamic shared memory")
                loaded.functions[kernel.name] = function
        for call in native.attention.values():
            loaded.attention[call.name] = self._prepare_attention(call)
        return loaded

    def _prepare_attention(self, call: Sdpa) -> Callable[[list[int]], None] | str:
        """The step's cuDNN graph, ready to run on its operands' addresses, or why there
        is none (no frontend, no libcudnn, a graph cuDNN refuses): the step's own kernels
        then run."""
        sdpa = self._cudnn()
        if isinstance(sdpa, str):
            return sdpa
        try:
            return functools.partial(sdpa.run, sdpa.prepare(call.plan))
        except RanvierError as error:
            return str(error)

    def attention_refusal(self, code: DriverKernels, call: Sdpa) -> str:
        prepared = code.attention.get(call.name, "the step was not loaded")
        return prepared if isinstance(prepared, str) else ""

    def attention(self, code: DriverKernels, call: Sdpa, addresses: list[int]) -> None:
        run = code.attention[call.name]
        if isinstance(run, str):
            raise RanvierError(f"cuDNN refused attention step {call.name} ({run}): its own kernels run it")
        run(addresses)

    def _cudnn(self) -> CudnnAttention | str:
        """cuDNN's attention on this device's stream, started by the first cell that claims
        it; or why it could not start, kept so that no later cell tries again."""
        if self._sdpa is None:
            try:
                self._sdpa = CudnnAttention(self._stream, self.allocate)
            except RanvierError as error:
                self._sdpa = str(error)
        return self._sdpa

    def launch(self, code: DriverKernels, kernel: GPUKernel, shape: LaunchShape, addresses: list[int]) -> None:
        values = [ctypes.c_uint64(a) for a in addresses]
        parameters = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self._check(self._library.cuLaunchKernel(code.functions[kernel.name], shape.blocks, 1, 1, shape.threads, 1, 1,
                                                 kernel.dynamic_shared_bytes, self._stream, parameters, None),
                    f"launch {kernel.name}")

    def gemm(self, code: DriverKernels, gemm: Gemm, addresses: list[int]) -> None:
        self._cublas().matmul(code.products[gemm.name], addresses)

    def _cublas(self) -> CublasLt:
        """cuBLASLt on this device's stream, started by the first cell with a product."""
        if self._blas is None:
            self._blas = CublasLt(self._stream, self.allocate, self._load)
        return self._blas

    def graph(self, launches: Callable[[], None]) -> ctypes.c_void_p:
        """The launches captured from the stream as a CUDA graph, instantiated, and run once.
        A capture that fails (a launch refused while capturing included) ends, leaving the
        stream as it was, and raises."""
        graph, executable = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self._library.cuStreamBeginCapture_v2(self._stream, _CAPTURE_THREAD_LOCAL), "start capturing a graph")
        self.capturing = True
        try:
            launches()
        except BaseException:
            self._library.cuStreamEndCapture(self._stream, ctypes.byref(graph))  # the stream leaves capture mode
            if graph:
                self._library.cuGraphDestroy(graph)
            raise
        finally:
            self.capturing = False
        self._check(self._library.cuStreamEndCapture(self._stream, ctypes.byref(graph)), "finish capturing a graph")
        try:
            self._check(self._library.cuGraphInstantiateWithFlags(ctypes.byref(executable), graph, ctypes.c_ulonglong(0)),
                        "instantiate a graph")
        finally:
            self._library.cuGraphDestroy(graph)  # the instantiated graph keeps what it needs
        self.replay(executable)
        return executable

    def replay(self, graph: ctypes.c_void_p) -> None:
        self._check(self._library.cuGraphLaunch(graph, self._stream), "launch a graph")

    def discard(self, graph: ctypes.c_void_p) -> None:
        self._check(self._library.cuGraphExecDestroy(graph), "destroy a graph")

    def timer(self, marks: int) -> EventTimer:
        return EventTimer(self, marks)

    def synchronize(self) -> None:
        self._check(self._library.cuCtxSynchronize(), "finish the launches")


class EventTimer:
    """Marks as CUDA events on the launches' stream, made once per instance."""

    def __init__(self, gpu: DriverGPU, marks: int):
        self.gpu = gpu
        self.events = [ctypes.c_void_p() for _ in range(marks)]
        for event in self.events:
            gpu._check(gpu._library.cuEventCreate(ctypes.byref(event), 0), "make an event")

    def record(self, mark: int) -> None:
        flags = _EVENT_RECORD_EXTERNAL if self.gpu.capturing else _EVENT_RECORD_DEFAULT
        self.gpu._check(self.gpu._library.cuEventRecordWithFlags(self.events[mark], self.gpu._stream, flags),
                        "record an event")

    def seconds(self, start: int, stop: int) -> float:
        milliseconds = ctypes.c_float()
        self.gpu._check(self.gpu._library.cuEventElapsedTime(ctypes.byref(milliseconds), self.events[start], self.events[stop]),
                        "time a step")
        return milliseconds.value / 1e3

    def close(self) -> None:
        for event in self.events:
            self.gpu._check(self.gpu._library.cuEventDestroy_v2(event), "destroy an event")
