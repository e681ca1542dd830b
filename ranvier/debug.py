"""What the compiler did, printed as it does it: `RANVIER_DEBUG=passes,llvm,asm`.

    passes   the function after each compiler pass (Myelin's --dump_final_flow, per pass)
    llvm     each generated cell's LLVM IR
    asm      each generated cell's machine code, as assembly (Myelin's --jit_code)

Output goes to standard error. `cell.llvm_ir()` and `cell.asm()` give the same text
for one cell. RANVIER_DEBUG set to anything also makes the `ranvier` command show the
full traceback of an error (as `ranvier --debug` does) instead of one line.
"""

from __future__ import annotations

import os
import sys

KINDS = ("passes", "llvm", "asm")


def enabled(kind: str) -> bool:
    """Whether RANVIER_DEBUG names `kind` (or says "all")."""
    asked = {part.strip() for part in os.environ.get("RANVIER_DEBUG", "").split(",") if part.strip()}
    return kind in asked or "all" in asked


def tracebacks() -> bool:
    """Whether the `ranvier` command shows full tracebacks: RANVIER_DEBUG has any value."""
    return bool(os.environ.get("RANVIER_DEBUG"))


def dump(kind: str, title: str, text: str) -> None:
    """Print `text` under a title line when RANVIER_DEBUG names `kind`."""
    if enabled(kind):
        print(f"==== {title} ====\n{text}", file=sys.stderr, flush=True)
