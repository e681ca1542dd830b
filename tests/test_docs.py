"""The README's and docs/'s Python code blocks, run as they are written.

A document's blocks run in order, in one namespace (a later block may use what an earlier
one made), in a fresh process whose working folder is a temporary one. A comment on the line
just before a block says where that is not what the block is for:

- `<!-- excerpt: ranvier/ops/nn.py -->`: the block quotes that file; each of its paragraphs,
  and each run of lines between `...` lines, must appear there as written, in order.
- `<!-- after: README.md#a-first-flow -->`: the block runs after the blocks of that document
  under that heading (what it uses: a cell, an instance).
- `<!-- not run: reason -->`: the block needs what the tests do not have (a model file).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(excerpt|after|not run):\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of its first code line, 1-based
    heading: str  # the slug of the heading it is under
    code: str
    marker: tuple[str, str] | None  # (kind, argument)


def _slug(heading: str) -> str:
    """A heading as GitHub anchors it: lower case, spaces as hyphens, punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def blocks(document: str) -> list[Block]:
    """The ```python blocks of a document."""
    lines = (ROOT / document).read_text().splitlines()
    found, heading, k = [], "", 0
    while k < len(lines):
        line = lines[k]
        if line.startswith("#"):
            heading = _slug(line.lstrip("#"))
        if line.strip() == "```python":
            end = lines.index("```", k + 1)
            before = MARKER.search(lines[k - 1]) if k else None
            found.append(Block(document, k + 2, heading, "\n".join(lines[k + 1 : end]) + "\n",
                               (before.group(1), before.group(2)) if before else None))
            k = end
        k += 1
    return found


def _runnable(document: str, heading: str | None = None) -> list[Block]:
    return [b for b in blocks(document) if b.marker is None and (heading is None or b.heading == heading)]


def _program(document: str) -> list[Block]:
    """The blocks a document's run executes, each after what it names."""
    program = []
    for block in blocks(document):
        if block.marker is None:
            program.append(block)
        elif block.marker[0] == "after":
            source, _, heading = block.marker[1].partition("#")
            prerequisites = _runnable(source, heading)
            assert prerequisites, f"{document} line {block.line}: no runnable block under {block.marker[1]}"
            program += [b for b in prerequisites if b not in program] + [block]
    return program


RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for name, code in json.load(sys.stdin):
    exec(compile(code, name, "exec"), namespace)
"""


@pytest.mark.slow
@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_documents_python_blocks_run(document: str, tmp_path: Path) -> None:
    program = _program(document)
    if not program:
        pytest.skip(f"{document} has no block to run")
    # (each block on its own lines of its document, so a traceback points at the text)
    pieces = [(b.document, "\n" * (b.line - 1) + b.code) for b in program]
    result = subprocess.run([sys.executable, "-c", RUNNER], check=False, input=json.dumps(pieces), cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{document}'s code failed:\n{result.stderr[-4000:]}"


def _excerpts() -> list[Block]:
    return [b for document in DOCUMENTS for b in blocks(document) if b.marker and b.marker[0] == "excerpt"]


@pytest.mark.parametrize("block", _excerpts(), ids=lambda b: f"{b.document}:{b.line}")
def test_an_excerpt_quotes_its_source(block: Block) -> None:
    assert block.marker is not None
    source = (ROOT / block.marker[1]).read_text()
    # (its paragraphs, and the parts of each around a `...` line, each as the file has it)
    chunks = [chunk.strip("\n") for chunk in re.split(r"^\s*(?:\.\.\.)?\s*$", block.code, flags=re.MULTILINE)]
    at = 0
    for chunk in filter(None, chunks):
        found = source.find(chunk, at)
        assert found >= 0, f"{block.document} line {block.line} quotes what {block.marker[1]} does not hold (now):\n{chunk}"
        at = found + len(chunk)


def test_every_comment_before_a_block_is_a_marker_with_its_argument() -> None:
    """A misspelt marker would leave its block run (or not) unnoticed."""
    wrong = []
    for document in DOCUMENTS:
        lines = (ROOT / document).read_text().splitlines()
        for k, line in enumerate(lines[1:], 1):
            before = lines[k - 1].strip()
            if line.strip() == "```python" and before.startswith("<!--"):
                marker = MARKER.fullmatch(before)
                if marker is None or not marker.group(2):
                    wrong.append(f"{document} line {k}: {before}")
    assert not wrong, f"comments before code blocks that are not markers: {wrong}"


def test_the_reader_finds_the_blocks_and_their_markers() -> None:
    readme = blocks("README.md")
    first = readme[0]
    assert first.heading == "a-first-flow" and first.marker is None and first.code.startswith("import numpy as np\n")
    assert (ROOT / "README.md").read_text().splitlines()[first.line - 1] == "import numpy as np"
    assert any(b.marker and b.marker[0] == "excerpt" for d in DOCUMENTS for b in blocks(d))
