"""CheckpointedStack: streamed layers give the monolithic step's gradients and updates,
with compiled cells and per-layer memory that do not depend on depth."""

from __future__ import annotations

import numpy as np
import pytest

from ranvier import RanvierError
from ranvier.autodiff import gradient
from ranvier.compiler import Compiler
from ranvier.flow.builder import Builder
from ranvier.flow.graph import Flow
from ranvier.models.llama import Llama, LlamaConfig
from ranvier.train.losses import softmax_cross_entropy
from ranvier.train.optimizers import AdamW
from ranvier.train.options import TrainOptions
from ranvier.train.schedules import WarmupCosine
from ranvier.train.stack import CheckpointedStack
from ranvier.train.trainer import Trainer

BATCH, SEQ = 2, 8


def config(layers: int = 3, shared: bool = True) -> LlamaConfig:
    return LlamaConfig(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=50, hidden_dim=40, max_seq_len=16, shared_classifier=shared)


def lm_loss(vocab: int):
    def loss(b, logits, targets):
        return softmax_cross_entropy(logits.reshape([BATCH * SEQ, vocab]), targets.reshape([BATCH * SEQ]))

    return loss


def batch(seed: int, vocab: int = 50):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32) for _ in range(2)]


def stack(c: LlamaConfig, **options) -> CheckpointedStack:
    types = ("int32", [BATCH, SEQ])
    return CheckpointedStack(Llama(c, seed=1), types, types, lm_loss(c.vocab_size), **options)


def monolithic(c: LlamaConfig, **options) -> tuple[Trainer, dict]:
    flow = Flow()
    f = Builder(flow, "train")
    tokens, targets = f.var("tokens", "int32", [BATCH, SEQ]), f.var("targets", "int32", [BATCH, SEQ])
    model = Llama(c, seed=1)
    params = model.parameters(f)
    loss = lm_loss(c.vocab_size)(f, model(f, tokens, params), targets)
    return Trainer(loss, list(params.values()), inputs=[tokens, targets], **options), params


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_gradients_equal_the_monolithic_backward(shared):
    c = config(shared=shared)
    x, y = batch(0)
    streamed_loss, streamed = stack(c).gradients([x, y])

    flow = Flow()
    f = Builder(flow, "whole")
    tokens, targets = f.var("tokens", "int32", [BATCH, SEQ]), f.var("targets", "int32", [BATCH, SEQ])
    params = Llama(c, seed=1).parameters(f)
    loss = lm_loss(c.vocab_size)(f, Llama(c, seed=1)(f, tokens, params), targets)
    loss.var.out = True
    grads = gradient(flow, f.func, list(params.values()), loss=loss)
    data = Compiler().compile(flow).cell("whole").instance()
    data[tokens], data[targets] = x, y
    data.compute()

    assert streamed_loss == float(data[loss])
    assert sorted(streamed) == sorted(grads)
    for name, g in grads.items():
        expected = data[g]
        assert np.abs(expected).max() > 0, name
        np.testing.assert_allclose(streamed[name], expected, rtol=1e-6, atol=1e-7 * np.abs(expected).max(), err_msg=name)


@pytest.mark.slow
def test_training_matches_the_monolithic_trainer_and_shares_its_checkpoints(tmp_path):
    c = config()
    schedule = WarmupCosine(lr=3e-3, warmup=2, total=6, floor=3e-4)
    options = {"optimizer": AdamW(lr=3e-3, beta2=0.95, weight_decay=0.1, decay_matrices_only=True),
               "options": TrainOptions(schedule=schedule, clip_norm=0.5)}  # one options object for both
    streamed = stack(c, **options)
    whole, _ = monolithic(c, **options)
    for step in range(4):
        x, y = batch(step)
        assert streamed.step([x, y]) == pytest.approx(whole.step([x, y]), rel=1e-6)
        assert streamed.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    mine, theirs = streamed.state_arrays(), whole.state_arrays()
    assert sorted(mine) == sorted(theirs)  # parameters, Adam moments and the step counter
    for name in mine:
        np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-7, err_msg=name)

    # A stack checkpoint resumes in the monolithic trainer, and the other way round.
    streamed.save(tmp_path / "stack")
    resumed, _ = monolithic(c, **options)
    resumed.load(tmp_path / "stack")
    x, y = batch(9)
    assert resumed.step([x, y]) == pytest.approx(streamed.step([x, y]), rel=1e-6)
    resumed.save(tmp_path / "whole")
    again = stack(c, optimizer=options["optimizer"], clip_norm=0.5)  # the schedule comes back with the checkpoint
    again.load(tmp_path / "whole")
    assert again.step_count == 5 and again.schedule == schedule
    for name, array in again.state_arrays().items():
        np.testing.assert_array_equal(array, resumed.state_arrays()[name], err_msg=name)


