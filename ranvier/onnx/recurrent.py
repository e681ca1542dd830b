"""ONNX's recurrent layers, RNN, GRU and LSTM, unrolled at load over their sequence
length (fixed by the input's shape): one step's gates a few matmuls and elementwise ops.

The input's share of every gate, X·Wᵀ + Wb, is one matmul over all steps before the
loop; each step adds H·Rᵀ + Rb and applies the cell. Sequence lengths shorter than the
input (sequence_lens) mask the steps past them: the state holds, the output there is 0
(a reverse direction then starts at each sequence's own last step, as ONNX has it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..flow.builder import Tensor
from .node import Node, converts

DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
# How many of activation_alpha/beta each activation takes, and the defaults ONNX Runtime uses.
ACTIVATION_PARAMETERS = {"Affine": (1.0, 0.0), "LeakyRelu": (0.01,), "ThresholdedRelu": (1.0,),
                         "ScaledTanh": (1.0, 1.0), "HardSigmoid": (0.2, 0.5), "Elu": (1.0,)}
PLAIN_ACTIVATIONS = ("Tanh", "Sigmoid", "Relu", "Softsign", "Softplus")

Activation = Callable[[Tensor], Tensor]


def _activation(node: Node, name: str, alphas: list[float], betas: list[float]) -> Activation:
    """An activation by ONNX's name, taking its alpha and beta from the attribute lists."""
    b = node.b
    if name in PLAIN_ACTIVATIONS:
        return getattr(b, name.lower())
    if name not in ACTIVATION_PARAMETERS:
        raise node.error(f"activation {name!r} is not one of "
                         f"{', '.join(PLAIN_ACTIVATIONS + tuple(ACTIVATION_PARAMETERS))}")
    defaults = ACTIVATION_PARAMETERS[name]
    alpha = alphas.pop(0) if alphas else defaults[0]
    beta = (betas.pop(0) if betas else defaults[1]) if len(defaults) > 1 else None
    if name == "Affine":
        return lambda x: x * alpha + beta
    if name == "LeakyRelu":
        return lambda x: b.cond(b.greater(x, 0.0), x, x * alpha)
    if name == "ThresholdedRelu":
        return lambda x: b.cond(b.greater(x, alpha), x, x * 0.0)
    if name == "ScaledTanh":
        return lambda x: b.tanh(x * beta) * alpha
    if name == "HardSigmoid":
        return lambda x: b.maximum(b.minimum(x * alpha + beta, 1.0), 0.0)
    return lambda x: b.cond(b.greater(x, 0.0), x, (b.exp(x) - 1.0) * alpha)  # Elu


@dataclass
class Direction:
    """One direction's weights: W [G·H, I], R [G·H, H], biases [G·H] each, peepholes."""

    w: Tensor
    r: Tensor
    w_bias: Tensor | None
    r_bias: Tensor | None
    peepholes: Tensor | None
    h: Tensor  # the initial state [B, H]
    c: Tensor | None
    activations: list[Activation]
    reverse: bool


def _per_direction(node: Node, index: int, what: str, shape: list[int]) -> Tensor | None:
    if node.optional(index) is None:
        return None
    value = node.tensor(index)
    if value.shape != shape:
        raise node.error(f"its {what} of shape {value.shape} is not {shape}")
    return value


