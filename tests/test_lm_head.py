"""LM-head chunking (`compiler/lm_head.py`): a training step's logits = x·W feeding the
cross-entropy are computed a chunk of rows at a time, their loss and gradient with them,
then d x's rows and d W's sum: the loss and every gradient as the unchunked step and float64
numpy give them, on the CPU and on the CUDA backend's host emulator, and the step's memory
less by about the logits' size."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import language_model_trainer

import ranvier as rv
from ranvier.autodiff import backward
from ranvier.compiler import lm_head
from ranvier.models import llama
from ranvier.train.losses import softmax_cross_entropy

ROWS, DIM, VOCAB = 3 * 37, 24, 300  # [3, 37] tokens


def _head_step(tied: bool, smoothing: float | None = None, probabilities: bool = False):
    """loss = mean cross-entropy of x·W (x·Wᵀ where `tied`: an embedding [vocab, dim]) over
    [3, 37] tokens, and its gradients for x and W, as outputs."""
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("x", "float32", [3, ROWS // 3, DIM])
    w = f.var("w", "float32", [VOCAB, DIM] if tied else [DIM, VOCAB])
    target = f.var("target", "float32", [ROWS, VOCAB]) if probabilities else f.var("target", "int32", [ROWS])
    logits = f.matmul(x, w, transpose_b=tied)
    loss = softmax_cross_entropy(logits.reshape([ROWS, VOCAB]), target, smoothing)
    grads = backward(loss, [x, w])
    outputs = [loss, grads[x.name], grads[w.name]]
    for t in outputs:
        t.var.out = True
    return flow, outputs


def _inputs(tied: bool, probabilities: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if probabilities:
        raw = rng.random((ROWS, VOCAB))
        target = (raw / raw.sum(axis=1, keepdims=True)).astype(np.float32)
    else:
        target = rng.integers(0, VOCAB, ROWS).astype(np.int32)
    return {"x": rng.standard_normal((3, ROWS // 3, DIM)).astype(np.float32),
            "w": (rng.standard_normal((VOCAB, DIM) if tied else (DIM, VOCAB)) * 0.3).astype(np.float32),
            "target": target}


def _expected(values: dict[str, np.ndarray], tied: bool, smoothing: float = 0.0) -> list[np.ndarray]:
    """Loss, d x and d W in float64 numpy."""
    x = values["x"].astype(np.float64).reshape(ROWS, DIM)
    w = values["w"].astype(np.float64)
    logits = x @ (w.T if tied else w)
    target = values["target"]
    probs = np.eye(VOCAB)[target] if target.dtype == np.int32 else target.astype(np.float64)
    probs = probs * (1 - smoothing) + smoothing / VOCAB
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -(probs * log_softmax).sum(axis=1).mean()
    dlogits = (np.exp(log_softmax) * probs.sum(axis=1, keepdims=True) - probs) / ROWS
    dx = dlogits @ (w if tied else w.T)
    dw = dlogits.T @ x if tied else x.T @ dlogits
    return [np.float64(loss), dx.reshape(values["x"].shape), dw]


def _run(flow, outputs, values, backend: str, **options) -> tuple[list[np.ndarray], rv.Cell]:
    """The outputs, every one filled with NaN before the step (so none is left unwritten)."""
    network = rv.Compiler(backend, **options).compile(flow)
    cell = network.cell("f")
    instance = cell.instance()
    for name, value in values.items():
        instance[f"f/{name}"] = value
    for t in outputs:
        instance[t] = np.full(t.shape, np.nan, np.float32)
    instance.compute()
    return [instance[t].copy() for t in outputs], cell


@pytest.fixture
def chunks_of(monkeypatch):
    """Chunks of `rows` rows (whatever the logits' size)."""
    def rows(count: int) -> None:
        monkeypatch.setattr(lm_head, "chunk_rows", lambda total, vocab, dim, itemsize: min(total, count))
    return rows


def _products(cell: rv.Cell) -> list[str]:
    return [step.op.type for step in cell.steps if step.op.type in ("SoftmaxCrossEntropyGrad", "SoftmaxCrossEntropy")]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("rows", [16, 37, 50])
def test_chunked_loss_and_gradients_match_float64_and_the_unchunked_step(tied, rows, chunks_of):
    """Chunks of 16, 37 and 50 rows (none divides 111 but 37): every chunk a loss-and-gradient
    row pass, the loss and both gradients as float64 numpy and the reference backend give them."""
    flow, outputs = _head_step(tied)
    values = _inputs(tied)
    expected = _expected(values, tied)
    reference, _ = _run(flow, outputs, values, "reference")
    chunks_of(rows)
    got, cell = _run(flow, outputs, values, "cpu")
    assert _products(cell) == ["SoftmaxCrossEntropyGrad"] * -(-ROWS // rows)
    assert not any(v.shape == [ROWS, VOCAB] for step in cell.steps for v in (*step.op.inputs, *step.op.outputs))
    for g, r, e in zip(got, reference, expected):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6)


def test_label_smoothing_and_probability_targets_are_chunked_too(chunks_of):
    chunks_of(40)
    for smoothing, probabilities in ((0.1, False), (None, True)):
        flow, outputs = _head_step(True, smoothing, probabilities)
        values = _inputs(True, probabilities)
        got, cell = _run(flow, outputs, values, "cpu")
        assert len(_products(cell)) == 3
        for g, e in zip(got, _expected(values, True, smoothing or 0.0)):
            np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)


