"""GGUF files (llama.cpp's format) out and back in: the config, the weights in float32,
float16, bfloat16 and q8_0 (llama.cpp's blocks, byte for byte as the gguf package quantizes),
the SentencePiece or llama2.c vocabulary as llama.cpp's converters write it, and clear errors
for what a file cannot hold or ranvier cannot read."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from ranvier.backends.cpu.q8gemm import quantize_q8_0
from ranvier.data.tokenizers import ByteTokenizer, train_sentencepiece
from ranvier.interop import InteropError, Llama2cTokenizer, export_gguf, import_gguf, load_any, weight_shapes
from ranvier.interop.gguf_file import gguf_name
from ranvier.models.llama import LlamaConfig
from ranvier.models.moe import PRESETS as MOE_PRESETS

gguf = pytest.importorskip("gguf")

CONFIGS = {
    "shared": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=300, hidden_dim=96, max_seq_len=40),
    # rows of 24 and 40: not whole q8_0 blocks (float16 instead), grouped-query attention, own classifier
    "unshared-gqa": LlamaConfig(dim=24, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=300, hidden_dim=40,
                                max_seq_len=10, norm_eps=1e-6, rope_theta=500000.0, shared_classifier=False),
}
MATRICES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.3, size=s).astype(np.float32) for k, s in weight_shapes(config).items()}


def placeholder_tokenizer(size: int) -> Llama2cTokenizer:
    """llama2.c's special pieces, the 256 byte pieces, then made-up ones with spaces."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
    pieces += [b" piece%d" % i for i in range(size - len(pieces))]
    return Llama2cTokenizer(pieces, [-float(i) for i in range(size)])


def q8_0_round_trip(rows: np.ndarray) -> np.ndarray:
    """Rows quantized to q8_0 and back (scales in float16), as a file holds them."""
    d, q = quantize_q8_0(rows)
    return (d.astype(np.float16).astype(np.float32)[:, :, None] * q.reshape(len(q), -1, 32)).reshape(rows.shape)


def stored(key: str, value: np.ndarray, dtype: str) -> np.ndarray:
    """What a weight reads back as: norms float32, matrices rounded to `dtype`."""
    if value.ndim == 1 or dtype == "float32":
        return value
    if dtype == "q8_0" and value.shape[0 if key.rsplit(".", 1)[-1] in MATRICES else 1] % 32 == 0:
        rows = value.T if key.rsplit(".", 1)[-1] in MATRICES else value  # torch [out, in] rows, quantized along in
        back = q8_0_round_trip(np.ascontiguousarray(rows))
        return np.ascontiguousarray(back.T) if key.rsplit(".", 1)[-1] in MATRICES else back
    if dtype == "bfloat16":
        return value.astype(ml_dtypes.bfloat16).astype(np.float32)
    return value.astype(np.float16).astype(np.float32)  # float16, and q8_0's fallback


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q8_0"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_round_trip(tmp_path, case, dtype):
    config = CONFIGS[case]
    weights = random_weights(config, seed=len(case))
    tokenizer = placeholder_tokenizer(config.vocab_size)
    path = export_gguf(config, weights, tokenizer, tmp_path / "model.gguf", dtype)
    imported_config, imported, imported_tokenizer = import_gguf(path)
    assert imported_config == config
    assert set(imported) == set(weights)
    for key, value in weights.items():
        np.testing.assert_array_equal(imported[key], stored(key, value, dtype), err_msg=key)
    assert imported_tokenizer.tokens[3:] == tokenizer.tokens[3:] and imported_tokenizer.scores == tokenizer.scores
    assert imported_tokenizer.tokens[:3] == [b"<unk>", b"<s>", b"</s>"]  # llama.cpp's names for the special pieces
    assert (imported_tokenizer.bos_id, imported_tokenizer.eos_id) == (1, 2)


