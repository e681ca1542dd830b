"""Moving Llama models between ranvier and other tools: llama2.c and Hugging Face.

llama2.c checkpoints (`run.c` reads them):
  * version 0 ("legacy"): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
    vocab_size — negative when the classifier is not shared —, max_seq_len), then float32
    arrays: token embedding, attention norms, wq, wk, wv, wo, ffn norms, w1, w2, w3, final
    norm, the RoPE cos and sin tables [max_seq_len, head_size/2] (written, skipped on
    import), then the classifier when it is not shared.
  * version 1 (export.py's version1_export): a 256-byte header — uint32 magic "ak42",
    int32 version 1, the 7 int32 parameters, a uint8 shared-classifier flag, zeros — then
    attention norms, ffn norms, final norm, token embedding, wq, wk, wv, wo, w1, w2, w3 and
    the classifier when it is not shared.
  Matrices are torch Linear weights [out, in], layer after layer; ranvier keeps [in, out].

llama2.c tokenizer.bin: uint32 max_token_length, then per token float32 score, uint32
length and the token's bytes. `Llama2cTokenizer` reads one and encodes exactly as run.c.

Hugging Face: a folder with config.json (LlamaForCausalLM) and model.safetensors (or shards
with model.safetensors.index.json; float32, float16 or bfloat16). HF rotates the halves of each head (rotate_half) where
llama2.c and ranvier rotate interleaved pairs, so q and k rows are permuted on the way.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from ..atomic import atomic_write, atomic_write_bytes
from ..errors import RanvierError, name_mismatch
from .llama import LlamaConfig, rope_tables

MAGIC = 0x616B3432  # "ak42"
V1_HEADER_BYTES = 256
LEGACY_HEADER_BYTES = 7 * 4
LLAMA2C_NORM_EPS = 1e-5
LLAMA2C_ROPE_THETA = 10000.0


class InteropError(RanvierError):
    """A model or tokenizer file cannot be read or written in a foreign format."""


# ---- shapes and checks --------------------------------------------------------------------


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """ranvier's weight names and shapes ([in, out] matrices) for a config."""
    c = config
    kv = c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings": (c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        shapes.update({
            f"layers.{i}.attention_norm": (c.dim,),
            f"layers.{i}.wq": (c.dim, c.dim),
            f"layers.{i}.wk": (c.dim, kv),
            f"layers.{i}.wv": (c.dim, kv),
            f"layers.{i}.wo": (c.dim, c.dim),
            f"layers.{i}.ffn_norm": (c.dim,),
            f"layers.{i}.w1": (c.dim, c.hidden_dim),
            f"layers.{i}.w2": (c.hidden_dim, c.dim),
            f"layers.{i}.w3": (c.dim, c.hidden_dim),
        })
    shapes["norm"] = (c.dim,)
    if not c.shared_classifier:
        shapes["output"] = (c.dim, c.vocab_size)
    return shapes


def check_weights(config: LlamaConfig, weights: dict[str, np.ndarray], source: str = "weights") -> dict[str, np.ndarray]:
    """The weights as float32 arrays, after checking names and shapes against the config."""
    expected = weight_shapes(config)
    missing = [k for k in expected if k not in weights]
    extra = [k for k in weights if k not in expected]
    if missing or extra:
        raise InteropError(
            f"{source} do not fit the Llama config: " + name_mismatch(missing, extra)
        )
    out = {}
    for key, shape in expected.items():
        array = np.asarray(weights[key])
        if array.shape != shape:
            raise InteropError(f"{source}: {key} has shape {list(array.shape)}, the config needs {list(shape)}")
        out[key] = np.ascontiguousarray(array, dtype=np.float32)
    return out


def _config(source: str, **fields) -> LlamaConfig:
    try:
        return LlamaConfig(**fields)
    except RanvierError as error:
        raise InteropError(f"{source}: {error}") from None
    except TypeError as error:
        raise InteropError(f"{source}: {error}") from None


# ---- llama2.c checkpoints -----------------------------------------------------------------


def _linear(array: np.ndarray) -> np.ndarray:
    """ranvier [in, out] → torch Linear [out, in] (and back: the transpose is its own inverse)."""
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32).T)


