"""Myelin's Reference ops: a function reading a variable of another function's instance.

`f.ref(instance, var)` is `var` as an instance of the function computing it holds it;
`instance` is a variable the caller binds to that instance (`data[instance] = other`).
The compiler turns each Reference into a copy of `var` read through the link a cell
already has for another cell's values (the one a gradient cell reads its forward pass
through), with `instance` as the link's name.
"""

from __future__ import annotations

from ..autodiff import link_primal
from ..errors import CompileError
from ..flow.graph import Flow


def resolve_references(flow: Flow) -> None:
    for op in [op for op in flow.ops.values() if op.type == "Reference"]:
        reader, name = op.func, op.attr("var")
        if reader is None:
            raise CompileError(f"Reference op {op.name} belongs to no function")
        if name is None or len(op.inputs) != 1 or len(op.outputs) != 1:
            raise CompileError(f"Reference op {op.name} needs one instance input, one output and a 'var' attribute")
        target = flow.find_var(name)
        if target is None:
            raise CompileError(f"Reference op {op.name} refers to {name!r}, which is not a variable of the flow")
        users = [target.producer] if target.producer is not None else target.consumers
        source = next((user.func for user in users if user.func is not None and user.func is not reader), None)
        if source is None:
            raise CompileError(f"Reference op {op.name}: no other function computes or reads {name}")
        instance = op.inputs[0]
        if reader.primal_link not in (None, instance.name):
            raise CompileError(f"function {reader.name} reads other instances through {reader.primal_link} and {instance.name}; "
                               "a function can read one")
        reader.primal_link = instance.name
        op.type = "Identity"
        op.attrs.pop("var")
        op.replace_input(instance, target)
        link_primal(flow, source, [op])
