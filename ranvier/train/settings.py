"""A run's saved settings (its config.json) checked against the job config they rebuild:
each of the type its field declares, and the counts and rates within their bounds, so a
corrupt or hand-edited file is refused by name instead of failing deep inside a resume."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields
from pathlib import Path

from ..errors import RanvierError, brief

_NOUNS = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object"}
_BOUNDS = {"positive": " above 0", "non-negative": " of 0 or more", None: ""}


def check_settings(path: Path, config_type: type, saved: dict) -> None:
    """Refuse, naming the setting, a value in `saved` (read from `path`) that `config_type`
    (a dataclass) cannot take: of another type than its field's, or out of its bound
    (the field is in `config_type.POSITIVE` or `NON_NEGATIVE`; a list's numbers each)."""
    hints = typing.get_type_hints(config_type)
    for field in fields(config_type):
        if field.name not in saved:
            continue
        value, hint = saved[field.name], hints[field.name]
        bound = ("positive" if field.name in getattr(config_type, "POSITIVE", ()) else
                 "non-negative" if field.name in getattr(config_type, "NON_NEGATIVE", ()) else None)
        if not _fits(value, hint) or not _within(value, bound):
            raise RanvierError(f"{path}: {field.name} is {brief(value)}, expected {_described(hint, bound)}")


def _fits(value: object, hint: object) -> bool:
    """Whether a JSON value is of the type `hint` (a field's annotation) describes."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    return type(value) is hint  # (bool is not an int here, as JSON has it)


def _within(value: object, bound: str | None) -> bool:
    if isinstance(value, list):
        return all(_within(item, bound) for item in value)
    if bound is None or type(value) not in (int, float):
        return True
    return value > 0 if bound == "positive" else value >= 0


def _described(hint: object, bound: str | None) -> str:
    """"an integer above 0 or null": what a setting takes, for a message."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_described(arg, bound) for arg in args)
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_NOUNS[args[0]]}s{_BOUNDS[bound] if args[0] in (int, float) else ''}"
    noun = _NOUNS[hint]
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}{_BOUNDS[bound] if hint in (int, float) else ''}"
