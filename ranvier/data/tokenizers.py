"""Tokenizers for language-model training: bytes, characters and SentencePiece.

All three share one small API, the one llama2.c's `Tokenizer` has:
`encode(text, bos=True, eos=False) -> list[int]`, `decode(ids) -> str`, and
`vocab_size`, `bos_id`, `eos_id`; `save(path)` stores one in a run directory and
`load_tokenizer(path)` reads it back, choosing the kind by the file's suffix
(`.json` for byte and char tokenizers, `.model` for SentencePiece).

`train_sentencepiece` trains a custom vocabulary with the options llama2.c's
tinystories.py uses (BPE, byte fallback, split digits, identity normalization,
full character coverage, unk=0 bos=1 eos=2), so any Unicode text encodes even
with a tiny vocabulary.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ..atomic import atomic_write_bytes
from ..errors import RanvierError, parse_json

FORMAT_VERSION = 1


class TokenizerError(RanvierError):
    """A tokenizer file is missing or malformed, or text or ids do not fit the tokenizer."""


class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    kind: str
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, path: str | os.PathLike) -> None: ...


def _with_specials(ids: list[int], bos_id: int, eos_id: int, bos: bool, eos: bool) -> list[int]:
    return ([bos_id] if bos else []) + ids + ([eos_id] if eos else [])


def _write_json(path: str | os.PathLike, payload: dict) -> None:
    # ensure_ascii keeps lone surrogates (from undecodable corpora) representable.
    atomic_write_bytes(path, (json.dumps(payload, indent=1) + "\n").encode("ascii"))


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, 256 is BOS and 257 is EOS.

    It needs no training and encodes every string, so it is the baseline any learned
    vocabulary is compared against.
    """

    kind = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return _with_specials(list(text.encode("utf-8")), self.bos_id, self.eos_id, bos, eos)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; BOS/EOS are dropped and invalid UTF-8 (a model's sample may hold some) becomes U+FFFD."""
        data = bytearray()
        for position, token in enumerate(ids):
            token = int(token)
            if 0 <= token < 256:
                data.append(token)
            elif token not in (self.bos_id, self.eos_id):
                raise TokenizerError(
                    f"byte tokenizer: id {token} at position {position} is outside 0..{self.vocab_size - 1}"
                )
        return data.decode("utf-8", errors="replace")

    def save(self, path: str | os.PathLike) -> None:
        _write_json(path, {"type": self.kind, "version": FORMAT_VERSION})

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"


class CharTokenizer:
    """One token per distinct character of a corpus (ids in sorted order), then BOS and EOS.

    Useful for tiny character-level models; text holding a character the corpus did
    not is refused rather than silently mapped to something else.
    """

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not chars:
            raise TokenizerError("char tokenizer: the character set is empty")
        if any(len(c) != 1 for c in chars):
            wrong = [c for c in chars if len(c) != 1][:5]
            raise TokenizerError(f"char tokenizer: every entry must be one character, got {wrong}")
        if len(set(chars)) != len(chars):
            raise TokenizerError("char tokenizer: the character set has duplicates")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}
        self.bos_id = len(chars)
        self.eos_id = len(chars) + 1
        self.vocab_size = len(chars) + 2

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> CharTokenizer:
        """Build the vocabulary from a string or an iterable of documents."""
        chars: set[str] = set()
        for document in [text] if isinstance(text, str) else text:
            chars.update(document)
        return cls(sorted(chars))

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as missing:
            char = missing.args[0]
            raise TokenizerError(
                f"char tokenizer: character {char!r} (U+{ord(char):04X}) at position {text.index(char)} is not in its "
                f"{len(self.chars)}-character vocabulary"
            ) from None
        return _with_specials(ids, self.bos_id, self.eos_id, bos, eos)

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for position, token in enumerate(ids):
            token = int(token)
            if 0 <= token < len(self.chars):
                out.append(self.chars[token])
            elif token not in (self.bos_id, self.eos_id):
                raise TokenizerError(
                    f"char tokenizer: id {token} at position {position} is outside 0..{self.vocab_size - 1}"
                )
        return "".join(out)

    def save(self, path: str | os.PathLike) -> None:
        _write_json(path, {"type": self.kind, "version": FORMAT_VERSION, "chars": "".join(self.chars)})

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def _sentencepiece():
    """Import the `sentencepiece` package, or say how to get it."""
    try:
        import sentencepiece
    except ImportError:
        raise TokenizerError(
            "SentencePiece tokenizers need the `sentencepiece` package: pip install sentencepiece"
        ) from None
    return sentencepiece


