"""llama2.c's tokenizer.bin: uint32 max_token_length, then per token float32 score, uint32
length and the token's bytes. `Llama2cTokenizer` reads one and encodes exactly as run.c."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from .weights import InteropError

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class Llama2cTokenizer:
    """A llama2.c tokenizer.bin: encode and decode exactly as run.c does (BOS 1, EOS 2)."""

    kind = "llama2c"

    def __init__(self, tokens: list[bytes], scores: list[float], max_token_length: int | None = None,
                 bos_id: int = 1, eos_id: int = 2, source: str = "llama2.c tokenizer"):
        self.source = source  # what messages call it: the file it was read from
        if len(tokens) != len(scores) or not tokens:
            raise InteropError(f"{source}: needs one score per token and at least one token")
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
        for wanted, token, name in ((bos, self.bos_id, "BOS"), (eos, self.eos_id, "EOS")):
            if wanted and token >= self.vocab_size:
                raise InteropError(f"{self.source}: no {name} token: its id {token} is past the {self.vocab_size} tokens")
        ids: list[int] = [self.bos_id] if bos else []
        if text and b" " in self._ids:  # add_dummy_prefix
                ids.append(self._ids[b" "])
        for char in text:
            data = char.encode("utf-8", errors="surrogatepass")
            token = self._ids.get(data)
            if token is not None:
                ids.append(token)
            elif max(data) + 3 >= self.vocab_size:
                raise InteropError(f"{self.source}: {char!r} is not one of its {self.vocab_size} tokens, nor are its bytes: "
                                   "run.c's byte tokens are ids 3 + byte, 259 tokens at least")
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
                raise InteropError(f"{self.source}: id {token} at position {position} is outside 0..{self.vocab_size - 1}")
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
    if max_length > len(data):  # run.c sizes a buffer by it
        raise InteropError(f"{path}: header says max_token_length {max_length:,}, but the file holds {len(data):,} bytes: "
                           "corrupt or not a tokenizer.bin")
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
    return Llama2cTokenizer(tokens, scores, max_length, source=str(path))
