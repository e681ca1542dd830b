"""Fuzzed file readers: llama2.c checkpoints and tokenizer.bin (encoding and decoding with
it too), SentencePiece models (the same), Hugging Face folders (config.json, safetensors
files, the shard index), ranvier checkpoints (with the batch samplers' states a resume
restores), a run's config.json, token shards with their manifest, tokenizer .json files and
MNIST IDX files, plain and gzipped. (The .flow reader has its own fuzz test,
test_flowfile_fuzz.py.)

Each reader gets a valid input made by ranvier's own writers (or, for IDX, by the format's
few bytes), then garbage and wrong magic, the files cut short at many points, headers that
claim huge sizes, and seeded random mutations for a time budget. Every input must load or
raise a RanvierError that names the file at fault: never another exception, a hang, or an
allocation beyond what the input's size warrants (watched as fuzzing.py says).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from fuzzing import within
from safetensors.numpy import load_file, save_file

from ranvier.data import mnist
from ranvier.data.batches import BatchSampler
from ranvier.data.shards import MANIFEST, TokenShards, pretokenize
from ranvier.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer, train_sentencepiece
from ranvier.interop import (
    Llama2cTokenizer,
    export_hf,
    export_llama2c,
    import_hf,
    import_llama2c,
    import_tokenizer_bin,
    weight_shapes,
)
from ranvier.jobs import rundir
from ranvier.jobs.llama import restore_sampler_rng
from ranvier.jobs.mnist import MnistConfig
from ranvier.jobs.mnist import read_config as read_mnist_config
from ranvier.models.llama import LlamaConfig
from ranvier.models.moe import MoEConfig
from ranvier.train.checkpoint import METADATA, load_checkpoint, read_metadata, save_checkpoint
from ranvier.train.runs import LlamaRunConfig, read_run

SEED = 19
BUDGET_S = 1.5  # each reader's mutation loop runs this long ...
MIN_CASES = 100  # ... and at least this many cases, however slow the machine
# Mutation cases in one run on 2 cores (the file took 24 s): llama2c-v0 588, llama2c-v1 869,
# tokenizer.bin 1,176, hf 495, hf-sharded 279, checkpoint 1,244, shards 819, tokenizer.json
# 2,628, idx 2,504, idx.gz 1,577. Each run records its own as the fuzz_cases property of
# test_mutated (pytest --junitxml=... -o junit_family=xunit1).
CASE_TIMEOUT_S = 5.0  # a read still running after this has hung
# A read may hold a few copies of its input (the bytes read, the arrays, transposed or widened
# copies) and some bookkeeping; a header claiming a huge tensor asks for far more than either.
MEMORY_FACTOR = 8
MEMORY_SLACK = 1 << 20


# ---- the readers and their valid inputs --------------------------------------------------------

LLAMA = LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=37, hidden_dim=24, max_seq_len=12)
UNSHARED = replace(LLAMA, shared_classifier=False)
MOE = MoEConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=29, hidden_dim=8, max_seq_len=8,
                n_experts=3, top_k=2)
HF_INDEX = "model.safetensors.index.json"
SHARD = {"path": "/data/shards/data00.bin", "bytes": 4096, "mtime_ns": 1_700_000_000_000_000_000}


def random_weights(config: LlamaConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {k: rng.normal(0, 0.3, size=s).astype(np.float32) for k, s in weight_shapes(config).items()}


@dataclass
class Reader:
    """A reader under test. `make` writes a valid input into a folder and returns what `read`
    takes and the files it reads; `lenient` readers take some garbage and some prefixes of
    their files as valid inputs (a shard is any even number of bytes; tokenizer.bin has no
    token count, so it can end after any token)."""

    make: Callable[[Path], tuple[Path, list[Path]]]
    read: Callable[[Path], object]
    lenient: bool = False
    # The files to rewrite along with a mutated one so the input stays consistent (a
    # checkpoint.json with the SHA-256 of mutated weights), for mutations to get past a checksum.
    reseal: Callable[[Path, bytes, dict[Path, bytes]], dict[Path, bytes]] | None = None


def make_llama2c(config: LlamaConfig, version: int) -> Callable[[Path], tuple[Path, list[Path]]]:
    def make(folder: Path) -> tuple[Path, list[Path]]:
        path = export_llama2c(config, random_weights(config), folder / "model.bin", version)
        return path, [path]
    return make


def make_tokenizer_bin(folder: Path) -> tuple[Path, list[Path]]:
    """llama2.c's layout: <unk>, BOS, EOS, the 256 byte tokens, then merged pieces."""
    rng = random.Random(SEED)
    tokens = [b"<unk>", b"\n<s>\n", b"\n</s>\n", *(f"<0x{byte:02X}>".encode() for byte in range(256)),
              *(rng.randbytes(rng.randint(1, 6)) for _ in range(60))]
    path = folder / "tokenizer.bin"
    Llama2cTokenizer(tokens, [rng.uniform(-10, 0) for _ in tokens]).save(path)
    return path, [path]


