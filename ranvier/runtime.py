"""The runtime: a Network holds globals and cells; a Cell is compiled code plus its data
layout; an Instance is one cell's data, whose tensors are writable numpy views."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from . import dtypes, guards
from .errors import RanvierError, shape_str
from .flow.graph import Flow, Function, Operation, Variable
from .handles import Channel, TensorArray, TensorHandle
from .limits import check_allocation
from .ops import written_inputs
from .profile import Profile, StepTime

if TYPE_CHECKING:
    from .backends.base import Backend


@dataclass
class Slot:
    """Where one local variable lives in an instance's buffer."""

    var: Variable
    offset: int
    size: int
    alignment: int
    first: int  # step that writes it (-1: set before compute)
    last: int  # last step that reads it (len(steps): read after compute)


def workspace_variable(op: Operation, nbytes: int) -> Variable:
    """The working memory of `op`'s step (`Step.workspace`), `nbytes` bytes: a kernel that
    lists this variable among its operands is given the step's (a cell finds it by name)."""
    return Variable(f"{op.name}/workspace", dtypes.DT_UINT8, [nbytes])


@dataclass
class Step:
    """One computation of a cell: the op it computes and the kernel chosen for it (its name,
    as cells and profiles print it, and the backend's kernel itself, `chosen`, for the
    backend to generate the step's code from without choosing again)."""

    op: Operation
    kernel: str
    variant: str = ""
    flops: int = 0  # floating-point operations per execution, by the kernel's cost
    workspace: Variable | None = None  # the kernel's working memory, planned like a temporary
    chosen: object = None  # the backend's kernel (`backends.kernels.Kernel`); None where it has none

    @property
    def label(self) -> str:
        """The kernel with its CPU variant, as cells and profiles print it: "Calculate[avx2]"."""
        return f"{self.kernel}[{self.variant}]" if self.variant else self.kernel

    def __str__(self) -> str:
        outs = ", ".join(v.name for v in self.op.outputs)
        ins = ", ".join(v.name for v in self.op.inputs)
        lhs = f"{outs} = " if outs else ""
        expression = f"  // {self.op.attrs['expr']}" if "expr" in self.op.attrs else ""
        return f"{lhs}{self.label}({ins}){expression}"


ALIGNMENT = 64  # bytes: where globals and instance buffers start (a cache line; an AVX-512 vector)


def _zero_bytes(array: np.ndarray) -> bool:
    """Whether every byte of `array` is zero (a -0.0 is not). Its first cache line answers
    for most nonzero data (a model's weights) without the whole pass over it, which numpy's
    any() makes whatever it finds (200 MB: 7 ms, where copying them takes 16)."""
    if not array.flags.c_contiguous:
        return False
    data = array.reshape(-1).view(np.uint8)
    return not data[:ALIGNMENT].any() and not data.any()


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT, what: str = "a buffer") -> np.ndarray:
    """A zeroed uint8 buffer whose first byte is aligned (numpy only promises 16 bytes),
    between guard bytes in the test mode (`guards`; `what` names it there)."""
    return guards.allocate(nbytes, alignment, what=what)


