"""Export and import of Llama models and tokenizers: llama2.c checkpoints and tokenizer.bin,
Hugging Face folders (with the q/k rotary permutation checked against a rotate_half model)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import re
import struct

import numpy as np
import pytest
import torch

import ranvier as rv
from ranvier.data.tokenizers import ByteTokenizer, CharTokenizer, train_sentencepiece
from ranvier.interop import (
    InteropError,
    export_hf,
    export_llama2c,
    export_tokenizer_bin,
    hf_permute,
    hf_unpermute,
    import_hf,
    import_llama2c,
    import_tokenizer_bin,
    weight_shapes,
)
from ranvier.models.llama import Llama, LlamaConfig, rope_tables
from ranvier.models.moe import PRESETS as MOE_PRESETS
from ranvier.models.moe import MoE

CONFIGS = {
    "shared": LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=37, hidden_dim=24, max_seq_len=12),
    "unshared-gqa": LlamaConfig(dim=24, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=41, hidden_dim=40,
                                max_seq_len=10, shared_classifier=False),
}


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.3, size=s).astype(np.float32) for k, s in weight_shapes(config).items()}


def ranvier_logits(config: LlamaConfig, weights: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    model = Llama(config)
    assert set(model.initial) == set(weights)
    for key, value in weights.items():
        model.initial[key] = np.ascontiguousarray(value, dtype=np.float32)
    flow = rv.Flow()
    f = rv.Builder(flow, "f")
    x = f.var("tokens", rv.DT_INT32, list(tokens.shape))
    logits = model(f, x)
    logits.var.out = True
    data = rv.Compiler("cpu").compile(flow).cell("f").instance()
    data[x][...] = tokens
    data.compute()
    return np.array(data[logits])


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for key, value in a.items():
        assert value.dtype == np.float32 and value.shape == b[key].shape, key
        np.testing.assert_array_equal(value, b[key], err_msg=key)


# ---- llama2.c checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_llama2c_round_trip(tmp_path, case, version):
    config = CONFIGS[case]
    weights = random_weights(config, seed=version)
    path = export_llama2c(config, weights, tmp_path / "model.bin", version=version)
    c = config
    header = 28 if version == 0 else 256
    floats = c.parameter_count() + (c.max_seq_len * c.head_dim if version == 0 else 0)
    assert path.stat().st_size == header + 4 * floats
    imported_config, imported = import_llama2c(path)
    assert imported_config == config
    assert_same(imported, weights)


def test_llama2c_v0_layout_matches_run_c(tmp_path):
    """Spot-check the byte layout against llama2.c's legacy_export order and [out, in] matrices."""
    config = CONFIGS["unshared-gqa"]
    c = config
    weights = random_weights(config, seed=3)
    export_llama2c(config, weights, tmp_path / "m.bin", version=0)
    raw = (tmp_path / "m.bin").read_bytes()
    assert struct.unpack_from("<7i", raw) == (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, -c.vocab_size, c.max_seq_len)
    data = np.frombuffer(raw, "<f4", offset=28)
    kv = c.n_kv_heads * c.head_dim
    at = 0
    np.testing.assert_array_equal(data[at:at + c.vocab_size * c.dim].reshape(c.vocab_size, c.dim), weights["tok_embeddings"])
    at += c.vocab_size * c.dim
    np.testing.assert_array_equal(data[at:at + c.dim], weights["layers.0.attention_norm"])
    at += c.n_layers * c.dim
    np.testing.assert_array_equal(data[at:at + c.dim * c.dim].reshape(c.dim, c.dim), weights["layers.0.wq"].T)
    at += c.n_layers * c.dim * c.dim
    np.testing.assert_array_equal(data[at:at + kv * c.dim].reshape(kv, c.dim), weights["layers.0.wk"].T)
    # RoPE tables, then the classifier [V, D] at the very end.
    end = len(data) - c.vocab_size * c.dim
    cos, sin = rope_tables(c.head_dim, c.max_seq_len, 10000.0)
    half = c.max_seq_len * c.head_dim // 2
    np.testing.assert_array_equal(data[end - 2 * half:end - half], cos.ravel())
    np.testing.assert_array_equal(data[end - half:end], sin.ravel())
    np.testing.assert_array_equal(data[end:].reshape(c.vocab_size, c.dim), weights["output"].T)


