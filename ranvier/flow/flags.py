"""Flag bits of variables, ops and functions, numbered as in Myelin's .flow files."""

from __future__ import annotations

import enum


class VarFlags(enum.IntFlag):
    """Variable flag bits, numbered as in Myelin's .flow files."""

    NONE = 0
    IN = 1
    OUT = 2
    REF = 4
    LEARNABLE = 8
    UNIQUE = 16
    DYNAMIC = 32
    ROW = 64
    COL = 128
    NOGRADIENT = 256


class OpFlags(enum.IntFlag):
    NONE = 0
    NOGRADIENT = 1


class FuncFlags(enum.IntFlag):
    NONE = 0
    TRAINING = 1
    BACKPROP = 2