def test_the_logits_asked_for_stay_whole(chunks_of):
    """A step that returns its logits (generation's, a benchmark printing them) keeps them."""
    chunks_of(16)
    flow, outputs = _head_step(True)
    logits = next(op for op in flow.ops.values() if op.type == "MatMul" and op.outputs[0].shape == [3, ROWS // 3, VOCAB])
    logits.outputs[0].out = True
    _, cell = _run(flow, [*outputs], _inputs(True), "cpu")
    assert _products(cell) == ["SoftmaxCrossEntropyGrad"]


def test_a_step_without_the_gradient_is_left_alone(chunks_of):
    chunks_of(16)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    logits = f.matmul(f.var("x", "float32", [ROWS, DIM]), f.var("w", "float32", [DIM, VOCAB]))
    softmax_cross_entropy(logits, f.var("target", "int32", [ROWS])).var.out = True
    cell = rv.Compiler("cpu").compile(flow).cell("f")
    assert _products(cell) == ["SoftmaxCrossEntropy"]


def test_the_chunked_step_stores_about_the_logits_less():
    """The default chunks (here 1 MiB of logits: 64 rows) on 1,024 tokens of a 4,096-word
    vocabulary: the step's memory falls by at least the logits' size less a chunk's
    logits and gradient (16 MiB − 2 MiB)."""
    rows, vocab, dim = 1024, 4096, 32
    sizes = {}
    for name, budget in (("whole", 1 << 40), ("chunked", 1 << 20)):
        flow = rv.Flow()
        f = rv.Builder(flow, "f")
        x, w = f.var("x", "float32", [rows, dim]), f.var("w", "float32", [vocab, dim])
        loss = softmax_cross_entropy(f.matmul(x, w, transpose_b=True), f.var("target", "int32", [rows]))
        grads = backward(loss, [x, w])
        for t in (loss, grads[x.name], grads[w.name]):
            t.var.out = True
        saved = lm_head.CHUNK_BYTES
        lm_head.CHUNK_BYTES = budget
        try:
            sizes[name] = rv.Compiler("cpu").compile(flow).cell("f").size
        finally:
            lm_head.CHUNK_BYTES = saved
    logits = rows * vocab * 4
    assert sizes["whole"] - sizes["chunked"] >= logits - 2 * 64 * vocab * 4


def test_chunk_rows_keep_a_chunk_within_its_bytes_and_at_least_rows_per_feature():
    assert lm_head.CHUNK_BYTES == 256 << 20 and lm_head.ROWS_PER_FEATURE == 2
    assert lm_head.chunk_rows(32768, 32000, 768, 2) == 4160  # 256 MiB of bf16 logits: 4,194 rows, whole 64s
    assert lm_head.chunk_rows(2048, 32000, 288, 4) == 2048  # 262 MB of float32 logits: one chunk, no rewrite
    assert lm_head.chunk_rows(100_000, 4_000_000, 64, 4) == 128  # a chunk of 16 rows, but at least 2 x 64


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_chunked_on_the_cuda_emulator(precision, chunks_of, monkeypatch):
    """The CUDA backend runs the chunks as it runs any products and row passes (the host
    emulator here): float32 as float64 numpy gives them, bfloat16 activations within
    their rounding."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    chunks_of(48)
    flow, outputs = _head_step(False)
    values = _inputs(False)
    got, cell = _run(flow, outputs, values, "cuda", precision=precision)
    chunks = [step.op for step in cell.steps if step.op.type == "SoftmaxCrossEntropyGrad"]
    assert len(chunks) == 3 and {op.inputs[0].dtype for op in chunks} == {precision}
    tolerance = (2e-5, 2e-6) if precision == "float32" else (3e-2, 2e-3)
    for g, e in zip(got, _expected(values, False)):
        np.testing.assert_allclose(g, e, rtol=tolerance[0], atol=tolerance[1])


def test_bfloat16_products_on_the_cpu(chunks_of):
    """Products on bf16 inputs (Compiler(matmul="bfloat16")) take the chunks as they took the
    whole head: within bf16's rounding of float64, and equal to the unchunked step's."""
    flow, outputs = _head_step(True)
    values = _inputs(True)
    whole, _ = _run(flow, outputs, values, "cpu", matmul="bfloat16")
    chunks_of(40)
    got, cell = _run(flow, outputs, values, "cpu", matmul="bfloat16")
    assert len(_products(cell)) == 3
    for g, w, e in zip(got, whole, _expected(values, True)):
        np.testing.assert_allclose(g, e, rtol=3e-2, atol=2e-3)
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5)


def test_a_llama_trains_as_it_did_with_its_head_chunked(monkeypatch):
    """A one-layer Llama (tied embedding: d W joins the embedding's scattered gradient),
    AdamW with clipping: five steps' losses as the unchunked step's, the head in chunks of
    24 rows of 100."""
    config = dataclasses.replace(llama.PRESETS["stories260K"], n_layers=1)

    def trainer(rows: int | None):
        monkeypatch.setattr(lm_head, "chunk_rows", lambda total, vocab, dim, itemsize: min(total, rows or total))
        return language_model_trainer(llama.Llama(config, seed=0), "cpu", 2, 50, 1e-2)

    chunked = trainer(24)
    assert len(_products(chunked.network.cell("train"))) == 5
    whole = trainer(None)
    rng = np.random.default_rng(3)
    for _ in range(5):
        batch = [rng.integers(0, config.vocab_size, (2, 50)).astype(np.int32) for _ in range(2)]
        assert chunked.step(batch) == pytest.approx(whole.step(batch), rel=1e-5)
