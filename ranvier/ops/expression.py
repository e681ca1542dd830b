"""Calculate expressions: a fused elementwise computation as a small printable program.

A program is a list of statements such as

    $0=Mul(%0,%1);$1=Add($0,%2);@0=Gelu[approximate=tanh]($1)

where %i is input i of the fused op, $k a temporary and @j output j. A statement
assigning %i writes input i in place (how a fused optimizer update writes a weight). Each call names
a registered elementwise op type (with its attributes in brackets), so the numpy
reference and the code generator both evaluate a statement by looking up that op.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ref:
    """An operand: an input (%), a temporary ($) or an output (@) of the fused op."""

    kind: str  # "%", "$" or "@"
    index: int

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


@dataclass(frozen=True)
class Call:
    op_type: str
    args: tuple[Ref | Call, ...]
    attrs: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        attrs = f"[{','.join(f'{k}={v}' for k, v in self.attrs)}]" if self.attrs else ""
        return f"{self.op_type}{attrs}({','.join(map(str, self.args))})"


@dataclass(frozen=True)
class Program:
    """Statements (target, call) in order; immutable, so one parsed program is shared by
    every op whose expression reads the same (`parsed`)."""

    statements: tuple[tuple[Ref, Call], ...] = ()

    def __str__(self) -> str:
        return ";".join(f"{target}={call}" for target, call in self.statements)

    @property
    def writes(self) -> list[int]:
        """The inputs it writes in place (statements assigning %i), in statement order."""
        return [target.index for target, _ in self.statements if target.kind == "%"]

    def evaluate(self, inputs: list, outputs: int, call: Callable[[Call, list], Any]) -> list:
        """Run the program on `inputs` (numpy arrays, IR values...), `call(node, args)`
        computing each call: its `outputs` results, then the values it writes in place."""
        env = {f"%{i}": value for i, value in enumerate(inputs)}

        def operand(node: Ref | Call):
            return env[str(node)] if isinstance(node, Ref) else call(node, [operand(a) for a in node.args])

        writes = []
        for target, statement in self.statements:
            value = operand(statement)
            if target.kind == "%":
                writes.append(value)
            else:
                env[str(target)] = value
        return [env[f"@{j}"] for j in range(outputs)] + writes

    def feeds(self, outputs: int) -> dict[Call, frozenset[int]]:
        """Each call of the program (nested ones too; equal calls as one) → the results its
        value reaches, numbered as `evaluate` returns them: its `outputs` results, then the
        values it writes in place. A code generator may compute a call more loosely where
        every result it feeds is stored with less precision (`cuda/fastmath.py`)."""
        found: dict[Call, frozenset[int]] = {}
        live = {f"@{j}": {j} for j in range(outputs)}  # the results a name's current value reaches
        write = len(self.writes)
        for target, statement in reversed(self.statements):
            if target.kind == "%":  # each write is a result of its own; reads of %i see the input
                write -= 1
                reached = {outputs + write}
            else:
                reached = live.pop(str(target), set())  # uses before this statement read an earlier value
            nodes: list[Ref | Call] = [statement]
            while nodes:
                node = nodes.pop()
                if isinstance(node, Call):
                    found[node] = found.get(node, frozenset()) | reached
                    nodes.extend(node.args)
                elif node.kind != "%":
                    live.setdefault(str(node), set()).update(reached)
        return found


_TOKEN = re.compile(r"\s*(?:(?P<ref>[%$@]\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<attrs>\[[^\]]*\])|(?P<punct>[(),=;]))")


class ExpressionError(ValueError):
    pass


def parse(text: str) -> Program:
    tokens = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise ExpressionError(f"cannot parse Calculate expression at {text[pos:pos + 20]!r}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    statements: list[tuple[Ref, Call]] = []
    i = 0

    def peek() -> str:
        if i >= len(tokens):
            raise ExpressionError(f"unexpected end of Calculate expression {text!r}")
        return tokens[i][1]

    def expect(value):
        nonlocal i
        if i >= len(tokens) or tokens[i][1] != value:
            raise ExpressionError(f"expected {value!r} in Calculate expression {text!r}")
        i += 1

    def operand():
        nonlocal i
        if i >= len(tokens):
            raise ExpressionError(f"unexpected end of Calculate expression {text!r}")
        kind, value = tokens[i]
        if kind == "ref":
            i += 1
            return Ref(value[0], int(value[1:]))
        if kind != "name":
            raise ExpressionError(f"unexpected {value!r} in Calculate expression {text!r}")
        i += 1
        attrs = ()
        if i < len(tokens) and tokens[i][0] == "attrs":
            body = tokens[i][1][1:-1]
            attrs = tuple(tuple(part.split("=", 1)) for part in body.split(",") if part)
            i += 1
        expect("(")
        args = []
        while peek() != ")":
            args.append(operand())
            if peek() == ",":
                i += 1
        expect(")")
        return Call(value, tuple(args), attrs)

    while i < len(tokens):
        target = operand()
        if not isinstance(target, Ref):
            raise ExpressionError(f"a Calculate statement assigns a $temporary, an @output or an %input (in place), in {text!r}")
        expect("=")
        call = operand()
        if not isinstance(call, Call):
            call = Call("Identity", (call,))
        statements.append((target, call))
        if i < len(tokens):
            expect(";")
    return Program(tuple(statements))


@functools.lru_cache(maxsize=4096)
def parsed(text: str) -> Program:
    """The program `text` says, parsed once per text: every reader of an op's `expr` (its
    type rule, its reference, its cost, each backend's kernel) takes it from here, and a
    pass that rewrites `expr` is read anew, as the cache is keyed by the text itself."""
    return parse(text)


def program_of(op) -> Program:
    """A fused op's program (a Calculate's, a MatMulCalculate's...: its `expr` attribute;
    none for an op without one), parsed once per text (`parsed`). `op` is an Operation or
    anything that reads as one (a ForEach's Member)."""
    return parsed(op.attrs.get("expr", ""))