def test_llama2c_v1_header(tmp_path):
    config = CONFIGS["shared"]
    export_llama2c(config, random_weights(config), tmp_path / "m.bin", version=1)
    raw = (tmp_path / "m.bin").read_bytes()
    assert raw[:4] == b"24ka"  # uint32 0x616b3432, little-endian
    assert struct.unpack_from("<i7iB", raw, 4) == (1, 16, 24, 2, 4, 4, 37, 12, 1)
    assert raw[37:256] == bytes(219)
    # Version 1 starts with the norms: attention norms of every layer, ffn norms, final norm.
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4", count=16, offset=256), random_weights(config)["layers.0.attention_norm"])


@pytest.mark.parametrize("version", [0, 1])
def test_llama2c_logits_identical(tmp_path, version):
    config = CONFIGS["unshared-gqa"] if version else CONFIGS["shared"]
    weights = random_weights(config, seed=5)
    export_llama2c(config, weights, tmp_path / "m.bin", version=version)
    imported_config, imported = import_llama2c(tmp_path / "m.bin")
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 7)).astype(np.int32)
    np.testing.assert_array_equal(ranvier_logits(imported_config, imported, tokens), ranvier_logits(config, weights, tokens))


@pytest.mark.parametrize("version", [0, 1])
def test_llama2c_corrupt_files(tmp_path, version):
    config = CONFIGS["unshared-gqa"]
    path = export_llama2c(config, random_weights(config), tmp_path / "m.bin", version=version)
    raw = path.read_bytes()
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(raw[:-4])
    with pytest.raises(InteropError, match=rf"needs {len(raw)} bytes, the file has {len(raw) - 4}"):
        import_llama2c(truncated)
    extra = tmp_path / "extra.bin"
    extra.write_bytes(raw + b"\0" * 8)
    with pytest.raises(InteropError, match="extra data"):
        import_llama2c(extra)
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(raw[:10])
    with pytest.raises(InteropError, match="shorter than any header"):
        import_llama2c(tiny)


def test_llama2c_bad_magic_version_and_dims(tmp_path):
    config = CONFIGS["shared"]
    raw = bytearray(export_llama2c(config, random_weights(config), tmp_path / "m.bin", version=1).read_bytes())
    version2 = tmp_path / "v2.bin"
    version2.write_bytes(bytes(raw[:4]) + struct.pack("<i", 2) + bytes(raw[8:]))
    with pytest.raises(InteropError, match="version 2 is not supported"):
        import_llama2c(version2)
    bad_magic = tmp_path / "magic.bin"
    bad_magic.write_bytes(b"GGUF" + bytes(raw[4:]))  # no magic: read as legacy, whose dims make no sense
    with pytest.raises(InteropError, match="not a (valid )?llama2.c checkpoint.*no version-1 magic"):
        import_llama2c(bad_magic)
    zero_dim = tmp_path / "zero.bin"
    zero_dim.write_bytes(struct.pack("<7i", 0, 24, 2, 4, 4, 37, 12) + bytes(400))
    with pytest.raises(InteropError, match="non-positive dim=0"):
        import_llama2c(zero_dim)
    inconsistent = tmp_path / "inconsistent.bin"
    inconsistent.write_bytes(struct.pack("<7i", 18, 24, 2, 4, 4, 37, 12) + bytes(400))
    with pytest.raises(InteropError, match="must divide"):
        import_llama2c(inconsistent)
    with pytest.raises(InteropError, match="does not exist"):
        import_llama2c(tmp_path / "missing.bin")


def test_llama2c_export_refuses_what_it_cannot_store(tmp_path):
    config = CONFIGS["shared"]
    with pytest.raises(InteropError, match="version must be 0"):
        export_llama2c(config, random_weights(config), tmp_path / "m.bin", version=2)
    theta = LlamaConfig(**{**config.__dict__, "rope_theta": 500000.0})
    with pytest.raises(InteropError, match="rope_theta"):
        export_llama2c(theta, random_weights(theta), tmp_path / "m.bin")
    weights = random_weights(config)
    weights["layers.0.wq"] = weights["layers.0.wq"][:, :8]
    with pytest.raises(InteropError, match=r"layers.0.wq has shape \[16, 8\]"):
        export_llama2c(config, weights, tmp_path / "m.bin")
    moe = MOE_PRESETS["moe-tiny"]
    with pytest.raises(InteropError, match="not mixtures of experts.*MixtralForCausalLM"):
        export_llama2c(moe, MoE(moe).initial, tmp_path / "m.bin")
    assert not (tmp_path / "m.bin").exists()