def _llama2c_arrays(config: LlamaConfig, weights: dict[str, np.ndarray], version: int) -> list[np.ndarray]:
    c, w = config, weights
    L = range(c.n_layers)

    def layers(name: str, linear: bool) -> list[np.ndarray]:
        return [_linear(w[f"layers.{i}.{name}"]) if linear else w[f"layers.{i}.{name}"] for i in L]

    matrices = [array for name in ("wq", "wk", "wv", "wo") for array in layers(name, True)]
    ffn = [array for name in ("w1", "w2", "w3") for array in layers(name, True)]
    classifier = [] if c.shared_classifier else [_linear(w["output"])]
    if version == 0:
        cos, sin = rope_tables(c.head_dim, c.max_seq_len, LLAMA2C_ROPE_THETA)
        return [w["tok_embeddings"], *layers("attention_norm", False), *matrices, *layers("ffn_norm", False), *ffn,
                w["norm"], cos, sin, *classifier]
    return [*layers("attention_norm", False), *layers("ffn_norm", False), w["norm"], w["tok_embeddings"],
            *matrices, *ffn, *classifier]


def export_llama2c(config: LlamaConfig, weights: dict[str, np.ndarray], path: str | os.PathLike, version: int = 0) -> Path:
    """Write a llama2.c checkpoint (version 0 = legacy, run.c's format; 1 = export.py's version 1)."""
    if version not in (0, 1):
        raise InteropError(f"llama2.c checkpoint version must be 0 (legacy) or 1, not {version!r}")
    if config.norm_eps != LLAMA2C_NORM_EPS or config.rope_theta != LLAMA2C_ROPE_THETA:
        raise InteropError(
            f"llama2.c fixes norm_eps at {LLAMA2C_NORM_EPS:g} and rope_theta at {LLAMA2C_ROPE_THETA:g}; "
            f"this model has {config.norm_eps:g} and {config.rope_theta:g}, which the file cannot record"
        )
    weights = check_weights(config, weights)
    c = config
    params = (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len)
    if version == 0:
        vocab = c.vocab_size if c.shared_classifier else -c.vocab_size
        header = struct.pack("<7i", *params[:5], vocab, params[6])
    else:
        header = struct.pack("<Ii7iB", MAGIC, 1, *params, int(c.shared_classifier))
        header += b"\0" * (V1_HEADER_BYTES - len(header))
    arrays = _llama2c_arrays(c, weights, version)

    def write(f):
        f.write(header)
        for array in arrays:
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())

    atomic_write(path, write)
    return Path(path)


def _llama2c_float_count(config: LlamaConfig, version: int) -> int:
    c = config
    count = c.parameter_count()
    if version == 0:
        count += c.max_seq_len * c.head_dim  # cos and sin tables, head_dim/2 each
    return count