def is_aligned(array: np.ndarray) -> bool:
    """Whether the array is C-contiguous and starts on an `ALIGNMENT` boundary."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0


def aligned_array(value: object, dtype: npt.DTypeLike) -> np.ndarray:
    """`value` as a C-contiguous array of `dtype` starting on an `ALIGNMENT` boundary: the
    array itself where it already is one, else an aligned copy."""
    array = np.asarray(value)
    if array.dtype == np.dtype(dtype) and is_aligned(array):
        return array
    copy = aligned_zeros(array.shape, dtype)
    copy[...] = array
    return copy


def aligned_zeros(shape: Sequence[int], dtype: npt.DTypeLike) -> np.ndarray:
    """A zeroed C-contiguous array of `dtype` starting on an `ALIGNMENT` boundary (its pages
    untouched until written, as np.zeros leaves them)."""
    return aligned_empty(math.prod(shape) * np.dtype(dtype).itemsize).view(dtype).reshape(shape)


def view_of(buffer: np.ndarray, offset: int, var: Variable) -> np.ndarray:
    dtype = dtypes.to_numpy(var.dtype)
    return buffer[offset : offset + var.nbytes].view(dtype).reshape(var.shape)


class GlobalArrays(MutableMapping[str, np.ndarray]):
    """A network's globals by name: host arrays. Where a device keeps them (the CUDA
    backend), `before_access(name, writing)` is told of each one the host is about to
    reach, so the device's newer value comes back first and, unless the host only reads
    it (`read`), the host's goes out before the next compute. An array handed out so holds
    the value of that moment: after a compute that may change it, fetch it again. `host`
    holds the arrays themselves, for the device to copy without that."""

    def __init__(self) -> None:
        self.host: dict[str, np.ndarray] = {}
        self.before_access: Callable[[str, bool], None] | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        array = self.host[name]
        if self.before_access is not None:
            self.before_access(name, True)
        return array

    def read(self, name: str) -> np.ndarray:
        """A global's value to read only (a read-only view), which then need not go back
        to a device (a layer's weights fed to a cell, a checkpoint's arrays)."""
        array = self.host[name]
        if self.before_access is not None:
            self.before_access(name, False)
        view: np.ndarray = array.view()
        view.flags.writeable = False
        return view

    def __setitem__(self, name: str, array: np.ndarray) -> None:
        self.host[name] = array

    def __delitem__(self, name: str) -> None:
        del self.host[name]

    def __contains__(self, name: object) -> bool:
        return name in self.host

    def __iter__(self) -> Iterator[str]:
        return iter(self.host)

    def __len__(self) -> int:
        return len(self.host)


class Network:
    """Compiled flow: the cells of its functions and the globals (constants, parameters) they share.

    A global starts as a copy of its variable's data, so training the network leaves the
    flow's data (a model's initial values) as it was. With `share_data` the network instead
    takes a variable's data array itself where that is already laid out as a global
    (`_shareable`): no second copy of the weights, and the two name the same memory."""

    def __init__(self, flow: Flow, backend_name: str, share_data: bool = False):
        self.flow = flow
        self.backend_name = backend_name
        self.share_data = share_data
        self.cells: dict[str, Cell] = {}
        self.globals = GlobalArrays()
        # Where a device keeps the globals, set by its backend (the CUDA backend's DeviceGlobals).
        self.device_globals: object = None
        self._prepared: dict[tuple[str, str, str], np.ndarray] = {}

    def add_global(self, var: Variable) -> np.ndarray:
        if var.name not in self.globals.host:
            if self.share_data and var.data is not None and _shareable(var):
                array = var.data
            else:
                # A learnable variable without an initial value starts at zero.
                check_allocation(var.nbytes, f"global variable {var.name}: {var.typestr()}")
                array = view_of(aligned_empty(var.nbytes, what=f"global {var.name}"), 0, var)
                if var.data is not None and not _zero_bytes(var.data):  # the buffer is zeros already, its pages untouched
                    array[...] = var.data
            self.globals[var.name] = array
        return self.globals[var.name]

    def prepared(self, var: Variable, form: str, target: str, make: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Constant `var` in a form a kernel reads (`make` of its value), made once per
        form and target and shared by every instance. The constant becomes read-only:
        a write to it would not reach the copy the kernels read."""
        key = (var.name, form, target)
        if key not in self._prepared:
            value = self.add_global(var)
            value.flags.writeable = False
            self._prepared[key] = make(value)
        return self._prepared[key]

    def cell(self, name: str) -> Cell:
        try:
            return self.cells[name]
        except KeyError:
            raise RanvierError(f"no cell {name!r} in the network; cells: {', '.join(self.cells) or 'none'}") from None

    def __getitem__(self, key: object) -> TensorArray:
        """The array of a global (constant or parameter), by handle, name or alias: writable,
        except a constant a kernel reads prepared (`prepared`: a GEMM's packed weights)."""
        var = self._global(key)
        return TensorArray.of(var, self.globals[var.name])

    def _global(self, key: object) -> Variable:
        var = self.flow.lookup(_key_name(key))
        if var.name not in self.globals:
            raise RanvierError(f"{var.name} is not a global of the network (it is local to a cell)")
        return var

    def __setitem__(self, key: object, value: object) -> None:
        """Set a global's elements (Myelin's `net[W] = array`); a scalar fills it."""
        array = self[key]
        value = np.asarray(value)
        if not array.flags.writeable:
            raise RanvierError(f"cannot set {array.name()}: a kernel reads it prepared, so it is read-only once compiled")
        try:
            array[...] = value
        except ValueError:
            raise RanvierError(
                f"cannot set {array.name()}: got an array of shape {list(value.shape)}, expected [{shape_str(array.shape)}]"
            ) from None

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: self.globals[name] for name in self.globals if self.flow.vars[name].learnable}

    def tensor(self, key: object) -> TensorHandle:
        """A global as Myelin's tensor handle."""
        var = self._global(key)
        return TensorHandle(var, lambda: self.globals[var.name])

    def profile(self) -> str:
        """The profiles of every instance that has computed, cell by cell (Myelin's net.profile())."""
        profiles = [str(data.profile()) for cell in self.cells.values() for data in cell.instances if data.computes]
        return "\n\n".join(profiles) or "no instance has computed yet"


