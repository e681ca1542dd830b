"""Non-finite values in training: with loss scaling the step is skipped and counted;
without it, training stops naming the step and the first non-finite tensor, and the
step changed nothing."""

from __future__ import annotations

import numpy as np
import pytest

import ranvier as rv
from ranvier.models.llama import Llama, LlamaConfig
from ranvier.train.loss_scale import DynamicLossScale
from ranvier.train.losses import mse, softmax_cross_entropy
from ranvier.train.nonfinite import NonFiniteError, describe, replay
from ranvier.train.optimizers import SGD, Adam
from ranvier.train.stack import CheckpointedStack
from ranvier.train.trainer import Trainer
from ranvier.train.unrolled import UnrolledTrainer

RNG = np.random.default_rng(7)
X = RNG.standard_normal((64, 5)).astype(np.float32)
Y = RNG.standard_normal((64, 3)).astype(np.float32)
BATCH = 8


def batch(i: int) -> list[np.ndarray]:
    return [X[i * BATCH : (i + 1) * BATCH].copy(), Y[i * BATCH : (i + 1) * BATCH].copy()]


def sqrt_model(**options) -> Trainer:
    """y ≈ sqrt(x·W)·V: the square root of a negative product is NaN, from finite inputs."""
    flow = rv.Flow()
    f = rv.Builder(flow, "train")
    x = f.var("x", rv.DT_FLOAT, [BATCH // options.get("accumulate", 1), 5])
    y = f.var("y", rv.DT_FLOAT, [BATCH // options.get("accumulate", 1), 3])
    W = f.parameter("W", np.abs(RNG.standard_normal((5, 4))).astype(np.float32) * 0.3)
    V = f.parameter("V", RNG.standard_normal((4, 3)).astype(np.float32) * 0.3)
    hidden = f.sqrt(f.abs(x) @ W, name="root")
    return Trainer(mse(hidden @ V, y, name="loss"), [W, V], options.pop("optimizer", Adam(lr=0.01)), inputs=[x, y], **options)


def parameters(trainer) -> dict[str, np.ndarray]:
    return {name: array.copy() for name, array in trainer.state_arrays().items()}


def assert_unchanged(trainer, before: dict[str, np.ndarray]) -> None:
    for name, array in trainer.state_arrays().items():
        np.testing.assert_array_equal(array, before[name], err_msg=f"{name} changed on a non-finite step")


def test_describe_names_count_kind_and_first_index():
    array = np.ones((3, 4), np.float32)
    assert describe("a", array) is None
    array[1, 2], array[2, 0] = np.nan, -np.inf
    assert describe("a", array) == "a: 2 of 12 elements are NaN or inf, the first at [1, 2]"
    assert describe("ids", np.arange(4)) is None


def test_non_finite_input_stops_training_and_names_the_input():
    trainer = sqrt_model()
    for i in range(2):
        trainer.step(batch(i))
    before = parameters(trainer)
    x, y = batch(2)
    x[3, 1] = np.nan
    with pytest.raises(NonFiniteError) as caught:
        trainer.step([x, y])
    assert caught.value.step == 3
    assert "step 3:" in str(caught.value) and "input train/x: 1 of 40 elements are NaN, the first at [3, 1]" in str(caught.value)
    assert_unchanged(trainer, before)
    assert trainer.step_count == 2
    trainer.step(batch(3))  # the run can go on from where it stood
    assert trainer.step_count == 3


def test_the_first_op_producing_a_non_finite_value_is_named():
    trainer = sqrt_model(optimizer=SGD(lr=0.1))
    before = parameters(trainer)
    trainer.network["train/W"][0, 0] = -50.0  # sqrt of a negative product for some rows
    before["train/W"] = trainer.network["train/W"].copy()
    with pytest.raises(NonFiniteError) as caught:
        trainer.step(batch(0))
    message = str(caught.value)
    assert "step 1:" in message and "output of Sqrt op train/root" in message and "NaN" in message
    assert_unchanged(trainer, before)


def test_replay_finds_nothing_in_a_finite_step():
    trainer = sqrt_model()
    x, y = batch(0)
    values = {"train/x": x, "train/y": y, "train/lr": np.float32(0.01)}
    values.update(trainer.network.globals)
    assert replay(trainer.flow, trainer.func, values) is None


@pytest.mark.parametrize("row,named", [(0, "accumulated gradient train/W/grad_accumulator"), (5, "input train/x")])
def test_accumulated_micro_batches(row, named):
    """Only the last micro-batch is replayed; a non-finite earlier one is named by the
    accumulated gradient it left."""
    trainer = sqrt_model(accumulate=2)
    x, y = batch(0)
    x[row, 0] = np.inf
    before = parameters(trainer)
    with pytest.raises(NonFiniteError, match=named):
        trainer.step([x, y])
    assert_unchanged(trainer, before)
    trainer.step(batch(1))  # the accumulators start afresh
    assert np.isfinite(trainer.network["train/W"]).all() and trainer.step_count == 1


@pytest.mark.parametrize("loss_scale", [128.0, DynamicLossScale(initial=128.0, growth_interval=100)])
def test_with_loss_scaling_the_step_is_skipped_and_counted(loss_scale):
    trainer = sqrt_model(loss_scale=loss_scale)
    trainer.step(batch(0))
    before = {k: v for k, v in parameters(trainer).items() if "loss_scale" not in k and "skipped" not in k}
    x, y = batch(1)
    x[2, 2] = np.inf
    trainer.step([x, y])
    trainer.step([x, y])
    assert trainer.skipped_steps == 2
    for name, array in before.items():
        np.testing.assert_array_equal(trainer.network[name], array)
    trainer.step(batch(2))
    assert trainer.skipped_steps == 2 and trainer.step_count == 4
    assert not np.array_equal(trainer.network["train/W"], before["train/W"])


def test_clipping_derives_finiteness_from_the_norm():
    trainer = sqrt_model(clip_norm=1.0)
    before = parameters(trainer)
    x, y = batch(0)
    x[1, 4] = -np.inf
    with pytest.raises(NonFiniteError, match="input train/x"):
        trainer.step([x, y])
    assert_unchanged(trainer, before)


def test_unrolled_trainer_applies_the_steps_before_the_non_finite_one():
    flow = rv.Flow()
    f = rv.Builder(flow, "model")
    W = f.parameter("W", RNG.standard_normal((5, 3)).astype(np.float32))

    def build_loss(b, values, k):
        x = b.var(f"x{k}", rv.DT_FLOAT, [BATCH, 5])
        y = b.var(f"y{k}", rv.DT_FLOAT, [BATCH, 3])
        return mse(x @ values[W.name], y)

    unrolled = UnrolledTrainer(flow, build_loss, [W], steps_per_call=3, optimizer=SGD(lr=0.1))
    bad = batch(1)
    bad[1][0, 0] = np.nan
    start = unrolled.network[W.name].copy()
    with pytest.raises(NonFiniteError) as caught:
        unrolled.step([batch(0), bad, batch(2)])
    assert caught.value.step == 2 and "the loss of step 2" in str(caught.value)
    assert unrolled.step_count == 1
    x, y = batch(0)
    gradient = 2 * x.T @ (x @ start - y) / y.size
    np.testing.assert_allclose(unrolled.network[W.name], start - 0.1 * gradient, rtol=1e-5, atol=1e-6)


def test_checkpointed_stack_names_the_first_non_finite_activation():
    config = LlamaConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=20, hidden_dim=24, max_seq_len=8)
    types = ("int32", [2, 8])

    def loss(b, logits, targets):
        return softmax_cross_entropy(logits.reshape([16, 20]), targets.reshape([16]))

    stack = CheckpointedStack(Llama(config, seed=1), types, types, loss)
    tokens = np.random.default_rng(0).integers(0, 20, (2, 2, 8)).astype(np.int32)
    stack.step([tokens[0], tokens[1]])
    layer_weight = next(name for name in stack.network.globals if "layers.1" in name and name.endswith("wq"))
    stack.network[layer_weight][...] = np.inf
    before = parameters(stack)
    with pytest.raises(NonFiniteError) as caught:
        stack.step([tokens[0], tokens[1]])
    assert "step 2:" in str(caught.value) and "the last layer's output" in str(caught.value)
    assert_unchanged(stack, before)
