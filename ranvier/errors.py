"""Exceptions raised by ranvier. Every message names the thing that was wrong."""


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


def shape_str(shape) -> str:
    """A shape as Myelin prints it: 2x3x4, an undefined dimension as ? (empty for a scalar)."""
    return "x".join("?" if d < 0 else str(d) for d in shape)
