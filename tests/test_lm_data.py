"""The language-model data layer: tokenizers, uint16 token shards, corpora, TinyStories, `ranvier data`."""

from __future__ import annotations

import json
import math
import re
import tarfile

import numpy as np
import pytest

from ranvier.cli import main
from ranvier.data.corpus import CorpusError, corpus_files, iter_documents, read_corpus, stdlib_dir, unigram_entropy
from ranvier.data.mnist import DatasetError
from ranvier.data.shards import ShardError, TokenShards, pretokenize, write_shard
from ranvier.data.tinystories import (
    ARCHIVE,
    DownloadError,
    download_tinystories,
    iter_stories,
    pretokenize_tinystories,
)
from ranvier.data.tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_tokenizer,
    train_sentencepiece,
)

UNSEEN = "Ωμέγα 日本語 🎉 Straße\n\tX = 42  # two  spaces\n"


@pytest.fixture(scope="module")
def words_corpus() -> list[str]:
    """Lines of lowercase identifiers from stdlib source: 27 distinct characters, so a 300-piece vocabulary fits."""
    words = re.findall(r"[a-z]+", read_corpus(max_bytes=400_000))
    return [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]


@pytest.fixture(scope="module")
def sp300(words_corpus, tmp_path_factory) -> SentencePieceTokenizer:
    return train_sentencepiece(iter(words_corpus), 300, "bpe", tmp_path_factory.mktemp("sp") / "tok300")


def _stories_shard(path, stories: list[str]) -> None:
    """A JSON shard in TinyStories' real format: a list of objects with story, instruction, summary, source."""
    entries = [
        {"story": f"  {story}\n", "instruction": {"prompt:": "Write a short story.", "words": ["dog", "run"], "features": []},
         "summary": story[:20], "source": "GPT-4"}
        for story in stories
    ]
    path.write_text(json.dumps(entries), encoding="utf-8")


STORIES = [
    "once upon a time there was a little dog named tom. tom liked to run in the park.",
    "lily saw a big red ball. she kicked the ball and it flew over the tree. lily laughed.",
    "the sun was hot, so the cat slept under the tree all day long.",
]


# Tokenizers -------------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_specials(tmp_path):
    tok = ByteTokenizer()
    text = "héllo, 世界 🎉"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257 and tok.vocab_size == 258
    assert ids[1:-1] == list(text.encode("utf-8"))
    assert tok.encode(text, bos=False) == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    tok.save(tmp_path / "tok.json")
    assert isinstance(load_tokenizer(tmp_path / "tok.json"), ByteTokenizer)
    with pytest.raises(TokenizerError, match="id 300"):
        tok.decode([65, 300])


