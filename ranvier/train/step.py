"""A training step compiled from a model people already have: a PyTorch module, an ONNX
file, or a trainable flow made from either.

    step = ranvier.train.compile_step(module, loss="cross_entropy", optimizer=AdamW(lr=1e-3), batch=(x, y))
    for x, y in batches:
        loss = step(x, y)
    module.load_state_dict(step.state_dict())

The step is a `Trainer` (schedules, clipping, loss scaling, accumulation, checkpoints,
data parallelism): `compile_step` adds the loss to the model's function and hands the
rest over. Weights keep the model's names both ways (`state_dict`, `load_state_dict`,
and `read_state_dict` of a saved checkpoint).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from .. import dtypes
from ..compiler.attention import fuse_attention
from ..compiler.transposed import fold_transposed_operands
from ..errors import RanvierError
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Function
from .checkpoint import load_checkpoint
from .losses import mse, softmax_cross_entropy
from .optimizers import AdamW
from .options import TrainOptions
from .trainer import Trainer

Loss = str | Callable[[Tensor, Tensor], Tensor] | None
_LOSSES = ("cross_entropy", "mse")


def compile_step(model, loss: Loss = "cross_entropy", optimizer=None, batch: Sequence | None = None, *,
                 dims: Mapping[str, int] | None = None, seed: int = 0, options: TrainOptions | None = None,
                 **settings) -> CompiledStep:
    """Compile one training step of `model` (forward, loss, backward and update) into a cell.

    model: a torch.nn.Module (traced on `batch`'s inputs, see `ranvier.from_torch`), an ONNX
        file (its symbolic sizes bound by `dims`), or a flow from `from_torch(...,
        trainable=True)` or `ranvier.onnx.load(..., trainable=True)`.
    loss: "cross_entropy" (mean over the examples of the model's logits [..., classes]
        against integer classes [...]), "mse", a function `(output, target) -> scalar`
        built with ranvier's tensor operations, or None when the model's output is the
        loss. The model's first output is the loss's input (a model of several outputs
        gives the function the list).
    optimizer: default AdamW() (as torch.optim.AdamW's defaults).
    batch: an example batch: the model's inputs, then the target (unless loss is None),
        as numpy arrays or tensors. It fixes the shapes the step is compiled for; a
        module needs it, a flow or an ONNX file only for a target of its own shape.
    seed: where the dropout masks' sequence starts (the step counts on from it).
    options: the Trainer's TrainOptions (schedule, clip_norm, loss_scale, accumulate,
        backend, cpu, matmul, precision, world, zero, ...); keyword arguments named as its
        fields replace its values.
    """
    arrays = [_as_array(a) for a in batch] if batch is not None else None
    target_example = arrays[-1] if arrays is not None and loss is not None else None
    flow = _trainable_flow(model, arrays[:-1] if target_example is not None else arrays, dims)
    # A flow made here is the step's alone: the step trains its weights' arrays, not copies of them.
    return CompiledStep(flow, loss, optimizer or AdamW(), target_example, seed, options, share_data=flow is not model, **settings)


class CompiledStep(Trainer):
    """A Trainer over a trainable flow, called the way a PyTorch loop is written:
    `step(*batch)` takes the inputs and the target and returns the loss. share_data: train
    the flow's own weight arrays (a flow made for this step alone; see Trainer)."""

    def __init__(self, flow: Flow, loss: Loss, optimizer, target_example: np.ndarray | None = None, seed: int = 0,
                 options: TrainOptions | None = None, share_data: bool = False, **settings):
        if not (loss is None or callable(loss) or loss in _LOSSES):
            raise RanvierError(f"unknown loss {loss!r}: {' or '.join(_LOSSES)}, a function (output, target) -> scalar, "
                               "or None")
        if len(flow.funcs) != 1:
            raise RanvierError(f"compile_step takes a flow of one function (the model's), not {len(flow.funcs)}: "
                               f"{', '.join(flow.funcs)}")
        func = next(iter(flow.funcs.values()))
        _before_the_gradient(flow, func)
        b = Builder(flow, func)
        params = [b.wrap(v) for v in flow.vars.values() if v.learnable]
        if not params:
            raise RanvierError("the flow has no learnable variables: make it with from_torch(..., trainable=True) "
                               "or ranvier.onnx.load(..., trainable=True)")
        inputs = [b.wrap(v) for v in flow.inputs(func) if not v.is_global]
        outputs = [b.wrap(v) for v in flow.outputs(func)]
        if not outputs:
            raise RanvierError(f"function {func.name} has no outputs to compute a loss from")
        self.model_outputs = [output.var for output in outputs]  # what the loss is taken of (the logits)
        for output in outputs:  # the step's result is the loss: the model's outputs need no storage of their own
            output.var.out = False
        target = None if loss is None else _target(b, loss, outputs[0], target_example)
        total = _loss(loss, outputs, target)
        super().__init__(total, params, optimizer, options, inputs=[*inputs, *([target] if target is not None else [])],
                         share_data=share_data, **settings)
        self.names = _source_names(flow, set(self.state_arrays()))
        seed_var = flow.vars.get(f"{func.name}/dropout_seed")
        if seed_var is not None:
            self.network.globals[seed_var.name][...] = seed

    def __call__(self, *batch) -> float:
        """One optimizer step on a batch (the inputs, then the target); returns the loss."""
        return self.step([_as_array(a) for a in batch])

    # ---- weights by the model's names ------------------------------------------------------

    def weights(self) -> dict[str, np.ndarray]:
        """Copies of the parameters and running statistics, by the model's names."""
        return {name: np.array(self.network.globals[var]) for name, var in self.names.items()}

    def state_dict(self) -> dict:
        """The weights as torch tensors, for `module.load_state_dict`."""
        import torch

        return {name: torch.from_numpy(array) for name, array in self.weights().items()}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        """Set weights from a torch state dict or arrays by the model's names (with
        `strict`, every one of the step's and nothing else)."""
        unknown = sorted(set(state) - set(self.names))
        missing = sorted(set(self.names) - set(state))
        if strict and (unknown or missing):
            raise RanvierError(f"state dict does not match the step's weights: missing {missing[:5]}, unexpected {unknown[:5]}")
        for name, value in state.items():
            if name not in self.names:
                continue
            target = self.network.globals[self.names[name]]
            array = _as_array(value)
            if array.shape != target.shape:
                raise RanvierError(f"state dict's {name} has shape {list(array.shape)}, expected {list(target.shape)}")
            target[...] = array

    def save(self, directory, extra: dict | None = None) -> Path:
        """The Trainer's checkpoint, recording which array is which model name (see `read_state_dict`)."""
        return super().save(directory, {"names": self.names, **(extra or {})})


def read_state_dict(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """A compiled step's checkpoint's weights by the model's names, for PyTorch:
    `module.load_state_dict({k: torch.from_numpy(v) for k, v in read_state_dict(d).items()})`."""
    arrays, metadata = load_checkpoint(directory)
    names = metadata.get("names")
    if not isinstance(names, dict) or not all(isinstance(v, str) and v in arrays for v in names.values()):
        raise RanvierError(f"{directory} is not the checkpoint of a compiled step (its metadata names no model weights)")
    return {name: np.array(arrays[var]) for name, var in names.items()}


def _trainable_flow(model, inputs: list[np.ndarray] | None, dims: Mapping[str, int] | None) -> Flow:
    if isinstance(model, Flow):
        return model
    if isinstance(model, (str, os.PathLike)):
        from ..onnx import load

        return load(model, dims=dims, trainable=True)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and isinstance(model, torch.nn.Module):
        from ..onnx import from_torch

        if not inputs:
            raise RanvierError("compile_step of a torch module needs batch=(inputs..., target) to trace it on")
        return from_torch(model, [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs], dims, trainable=True)
    raise RanvierError(f"compile_step takes a torch module, an ONNX file or a trainable flow, not {type(model).__name__}")


def _before_the_gradient(flow: Flow, func: Function) -> None:
    """What the exporters write op by op, folded before the gradient is taken, so the
    backward is built from the folded ops: attention (its backward the fused AttentionGrad,
    which recomputes each block's probabilities rather than keeping every layer's batch ×
    heads × queries × keys scores) and products of transposed matrices (the product reads
    the matrix, so neither the copy nor its gradient's transpose back is made)."""
    keep = {v.name for v in flow.outputs(func)} | {v.name for v in flow.vars.values() if v.out or v.in_}
    fuse_attention(flow, func, keep)
    fold_transposed_operands(flow, func, keep)


def _as_array(value) -> np.ndarray:
    """A numpy array of a batch element or a weight (torch tensors included)."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _target(b: Builder, loss: Loss, output: Tensor, example: np.ndarray | None) -> Tensor:
    """The step's target input: shaped like `example`, else as the loss needs it."""
    if example is not None:
        dtype = dtypes.DT_INT32 if np.issubdtype(example.dtype, np.integer) else dtypes.DT_FLOAT
        shape = list(example.shape)
    elif loss == "cross_entropy":
        dtype, shape = dtypes.DT_INT32, output.shape[:-1]
    elif loss == "mse":
        dtype, shape = output.dtype, output.shape
    else:
        raise RanvierError("a loss function needs batch=(inputs..., target) to give its target's shape and type")
    if loss == "cross_entropy" and (dtype != dtypes.DT_INT32 or shape != output.shape[:-1]):
        raise RanvierError(f"cross_entropy takes integer classes of shape {output.shape[:-1]} for logits of shape "
                           f"{output.shape}, not {example.dtype}{list(example.shape)}")
    return b.var("target", dtype, shape)


def _loss(loss: Loss, outputs: list[Tensor], target: Tensor | None) -> Tensor:
    if loss is None:
        if outputs[0].shape:
            raise RanvierError(f"with loss=None the model's output is the loss, a scalar, not of shape {outputs[0].shape}")
        return outputs[0]
    if callable(loss):
        total = loss(outputs[0] if len(outputs) == 1 else outputs, target)
        if not isinstance(total, Tensor) or total.shape:
            raise RanvierError("the loss function must return a scalar Tensor")
        return total
    if loss == "cross_entropy":
        return softmax_cross_entropy(outputs[0], target, name="loss")
    return mse(outputs[0], target, name="loss")


def _source_names(flow: Flow, state: set[str]) -> dict[str, str]:
    """The model's name of every weight and statistic in the state -> its variable: its
    names in the model it was imported from (a tied weight has several), else a learnable
    variable's own (the optimizer's state and the dropout seed are the step's, not the model's)."""
    return {name: var.name for var in flow.vars.values() if var.name in state
            for name in var.aliases or ([var.name] if var.learnable else [])}