@pytest.mark.slow
def test_accumulated_micro_batches_match_the_trainer():
    c = config()
    options = {"optimizer": AdamW(lr=3e-3), "clip_norm": 1.0, "accumulate": 2}
    types = ("int32", [BATCH, SEQ])
    streamed = CheckpointedStack(Llama(c, seed=1), types, types, lm_loss(c.vocab_size), **options)
    flow = Flow()
    f = Builder(flow, "train")
    tokens, targets = f.var("tokens", "int32", [BATCH, SEQ]), f.var("targets", "int32", [BATCH, SEQ])
    params = Llama(c, seed=1).parameters(f)
    loss = lm_loss(c.vocab_size)(f, Llama(c, seed=1)(f, tokens, params), targets)
    whole = Trainer(loss, list(params.values()), inputs=[tokens, targets], **options)
    assert streamed.batch_rows == whole.batch_rows == 2 * BATCH
    for step in range(3):
        (x, y), (x2, y2) = batch(step), batch(step + 10)
        both = [np.concatenate([x, x2]), np.concatenate([y, y2])]
        assert streamed.step(both) == pytest.approx(whole.step(both), rel=1e-6)
    # The two hold the same state under the same names (the step counter is the training step's).
    mine, theirs = streamed.state_arrays(), whole.state_arrays()
    assert sorted(mine) == sorted(theirs)
    assert streamed.network["train/adam_step"] == whole.network["train/adam_step"] == 3
    for name, array in theirs.items():
        np.testing.assert_allclose(mine[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    with pytest.raises(RanvierError, match=r"a batch has 4 rows \(2 micro-batches of 2\), got 2 inputs and 2 targets"):
        streamed.step(batch(0))


def test_compiled_cells_and_layer_memory_do_not_grow_with_depth():
    shallow, deep = stack(config(layers=2)), stack(config(layers=6))
    assert sorted(shallow.network.cells) == sorted(deep.network.cells)
    for name, cell in shallow.network.cells.items():
        other = deep.network.cells[name]
        if name == "train":  # the optimizer update touches every parameter
            continue
        assert len(cell.steps) == len(other.steps), name
        assert cell.size == other.size, name
    # Only the checkpoints (one layer input per layer) grow with depth.
    assert len(deep._activations) == 7


def test_loss_runs_forward_only_and_agrees_with_the_training_loss():
    s = stack(config())
    x, y = batch(3)
    forward = s.loss(x, y)
    assert forward == s.step([x, y])
    assert s.loss(x, y) < forward  # the step learned something
    profile = s.profile()
    assert profile.total > 0 and any("layer_backward" in step.op.name for step in profile.steps)


@pytest.mark.parametrize("setting, message", [
    ({"precision": "bfloat16"}, "CheckpointedStack takes no precision='bfloat16': half-precision activations are the "
                                "Trainer's"),
    ({"loss_scale": 1024.0}, "CheckpointedStack takes no loss_scale=1024.0: the stack's activations and gradients are "
                             "float32"),
    ({"clip": 1.0}, "CheckpointedStack got unknown option clip; its options are schedule, clip_norm,"),
])
def test_options_the_stack_cannot_honour_are_refused_by_name(setting, message):
    with pytest.raises(RanvierError) as caught:
        stack(config(layers=1), **setting)
    assert str(caught.value).startswith(message)


def test_bad_batches_and_unequal_layers_are_refused():
    s = stack(config(layers=2))
    x, y = batch(0)
    with pytest.raises(RanvierError, match=r"batch for train/embed/input has shape \[2, 7\], expected \[2, 8\]"):
        s.gradients([x[:, :7], y])

    class Uneven(Llama):
        def __init__(self, c, seed=0):
            super().__init__(c, seed)
            self.initial["layers.1.wq"] = np.zeros((c.dim, c.dim + 1), np.float32)

    with pytest.raises(RanvierError, match="identical layers: layer 1"):
        CheckpointedStack(Uneven(config(layers=2)), ("int32", [BATCH, SEQ]), ("int32", [BATCH, SEQ]), lm_loss(50))
