"""PyTorch modules as flows: torch.export traces the module, ONNX carries the graph over.

`torch.onnx.export(..., dynamo=True)` runs `torch.export` and lowers its ATen graph to
ONNX; the importer then reads that model like any other. PyTorch stays optional: it is
imported only here, when called.

A trainable flow keeps the module's names: each parameter and buffer the graph reads is
reachable by its name in `module.state_dict()` (tied weights by each of theirs), so the
trained values load back with `module.load_state_dict`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import RanvierError
from ..flow.builder import Builder
from ..flow.graph import Flow
from .importer import load


def from_torch(module, example_inputs: Sequence, dims: Mapping[str, int] | None = None, function: str = "main",
               trainable: bool = False) -> Flow:
    """The module's forward pass on inputs shaped like `example_inputs` as a flow. Call
    `module.eval()` first for inference (dropout off, batch norm on running statistics).
    The flow's inputs are named after the forward's arguments.

    trainable: the forward pass as in training (the module's `train()` mode: batch norm on
        the batch's statistics, updating its running ones and `num_batches_tracked` in
        place; dropout on), with the parameters that require a gradient as learnable
        variables and everything else constant. The module itself is left as it was."""
    try:
        import torch
    except ImportError:
        raise RanvierError("from_torch needs PyTorch (pip install torch)") from None
    if not isinstance(module, torch.nn.Module):
        raise RanvierError(f"from_torch takes a torch.nn.Module, not {type(module).__name__}")
    if trainable:
        _check_trainable(module, torch)
    was_training = module.training
    try:
        # A trainable export traces the training-mode forward and is not optimized: the
        # optimizer would fold batch norm into the convolution before it, as for inference.
        module.train(trainable or was_training)
        with warnings.catch_warnings():  # a trainable export is of the training mode on purpose
            warnings.filterwarnings("ignore", "Exporting a model while it is in training mode")
            program = torch.onnx.export(module, tuple(example_inputs), dynamo=True, verbose=False, optimize=not trainable)
    except ImportError as error:
        raise RanvierError(f"torch.onnx.export needs {error.name or 'onnxscript'} (pip install onnxscript)") from None
    except Exception as error:  # noqa: BLE001  (torch.export raises many kinds for untraceable code)
        raise RanvierError(f"torch.export could not trace {type(module).__name__}: {type(error).__name__}: {str(error)[:400]}") from None
    finally:
        module.train(was_training)
    if not trainable:
        return load(program.model_proto, dims=dims, function=function)
    proto = program.model_proto
    tensors = _named_tensors(module)
    learnable = {t.name for t in proto.graph.initializer
                 if t.name in tensors and isinstance(tensors[t.name], torch.nn.Parameter) and tensors[t.name].requires_grad}
    flow = load(proto, dims=dims, function=function, trainable=learnable)
    _name_every_alias(flow, tensors)
    _count_batches(flow, module, function, torch)
    _padding_rows_learn_nothing(flow, module, function, torch)
    return flow


def _check_trainable(module, torch) -> None:
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm) and child.momentum is None:
            raise RanvierError(f"{name or type(module).__name__} is a batch norm with momentum=None (a cumulative average "
                               "of the batches' statistics); ranvier trains batch norms of a fixed momentum")


def _named_tensors(module) -> dict:
    """Every name of every parameter and buffer (a tied weight under each of its names)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def _name_every_alias(flow: Flow, tensors: dict) -> None:
    """A tied weight is in the graph once, under one of its names: give its variable the
    others too, so the state dict holds each name the module's has."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        names_of.setdefault(id(tensor), []).append(name)
    for var in list(flow.vars.values()):
        for alias in list(var.aliases):
            if alias in tensors and var.is_global:
                for other in names_of[id(tensors[alias])]:
                    flow.add_alias(var, other)


def _count_batches(flow: Flow, module, function: str, torch) -> None:
    """Each training batch norm's `num_batches_tracked`, counted up by the step as the
    module's forward does, so its state dict is whole."""
    b = Builder(flow, function)
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.modules.batchnorm._BatchNorm) or child.num_batches_tracked is None:
            continue
        prefix = f"{name}." if name else ""
        if flow.find_var(f"{prefix}running_mean") is None:
            continue  # not in the graph: a batch norm the forward does not use
        var = flow.add_var(b.varname(f"{prefix}num_batches_tracked"), "int64", [])
        var.set_data(np.asarray(child.num_batches_tracked.item(), np.int64))
        var.nogradient = True
        flow.add_alias(var, f"{prefix}num_batches_tracked")
        counter = b.wrap(var)
        b.assign(counter, counter + b.const(1, "int64"))


def _padding_rows_learn_nothing(flow: Flow, module, function: str, torch) -> None:
    """An nn.Embedding's padding row gets no gradient (its lookups read it as any row's);
    the ONNX graph has a plain Gather, so its lookups of that row go on through a copy
    that no gradient passes."""
    b = Builder(flow, function)
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.Embedding) or child.padding_idx is None:
            continue
        weight = flow.find_var(f"{name}.weight" if name else "weight")
        if weight is None or not weight.learnable:
            continue
        for gather in [op for op in weight.consumers if op.type == "Gather" and op.inputs[0] is weight]:
            rows, ids = b.wrap(gather.outputs[0]), b.wrap(gather.inputs[1])
            readers = list(rows.var.consumers)
            frozen = b.identity(rows)
            frozen.producer.nogradient = True
            padding = b.equal(ids, b.const(child.padding_idx, ids.dtype)).reshape([*ids.shape, *[1] * (rows.rank - ids.rank)])
            looked_up = b.cond(padding, frozen, rows)
            for reader in readers:
                reader.replace_input(rows.var, looked_up.var)