def import_llama2c(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Read a llama2.c checkpoint of version 0 (legacy) or 1, told apart by the version-1 magic."""
    path = Path(path)
    if not path.is_file():
        raise InteropError(f"llama2.c checkpoint {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(V1_HEADER_BYTES)
    if len(head) < LEGACY_HEADER_BYTES:
        raise InteropError(f"{path} is not a llama2.c checkpoint: {size} bytes, shorter than any header")
    if struct.unpack_from("<I", head)[0] == MAGIC:
        if len(head) < V1_HEADER_BYTES:
            raise InteropError(f"{path}: truncated llama2.c header ({size} bytes, a version-1 header is {V1_HEADER_BYTES})")
        version = struct.unpack_from("<i", head, 4)[0]
        if version != 1:
            raise InteropError(
                f"{path}: llama2.c checkpoint version {version} is not supported (only 0 = legacy and 1 = float32; "
                "version 2 is llama2.c's int8-quantized format)"
            )
        params = struct.unpack_from("<7i", head, 8)
        shared = bool(head[36])
        vocab = params[5]
        offset = V1_HEADER_BYTES
        kind = "version-1"
    else:
        version = 0
        params = struct.unpack_from("<7i", head, 0)
        shared = params[5] > 0
        vocab = abs(params[5])
        offset = LEGACY_HEADER_BYTES
        kind = f"legacy (no version-1 magic 0x{MAGIC:08x})"
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")
    values = dict(zip(names, (*params[:5], vocab, params[6])))
    bad = [f"{name}={value}" for name, value in values.items() if value < 1]
    if bad:
        raise InteropError(f"{path} is not a llama2.c checkpoint: read as {kind}, its header has non-positive {', '.join(bad)}")
    config = _config(f"{path} is not a valid llama2.c checkpoint: read as {kind}, its header says", **values, norm_eps=LLAMA2C_NORM_EPS,
                     rope_theta=LLAMA2C_ROPE_THETA, shared_classifier=shared)
    expected = offset + 4 * _llama2c_float_count(config, version)
    if size != expected:
        raise InteropError(
            f"{path}: the {kind} llama2.c header ({', '.join(f'{k}={v}' for k, v in values.items())}, "
            f"{'shared' if shared else 'separate'} classifier) needs {expected} bytes, the file has {size} "
            f"({'truncated' if size < expected else 'extra data'})"
        )
    data = np.memmap(path, dtype="<f4", mode="r", offset=offset)
    position = 0

    def take(*shape: int) -> np.ndarray:
        nonlocal position
        n = int(np.prod(shape))
        array = np.array(data[position:position + n], dtype=np.float32).reshape(shape)
        position += n
        return array

    c = config
    kv = c.n_kv_heads * c.head_dim
    L = c.n_layers
    weights: dict[str, np.ndarray] = {}

    def per_layer(name: str, *shape: int, linear: bool = False) -> None:
        for i in range(L):
            array = take(*shape)
            weights[f"layers.{i}.{name}"] = _linear(array) if linear else array

    def matrices() -> None:
        per_layer("wq", c.dim, c.dim, linear=True)
        per_layer("wk", kv, c.dim, linear=True)
        per_layer("wv", kv, c.dim, linear=True)
        per_layer("wo", c.dim, c.dim, linear=True)

    def ffn() -> None:
        per_layer("w1", c.hidden_dim, c.dim, linear=True)
        per_layer("w2", c.dim, c.hidden_dim, linear=True)
        per_layer("w3", c.hidden_dim, c.dim, linear=True)

    if version == 0:
        weights["tok_embeddings"] = take(c.vocab_size, c.dim)
        per_layer("attention_norm", c.dim)
        matrices()
        per_layer("ffn_norm", c.dim)
        ffn()
        weights["norm"] = take(c.dim)
        take(c.max_seq_len * c.head_dim)  # RoPE cos and sin tables: recomputed, not stored
    else:
        per_layer("attention_norm", c.dim)
        per_layer("ffn_norm", c.dim)
        weights["norm"] = take(c.dim)
        weights["tok_embeddings"] = take(c.vocab_size, c.dim)
        matrices()
        ffn()
    if not shared:
        weights["output"] = _linear(take(c.vocab_size, c.dim))
    return config, {key: weights[key] for key in weight_shapes(config)}


# ---- llama2.c tokenizer.bin ---------------------------------------------------------------

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class Llama2cTokenizer:
    """A llama2.c tokenizer.bin: encode and decode exactly as run.c does (BOS 1, EOS 2)."""

    kind = "llama2c"

    def __init__(self, tokens: list[bytes], scores: list[float], max_token_length: int | None = None,
                 bos_id: int = 1, eos_id: int = 2):
        if len(tokens) != len(scores) or not tokens:
            raise InteropError("llama2.c tokenizer: needs one score per token and at least one token")
        self.tokens = [bytes(t) for t in tokens]
        self.scores = [float(np.float32(s)) for s in scores]
        self.max_token_length = max(len(t) for t in self.tokens) if max_token_length is None else int(max_token_length)
        self.vocab_size = len(self.tokens)
        self.bos_id, self.eos_id = bos_id, eos_id
        self._ids: dict[bytes, int] = {}
        for i, token in enumerate(self.tokens):
            self._ids.setdefault(token, i)

    def piece(self, token: int) -> bytes:
        return self.tokens[int(token)]

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """run.c's encode(): dummy-prefix space, one token per UTF-8 codepoint (bytes + 3 when
        unknown), then merge the best-scoring adjacent pair until none is in the vocabulary."""
        ids: list[int] = [self.bos_id] if bos else []
        if text:
            if b" " in self._ids:  # add_dummy_prefix
                ids.append(self._ids[b" "])
        for char in text:
            data = char.encode("utf-8", errors="surrogatepass")
            token = self._ids.get(data)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(byte + 3 for byte in data)
        while True:
            best_score, best_id, best_index = -1e10, -1, -1
            for i in range(len(ids) - 1):
                merged = self._ids.get(self.tokens[ids[i]] + self.tokens[ids[i + 1]])
                if merged is not None and self.scores[merged] > best_score:
                    best_score, best_id, best_index = self.scores[merged], merged, i
            if best_index < 0:
                break
            ids[best_index:best_index + 2] = [best_id]
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        out = bytearray()
        previous = None
        for position, token in enumerate(ids):
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise InteropError(f"llama2.c tokenizer: id {token} at position {position} is outside 0..{self.vocab_size - 1}")
            if token not in (self.bos_id, self.eos_id):
                piece = self.tokens[token]
                if previous == self.bos_id and piece.startswith(b" "):
                    piece = piece[1:]  # sentencepiece drops the dummy prefix after BOS
                match = _BYTE_PIECE.fullmatch(piece)
                out += bytes([int(match.group(1), 16)]) if match else piece
            previous = token
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Tokens to text as run.c prints them (BOS and EOS themselves are left out)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_bytes(path, _tokenizer_bin(self.tokens, self.scores))

    def __repr__(self) -> str:
        return f"Llama2cTokenizer(vocab_size={self.vocab_size})"


def _tokenizer_bin(tokens: list[bytes], scores: list[float]) -> bytes:
    parts = [struct.pack("<I", max(len(t) for t in tokens))]
    for token, score in zip(tokens, scores):
        parts.append(struct.pack("<fI", score, len(token)))
        parts.append(token)
    return b"".join(parts)


def tokenizer_pieces(tokenizer) -> tuple[list[bytes], list[float]]:
    """The (bytes, score) of every token as llama2.c's tokenizer.py export() writes them."""
    kind = getattr(tokenizer, "kind", None)
    if kind == "llama2c":
        return list(tokenizer.tokens), list(tokenizer.scores)
    tokens, scores = [], []
    if kind == "sentencepiece":
        model = tokenizer._model
        for i in range(tokenizer.vocab_size):
            piece, score = model.id_to_piece(i), float(model.get_score(i))
            if i == tokenizer.bos_id:
                piece = "\n<s>\n"
            elif i == tokenizer.eos_id:
                piece = "\n</s>\n"
            tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
            scores.append(score)
        return tokens, scores
    for i in range(tokenizer.vocab_size):
        if i == tokenizer.bos_id:
            token = b"\n<s>\n"
        elif i == tokenizer.eos_id:
            token = b"\n</s>\n"
        elif kind == "byte":
            token = bytes([i])
        elif kind == "char":
            token = tokenizer.chars[i].encode("utf-8", errors="surrogatepass")
        else:
            raise InteropError(f"cannot export a {type(tokenizer).__name__} as a llama2.c tokenizer.bin")
        tokens.append(token)
        scores.append(0.0)
    return tokens, scores


