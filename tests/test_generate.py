"""Generation with a KV cache: the same tokens as re-running the whole sequence, and
reproducible sampling, drawn in the cells as the host would draw it."""

from __future__ import annotations

import numpy as np
import pytest

import ranvier as rv
from ranvier.generate import Generator, Sampling
from ranvier.models.llama import Llama, LlamaConfig
from ranvier.runtime import aligned_zeros, is_aligned

CONFIG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, hidden_dim=48, max_seq_len=24)


def spread_weights(seed: int = 1) -> dict:
    """Larger-than-initial weights, so the next token depends on the whole context."""
    r = np.random.default_rng(seed)
    return {k: (r.standard_normal(v.shape) * (0.3 if v.ndim > 1 else 1.0) + (v.ndim == 1)).astype(np.float32)
            for k, v in Llama(CONFIG).initial.items()}


def full_forward_greedy(weights: dict, prompt: list[int], steps: int, model: Llama | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens by re-running the whole growing sequence (padded; the model is causal).
    `model`: any language model (default a Llama of CONFIG); its weights are replaced."""
    model = model or Llama(CONFIG)
    model.initial = weights
    length = model.config.max_seq_len
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    tokens = f.var("tokens", rv.DT_INT32, [1, length])
    logits = model(f, tokens)
    logits.var.out = True
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    sequence, picked, rows = list(prompt), [], []
    for _ in range(steps):
        padded = np.zeros((1, length), np.int32)
        padded[0, : len(sequence)] = sequence
        data[tokens] = padded
        data.compute()
        row = np.array(data[logits][0, len(sequence) - 1])
        rows.append(row)
        picked.append(int(np.argmax(row)))
        sequence.append(picked[-1])
    return picked, rows


@pytest.mark.parametrize("prefill", [4, 8, 32])
def test_greedy_with_kv_cache_matches_full_forward(prefill):
    weights = spread_weights()
    prompt = [1, 5, 9, 13, 2, 7, 30, 4, 11, 3]  # longer than some prefill widths: chunked
    generator = Generator(Llama(CONFIG), weights, prefill=prefill)
    expected, rows = full_forward_greedy(weights, prompt, 8)
    assert list(generator.stream(prompt, 8, Sampling(temperature=0))) == expected
    np.testing.assert_allclose(generator.prefill(prompt), rows[0], rtol=1e-4, atol=1e-5)
    assert len(set(expected)) > 3  # a real sequence, not one repeated token


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_the_generator_keeps_one_copy_of_the_weights(matmul):
    """The network's weights are the model's arrays (given weights are copied once, aligned),
    not a second copy of them; its caches are the network's globals, one per layer and key or
    value; its greedy tokens are the full forward pass's."""
    weights = spread_weights()
    unaligned = {}
    for key, value in weights.items():  # each 4 bytes past an alignment boundary
        unaligned[key] = aligned_zeros([value.size + 1], np.float32)[1:].reshape(value.shape)
        unaligned[key][...] = value
        assert not is_aligned(unaligned[key])
    model = Llama(CONFIG)
    generator = Generator(model, unaligned, prefill=4, matmul=matmul)
    for key, value in model.initial.items():
        assert np.shares_memory(generator.network[f"{model.name}/{key}"], value), key
        np.testing.assert_array_equal(value, weights[key])
    caches = [name for name in generator.network.globals if name.startswith("cache/")]
    assert len(caches) == 2 * CONFIG.n_layers
    prompt = [1, 5, 9, 13, 2]
    expected, _ = full_forward_greedy(weights, prompt, 4) if matmul == "float32" else (None, None)
    tokens = list(generator.stream(prompt, 4, Sampling(temperature=0)))
    assert expected is None or tokens == expected


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    generator = Generator(Llama(CONFIG), spread_weights(), prefill=8)
    prompt = [1, 2, 3]
    first = list(generator.stream(prompt, 10, Sampling(temperature=1.0, top_k=5), seed=7))
    again = list(generator.stream(prompt, 10, Sampling(temperature=1.0, top_k=5), seed=7))
    other = list(generator.stream(prompt, 10, Sampling(temperature=1.0, top_k=5), seed=8))
    assert first == again and first != other
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    assert {Sampling(1.0, top_k=2).pick(logits, rng) for _ in range(200)} == {0, 1}
    assert {Sampling(1.0, top_p=0.7).pick(logits, rng) for _ in range(200)} == {0, 1}
    assert {Sampling(1.0, top_p=0.9).pick(logits, rng) for _ in range(400)} == {0, 1, 2}
    assert Sampling(0.0).pick(logits, rng) == 0


@pytest.mark.parametrize("sampling", [Sampling(0.9, top_k=20, top_p=0.8), Sampling(1.2), Sampling(0.7, top_p=0.95)])
def test_the_cells_draw_the_tokens_the_host_would(sampling):
    """stream() reads back only the token each cell drew; drawing on the host from the
    same logits with the same uniform numbers gives the same tokens."""
    generator = Generator(Llama(CONFIG), spread_weights(), prefill=4)
    prompt = [1, 5, 9, 13, 2, 7]  # two prefill chunks: the token comes after the second's row 1
    streamed = list(generator.stream(prompt, 12, sampling, seed=5))
    rng = np.random.default_rng(5)
    logits, position, host = generator.prefill(prompt), len(prompt), []
    for _ in range(12):
        host.append(sampling.pick(logits, rng))
        logits = generator.decode(host[-1], position)
        position += 1
    assert streamed == host and len(set(host)) > 3


def test_stream_stops_at_eos_and_at_the_context():
    generator = Generator(Llama(CONFIG), spread_weights(), prefill=8)
    greedy = list(generator.stream([1, 2, 3], 5, Sampling(temperature=0)))
    assert list(generator.stream([1, 2, 3], 5, Sampling(temperature=0), eos=greedy[2])) == greedy[:2]
    assert len(list(generator.stream([1] * 20, 50, Sampling(temperature=0)))) == CONFIG.max_seq_len - 20 + 1
    with pytest.raises(rv.RanvierError, match="at most 24"):
        generator.prefill([1] * 25)


@pytest.mark.parametrize("shared", [True, False], ids=["shared classifier", "own classifier"])
def test_bf16_weights_decode_as_float32_on_weights_rounded_to_bf16(shared, monkeypatch):
    """matmul="bfloat16" on the CPU: every product of a decode step by a weight matrix reads
    bf16 panels, and its logits are a float32 decoder's on those matrices rounded to bf16
    (the embedding's lookup stays float32). The prompt's products read the same panels, or
    AMX-BF16 tiles where the CPU has them, else bf16 pairs where it has AVX512-BF16. Where the
    CPU has AVX512-BF16 a decode step's products are its dot products of pairs (`Bf16Gemv`),
    which round the row to bf16 too: near that decoder's logits then, not at them (the
    kernel's own test holds it to float64)."""
    import dataclasses

    import ml_dtypes

    from ranvier.backends.cpu import sgemm
    from ranvier.backends.cpu.backend import bf16_gemm
    from ranvier.backends.cpu.target import host_target

    monkeypatch.setenv("RANVIER_GEMM", "generated")  # the bf16 panels whatever this machine measures
    config = dataclasses.replace(CONFIG, shared_classifier=shared)
    weights = {k: (np.random.default_rng(3).standard_normal(v.shape) * 0.3 + (v.ndim == 1)).astype(np.float32)
               for k, v in Llama(config).initial.items()}
    narrow = Generator(Llama(config), weights, prefill=8, matmul="bfloat16")
    decode = narrow.network.cell("decode")
    products = [s for s in decode.steps if s.op.type.startswith("MatMul") and s.op.inputs[1].constant]
    pairs = sgemm.pairs_supported(host_target())
    assert len(products) == 7 * config.n_layers + 1
    assert {s.kernel for s in products} == {"Bf16Gemv" if pairs else "PackedGemmBf16"}
    prefill = [s for s in narrow.network.cell("prefill").steps if s.op.type.startswith("MatMul") and s.op.inputs[1].constant]
    rows = {"amx-bf16": "AmxGemm", "avx512bf16": "PackedGemmDpbf16"}.get(bf16_gemm(host_target()), "PackedGemmBf16")
    # the classifier's product is of the prompt's last row alone, a decode step's product
    assert {s.kernel for s in prefill[:-1]} == {rows} and prefill[-1].kernel == products[-1].kernel

    def rounded(key: str, value: np.ndarray) -> np.ndarray:
        return value.astype(ml_dtypes.bfloat16).astype(np.float32) if value.ndim == 2 and key != "tok_embeddings" else value

    # token by token through the decode cells (a prompt's cell may run on AMX tiles, which round A too)
    rounded_weights = {k: rounded(k, v) for k, v in weights.items()} if not shared else weights
    reference = Generator(Llama(config), rounded_weights, prefill=8)
    for position, token in enumerate([1, 5, 9, 13, 3, 17, 40]):
        got, want = narrow.decode(token, position), reference.decode(token, position)
        # a shared classifier is the embedding, rounded for the product alone: a float32 decoder's, to bf16
        if shared or pairs:
            assert np.abs(got - want).max() <= 0.05 * np.abs(want).max() and not np.array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("shared", [True, False], ids=["shared classifier", "own classifier"])
def test_int8_weights_decode_near_float32_on_the_dequantized_weights(shared):
    """matmul="int8": every product by a weight matrix, the prompt's and the decode step's,
    reads its q8_0 blocks (`Q8Gemm`), the rows quantized likewise; the logits stay near a
    float32 decoder's on the dequantized matrices (they part by the activations' rounding,
    at most half a step of 1/127 of each block's largest value; at near-ties of these random
    weights, the greedy token with them)."""
    import dataclasses

    from ranvier.backends.cpu.q8gemm import quantize_q8_0

    config = dataclasses.replace(CONFIG, shared_classifier=shared)
    weights = {k: (np.random.default_rng(3).standard_normal(v.shape) * 0.3 + (v.ndim == 1)).astype(np.float32)
               for k, v in Llama(config).initial.items()}
    quantized = Generator(Llama(config), weights, prefill=8, matmul="int8")
    for name in ("prefill", "decode"):
        products = [s for s in quantized.network.cell(name).steps if s.op.type.startswith("MatMul") and s.op.inputs[1].constant]
        assert len(products) == 7 * config.n_layers + 1 and {s.kernel for s in products} == {"Q8Gemm"}

    def dequantized(key: str, value: np.ndarray) -> np.ndarray:
        if value.ndim != 2 or key == "tok_embeddings":  # the lookup reads float32 rows; a shared classifier's product does not
            return value
        d, q = quantize_q8_0(value.T)
        blocks = (d.astype(np.float16).astype(np.float32)[:, :, None] * q.reshape(len(q), -1, 32)).reshape(len(q), -1)
        return np.ascontiguousarray(blocks[:, : value.shape[0]].T)

    reference = Generator(Llama(config), {k: dequantized(k, v) for k, v in weights.items()}, prefill=8)
    # a shared classifier is the embedding, quantized for the product alone: the reference's is float32
    share = 0.1 if shared else 0.05
    prompt = [1, 5, 9, 13, 3, 17, 40]
    got, want = quantized.prefill(prompt), reference.prefill(prompt)
    assert np.abs(got - want).max() <= share * np.abs(want).max() and not np.array_equal(got, want)
    for position, token in enumerate(prompt):
        got, want = quantized.decode(token, position), reference.decode(token, position)
        assert np.abs(got - want).max() <= share * np.abs(want).max()
