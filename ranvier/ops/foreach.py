"""ForEach: one op applied to several independent sets of operands, as one op — a
multi-tensor update (every parameter's AdamW step), every weight's cast, every gradient's
sum of squares.

A backend that pays for each kernel launch (a GPU: a few microseconds each, against a
parameter update of a few microseconds) runs it as one kernel; the compiler's horizontal
fusion (`compiler/foreach.py`) makes it there. It means exactly its members, one after
another: its shape rule and reference are theirs, and any backend without a kernel for it
runs the members one by one (its decomposition).

The op carries its members' type (`op`), how many there are (`count`) and their common
attributes; its inputs are the first member's inputs, then the second's, and so on, and
likewise its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .registry import Attr, Attrs, TensorType, decomposition, define, op_def

OWN_ATTRS = ("op", "count")


def member_attrs(attrs: dict[str, str]) -> dict[str, str]:
    """The members' own attributes, from a ForEach's."""
    return {name: value for name, value in attrs.items() if name not in OWN_ATTRS}


def _count(op) -> int:
    """How many members `op` has (a one-member ForEach does not store the default 1)."""
    return int(op_def(op.type).attrs_of(op)["count"])


def _split(items: list, count: int) -> list[list]:
    """`items` in `count` runs of equal length (empty ones where there are none)."""
    return [_run(items, count, k) for k in range(count)]


def _run(items: list, count: int, k: int) -> list:
    """Run `k` of `items` cut into `count` runs of equal length."""
    size = len(items) // count
    return items[k * size:(k + 1) * size]


@dataclass
class Member:
    """One op a ForEach stands for, as kernels and rules read an op: its name, type,
    variables and attributes (no function lists it, no variable names it as its producer
    or consumer)."""

    name: str
    type: str
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)
    func: object = None


def members(op) -> list[Member]:
    """The ops a ForEach stands for, over its own variables."""
    return [member(op, k) for k in range(_count(op))]


def member(op, k: int) -> Member:
    """The `k`th op a ForEach stands for (without making the others: a ForEach of every
    parameter's update has hundreds)."""
    count = _count(op)
    return Member(f"{op.name}.{k}", op.attrs["op"], _run(op.inputs, count, k), _run(op.outputs, count, k),
                  member_attrs(op.attrs), op.func)


def members_reading(op, source) -> list[Member]:
    """The members of a ForEach that read `source` (one, or several where they share it: a
    learning rate)."""
    width = len(op.inputs) // _count(op)
    return [member(op, k // width) for k, v in enumerate(op.inputs) if v is source]


def _infer(ctx) -> list[TensorType]:
    member, count = ctx.attrs["op"], ctx.attrs["count"]
    definition = op_def(member)
    if member == "ForEach" or any(name in definition.attrs for name in OWN_ATTRS):
        raise ctx.fail(f"a member op type other than {member} (a ForEach's own attributes are {', '.join(OWN_ATTRS)})")
    if count < 1 or len(ctx.inputs) % count:
        raise ctx.fail(f"{count} members' inputs, as many each (got {len(ctx.inputs)} inputs)")
    types = []
    for k, inputs in enumerate(_split(ctx.inputs, count)):
        types += definition.infer_types(f"{ctx.op_name}.{k}", inputs, member_attrs(ctx.attrs.raw))
    return types


def _reference(attrs: Attrs, args, outs) -> list:
    definition = op_def(attrs["op"])
    count = attrs["count"]
    own = Attrs(member_attrs(attrs.raw), attrs.op_name, definition.type, definition.attrs)
    results, writes = [], []  # every member's outputs, then every member's writes in place
    for inputs, outputs in zip(_split(list(args), count), _split(list(outs), count)):
        made = list(definition.reference(own, inputs, outputs))
        results += made[:len(outputs)]
        writes += made[len(outputs):]
    return results + writes


def _written(op) -> list[int]:
    """Each member's inputs it overwrites in place (a fused parameter update's)."""
    width = len(op.inputs) // _count(op)
    return [k * width + i for k, member in enumerate(members(op)) for i in op_def(member.type).written_inputs(member)]


def _flops(op) -> int:
    return sum(op_def(member.type).cost(member) for member in members(op))


define(
    "ForEach", _infer, _reference, (0, None), "fused",
    "one op over several sets of operands (inputs and outputs member by member), one kernel",
    attrs=[Attr("op", "str", "Identity", "the members' op type"), Attr("count", "int", 1, "how many members")],
    written=_written, flops=_flops,
)


@decomposition("ForEach")
def _one_by_one(b, op) -> list:
    """The members as ops of their own."""
    results = []
    for member in members(op):
        made = b.op(member.type, member.inputs, None, member.attrs)
        results += list(made) if isinstance(made, tuple) else [made]
    return results
