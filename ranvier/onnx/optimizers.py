"""Converters of the update rules of ONNX's training domain (ai.onnx.preview.training):
Adagrad, Adam and Momentum, each the elementwise formula of its definition for every
tensor it updates. Inputs are the learning rate r and the step count t, then the tensors
in groups (all the parameters, then all their gradients, then each state); outputs the
new parameters, then each new state.
"""

from __future__ import annotations

from .node import Node, converts

_DOMAIN = "ai.onnx.preview.training"


def _groups(node: Node, count: int):
    """(r, t in r's dtype, the `count` groups of tensors, each a list over the parameters)."""
    total = len(node.inputs) - 2
    if total <= 0 or total % count:
        raise node.error(f"{len(node.inputs)} inputs: {node.proto.op_type} takes r, t, then {count} tensors per "
                         "parameter")
    n = total // count
    r = node.tensor(0).reshape([])
    t = node.b.cast(node.tensor(1), r.dtype).reshape([])
    return r, t, [[node.tensor(2 + g * n + i) for i in range(n)] for g in range(count)]


@converts("Adagrad", domain=_DOMAIN)
def adagrad(node: Node):
    r, t, (xs, gs, hs) = _groups(node, 3)
    rate = r / (t * float(node.attr("decay_factor", 0.0)) + 1.0)
    norm, epsilon = float(node.attr("norm_coefficient", 0.0)), float(node.attr("epsilon", 0.0))
    new_xs, new_hs = [], []
    for x, g, h in zip(xs, gs, hs):
        g = x * norm + g
        h = h + g * g
        new_xs.append(x - rate * g / (h.sqrt() + epsilon))
        new_hs.append(h)
    return new_xs + new_hs


@converts("Adam", domain=_DOMAIN)
def adam(node: Node):
    """Bias-corrected from the first step on (t > 0); at t = 0 the rate is r itself."""
    r, t, (xs, gs, vs, hs) = _groups(node, 4)
    alpha, beta = float(node.attr("alpha", 0.9)), float(node.attr("beta", 0.999))
    norm, post = float(node.attr("norm_coefficient", 0.0)), float(node.attr("norm_coefficient_post", 0.0))
    epsilon = float(node.attr("epsilon", 0.0))
    one = node.b.const(1.0, r.dtype)
    corrected = r * (one - node.b.pow(node.b.const(beta, r.dtype), t)).sqrt() / \
        (one - node.b.pow(node.b.const(alpha, r.dtype), t))
    rate = node.b.cond(t > 0.0, corrected, r)
    new_xs, new_vs, new_hs = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = x * norm + g
        v = v * alpha + g * (1.0 - alpha)
        h = h * beta + g * g * (1.0 - beta)
        new_xs.append((x - rate * (v / (h.sqrt() + epsilon))) * (1.0 - post))
        new_vs.append(v)
        new_hs.append(h)
    return new_xs + new_vs + new_hs


@converts("Momentum", domain=_DOMAIN)
def momentum(node: Node):
    """Standard or Nesterov momentum; the gradient's coefficient is 1 at t = 0."""
    r, t, (xs, gs, vs) = _groups(node, 3)
    mode = node.attr("mode", "standard")
    if mode not in ("standard", "nesterov"):
        raise node.error(f"mode {mode!r} is not standard or nesterov")
    alpha, norm = float(node.attr("alpha")), float(node.attr("norm_coefficient"))
    beta = node.b.cond(t > 0.0, node.b.const(float(node.attr("beta")), r.dtype), node.b.const(1.0, r.dtype))
    new_xs, new_vs = [], []
    for x, g, v in zip(xs, gs, vs):
        g = x * norm + g
        v = v * alpha + beta * g
        new_xs.append(x - r * (v if mode == "standard" else g + v * alpha))
        new_vs.append(v)
    return new_xs + new_vs
