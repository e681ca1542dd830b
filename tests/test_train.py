"""Optimizers, schedules, clipping, accumulation, loss scaling, trainers and checkpoints."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

import ranvier as rv
from ranvier.distributed import World
from ranvier.models import CNN, MLP
from ranvier.train import schedules
from ranvier.train.checkpoint import CheckpointError
from ranvier.train.classifier import build_classifier
from ranvier.train.loss_scale import DynamicLossScale
from ranvier.train.losses import mse, softmax_cross_entropy
from ranvier.train.optimizers import SGD, Adam, AdamW
from ranvier.train.options import TrainOptions
from ranvier.train.trainer import Trainer
from ranvier.train.unrolled import UnrolledTrainer

RNG = np.random.default_rng(1234)
X = RNG.standard_normal((96, 7)).astype(np.float32)
W_TRUE = RNG.standard_normal((7, 3)).astype(np.float32)
Y = (X @ W_TRUE + 0.1 * RNG.standard_normal((96, 3))).astype(np.float32)
W0 = (0.3 * RNG.standard_normal((7, 3))).astype(np.float32)
B0 = (0.3 * RNG.standard_normal(3)).astype(np.float32)


def regression_trainer(optimizer, batch=16, **kwargs) -> Trainer:
    flow = rv.Flow()
    f = rv.Builder(flow, "train")
    x = f.var("x", rv.DT_FLOAT, [batch, 7])
    y = f.var("y", rv.DT_FLOAT, [batch, 3])
    W = f.parameter("W", W0)
    b = f.parameter("b", B0)
    loss = mse(x @ W + b, y, name="loss")
    return Trainer(loss, [W, b], optimizer, inputs=[x, y], **kwargs)


def torch_regression(make_optimizer, steps, batch=16, clip=None):
    W = torch.tensor(W0, requires_grad=True)
    b = torch.tensor(B0, requires_grad=True)
    opt = make_optimizer([W, b])
    losses = []
    for i in range(steps):
        xb = torch.tensor(X[i * batch % 96 : i * batch % 96 + batch])
        yb = torch.tensor(Y[i * batch % 96 : i * batch % 96 + batch])
        opt.zero_grad()
        loss = ((xb @ W + b - yb) ** 2).mean()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([W, b], clip)
        opt.step()
        losses.append(loss.item())
    return losses, W.detach().numpy(), b.detach().numpy()


def run(trainer: Trainer, steps: int, batch: int = 16) -> list[float]:
    return [trainer.step([X[i * batch % 96 : i * batch % 96 + batch], Y[i * batch % 96 : i * batch % 96 + batch]]) for i in range(steps)]


OPTIMIZER_CASES = [
    (lambda: SGD(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    (lambda: SGD(lr=0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    (lambda: SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (lambda: Adam(lr=0.02), lambda p: torch.optim.Adam(p, lr=0.02)),
    (lambda: Adam(lr=0.02, beta2=0.95, weight_decay=0.05), lambda p: torch.optim.Adam(p, lr=0.02, betas=(0.9, 0.95), weight_decay=0.05)),
    (lambda: AdamW(lr=0.02, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1)),
]


@pytest.mark.parametrize("ours,theirs", OPTIMIZER_CASES)
def test_optimizers_match_pytorch(ours, theirs):
    trainer = regression_trainer(ours())
    losses = run(trainer, 12)
    ref_losses, ref_W, ref_b = torch_regression(theirs, 12)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.network["train/W"], ref_W, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trainer.network["train/b"], ref_b, rtol=1e-4, atol=1e-5)


def test_global_norm_clipping_matches_pytorch():
    trainer = regression_trainer(SGD(lr=0.1), clip_norm=0.5)
    losses = run(trainer, 6)
    ref_losses, ref_W, _ = torch_regression(lambda p: torch.optim.SGD(p, lr=0.1), 6, clip=0.5)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    np.testing.assert_allclose(trainer.network["train/W"], ref_W, rtol=1e-4, atol=1e-6)
    assert trainer.grad_norm > 0.5  # the gradients were really clipped


def test_schedules():
    cosine = schedules.WarmupCosine(lr=1.0, warmup=10, total=110, floor=0.1)
    assert cosine(0) == pytest.approx(0.1) and cosine(9) == pytest.approx(1.0)
    assert cosine(60) == pytest.approx(0.55) and cosine(110) == pytest.approx(0.1) and cosine(500) == 0.1
    values = [cosine(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    linear = schedules.LinearDecay(lr=1.0, total=100, floor=0.0, warmup=0)
    assert linear(0) == 1.0 and linear(50) == pytest.approx(0.5) and linear(200) == 0.0
    assert schedules.Constant(0.3)(1000) == 0.3
    assert schedules.from_dict(schedules.to_dict(cosine), "checkpoint.json") == cosine
    assert schedules.from_dict({"type": "LinearDecay", "lr": 1, "total": 100}, "c.json") == schedules.LinearDecay(1.0, 100)
    assert schedules.to_dict(lambda step: 0.1) is None  # a function of the caller's: a checkpoint cannot rebuild it


@pytest.mark.parametrize("saved, message", [
    ({"type": "Cosine", "lr": 1.0}, 'c.json: schedule is {"type": "Cosine", "lr": 1.0}, expected an object whose type is '
                                    "one of Constant, WarmupCosine, LinearDecay"),
    ([1, 2], "c.json: schedule is [1, 2], expected an object"),
    ({"type": "Constant"}, "c.json: the Constant schedule has no settings, expected lr"),
    ({"type": "Constant", "lr": 1.0, "warmup": 3}, "c.json: the Constant schedule has lr, warmup, expected lr"),
    ({"type": "WarmupCosine", "lr": 1.0, "warmup": 2.5, "total": 10}, "c.json: warmup is 2.5, expected an integer"),
])
def test_a_saved_schedule_that_is_not_one_is_refused_by_name(saved, message):
    with pytest.raises(rv.RanvierError) as caught:
        schedules.from_dict(saved, "c.json")
    assert str(caught.value).startswith(message)


def test_schedule_feeds_the_compiled_step():
    trainer = regression_trainer(SGD(lr=1.0), schedule=schedules.LinearDecay(lr=0.05, total=4, floor=0.01))
    losses = run(trainer, 4)
    W = torch.tensor(W0, requires_grad=True)
    b = torch.tensor(B0, requires_grad=True)
    for i, lr in enumerate([0.05, 0.04, 0.03, 0.02]):
        xb, yb = torch.tensor(X[i * 16 : i * 16 + 16]), torch.tensor(Y[i * 16 : i * 16 + 16])
        loss = ((xb @ W + b - yb) ** 2).mean()
        assert losses[i] == pytest.approx(loss.item(), rel=1e-5)
        loss.backward()
        with torch.no_grad():
            W -= lr * W.grad
            b -= lr * b.grad
            W.grad = None
            b.grad = None


@pytest.mark.parametrize("optimizer", [lambda: SGD(lr=0.05, momentum=0.9), lambda: Adam(lr=0.01)])
def test_gradient_accumulation_equals_one_big_batch(optimizer):
    big = regression_trainer(optimizer(), batch=32)
    accumulated = regression_trainer(optimizer(), batch=8, accumulate=4)
    for i in range(3):
        batch = [X[i * 32 : i * 32 + 32], Y[i * 32 : i * 32 + 32]]
        assert accumulated.step(batch) == pytest.approx(big.step(batch), rel=1e-5)
    np.testing.assert_allclose(accumulated.network["train/W"], big.network["train/W"], rtol=1e-5, atol=1e-6)
    assert not accumulated.network["train/W/grad_accumulator"].any()  # cleared after each update


@pytest.mark.parametrize("optimizer", [lambda: SGD(lr=0.05, momentum=0.9), lambda: Adam(lr=0.01)])
def test_static_loss_scale_does_not_change_the_step(optimizer):
    plain = regression_trainer(optimizer())
    scaled = regression_trainer(optimizer(), loss_scale=1024.0)
    run(plain, 5)
    run(scaled, 5)
    np.testing.assert_allclose(scaled.network["train/W"], plain.network["train/W"], rtol=2e-4, atol=1e-6)


def test_dynamic_loss_scale_skips_non_finite_steps_and_adapts():
    policy = DynamicLossScale(initial=256.0, growth_interval=3, factor=2.0)
    trainer = regression_trainer(SGD(lr=0.05), loss_scale=policy)
    scale = trainer.network["train/loss_scale"]
    run(trainer, 3)
    assert float(scale) == 512.0  # grew after three finite steps
    before = trainer.network["train/W"].copy()
    bad_x = X[:16].copy()
    bad_x[0, 0] = np.inf
    trainer.step([bad_x, Y[:16]])
    np.testing.assert_array_equal(trainer.network["train/W"], before)  # update skipped
    assert float(scale) == 256.0  # backed off
    run(trainer, 1)
    assert not np.array_equal(trainer.network["train/W"], before)


def test_fp16_training_with_dynamic_loss_scale_converges():
    flow = rv.Flow()
    f = rv.Builder(flow, "train")
    x = f.var("x", rv.DT_HALF, [16, 7])
    y = f.var("y", rv.DT_HALF, [16, 3])
    W = f.parameter("W", W0.astype(np.float16))
    loss = mse(x @ W, y, name="loss")
    trainer = Trainer(loss, [W], SGD(lr=0.05), loss_scale=DynamicLossScale(initial=2.0**20, growth_interval=5), inputs=[x, y])
    trainer.set_dataset([X.astype(np.float16), Y.astype(np.float16)])
    losses = trainer.train(60, progress=False)
    assert float(trainer.network["train/loss_scale"]) < 2.0**20  # overflowed at first and backed off
    assert np.isfinite(trainer.network["train/W"].astype(np.float32)).all()
    assert np.mean(losses[-10:]) < 0.2 * losses[0]


def classifier_trainer(model=None, **kwargs):
    model = model or MLP([7, 16, 3], seed=3)
    setup = build_classifier(model, [7], 16, eval_batch=40)
    trainer = Trainer(setup.loss, setup.params, Adam(lr=0.01), predict=setup.logits, inputs=[setup.x, setup.labels], **kwargs)
    trainer.set_dataset([X, Y.argmax(axis=1).astype(np.int32)], seed=5)
    return trainer


def test_trainer_learns_and_evaluates_with_shared_parameters():
    trainer = classifier_trainer()
    labels = Y.argmax(axis=1)
    before = trainer.accuracy(X, labels)
    trainer.train(150, progress=False)
    assert trainer.accuracy(X, labels) > max(0.9, before)
    assert trainer.evaluate(X).shape == (96, 3)  # 96 = 2 full eval batches + a padded one


def unrolled_trainer(options: TrainOptions | None = None, **kwargs) -> UnrolledTrainer:
    """classifier_trainer's model and data, 4 steps a call."""
    flow = rv.Flow()
    model = MLP([7, 16, 3], seed=3)

    def build(b, params, k):
        x = b.var(f"x{k}", rv.DT_FLOAT, [16, 7])
        y = b.var(f"labels{k}", rv.DT_INT32, [16])
        return softmax_cross_entropy(model(b, x, params), y)

    params = list(model.parameters(rv.Builder(flow, "train_unrolled")).values())
    unrolled = UnrolledTrainer(flow, build, params, 4, Adam(lr=0.01), options, **kwargs)
    unrolled.set_dataset([X, Y.argmax(axis=1).astype(np.int32)], seed=5)
    return unrolled


