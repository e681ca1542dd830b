"""ranvier as an ONNX backend (`onnx.backend.base.Backend`): `prepare(model)` returns a
representation whose `run(inputs)` compiles the model on its first call and computes it.

Like a JIT, the representation specializes on what fixes the compiled code: the sizes of
symbolic dimensions are taken from the inputs' shapes, and an input whose value fixes a
shape (a Reshape's target, a TopK's k, pads, axes, sizes given as graph inputs) is bound
to the value it holds; each distinct set of those is compiled once and kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from ..compiler import Compiler
from ..runtime import Instance
from .importer import load, read_model
from .node import OnnxError, ValueNeeded

_DEVICES = {DeviceType.CPU: "cpu"}


class RanvierRep(BackendRep):
    """A prepared model: compiled instances by the dims and bound values they were compiled for."""

    def __init__(self, model: onnx.ModelProto, device: str = "CPU", compiler: Compiler | None = None):
        self.model = read_model(model)
        if not RanvierBackend.supports_device(device):
            raise OnnxError(f"device {device!r}: ranvier's ONNX backend runs on the CPU")
        self.compiler = compiler or Compiler(_DEVICES[Device(device).type])
        initializers = {t.name for t in self.model.graph.initializer}
        self.inputs = [v for v in self.model.graph.input if v.name not in initializers]
        for value_info in self.inputs:  # refused here, before a sequence's values are read as an array
            if not value_info.type.HasField("tensor_type"):
                raise OnnxError(f"graph input {value_info.name!r} is not a tensor (sequences and maps are not supported)")
        self.outputs = [v.name for v in self.model.graph.output]
        self.bound: tuple[str, ...] = ()  # inputs whose values the compiled code depends on
        self.instances: dict[tuple, Instance] = {}

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        feeds = self._feeds(inputs)
        instance = self._instance(feeds)
        for name, value in feeds.items():
            if name in instance.cell:  # an input only read for its shape folds away
                instance[name] = value
        instance.compute()
        results = [np.array(instance[name]) for name in self.outputs]
        return namedtupledict("Outputs", self.outputs)(*results)

    def _instance(self, feeds: dict[str, np.ndarray]) -> Instance:
        """The instance compiled for these inputs' shapes and bound values, compiled on first sight."""
        while (key := self._key(feeds)) not in self.instances:
            try:
                self.instances[key] = self._compile(feeds)
            except ValueNeeded as needed:  # a shape-fixing value computed from inputs: bind them, compile again
                if needed.inputs <= set(self.bound):
                    raise
                self.bound = tuple(sorted({*self.bound, *needed.inputs}))
        return self.instances[key]

    def _feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        """The inputs by name: given as a mapping, or in the order of the graph's inputs."""
        names = [v.name for v in self.inputs]
        if isinstance(inputs, Mapping):
            feeds = {name: np.asarray(value) for name, value in inputs.items()}
        else:
            values = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(values) > len(names):
                raise OnnxError(f"the model takes {len(names)} inputs {names}; {len(values)} were given")
            feeds = {name: np.asarray(value) for name, value in zip(names, values)}
        if set(feeds) != set(names):
            raise OnnxError(f"the model takes inputs {names}; given {sorted(feeds)}")
        return feeds

    def _key(self, feeds: dict[str, np.ndarray]) -> tuple:
        shapes = tuple(feeds[v.name].shape for v in self.inputs)
        values = tuple((name, feeds[name].dtype.str, feeds[name].tobytes()) for name in self.bound)
        return shapes, values

    def _compile(self, feeds: dict[str, np.ndarray]) -> Instance:
        dims: dict[str, int] = {}
        for value_info in self.inputs:
            for dim, size in zip(value_info.type.tensor_type.shape.dim, feeds[value_info.name].shape):
                if dim.dim_param:
                    dims[dim.dim_param] = int(size)
        constants = {name: feeds[name] for name in self.bound}
        flow = load(self.model, dims=dims, constants=constants)
        return self.compiler.compile(flow).cell("main").instance()


class RanvierBackend(Backend):
    """ONNX's backend interface over ranvier's importer and compiler."""

    representation: type[RanvierRep] = RanvierRep  # what `prepare` returns

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", compiler: Compiler | None = None,
                **options: Any) -> RanvierRep:
        """The model, to be compiled when first run. `compiler` picks the target's variant
        (`Compiler("cpu", cpu="-avx512")`); of other options only the tolerances ONNX's
        test runner passes along for its own comparison (rtol, atol) are taken."""
        unknown = set(options) - {"rtol", "atol"}
        if unknown:
            raise OnnxError(f"options {sorted(unknown)} are not ranvier backend options; it takes compiler")
        return cls.representation(model, device, compiler)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **options: Any) -> tuple:
        return cls.prepare(model, device, **options).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return Device(device).type in _DEVICES
        except AttributeError:  # not a device type ONNX names
            return False


prepare = RanvierBackend.prepare
run_model = RanvierBackend.run_model
supports_device = RanvierBackend.supports_device
