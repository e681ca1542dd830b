"""Exceptions raised by ranvier. Every message names the thing that was wrong. Also the
checks every file reader makes of what a file holds, so each says it the same way."""

import json
from pathlib import Path


class RanvierError(Exception):
    """Base class of every error ranvier raises on purpose."""


class ShapeError(RanvierError, ValueError):
    """An op was given inputs whose shapes or dtypes it cannot accept."""


class UnknownOpError(RanvierError, KeyError):
    """An op type has no definition (or no rule for the requested action)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class FlowFileError(RanvierError, ValueError):
    """A .flow file is truncated, corrupt or not a flow file at all."""


class CompileError(RanvierError):
    """A flow function cannot be compiled as it stands."""


def name_mismatch(missing, extra) -> str:
    """"missing a, b; unexpected c" (five names each at most), or "" when both are empty."""
    parts = []
    if missing:
        parts.append(f"missing {', '.join(list(missing)[:5])}")
    if extra:
        parts.append(f"unexpected {', '.join(list(extra)[:5])}")
    return "; ".join(parts)


def brief(value: object) -> str:
    """A value read from a JSON file, for a message: at most 60 characters of its JSON, and
    containers of containers described, not printed, however deep a corrupt file nests them."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return "(nested JSON)" if any(isinstance(v, (list, dict)) for v in items) else json.dumps(value)[:60]


def parse_json(text: str | bytes, error: type[RanvierError], message: str) -> object:
    """JSON read from a file. Bad JSON or UTF-8 (a ValueError) and nesting deeper than the
    parser recurses raise `error` as "<message>: <what the parser said>"."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as problem:
        raise error(f"{message}: {problem}") from None


def is_file_name(value: object) -> bool:
    """Whether a name read from a file (a manifest, an index) is a plain file name: no
    folder, so it cannot point outside the folder it was found in."""
    return isinstance(value, str) and value not in ("", "..") and Path(value).name == value


def shape_str(shape) -> str:
    """A shape as Myelin prints it: 2x3x4, an undefined dimension as ? (empty for a scalar)."""
    return "x".join("?" if d < 0 else str(d) for d in shape)