def _shareable(var: Variable) -> bool:
    """Whether the variable's data can serve as its global: aligned and contiguous, of its
    dtype and shape, and writable."""
    data = var.data
    return (isinstance(data, np.ndarray) and data.dtype == dtypes.to_numpy(var.dtype) and list(data.shape) == var.shape
            and data.flags.writeable and is_aligned(data))


def _key_name(key: object) -> str:
    if isinstance(key, str):
        return key
    var = getattr(key, "var", key)
    if isinstance(var, Variable):
        return var.name
    return repr(key)


class Cell:
    """A compiled function: its steps, the layout of its instance data, and its code."""

    def __init__(
        self,
        network: Network,
        func: Function,
        steps: list[Step],
        slots: list[Slot],
        size: int,
        backend: Backend,
        roles: dict[str, str] | None = None,
        external: list[Variable] | None = None,
    ):
        self.network = network
        self.func = func
        self.name = func.name
        self.steps = steps
        self.slots = slots
        self.size = size
        self.backend = backend
        self.roles = roles or {}
        self.external = external or []
        self._slot_by_name = {s.var.name: s for s in slots}
        self._index = {s.var.name: i for i, s in enumerate(slots)}
        self.global_vars = _globals_of(steps)
        # The backend's compiled code, of its own type (the CPU's CPUCode, CUDA's CUDACode),
        # which its `finish` sets; None for a backend that generates none (the reference).
        self.native: object = None
        # Myelin names the link from a gradient cell to its forward instance `<cell>/primal`.
        self.primal_name = (func.primal_link or f"{self.name}/primal") if self.external else None
        self.instances: weakref.WeakSet[Instance] = weakref.WeakSet()

    def instance(self, primal: Instance | None = None) -> Instance:
        """A new instance. A cell that reads values computed by another cell (a gradient
        cell reading its forward pass) is linked to an instance of that cell: `primal`,
        given here or later as `data["<cell>/primal"] = forward_instance`."""
        data = Instance(self, primal)
        self.instances.add(data)
        return data

    @property
    def flops(self) -> int:
        """Floating-point operations per compute, by each step's kernel (convolutions
        count each window, which parameter counts cannot)."""
        return sum(step.flops for step in self.steps)

    def channel(self, key: object, size: int = 0) -> Channel:
        """A channel of `size` tensors shaped like the variable `key` (Myelin's cell.channel)."""
        return Channel(self.resolve(key), size)

    def __contains__(self, key: object) -> bool:
        """Whether the cell has this variable (or its primal link), as Myelin's `name in cell`."""
        name = _key_name(key)
        if name == self.primal_name:
            return True
        var = self.network.flow.find_var(name)
        return var is not None and (var.name in self._index or var in self.global_vars or var in self.external)

    def index(self, name: object) -> int:
        """The parameter id of a local variable, for fast lookups (`data[id]`); the primal
        link's id is one past the last variable's."""
        if _key_name(name) == self.primal_name:
            return len(self.slots)
        resolved = self.resolve(name)
        if resolved.name not in self._index:
            raise RanvierError(f"{resolved.name} is not a local variable of cell {self.name}")
        return self._index[resolved.name]

    def resolve(self, key: object) -> Variable:
        name = _key_name(key)
        var = self.network.flow.find_var(name)
        if var is None:
            raise RanvierError(f"cell {self.name} has no variable {name!r}")
        return var

    def slot(self, var: Variable) -> Slot | None:
        return self._slot_by_name.get(var.name)

    def llvm_ir(self) -> str:
        """The LLVM IR generated for this cell (as the backend emits it, before LLVM optimizes)."""
        return self.backend.code(self, "llvm")

    def asm(self) -> str:
        """The cell's machine code as assembly."""
        return self.backend.code(self, "asm")

    def __str__(self) -> str:
        lines = [f"cell {self.name} {{  // size {self.size}"]
        regions: list[tuple[int, int]] = []
        for slot in self.slots:
            var = slot.var
            shared = any(slot.offset < stop and start < slot.offset + slot.size for start, stop in regions)
            role = "  union" if shared else " ".join(filter(None, [self.roles.get(var.name, ""), "var"]))
            lines.append(
                f"  {role} {var.name}: {var.typestr()}"
                f"    // offset {slot.offset} size {var.nbytes} alignment {slot.alignment} row-major"
            )
            regions.append((slot.offset, slot.offset + slot.size))
        if self.global_vars:
            lines.append("")
        written = {v.name for step in self.steps for v in written_inputs(step.op)}
        for var in self.global_vars:
            kind = "learnable" if var.learnable else ("state" if var.name in written else "const")
            lines.append(f"  {kind} {var.name}: {var.typestr()}    // size {var.nbytes} alignment 64 row-major")
        lines.append("")
        for step in self.steps:
            lines.append(f"  {step}")
        lines.append("}")
        return "\n".join(lines)


