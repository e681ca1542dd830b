"""Atomic file writes: write to a temporary file beside the target, fsync, rename, fsync the folder.

A reader sees the old file or the new one, never half of one, even if the writer
is killed midway or the machine loses power.
"""

from __future__ import annotations

import errno
import glob
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import RanvierError

TEMPORARY = ".tmp"  # the suffix of a write in progress: `.<name>.<random>.tmp` beside `<name>`


def os_error(error: OSError) -> str:
    """"No space left on device (ENOSPC)": what failed, with the name to look up."""
    name = errno.errorcode.get(error.errno or 0)
    return f"{error.strerror or error}{f' ({name})' if name else ''}"


class WriteError(RanvierError, OSError):
    """A file could not be written (a full disk, a read-only file system): an OSError with
    the failure's errno, whose message names the file."""

    def __init__(self, path: str | os.PathLike, error: OSError):
        super().__init__(error.errno, error.strerror or str(error))
        self.path = Path(path)

    def __str__(self) -> str:
        return f"cannot write {self.path}: {os_error(self)}"


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(file)` on a temporary file and move it over `path` once complete.

    A failure (a full disk, a read-only file system) removes the temporary file and raises a
    WriteError naming `path`; the file there, if any, is unchanged."""
    _write_beside(path, lambda name, f: write(f))


def atomic_write_by_name(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """`atomic_write` for a library that writes a file only by its name (the gguf package's
    writer opens the path it is given): `write(name)` fills the temporary file `name`."""
    _write_beside(path, lambda name, f: write(Path(name)))


def _write_beside(path: str | os.PathLike, fill: Callable[[str, BinaryIO], None]) -> None:
    """Create a temporary file beside `path`, `fill(its name, itself)`, and move it over `path`."""
    target = Path(path)
    # A path's own mistakes (a file where a folder should be) raise as they are, naming it.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMPORARY, dir=target.parent)
        with os.fdopen(fd, "wb") as f:
            # mkstemp creates owner-only files; give the result the permissions a plain open() would.
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)
            fill(tmp, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as error:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            raise WriteError(target, error) from error
        raise
    # The rename is durable only once the folder's entry is on disk.
    fsync_directory(target.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def fsync_directory(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename into it) to disk, where its file system can."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # some network and FUSE file systems cannot
            raise
    finally:
        os.close(fd)


def remove_partial_writes(folder: str | os.PathLike, pattern: str = "*") -> None:
    """Delete the temporary files that writes of files named `pattern` in `folder` left when
    their process was killed. Only for a folder no other process writes to at the time."""
    for leftover in glob.glob(os.path.join(glob.escape(os.fspath(folder)), f".{pattern}.*{TEMPORARY}")):
        os.unlink(leftover)