class SentencePieceTokenizer:
    """A trained SentencePiece model (`.model` file), as llama2.c and Llama 2 use.

    BOS/EOS are added by `encode` rather than by SentencePiece, exactly as llama2.c's
    `Tokenizer.encode` does, so the ids match llama2.c's pretokenized shards.
    """

    kind = "sentencepiece"

    def __init__(self, model_path: str | os.PathLike):
        self.path = Path(model_path)
        if not self.path.is_file():
            raise TokenizerError(f"SentencePiece model {self.path} does not exist")
        self._proto = self.path.read_bytes()
        spm = _sentencepiece()
        try:
            self._model = spm.SentencePieceProcessor(model_proto=self._proto)
            # A corrupt piece that is not UTF-8 is refused here, not in some later encode.
            self._model.id_to_piece(list(range(self._model.vocab_size())))
        except (RuntimeError, UnicodeDecodeError) as error:  # (a corrupt model's own message may not be UTF-8)
            raise TokenizerError(f"{self.path} is not a SentencePiece model: {error}") from None
        self.vocab_size = int(self._model.vocab_size())
        self.bos_id = int(self._model.bos_id())
        self.eos_id = int(self._model.eos_id())
        self.unk_id = int(self._model.unk_id())
        self.pad_id = int(self._model.pad_id())

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if (bos and self.bos_id < 0) or (eos and self.eos_id < 0):
            raise TokenizerError(f"{self.path}: the model has no {'BOS' if bos and self.bos_id < 0 else 'EOS'} piece")
        return _with_specials(list(self._model.encode(text)), self.bos_id, self.eos_id, bos, eos)

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(token) for token in ids]
        bad = [token for token in ids if not 0 <= token < self.vocab_size]
        if bad:
            raise TokenizerError(f"{self.path}: id {bad[0]} is outside 0..{self.vocab_size - 1}")
        return self._model.decode(ids)

    def piece(self, token: int) -> str:
        """The vocabulary entry for one id (e.g. '▁the' or '<0x0A>'), for inspecting a vocabulary."""
        return self._model.id_to_piece(int(token))

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_bytes(path, self._proto)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


# SentencePiece's max_sentence_length (its default): the trainer skips longer sentences, so
# a corpus of one long line trained on nothing ("!sentences_.empty()").
MAX_SENTENCE_BYTES = 4192


def _sentences(documents: Iterable[str]) -> Iterable[str]:
    """Non-empty lines of each document, as SentencePiece trains on lines; a line longer
    than it takes comes in pieces, cut before a space where there is one."""
    for document in documents:
        for line in document.splitlines():
            data = line.encode("utf-8")
            while data:
                cut = len(data)
                if cut > MAX_SENTENCE_BYTES:
                    cut = data.rfind(b" ", 1, MAX_SENTENCE_BYTES + 1)
                    if cut < 0:  # no space: cut between two characters
                        cut = MAX_SENTENCE_BYTES
                        while data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
                            cut -= 1
                piece, data = data[:cut].decode("utf-8"), data[cut:]
                if piece.strip():
                    yield piece


def _file_documents(files: list[Path]) -> Iterator[str]:
    for file in files:
        with open(file, encoding="utf-8") as lines:
            try:
                yield from lines
            except UnicodeDecodeError as error:
                raise TokenizerError(f"SentencePiece training input {file} is not UTF-8 text: {error}") from None