def export_tokenizer_bin(tokenizer, path: str | os.PathLike) -> Path:
    """Write llama2.c's tokenizer.bin for a SentencePiece, byte, char or llama2.c tokenizer.

    Only a SentencePiece vocabulary (BOS 1, EOS 2, bytes at 3..258, as ranvier trains
    them) encodes in run.c as it does here; byte and char vocabularies are written with
    their token texts and score 0, for decoding.
    """
    tokens, scores = tokenizer_pieces(tokenizer)
    atomic_write_bytes(path, _tokenizer_bin(tokens, scores))
    return Path(path)


def import_tokenizer_bin(path: str | os.PathLike) -> Llama2cTokenizer:
    path = Path(path)
    if not path.is_file():
        raise InteropError(f"llama2.c tokenizer {path} does not exist")
    data = path.read_bytes()
    if len(data) < 4:
        raise InteropError(f"{path} is not a llama2.c tokenizer.bin: {len(data)} bytes")
    (max_length,) = struct.unpack_from("<I", data, 0)
    position, tokens, scores = 4, [], []
    while position < len(data):
        if position + 8 > len(data):
            raise InteropError(f"{path}: truncated at token {len(tokens)} (byte {position} of {len(data)})")
        score, length = struct.unpack_from("<fI", data, position)
        position += 8
        if length > max_length or position + length > len(data):
            raise InteropError(
                f"{path}: token {len(tokens)} claims {length} bytes (max_token_length {max_length}, "
                f"{len(data) - position} bytes left): corrupt or not a tokenizer.bin"
            )
        tokens.append(data[position:position + length])
        scores.append(score)
        position += length
    if not tokens:
        raise InteropError(f"{path}: a llama2.c tokenizer.bin with no tokens")
    return Llama2cTokenizer(tokens, scores, max_length)


# ---- Hugging Face Llama --------------------------------------------------------------------