# ---- Hugging Face ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CONFIGS))
def test_hf_round_trip(tmp_path, case):
    config = CONFIGS[case]
    weights = random_weights(config, seed=9)
    export_hf(config, weights, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
            hf["num_key_value_heads"], hf["vocab_size"], hf["max_position_embeddings"]) == (
        config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads, config.vocab_size, config.max_seq_len)
    assert hf["tie_word_embeddings"] == config.shared_classifier
    from safetensors.numpy import load_file

    state = load_file(tmp_path / "hf" / "model.safetensors")
    assert ("lm_head.weight" in state) != config.shared_classifier
    assert state["model.layers.1.mlp.gate_proj.weight"].shape == (config.hidden_dim, config.dim)
    np.testing.assert_array_equal(state["model.layers.1.mlp.down_proj.weight"], weights["layers.1.w2"].T)
    imported_config, imported = import_hf(tmp_path / "hf")
    assert imported_config == config
    assert_same(imported, weights)


def test_hf_sharded_index(tmp_path):
    from safetensors.numpy import load_file, save_file

    config = CONFIGS["unshared-gqa"]
    weights = random_weights(config, seed=2)
    export_hf(config, weights, tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / "hf" / file)
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    imported_config, imported = import_hf(tmp_path / "hf")
    assert imported_config == config
    assert_same(imported, weights)
    (tmp_path / "hf" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InteropError, match="missing"):
        import_hf(tmp_path / "hf")


def test_hf_import_bfloat16(tmp_path):
    """Checkpoints published in bfloat16 (numpy has no such type) import as float32."""
    from safetensors.torch import save_file

    config = CONFIGS["unshared-gqa"]
    weights = {k: torch.from_numpy(v).bfloat16().float().numpy() for k, v in random_weights(config, seed=8).items()}
    export_hf(config, weights, tmp_path / "hf")
    from safetensors.numpy import load_file

    state = load_file(tmp_path / "hf" / "model.safetensors")
    halves = {k: torch.from_numpy(v).bfloat16() if "mlp" in k or "embed" in k else torch.from_numpy(v) for k, v in state.items()}
    save_file(halves, tmp_path / "hf" / "model.safetensors")
    imported_config, imported = import_hf(tmp_path / "hf")
    assert imported_config == config
    assert_same(imported, weights)


def test_hf_import_errors(tmp_path):
    config = CONFIGS["shared"]
    export_hf(config, random_weights(config), tmp_path / "hf")
    with pytest.raises(InteropError, match="config.json is missing"):
        import_hf(tmp_path)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(InteropError, match="missing model.layers.2"):
        import_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(InteropError, match="rope_scaling"):
        import_hf(tmp_path / "hf")


