"""Cells running on a device: each instance's data in one device arena, the network's
globals kept on the device, and a compute as the cell's launches in order.

What moves between host and device, and when (a training step: the batch and learning
rate in, one copy of a few bytes out):
- An instance's arena holds its local variables at the offsets the memory planner gave
  them (the cell's layout, as on the CPU). A compute first copies in the cell's inputs
  (a batch, a learning rate: the host writes them through their views, so they always
  go) and any other local the host set since the last one (`data[x] = value`; or read,
  for a local the cell reads and writes, which the host may change through its view; and
  such a local once a new or cleared instance holds zeros, as on the CPU), adjacent ones
  in one copy. Afterwards one copy brings back the instance's mailbox
  (`mailbox.py`): the status words, and the small outputs (a loss, a flag, a norm), which
  live there. Nothing else moves: any other local (a gradient, an activation, an
  inference cell's logits) is copied back when the host reads it (`data[x]`), once per
  compute.
- A global (parameter, optimizer state, constant, KV cache) is copied to the device
  before the first compute that reads it and then lives there: a training step updates
  it in place on the device. The host's array is brought up to date when the host
  reaches for it (`network[name]`, `data[name]`, `trainer.state_arrays()`), and then sent
  again before the next compute, since the host may have written it; unless the host
  asked to read it only (`network.globals.read(name)`: a checkpoint being saved, a
  layer's weights fed to a cell).
- A gradient cell reads its forward instance's values in that instance's arena (what the
  host set there since the forward's compute goes out first).
- An array the host holds (`data[x]`, `network[name]`) is the value of the moment it was
  fetched: fetched again after a compute, it is that compute's, and written, it goes out
  before the next (the library fetches again; Myelin's tensor handles at each use).

A step cuDNN's attention claims (`cudnn_attention`) is one call where the device takes it,
and else its own kernels, the step then printed as what runs it and why.

A compute's launches (every step's kernels or cuBLASLt product) run kernel by kernel the
first time: cuBLASLt's first calls load its kernels and choose its algorithms, which no
graph may capture. The second compute captures them as a graph (a CUDA graph on the
driver, in the thread-local capture mode) and every later one replays it as one launch:
the addresses they read never change, only the memory's contents. Where the driver cannot
capture them, the instance warns once and launches kernel by kernel from then on. A
compute made while `RANVIER_CUDA_GRAPHS=0` makes its launches one by one, which is what a
graph saves (benchmarks/llama_train.py --backend cuda compares them). Steps are timed (an
event between each two, each read back after the compute) only while the instance is
profiled (`data.reset_profile()`, `--profile`); a profiled compute replays a graph of its
own, with the events in it. An instance's graphs and events are destroyed when it goes,
as its memory is given back (`Launches`).

`data.device_array(x)` hands a variable's device memory to other GPU libraries without a
copy (`DeviceArray`: `__cuda_array_interface__`, which CuPy and PyTorch read). What they
write there stays: an input handed out so is no longer copied in from the host (until the
host sets it again), and the host's copy of anything else handed out is fetched again
when next read.

Each step whose kernels check their data gets a status word; a kernel that meets bad
data (a label or index out of range) sets it, and the compute raises naming the step, as
on the CPU.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable, Iterable

import numpy as np

from ... import dtypes
from ...errors import RanvierError
from ...flow.graph import Variable
from ...ops import written_inputs
from ...runtime import Cell, Instance, Network, Slot, Step
from ..kernels import chosen_kernel
from .blas import Gemm
from .code import CUDACode
from .cudnn_attention import Sdpa
from .device import GPU, Timer
from .mailbox import Mailbox

_HOST_NEWER, _SAME, _DEVICE_NEWER = "host newer", "same", "device newer"
GRAPHS_ENVIRONMENT = "RANVIER_CUDA_GRAPHS"  # "0": launch kernel by kernel, no graph
REFUSAL_CHARACTERS = 240  # of why a claimed attention step does not run with cuDNN, in its label


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

    def before_host_access(self, name: str, writing: bool) -> None:
        """The host is about to read a global, and maybe write it: bring its device value
        back first; one the host may write goes out again before the next compute."""
        state = self.state.get(name)
        if state is None:
            return
        if state == _DEVICE_NEWER:
            self.gpu.synchronize()
            self.gpu.download(self.addresses[name], self.network.globals.host[name])
            self.state[name] = _SAME
        if writing:
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


def _release(gpu: GPU, addresses: Iterable[int]) -> None:
    """Give a collected instance's (or network's) device memory back."""
    for address in list(addresses):
        gpu.release(address)


def device_globals(network: Network, gpu: GPU) -> DeviceGlobals:
    """The network's globals on `gpu` (one record per network)."""
    record = network.device_globals
    if not isinstance(record, DeviceGlobals) or record.gpu is not gpu:
        record = network.device_globals = DeviceGlobals(network, gpu)
    return record


