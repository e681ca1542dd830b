"""Cells running on a device: each instance's data in one device arena, the network's
globals kept on the device, and a compute as the cell's launches in order.

What moves between host and device, and when:
- An instance's arena holds all its local variables at the offsets the memory planner
  gave them (the cell's layout, as on the CPU). A compute first copies in the locals set
  before it (the cell's inputs: a batch, a learning rate) from the instance's host views,
  and afterwards copies out the ones read after it (its outputs: a loss); nothing else
  moves. Another local is copied back when the host asks for it (`data[x]`), and one the
  host sets (`data[x] = value`) goes out before the next compute.
- A global (parameter, optimizer state, constant) is copied to the device before the
  first compute that reads it and then lives there: a training step updates it in place
  on the device. The host's array is brought up to date when the host reaches for it
  (`network[name]`, `data[name]`, a checkpoint's state arrays), and then sent again before
  the next compute, since the host may have written it.
- A gradient cell reads its forward instance's values in that instance's arena.

A compute's launches (every step's kernels or cuBLASLt product, and the timing marks
between them) are captured once as a graph (a CUDA graph on the driver) and replayed as
one launch by every later compute: the addresses they read never change, only the
memory's contents. A compute made while `RANVIER_CUDA_GRAPHS=0` makes its launches one
by one instead, which is what a graph saves (benchmarks/llama_train.py --backend cuda
compares them).

`data.device_array(x)` hands a variable's device memory to other GPU libraries without a
copy (`DeviceArray`: `__cuda_array_interface__`, which CuPy and PyTorch read). What they
write there stays: an input handed out so is no longer copied in from the host (until the
host sets it again), and a global's host copy is fetched again when next read.

Each step's kernels get one status word; a kernel that meets bad data (a label or index
out of range) sets it, and the compute raises naming the step, as on the CPU.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from ... import dtypes
from ...errors import RanvierError
from ...flow.graph import Variable
from ...ops import written_inputs
from ...runtime import Cell, Instance, Network
from .blas import Gemm
from .device import GPU

_HOST_NEWER, _SAME, _DEVICE_NEWER = "host newer", "same", "device newer"
GRAPHS_ENVIRONMENT = "RANVIER_CUDA_GRAPHS"  # "0": launch kernel by kernel, no graph


class DeviceGlobals:
    """A network's globals on one device: where each lives, and which side holds its
    latest value."""

    def __init__(self, network: Network, gpu: GPU):
        self.network, self.gpu = network, gpu
        self.addresses: dict[str, int] = {}
        self.state: dict[str, str] = {}
        network.globals.before_access = self.before_host_access
        weakref.finalize(self, _release, gpu, self.addresses.values())

    def address(self, var: Variable) -> int:
        if var.name not in self.addresses:
            self.network.add_global(var)
            self.addresses[var.name] = self.gpu.allocate(var.nbytes)
            self.state[var.name] = _HOST_NEWER
        return self.addresses[var.name]

    def before_compute(self, names: list[str]) -> None:
        """Send the globals a compute reads whose latest value is the host's."""
        for name in names:
            if self.state[name] == _HOST_NEWER:
                self.gpu.upload(self.addresses[name], self.network.globals.host[name])
                self.state[name] = _SAME

    def after_compute(self, written: list[str]) -> None:
        for name in written:
            self.state[name] = _DEVICE_NEWER

    def before_host_access(self, name: str) -> None:
        """The host is about to read or write a global: bring its device value back first."""
        state = self.state.get(name)
        if state is None:
            return
        if state == _DEVICE_NEWER:
            self.gpu.synchronize()
            self.gpu.download(self.addresses[name], self.network.globals.host[name])
        self.state[name] = _HOST_NEWER


class DeviceArray:
    """A variable's memory on the device, for other GPU libraries: `cupy.asarray(handle)` or
    `torch.as_tensor(handle, device="cuda")` read it in place through
    `__cuda_array_interface__` (version 3). On the host emulator the memory is the host's,
    so it offers `__array_interface__` instead (`numpy.asarray(handle)`). Valid while its
    instance lives; a compute may overwrite it."""

    def __init__(self, address: int, var: Variable, owner: DeviceInstance, host_memory: bool):
        self.address, self.var, self.owner = address, var, owner  # the owner keeps the memory alive
        dtype = np.dtype(dtypes.to_numpy(var.dtype))
        if dtype.kind == "V":
            raise RanvierError(f"{var.name} is {var.dtype}, which __cuda_array_interface__ has no type string for")
        interface = {"shape": tuple(var.shape), "typestr": dtype.str, "data": (address, False), "strides": None, "version": 3}
        setattr(self, "__array_interface__" if host_memory else "__cuda_array_interface__", interface)

    def __repr__(self) -> str:
        return f"<DeviceArray {self.var.name}: {self.var.typestr()} at {self.address:#x}>"


def _release(gpu: GPU, addresses) -> None:
    """Give a collected instance's (or network's) device memory back."""
    for address in list(addresses):
        gpu.release(address)


def device_globals(network: Network, gpu: GPU) -> DeviceGlobals:
    """The network's globals on `gpu` (one record per network)."""
    record = getattr(network, "device_globals", None)
    if record is None or record.gpu is not gpu:
        record = network.device_globals = DeviceGlobals(network, gpu)
    return record