def test_unrolled_trainer_equals_single_steps():
    options = TrainOptions(clip_norm=0.5, schedule=schedules.LinearDecay(lr=0.02, total=8))
    single = classifier_trainer(options=options)
    expected = single.train(8, progress=False)
    unrolled = unrolled_trainer(options)
    got = [loss for call in unrolled.train(2, progress=False) for loss in call]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(unrolled.network["mlp/W0"], single.network["mlp/W0"], rtol=1e-6)
    assert unrolled.step_count == 8
    assert unrolled.grad_norm == pytest.approx(single.grad_norm, rel=1e-5)  # the last of its 4 steps'
    with pytest.raises(rv.RanvierError, match="the gradient norm is not computed: create the UnrolledTrainer with clip_norm"):
        _ = unrolled_trainer().grad_norm


def test_one_options_object_for_every_trainer_and_keywords_in_place_of_its_fields():
    options = TrainOptions(clip_norm=0.5, track_grad_norm=True)
    by_object, by_keywords = classifier_trainer(options=options), classifier_trainer(clip_norm=0.5, track_grad_norm=True)
    assert by_object.train(3, progress=False) == by_keywords.train(3, progress=False)
    assert classifier_trainer(options=options, clip_norm=None).options == TrainOptions(track_grad_norm=True)
    with pytest.raises(rv.RanvierError, match=r"Trainer got unknown option clip; its options are schedule, clip_norm, "):
        classifier_trainer(clip=1.0)
    with pytest.raises(rv.RanvierError, match="accumulate must be an integer >= 1, got 0"):
        TrainOptions(accumulate=0)
    with pytest.raises(rv.RanvierError, match=r"clip_norm must be above 0 \(or None: no clipping\), got -1"):
        classifier_trainer(clip_norm=-1)


