"""GGUF files (llama.cpp's format) of the "llama" architecture, through the `gguf` package
(`pip install ranvier[gguf]`).

A file holds the config as metadata (`llama.embedding_length`, ...), a SentencePiece vocabulary
as llama.cpp's tokenizer keys (`tokenizer.ggml.model` "llama": each piece with its score and
type, a space written as U+2581), and the tensors under llama.cpp's names: torch [out, in]
matrices, ggml's dimensions reversed. llama.cpp rotates interleaved pairs of a head, as
llama2.c and ranvier do, so q and k are written as they are (Hugging Face's converter permutes
its halves back into this order). Matrices go out in float32, float16, bfloat16 or q8_0 (blocks
of 32 int8 with one float16 scale), the norms' gains in float32, as llama.cpp's converters
write them; a matrix whose rows are not whole blocks of 32 goes out in float16 under q8_0.
Import reads those four types back to float32 weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_by_name
from ..models.llama import LlamaConfig
from ..models.moe import MoEConfig
from .tokenizer_bin import Llama2cTokenizer
from .weights import InteropError, check_weights, config_from, torch_layout, weight_shapes

GGUF_TYPES = ("float32", "float16", "bfloat16", "q8_0")
_SPACE = "\u2581".encode()  # SentencePiece's space, as its pieces and llama.cpp's vocabularies hold it
_UNKNOWN, _BOS, _EOS = 0, 1, 2  # llama2.c's and Llama 2's special ids
# ranvier's names → llama.cpp's, per layer and outside the layers
_LAYER_NAMES = {"attention_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                "ffn_norm": "ffn_norm", "w1": "ffn_gate", "w2": "ffn_down", "w3": "ffn_up"}
_OUTSIDE_NAMES = {"tok_embeddings": "token_embd", "norm": "output_norm", "output": "output"}


def _gguf():
    """The `gguf` package, or how to get it."""
    try:
        import gguf
    except ImportError:
        raise InteropError("GGUF files need the `gguf` package: pip install 'ranvier[gguf]' (or pip install gguf)") from None
    return gguf


def gguf_name(key: str) -> str:
    """llama.cpp's tensor name for a ranvier weight (`layers.3.wq` → `blk.3.attn_q.weight`)."""
    if key.startswith("layers."):
        _, layer, name = key.split(".", 2)
        return f"blk.{layer}.{_LAYER_NAMES[name]}.weight"
    return f"{_OUTSIDE_NAMES[key]}.weight"