class DeviceInstance:
    """An instance's arena on the device and the launches of its cell (module docstring)."""

    def __init__(self, cell: Cell, instance: Instance, gpu: GPU, code: object):
        self.cell, self.instance, self.gpu, self.code = cell, instance, gpu, code
        self.globals = device_globals(cell.network, gpu)
        self.arena = gpu.allocate(cell.size)
        self.mailbox = Mailbox(cell, gpu)
        weakref.finalize(self, _release, gpu, [self.arena, self.mailbox.address])
        self.inputs = [slot for slot in cell.slots if cell.roles.get(slot.var.name) == "input"]
        self.state = {slot.var.name for slot in cell.slots if cell.roles.get(slot.var.name) == "state"}
        self.mailed = {slot.var.name for slot in cell.slots if self.mailbox.address_of(slot) is not None}
        self.pending: dict[str, Slot] = {}  # locals the host set since the last compute: sent before the next
        self.host_current: set[str] = set()  # locals whose host view holds their latest value
        self.fed_on_device: set[str] = set()  # inputs handed out as device arrays: not copied in
        self.cleared()
        launches: list[tuple[int, Callable[[], None]]] = []  # (its step, the launch)
        tables: list[int] = []  # table-driven ForEach kernels' tables, written here once
        weakref.finalize(self, _release, gpu, tables)
        native = CUDACode.of(cell)
        for index in range(len(cell.steps)):
            status = self.mailbox.status_word(index)
            call = native.attention.get(index)
            if call is not None and self._runs_with_cudnn(cell.steps[index], call):
                launches.append((index, functools.partial(gpu.attention, code, call, [self.address(v) for v in call.operands])))
                continue
            for kernel, shape in zip(native.kernels[index], native.shapes[index]):
                operands = [self.address(v) for v in kernel.operands]
                if not isinstance(kernel, Gemm) and kernel.table is not None:
                    words = kernel.table.words(operands)
                    tables.append(gpu.allocate(words.nbytes))
                    gpu.upload(tables[-1], words)
                    operands = [tables[-1]]
                if isinstance(kernel, Gemm):
                    launches.append((index, functools.partial(gpu.gemm, code, kernel, operands)))
                elif shape is not None:
                    launches.append((index, functools.partial(gpu.launch, code, kernel, shape, [*operands, status])))
                else:
                    raise RanvierError(f"kernel {kernel.name} of cell {cell.name} was compiled without its launch shape")
        self.launches = Launches(cell.name, len(cell.steps), launches, gpu)
        weakref.finalize(self, self.launches.release)
        # the globals the kernels read (a shape operand no kernel reads stays on the host)
        self.read_globals = [var.name for var in cell.global_vars if var.name in self.globals.addresses]
        written = {v.name for step in cell.steps for v in (*written_inputs(step.op), *step.op.outputs) if v.is_global}
        self.written_globals = sorted(written & set(self.read_globals))
        instance.device = self

    def _runs_with_cudnn(self, step: Step, call: Sdpa) -> bool:
        """Whether the device runs a claimed attention step with cuDNN; where it does not,
        the step is relabelled as what runs it instead: its own kernel, and why (its first
        `REFUSAL_CHARACTERS`: cuDNN's own messages list every engine it asked)."""
        refused = self.gpu.attention_refusal(self.code, call)
        if refused:
            why = refused if len(refused) <= REFUSAL_CHARACTERS else refused[: REFUSAL_CHARACTERS - 1] + "…"
            step.kernel, step.variant = chosen_kernel(step).name, why
        return not refused

    @property
    def device_name(self) -> str:
        return self.gpu.name

    def address(self, var: Variable) -> int:
        """Where `var` lives on the device: this arena (or its mailbox), the network's
        globals, or the forward instance's arena."""
        slot = self.cell.slot(var)
        if slot is not None:
            mailed = self.mailbox.address_of(slot)
            return self.arena + slot.offset if mailed is None else mailed
        if var.is_global:
            return self.globals.address(var)
        primal = self.instance.primal
        if primal is not None and isinstance(primal.device, DeviceInstance):
            return primal.device.address(var)
        raise RanvierError(f"{var.name} is not a variable of cell {self.cell.name} or of its linked forward instance")

    def cleared(self) -> None:
        """The host's buffer is all zeros (a new instance's, or `data.clear()`): it holds every
        local's value until the next compute, and the locals the cell reads before writing (an
        accumulated gradient) go out before it, as the CPU would read them."""
        self.host_current = {slot.var.name for slot in self.cell.slots}
        self.pending = {slot.var.name: slot for slot in self.cell.slots if slot.var.name in self.state}
        self.fed_on_device.clear()

    def _host_view(self, slot: Slot) -> np.ndarray:
        return self.instance.buffer[slot.offset : slot.offset + slot.var.nbytes]

    def before_read(self, var: Variable) -> None:
        """The host is about to read a local: bring its device value back, unless the host's
        view holds it already or the host has set those bytes since."""
        slot = self.cell.slot(var)
        if slot is None or var.name in self.host_current or any(_overlap(slot, s) for s in self.pending.values()):
            return
        self.gpu.synchronize()
        self.gpu.download(self.address(var), self._host_view(slot))
        self.host_current.add(var.name)
        if var.name in self.state:  # read and written by the cell: the host may change it through its view
            self.pending[var.name] = slot

    def after_write(self, var: Variable) -> None:
        slot = self.cell.slot(var)
        if slot is None:
            raise RanvierError(f"{var.name} is not a local variable of cell {self.cell.name}")
        self.pending[var.name] = slot
        self.host_current.add(var.name)
        self.fed_on_device.discard(var.name)

    def array(self, var: Variable) -> DeviceArray:
        """`var`'s device memory as a `DeviceArray` (see the module's docstring)."""
        address = self.address(var)
        if var.is_global:
            self.globals.before_compute([var.name])
            self.globals.after_compute([var.name])
        elif self.cell.slot(var) is not None:
            if any(slot.var is var for slot in self.inputs):
                self.fed_on_device.add(var.name)
            self.host_current.discard(var.name)
        return DeviceArray(address, var, self, self.gpu.host_memory)

    def _send(self) -> None:
        """Copy in the inputs and the other locals the host set, adjacent ones in one copy."""
        self._upload({slot.var.name: slot for slot in self.inputs if slot.var.name not in self.fed_on_device} | self.pending)

    def send_pending(self) -> None:
        """Copy in the locals the host set since the last compute (before a gradient
        instance's compute reads them here)."""
        self._upload(self.pending)

    def _upload(self, sent: dict[str, Slot]) -> None:
        """Copy in `sent`, adjacent ones in one copy; then nothing the host set is pending."""
        in_arena = []
        for slot in sent.values():
            mailed = self.mailbox.address_of(slot)
            if mailed is None:
                in_arena.append(slot)
            else:
                self.gpu.upload(mailed, self._host_view(slot))
        for start, stop in _spans(in_arena, self.cell.slots):
            self.gpu.upload(self.arena + start, self.instance.buffer[start:stop])
        self.pending.clear()

    def __call__(self) -> None:
        timed = self.instance.profiling
        self.globals.before_compute(self.read_globals)
        self._send()
        primal = self.instance.primal
        if primal is not None and isinstance(primal.device, DeviceInstance):
            primal.device.send_pending()
        self.launches(timed)
        self.globals.after_compute(self.written_globals)
        self.gpu.synchronize()
        failed = self.mailbox.receive(self.instance.buffer)
        self.host_current = self.mailed | {slot.var.name for slot in self.inputs if slot.var.name not in self.fed_on_device}
        if timed:
            for index in range(len(self.cell.steps)):
                self.instance.step_time[index] += self.launches.seconds(index)
        if failed is not None:
            op = self.cell.steps[failed].op
            raise RanvierError(f"{op.type} op {op.name} failed on the GPU: an index or class label is out of range")


