"""CheckpointedStack: train a deep stack of identical layers with compile work and
activation memory that do not grow with depth (ANEForge's layer-streamed training).

A monolithic training step compiles every layer's forward and backward into one cell,
so compile time grows with depth and every layer's intermediate values are live at
once. Here the model is split into three stages, each compiled once:

    embed:  input → x₀                      (and its backward, into the embedding grads)
    layer:  xᵢ, wᵢ → xᵢ₊₁                   one cell for every layer, weights fed per call
    head:   x_L, target → loss, ∂loss/∂x_L  (and the head's parameter gradients)

The forward keeps only each layer's input (the checkpoint). The backward of layer i
recomputes its forward from that input inside one reused `layer_backward` cell and
returns the input gradient (the upstream gradient of layer i − 1) with the weight
gradients. The weight gradients land in resident gradient buffers beside the
parameters, and one update cell applies the optimizer (clipping included) to all of
them, so parameters, optimizer state and checkpoints are named exactly as the
monolithic Trainer's and the two can load each other's checkpoints.

The model provides `depth`, `parameters(b)`, `layer_parameters(p, i)` (layer i's
parameters keyed by a name shared by all layers) and the stages `embed(b, x, p)`,
`layer(b, x, w)` and `head(b, x, p)`. A model whose layers add to the loss (a MoE
layer's load balancing) also provides `auxiliary_loss(b)`, the terms its layer built in
b's function: each layer's term joins the loss, and its backward is seeded with both the
upstream gradient and 1 for the term. `expert_loads(b)` values are read into `watched`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from .. import dtypes
from ..autodiff import gradient
from ..errors import RanvierError
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Variable
from ..profile import Profile, StepTime
from .nonfinite import NonFiniteError, first_in
from .optimizers import state_var
from .options import TrainOptions
from .trainer import TrainerBase, assign_all, step_updates

TensorType = tuple[str, Sequence[int]]  # (dtype, shape)
Loss = Callable[[Builder, Tensor, Tensor], Tensor]

# The options a stack cannot honour, and why.
REFUSED = {
    "precision": "half-precision activations are the Trainer's, whose one cell holds the whole step; the stack's cells "
                 "pass float32 activations through the host (use a Trainer)",
    "loss_scale": "the stack's activations and gradients are float32, which need no loss scaling, and its backward "
                  "is seeded unscaled",
}


class StackModel(Protocol):
    depth: int

    def parameters(self, b: Builder) -> dict[str, Tensor]: ...
    def layer_parameters(self, p: dict, i: int) -> dict[str, Tensor]: ...
    def embed(self, b: Builder, x: Tensor, p: dict) -> Tensor: ...
    def layer(self, b: Builder, x: Tensor, w: dict) -> Tensor: ...
    def head(self, b: Builder, x: Tensor, p: dict) -> Tensor: ...


class CheckpointedStack(TrainerBase):
    """A trainer whose step streams the layers through one compiled layer forward and
    one compiled layer backward (with recompute).

    input_type, target_type: (dtype, shape) of one micro-batch's model input and loss target.
    loss: `loss(b, model_output, target)` → scalar loss tensor.
    optimizer, options: as the Trainer's (a TrainOptions, or its fields as keyword
        arguments), but for precision and loss_scale, which it refuses. `accumulate` is
        micro-batches per step, their gradients averaged before the update. In a
        data-parallel run each layer's weight gradients are averaged over the ranks while
        the next layer's backward runs.
    name: the update cell's function name; the optimizer's state is named after it, so
        the default matches a monolithic Trainer built in a function "train".
    """

    def __init__(
        self,
        model: StackModel,
        input_type: TensorType,
        target_type: TensorType,
        loss: Loss,
        optimizer=None,
        options: TrainOptions | None = None,
        *,
        name: str = "train",
        **settings,
    ):
        options = self._take_options(optimizer, options, settings, REFUSED)
        self.model = model
        self.flow = flow = Flow()
        update = Builder(flow, name)
        update.func.training = True
        params = model.parameters(update)
        self.params = params
        owned = self._join_world(list(params.values()))
        self._layer_globals = [self._layer_names(params, i) for i in range(model.depth)]

        self.watched: dict[str, np.ndarray] = {}
        embed_input, x0 = self._build_embed(f"{name}/embed", input_type)
        self.act_type = (x0.dtype, list(x0.shape))
        layer_w = self._build_layer(f"{name}/layer")
        backward_w, backward_grads = self._build_layer_backward(f"{name}/layer_backward")
        head_target, head_loss, head_params = self._build_head(f"{name}/head", target_type, loss, with_gradient=True)
        self._eval_target, eval_loss, _ = self._build_head(f"{name}/head_eval", target_type, loss, with_gradient=False)
        self._build_embed_backward(f"{name}/embed_backward", input_type, head_params)

        # The head's and the embedding's gradients are written by their cells into resident
        # buffers; a layer's are copied from the layer backward into the update cell's inputs.
        in_layers = {global_name for layer in self._layer_globals for global_name in layer.values()}
        self.grads = {
            key: update.var(f"{key}.grad", p.dtype, p.shape) if p.var.name in in_layers else state_var(update, p.var, "grad")
            for key, p in params.items()
        }
        self.lr_var = update.var("lr", "float32", []).var
        stepped = step_updates(
            update, list(params.values()), [update.wrap(g.var) for g in self.grads.values()], self.optimizer,
            update.wrap(self.lr_var), None, None, options.clip_norm, track_norm=options.track_grad_norm, owned=owned,
        )
        assign_all(update, stepped.updates)
        self.norm_var = stepped.norm.var if stepped.norm is not None else None
        if self.norm_var is not None:
            self.norm_var.out = True
        self.finite_var = stepped.finite.var
        self.finite_var.out = True

        self.inputs = [embed_input, head_target]
        self.accumulate = options.accumulate
        self.local_rows = input_type[1][0] * options.accumulate
        self._compile(None)
        net = self.network
        self.embed_data = net.cell(f"{name}/embed").instance()
        self.layer_data = net.cell(f"{name}/layer").instance()
        self.backward_data = net.cell(f"{name}/layer_backward").instance()
        self.head_data = net.cell(f"{name}/head").instance()
        self.eval_data = net.cell(f"{name}/head_eval").instance()
        self.embed_backward_data = net.cell(f"{name}/embed_backward").instance()
        self.update_data = net.cell(name).instance()
        self._x0, self._head_loss, self._eval_loss = x0.var, head_loss.var, eval_loss.var
        self._layer_w, self._backward_w, self._backward_grads = layer_w, backward_w, backward_grads
        self._grad_names = {g.var.name for g in self.grads.values()}
        self._resident_grads = [g.var for g in self.grads.values() if g.var.is_global]
        key_of = {p.var.name: key for key, p in params.items()}
        self._layer_grad_vars = [
            {key: self.grads[key_of[global_name]].var for key, global_name in layer.items()} for layer in self._layer_globals
        ]
        # The checkpoints: layer i's input, for the backward's recompute.
        self._activations = [np.empty(self.act_type[1], dtypes.to_numpy(self.act_type[0])) for _ in range(model.depth + 1)]
        self._profiled_from = 0  # the step the profile starts after (reset_profile)
        self._start_parallel(list(params.values()))

    # ---- building the stages -------------------------------------------------------------

    def _layer_names(self, params: dict, i: int) -> dict[str, str]:
        """Layer i's {shared key: global name}; every layer must match layer 0."""
        def types(layer: dict) -> dict:
            return {key: (t.dtype, t.shape) for key, t in layer.items()}

        layer, first = self.model.layer_parameters(params, i), self.model.layer_parameters(params, 0)
        if types(layer) != types(first):
            raise RanvierError(
                f"CheckpointedStack needs identical layers: layer {i} has parameters {types(layer)}, layer 0 {types(first)}"
            )
        return {key: t.var.name for key, t in layer.items()}

    def _wrapped(self, b: Builder) -> dict[str, Tensor]:
        return {key: b.wrap(t.var) for key, t in self.params.items()}

    def _parameters_read(self, b: Builder) -> list[Tensor]:
        """The parameters b's function reads."""
        used = {v.name for v in self.flow.inputs(b.func)}
        return [t for t in self.params.values() if t.var.name in used]

    def _layer_inputs(self, b: Builder) -> tuple[Tensor, dict[str, Tensor]]:
        """A layer function's inputs: its input activation and its weights (fed per layer)."""
        dtype, shape = self.act_type
        x = b.var("x", dtype, shape)
        first = self.model.layer_parameters(self.params, 0)
        weights = {key: b.var(key, t.dtype, t.shape) for key, t in first.items()}
        return x, weights

    def _build_embed(self, name: str, input_type: TensorType) -> tuple[Variable, Tensor]:
        b = Builder(self.flow, name)
        x = b.var("input", input_type[0], input_type[1])
        x0 = self.model.embed(b, x, self._wrapped(b))
        x0.var.out = True
        return x.var, x0

    def _auxiliary_loss(self, b: Builder) -> Tensor | None:
        terms = getattr(self.model, "auxiliary_loss", None)
        return terms(b) if terms is not None else None

    def _build_layer(self, name: str) -> dict[str, Variable]:
        b = Builder(self.flow, name)
        b.func.training = True  # the forward of a training step (a MoE layer drops at capacity here too)
        x, weights = self._layer_inputs(b)
        y = self.model.layer(b, x, weights)
        y.var.out = True
        self._layer_x, self._layer_y = x.var, y.var
        aux = self._auxiliary_loss(b)
        self._layer_aux = aux.var if aux is not None else None
        loads = getattr(self.model, "expert_loads", lambda b: [])(b)
        self._layer_loads = [t.var for t in loads]
        for var in ([self._layer_aux] if aux is not None else []) + self._layer_loads:
            var.out = True
        return {key: w.var for key, w in weights.items()}

    def _build_layer_backward(self, name: str) -> tuple[dict[str, Variable], dict[str, Variable]]:
        b = Builder(self.flow, name)
        b.func.training = True
        x, weights = self._layer_inputs(b)
        dy = b.var("dy", *self.act_type)
        y = self.model.layer(b, x, weights)
        aux = self._auxiliary_loss(b)
        roots, seeds = ([y, aux], [dy, 1.0]) if aux is not None else (y, dy)
        grads = gradient(self.flow, b.func, [x, *weights.values()], loss=roots, seed=seeds)
        self._backward_x, self._backward_dy, self._backward_dx = x.var, dy.var, grads[x.name].var
        return {key: w.var for key, w in weights.items()}, {key: grads[w.name].var for key, w in weights.items()}

    def _build_head(self, name: str, target_type: TensorType, loss: Loss, with_gradient: bool):
        b = Builder(self.flow, name)
        x = b.var("x", *self.act_type)
        target = b.var("target", target_type[0], target_type[1])
        value = loss(b, self.model.head(b, x, self._wrapped(b)), target)
        if value.shape:
            raise RanvierError(f"the CheckpointedStack loss must be a scalar, got shape {value.shape}")
        value.var.out = True
        head_params = self._parameters_read(b)
        if with_gradient:
            b.func.training = True
            grads = gradient(self.flow, b.func, [x, *head_params], loss=value)
            self._head_x, self._head_dx = x.var, grads[x.name].var
            for p in head_params:
                b.op("Assign", [b.wrap(state_var(b, p.var, "grad").var), grads[p.name]])
        else:
            self._eval_x = x.var
        return target.var, value, head_params

    def _build_embed_backward(self, name: str, input_type: TensorType, head_params: list[Tensor]) -> None:
        """The embedding's gradients from dx₀; a parameter the head also uses (a shared
        classifier) adds to the gradient the head wrote."""
        b = Builder(self.flow, name)
        b.func.training = True
        x = b.var("input", input_type[0], input_type[1])
        dx = b.var("dx", *self.act_type)
        x0 = self.model.embed(b, x, self._wrapped(b))
        embed_params = self._parameters_read(b)
        grads = gradient(self.flow, b.func, embed_params, loss=x0, seed=dx)
        written_by_head = {p.var.name for p in head_params}
        for p in embed_params:
            accumulator = b.wrap(state_var(b, p.var, "grad").var)
            g = grads[p.name]
            b.op("Assign", [accumulator, accumulator + g if p.var.name in written_by_head else g])
        self._embed_backward_input, self._embed_backward_dx = x.var, dx.var

    # ---- running -------------------------------------------------------------------------

    def _feed_layer(self, data, weights: dict[str, Variable], i: int) -> None:
        globals_ = self.network.globals
        for key, var in weights.items():
            data[var] = globals_.read(self._layer_globals[i][key])  # read only: no copy back to a device

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Embed and run every layer, keeping each layer's input; returns the last output
        and what the layers report: their auxiliary losses' sum and expert loads."""
        self.embed_data[self.inputs[0]] = x
        self.embed_data.compute()
        acts = self._activations
        acts[0][...] = self.embed_data[self._x0]
        layer = self.layer_data
        reported: dict[str, np.ndarray] = {}
        aux = 0.0
        for i in range(self.model.depth):
            self._feed_layer(layer, self._layer_w, i)
            layer[self._layer_x] = acts[i]
            layer.compute()
            acts[i + 1][...] = layer[self._layer_y]
            if self._layer_aux is not None:
                aux += float(layer[self._layer_aux])
            for load in self._layer_loads:
                reported[f"load.{i}"] = np.array(layer[load], np.float64)
        if self._layer_aux is not None:
            reported["aux_loss"] = np.array(aux)
        return acts[-1], reported

    def compute_gradients(self, x: np.ndarray, target: np.ndarray, add: bool = False, reduce: bool = False) -> float:
        """Forward and backward of one micro-batch into the gradient buffers (added to
        what they hold with `add`); returns the loss. With `reduce` (the last micro-batch of
        a data-parallel step) each finished gradient is handed to the all-reduce at once."""
        self._check_batch(self.inputs[0], x)
        self._check_batch(self.inputs[1], target)
        # The head's and embedding's cells overwrite their resident gradients.
        earlier = [np.array(a) for a in self._resident_grad_arrays()] if add else []
        last, reported = self._forward(x)
        head = self.head_data
        head[self._head_x] = last
        head[self.inputs[1]] = target
        head.compute()
        backward = self.backward_data
        upstream = backward[self._backward_dy]
        upstream[...] = head[self._head_dx]
        for i in reversed(range(self.model.depth)):
            self._feed_layer(backward, self._backward_w, i)
            backward[self._backward_x] = self._activations[i]
            backward.compute()
            finished = []
            for key, var in self._backward_grads.items():
                accumulator = self.update_data[self._layer_grad_vars[i][key]]
                if add:
                    accumulator += backward[var]
                else:
                    accumulator[...] = backward[var]
                finished.append(accumulator)
            if reduce:
                self.reducer.submit(finished)
            upstream[...] = backward[self._backward_dx]
        embed = self.embed_backward_data
        embed[self._embed_backward_input] = x
        embed[self._embed_backward_dx] = upstream
        embed.compute()
        if add or reduce:  # else they stay where the cells wrote them
            resident = self._resident_grad_arrays()
            for accumulator, before in zip(resident, earlier):
                accumulator += before
            if reduce:
                self.reducer.submit(resident)
        for name, value in reported.items():
            self._add_watched(name, value, self.accumulate, fresh=not add)
        return float(head[self._head_loss]) + float(reported.get("aux_loss", 0.0))

    def _resident_grad_arrays(self) -> list[np.ndarray]:
        """The resident gradient buffers as they are now: fetched after the cells that write
        them, since a device's copy (the CUDA backend's) comes back, and the host's writes go
        out, only through such a fetch."""
        return [self.update_data[var] for var in self._resident_grads]

    def _batch_gradients(self, named: dict[str, np.ndarray]) -> float:
        """The gradients of a whole batch: the mean over its micro-batches. Returns the mean loss."""
        x, target = named[self.inputs[0].name], named[self.inputs[1].name]
        if len(x) != self.local_rows or len(target) != self.local_rows:
            raise RanvierError(
                f"a batch has {self.local_rows} rows ({self.accumulate} micro-batches of {self.inputs[0].shape[0]}), "
                f"got {len(x)} inputs and {len(target)} targets"
            )
        micro = self.inputs[0].shape[0]
        last = self.accumulate - 1
        losses = [self.compute_gradients(x[k * micro : (k + 1) * micro], target[k * micro : (k + 1) * micro], add=k > 0,
                                         reduce=k == last and self.reducer is not None)
                  for k in range(self.accumulate)]
        if self.reducer is not None:
            self.reduce_times = self.reducer.wait()
        if self.accumulate > 1:
            for g in self.grads.values():
                self.update_data[g.var] *= 1.0 / self.accumulate
        return self._mean_over_ranks(float(np.mean(losses)))

    def gradients(self, batch) -> tuple[float, dict[str, np.ndarray]]:
        """(loss, {parameter name: gradient}) of a batch [input, target], without updating."""
        loss = self._batch_gradients(self._next_batch(batch))
        return loss, {t.var.name: np.array(self.update_data[self.grads[key].var]) for key, t in self.params.items()}

    def step(self, batch=None) -> float:
        """One optimizer step on `batch` [input, target] (or the next sampled minibatch)."""
        loss = self._batch_gradients(self._next_batch(batch))
        self.update_data[self.lr_var] = float(self.schedule(self.step_count))
        self.update_data.compute()
        if not self.update_data[self.finite_var]:
            raise NonFiniteError(self.step_count + 1, self._first_nonfinite())
        self._gather_updated()
        self.step_count += 1
        return loss

    def _first_nonfinite(self) -> str:
        """The first non-finite value among what the host holds of the step, in the order it
        was computed: the layers' inputs (the last micro-batch's), then the gradients."""
        activations = [(f"the input of layer {i}" if i < self.model.depth else "the last layer's output", a)
                       for i, a in enumerate(self._activations)]
        gradients = [(f"the gradient of {p.var.name}", self.update_data[self.grads[key].var]) for key, p in self.params.items()]
        return first_in(activations + gradients) or "the sum of the squared gradients (it overflowed float32)"

    def loss(self, x: np.ndarray, target: np.ndarray) -> float:
        """The loss of a batch with the current parameters (forward only)."""
        self._check_batch(self.inputs[0], x)
        self._check_batch(self.inputs[1], target)
        self.eval_data[self._eval_x] = self._forward(x)[0]
        self.eval_data[self._eval_target] = target
        self.eval_data.compute()
        return float(self.eval_data[self._eval_loss])

    @property
    def grad_norm(self) -> float:
        """The last step's global gradient norm (before clipping)."""
        if self.norm_var is None:
            raise RanvierError("the gradient norm is not computed: create the stack with clip_norm or track_grad_norm=True")
        return float(self.update_data[self.norm_var])

    def _state_names(self) -> list[str]:
        """As the Trainer's: parameters and optimizer state (the gradient buffers are scratch)."""
        return [name for name in super()._state_names() if name not in self._grad_names]

    def _instances(self) -> list:
        return [self.embed_data, self.layer_data, self.head_data, self.backward_data, self.embed_backward_data, self.update_data]

    def reset_profile(self) -> None:
        """Start the profile afresh (on a GPU, start timing each step: see Instance.reset_profile)."""
        for data in self._instances():
            data.reset_profile()
        self._profiled_from = self.step_count

    def profile(self) -> Profile:
        """Time per training step of every stage's steps (the layer cells summed over layers),
        since the last reset_profile()."""
        instances = self._instances()
        profiled = max(self.step_count - self._profiled_from, 0)
        steps = max(profiled, 1)
        result = []
        for data in instances:
            seconds = data.cell.backend.step_seconds(data)
            all_cores = data.cell.backend.all_cores_seconds(data)
            for i, s in enumerate(data.cell.steps):
                result.append(StepTime(len(result), s.label, seconds[i] / steps, s.flops * data.computes // steps, s.op,
                                       all_cores[i] / steps))
        device = self.layer_data.device
        return Profile("checkpointed stack", profiled, result, device.device_name if device is not None else None,
                       timed=device is None or self.layer_data.profiling)
