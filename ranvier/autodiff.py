"""Reverse-mode automatic differentiation as a graph transform.

`gradient()` walks a function's ops backwards from a loss and, for each op, asks the
VJP registry for the vector-Jacobian product: a rule that builds the input
gradients as ordinary ops. The backward pass is therefore a flow like any other and
compiles with the same compiler, fused into a training function or as Myelin's
separate `gradients/<f>` function.

Each op's rule is part of its definition (`ranvier.ops`), beside its forward math;
`@vjp("OpType")` attaches one to an op a user defines. A rule receives a `VJPContext`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from . import dtypes
from .errors import RanvierError, UnknownOpError
from .flow.builder import Builder, Tensor, variable_of
from .flow.graph import Flow, Function, Operation, Variable
from .ops import has_op, op_def, vjp

__all__ = [
    "VJPContext", "backward", "backward_from", "gradient", "gradient_function", "has_vjp", "link_primal", "unbroadcast",
    "ungradable_ops", "vjp",
]


class VJPContext:
    """What a VJP rule sees: the builder for backward ops, the op, its inputs and outputs."""

    def __init__(self, builder: Builder, op: Operation):
        self.b = builder
        self.op = op
        self.attrs = op_def(op.type).attrs_of(op)
        self.inputs = [builder.wrap(v) for v in op.inputs]
        self.outputs = [builder.wrap(v) for v in op.outputs]

    def unbroadcast(self, grad: Tensor, like: Tensor) -> Tensor:
        """Sum a broadcast gradient back to the shape of the operand it came from."""
        return unbroadcast(self.b, grad, like.shape)

    def const(self, value: float, like: Tensor) -> Tensor:
        return self.b.const(value, like.dtype)


def has_vjp(op_type: str) -> bool:
    return has_op(op_type) and op_def(op_type).vjp is not None


def unbroadcast(b: Builder, grad: Tensor, shape: Sequence[int]) -> Tensor:
    shape = list(shape)
    gshape = grad.shape
    if gshape == shape:
        return grad
    lead = len(gshape) - len(shape)
    axes = list(range(lead)) + [lead + i for i, d in enumerate(shape) if d == 1 and gshape[lead + i] != 1]
    summed = b.sum(grad, axis=axes, keepdims=True) if axes else grad
    return b.reshape(summed, shape) if summed.shape != shape else summed


def _differentiable(var: Variable) -> bool:
    return dtypes.is_float(var.dtype) and not var.nogradient


def _seed(b: Builder, root: Variable, seed) -> Tensor:
    """The gradient flowing into `root`: a Tensor (cast and broadcast to the root's type) or a number."""
    if isinstance(seed, (Tensor, Variable)):
        tensor = b.wrap(variable_of(seed))
        if tensor.dtype != root.dtype:
            tensor = b.cast(tensor, root.dtype)
        if tensor.shape != list(root.shape):
            if tensor.shape:
                raise RanvierError(
                    f"gradient seed {tensor.name} has shape {tensor.shape}, expected the loss's {list(root.shape)} or a scalar"
                )
            tensor = b.broadcast_to(tensor, root.shape)
        return tensor
    value = 1.0 if seed is None else float(seed)
    return b.broadcast_to(b.const(value, root.dtype), root.shape) if root.shape else b.const(value, root.dtype)


def _relevant_ops(ops: list[Operation], sources: set[str], targets: list[Variable], stop: set[str]) -> list[Operation]:
    """Ops on some path from a source variable to a target, in forward order."""
    reaches: set[str] = set(sources)
    forward: list[Operation] = []
    for op in ops:
        if op.nogradient:
            continue
        if any(v.name in reaches and v.name not in stop - sources for v in op.inputs):
            forward.append(op)
            reaches.update(v.name for v in op.outputs)
    needed = {target.name for target in targets}
    relevant = []
    for op in reversed(forward):
        if any(v.name in needed for v in op.outputs):
            relevant.append(op)
            needed.update(v.name for v in op.inputs)
    relevant.reverse()
    return relevant


def ungradable_ops(flow: Flow, func: Function | str, wrt: Iterable, roots: Iterable) -> list[Operation]:
    """The ops between a `wrt` variable and a root that a gradient would have to pass
    and cannot (no VJP rule): what `gradient` would fail on, found before building it."""
    func = flow.func(func)
    sources = {variable_of(w).name for w in wrt}
    relevant = _relevant_ops(flow.op_order(func), sources, [variable_of(r) for r in roots], set())
    return [op for op in relevant if op_def(op.type).vjp is None and any(_differentiable(v) for v in op.outputs)]


def gradient(
    flow: Flow,
    func: Function | str,
    wrt: Iterable,
    loss=None,
    seed=None,
    stop: Iterable = (),
    into: Function | str | None = None,
) -> dict[str, Tensor]:
    """Add the backward ops of `func` to the flow and return {variable name: gradient}.

    loss: the scalar (or any tensor) to differentiate; defaults to the function's only output.
    seed: the gradient flowing into `loss` (a Tensor, or a number; default 1). With a
          number, e.g. a loss scale, the seed is a constant of the loss's shape.
          `loss` and `seed` may also be lists, one seed per root: the gradient of
          Σ seedᵢ·rootᵢ (a layer's output with its upstream gradient, plus an auxiliary
          loss it adds with seed 1).
    stop: variables treated as leaves: no gradient flows past them (the stop-gradient
          frontier). A `wrt` variable is never stopped: when one depends on another,
          each still gets its full gradient.
    into: the function receiving the backward ops; default `func` itself (a fused
          training function). Pass "gradients/<f>" for Myelin's separate gradient
          function, whose cell is instantiated with `primal=` the forward instance.
    """
    func = flow.func(func)
    ops = flow.op_order(func)
    wrt_vars = [variable_of(w) if not isinstance(w, str) else flow.lookup(w) for w in wrt]
    if loss is None:
        outputs = flow.outputs(func)
        if len(outputs) != 1:
            raise RanvierError(f"function {func.name} has {len(outputs)} outputs; say which one is the loss")
        roots = [outputs[0]]
    else:
        roots = [variable_of(t) if not isinstance(t, str) else flow.lookup(t) for t in (loss if isinstance(loss, list) else [loss])]
    seeds = seed if isinstance(seed, list) else [seed] * len(roots)
    if len(seeds) != len(roots):
        raise RanvierError(f"gradient: {len(roots)} roots but {len(seeds)} seeds")
    target_func = flow.func(into) if into is not None else func
    if into is not None and target_func is not func:
        target_func.backprop = True
    b = Builder(flow, target_func)

    ops_before = set(target_func.ops)
    stop_names = {variable_of(s).name if not isinstance(s, str) else s for s in stop}
    sources = {v.name for v in wrt_vars}
    relevant = _relevant_ops(ops, sources, roots, stop_names)

    grads: dict[str, Tensor] = {}
    for root, root_seed in zip(roots, seeds):
        seeded = _seed(b, root, root_seed)
        grads[root.name] = seeded if root.name not in grads else b.add(grads[root.name], seeded)
    for op in reversed(relevant):
        out_grads = [grads.get(v.name) for v in op.outputs]
        if all(g is None for g in out_grads):
            continue
        rule = op_def(op.type).vjp
        if rule is None:
            raise UnknownOpError(f"no VJP rule for op type {op.type} (op {op.name}); register one with @vjp({op.type!r})")
        in_grads = rule(VJPContext(b, op), out_grads)
        if len(in_grads) != len(op.inputs):
            raise RanvierError(f"VJP rule of {op.type} returned {len(in_grads)} gradients for {len(op.inputs)} inputs")
        for var, g in zip(op.inputs, in_grads):
            if g is None or not _differentiable(var):
                continue
            if var.name in stop_names and var.name not in sources:
                continue
            if var.constant and var.name not in sources:
                continue
            if g.shape != var.shape or g.dtype != var.dtype:
                raise RanvierError(
                    f"VJP rule of {op.type} (op {op.name}) gave gradient {g.dtype}{g.shape} "
                    f"for input {var.name} of type {var.typestr()}"
                )
            previous = grads.get(var.name)
            grads[var.name] = g if previous is None else b.add(previous, g)

    result = {}
    for v in wrt_vars:
        g = grads.get(v.name)
        if g is None:
            zero = b.const(0.0, v.dtype)
            g = b.broadcast_to(zero, v.shape) if v.shape else b.identity(zero)
        elif g.producer is None or g.producer.func is not target_func:
            # The seed itself (d(x + y)/dx), or a value of another function: a copy makes
            # the gradient a value of the function that computes the gradients.
            g = b.identity(g)
        result[v.name] = g
    _prune(flow, target_func, ops_before, {g.var.name for g in result.values()})
    for g in result.values():
        # A gradient is a result of the function even when a later op (an optimizer
        # update, another gradient) reads it: keep its storage from being reused.
        if not g.var.is_global:
            g.var.out = True
    if target_func is not func:
        link_primal(flow, func, [op for op in target_func.ops if op not in ops_before])
    return result


def _prune(flow: Flow, func: Function, keep_ops: set[Operation], keep_vars: set[str]) -> None:
    """Remove backward ops whose results nothing uses (e.g. the gradient of a data input
    that a rule computed alongside a weight gradient)."""
    changed = True
    while changed:
        changed = False
        for op in reversed(list(func.ops)):
            if op in keep_ops or any(v.consumers or v.name in keep_vars for v in op.outputs):
                continue
            flow.remove_op(op)
            for v in op.outputs:
                flow.remove_var(v)
            changed = True


def link_primal(flow: Flow, func: Function, grad_ops: list[Operation]) -> None:
    """Make what another function's ops (a separate gradient function's, or ops after a
    Myelin Reference) read from `func` survive it.

    The reading cell reads `func`'s values through its primal instance. Values the
    forward cell computes are flagged OUT, so its memory plan keeps them to the end
    instead of reusing their storage. The forward function's inputs are not computed
    by it, so the gradient cell would take them for its own (unset) inputs; it reads a
    copy the forward cell makes instead (`<input>.primal`).
    """
    copies: dict[str, Variable] = {}
    for op in grad_ops:
        for v in list(op.inputs):
            if v.is_global:
                continue
            if v.producer is not None:
                if v.producer.func is func:
                    v.out = True
                continue
            if not any(c.func is func for c in v.consumers):
                continue  # an input of the gradient function itself (a seed, say)
            copy = copies.get(v.name)
            if copy is None:
                short = v.name[len(func.name) + 1:] if v.name.startswith(func.name + "/") else v.name
                existing = flow.ops.get(f"{func.name}/{short}.primal")
                if existing is not None and existing.type == "Identity" and existing.inputs == [v]:
                    copy = existing.outputs[0]
                else:
                    copy = Builder(flow, func).identity(v, name=f"{short}.primal").var
                copy.out = True
                copies[v.name] = copy
            op.replace_input(v, copy)


def backward(loss: Tensor, params: Sequence[Tensor], loss_scale: float | None = None, stop: Iterable = ()) -> dict[str, Tensor]:
    """Gradients of `loss` for each parameter, as ops fused into the loss's function (ANEForge's backward)."""
    return backward_from(loss_scale, loss, params, stop)


def backward_from(grad, root: Tensor, params: Sequence[Tensor], stop: Iterable = ()) -> dict[str, Tensor]:
    """Gradients seeded with an explicit `grad` at an intermediate tensor `root`."""
    flow = root.builder.flow
    func = root.producer.func if root.producer is not None else root.builder.func
    stop = list(stop) + list(params)
    return gradient(flow, func, params, loss=root, seed=grad, stop=stop)


def gradient_function(flow: Flow, func: Function | str) -> Function:
    """Myelin's gradient function `gradients/<f>` of a function marked for backprop.

    For every float variable `f/x` the function reads (inputs and learnable
    parameters, not constants or NOGRADIENT ones) it computes the adjoint
    `gradients/f/d_x`; for every float output `f/y` it takes the adjoint
    `gradients/f/d_y` as an input; it reads the forward values through the primal link
    `gradients/f/primal`. As in Myelin, a learnable parameter's adjoint accumulates
    (`d_W += ...` on every compute) until the caller clears the instance.
    """
    func = flow.func(func)
    name = f"gradients/{func.name}"
    b = Builder(flow, name)
    outputs = [v for v in flow.outputs(func) if _differentiable(v)]
    wrt = [v for v in flow.inputs(func) if _differentiable(v) and not v.constant]
    seeds = [b.var(f"d_{_basename(y)}", y.dtype, y.shape) for y in outputs]
    grads = gradient(flow, func, wrt, loss=outputs, seed=seeds, into=name)
    for v in wrt:
        adjoint = f"{name}/d_{_basename(v)}"
        if v.learnable:
            total = b.var(f"d_{_basename(v)}", v.dtype, v.shape)
            total.var.out = True
            b.assign(total, total + grads[v.name])
        else:
            flow.add_alias(grads[v.name].var, adjoint)
    return flow.funcs[name]


def _basename(var: Variable) -> str:
    return var.name.rsplit("/", 1)[-1]