class TwoRanks(World):
    size = 2


@pytest.mark.parametrize("setting, message", [
    ({"accumulate": 2}, "UnrolledTrainer takes no accumulate=2: each of its K steps takes one batch"),
    ({"loss_scale": 128.0}, "UnrolledTrainer takes no loss_scale=128.0: its K steps run in one compute() call"),
    ({"precision": "bfloat16"}, "UnrolledTrainer takes no precision='bfloat16': its steps hand the updated parameters"),
    ({"world": TwoRanks()}, "the UnrolledTrainer applies its K updates inside one compute() call"),
])
def test_the_unrolled_trainer_refuses_what_it_cannot_honour_by_name(setting, message):
    with pytest.raises(rv.RanvierError) as caught:
        unrolled_trainer(TrainOptions(**setting))
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("kind", ["Trainer", "UnrolledTrainer"])
def test_resume_restores_the_schedule(tmp_path, kind):
    """A trainer built anew (with the optimizer's constant rate) takes the checkpoint's
    schedule: the rates it feeds and the losses after the resume are the uninterrupted run's."""
    make = classifier_trainer if kind == "Trainer" else unrolled_trainer
    calls = 4 if kind == "Trainer" else 1  # 4 steps either way
    schedule = schedules.WarmupCosine(lr=0.05, warmup=3, total=16, floor=0.001)

    def run(trainer, calls: int) -> tuple[list[float], list[float]]:
        losses, rates = [], []
        for _ in range(calls):
            losses += np.ravel(trainer.step()).tolist()
            rates += np.ravel(trainer.data[trainer.lr_var if kind == "Trainer" else trainer.lrs_var]).tolist()
        return losses, rates

    expected = run(make(schedule=schedule), 2 * calls)
    first = make(schedule=schedule)
    losses, rates = run(first, calls)
    first.save(tmp_path / "checkpoint")
    resumed = make()
    resumed.load(tmp_path / "checkpoint")
    assert resumed.schedule == schedule
    more_losses, more_rates = run(resumed, calls)
    assert rates + more_rates == expected[1]
    assert losses + more_losses == expected[0]  # bit for bit on the same backend