def hf_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a torch [out, in] q/k weight from interleaved-pair RoPE order to HF's half-split
    order (transformers' convert_llama_weights_to_hf.py `permute`)."""
    out, inp = w.shape
    return np.ascontiguousarray(w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(0, 2, 1, 3).reshape(out, inp))


def hf_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `hf_permute`."""
    out, inp = w.shape
    return np.ascontiguousarray(w.reshape(n_heads, 2, out // n_heads // 2, inp).transpose(0, 2, 1, 3).reshape(out, inp))


def hf_config(config: LlamaConfig, bos_id: int = 1, eos_id: int = 2) -> dict:
    c = config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": c.shared_classifier,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def hf_state_dict(config: LlamaConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ranvier weights → HF LlamaForCausalLM names, torch [out, in] layout, q/k rows permuted."""
    c, w = config, check_weights(config, weights)
    state = {"model.embed_tokens.weight": w["tok_embeddings"]}
    for i in range(c.n_layers):
        p, lw = f"model.layers.{i}.", (lambda name: w[f"layers.{i}.{name}"])
        state[p + "input_layernorm.weight"] = lw("attention_norm")
        state[p + "self_attn.q_proj.weight"] = hf_permute(_linear(lw("wq")), c.n_heads)
        state[p + "self_attn.k_proj.weight"] = hf_permute(_linear(lw("wk")), c.n_kv_heads)
        state[p + "self_attn.v_proj.weight"] = _linear(lw("wv"))
        state[p + "self_attn.o_proj.weight"] = _linear(lw("wo"))
        state[p + "post_attention_layernorm.weight"] = lw("ffn_norm")
        state[p + "mlp.gate_proj.weight"] = _linear(lw("w1"))
        state[p + "mlp.up_proj.weight"] = _linear(lw("w3"))
        state[p + "mlp.down_proj.weight"] = _linear(lw("w2"))
    state["model.norm.weight"] = w["norm"]
    if not c.shared_classifier:
        state["lm_head.weight"] = _linear(w["output"])
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}


def export_hf(config: LlamaConfig, weights: dict[str, np.ndarray], out_dir: str | os.PathLike,
              bos_id: int = 1, eos_id: int = 2) -> Path:
    """Write config.json and model.safetensors that transformers' LlamaForCausalLM loads."""
    from safetensors.numpy import save as st_save

    out = Path(out_dir)
    state = hf_state_dict(config, weights)
    atomic_write_bytes(out / "model.safetensors", st_save(state, metadata={"format": "pt"}))
    atomic_write_bytes(out / "config.json", (json.dumps(hf_config(config, bos_id, eos_id), indent=2) + "\n").encode())
    return out


def _read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise InteropError(f"{index} is not a safetensors index (no readable 'weight_map'): {error}") from None
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InteropError(f"{folder} holds no *.safetensors weights")
    state: dict[str, np.ndarray] = {}
    for file in files:
        if not file.is_file():
            raise InteropError(f"{file}, named by {folder}'s safetensors index, is missing")
        try:
            state.update(load_file(file))
        except TypeError:  # numpy has no bfloat16: safetensors' numpy API refuses such files
            try:
                state.update(_read_safetensors_bf16(file))
            except (struct.error, KeyError, ValueError) as error:
                raise InteropError(f"cannot read {file}: {error!r}") from None
        except Exception as error:  # safetensors raises its own error types for corrupt data
            raise InteropError(f"cannot read {file}: {error}") from None
    return state