class DeviceInstance:
    """An instance's arena on the device and the launches of its cell (module docstring)."""

    def __init__(self, cell: Cell, instance: Instance, gpu: GPU, code: object):
        self.cell, self.instance, self.gpu, self.code = cell, instance, gpu, code
        self.globals = device_globals(cell.network, gpu)
        self.arena = gpu.allocate(cell.size)
        self.status = np.zeros(max(1, len(cell.steps)), np.int64)
        self.status_address = gpu.allocate(self.status.nbytes)
        weakref.finalize(self, _release, gpu, [self.arena, self.status_address])
        steps = len(cell.steps)
        self.inputs = [slot for slot in cell.slots if slot.first < 0]
        self.outputs = [slot for slot in cell.slots if slot.last >= steps]
        self.pending: dict[str, object] = {}  # locals the host set since the last compute
        self.fed_on_device: set[str] = set()  # inputs handed out as device arrays: not copied in
        self.timer = gpu.timer(len(cell.steps) + 1)
        self.graph = None  # the launches, captured by the first compute and replayed by the next
        self.launches = []
        for index in range(len(cell.steps)):
            status = self.status_address + 8 * index
            for kernel, shape in zip(cell.native["kernels"][index], cell.native["shapes"][index]):
                operands = [self.address(v) for v in kernel.operands]
                self.launches.append((index, kernel, shape, operands if isinstance(kernel, Gemm) else [*operands, status]))
        # the globals the kernels read (a shape operand no kernel reads stays on the host)
        self.read_globals = [var.name for var in cell.global_vars if var.name in self.globals.addresses]
        written = {v.name for step in cell.steps for v in (*written_inputs(step.op), *step.op.outputs) if v.is_global}
        self.written_globals = sorted(written & set(self.read_globals))
        instance.device = self

    def address(self, var: Variable) -> int:
        """Where `var` lives on the device: this arena, the network's globals, or the
        forward instance's arena."""
        slot = self.cell.slot(var)
        if slot is not None:
            return self.arena + slot.offset
        if var.is_global:
            return self.globals.address(var)
        primal = self.instance.primal
        if primal is not None and isinstance(primal.device, DeviceInstance):
            return primal.device.address(var)
        raise RanvierError(f"{var.name} is not a variable of cell {self.cell.name} or of its linked forward instance")

    def _host_view(self, slot) -> np.ndarray:
        return self.instance.buffer[slot.offset : slot.offset + slot.var.nbytes]

    def before_read(self, var: Variable) -> None:
        slot = self.cell.slot(var)
        if slot is not None and var.name not in self.pending:
            self.gpu.synchronize()
            self.gpu.download(self.arena + slot.offset, self._host_view(slot))

    def after_write(self, var: Variable) -> None:
        self.pending[var.name] = self.cell.slot(var)
        self.fed_on_device.discard(var.name)

    def array(self, var: Variable) -> DeviceArray:
        """`var`'s device memory as a `DeviceArray` (see the module's docstring)."""
        address = self.address(var)
        if var.is_global:
            self.globals.before_compute([var.name])
            self.globals.after_compute([var.name])
        elif self.cell.slot(var) is not None and self.cell.slot(var).first < 0:
            self.fed_on_device.add(var.name)
        return DeviceArray(address, var, self, self.gpu.host_memory)

    def _launch_steps(self) -> None:
        """Every step's kernels in order, with a timing mark at each step's end."""
        timer, step = self.timer, 0
        timer.record(0)
        for index, kernel, shape, addresses in self.launches:
            while step < index:
                step += 1
                timer.record(step)
            if isinstance(kernel, Gemm):
                self.gpu.gemm(self.code, kernel, addresses)
            else:
                self.gpu.launch(self.code, kernel, shape, addresses)
        while step < len(self.cell.steps):
            step += 1
            timer.record(step)

    def __call__(self) -> None:
        gpu = self.gpu
        self.globals.before_compute(self.read_globals)
        inputs = [s for s in self.inputs if s.var.name not in self.fed_on_device]
        for slot in [*inputs, *(s for s in self.pending.values() if s.first >= 0)]:
            gpu.upload(self.arena + slot.offset, self._host_view(slot))
        self.pending.clear()
        gpu.zero(self.status_address, self.status.nbytes)
        if os.environ.get(GRAPHS_ENVIRONMENT) == "0":
            self._launch_steps()
        elif self.graph is None:
            self.graph = gpu.graph(self._launch_steps)
        else:
            gpu.replay(self.graph)
        steps, timer = len(self.cell.steps), self.timer
        self.globals.after_compute(self.written_globals)
        gpu.synchronize()
        for index in range(steps):
            self.instance.step_time[index] += timer.seconds(index, index + 1)
        gpu.download(self.status_address, self.status)
        for slot in self.outputs:
            gpu.download(self.arena + slot.offset, self._host_view(slot))
        failed = np.flatnonzero(self.status)
        if failed.size:
            op = self.cell.steps[failed[0]].op
            raise RanvierError(f"{op.type} op {op.name} failed on the GPU: an index or class label is out of range")