def test_char_tokenizer_round_trip_save_load(tmp_path):
    corpus = "the quick brown fox — jumps über 🦊\n"
    tok = CharTokenizer.from_text(corpus)
    assert tok.vocab_size == len(set(corpus)) + 2 and (tok.bos_id, tok.eos_id) == (tok.vocab_size - 2, tok.vocab_size - 1)
    ids = tok.encode("über fox 🦊", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids) == "über fox 🦊"
    tok.save(tmp_path / "chars.json")
    loaded = load_tokenizer(tmp_path / "chars.json")
    assert isinstance(loaded, CharTokenizer) and loaded.chars == tok.chars and loaded.encode(corpus) == tok.encode(corpus)
    with pytest.raises(TokenizerError, match="'Z'"):
        tok.encode("Zebra")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "tok.txt").write_text("x")
    with pytest.raises(TokenizerError, match=r"expected a \.json"):
        load_tokenizer(tmp_path / "tok.txt")
    (tmp_path / "bad.json").write_text('{"type": "wordpiece"}')
    with pytest.raises(TokenizerError, match="'wordpiece'"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")


def test_sentencepiece_round_trip_and_byte_fallback(sp300, tmp_path):
    assert sp300.vocab_size == 300 and (sp300.unk_id, sp300.bos_id, sp300.eos_id) == (0, 1, 2)
    assert sp300.path.suffix == ".model" and sp300.path.with_suffix(".vocab").is_file()
    text = "def read corpus files with the tokenizer"
    ids = sp300.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and sp300.decode(ids) == text
    assert len(ids) - 2 < len(text)  # merges learned from the corpus make it shorter than one token per character
    # Characters never seen in training (uppercase, digits, tabs, non-Latin, emoji) fall back to byte pieces.
    unseen_ids = sp300.encode(UNSEEN, bos=False)
    assert sp300.unk_id not in unseen_ids
    assert sp300.decode(unseen_ids) == UNSEEN
    assert "<0xF0>" in {sp300.piece(i) for i in unseen_ids}  # the emoji's first UTF-8 byte
    sp300.save(tmp_path / "copy.model")
    loaded = load_tokenizer(tmp_path / "copy.model")
    assert isinstance(loaded, SentencePieceTokenizer) and loaded.encode(UNSEEN) == sp300.encode(UNSEEN)


def test_sentencepiece_unigram_from_files(words_corpus, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(words_corpus), encoding="utf-8")
    tok = train_sentencepiece([corpus], 320, model_type="unigram", output_prefix=tmp_path / "uni")
    assert tok.vocab_size == 320 and tok.decode(tok.encode(UNSEEN)) == UNSEEN


def test_sentencepiece_errors(tmp_path):
    with pytest.raises(TokenizerError, match="Vocabulary size is smaller than required_chars"):
        train_sentencepiece(iter([read_corpus(max_bytes=200_000)]), 260, output_prefix=tmp_path / "small")
    with pytest.raises(TokenizerError, match="not found"):
        train_sentencepiece([tmp_path / "missing.txt"], 300, output_prefix=tmp_path / "x")
    with pytest.raises(TokenizerError, match="model_type"):
        train_sentencepiece(iter(["a"]), 300, model_type="wordpiece", output_prefix=tmp_path / "x")
    assert not list(tmp_path.glob("*.model"))


# Shards -----------------------------------------------------------------------------------------------------


def test_shard_round_trip_through_memmap(tmp_path):
    tokens = np.array([0, 1, 255, 256, 65535, 7], dtype=np.int64)
    assert write_shard(tmp_path / "a.bin", tokens) == 6
    assert (tmp_path / "a.bin").read_bytes() == tokens.astype("<u2").tobytes()  # headerless little-endian uint16
    shards = TokenShards(tmp_path / "a.bin")
    assert isinstance(shards.shards[0], np.memmap) and len(shards) == 6
    np.testing.assert_array_equal(shards.shards[0], tokens)
    for bad in (65536, -1):
        with pytest.raises(ShardError, match=f"token id {bad} at position 1"):
            write_shard(tmp_path / "b.bin", [3, bad])
    with pytest.raises(ShardError, match="non-empty"):
        write_shard(tmp_path / "b.bin", [])
    assert not (tmp_path / "b.bin").exists()


def test_corrupt_and_empty_shards(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ShardError, match="3 bytes, an odd count"):
        TokenShards(tmp_path / "odd.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ShardError, match="is empty"):
        TokenShards([tmp_path / "empty.bin"])
    with pytest.raises(ShardError, match="does not exist"):
        TokenShards(tmp_path / "none")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ShardError, match="no .bin"):
        TokenShards(tmp_path / "sub")


@pytest.fixture
def two_shards(tmp_path) -> TokenShards:
    """Consecutive ids, so a window's position is its first token; shard 2 continues the numbering of shard 1."""
    write_shard(tmp_path / "data1.bin", np.arange(0, 1000))
    write_shard(tmp_path / "data2.bin", np.arange(1000, 1300))
    return TokenShards(tmp_path)


def test_sample_windows_reproducible_shifted_and_inside(two_shards):
    x, y = two_shards.sample(64, 32, np.random.default_rng(7))
    x2, y2 = two_shards.sample(64, 32, np.random.default_rng(7))
    assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (64, 32)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(x, two_shards.sample(64, 32, np.random.default_rng(8))[0])
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(y, x + 1)  # consecutive ids: each window is one contiguous run, never across shards
    first, last = x[:, 0], y[:, -1]
    assert ((last < 1000) | (first >= 1000)).all() and first.min() >= 0 and last.max() <= 1299
    many, _ = two_shards.sample(4000, 32, np.random.default_rng(0))
    assert 0.15 < (many[:, 0] >= 1000).mean() < 0.25  # shards drawn in proportion to their windows (268 of 1236)
    with pytest.raises(ShardError, match="1001 tokens"):
        two_shards.sample(1, 1000, np.random.default_rng(0))


def test_split_and_validate(two_shards):
    train, val = two_shards.split(shards=1)
    assert (len(train), len(val)) == (1000, 300)
    train, val = two_shards.split(fraction=0.25)
    assert (len(train), len(val)) == (975, 325)
    assert int(val.shards[0][0]) == 975 and int(train.shards[-1][-1]) == 974
    assert val.sample(2, 8, np.random.default_rng(0))[0].min() >= 975
    with pytest.raises(ShardError, match="exactly one"):
        two_shards.split()
    with pytest.raises(ShardError, match="cannot hold out 2"):
        two_shards.split(shards=2)
    two_shards.validate(1300)
    with pytest.raises(ShardError, match="id 1000 at token 0 is outside the tokenizer's vocabulary of 1000"):
        two_shards.validate(1000)


def test_pretokenize_shards_manifest_and_bos(tmp_path):
    tok = ByteTokenizer()
    docs = ["first document", "", "zweites Dokument ü", "third"]
    manifest = pretokenize(iter(docs), tok, tmp_path / "out", shard_tokens=16)
    stream = [i for d in docs if d for i in tok.encode(d)]
    assert [s["file"] for s in manifest["shards"]] == ["data00.bin", "data01.bin", "data02.bin"]
    assert [s["tokens"] for s in manifest["shards"]] == [16, 16, len(stream) - 32]
    assert manifest["documents"] == 3 and manifest["tokens"] == len(stream)
    assert manifest["tokenizer"] == {"kind": "byte", "file": "tokenizer.json", "vocab_size": 258, "bos_id": 256, "eos_id": 257}
    assert manifest["unigram_entropy"] == pytest.approx(unigram_entropy(stream))
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    shards = TokenShards(tmp_path / "out")
    read = np.concatenate([np.asarray(s) for s in shards.shards]).tolist()
    assert read == stream and read.count(256) == 3
    assert load_tokenizer(tmp_path / "out" / "tokenizer.json").decode(read) == "first documentzweites Dokument üthird"
    shards.validate(258)
    with pytest.raises(ShardError, match="already holds .bin shards"):
        pretokenize(iter(docs), tok, tmp_path / "out")


# Corpus -----------------------------------------------------------------------------------------------------


def test_stdlib_corpus_found():
    files = corpus_files()
    root = stdlib_dir()
    relative = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100 and "os.py" in relative and relative == sorted(relative)
    assert not any(part in ("test", "tests", "site-packages") for f in relative for part in f.split("/")[:-1])
    capped = [len(d.encode("utf-8")) for d in iter_documents(max_bytes=50_000)]
    assert 49_990 < sum(capped) <= 50_000 and "def " in read_corpus(max_bytes=50_000)
    assert next(iter_documents()) == files[0].read_text(encoding="utf-8")


def test_folder_corpus(tmp_path):
    (tmp_path / "b.md").write_text("# bee\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("ay ü\n", encoding="utf-8")
    (tmp_path / "c.bin").write_bytes(b"\xff")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_text("hidden")
    assert read_corpus(tmp_path) == "ay ü\n\n# bee\n"
    assert read_corpus(tmp_path / "b.md") == "# bee\n"
    assert read_corpus(tmp_path, max_bytes=4) == "ay "  # the cap never splits a character
    (tmp_path / "d.txt").write_bytes(b"caf\xe9")
    with pytest.raises(CorpusError, match="d.txt is not UTF-8"):
        read_corpus(tmp_path)
    with pytest.raises(CorpusError, match="does not exist"):
        read_corpus(tmp_path / "nowhere")


def test_unigram_entropy():
    assert unigram_entropy([0, 1, 2, 3] * 5) == pytest.approx(math.log(4))
    p = np.array([0.5, 0.25, 0.25])
    assert unigram_entropy(np.array([0, 0, 1, 2], dtype=np.uint16)) == pytest.approx(-(p * np.log(p)).sum())
    assert unigram_entropy([7, 7, 7]) == 0.0
    with pytest.raises(CorpusError, match="empty"):
        unigram_entropy([])


# TinyStories ------------------------------------------------------------------------------------------------


def test_iter_stories_and_pretokenize(tmp_path):
    _stories_shard(tmp_path / "data00.json", STORIES[:2])
    _stories_shard(tmp_path / "data01.json", STORIES[2:])
    assert list(iter_stories(tmp_path)) == STORIES  # stripped, in shard order
    assert list(iter_stories([tmp_path / "data01.json"])) == STORIES[2:]
    tok = ByteTokenizer()
    manifest = pretokenize_tinystories(tmp_path, tok, tmp_path / "tok")
    assert manifest["documents"] == 3 and manifest["tokens"] == sum(len(s.encode()) + 1 for s in STORIES)
    data = np.fromfile(tmp_path / "tok" / "data00.bin", dtype="<u2")
    assert data[0] == tok.bos_id and tok.decode(data[1 : 1 + len(STORIES[0])]) == STORIES[0]
    (tmp_path / "bad.json").write_text('[{"text": "no story"}]')
    with pytest.raises(DatasetError, match="entry 0"):
        list(iter_stories(tmp_path / "bad.json"))
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(DatasetError, match="not valid JSON"):
        list(iter_stories(tmp_path / "bad.json"))


def test_download_from_local_archive(tmp_path):
    """The download path end to end against a file:// URL: no network is touched."""
    shards = tmp_path / "src"
    shards.mkdir()
    _stories_shard(shards / "data00.json", STORIES)
    archive = tmp_path / "archive.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(shards / "data00.json", arcname="data00.json")
    dest = tmp_path / "dest"
    json_dir = download_tinystories(dest, url=archive.as_uri(), progress=False)
    assert (dest / ARCHIVE).read_bytes() == archive.read_bytes()
    assert list(iter_stories(json_dir)) == STORIES
    assert download_tinystories(dest, url="file:///nonexistent", progress=False) == json_dir  # done: nothing fetched
    with pytest.raises(DownloadError, match="could not download file:.*nonexistent.*--json-dir"):
        download_tinystories(tmp_path / "other", url=(tmp_path / "nonexistent").as_uri(), progress=False)
    assert not (tmp_path / "other" / ARCHIVE).exists()


def test_download_corrupt_archive(tmp_path):
    (tmp_path / ARCHIVE).write_bytes(b"this is not gzip")
    with pytest.raises(DownloadError, match="not a readable .tar.gz"):
        download_tinystories(tmp_path, progress=False)


# CLI --------------------------------------------------------------------------------------------------------


def test_cli_data_tinystories(tmp_path, capsys):
    json_dir = tmp_path / "json"
    json_dir.mkdir()
    _stories_shard(json_dir / "data00.json", STORIES * 40)
    dest = tmp_path / "ts"
    assert main(["data", "tinystories", "--json-dir", str(json_dir), "--dest", str(dest), "--vocab-size", "300"]) == 0
    assert "nats/token" in capsys.readouterr().out
    tok = load_tokenizer(dest / "tok300.model")
    shards = TokenShards(dest / "tok300")
    shards.validate(tok.vocab_size)
    data = np.asarray(shards.shards[0])
    assert data[0] == tok.bos_id and np.count_nonzero(data == tok.bos_id) == 120
    assert tok.decode(data[: np.flatnonzero(data == tok.bos_id)[1]]) == STORIES[0]
    assert json.loads((dest / "tok300" / "manifest.json").read_text())["tokenizer"]["file"] == "tokenizer.model"
    assert main(["data", "tinystories", "--json-dir", str(json_dir), "--dest", str(tmp_path / "b"), "--tokenizer",
                 str(dest / "tok300.model")]) == 0
    np.testing.assert_array_equal(np.fromfile(tmp_path / "b" / "tok300" / "data00.bin", dtype="<u2"), data)


def test_cli_data_pretokenize_a_corpus_without_newlines(tmp_path, capsys):
    """SentencePiece skips sentences over 4,192 bytes: a corpus of one long line trained on
    nothing and failed with "!sentences_.empty()". Long lines now come in pieces."""
    corpus = tmp_path / "one-line.txt"
    corpus.write_text(" ".join(STORIES * 60), encoding="utf-8")
    assert main(["data", "pretokenize", str(corpus), "--out", str(tmp_path / "sp"), "--vocab-size", "300"]) == 0
    tok = load_tokenizer(tmp_path / "sp" / "tokenizer.model")
    assert tok.vocab_size == 300 and len(TokenShards(tmp_path / "sp")) < 0.8 * len(corpus.read_text())  # merges were learned
    assert tok.decode(tok.encode(corpus.read_text())) == corpus.read_text()


@pytest.mark.parametrize("line", ["word " * 3000, "é" * 5000 + " x", "日本語" * 2000], ids=["spaces", "one long word", "no spaces"])
def test_long_lines_reach_sentencepiece_in_pieces(line, tmp_path):
    from ranvier.data.tokenizers import MAX_SENTENCE_BYTES, _sentences

    pieces = list(_sentences([line]))
    assert "".join(pieces) == line.rstrip() or "".join(pieces) == line
    assert all(0 < len(piece.encode()) <= MAX_SENTENCE_BYTES for piece in pieces)
    (tmp_path / "line.txt").write_text(line, encoding="utf-8")
    assert train_sentencepiece([tmp_path / "line.txt"], 270, output_prefix=tmp_path / "tok").vocab_size == 270


def test_cli_data_pretokenize(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "one.txt").write_text(" ".join(STORIES * 30), encoding="utf-8")
    (corpus / "two.md").write_text("\n".join(STORIES[::-1] * 30), encoding="utf-8")
    assert main(["data", "pretokenize", str(corpus), "--out", str(tmp_path / "sp"), "--vocab-size", "300"]) == 0
    tok = load_tokenizer(tmp_path / "sp" / "tokenizer.model")
    shards = TokenShards(tmp_path / "sp")
    shards.validate(300)
    characters = sum(len(f.read_text(encoding="utf-8")) for f in corpus.iterdir())
    assert tok.vocab_size == 300 and len(shards) < 0.8 * characters  # merges were learned
    assert main(["data", "pretokenize", "--out", str(tmp_path / "std"), "--max-bytes", "20000", "--bytes"]) == 0
    manifest = json.loads((tmp_path / "std" / "manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "byte" and manifest["tokens"] == 20000 + manifest["documents"]
    assert 2.0 < manifest["unigram_entropy"] < math.log(258)
    out = capsys.readouterr().out
    assert "wrote" in out and "data00.bin" in out
    with pytest.raises(SystemExit):
        main(["data", "pretokenize", "--out", str(tmp_path / "x"), "--bytes", "--vocab-size", "300"])