def test_hf_permutation_is_invertible():
    rng = np.random.default_rng(0)
    for heads, head_dim, inp in [(4, 8, 16), (2, 6, 24), (1, 2, 3)]:
        w = rng.normal(size=(heads * head_dim, inp)).astype(np.float32)
        permuted = hf_permute(w, heads)
        assert not np.array_equal(permuted, w) or head_dim == 2
        np.testing.assert_array_equal(hf_unpermute(permuted, heads), w)
        np.testing.assert_array_equal(hf_permute(hf_unpermute(w, heads), heads), w)
        # Matches transformers' convert_llama_weights_to_hf.py permute(), written in torch.
        expected = torch.from_numpy(w).view(heads, head_dim // 2, 2, inp).transpose(1, 2).reshape(heads * head_dim, inp)
        np.testing.assert_array_equal(permuted, expected.numpy())


def test_hf_rotate_half_on_permuted_weights_equals_interleaved_rope():
    """q from HF's permuted weight with rotate_half RoPE is llama2.c's interleaved RoPE of q,
    with each head's dimensions reordered (evens first, then odds) — so q·k is unchanged."""
    heads, head_dim, dim, seq = 3, 8, 12, 5
    rng = np.random.default_rng(4)
    w = rng.normal(size=(heads * head_dim, dim))  # torch layout [out, in]
    x = rng.normal(size=(seq, dim))
    cos, sin = (t.astype(np.float64) for t in rope_tables(head_dim, seq, 10000.0))
    # llama2.c: rotate the pairs (2i, 2i+1).
    q = (x @ w.T).reshape(seq, heads, head_dim // 2, 2)
    even, odd = q[..., 0], q[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    interleaved = np.stack([even * c - odd * s, even * s + odd * c], -1).reshape(seq, heads, head_dim)
    # HF: rotate_half on [first half, second half] with cos/sin repeated over both halves.
    qh = (x @ hf_permute(w, heads).T).reshape(seq, heads, head_dim)
    cos2, sin2 = np.concatenate([c, c], -1), np.concatenate([s, s], -1)
    rotate_half = np.concatenate([-qh[..., head_dim // 2:], qh[..., :head_dim // 2]], -1)
    hf = qh * cos2 + rotate_half * sin2
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    np.testing.assert_allclose(hf, interleaved[..., order], rtol=1e-12, atol=1e-12)


def hf_reference_logits(folder, tokens: np.ndarray) -> np.ndarray:
    """A tiny LlamaForCausalLM forward in torch (float64), written the Hugging Face way:
    rotate_half rotary embeddings, repeat_kv, gate/up/down MLP, weights read by their HF names."""
    from safetensors.numpy import load_file

    hf = json.loads((folder / "config.json").read_text())
    state = {k: torch.from_numpy(v).double() for k, v in load_file(folder / "model.safetensors").items()}
    d, heads, kv_heads = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    hd, eps = d // heads, hf["rms_norm_eps"]
    batch, seq = tokens.shape

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv_freq = 1.0 / (hf["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)

    x = state["model.embed_tokens.weight"][torch.from_numpy(tokens).long()]
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, state[p + "input_layernorm.weight"])
        q = (h @ state[p + "self_attn.q_proj.weight"].T).view(batch, seq, heads, hd).transpose(1, 2)
        k = (h @ state[p + "self_attn.k_proj.weight"].T).view(batch, seq, kv_heads, hd).transpose(1, 2)
        v = (h @ state[p + "self_attn.v_proj.weight"].T).view(batch, seq, kv_heads, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
        x = x + attn.transpose(1, 2).reshape(batch, seq, d) @ state[p + "self_attn.o_proj.weight"].T
        h = norm(x, state[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ state[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ state[p + "mlp.up_proj.weight"].T)) @ state[p + "mlp.down_proj.weight"].T
    x = norm(x, state["model.norm.weight"])
    head = state["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else state["lm_head.weight"]
    return (x @ head.T).numpy()


@pytest.mark.parametrize("case", list(CONFIGS))
def test_hf_logits_match_rotate_half_reference(tmp_path, case):
    config = CONFIGS[case]
    weights = random_weights(config, seed=11)
    export_hf(config, weights, tmp_path / "hf")
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (2, 8)).astype(np.int32)
    ours = ranvier_logits(config, weights, tokens)
    np.testing.assert_allclose(hf_reference_logits(tmp_path / "hf", tokens), ours, rtol=1e-4, atol=1e-4)
    imported_config, imported = import_hf(tmp_path / "hf")
    np.testing.assert_array_equal(ranvier_logits(imported_config, imported, tokens), ours)


# ---- tokenizer.bin ---------------------------------------------------------------------------

CORPUS = [
    "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog.",
    "The café served crème brûlée and naïve piñatas; Zoë paid 12.50 € for 3 of them.",
    "In 2023 the numbers 1, 22, 333 and 4444 were written down by the old man.",
    "Grüße aus München! Das Mädchen läuft über die Straße.",
    "Tom said: \"I can count to 100 and back.\" Then he ran home to his mother.",
    "Привет, как дела? Всё хорошо, спасибо.",
] * 20

SENTENCES = [
    "Once upon a time",
    "Lily and her dog played in the park on 2024-05-17 at 10:30.",
    "Zoë's café sold crème brûlée for 9.99 €.",
    "Привет, мир! Über 42 Straßen.",
    "Unknown characters: 漢字 and 🎉 fall back to bytes.",
    "a",
    "",
    " leading space and trailing ",
    "runs  of   spaces,\ttabs\nand newlines",
]


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spm")
    return train_sentencepiece(iter(CORPUS), 400, output_prefix=directory / "tok", num_threads=1)


def test_tokenizer_bin_encodes_like_sentencepiece(tmp_path, sentencepiece_tokenizer):
    sp = sentencepiece_tokenizer
    export_tokenizer_bin(sp, tmp_path / "tokenizer.bin")
    bin_tokenizer = import_tokenizer_bin(tmp_path / "tokenizer.bin")
    assert bin_tokenizer.vocab_size == sp.vocab_size == 400
    assert (bin_tokenizer.bos_id, bin_tokenizer.eos_id) == (sp.bos_id, sp.eos_id) == (1, 2)
    for text in SENTENCES:
        ids = bin_tokenizer.encode(text, bos=True, eos=True)
        assert ids == sp.encode(text, bos=True, eos=True), text
        assert bin_tokenizer.decode(ids) == sp.decode(ids) == text, text
    # Every character of the unknown words went through byte fallback (ids byte + 3).
    emoji = bin_tokenizer.encode("🎉", bos=False)
    assert emoji[1:] == [b + 3 for b in "🎉".encode()]
    assert bin_tokenizer.encode("", bos=False) == []


def test_tokenizer_bin_format(tmp_path, sentencepiece_tokenizer):
    sp = sentencepiece_tokenizer
    path = export_tokenizer_bin(sp, tmp_path / "tokenizer.bin")
    raw = path.read_bytes()
    (max_length,) = struct.unpack_from("<I", raw)
    position, tokens, scores = 4, [], []
    while position < len(raw):
        score, length = struct.unpack_from("<fI", raw, position)
        tokens.append(raw[position + 8:position + 8 + length])
        scores.append(score)
        position += 8 + length
    assert max_length == max(len(t) for t in tokens)
    assert tokens[:3] == [b"<unk>", b"\n<s>\n", b"\n</s>\n"]
    assert tokens[3 + ord("A")] == b"<0x41>"
    for i in range(sp.vocab_size):
        if i > 2:
            assert tokens[i] == sp.piece(i).replace("\u2581", " ").encode()
        assert scores[i] == np.float32(sp._model.get_score(i))
    # Round trip through Llama2cTokenizer.save gives the same bytes.
    import_tokenizer_bin(path).save(tmp_path / "again.bin")
    assert (tmp_path / "again.bin").read_bytes() == raw


def test_tokenizer_bin_run_c_details():
    from ranvier.interop import Llama2cTokenizer

    tokens = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    tokens += [b" ", b"a", b"b", b" a", b"ab", b" ab", b"\xc3\xa9"]
    scores = [0.0] * 259 + [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, 0.0]
    t = Llama2cTokenizer(tokens, scores)
    ids = {tok: i for i, tok in enumerate(tokens)}
    # " a" (score -1) merges before "ab" (score -2), then " ab" (-3).
    assert t.encode("ab", bos=False) == [ids[b" ab"]]
    assert t.encode("ba", bos=True, eos=True) == [1, ids[b" "], ids[b"b"], ids[b"a"], 2]
    assert t.encode("é?", bos=False) == [ids[b" "], ids[b"\xc3\xa9"], ord("?") + 3]
    assert t.decode([1, ids[b" ab"], ord("\n") + 3, 2]) == "ab\n"
    assert t.decode([ids[b" ab"]]) == " ab"  # the dummy space stays without a BOS before it
    with pytest.raises(InteropError, match="outside"):
        t.decode([999])


def test_tokenizer_bin_byte_and_char(tmp_path):
    export_tokenizer_bin(ByteTokenizer(), tmp_path / "byte.bin")
    byte = import_tokenizer_bin(tmp_path / "byte.bin")
    assert byte.vocab_size == 258 and byte.piece(65) == b"A" and byte.piece(256) == b"\n<s>\n"
    chars = CharTokenizer.from_text("héllo wörld")
    export_tokenizer_bin(chars, tmp_path / "char.bin")
    imported = import_tokenizer_bin(tmp_path / "char.bin")
    assert imported.tokens[: len(chars.chars)] == [c.encode() for c in chars.chars]
    assert set(imported.scores) == {0.0}


def test_tokenizer_bin_corrupt(tmp_path, sentencepiece_tokenizer):
    raw = export_tokenizer_bin(sentencepiece_tokenizer, tmp_path / "tokenizer.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(raw[:-3])
    with pytest.raises(InteropError, match="truncated|corrupt"):
        import_tokenizer_bin(tmp_path / "cut.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(InteropError, match="not a llama2.c tokenizer.bin"):
        import_tokenizer_bin(tmp_path / "empty.bin")


# ---- run directories and the command line ----------------------------------------------------


@pytest.mark.slow
def test_export_run_directory_from_the_command_line(tmp_path, sentencepiece_tokenizer):
    from dataclasses import asdict

    from ranvier.cli import main
    from ranvier.interop import weights_from_run
    from ranvier.models.llama import PRESETS
    from ranvier.train.checkpoint import save_checkpoint
    from ranvier.train.runs import LlamaRunConfig

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(asdict(LlamaRunConfig(preset="stories260K", seq=64))))
    sentencepiece_tokenizer.save(run / "tokenizer.model")
    config = LlamaConfig(**{**asdict(PRESETS["stories260K"]), "vocab_size": 400})
    weights = random_weights(config, seed=6)
    arrays = {f"llama/{k}": v for k, v in weights.items()}
    arrays.update({f"llama/{k}/m": np.zeros_like(v) for k, v in weights.items()})  # optimizer state
    arrays["train/adam_step"] = np.array(3, np.int32)
    save_checkpoint(run / "checkpoint", arrays, {"step": 3})

    run_config, run_weights = weights_from_run(run)
    assert run_config == config
    assert_same(run_weights, weights)

    assert main(["export", "llama2c", str(run), str(tmp_path / "model.bin"), "--version", "1",
                 "--tokenizer-out", str(tmp_path / "tokenizer.bin")]) == 0
    imported_config, imported = import_llama2c(tmp_path / "model.bin")
    assert imported_config == config
    assert_same(imported, weights)
    text = "Lily and her dog, 2 times."
    assert import_tokenizer_bin(tmp_path / "tokenizer.bin").encode(text) == sentencepiece_tokenizer.encode(text)

    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 0
    imported_config, imported = import_hf(tmp_path / "hf")
    assert imported_config == config
    assert_same(imported, weights)
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (run / "tokenizer.model").read_bytes()

    forms = [(run, []), (tmp_path / "model.bin", ["--tokenizer", str(tmp_path / "tokenizer.bin")]), (tmp_path / "hf", [])]
    if importlib.util.find_spec("gguf"):
        from ranvier.interop import import_gguf

        assert main(["export", "gguf", str(run), str(tmp_path / "model.gguf")]) == 0
        imported_config, imported, tokenizer = import_gguf(tmp_path / "model.gguf")
        assert imported_config == config
        assert_same(imported, weights)
        assert tokenizer.encode(text) == sentencepiece_tokenizer.encode(text)
        forms.append((tmp_path / "model.gguf", []))
    # The same model generates the same greedy text from every form.
    texts = []
    for model, extra in forms:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["generate", str(model), "--prompt", "Lily", "--max-tokens", "5", "--temperature", "0", *extra]) == 0
        texts.append(printed.getvalue().splitlines()[0])
    assert len(set(texts)) == 1 and texts[0].startswith("Lily")
    # with the decode step's weights in bf16: text, and the speed on stderr
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        assert main(["generate", str(run), "--prompt", "Lily", "--max-tokens", "5", "--temperature", "0", "--matmul", "bfloat16"]) == 0
    assert printed.getvalue().startswith("Lily") and re.search(r"^\d+ tokens, [\d.]+ tokens/s$", said.getvalue(), re.MULTILINE)
    # ... and as int8 q8_0 blocks
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        assert main(["generate", str(run), "--prompt", "Lily", "--max-tokens", "5", "--temperature", "0", "--weights", "int8"]) == 0
    assert printed.getvalue().startswith("Lily") and re.search(r"^\d+ tokens, [\d.]+ tokens/s$", said.getvalue(), re.MULTILINE)
    with pytest.raises(rv.RanvierError, match="--weights int8 and --matmul bfloat16 ask for two precisions"):
        main(["generate", str(run), "--weights", "int8", "--matmul", "bfloat16"])