def test_layout_is_llama_cpps(tmp_path):
    """llama.cpp's names, torch's [out, in] matrices (ggml's dimensions reversed), the norms in
    float32, q8_0 blocks byte for byte as the gguf package quantizes them, the metadata keys
    and the vocabulary's pieces (spaces as U+2581) and token types."""
    config = CONFIGS["shared"]
    weights = random_weights(config, seed=3)
    path = export_gguf(config, weights, placeholder_tokenizer(config.vocab_size), tmp_path / "m.gguf", "q8_0")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # a shared classifier: llama.cpp uses the embedding
    wq = tensors["blk.1.attn_q.weight"]
    assert wq.tensor_type == gguf.GGMLQuantizationType.Q8_0 and wq.shape.tolist() == [config.dim, config.dim]
    expected = gguf.quants.quantize(np.ascontiguousarray(weights["layers.1.wq"].T), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(np.asarray(wq.data), expected)
    norm = tensors["blk.0.ffn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["token_embd.weight"].shape.tolist() == [config.dim, config.vocab_size]

    def value(key):
        field = reader.fields[key]
        return field.parts[field.data[0]].tolist()[0]

    assert value("llama.block_count") == 2 and value("llama.feed_forward_length") == 96
    assert value("llama.rope.dimension_count") == 16 and value("general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert bytes(reader.fields["tokenizer.ggml.model"].parts[-1]) == b"llama"
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert bytes(tokens.parts[tokens.data[300 - 1]]) == "\u2581piece40".encode()
    types = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    assert kinds[:5] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.BYTE,
                         gguf.TokenType.BYTE]
    assert kinds[259:] == [gguf.TokenType.NORMAL] * (300 - 259)


def test_quantize_q8_0_is_llama_cpps():
    """ranvier's q8_0 quantizer (weights and activations) gives the gguf package's bytes:
    llama.cpp's reference, halves rounded away from zero, an all-zero block included."""
    rows = np.random.default_rng(8).standard_normal((5, 96)).astype(np.float32)
    rows[1, :32] = 0.0
    rows[2, :32] = np.arange(32) - 15.5  # halves everywhere
    d, q = quantize_q8_0(rows)
    blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0).reshape(5, 3, 34)
    np.testing.assert_array_equal(blocks[..., :2].copy().view(np.float16)[..., 0], d.astype(np.float16))
    np.testing.assert_array_equal(blocks[..., 2:].copy().view(np.int8).reshape(5, 96), q)


def test_sentencepiece_vocabulary_encodes_alike(tmp_path):
    """A SentencePiece model's pieces, scores and types go into the file; the tokenizer read
    back encodes as SentencePiece does (run.c's merges on its pieces)."""
    corpus = ["Once upon a time there was a little girl named Lily. She liked to play in the park.",
              "The café served crème brûlée; Zoë paid 12.50 € for 3 of them."] * 30
    sp = train_sentencepiece(iter(corpus), 300, output_prefix=tmp_path / "tok", num_threads=1)
    config = dataclasses.replace(CONFIGS["shared"], vocab_size=sp.vocab_size)
    export_gguf(config, random_weights(config), sp, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data] == [sp.piece(i) for i in range(sp.vocab_size)]
    _, _, tokenizer = import_gguf(tmp_path / "m.gguf")
    for text in ("Once upon a time", "Lily played in the park with Zoë.", "12.50 €", ""):
        assert tokenizer.encode(text, bos=True) == sp.encode(text, bos=True), text
        assert tokenizer.decode(sp.encode(text)) == text


def test_load_any_reads_gguf(tmp_path):
    config = CONFIGS["unshared-gqa"]
    weights = random_weights(config, seed=4)
    export_gguf(config, weights, placeholder_tokenizer(config.vocab_size), tmp_path / "m.gguf")
    loaded_config, loaded, tokenizer = load_any(tmp_path / "m.gguf")
    assert loaded_config == config and all(np.array_equal(loaded[k], weights[k]) for k in weights)
    assert tokenizer.vocab_size == config.vocab_size
    placeholder_tokenizer(config.vocab_size).save(tmp_path / "tokenizer.bin")
    assert load_any(tmp_path / "m.gguf", tmp_path / "tokenizer.bin")[2].tokens[0] == b"<unk>"  # the one given


def test_export_refuses_what_a_file_cannot_hold(tmp_path):
    config = CONFIGS["shared"]
    weights = random_weights(config)
    tokenizer = placeholder_tokenizer(config.vocab_size)
    with pytest.raises(InteropError, match="dtype 'q4_0' is not one of float32, float16, bfloat16, q8_0"):
        export_gguf(config, weights, tokenizer, tmp_path / "m.gguf", "q4_0")
    with pytest.raises(InteropError, match="SentencePiece's: a ByteTokenizer cannot be written"):
        export_gguf(config, weights, ByteTokenizer(), tmp_path / "m.gguf")
    with pytest.raises(InteropError, match="the tokenizer has 299 pieces, the model's vocabulary 300"):
        export_gguf(config, weights, placeholder_tokenizer(299), tmp_path / "m.gguf")
    with pytest.raises(InteropError, match="mixture of experts"):
        export_gguf(MOE_PRESETS["moe-15M"], {}, tokenizer, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.iterdir())  # nothing written, not even half


def _rewrite(source, target, architecture="llama", drop=(), tensor_type=None):
    """A copy of GGUF file `source` with another architecture, without keys or tensors in
    `drop`, or with its first matrix stored as `tensor_type`."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in drop:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            items = [bytes(field.parts[i]) if field.types[1] == gguf.GGUFValueType.STRING else field.parts[i].tolist()[0]
                     for i in field.data]
            writer.add_array(field.name.replace("llama.", f"{architecture}."), items)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(field.name.replace("llama.", f"{architecture}."), field.parts[field.data[0]].tolist()[0], kind)
    for tensor in reader.tensors:
        if tensor.name in drop:
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if tensor_type is not None and tensor.name == "blk.0.attn_q.weight":
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, tensor_type), raw_dtype=tensor_type)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_import_errors_name_what_is_wrong(tmp_path):
    config = CONFIGS["shared"]
    good = export_gguf(config, random_weights(config), placeholder_tokenizer(config.vocab_size), tmp_path / "good.gguf")
    with pytest.raises(InteropError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(InteropError, match="not a readable GGUF file"):
        import_gguf(tmp_path / "junk.gguf")
    with pytest.raises(InteropError, match="architecture 'gpt2'; ranvier reads GGUF files of the 'llama' architecture"):
        import_gguf(_rewrite(good, tmp_path / "gpt2.gguf", architecture="gpt2"))
    with pytest.raises(InteropError, match="blk.0.attn_q.weight is Q4_0; ranvier reads F32, F16, BF16 and Q8_0"):
        import_gguf(_rewrite(good, tmp_path / "q4.gguf", tensor_type=gguf.GGMLQuantizationType.Q4_0))
    with pytest.raises(InteropError, match="lacks llama.feed_forward_length"):
        import_gguf(_rewrite(good, tmp_path / "nokey.gguf", drop=("llama.feed_forward_length",)))
    with pytest.raises(InteropError, match="missing layers.1.w2"):
        import_gguf(_rewrite(good, tmp_path / "notensor.gguf", drop=(gguf_name("layers.1.w2"),)))


def test_q8_0_files_blocks_are_what_int8_products_read(tmp_path):
    """A q8_0 file's weights, read back to float32 and quantized again for `matmul="int8"`,
    give the file's own blocks: each block's largest value is ±127 steps of its scale, so the
    scale and the steps come back exactly."""
    config = CONFIGS["shared"]
    export_gguf(config, random_weights(config, seed=9), placeholder_tokenizer(config.vocab_size), tmp_path / "m.gguf", "q8_0")
    _, weights, _ = import_gguf(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        key = next(k for k in weights if gguf_name(k) == tensor.name)
        rows = weights[key].T if key.rsplit(".", 1)[-1] in MATRICES else weights[key]
        d, q = quantize_q8_0(np.ascontiguousarray(rows))
        blocks = np.asarray(tensor.data).reshape(len(q), -1, 34)
        np.testing.assert_array_equal(d.astype(np.float16), blocks[..., :2].copy().view(np.float16)[..., 0], err_msg=key)
        np.testing.assert_array_equal(q, blocks[..., 2:].copy().view(np.int8).reshape(q.shape), err_msg=key)
