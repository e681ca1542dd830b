"""What crosses between host and GPU per compute, counted through the driver layer: a
training step moves its batch in and a few bytes out, everything else stays on the device
until the host reads it.

The counts come from stand-ins for libcuda and libcublasLt that keep device memory in host
memory and record every call (no kernel runs: the bytes are counted, not computed); the
values the host reads back are checked on the host emulator."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
from helpers import random_array
from test_cuda_blas import _FakeCublasLt
from test_cuda_runtime import _classifier, _RecordingDriver

import ranvier as rv
from ranvier.backends.cuda import backend, blas, device, driver, emulator

COPIES = ("cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2")
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _stand_in_gpu(monkeypatch, events: list) -> driver.DriverGPU:
    """The device every CUDA cell runs on: the libcuda and libcublasLt stand-ins, recording
    each call in `events`."""
    monkeypatch.setattr(blas, "find_library", lambda: "libcublasLt.so.13")
    fake_driver, fake_blas = _RecordingDriver(events), _FakeCublasLt(events)
    gpu = driver.DriverGPU(lambda name: fake_blas if "cublas" in name else fake_driver)
    monkeypatch.setattr(backend.CUDABackend, "_gpu", lambda self, cell: gpu)
    return gpu


def _copies(events: list) -> list[tuple[str, int]]:
    """Each copy between host and device in `events`: its direction and bytes."""
    return [(call, args[2].value) for call, args in events if call in COPIES]


def _stories15m_trainer():
    """stories15M's training step as benchmarks/llama_train.py --backend cuda races it
    (AdamW, clipping, bfloat16 activations), on 2 × 32 tokens: the shape changes no count."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from common import ranvier_trainer
    finally:
        sys.path.remove(str(BENCHMARKS))
    from ranvier.models.llama import PRESETS, Llama

    model = Llama(dataclasses.replace(PRESETS["stories15M"], max_seq_len=32), seed=0)
    return ranvier_trainer(model, 2, 32, "bfloat16", backend="cuda", precision="bfloat16")


def test_a_training_step_moves_its_batch_in_and_a_few_bytes_out(monkeypatch):
    """After the first compute (which sends the parameters and optimizer state), a step of
    stories15M copies in its tokens, targets and learning rate, and copies out its status
    words, loss and finite flag: the batch's bytes and at most 64 more, in at most 3 copies.
    Gradients, parameters and optimizer state stay on the device; a gradient comes back
    when the host reads it, once."""
    events: list = []
    _stand_in_gpu(monkeypatch, events)
    trainer = _stories15m_trainer()
    # the stand-in runs no kernel: its finite flag reads 0, and the trainer would stop
    monkeypatch.setattr(trainer, "_check_finite", lambda: bool(trainer.data[trainer.finite_var]))
    batch_bytes = sum(var.nbytes for var in trainer.inputs)
    rng = np.random.default_rng(0)
    for step in range(4):
        events.clear()
        trainer.step([rng.integers(0, 32000, (2, 32)).astype(np.int32) for _ in range(2)])
        copies = _copies(events)
        if step == 0:
            parameters = sum(p.var.nbytes for p in trainer.params)
            assert sum(nbytes for _, nbytes in copies) > 3 * parameters  # they and AdamW's moments go up once
            continue
        moved = sum(nbytes for _, nbytes in copies)
        assert len(copies) <= 3 and batch_bytes <= moved <= batch_bytes + 64, copies
        assert not [call for call, _ in events if call.startswith("cuMem") and call not in COPIES], "no other memory call"
    gradient = next(var for var in trainer.flow.vars.values() if var.out and var.name.startswith("train/MatMul"))
    for _ in range(2):
        events.clear()
        trainer.data[gradient]
        assert _copies(events) == ([("cuMemcpyDtoH_v2", gradient.nbytes)] if _ == 0 else [])


def test_an_inference_output_is_copied_out_when_read(monkeypatch):
    """On the emulator: a compute copies out nothing of a [24, 10] output until the host
    reads it; the read brings the compute's values (the CPU's), once per compute."""
    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    downloads = []
    download = emulator.HostEmulator.download
    monkeypatch.setattr(emulator.HostEmulator, "download", lambda gpu, address, host: downloads.append(host.nbytes)
                        or download(gpu, address, host))
    values = {}
    for backend_name in ("cuda", "cpu"):
        flow = rv.Flow()
        shapes = _classifier(rv.Builder(flow, "f"))
        data = rv.Compiler(backend_name).compile(flow).cell("f").instance()
        probabilities = next(v for v in flow.vars.values() if v.out and v.dtype == "float32")
        values[backend_name] = []
        for seed in (1, 2):
            for i, (name, shape) in enumerate(shapes.items()):
                data[name] = random_array(shape, "float32", seed=seed * 10 + i) * (1 if name == "f/x" else 0.2)
            downloads.clear()
            data.compute()
            computed = list(downloads)
            values[backend_name].append((np.array(data[probabilities]), np.array(data[probabilities])))
            if backend_name == "cuda":
                assert probabilities.nbytes not in computed  # not copied out by the compute
                assert downloads[len(computed):] == [probabilities.nbytes]  # by the first read alone
    for (got, again), (want, _) in zip(values["cuda"], values["cpu"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        assert (again == got).all()
    assert not np.allclose(values["cuda"][0][0], values["cuda"][1][0])  # the second compute's values


def test_weights_fed_to_layers_and_a_checkpoint_go_back_to_no_device(monkeypatch, tmp_path):
    """On the emulator: a CheckpointedStack feeds each layer its weights from the parameters
    (read back from the device after each update) and saves a checkpoint; neither sends a
    parameter or moment to the device again (every one went up at each step). The
    checkpoint holds the device's values."""
    from test_stack import batch, config, stack

    from ranvier.train.checkpoint import load_checkpoint

    monkeypatch.setenv(device.DEVICE_ENVIRONMENT, device.EMULATOR)
    uploads = []
    upload = emulator.HostEmulator.upload
    monkeypatch.setattr(emulator.HostEmulator, "upload", lambda gpu, address, host: uploads.append(address)
                        or upload(gpu, address, host))
    trainer = stack(config(layers=2), backend="cuda")
    trainer.step(batch(0))
    on_device = set(trainer.network.device_globals.addresses.values())
    uploads.clear()
    trainer.step(batch(1))
    trainer.save(tmp_path / "checkpoint")
    trainer.step(batch(2))
    assert uploads and not on_device & set(uploads)
    saved, _ = load_checkpoint(tmp_path / "checkpoint")
    trainer.step(batch(3))
    assert not (saved["llama/norm"] == trainer.network["llama/norm"]).all()  # the step changed what was saved
