"""Checkpoints: every network global (weights, optimizer state, counters) as safetensors,
plus JSON metadata (step, schedule, data position, model description).

Layout of a checkpoint directory:
    weights-<step>.safetensors   the arrays
    checkpoint.json              metadata; names the weights file and its SHA-256

Both files are written atomically, the weights first: replacing checkpoint.json is
the commit point, so an interrupted save leaves the previous checkpoint intact. What a
killed save leaves behind (temporary files, weights no checkpoint.json names) goes with
the next save.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save as st_save

from .. import dtypes
from ..atomic import atomic_write_bytes, remove_partial_writes
from ..errors import RanvierError, brief, is_file_name, name_mismatch, parse_json
from ..safetensors_file import read_safetensors

FORMAT = "ranvier-checkpoint"
VERSION = 1
METADATA = "checkpoint.json"

# safetensors' numpy API has no bfloat16; such arrays travel as their uint16 bits.
_STORED_AS = {dtypes.DT_BFLOAT16: np.uint16}


class CheckpointError(RanvierError):
    """A checkpoint is missing, corrupt, or belongs to a different model."""


def save_checkpoint(directory: str | Path, arrays: dict[str, np.ndarray], state: dict) -> Path:
    """Write a checkpoint of `arrays` and `state` (its "step" names the weights file).

    Saving fails whole: on a full disk, say, the error names the file that could not be
    written, and the directory keeps the previous checkpoint (without the new weights)."""
    directory = Path(directory)
    stored, types = {}, {}
    for name, array in arrays.items():
        dtype = dtypes.from_numpy(array.dtype)
        types[name] = {"dtype": dtype, "shape": list(array.shape)}
        carrier = _STORED_AS.get(dtype)
        stored[name] = np.ascontiguousarray(array).view(carrier) if carrier else np.ascontiguousarray(array)
    blob = st_save(stored)
    step = int(state.get("step", 0))
    weights_name = f"weights-{step:08d}.safetensors"
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "weights": weights_name,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "arrays": types,
        **state,
    }
    previous = _committed(directory)
    try:
        atomic_write_bytes(directory / weights_name, blob)
        atomic_write_bytes(directory / METADATA, json.dumps(metadata, indent=1).encode())
    except RanvierError as error:
        if previous is None or previous.get("weights") != weights_name:
            (directory / weights_name).unlink(missing_ok=True)
        kept = f"{directory} still holds the step {previous.get('step')} checkpoint" if previous else f"{directory} holds no checkpoint"
        raise CheckpointError(f"cannot save the step {step} checkpoint: {error}; {kept}") from error
    # Committed: what earlier saves left, finished or killed midway, goes.
    for old in directory.glob("weights-*.safetensors"):
        if old.name != weights_name:
            old.unlink()
    remove_partial_writes(directory)
    return directory


def _committed(directory: Path) -> dict | None:
    """The metadata of the checkpoint in `directory`, None where there is none to keep."""
    try:
        return read_metadata(directory)
    except CheckpointError:
        return None


def read_metadata(directory: str | Path) -> dict:
    """A checkpoint's metadata (its step, schedule, ...), without reading its weights."""
    meta_path = Path(directory) / METADATA
    if not meta_path.is_file():
        raise CheckpointError(f"no checkpoint in {directory}: {METADATA} is missing")
    metadata = parse_json(meta_path.read_bytes(), CheckpointError, f"{meta_path} is not valid JSON")
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise CheckpointError(f"{meta_path} is not a {FORMAT} version {VERSION} file")
    _check_metadata(metadata, meta_path)
    return metadata


def _check_metadata(metadata: dict, meta_path: Path) -> None:
    """The fields that reading a checkpoint relies on, each of the kind it needs."""
    weights, arrays, step = metadata.get("weights"), metadata.get("arrays"), metadata.get("step", 0)
    if not is_file_name(weights):
        raise CheckpointError(f"{meta_path}: weights {brief(weights)} is not a file name in {meta_path.parent}")
    if not isinstance(metadata.get("sha256"), str):
        raise CheckpointError(f"{meta_path}: sha256 {brief(metadata.get('sha256'))} is not a hex digest")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{meta_path}: step {brief(step)} is not a non-negative integer")
    if not isinstance(arrays, dict):
        raise CheckpointError(f"{meta_path}: arrays {brief(arrays)} is not an object")
    for name, info in arrays.items():
        dtype, shape = (info.get("dtype"), info.get("shape")) if isinstance(info, dict) else (None, None)
        if dtype not in dtypes.ALL_DTYPES:
            raise CheckpointError(f"{meta_path}: arrays[{name!r}] has dtype {brief(dtype)}, not one of "
                                  f"{', '.join(dtypes.ALL_DTYPES)}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise CheckpointError(f"{meta_path}: arrays[{name!r}] has shape {brief(shape)}, not a list of sizes")


def load_checkpoint(directory: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    directory = Path(directory)
    meta_path = directory / METADATA
    metadata = read_metadata(directory)
    weights_path = directory / metadata["weights"]
    if not weights_path.is_file():
        raise CheckpointError(f"checkpoint weights {weights_path}, named by {meta_path}, are missing")
    blob = weights_path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != metadata["sha256"]:
        raise CheckpointError(f"checkpoint weights {weights_path} do not match the SHA-256 in {meta_path} (corrupt or partial)")
    stored = read_safetensors(blob, str(weights_path), CheckpointError)
    arrays = {}
    for name, info in metadata["arrays"].items():
        if name not in stored:
            raise CheckpointError(f"checkpoint {weights_path} lacks array {name}, which {meta_path} lists")
        dtype = dtypes.to_numpy(info["dtype"])
        carrier = np.dtype(_STORED_AS.get(info["dtype"], dtype))
        # Sizes, not shapes, must agree: a scalar is saved as one element.
        if stored[name].dtype != carrier or stored[name].size != math.prod(info["shape"]):
            raise CheckpointError(
                f"checkpoint {weights_path}: array {name} is {stored[name].dtype}{list(stored[name].shape)}, "
                f"{meta_path} says {info['dtype']}{info['shape']}"
            )
        arrays[name] = stored[name].view(dtype).reshape(info["shape"])
    return arrays, metadata


def check_compatible(arrays: dict[str, np.ndarray], expected: dict[str, np.ndarray], source: str) -> None:
    """Refuse a checkpoint whose variables differ in name, dtype or shape from the model's."""
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {source} is for a different model: " + name_mismatch(missing, extra)
        )
    for name, target in expected.items():
        got = arrays[name]
        if got.shape != target.shape or got.dtype != target.dtype:
            raise CheckpointError(
                f"checkpoint {source} is for a different model: {name} is "
                f"{dtypes.from_numpy(got.dtype)}{list(got.shape)}, expected {dtypes.from_numpy(target.dtype)}{list(target.shape)}"
            )