def _directions(node: Node, x: Tensor, hidden: int) -> list[Direction]:
    op = node.proto.op_type
    direction = node.attr("direction", "forward")
    if direction not in DIRECTIONS:
        raise node.error(f"direction {direction!r} is not one of {', '.join(DIRECTIONS)}")
    count, gates, batch, inputs = DIRECTIONS[direction], GATES[op], x.shape[1], x.shape[2]
    w = _per_direction(node, 1, "W", [count, gates * hidden, inputs])
    r = _per_direction(node, 2, "R", [count, gates * hidden, hidden])
    bias = _per_direction(node, 3, "B", [count, 2 * gates * hidden])
    initial_h = _per_direction(node, 5, "initial_h", [count, batch, hidden])
    initial_c = _per_direction(node, 6, "initial_c", [count, batch, hidden]) if op == "LSTM" else None
    peepholes = _per_direction(node, 7, "P", [count, 3 * hidden]) if op == "LSTM" else None
    names = [n.decode() if isinstance(n, bytes) else n for n in node.attr("activations", [])]
    names = names or DEFAULT_ACTIVATIONS[op] * count
    if len(names) != len(DEFAULT_ACTIVATIONS[op]) * count:
        raise node.error(f"its activations {names} are not {len(DEFAULT_ACTIVATIONS[op])} per direction ({count})")
    alphas, betas = [float(a) for a in node.attr("activation_alpha", [])], [float(b) for b in node.attr("activation_beta", [])]
    functions = [_activation(node, name, alphas, betas) for name in names]
    zeros = node.b.const(np.zeros([batch, hidden], dtypes.to_numpy(x.dtype)))
    per = len(DEFAULT_ACTIVATIONS[op])

    def row(t: Tensor | None, d: int) -> Tensor | None:
        return None if t is None else node.b.slice(t, [d, *[0] * (t.rank - 1)], [1, *t.shape[1:]]).reshape(t.shape[1:])

    result = []
    for d in range(count):
        biases = row(bias, d)
        w_bias, r_bias = biases.split(2, axis=0) if biases is not None else (None, None)
        result.append(Direction(row(w, d), row(r, d), w_bias, r_bias, row(peepholes, d),
                                row(initial_h, d) if initial_h is not None else zeros,
                                (row(initial_c, d) if initial_c is not None else zeros) if op == "LSTM" else None,
                                functions[d * per:(d + 1) * per], direction == "reverse" or d == 1))
    return result


def _clipped(node: Node, clip: float | None, t: Tensor) -> Tensor:
    return t if clip is None else node.b.maximum(node.b.minimum(t, clip), -clip)


def _rnn_step(node, d: Direction, gates: Tensor, h: Tensor, c, clip):
    return d.activations[0](_clipped(node, clip, gates + _recurrent(node, d, h))), None


def _gru_step(node, d: Direction, gates: Tensor, h: Tensor, c, clip):
    f, g = d.activations
    hidden = h.shape[1]
    x_z, x_r, x_h = gates.split(3, axis=1)
    r_z, r_r, r_h = d.r.split(3, axis=0)
    rb_z, rb_r, rb_h = d.r_bias.split(3, axis=0) if d.r_bias is not None else (None, None, None)

    def recurrent(weights, bias, state):
        product = node.b.matmul(state, weights, transpose_b=True)
        return product if bias is None else product + bias.reshape([1, hidden])

    z = f(_clipped(node, clip, x_z + recurrent(r_z, rb_z, h)))
    r = f(_clipped(node, clip, x_r + recurrent(r_r, rb_r, h)))
    if node.attr("linear_before_reset", 0):
        candidate = g(_clipped(node, clip, x_h + r * recurrent(r_h, rb_h, h)))
    else:
        candidate = g(_clipped(node, clip, x_h + recurrent(r_h, rb_h, r * h)))
    return (1.0 - z) * candidate + z * h, None


def _lstm_step(node, d: Direction, gates: Tensor, h: Tensor, c: Tensor, clip):
    f, g, activation_h = d.activations
    hidden = h.shape[1]
    i, o, forget, cell = (gates + _recurrent(node, d, h)).split(4, axis=1)
    if d.peepholes is not None:
        p_i, p_o, p_f = (p.reshape([1, hidden]) for p in d.peepholes.split(3, axis=0))
        i, forget = i + p_i * c, forget + p_f * c
    i = f(_clipped(node, clip, i))
    forget = 1.0 - i if node.attr("input_forget", 0) else f(_clipped(node, clip, forget))
    c = forget * c + i * g(_clipped(node, clip, cell))
    if d.peepholes is not None:
        o = o + p_o * c
    return f(_clipped(node, clip, o)) * activation_h(c), c