class Launches:
    """An instance's launches (every step's kernels or products, in order, at fixed
    addresses), made kernel by kernel or as a graph (module docstring), and what they hold
    on the device: their graphs and timing marks, given back when the instance goes (a
    finalizer holds this, which holds nothing of the instance's)."""

    def __init__(self, name: str, steps: int, launches: list[tuple[int, Callable[[], None]]], gpu: GPU):
        self.name, self.steps, self.launches, self.gpu = name, steps, launches, gpu
        self.timer: Timer | None = None  # the marks between steps, made by the first profiled compute
        self.graphs: dict[bool, object] = {}  # the launches captured as a graph: untimed, and timed (profiled)
        self.capture_failed = False  # then every compute launches kernel by kernel
        self.computes = 0

    def __call__(self, timed: bool) -> None:
        """The launches: kernel by kernel the first time, then as a graph (module docstring)."""
        if timed and self.timer is None:
            self.timer = self.gpu.timer(self.steps + 1)
        if self.computes == 0 or self.capture_failed or os.environ.get(GRAPHS_ENVIRONMENT) == "0":
            self._in_order(timed)
        elif timed in self.graphs:
            self.gpu.replay(self.graphs[timed])
        else:
            try:
                self.graphs[timed] = self.gpu.graph(lambda: self._in_order(timed))
            except RanvierError as error:
                self.capture_failed = True
                warnings.warn(f"cell {self.name}: the driver could not capture its launches as a graph ({error}); "
                              "launching them kernel by kernel", RuntimeWarning, stacklevel=4)
                self._in_order(timed)
        self.computes += 1

    def _in_order(self, timed: bool) -> None:
        """Every step's kernels in order; profiled, with a timing mark at each step's end."""
        timer = self.timer if timed else None
        mark = timer.record if timer is not None else lambda step: None
        step = 0
        mark(0)
        for index, launch in self.launches:
            while step < index:
                step += 1
                mark(step)
            launch()
        while step < self.steps:
            step += 1
            mark(step)

    def seconds(self, step: int) -> float:
        """Step `step`'s time in the last (profiled) compute."""
        if self.timer is None:
            raise RanvierError(f"cell {self.name} has no step times: no compute was profiled (reset_profile() starts that)")
        return self.timer.seconds(step, step + 1)

    def release(self) -> None:
        for graph in self.graphs.values():
            self.gpu.discard(graph)
        if self.timer is not None:
            self.timer.close()


def _overlap(a: Slot, b: Slot) -> bool:
    return a.offset < b.offset + b.size and b.offset < a.offset + a.size


def _spans(slots: list[Slot], layout: list[Slot]) -> list[tuple[int, int]]:
    """The arena's byte ranges that hold `slots`, two joined where only the padding before
    the second lies between them (less than its alignment, and no variable of the `layout`)."""
    spans: list[list[int]] = []
    for start, stop, alignment in sorted({(slot.offset, slot.offset + slot.var.nbytes, slot.alignment) for slot in slots}):
        if spans and start - spans[-1][1] < alignment and not any(
                other.offset < start and spans[-1][1] < other.offset + other.size for other in layout):
            spans[-1][1] = max(spans[-1][1], stop)
        else:
            spans.append([start, stop])
    return [(start, stop) for start, stop in spans]
