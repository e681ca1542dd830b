"""Exceptions raised by ranvier. Every message names the thing that was wrong."""

import json


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


def shape_str(shape) -> str:
    """A shape as Myelin prints it: 2x3x4, an undefined dimension as ? (empty for a scalar)."""
    return "x".join("?" if d < 0 else str(d) for d in shape)