def test_a_schedule_of_the_callers_is_kept_on_load(tmp_path):
    def halving(step: int) -> float:
        return 0.02 / 2 ** step

    first = classifier_trainer(schedule=halving)
    first.train(2, progress=False)
    first.save(tmp_path / "checkpoint")
    resumed = classifier_trainer(schedule=halving)
    resumed.load(tmp_path / "checkpoint")
    assert resumed.schedule is halving and resumed.step_count == 2


def test_checkpoint_resume_is_exact(tmp_path):
    straight = classifier_trainer()
    expected = straight.train(20, progress=False)

    first = classifier_trainer()
    got = first.train(10, progress=False)
    first.save(tmp_path / "ckpt")
    resumed = classifier_trainer()
    resumed.load(tmp_path / "ckpt")
    assert resumed.step_count == 10
    got += resumed.train(10, progress=False)
    assert got == expected  # bit for bit on the same backend
    np.testing.assert_array_equal(resumed.network["mlp/W0"], straight.network["mlp/W0"])


def test_checkpoint_files_and_errors(tmp_path):
    trainer = classifier_trainer()
    trainer.train(3, progress=False)
    directory = trainer.save(tmp_path / "ckpt")
    meta = json.loads((directory / "checkpoint.json").read_text())
    assert meta["step"] == 3 and "mlp/W0/adam_m" in meta["arrays"] and meta["sampler"]["position"] == 48
    assert not list(directory.glob(".*tmp"))

    other = classifier_trainer(MLP([7, 32, 3], seed=3))
    with pytest.raises(CheckpointError, match=r"mlp/W0 is float32\[7, 16\], expected float32\[7, 32\]"):
        other.load(directory)

    weights = directory / meta["weights"]
    weights.write_bytes(weights.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="SHA-256"):
        classifier_trainer().load(directory)
    with pytest.raises(CheckpointError, match="missing"):
        classifier_trainer().load(tmp_path / "nowhere")


def test_bad_batches_are_named():
    trainer = classifier_trainer()
    with pytest.raises(rv.RanvierError, match=r"train/x has shape \[5, 7\], expected \[16, 7\]"):
        trainer.step([X[:5], np.zeros(5, np.int32)])
    with pytest.raises(rv.RanvierError, match="one per input"):
        trainer.step([X[:16]])


def test_cnn_trains_on_a_tiny_problem():
    rng = np.random.default_rng(0)
    images = rng.random((64, 1, 8, 8)).astype(np.float32)
    labels = (images[:, 0, :4].mean(axis=(1, 2)) > images[:, 0, 4:].mean(axis=(1, 2))).astype(np.int32)
    model = CNN(input_shape=(1, 8, 8), channels=(4,), kernel=3, classes=2, seed=1)
    setup = build_classifier(model, [1, 8, 8], 16, eval_batch=64)
    trainer = Trainer(setup.loss, setup.params, Adam(lr=0.01), predict=setup.logits, inputs=[setup.x, setup.labels])
    trainer.set_dataset([images, labels])
    losses = trainer.train(60, progress=False)
    assert np.mean(losses[-10:]) < 0.6 * losses[0]
    assert trainer.accuracy(images, labels) > 0.85