STEPS = {"RNN": _rnn_step, "GRU": _gru_step, "LSTM": _lstm_step}


def _recurrent(node: Node, d: Direction, h: Tensor) -> Tensor:
    product = node.b.matmul(h, d.r, transpose_b=True)
    return product if d.r_bias is None else product + d.r_bias.reshape([1, d.r_bias.shape[0]])


@converts("RNN", "GRU", "LSTM")
def recurrent(node: Node):
    op = node.proto.op_type
    layout = int(node.attr("layout", 0))
    if layout not in (0, 1):
        raise node.error(f"layout {layout} is not 0 ([seq, batch, ...]) or 1 ([batch, seq, ...])")
    x = node.tensor(0)
    if x.rank != 3 or x.dtype not in dtypes.FLOAT_DTYPES:
        raise node.error(f"its input {x.dtype}{x.shape} is not a floating-point [seq, batch, input] (or batch first)")
    x = x.transpose([1, 0, 2]) if layout else x
    hidden = int(node.attr("hidden_size", 0))
    if hidden < 1:
        raise node.error(f"hidden_size {hidden} must be given, at least 1")
    clip = node.attr("clip")
    clip = None if clip is None else float(clip)
    length, batch = x.shape[:2]
    valid = None
    if node.optional(4) is not None:
        lengths = node.tensor(4)
        if lengths.shape != [batch]:
            raise node.error(f"its sequence_lens of shape {lengths.shape} is not one length per item, [{batch}]")
        steps = node.b.const(np.arange(length, dtype=np.int64).reshape(length, 1, 1))
        valid = node.b.less(steps, lengths.cast(dtypes.DT_INT64).reshape([1, batch, 1]))
    outputs, finals_h, finals_c = [], [], []
    for d in _directions(node, x, hidden):
        # The input's share of the gates at every step: one [seq·batch, input] × [input, gates] product.
        gates = node.b.matmul(x.reshape([length * batch, x.shape[2]]), d.w, transpose_b=True)
        if d.w_bias is not None:
            gates = gates + d.w_bias.reshape([1, d.w_bias.shape[0]])
        gates = gates.reshape([length, batch, gates.shape[1]])
        h, c, ys = d.h, d.c, [None] * length
        for t in (reversed(range(length)) if d.reverse else range(length)):
            step_gates = node.b.slice(gates, [t, 0, 0], [1, batch, gates.shape[2]]).reshape([batch, gates.shape[2]])
            new_h, new_c = STEPS[op](node, d, step_gates, h, c, clip)
            if valid is None:
                h, c, ys[t] = new_h, new_c, new_h
            else:
                here = node.b.slice(valid, [t, 0, 0], [1, batch, 1]).reshape([batch, 1])
                h = node.b.cond(here, new_h, h)
                c = node.b.cond(here, new_c, c) if c is not None else None
                ys[t] = node.b.cond(here, new_h, new_h * 0.0)
        outputs.append(node.b.concat([y.reshape([1, 1, batch, hidden]) for y in ys], 0))
        finals_h.append(h.reshape([1, batch, hidden]))
        finals_c.append(c.reshape([1, batch, hidden]) if c is not None else None)
    y = outputs[0] if len(outputs) == 1 else node.b.concat(outputs, 1)  # [seq, directions, batch, hidden]
    y_h = finals_h[0] if len(finals_h) == 1 else node.b.concat(finals_h, 0)
    if layout:
        y, y_h = y.transpose([2, 0, 1, 3]), y_h.transpose([1, 0, 2])
    if op != "LSTM":
        return [y, y_h]
    y_c = finals_c[0] if len(finals_c) == 1 else node.b.concat(finals_c, 0)
    return [y, y_h, y_c.transpose([1, 0, 2]) if layout else y_c]
