"""Trainers: compile a whole training step (forward, backward, update) into one cell.

Parameters and optimizer state are network globals that the step updates in place,
so nothing is recompiled and nothing crosses back to the host per step except the
scalars: the learning rate in, the loss out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import dtypes
from ..autodiff import gradient
from ..compiler import Compiler
from ..data.batches import BatchSampler
from ..distributed import GradientReducer, ParameterGather, ReduceTimes, World, current_world, owners
from ..errors import RanvierError
from ..flow.builder import Builder, Tensor
from ..flow.graph import Flow, Variable
from . import schedules
from .checkpoint import METADATA, check_compatible, load_checkpoint, save_checkpoint
from .loss_scale import DynamicLossScale, dynamic_updates, scale_tensor
from .nonfinite import NonFiniteError, first_in, replay
from .optimizers import Adam, Current, Update, counter_var, current_value, state_var
from .options import TrainOptions


def _all_finite(b: Builder, grads: list[Tensor]) -> Tensor:
    """True when every gradient element is finite: inf or NaN makes (s − s) NaN, never 0."""
    total = b.sum(grads[0])
    for g in grads[1:]:
        total = total + b.sum(g)
    return b.equal(total - total, 0.0)


@dataclass
class StepUpdates:
    updates: list[Update]  # (variable, new value), every one guarded by `finite`
    norm: Tensor | None  # the unscaled global gradient norm, when clipping or tracked
    finite: Tensor  # whether every gradient (and every earlier unrolled step's) was finite
    skipped: Tensor | None  # with loss scaling: the count of steps skipped as non-finite


def step_updates(
    b: Builder,
    params: list[Tensor],
    grads: list[Tensor],
    optimizer,
    lr: Tensor,
    scale: Tensor | None,
    loss_scale,
    clip_norm: float | None,
    current: Current | None = None,
    track_norm: bool = False,
    finite_before: Tensor | None = None,
    owned: Sequence[bool] | None = None,
    scope: str | None = None,
) -> StepUpdates:
    """Clip, apply the optimizer, and guard every write: a step whose gradients are not
    all finite (or that follows a non-finite one, `finite_before`) writes nothing. With
    loss scaling such a step is expected: the global `<function>/skipped_steps` counts it
    (and a dynamic scale backs off); without, the trainer stops on it.

    The norm costs a pass over every gradient and so is built only for clipping or when
    tracked; where it is, the finiteness test reads the sum of squares instead of taking
    a pass of its own (a sum of squares that overflows float32 counts as non-finite).

    owned: which parameters this step updates (ZeRO-1: a rank updates its own share and
    holds only their optimizer state); the norm and the test still see every gradient.
    scope: the name of the training step that the optimizer's step counter and the skipped
    steps are named after (default: b's function), so that a step split into a gradient
    cell and an update cell keeps the state names of one cell's.
    """
    # Tensor operators build into their left operand's function; make that b's.
    params = [b.wrap(p.var) for p in params]
    grads = [b.wrap(g.var) for g in grads]
    # The norm and the finiteness test run in float32 even for half-precision gradients.
    wide = [g if g.dtype in ("float32", "float64") else b.cast(g, "float32") for g in grads]
    norm = None
    if clip_norm is not None or track_norm:
        squares = b.sum_squares(wide[0])
        for g in wide[1:]:
            squares = squares + b.sum_squares(g)
        finite = b.equal(squares - squares, 0.0)
        norm = b.sqrt(squares)
        if scale is not None:
            norm = norm / scale
    else:
        finite = _all_finite(b, wide)
    if finite_before is not None:
        finite = b.logical_and(finite_before, finite)
    if clip_norm is not None:
        factor = b.minimum(b.const(1.0), clip_norm / (norm + 1e-6))
        grads = [g * (factor if g.dtype == factor.dtype else b.cast(factor, g.dtype)) for g in grads]
    if owned is not None:
        params = [p for p, mine in zip(params, owned) if mine]
        grads = [g for g, mine in zip(grads, owned) if mine]
    updates = optimizer.updates(b, params, grads, lr, scale, current, scope)
    updates = [(target, b.cond(finite, value, current_value(current, b.wrap(target)))) for target, value in updates]
    skipped = None
    if scale is not None:
        skipped = counter_var(b, f"{scope or b.func.name}/skipped_steps")
        updates.append((skipped.var, b.cond(finite, skipped, skipped + 1.0)))
    if isinstance(loss_scale, DynamicLossScale):
        updates += dynamic_updates(b, loss_scale, scale, finite)
    return StepUpdates(updates, norm, finite, skipped)


def assign_all(b: Builder, updates: list[Update]) -> None:
    for target, value in updates:
        b.op("Assign", [b.wrap(target), value])


def _check_kind(what: str, var: Variable, array: np.ndarray) -> None:
    """Values for an input convert to its dtype within their kind (float64 to float32, int64
    labels to int32), never across: float images would be truncated into a uint8 input."""
    wanted = dtypes.to_numpy(var.dtype)
    if not np.can_cast(array.dtype, wanted, "same_kind"):
        raise RanvierError(f"{what} for {var.name} is {array.dtype}, expected {np.dtype(wanted).name} "
                           f"(or a dtype of its kind: {var.name} is {var.typestr()})")


class TrainerBase:
    """What every trainer shares: the compiled network, the dataset sampler, the schedule,
    evaluation through a prediction cell, and checkpoints of all resident state."""

    flow: Flow
    inputs: list[Variable]  # the arrays one sampled example set feeds, in dataset order
    local_rows: int  # examples this process trains on per step() call (its micro-batches)
    watched: dict[str, np.ndarray]  # the last step's values of what the trainer was asked to watch
    world: World = World()  # the ranks of a data-parallel run; a single process by default
    zero: bool = False  # ZeRO-1: this rank holds the optimizer state of its own share of the parameters
    reduce_times = ReduceTimes()  # the last step's gradient all-reduce: busy seconds, wait, share hidden

    @property
    def batch_rows(self) -> int:
        """Examples per step over all ranks (the global batch, which the dataset is sampled in)."""
        return self.local_rows * self.world.size

    def _join_world(self, params: Sequence[Tensor]) -> list[bool] | None:
        """Take this process's place in the options' world (default: the MPI job it was
        started in, if any); with ZeRO-1, which of `params` this rank updates."""
        world = self.options.world
        self.world = world if world is not None else current_world()
        self.zero = self.options.zero and self.world.size > 1
        if not self.zero:
            return None
        self._owner = owners([int(np.prod(p.shape)) for p in params], self.world.size)
        return [owner == self.world.rank for owner in self._owner]

    def _start_parallel(self, params: Sequence[Tensor]) -> None:
        """After compiling: every rank starts from rank 0's parameters (as seeded alike, or not),
        and the collectives get their buffers."""
        self.reducer = GradientReducer(self.world) if self.world.size > 1 else None
        self._gather_params = None
        if self.world.size == 1:
            return
        # With ZeRO-1 no cell of this rank may read a parameter another rank updates (a
        # CheckpointedStack feeds its layers' weights from the globals): it is made a global here.
        arrays = [self.network.add_global(p.var) for p in params]
        for p, array in zip(params, arrays):
            self.world.broadcast_(array, f"the broadcast of {p.var.name} from rank 0")
        if self.zero:
            self._gather_params = ParameterGather(self.world, arrays, self._owner)
            self._param_names = [p.var.name for p in params]

    def _gather_updated(self) -> None:
        """With ZeRO-1, after an update: the parameters other ranks updated, into this rank's
        copies (fetched now, after the update: this rank's own read only)."""
        if self._gather_params is None:
            return
        globals_ = self.network.globals
        self._gather_params([globals_.read(name) if owner == self.world.rank else globals_[name]
                             for name, owner in zip(self._param_names, self._owner)])

    def parallel_summary(self) -> str:
        """One line on the data-parallel run: its ranks, each one's rows per step and the
        training state (parameters and optimizer state) each holds. Every rank calls it."""
        held = self.world.gather(sum(self.flow.vars[name].nbytes for name in self._state_names()), "counting each rank's state")
        sharing = "ZeRO-1: optimizer state sharded" if self.zero else "optimizer state replicated"
        return (f"data parallel: {self.world.size} workers, {self.local_rows} rows each per step; training state per worker "
                f"{', '.join(f'{n / 2**20:.1f}' for n in held)} MiB ({sharing})")

    def _mean_over_ranks(self, loss: float) -> float:
        """The step's loss and watched values, averaged over the ranks."""
        if self.world.size == 1:
            return loss
        names = sorted(self.watched)
        values = np.concatenate([[loss], *(np.ravel(self.watched[n]) for n in names)]).astype(np.float64)
        self.world.sum_(values, "the all-reduce of the loss")
        values /= self.world.size
        offset = 1
        for name in names:
            shape = np.shape(self.watched[name])
            size = int(np.prod(shape))
            self.watched[name] = values[offset : offset + size].reshape(shape)
            offset += size
        return float(values[0])

    def _add_watched(self, name: str, value: np.ndarray, parts: int, fresh: bool) -> None:
        """Add one compute's share of a watched value: `watched` holds the mean over the
        `parts` computes (micro-batches) of a step; `fresh` starts the step."""
        share = np.asarray(value, np.float64) / parts
        self.watched[name] = share if fresh else self.watched[name] + share

    def _take_options(self, optimizer, options: TrainOptions | None, settings: Mapping[str, Any],
                      refused: Mapping[str, str] | None = None) -> TrainOptions:
        """The trainer's options (`options` with the keyword arguments `settings` in place of
        its fields), refusing by name a setting this trainer cannot honour (`refused`: field →
        why); sets the optimizer and the schedule."""
        trainer = type(self).__name__
        self.options = TrainOptions.merged(options, settings, trainer)
        self.options.refuse(trainer, refused or {})
        self.optimizer = optimizer or Adam()
        self.schedule = self.options.schedule or schedules.Constant(self.optimizer.lr)
        return self.options

    def _compile(self, predict: Tensor | None, share_data: bool = False) -> None:
        options = self.options
        compile_start = time.perf_counter()
        compiler = Compiler(options.backend, cpu=options.cpu, matmul=options.matmul, denormals="flush", precision=options.precision)
        self.network = compiler.compile(self.flow, share_data)
        self.compile_seconds = time.perf_counter() - compile_start
        # Where the backend cannot run the requested precision, products and activations stay float32.
        matmul = compiler.options.matmul
        self.matmul = matmul if matmul in compiler.backend.capabilities.matmul_precisions else "float32"
        precision = options.precision
        self.precision = precision if precision in compiler.backend.capabilities.activation_precisions else "float32"
        self.predict_var = predict.var if predict is not None else None
        self.predict_data = self.network.cell(predict.var.producer.func.name).instance() if predict is not None else None
        self.step_count = 0
        self.sampler: BatchSampler | None = None
        self.dataset: dict[str, np.ndarray] = {}

    # ---- data --------------------------------------------------------------------------

    def set_dataset(self, arrays: Mapping | Sequence[np.ndarray], seed: int = 0, shuffle: bool = True) -> None:
        """Sample minibatches host-side from whole arrays, one per train-step input."""
        named = self._by_input(arrays, "dataset")
        sizes = {len(a) for a in named.values()}
        if len(sizes) != 1:
            raise RanvierError(f"dataset arrays have different lengths: {sorted(sizes)}")
        for var in self.inputs:
            array = named[var.name]
            if list(array.shape[1:]) != var.shape[1:]:
                raise RanvierError(f"dataset for {var.name} has examples of shape {list(array.shape[1:])}, expected {var.shape[1:]}")
            _check_kind("dataset", var, array)
        # Stored in the inputs' dtypes, so batches can be gathered straight into the cell.
        self.dataset = {v.name: np.ascontiguousarray(named[v.name], dtype=dtypes.to_numpy(v.dtype)) for v in self.inputs}
        # Every rank draws the same global batches and trains on its share of their rows.
        self.sampler = BatchSampler(sizes.pop(), self.batch_rows, seed=seed, shuffle=shuffle)

    def _by_input(self, arrays, what: str) -> dict[str, np.ndarray]:
        if isinstance(arrays, Mapping):
            named = {}
            for key, value in arrays.items():
                var = key.var if isinstance(key, Tensor) else (key if isinstance(key, Variable) else self.flow.lookup(key))
                named[var.name] = np.asarray(value)
        else:
            arrays = list(arrays)
            if len(arrays) != len(self.inputs):
                raise RanvierError(f"{what} has {len(arrays)} arrays, expected one per input: {', '.join(v.name for v in self.inputs)}")
            named = {v.name: np.asarray(a) for v, a in zip(self.inputs, arrays)}
        missing = [v.name for v in self.inputs if v.name not in named]
        if missing:
            raise RanvierError(f"{what} lacks arrays for inputs {', '.join(missing)}")
        return named

    def _next_batch(self, batch) -> dict[str, np.ndarray]:
        """This rank's rows of `batch` (the global batch, or already its own share) or of
        the next sampled one."""
        if batch is not None:
            named = self._by_input(batch, "batch")
            if self.world.size > 1:
                named = {name: a[self.world.rows(len(a))] if len(a) == self.batch_rows else a for name, a in named.items()}
            return named
        if self.sampler is None:
            raise RanvierError("step() needs a batch, or call set_dataset() first")
        indices = self.sampler.next()[self.world.rows(self.batch_rows)]
        return {name: array[indices] for name, array in self.dataset.items()}

    @staticmethod
    def _check_batch(var: Variable, array: np.ndarray) -> None:
        if list(np.shape(array)) != var.shape:
            raise RanvierError(f"batch for {var.name} has shape {list(np.shape(array))}, expected {var.shape}")
        _check_kind("batch", var, np.asarray(array))

    @classmethod
    def _feed(cls, data, var: Variable, array: np.ndarray) -> None:
        cls._check_batch(var, array)
        data[var] = array

    def step(self, batch=None):
        raise NotImplementedError

    def train(self, steps: int, progress: bool = True, callback: Callable[[int, float], None] | None = None) -> list[float]:
        """Call step() `steps` times on the dataset, with a progress bar (loss, steps/s, ETA)."""
        from ..progress import training_progress

        losses = []
        with training_progress(steps, enabled=progress) as report:
            for _ in range(steps):
                loss = self.step()
                losses.append(loss)
                report(float(np.mean(loss)))
                if callback is not None:
                    callback(self.step_count, loss)
        return losses

    # ---- evaluation --------------------------------------------------------------------------

    def evaluate(self, x: np.ndarray) -> np.ndarray:
        """Run the prediction cell over all of `x` in batches (the last one padded)."""
        if self.predict_data is None:
            raise RanvierError("evaluate() needs the trainer to be created with predict=<output tensor>")
        cell = self.predict_data.cell
        inputs = [v for v in self.flow.inputs(cell.func) if not v.is_global]
        if len(inputs) != 1:
            raise RanvierError(f"prediction cell {cell.name} has inputs {[v.name for v in inputs]}; evaluate() needs exactly one")
        (var,) = inputs
        x = np.asarray(x)
        if list(x.shape[1:]) != var.shape[1:]:
            raise RanvierError(f"evaluate() got examples of shape {list(x.shape[1:])}, expected {var.shape[1:]} for {var.name}")
        _check_kind("evaluate()'s examples", var, x)
        batch = var.shape[0]
        outputs = []
        for start in range(0, len(x), batch):
            chunk = x[start : start + batch]
            padded = np.zeros(var.shape, dtype=self.predict_data[var].dtype)
            padded[: len(chunk)] = chunk
            self.predict_data[var] = padded
            self.predict_data.compute()
            outputs.append(np.array(self.predict_data[self.predict_var][: len(chunk)]))
        return np.concatenate(outputs)

    def accuracy(self, x: np.ndarray, labels: np.ndarray) -> float:
        return float((self.evaluate(x).argmax(axis=-1) == np.asarray(labels)).mean())

    # ---- checkpoints --------------------------------------------------------------------------

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything training changes, by name (writable: a device's copy goes out again
        before the next step)."""
        return {name: self.network.globals[name] for name in self._state_names()}

    def _state_names(self) -> list[str]:
        """The globals training changes: parameters and every global an Assign writes.
        (Constants the compiler made, which the flow as built does not have, are not state.)"""
        written = {op.inputs[0].name for op in self.flow.ops.values() if op.type == "Assign"}
        return [name for name in sorted(self.network.globals)
                if name in written or (name in self.flow.vars and self.flow.vars[name].learnable)]

    def save(self, directory: str | Path, extra: dict | None = None) -> Path:
        """Write weights, optimizer state, step, schedule and data position, atomically.

        In a data-parallel run every rank calls it: rank 0 writes the one checkpoint (with
        ZeRO-1, of every rank's optimizer state), and it returns on each rank once written.
        The checkpoint is the same as a single process's, so a run resumes on any number of ranks."""
        state = {
            "step": self.step_count,
            "schedule": schedules.to_dict(self.schedule),
            "sampler": self.sampler.state() if self.sampler else None,
            **(extra or {}),
        }
        arrays = {name: self.network.globals.read(name) for name in self._state_names()}
        if self.zero:
            learnable = {name for name, var in self.flow.vars.items() if var.learnable}
            shares = self.world.collect({n: a for n, a in arrays.items() if n not in learnable}, "collecting the optimizer state")
            arrays = {name: array for share in shares or [] for name, array in share.items()} | arrays
        path = Path(directory)
        if self.world.is_root:
            path = save_checkpoint(directory, dict(sorted(arrays.items())), state)
        self.world.barrier(f"writing the checkpoint {directory}")
        return path

    def load(self, directory: str | Path) -> dict:
        """Restore a checkpoint saved by `save`: the state, the step, the data position and
        the schedule (one of `ranvier.train.schedules`; a function of the caller's stays as
        the trainer was given it), so training continues exactly where it stopped. A caller
        that plans the rest of the run afresh sets `schedule` after loading.
        (Every rank of a data-parallel run reads it: the run directory must be on a file
        system they all see.)"""
        arrays, metadata = load_checkpoint(directory)
        expected = self.state_arrays()
        every_rank = expected
        if self.zero:  # the checkpoint holds every rank's optimizer state: check it against them all
            layouts = self.world.gather({n: (a.dtype, a.shape) for n, a in expected.items()}, "checking the checkpoint")
            every_rank = {n: np.broadcast_to(np.zeros((), dtype), shape) for layout in layouts for n, (dtype, shape) in layout.items()}
        check_compatible(arrays, every_rank, str(directory))
        for name, target in expected.items():
            target[...] = arrays[name]
        self.step_count = int(metadata["step"])
        if metadata.get("schedule") is not None:  # (None: a schedule of the caller's, which stays)
            self.schedule = schedules.from_dict(metadata["schedule"], Path(directory) / METADATA)
        if self.sampler is not None:
            self.sampler.restore(metadata.get("sampler"), str(Path(directory) / METADATA))
        return metadata


class Trainer(TrainerBase):
    """Compile one train-step cell for `loss` over `params`; `step(batch)` returns the loss.

    optimizer: SGD, Adam (the default) or AdamW (`ranvier.train.optimizers`).
    options: a TrainOptions (schedule, clipping, accumulation, loss scaling, precision, the
        backend, data parallelism); keyword arguments named as its fields replace its values.
    predict: an output in another function of the same flow (sharing the parameters)
        that `evaluate` and `accuracy` run, e.g. the logits of an inference function.
    inputs: the step's inputs in the order `step` and `set_dataset` take their arrays
        (default: the loss's function's inputs).
    watch: {name: tensor of the loss's function} to read after every step into `watched`
        (the mean over micro-batches), e.g. an auxiliary loss or a MoE layer's expert loads.
    share_data: the network trains the flow's own arrays of the weights where they are
        aligned (see `Compiler.compile`), not copies: for a flow made for this trainer alone,
        one copy of the weights instead of two (the flow's data then moves with training).
    """

    def __init__(
        self,
        loss: Tensor,
        params: Sequence[Tensor],
        optimizer=None,
        options: TrainOptions | None = None,
        *,
        predict: Tensor | None = None,
        inputs: Sequence[Tensor] | None = None,
        watch: Mapping[str, Tensor] | None = None,
        share_data: bool = False,
        **settings,
    ):
        options = self._take_options(optimizer, options, settings)
        accumulate, loss_scale = options.accumulate, options.loss_scale
        self._watch = {name: t.var for name, t in (watch or {}).items()}
        for var in self._watch.values():
            if var.producer is None or var.producer.func is not loss.builder.func:
                raise RanvierError(f"Trainer can watch only values the loss's function computes; {var.name} is not one")
            var.out = True
        self.watched = {}
        self.accumulate = accumulate
        self.params = list(params)
        owned = self._join_world(self.params)
        self.flow = loss.builder.flow
        b = loss.builder
        self.func = b.func
        self.func.training = True
        self.loss_var = loss.var
        loss.var.out = True
        self.inputs = [t.var for t in inputs] if inputs is not None else self._function_inputs()
        self.local_rows = self.inputs[0].shape[0] * accumulate

        if options.precision == "float16" and loss_scale is None:
            loss_scale = DynamicLossScale()
        scale = scale_tensor(b, loss_scale, self.func.name)
        grads_by_name = gradient(self.flow, self.func, self.params, loss=loss, seed=scale)
        grads = [grads_by_name[p.name] for p in self.params]
        if accumulate == 1 and self.world.size == 1:
            self.lr_var = b.var("lr", "float32", []).var
            stepped = step_updates(b, self.params, grads, self.optimizer, b.wrap(self.lr_var), scale, loss_scale, options.clip_norm,
                                   track_norm=options.track_grad_norm)
            assign_all(b, stepped.updates)
            self.apply_func = None
            self._accumulators: list[Variable] = []
        else:
            # Micro-batches add their gradients into resident accumulators; a second
            # cell applies one update from their mean and clears them. (In a data-parallel
            # run the accumulators are averaged over the ranks in between.)
            apply = Builder(self.flow, f"{self.func.name}/apply")
            apply.func.training = True
            accumulated = []
            for p, g in zip(self.params, grads):
                acc = state_var(b, p.var, "grad_accumulator")
                b.op("Assign", [acc, acc + g])
                accumulated.append(apply.wrap(acc.var))
            self.lr_var = apply.var("lr", "float32", []).var
            mean_grads = [a * (1.0 / accumulate) for a in accumulated]
            apply_scale = scale_tensor(apply, loss_scale, self.func.name)
            stepped = step_updates(apply, self.params, mean_grads, self.optimizer, apply.wrap(self.lr_var), apply_scale, loss_scale,
                                   options.clip_norm, track_norm=options.track_grad_norm, owned=owned, scope=self.func.name)
            zero = apply.const(0.0)
            clear = [(acc.var, apply.broadcast_to(zero, acc.shape) if acc.shape else apply.identity(zero)) for acc in accumulated]
            if loss_scale is None:  # a skipped step keeps them, to name the culprit (see _check_finite)
                clear = [(acc.var, apply.cond(stepped.finite, value, acc)) for acc, (_, value) in zip(accumulated, clear)]
            assign_all(apply, stepped.updates + clear)
            self.apply_func = apply.func
            self._accumulators = [acc.var for acc in accumulated]
        self.norm_var = stepped.norm.var if stepped.norm is not None else None
        if self.norm_var is not None:
            self.norm_var.out = True
        self.finite_var = stepped.finite.var
        self.finite_var.out = True
        self.skipped_var = stepped.skipped.var if stepped.skipped is not None else None

        self._compile(predict, share_data)
        self.cell = self.network.cell(self.func.name)
        self.data = self.cell.instance()
        self.apply_data = self.network.cell(self.apply_func.name).instance() if self.apply_func else None
        self._input_views = {v.name: self.data[v] for v in self.inputs}
        self._lr_view = (self.apply_data or self.data)[self.lr_var]
        self._loss_view = self.data[self.loss_var]
        self._finite_view = (self.apply_data or self.data)[self.finite_var]
        self._start_parallel(self.params)

    def _state_names(self) -> list[str]:
        """As TrainerBase's, less the gradient accumulators (zero between steps), so the
        checkpoint is the same with or without accumulation and data parallelism."""
        scratch = {v.name for v in self._accumulators}
        return [name for name in super()._state_names() if name not in scratch]

    def _function_inputs(self) -> list[Variable]:
        used = {v.name for v in self.flow.inputs(self.func)}
        return [v for v in self.flow.vars.values() if v.name in used and not v.is_global]

    # ---- training --------------------------------------------------------------------------

    def step(self, batch=None) -> float:
        """One optimizer step on `batch` (or the next sampled minibatch); returns the loss."""
        lr = float(self.schedule(self.step_count))
        if batch is None and self.apply_data is None and self.sampler is not None:
            # The hot path: gather the sampled rows straight into the cell's input views.
            indices = self.sampler.next()
            for name, view in self._input_views.items():
                # The sampler's indices are in range; mode="raise" would also buffer the copy.
                np.take(self.dataset[name], indices, axis=0, out=view, mode="clip")
            self._lr_view[...] = lr
            self.data.compute()
            self._check_finite()
            self.step_count += 1
            self._read_watched(1, fresh=True)
            return float(self._loss_view)
        named = self._next_batch(batch)
        if self.apply_data is None:
            for var in self.inputs:
                self._feed(self.data, var, named[var.name])
            self.data[self.lr_var] = lr
            self.data.compute()
            self._check_finite()
            loss = float(self.data[self.loss_var])
            self._read_watched(1, fresh=True)
        else:
            micro = self.inputs[0].shape[0]
            loss = 0.0
            for k in range(self.accumulate):
                for var in self.inputs:
                    self._feed(self.data, var, named[var.name][k * micro : (k + 1) * micro])
                self.data.compute()
                loss += float(self.data[self.loss_var])
                self._read_watched(self.accumulate, fresh=k == 0)
            loss /= self.accumulate
            if self.reducer is not None:
                self.reducer.submit([self.network.globals[v.name] for v in self._accumulators])
                self.reduce_times = self.reducer.wait()
                loss = self._mean_over_ranks(loss)
            self.apply_data[self.lr_var] = lr
            self.apply_data.compute()
            self._check_finite()
            self._gather_updated()
        self.step_count += 1
        return loss

    def _check_finite(self) -> None:
        """Stop on a step the guard skipped, unless loss scaling expects such steps."""
        if self._finite_view or self.skipped_var is not None:
            return
        values = dict(self.network.globals)
        values.update({v.name: self.data[v] for v in self.flow.inputs(self.func, const=False) if v.name not in values})
        # With accumulation only the last micro-batch can be replayed (from empty
        # accumulators); an earlier one's non-finite gradient is still in the accumulators,
        # which the skipped step kept.
        values.update({v.name: np.zeros_like(values[v.name]) for v in self._accumulators})
        accumulated = [(f"accumulated gradient {v.name}", self.apply_data[v]) for v in self._accumulators]
        where = replay(self.flow, self.func, values) or first_in(accumulated)
        for v in self._accumulators:
            self.apply_data[v][...] = 0  # the next step starts afresh
        raise NonFiniteError(self.step_count + 1, where or "a gradient the compiled step computed (the numpy replay of the step stays finite)")

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (counted with loss scaling; without it,
        the first one stops training)."""
        return int(self.network.globals[self.skipped_var.name]) if self.skipped_var is not None else 0

    def _read_watched(self, parts: int, fresh: bool) -> None:
        for name, var in self._watch.items():
            self._add_watched(name, self.data[var], parts, fresh)

    def profile(self):
        """The train-step cell's profile: time per step of each kernel."""
        return self.data.profile()

    def reset_profile(self) -> None:
        """Start the profile afresh (on a GPU, start timing each step: see Instance.reset_profile)."""
        self.data.reset_profile()

    @property
    def grad_norm(self) -> float:
        """The last step's global gradient norm (before clipping)."""
        if self.norm_var is None:
            raise RanvierError("the gradient norm is not computed: create the Trainer with clip_norm or track_grad_norm=True")
        source = self.apply_data if self.apply_data is not None else self.data
        return float(source[self.norm_var])