def train_sentencepiece(
    text_files_or_iterator: str | os.PathLike | Sequence[str | os.PathLike] | Iterable[str],
    vocab_size: int,
    model_type: str = "bpe",
    output_prefix: str | os.PathLike = "tok",
    *,
    character_coverage: float = 1.0,
    num_threads: int | None = None,
) -> SentencePieceTokenizer:
    """Train a vocabulary and write `{output_prefix}.model` and `{output_prefix}.vocab`.

    The input is a text file or a list or tuple of text files (read line by line), or
    any other iterable of documents (strings, split into lines), e.g. a generator.
    The options are llama2.c's train_vocab, plus remove_extra_whitespaces=False so that text with runs of spaces (source code,
    indentation) decodes back exactly; Llama 2's own tokenizer sets it the same way.
    With byte_fallback every character still encodes, so a small vocab_size only needs
    room for the 3 special pieces, the 256 byte pieces and every distinct character
    (all of them, with character_coverage=1.0).
    """
    if model_type not in ("bpe", "unigram"):
        raise TokenizerError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if vocab_size > 65536:
        raise TokenizerError(f"vocab_size {vocab_size} does not fit uint16 token shards (at most 65536)")
    spm = _sentencepiece()
    if isinstance(text_files_or_iterator, (str, os.PathLike)):
        text_files_or_iterator = [text_files_or_iterator]
    if isinstance(text_files_or_iterator, (list, tuple)):
        files = [Path(f) for f in text_files_or_iterator]
        missing = [str(f)[:60] for f in files if not f.is_file()]
        if missing or not files:
            raise TokenizerError(
                f"SentencePiece training input: {', '.join(missing[:3]) or 'no files given'}: not found "
                "(pass text files as a list of paths, documents as an iterator of strings)"
            )
        documents = _file_documents(files)
        described = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    else:
        documents = text_files_or_iterator
        described = "the given documents"
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(documents),
            max_sentence_length=MAX_SENTENCE_BYTES,
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            self_test_sample_size=0,
            character_coverage=character_coverage,
            num_threads=num_threads or os.cpu_count() or 1,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as error:
        raise TokenizerError(
            f"SentencePiece could not train a {vocab_size}-piece {model_type} vocabulary on {described}: {error}"
        ) from None
    model_path = Path(f"{os.fspath(output_prefix)}.model")
    atomic_write_bytes(model_path, model.getvalue())
    tokenizer = SentencePieceTokenizer(model_path)
    # The .vocab file is for people reading the vocabulary; only the .model is loaded.
    vocab = "".join(f"{tokenizer.piece(i)}\t{tokenizer._model.get_score(i):g}\n" for i in range(tokenizer.vocab_size))
    atomic_write_bytes(Path(f"{os.fspath(output_prefix)}.vocab"), vocab.encode("utf-8"))
    return tokenizer


def load_tokenizer(path: str | os.PathLike) -> ByteTokenizer | CharTokenizer | SentencePieceTokenizer:
    """Read a tokenizer saved by `save`: `.json` (byte or char) or a SentencePiece `.model`."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix != ".json":
        raise TokenizerError(f"tokenizer file {path}: expected a .json (byte/char) or .model (SentencePiece) file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TokenizerError(f"tokenizer file {path} is not valid JSON: {error}") from None
    payload = parse_json(text, TokenizerError, f"tokenizer file {path} is not valid JSON")
    kind = payload.get("type") if isinstance(payload, dict) else None
    if kind == ByteTokenizer.kind:
        return ByteTokenizer()
    if kind == CharTokenizer.kind:
        if not isinstance(payload.get("chars"), str):
            raise TokenizerError(f"tokenizer file {path}: a char tokenizer needs a string field 'chars'")
        try:
            return CharTokenizer(payload["chars"])
        except TokenizerError as error:
            raise TokenizerError(f"tokenizer file {path}: field 'chars': {error}") from None
    raise TokenizerError(f"tokenizer file {path}: expected 'type' to be 'byte' or 'char', got {kind!r}")
