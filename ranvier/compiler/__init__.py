"""The compiler: passes over a flow function, memory planning, and cell construction."""

from .compiler import Compiler

__all__ = ["Compiler"]