def _read_safetensors_bf16(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy, bfloat16 ones widened to float32 (exactly)."""
    from safetensors import safe_open

    raw = file.read_bytes()
    (header_size,) = struct.unpack_from("<Q", raw)
    try:
        header = json.loads(raw[8:8 + header_size])
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InteropError(f"cannot read {file}: corrupt safetensors header ({error})") from None
    state = {}
    with safe_open(file, framework="numpy") as f:
        for name in f.keys():
            info = header[name]
            if info["dtype"] == "BF16":
                begin, end = (8 + header_size + offset for offset in info["data_offsets"])
                bits = np.frombuffer(raw[begin:end], dtype="<u2").astype(np.uint32) << 16
                state[name] = bits.view(np.float32).reshape(info["shape"])
            else:
                state[name] = f.get_tensor(name)
    return state


def import_hf(folder: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face Llama folder (config.json + safetensors) into ranvier weights."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InteropError(f"{folder} is not a Hugging Face model folder: config.json is missing")
    try:
        hf = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InteropError(f"{config_path} is not valid JSON: {error}") from None
    if hf.get("model_type", "llama") != "llama":
        raise InteropError(f"{config_path}: model_type {hf.get('model_type')!r} is not 'llama'")
    if hf.get("rope_scaling"):
        raise InteropError(f"{config_path}: rope_scaling {hf['rope_scaling']!r} is not supported")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise InteropError(f"{config_path}: only silu activations without biases are supported")
    try:
        n_heads = hf["num_attention_heads"]
        config = _config(
            str(config_path),
            dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads, vocab_size=hf["vocab_size"],
            hidden_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(hf.get("rope_theta", 10000.0)),
            shared_classifier=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as error:
        raise InteropError(f"{config_path} lacks {error.args[0]!r}") from None
    if hf.get("head_dim") not in (None, config.head_dim):
        raise InteropError(f"{config_path}: head_dim {hf['head_dim']} differs from hidden_size / heads = {config.head_dim}")
    state = _read_safetensors(folder)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.shared_classifier:
        state.pop("lm_head.weight", None)
    c = config
    names = {"tok_embeddings": ("model.embed_tokens.weight", None), "norm": ("model.norm.weight", None)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        names.update({
            f"layers.{i}.attention_norm": (p + "input_layernorm.weight", None),
            f"layers.{i}.wq": (p + "self_attn.q_proj.weight", c.n_heads),
            f"layers.{i}.wk": (p + "self_attn.k_proj.weight", c.n_kv_heads),
            f"layers.{i}.wv": (p + "self_attn.v_proj.weight", 0),
            f"layers.{i}.wo": (p + "self_attn.o_proj.weight", 0),
            f"layers.{i}.ffn_norm": (p + "post_attention_layernorm.weight", None),
            f"layers.{i}.w1": (p + "mlp.gate_proj.weight", 0),
            f"layers.{i}.w3": (p + "mlp.up_proj.weight", 0),
            f"layers.{i}.w2": (p + "mlp.down_proj.weight", 0),
        })
    if not c.shared_classifier:
        names["output"] = ("lm_head.weight", 0)
    missing = [hf_name for hf_name, _ in names.values() if hf_name not in state]
    extra = sorted(set(state) - {hf_name for hf_name, _ in names.values()})
    if missing or extra:
        raise InteropError(
            f"{folder}: the weights do not fit config.json: " + name_mismatch(missing, extra)
        )
    weights = {}
    for key, (hf_name, heads) in names.items():
        array = np.asarray(state[hf_name], dtype=np.float32)
        if heads is not None:  # a Linear weight [out, in]
            if heads:
                array = hf_unpermute(array, heads)
            array = _linear(array)
        weights[key] = array
    return config, check_weights(config, weights, f"{folder}")


# ---- run directories -----------------------------------------------------------------------


def weights_from_run(run_dir: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The model config and latest checkpointed weights of a `ranvier train llama` run directory."""
    from ..train.llama_job import load_model

    config, weights, _ = load_model(Path(run_dir))
    return config, check_weights(config, {k: np.asarray(v, np.float32) for k, v in weights.items()}, f"the checkpoint in {run_dir}")


def load_any(model: str | os.PathLike, tokenizer: str | os.PathLike | None = None):
    """(config, weights, tokenizer) of a run directory, a llama2.c .bin (with its
    tokenizer.bin) or a Hugging Face folder (its tokenizer.model, or `tokenizer`)."""
    from ..data.tokenizers import load_tokenizer
    from ..train.llama_job import load_model

    path = Path(model)
    if path.is_dir() and (path / "checkpoint").is_dir():
        config, weights, run_tokenizer = load_model(path)
        return config, weights, load_tokenizer(tokenizer) if tokenizer else run_tokenizer
    if path.is_file():
        if tokenizer is None:
            raise InteropError(f"{path} is a llama2.c checkpoint: give its tokenizer.bin with --tokenizer")
        config, weights = import_llama2c(path)
        return config, weights, import_tokenizer_bin(tokenizer) if str(tokenizer).endswith(".bin") else load_tokenizer(tokenizer)
    if path.is_dir() and (path / "config.json").is_file():
        config, weights = import_hf(path)
        source = Path(tokenizer) if tokenizer else path / "tokenizer.model"
        if not source.is_file():
            raise InteropError(f"{path} has no tokenizer.model: give one with --tokenizer")
        return config, weights, load_tokenizer(source)
    raise InteropError(f"{path} is not a run directory, a llama2.c checkpoint or a Hugging Face folder")
