"""MNIST data (IDX files and the bundled subset) and the `ranvier train mnist` job."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest

from ranvier.cli import main
from ranvier.data import mnist


def write_idx(path, array: np.ndarray, compress: bool = False) -> None:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C}
    header = struct.pack(">BBBB", 0, 0, codes[array.dtype], array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


@pytest.fixture
def idx_dir(tmp_path):
    rng = np.random.default_rng(7)
    for (images_name, labels_name), count, compress in ((mnist.TRAIN_FILES, 30, True), (mnist.TEST_FILES, 12, False)):
        suffix = ".gz" if compress else ""
        write_idx(tmp_path / f"{images_name}{suffix}", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8), compress)
        write_idx(tmp_path / f"{labels_name}{suffix}", rng.integers(0, 10, count, dtype=np.uint8), compress)
    return tmp_path


def test_idx_files_plain_and_gzipped(idx_dir):
    train, test = mnist.load(idx_dir)
    assert train.images.shape == (30, 28, 28) and train.labels.shape == (30,)
    assert test.images.shape == (12, 28, 28)
    expected = mnist.read_idx(idx_dir / "t10k-images-idx3-ubyte")
    np.testing.assert_array_equal(test.images, expected)
    assert train.flat().shape == (30, 784) and train.flat().max() <= 1.0
    assert train.nchw().shape == (30, 1, 28, 28)
    assert train.pixels([784]).dtype == np.uint8 and train.pixels([1, 28, 28]).shape == (30, 1, 28, 28)


def test_idx_reader_reads_big_endian_ints(tmp_path):
    values = np.arange(-3, 9, dtype=np.int32).reshape(3, 4)
    write_idx(tmp_path / "ints", values)
    np.testing.assert_array_equal(mnist.read_idx(tmp_path / "ints"), values)


def test_bad_idx_files_raise_clear_errors(idx_dir, tmp_path):
    path = idx_dir / "t10k-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(mnist.DatasetError, match="data has 9 bytes, expected 12"):
        mnist.read_idx(path)
    (tmp_path / "png").write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(mnist.DatasetError, match="not an IDX file"):
        mnist.read_idx(tmp_path / "png")
    (tmp_path / "broken.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(mnist.DatasetError, match="not a valid gzip"):
        mnist.read_idx(tmp_path / "broken.gz")
    with pytest.raises(mnist.DatasetError, match="not found"):
        mnist.load(tmp_path / "empty")


def test_bundled_subset():
    train, test = mnist.load()
    assert train.images.shape == (4000, 28, 28) and test.images.shape == (1000, 28, 28)
    # Stratified: every digit equally represented in both splits.
    assert np.bincount(test.labels).tolist() == [100] * 10
    assert np.bincount(train.labels).tolist() == [400] * 10
    assert train.images.max() == 255 and train.images.dtype == np.uint8


def metric_losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in lines if "loss" in r], [r for r in lines if "test_accuracy" in r]


def test_train_resume_and_eval_commands(tmp_path, capsys):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    main(["train", "mnist", "--steps", "40", "--run-dir", str(straight), "--quiet", "--checkpoint-every", "20"])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line.startswith("test_accuracy=0.")

    main(["train", "mnist", "--steps", "20", "--run-dir", str(interrupted), "--quiet"])
    main(["train", "mnist", "--resume", str(interrupted), "--steps", "40", "--quiet"])
    resumed_output = capsys.readouterr().out
    assert "training from step 20" in resumed_output

    straight_losses, straight_acc = metric_losses(straight)
    resumed_losses, resumed_acc = metric_losses(interrupted)
    assert resumed_losses == straight_losses  # step for step, bit for bit
    assert resumed_acc[-1]["test_accuracy"] == straight_acc[-1]["test_accuracy"]

    main(["eval", str(interrupted)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == last_line


@pytest.mark.slow
def test_mnist_mlp_recipe_reaches_target_accuracy(tmp_path, capsys):
    """The issue's recipe: 784-256-10 GELU MLP, Adam 1e-3, batch 128, 2,340 steps."""
    main(["train", "mnist", "--run-dir", str(tmp_path / "run"), "--quiet"])
    accuracy = float(capsys.readouterr().out.strip().splitlines()[-1].split("=")[1])
    assert accuracy >= 0.93


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_the_job_feeds_pixels_that_the_step_scales_as_the_float_images_would_be(model):
    """`ranvier train mnist` gathers uint8 pixels and divides them by 255 in the step: the
    losses, parameters and predictions are those of the same classifier fed
    `Split.flat()` / `nchw()` (numpy's pixels / np.float32(255))."""
    from ranvier.jobs.mnist import MnistConfig, example_shape, make_model, make_trainer
    from ranvier.train.classifier import build_classifier
    from ranvier.train.optimizers import Adam
    from ranvier.train.trainer import Trainer

    config = MnistConfig(model=model, batch=16, hidden=[32])
    pixels, train, test = make_trainer(config)
    setup = build_classifier(make_model(config), example_shape(config), 16)
    floats = Trainer(setup.loss, setup.params, Adam(lr=1e-3), predict=setup.logits, inputs=[setup.x, setup.labels])
    floats.set_dataset([train.flat() if model == "mlp" else train.nchw(), train.labels.astype(np.int32)])
    assert pixels.dataset["train/x"].dtype == np.uint8
    for _ in range(3):
        assert pixels.step() == floats.step()
    for name, value in floats.network.parameters().items():
        np.testing.assert_array_equal(pixels.network[name], value, err_msg=name)
    np.testing.assert_array_equal(pixels.evaluate(test.pixels(example_shape(config))[:50]),
                                  floats.evaluate((test.flat() if model == "mlp" else test.nchw())[:50]))


def test_float_images_for_a_pixel_input_are_refused_not_truncated():
    from ranvier.errors import RanvierError
    from ranvier.jobs.mnist import MnistConfig, make_trainer

    trainer, train, test = make_trainer(MnistConfig(batch=16, hidden=[16]))
    with pytest.raises(RanvierError, match=r"evaluate\(\)'s examples for infer/x is float32, expected uint8"):
        trainer.accuracy(test.flat(), test.labels)
    with pytest.raises(RanvierError, match="dataset for train/x is float32, expected uint8"):
        trainer.set_dataset([train.flat(), train.labels])
    with pytest.raises(RanvierError, match="batch for train/x is float32, expected uint8"):
        trainer.step([train.flat()[:16], train.labels[:16].astype(np.int32)])
    assert trainer.step([train.pixels([784])[:16], train.labels[:16]]) > 0  # uint8 labels widen to int32