def _is_matrix(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")


def _vocabulary(tokenizer) -> tuple[list[bytes], list[float], list[int]]:
    """Pieces (spaces as U+2581), scores and llama.cpp token types of a SentencePiece or
    llama2.c tokenizer, as llama.cpp's converters write them."""
    gguf = _gguf()
    types = gguf.TokenType
    kind = getattr(tokenizer, "kind", None)
    if kind == "sentencepiece":
        model = tokenizer._model
        pieces, scores, kinds = [], [], []
        for i in range(tokenizer.vocab_size):
            pieces.append(model.id_to_piece(i).encode())
            scores.append(float(model.get_score(i)))
            kinds.append(types.UNKNOWN if model.is_unknown(i) else types.CONTROL if model.is_control(i)
                         else types.UNUSED if model.is_unused(i) else types.BYTE if model.is_byte(i) else types.NORMAL)
        return pieces, scores, [int(k) for k in kinds]
    if kind == "llama2c":  # convert-llama2c-to-ggml's reading of a tokenizer.bin
        pieces, kinds = [], []
        for i, piece in enumerate(tokenizer.tokens):
            special = {_UNKNOWN: (b"<unk>", types.UNKNOWN), _BOS: (b"<s>", types.CONTROL), _EOS: (b"</s>", types.CONTROL)}
            if i in special:
                piece, token_type = special[i]
            elif not piece:
                token_type = types.CONTROL
            elif len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
                token_type = types.BYTE
            else:
                token_type = types.NORMAL
            pieces.append(piece.replace(b" ", _SPACE))
            kinds.append(int(token_type))
        return pieces, list(tokenizer.scores), kinds
    raise InteropError(f"GGUF's 'llama' vocabulary is SentencePiece's: a {type(tokenizer).__name__} cannot be written "
                       "(train the model on a SentencePiece tokenizer, or give a llama2.c tokenizer.bin)")


def export_gguf(config: LlamaConfig, weights: dict[str, np.ndarray], tokenizer, path: str | os.PathLike,
                dtype: str = "float32") -> Path:
    """Write a llama-architecture GGUF file llama.cpp loads: the model's config, its tokenizer
    (SentencePiece or llama2.c) and its weights, the matrices in `dtype` (GGUF_TYPES)."""
    gguf = _gguf()
    if dtype not in GGUF_TYPES:
        raise InteropError(f"GGUF export: dtype {dtype!r} is not one of {', '.join(GGUF_TYPES)}")
    if isinstance(config, MoEConfig):
        raise InteropError("GGUF export writes dense Llama models; a mixture of experts goes out as a Hugging Face "
                           "MixtralForCausalLM folder (ranvier export hf)")
    weights = check_weights(config, weights)
    pieces, scores, kinds = _vocabulary(tokenizer)
    if len(pieces) != config.vocab_size:
        raise InteropError(f"GGUF export: the tokenizer has {len(pieces)} pieces, the model's vocabulary {config.vocab_size}")
    quantization = gguf.GGMLQuantizationType
    file_types = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                  "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    c = config

    def write(name: Path) -> None:
        writer = gguf.GGUFWriter(name, "llama")
        writer.add_name("ranvier llama")
        writer.add_context_length(c.max_seq_len)
        writer.add_embedding_length(c.dim)
        writer.add_block_count(c.n_layers)
        writer.add_feed_forward_length(c.hidden_dim)
        writer.add_head_count(c.n_heads)
        writer.add_head_count_kv(c.n_kv_heads)
        writer.add_rope_dimension_count(c.head_dim)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_layer_norm_rms_eps(c.norm_eps)
        writer.add_vocab_size(c.vocab_size)
        writer.add_file_type(int(file_types[dtype]))
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_scores(scores)
        writer.add_token_types(kinds)
        writer.add_bos_token_id(getattr(tokenizer, "bos_id", _BOS))
        writer.add_eos_token_id(getattr(tokenizer, "eos_id", _EOS))
        writer.add_unk_token_id(_UNKNOWN)
        for key, value in weights.items():
            array = torch_layout(value) if _is_matrix(key) else value
            kind = dtype if array.ndim == 2 else "float32"
            if kind == "q8_0" and array.shape[1] % 32:
                kind = "float16"  # llama.cpp's converter's fallback for rows of partial blocks
            if kind == "float32":
                writer.add_tensor(gguf_name(key), array)
            elif kind == "float16":
                writer.add_tensor(gguf_name(key), array.astype(np.float16))
            else:
                qtype = quantization.BF16 if kind == "bfloat16" else quantization.Q8_0
                writer.add_tensor(gguf_name(key), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write_by_name(path, write)
    return Path(path)


def _field(reader, path: Path, key: str, default=None):
    """A scalar or string metadata value (`default` where the file has none; no default: required)."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise InteropError(f"{path}: GGUF metadata lacks {key}")
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0] == _gguf().GGUFValueType.STRING:
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0]


def _shortest(value: float) -> float:
    """A float32 from the file as the shortest decimal that reads back as it (1e-05, not
    9.999999747378752e-06): the value the writer meant."""
    return float(str(np.float32(value)))


def _tokenizer(reader, path: Path) -> Llama2cTokenizer:
    """The file's SentencePiece vocabulary as a tokenizer that encodes as run.c does."""
    model = _field(reader, path, "tokenizer.ggml.model")
    if model != "llama":
        raise InteropError(f"{path}: tokenizer.ggml.model is {model!r}; ranvier reads SentencePiece ('llama') vocabularies")
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise InteropError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens")
    pieces = [bytes(field.parts[i]).replace(_SPACE, b" ") for i in field.data]
    score_field = reader.fields.get("tokenizer.ggml.scores")
    scores = [float(score_field.parts[i][0]) for i in score_field.data] if score_field else [0.0] * len(pieces)
    if len(scores) != len(pieces):
        raise InteropError(f"{path}: {len(pieces)} tokens but {len(scores)} scores")
    return Llama2cTokenizer(pieces, scores, bos_id=int(_field(reader, path, "tokenizer.ggml.bos_token_id", _BOS)),
                            eos_id=int(_field(reader, path, "tokenizer.ggml.eos_token_id", _EOS)))


def import_gguf(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray], Llama2cTokenizer]:
    """(config, float32 weights, tokenizer) of a llama-architecture GGUF file whose tensors are
    float32, float16, bfloat16 or q8_0."""
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise InteropError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError) as error:
        raise InteropError(f"{path} is not a readable GGUF file: {error}") from None
    architecture = _field(reader, path, "general.architecture")
    if architecture != "llama":
        raise InteropError(f"{path}: architecture {architecture!r}; ranvier reads GGUF files of the 'llama' architecture")
    if "llama.rope.scaling.type" in reader.fields:
        raise InteropError(f"{path}: rotary scaling ({_field(reader, path, 'llama.rope.scaling.type')}) is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise InteropError(f"{path}: no token_embd.weight tensor")
    heads = int(_field(reader, path, "llama.attention.head_count"))
    fields = {
        "dim": int(_field(reader, path, "llama.embedding_length")),
        "n_layers": int(_field(reader, path, "llama.block_count")),
        "n_heads": heads,
        "n_kv_heads": int(_field(reader, path, "llama.attention.head_count_kv", heads)),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_dim": int(_field(reader, path, "llama.feed_forward_length")),
        "max_seq_len": int(_field(reader, path, "llama.context_length")),
        "norm_eps": _shortest(_field(reader, path, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest(_field(reader, path, "llama.rope.freq_base", 10000.0)),
        "shared_classifier": "output.weight" not in tensors,
    }
    config = config_from(f"{path}: its GGUF metadata says", **fields)
    rotated = int(_field(reader, path, "llama.rope.dimension_count", config.head_dim))
    if rotated != config.head_dim:
        raise InteropError(f"{path}: llama.rope.dimension_count {rotated} rotates part of each head of {config.head_dim}; "
                           "ranvier rotates whole heads")
    readable = {gguf.GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "Q8_0")}
    weights = {}
    for key in weight_shapes(config):
        tensor = tensors.get(gguf_name(key))
        if tensor is None:
            continue  # check_weights names what is missing
        if tensor.tensor_type not in readable:
            raise InteropError(f"{path}: {tensor.name} is {tensor.tensor_type.name}; ranvier reads F32, F16, BF16 and Q8_0 tensors")
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        weights[key] = torch_layout(values) if _is_matrix(key) else np.asarray(values, np.float32)
    return config, check_weights(config, weights, f"the tensors of {path}"), _tokenizer(reader, path)
