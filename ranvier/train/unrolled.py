"""UnrolledTrainer: K optimizer steps per `compute()` call.

A fixed number of steps has no data-dependent control flow, so the whole
forward → backward → update recurrence unrolls into one function: step k reads the
parameter and state values step k−1 computed, and only the last values are written
back to the resident globals. The host feeds K minibatches and K learning rates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..autodiff import gradient
from ..distributed import current_world
from ..errors import RanvierError
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Variable
from .nonfinite import NonFiniteError, describe
from .optimizers import current_value
from .options import TrainOptions
from .trainer import TrainerBase, assign_all, step_updates

BuildLoss = Callable[[Builder, dict[str, Tensor], int], Tensor]


# The options an UnrolledTrainer cannot honour, and why.
REFUSED = {
    "accumulate": "each of its K steps takes one batch; accumulate micro-batches with a Trainer",
    "loss_scale": "its K steps run in one compute() call, with no point between them for a dynamic scale to back off "
                  "or a skipped step to be counted",
    "precision": "its steps hand the updated parameters and optimizer state to the next inside the cell, where "
                 "half-precision activations would round them",
}


class UnrolledTrainer(TrainerBase):
    """`build_loss(b, params, k)` builds step k's loss from the given parameter values,
    creating that step's inputs with `b.var(...)` (one set per step, same order each time).

    optimizer, options: as the Trainer's (a TrainOptions, or its fields as keyword
        arguments), but for accumulate, loss_scale and precision, which it refuses, and a
        world of more than one rank. `grad_norm` is the last of the K steps'.
    predict: an output of another function of the flow, for `evaluate` and `accuracy`.
    func: the name of the function the K steps are built in.
    """

    def __init__(
        self,
        flow: Flow,
        build_loss: BuildLoss,
        params: Sequence[Tensor],
        steps_per_call: int,
        optimizer=None,
        options: TrainOptions | None = None,
        *,
        predict: Tensor | None = None,
        func: str = "train_unrolled",
        **settings,
    ):
        options = self._take_options(optimizer, options, settings, REFUSED)
        if steps_per_call < 1:
            raise RanvierError(f"steps_per_call must be >= 1, got {steps_per_call}")
        if (options.world or current_world()).size > 1:
            raise RanvierError("the UnrolledTrainer applies its K updates inside one compute() call, so there is no point "
                               "between them to average gradients over data-parallel ranks: use a Trainer or CheckpointedStack")
        self._join_world([])
        self.flow = flow
        self.k = steps_per_call
        b = Builder(flow, func)
        b.func.training = True
        self.func = b.func
        params = [b.wrap(p.var) for p in params]
        self.lrs_var = b.var("lrs", "float32", [self.k]).var
        lrs = b.wrap(self.lrs_var)

        current: dict[str, Tensor] = {}
        self.step_inputs: list[list] = []
        self.loss_vars = []
        self.finite_vars: list[Variable] = []
        finite = None
        for k in range(self.k):
            known = set(flow.vars)
            values = {p.name: current_value(current, p) for p in params}
            loss = build_loss(b, values, k)
            loss.var.out = True
            self.loss_vars.append(loss.var)
            self.step_inputs.append([v for name, v in flow.vars.items() if name not in known and v.in_])
            leaves = [values[p.name] for p in params]
            grads = gradient(flow, self.func, leaves, loss=loss, stop=leaves)
            lr = b.reshape(b.slice(lrs, [k], [1]), [])
            # Once a step is not finite, it and every later one write nothing.
            stepped = step_updates(b, params, [grads[v.name] for v in leaves], self.optimizer, lr, None, None, options.clip_norm,
                                   current, track_norm=options.track_grad_norm, finite_before=finite)
            finite = stepped.finite
            finite.var.out = True
            self.finite_vars.append(finite.var)
            current.update({target.name: value for target, value in stepped.updates})
        if any(len(inputs) != len(self.step_inputs[0]) for inputs in self.step_inputs):
            raise RanvierError("build_loss must create the same inputs for every unrolled step")
        assign_all(b, [(flow.vars[name], value) for name, value in current.items()])

        self.inputs = self.step_inputs[0]
        self.local_rows = self.inputs[0].shape[0]
        self.norm_var = stepped.norm.var if stepped.norm is not None else None
        if self.norm_var is not None:
            self.norm_var.out = True
        self._compile(predict)
        self.cell = self.network.cell(self.func.name)
        self.data = self.cell.instance()

    def step(self, batches: Sequence | None = None) -> list[float]:
        """K optimizer steps in one compute(): `batches` holds K batches, or None to sample
        them from the dataset. Returns the K losses."""
        if batches is not None and len(batches) != self.k:
            raise RanvierError(f"step() got {len(batches)} batches, expected {self.k} (one per unrolled step)")
        for k in range(self.k):
            named = self._next_batch(None if batches is None else batches[k])
            for first_step_var, var in zip(self.inputs, self.step_inputs[k]):
                self._feed(self.data, var, named[first_step_var.name])
        self.data[self.lrs_var] = np.array([self.schedule(self.step_count + k) for k in range(self.k)], np.float32)
        self.data.compute()
        for k, var in enumerate(self.finite_vars):
            if not self.data[var]:
                # Steps before k were applied; from k on nothing was.
                self.step_count += k
                loss = describe(f"the loss of step {self.step_count + 1}", self.data[self.loss_vars[k]])
                raise NonFiniteError(self.step_count + 1, loss or f"a gradient of step {self.step_count + 1} (its loss is finite)")
        self.step_count += self.k
        return [float(self.data[v]) for v in self.loss_vars]

    @property
    def grad_norm(self) -> float:
        """The last step's global gradient norm (before clipping): the K-th of the last call's."""
        if self.norm_var is None:
            raise RanvierError("the gradient norm is not computed: create the UnrolledTrainer with clip_norm or "
                               "track_grad_norm=True")
        return float(self.data[self.norm_var])