TEXT = "hé wörld ✓ \x00 🙂"  # ASCII, 2-, 3- and 4-byte characters, a NUL


def read_tokenizer_bin(path: Path) -> None:
    tokenizer = import_tokenizer_bin(path)
    tokenizer.decode(tokenizer.encode(TEXT, bos=True, eos=True))


def make_sentencepiece(folder: Path) -> tuple[Path, list[Path]]:
    texts = ["the quick brown fox jumps over the lazy dog", "hé wörld ✓ 123 456"] * 8
    tokenizer = train_sentencepiece(iter(texts), 300, output_prefix=folder / "tokenizer", num_threads=1)
    return tokenizer.path, [tokenizer.path]


def read_sentencepiece(path: Path) -> None:
    tokenizer = load_tokenizer(path)
    tokenizer.decode(tokenizer.encode(TEXT, bos=True, eos=True))
    tokenizer.decode(range(tokenizer.vocab_size))


def make_hf(folder: Path) -> tuple[Path, list[Path]]:
    export_hf(UNSHARED, random_weights(UNSHARED), folder)
    return folder, [folder / "config.json", folder / "model.safetensors"]


def make_hf_sharded(folder: Path) -> tuple[Path, list[Path]]:
    """A Mixtral in two shards, one float16 and one bfloat16, with their index."""
    export_hf(MOE, random_weights(MOE), folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for (file, keys), dtype in zip(shards.items(), (np.float16, ml_dtypes.bfloat16)):
        save_file({k: state[k].astype(dtype) for k in keys}, folder / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / HF_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, [folder / "config.json", folder / HF_INDEX, *(folder / file for file in shards)]


def make_checkpoint(folder: Path) -> tuple[Path, list[Path]]:
    rng = np.random.default_rng(SEED)
    arrays = {"mlp/W0": rng.standard_normal((8, 6)).astype(np.float32),
              "mlp/b0": rng.standard_normal(6).astype(ml_dtypes.bfloat16),
              "adam/t": np.array(3, np.int64), "mask": rng.random((2, 3)) < 0.5}
    samplers = {"sampler": BatchSampler(100, 10, seed=4, epoch=2, position=30).state(),
                "rng": np.random.default_rng(SEED).bit_generator.state}
    path = save_checkpoint(folder / "checkpoint", arrays, {"step": 3, "schedule": {"kind": "constant", "lr": 0.01}, **samplers})
    return path, [path / METADATA, *path.glob("weights-*.safetensors")]


def reseal_checkpoint(file: Path, data: bytes, pristine: dict[Path, bytes]) -> dict[Path, bytes]:
    if file.name == METADATA:
        return {}
    metadata = file.parent / METADATA
    return {metadata: in_json("sha256", value=hashlib.sha256(data).hexdigest())(pristine[metadata])}


def read_checkpoint(path: Path) -> None:
    """The weights, and the batch samplers' states that resuming a run restores."""
    metadata = read_metadata(path)
    load_checkpoint(path)
    BatchSampler(100, 10).restore(metadata.get("sampler"), str(path / METADATA))
    restore_sampler_rng(np.random.default_rng(), metadata.get("rng"), path / METADATA)


def make_run_config(kind: str, config) -> Callable[[Path], tuple[Path, list[Path]]]:
    def make(folder: Path) -> tuple[Path, list[Path]]:
        run = folder / "run"
        run.mkdir()
        rundir.write_config(run, kind, config)
        return run, [run / "config.json"]
    return make


def make_shards(folder: Path) -> tuple[Path, list[Path]]:
    rng = random.Random(SEED)
    texts = ["".join(rng.choice("ab xé✓\n") for _ in range(rng.randint(0, 90))) for _ in range(12)]
    path = folder / "shards"
    pretokenize(texts, ByteTokenizer(), path, shard_tokens=300)
    return path, [path / MANIFEST, *sorted(path.glob("*.bin"))]


def read_shards(path: Path) -> None:
    TokenShards(path).validate(ByteTokenizer.vocab_size)


def make_tokenizer_json(folder: Path) -> tuple[Path, list[Path]]:
    path = folder / "tokenizer.json"
    CharTokenizer.from_text("hello wörld ✓ 123").save(path)
    return path, [path]


def idx_bytes(array: np.ndarray) -> bytes:
    """A uint8 array as an IDX file (type code 0x08)."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def make_idx(compress: bool) -> Callable[[Path], tuple[Path, list[Path]]]:
    def make(folder: Path) -> tuple[Path, list[Path]]:
        images = np.random.default_rng(SEED).integers(0, 256, (6, 28, 28), dtype=np.uint8)
        path = folder / ("images-idx3-ubyte.gz" if compress else "images-idx3-ubyte")
        path.write_bytes(gzip.compress(idx_bytes(images)) if compress else idx_bytes(images))
        return path, [path]
    return make


READERS = {
    "llama2c-v0": Reader(make_llama2c(LLAMA, 0), import_llama2c),
    "llama2c-v1": Reader(make_llama2c(UNSHARED, 1), import_llama2c),
    "tokenizer.bin": Reader(make_tokenizer_bin, read_tokenizer_bin, lenient=True),
    "sentencepiece": Reader(make_sentencepiece, read_sentencepiece),
    "hf": Reader(make_hf, import_hf),
    "hf-sharded": Reader(make_hf_sharded, import_hf),
    "checkpoint": Reader(make_checkpoint, read_checkpoint, reseal=reseal_checkpoint),
    "mnist config.json": Reader(make_run_config("mnist", MnistConfig()), read_mnist_config),
    "llama config.json": Reader(make_run_config("llama", LlamaRunConfig(shards=[SHARD])), read_run),
    "shards": Reader(make_shards, read_shards, lenient=True),
    "tokenizer.json": Reader(make_tokenizer_json, load_tokenizer),
    "idx": Reader(make_idx(False), mnist.read_idx),
    "idx.gz": Reader(make_idx(True), mnist.read_idx),
}


# ---- reading under watch ------------------------------------------------------------------------


def attempt(read: Callable[[Path], object], path: Path, culprit: Path, limit: int, label: str,
            timeout: float = CASE_TIMEOUT_S) -> str | None:
    """Read under the watch (fuzzing.within): the error's message when the input is refused,
    None when it loads. Also fails on a message that does not name the culprit file."""
    error = within(lambda: read(path), limit, timeout, label)
    if error is None:
        return None
    assert culprit.name in str(error), f"{label}: the error does not name {culprit.name}: {error}"
    return str(error)


def write(file: Path, data: bytes) -> None:
    # A new file, not the old one truncated: ext4 flushes a file truncated and rewritten to disk
    # on close (auto_da_alloc), which made each case forty times slower.
    file.unlink()
    file.write_bytes(data)


@dataclass
class Subject:
    """A reader with its valid input on disk, to read with some of its files replaced."""

    reader: Reader
    path: Path
    pristine: dict[Path, bytes]

    @property
    def limit(self) -> int:
        unpacked = sum(len(gzip.decompress(data)) if file.suffix == ".gz" else len(data)
                       for file, data in self.pristine.items())
        return MEMORY_FACTOR * unpacked + MEMORY_SLACK

    def file(self, name: str) -> Path:
        return next(file for file in self.pristine if file.name == name)

    def attempt(self, file: Path, data: bytes, label: str, reseal: bool = False) -> str | None:
        """Read with `file` holding `data` (and, with `reseal`, the files the reader's reseal
        rewrites to match); the files are restored afterwards."""
        changes = {file: data, **(self.reader.reseal(file, data, self.pristine) if reseal and self.reader.reseal else {})}
        for changed, content in changes.items():
            write(changed, content)
        try:
            return attempt(self.reader.read, self.path, file, self.limit, f"{file.name}, {label}")
        finally:
            for changed in changes:
                write(changed, self.pristine[changed])


def make_subject(name: str, folder: Path) -> Subject:
    reader = READERS[name]
    path, files = reader.make(folder)
    subject = Subject(reader, path, {file: file.read_bytes() for file in files})
    assert attempt(reader.read, path, files[0], subject.limit, f"{name}: the valid input") is None
    return subject


@pytest.fixture(params=list(READERS))
def subject(request, tmp_path, watched) -> Subject:
    return make_subject(request.param, tmp_path)


# ---- mutations ----------------------------------------------------------------------------------

INTERESTING = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1)
ODD_JSON = (None, True, False, 0, -1, 2**31 - 1, 2**63, 1e300, -0.5, float("nan"), "", "x", "../x", [], [1, -1], {},
            {"a": None})
Mutation = Callable[[random.Random, bytes], tuple[bytes, list[str]]]


def mutate(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    """One to four edits: bit flips, random bytes, an interesting number written over, bytes
    inserted or deleted; half of them near the start, where the headers are."""
    out = bytearray(data)
    edits = []
    for _ in range(rng.randint(1, 4)):
        at = min(int(rng.expovariate(1 / 48)) if rng.random() < 0.5 else rng.randrange(len(out) + 1), len(out))
        kind = rng.randrange(5)
        if kind == 0 and at < len(out):
            bit = rng.randrange(8)
            out[at] ^= 1 << bit
            edits.append(f"flip bit {bit} of byte {at}")
        elif kind == 1:
            width, order = rng.choice((1, 2, 4, 8)), rng.choice(("little", "big"))
            value = rng.choice(INTERESTING) & ((1 << 8 * width) - 1)
            out[at:at + width] = value.to_bytes(width, order)
            edits.append(f"write {value:#x} ({width} bytes, {order}-endian) at {at}")
        elif kind == 2:
            inserted = rng.randbytes(rng.randint(1, 8))
            out[at:at] = inserted
            edits.append(f"insert {inserted.hex()} at {at}")
        elif kind == 3:
            count = rng.randint(1, 8)
            del out[at:at + count]
            edits.append(f"delete {count} at {at}")
        elif at < len(out):
            out[at] = rng.randrange(256)
            edits.append(f"set byte {at} to {out[at]}")
    return bytes(out), edits


def json_spots(node: object) -> Iterator[tuple[dict | list, object]]:
    """Every (container, key) in a JSON document."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in list(items):
        yield node, key
        yield from json_spots(child)


def mutate_json(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    """A JSON document with one value replaced by an odd one, or one key dropped or renamed."""
    document = json.loads(data)
    container, key = rng.choice(list(json_spots(document)))
    kind = rng.random()
    if kind < 0.15 and isinstance(container, dict):
        del container[key]
        edit = f"drop {key!r}"
    elif kind < 0.3 and isinstance(container, dict):
        container[f"{key}x"] = container.pop(key)
        edit = f"rename {key!r}"
    else:
        container[key] = rng.choice(ODD_JSON)
        edit = f"{key!r} = {container[key]!r}"
    return json.dumps(document).encode(), [edit]


def mutate_safetensors_header(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    """The JSON header mutated, its length field kept right."""
    length = int.from_bytes(data[:8], "little")
    header, edits = mutate_json(rng, data[8:8 + length])
    return len(header).to_bytes(8, "little") + header + data[8 + length:], edits


def mutate_gzipped(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    """The unpacked contents mutated and packed again."""
    inner, edits = mutate(rng, gzip.decompress(data))
    return gzip.compress(inner, mtime=0), edits


# Half the mutations know their file's structure, so they get past the first parse.
STRUCTURED: dict[str, Mutation] = {".json": mutate_json, ".safetensors": mutate_safetensors_header,
                                   ".gz": mutate_gzipped}


def garbage(rng: random.Random, data: bytes, is_json: bool) -> dict[str, bytes]:
    inputs = {"empty": b"", "zeros": bytes(len(data)), "random bytes": rng.randbytes(len(data)),
              "a zip's magic": b"PK\x03\x04" + data[4:], "a few bytes": data[:3]}
    if is_json:
        inputs |= {"deep nesting": b"[" * 100_000, "not UTF-8": b'{"\xff": 1}', "a list": b"[]", "null": b"null",
                   "a string": b'"text"', "an object": b'{"a": {}}'}
    return inputs


# ---- the tests ----------------------------------------------------------------------------------


def test_garbage_and_wrong_magic(subject):
    rng = random.Random(SEED)
    for file, data in subject.pristine.items():
        for label, bad in garbage(rng, data, file.suffix == ".json").items():
            refused = subject.attempt(file, bad, label)
            assert refused or subject.reader.lenient, f"{file.name}: {label} loaded"


def test_truncated(subject):
    """Every cut in the first 64 bytes of each file, where the headers are, and 48 beyond."""
    rng = random.Random(SEED)
    for file, data in subject.pristine.items():
        for cut in sorted({*range(min(len(data), 64)), *(rng.randrange(len(data)) for _ in range(48))}):
            refused = subject.attempt(file, data[:cut], f"cut at {cut} of {len(data)}")
            # A JSON file that lost only its trailing whitespace is the same document.
            same = file.suffix == ".json" and not data[cut:].strip()
            assert refused or same or subject.reader.lenient, f"{file.name} cut at {cut} of {len(data)} loaded"


def test_mutated(subject, request):
    """Seeded random mutations for BUDGET_S: each loads or is refused with a RanvierError."""
    rng = random.Random(SEED)
    files = list(subject.pristine)
    cases = refused = 0
    start = time.perf_counter()
    while cases < MIN_CASES or time.perf_counter() - start < BUDGET_S:
        file = rng.choice(files)
        structured = STRUCTURED.get(file.suffix)
        mutation = structured if structured and rng.random() < 0.5 else mutate
        data, edits = mutation(rng, subject.pristine[file])
        label = f"case {cases} (seed {SEED}): {'; '.join(edits)}"
        refused += subject.attempt(file, data, label, reseal=rng.random() < 0.5) is not None
        cases += 1
    request.node.user_properties.append(("fuzz_cases", cases))  # in a --junitxml report (junit_family=xunit1)
    assert refused > cases // 10  # the mutations reach the readers' checks, not only the data


# ---- headers that claim huge sizes --------------------------------------------------------------


def packed(offset: int, layout: str, *values: int) -> Callable[[bytes], bytes]:
    """An edit: `values` packed with struct `layout` over the bytes at `offset`."""
    return lambda data: data[:offset] + struct.pack(layout, *values) + data[offset + struct.calcsize(layout):]


def in_json(*keys: str | int, value: object) -> Callable[[bytes], bytes]:
    """An edit: the JSON value at `keys` set to `value`."""

    def edit(data: bytes) -> bytes:
        document = json.loads(data)
        node = document
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
        return json.dumps(document).encode()
    return edit


def in_safetensors_header(*keys: str, value: object) -> Callable[[bytes], bytes]:
    """An edit: a value in a safetensors file's JSON header set, its length field kept right."""

    def edit(data: bytes) -> bytes:
        length = int.from_bytes(data[:8], "little")
        header = in_json(*keys, value=value)(data[8:8 + length])
        return len(header).to_bytes(8, "little") + header + data[8 + length:]
    return edit


def gzipped(inner: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    return lambda data: gzip.compress(inner(gzip.decompress(data)), mtime=0)


BIG = 2**31 - 1
LLAMA2C_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")
HF_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
CHECKPOINT_WEIGHTS = "weights-00000003.safetensors"
# (reader, file, edit, words the error must hold besides the file's name)
OVERSIZED = [
    *(("llama2c-v0", "model.bin", packed(4 * i, "<i", BIG), field) for i, field in enumerate(LLAMA2C_FIELDS)),
    *(("llama2c-v1", "model.bin", packed(8 + 4 * i, "<i", BIG), field) for i, field in enumerate(LLAMA2C_FIELDS)
      if field != "max_seq_len"),  # a version-1 file holds no RoPE tables: max_seq_len sizes nothing in it
    ("tokenizer.bin", "tokenizer.bin", packed(0, "<I", 2**32 - 1), "max_token_length"),
    ("tokenizer.bin", "tokenizer.bin", packed(8, "<I", 2**32 - 1), "token 0 claims"),
    ("hf", "model.safetensors", packed(0, "<Q", 2**64 - 1), "header length"),
    ("hf", "model.safetensors", in_safetensors_header("model.norm.weight", "shape", value=[BIG, BIG]), "shape"),
    ("hf", "model.safetensors", in_safetensors_header("model.norm.weight", "data_offsets", value=[0, 2**62]),
     "data_offsets"),
    *(("hf", "config.json", in_json(key, value=2**31), key) for key in HF_SIZES),
    ("hf-sharded", "config.json", in_json("num_local_experts", value=2**31), "num_local_experts"),
    ("hf-sharded", "config.json", in_json("num_hidden_layers", value=2**31), "num_hidden_layers"),
    ("checkpoint", METADATA, in_json("arrays", "mlp/W0", "shape", value=[BIG, BIG]), "mlp/W0"),
    ("checkpoint", CHECKPOINT_WEIGHTS, packed(0, "<Q", 2**64 - 1), "header length"),
    ("checkpoint", CHECKPOINT_WEIGHTS, in_safetensors_header("mlp/W0", "shape", value=[BIG, BIG]), "shape"),
    ("shards", MANIFEST, in_json("shards", 0, "tokens", value=2**62), "tokens"),
    ("idx", "images-idx3-ubyte", packed(4, ">3I", *[2**32 - 1] * 3), "shape"),
    ("idx.gz", "images-idx3-ubyte.gz", gzipped(packed(4, ">3I", *[2**32 - 1] * 3)), "shape"),
]


@pytest.mark.parametrize(("name", "file", "edit", "field"), OVERSIZED,
                         ids=[f"{name}-{field}" for name, _, _, field in OVERSIZED])
def test_oversized_header_refused_before_allocating(name, file, edit, field, tmp_path, watched):
    """A header field claiming a huge size is refused, the error naming it, before anything of
    that size is allocated (a checkpoint's checksum is made to match, as a buggy writer's would)."""
    subject = make_subject(name, tmp_path)
    target = subject.file(file)
    message = subject.attempt(target, edit(subject.pristine[target]), f"{field} huge", reseal=True)
    assert message and field in message, f"{target.name} with a huge {field}: {message}"


def test_the_watch_catches_trusting_readers(tmp_path, watched):
    """A reader that sizes an array by a header it has not checked fails `attempt`, though the
    operating system never touches the pages; so does one that never returns."""
    path = tmp_path / "claims.bin"
    path.write_bytes(struct.pack("<Q", 1 << 30))

    def trusting(path: Path) -> None:
        np.empty(struct.unpack("<Q", path.read_bytes())[0], np.uint8)

    with pytest.raises(AssertionError, match="allocated"):
        attempt(trusting, path, path, MEMORY_SLACK, "a trusting reader")

    def endless(path: Path) -> None:
        while True:
            pass

    with pytest.raises(pytest.fail.Exception, match="still running"):
        attempt(endless, path, path, MEMORY_SLACK, "an endless reader", timeout=0.2)