def _globals_of(steps: list[Step]) -> list[Variable]:
    seen: dict[str, Variable] = {}
    for step in steps:
        for v in [*step.op.inputs, *step.op.outputs]:
            if v.is_global and v.name not in seen:
                seen[v.name] = v
    return list(seen.values())


class DeviceData(Protocol):
    """Where an instance's data lives on a device (the CUDA backend's DeviceInstance), which
    its backend sets as `Instance.device`: told of each local variable the host is about to
    read (its value comes back) or has set (it goes out before the next compute)."""

    @property
    def device_name(self) -> str:
        """The device's name, as profiles print it."""

    def before_read(self, var: Variable) -> None:
        """The host is about to read local `var`: its view must hold the device's value."""

    def after_write(self, var: Variable) -> None:
        """The host has set local `var` in its view: it goes to the device before the next compute."""

    def array(self, var: Variable) -> object:
        """`var`'s memory on the device, without a copy (`Instance.device_array`)."""

    def cleared(self) -> None:
        """The host zeroed the instance's buffer: every local's value is the host's now."""


class Instance:
    """One cell's data. `data[x]` is a writable numpy view with Myelin's tensor methods
    (`TensorArray`), `data.tensor(x)` Myelin's tensor handle; `compute()` runs the cell."""

    def __init__(self, cell: Cell, primal: Instance | None = None):
        self.cell = cell
        self.buffer = aligned_empty(cell.size, what=f"the data of an instance of cell {cell.name}")
        self._views = [view_of(self.buffer, s.offset, s.var) for s in cell.slots]
        self._by_name = {s.var.name: v for s, v in zip(cell.slots, self._views)}
        # Per-step time accumulated by the backend (its own unit: seconds or cycles).
        self.step_time = np.zeros(max(1, len(cell.steps)), cell.backend.step_time_dtype)
        self.all_cores_time = np.zeros_like(self.step_time)  # the part of it run on all cores
        self.computes = 0
        # Whether each step is timed: from the first reset_profile() on. The CPU backend times
        # every compute anyway (its counters cost nothing); a GPU only while this is set.
        self.profiling = False
        # Reference variables connected to channel elements: copied in before a compute,
        # and the ones the cell computes copied back after it.
        self._connected: dict[str, tuple[Variable, np.ndarray, bool]] = {}
        self.primal: Instance | None = None
        self._run: Callable[[], None] | None = None
        # Where the cell's data lives on a device, set by a backend that keeps it there; None
        # where the host's buffer is the data (the CPU).
        self.device: DeviceData | None = None
        if primal is not None or not cell.external:
            self.link(primal)

    def link(self, primal: Instance | None) -> None:
        """Bind the instance of the forward cell this (gradient) cell reads its values from
        (a cell that reads none, the gradient of a sum say, takes any instance and ignores it)."""
        if primal is not None and self.cell.external:
            sources = {op.func.name for v in self.cell.external if (op := v.producer) is not None and op.func is not None}
            if primal.cell.name not in sources:
                raise RanvierError(
                    f"cell {self.cell.name} reads values of cell {', '.join(sorted(sources))}, "
                    f"not of {primal.cell.name}; link it to an instance of that cell"
                )
        self.primal = primal
        self._run = self.cell.backend.bind(self.cell, self)

    def view(self, var: Variable) -> np.ndarray:
        """The host's array for any variable the cell touches: a slice of this instance, or a
        network global; what a backend computing on the host reads and writes. (Where a
        device computes, it may be stale: `data[x]` brings the device's value back.)"""
        local = self._by_name.get(var.name)
        if local is not None:
            return local
        if var.is_global:
            return self.cell.network.add_global(var)
        if self.primal is not None:
            return self.primal.view(var)
        raise RanvierError(f"{var.name} is not a variable of cell {self.cell.name}")

    def variable(self, key: object) -> Variable:
        """The variable a key names: a parameter id (`cell.index`), a name, alias or handle."""
        if isinstance(key, (int, np.integer)):
            if not 0 <= key < len(self._views):
                raise RanvierError(f"cell {self.cell.name} has no parameter id {key} (ids 0..{len(self._views) - 1})")
            return self.cell.slots[key].var
        return self.cell.resolve(key)

    def __getitem__(self, key: object) -> TensorArray:
        var = self.variable(key)
        if var.name not in self._by_name and not var.is_global and self.primal is not None:
            return self.primal[var]  # a value of the forward instance, brought up to date there
        if self.device is not None and var.name in self._by_name:
            self.device.before_read(var)
        return TensorArray.of(var, self._host_view(key, var))

    def _host_view(self, key: object, var: Variable) -> np.ndarray:
        return self._views[key] if isinstance(key, (int, np.integer)) else self.view(var)

    def __setitem__(self, key: object, value: object) -> None:
        if isinstance(value, Instance):
            if _key_name(key) != self.cell.primal_name and not (isinstance(key, (int, np.integer)) and key == len(self._views)):
                raise RanvierError(f"only the primal link {self.cell.primal_name or '(none: this cell reads no other cell)'} takes an instance")
            self.link(value)
            return
        var = self.variable(key)
        value = np.asarray(value)
        try:
            self._host_view(key, var)[...] = value  # overwritten whole: no need to fetch it from a device first
        except ValueError:
            raise RanvierError(
                f"cannot set {var.name}: got an array of shape {list(value.shape)}, expected [{shape_str(var.shape)}]"
            ) from None
        if self.device is not None and var.name in self._by_name:
            self.device.after_write(var)

    def device_array(self, key: object) -> object:
        """The variable's memory where the cell computes, shared without a copy: on the CPU
        the numpy view `data[key]`; on a GPU a handle other GPU libraries read in place
        (`ranvier.backends.cuda.resident.DeviceArray`)."""
        var = self.variable(key)
        return self[key] if self.device is None else self.device.array(var)

    def tensor(self, key: object) -> TensorHandle:
        """Myelin's tensor handle on one of the cell's variables."""
        return TensorHandle(self.variable(key), lambda: self[key])

    def connect(self, key: object, channel: Channel, index: int) -> None:
        """Make a reference variable of the cell stand for element `index` of `channel`."""
        var = self.cell.resolve(key)
        if not var.ref:
            raise RanvierError(f"{var.name} is not a reference variable; only those connect to channels")
        if var.shape != channel.format.shape or var.dtype != channel.format.dtype:
            raise RanvierError(f"{var.name} is {var.typestr()}; the channel holds {channel.format.typestr()}")
        computed = var.producer is not None and var.producer.func is self.cell.func
        self._connected[var.name] = (var, channel.element(index), computed)

    def compute(self) -> None:
        if self._run is None:
            raise RanvierError(
                f"cell {self.cell.name} reads values computed by another cell: link its primal first, "
                f"data[{self.cell.primal_name!r}] = <forward instance>, or cell.instance(primal=...)"
            )
        for var, element, _ in self._connected.values():
            self[var] = element
        try:
            self._run()
        finally:
            guards.check()
        for var, element, computed in self._connected.values():
            if computed:
                element[...] = self[var]
        self.computes += 1

    def clear(self) -> None:
        """Zero every local variable (a device's copy too)."""
        self.buffer[...] = 0
        if self.device is not None:
            self.device.cleared()

    def profile(self) -> Profile:
        """Time per step, averaged over the computes since the last `reset_profile()`."""
        seconds = self.cell.backend.step_seconds(self)
        all_cores = self.cell.backend.all_cores_seconds(self)
        computes = max(self.computes, 1)
        steps = [
            StepTime(i, s.label, seconds[i] / computes, s.flops, s.op, all_cores[i] / computes)
            for i, s in enumerate(self.cell.steps)
        ]
        return Profile(self.cell.name, self.computes, steps, self.device.device_name if self.device is not None else None,
                       timed=self.profiling or self.device is None)

    def reset_profile(self) -> None:
        """Start the profile afresh, and time each step from the next compute on (a GPU times
        steps only once asked: each costs a mark between kernels, read back after the compute)."""
        self.profiling = True
        self.computes = 0
        self.step_time[...] = 0
        self.all_cores_time[...] = 0

    def __str__(self) -> str:
        """Every variable of the instance with its value, one a line, as Myelin prints an instance."""
        values = (self[index] for index in range(len(self.cell.slots)))
        return "".join(f"{v.name()} = {np.array2string(v, separator=',', max_line_width=1 << 30)}\n" for v in values)

    def __repr__(self) -> str:
        return f"<Instance of cell {self.cell.name}, {self.cell.size} bytes>"
