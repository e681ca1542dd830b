"""Optimizers as graph builders: each adds the ops computing new parameter and state values.

An optimizer returns (variable, new value) pairs instead of writing directly, so the
trainer can guard every write (skip the step on non-finite gradients), thread values
from one unrolled step to the next, and then emit the in-place `Assign`s. State
(momenta, step counters) lives in network globals next to the parameters and stays
resident between steps. The math follows PyTorch's SGD, Adam and AdamW exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..flow.builder import Builder, Tensor
from ..flow.graph import Variable

Update = tuple[Variable, Tensor]
Current = dict[str, Tensor]


def current_value(current: Current | None, resident: Tensor) -> Tensor:
    """The latest value of a resident variable: its update from an earlier unrolled step, if any."""
    return (current or {}).get(resident.name, resident)


def state_var(b: Builder, param: Variable, suffix: str) -> Tensor:
    """A zero-initialized resident global beside a parameter, e.g. `mlp/W0/adam_m`."""
    name = f"{param.name}/{suffix}"
    if name not in b.flow.vars:
        var = b.flow.add_var(name, param.dtype, param.shape)
        var.set_data(np.zeros(param.shape, dtypes.to_numpy(param.dtype)))  # (in float64, converting touched every page)
        var.nogradient = True
    return b.wrap(b.flow.vars[name])


def counter_var(b: Builder, name: str) -> Tensor:
    if name not in b.flow.vars:
        var = b.flow.add_var(name, "float32", [])
        var.set_data(np.zeros((), np.float32))
        var.nogradient = True
    return b.wrap(b.flow.vars[name])


def _as(b: Builder, scalar: Tensor, like: Tensor) -> Tensor:
    return scalar if scalar.dtype == like.dtype else b.cast(scalar, like.dtype)


@dataclass
class SGD:
    """SGD with optional momentum (Nesterov) and L2 weight decay, as torch.optim.SGD.

    Gradients scaled by a loss scale S are divided by S before the step.
    """

    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def updates(
        self, b: Builder, params: list[Tensor], grads: list[Tensor], lr: Tensor,
        loss_scale: Tensor | None = None, current: Current | None = None, scope: str | None = None,
    ) -> list[Update]:
        """(variable, new value) for every parameter and state variable; state that is not
        per parameter is named after `scope` (default: b's function)."""
        result: list[Update] = []
        for param, g in zip(params, grads):
            p = current_value(current, param)
            if loss_scale is not None:
                g = g / _as(b, loss_scale, g)
            if self.weight_decay:
                g = g + p * self.weight_decay
            if self.momentum:
                buf = state_var(b, param.var, "momentum")
                new_buf = current_value(current, buf) * self.momentum + g
                result.append((buf.var, new_buf))
                g = g + new_buf * self.momentum if self.nesterov else new_buf
            result.append((param.var, p - g * _as(b, lr, p)))
        return result


@dataclass
class Adam:
    """Adam as torch.optim.Adam (weight_decay adds L2 to the gradient).

    decay_matrices_only: weight decay for parameters of rank 2 or more only (not for
    norms' scales and biases), as Llama training does.

    With a loss scale S the gradients stay scaled: m scales by S and v by S², so
    m̂/√v̂ is unchanged and the step must not be divided by S (eps is scaled instead).
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_matrices_only: bool = False
    decoupled = False

    def updates(
        self, b: Builder, params: list[Tensor], grads: list[Tensor], lr: Tensor,
        loss_scale: Tensor | None = None, current: Current | None = None, scope: str | None = None,
    ) -> list[Update]:
        """(variable, new value) for every parameter and state variable; state that is not
        per parameter is named after `scope` (default: b's function)."""
        step = counter_var(b, f"{scope or b.func.name}/adam_step")
        t = current_value(current, step) + 1.0
        correction1 = 1.0 - b.pow(b.const(self.beta1), t)
        correction2 = 1.0 - b.pow(b.const(self.beta2), t)
        # torch's algebra: lr_t = lr·√(1 − β2ᵗ)/(1 − β1ᵗ) and eps_t = eps·√(1 − β2ᵗ), one scalar each.
        lr_t = lr * b.sqrt(correction2) / correction1
        eps_t = b.sqrt(correction2) * self.eps
        if loss_scale is not None:
            eps_t = eps_t * loss_scale
        result: list[Update] = [(step.var, t)]
        for param, g in zip(params, grads):
            p = current_value(current, param)
            m_var, v_var = state_var(b, param.var, "adam_m"), state_var(b, param.var, "adam_v")
            m, v = current_value(current, m_var), current_value(current, v_var)
            decay = self.weight_decay if param.rank >= 2 or not self.decay_matrices_only else 0.0
            if decay and not self.decoupled:
                l2 = p * decay
                g = g + (l2 * _as(b, loss_scale, p) if loss_scale is not None else l2)
            new_m = m * self.beta1 + g * (1.0 - self.beta1)
            new_v = v * self.beta2 + g * g * (1.0 - self.beta2)
            base = p * (1.0 - _as(b, lr, p) * decay) if decay and self.decoupled else p
            new_p = base - _as(b, lr_t, p) * new_m / (b.sqrt(new_v) + _as(b, eps_t, p))
            result += [(m_var.var, new_m), (v_var.var, new_v), (param.var, new_p)]
        return result


@dataclass
class AdamW(Adam):
    """AdamW as torch.optim.AdamW: weight decay decoupled from the gradient (p ← p·(1 − lr·wd))."""

    weight_decay: float = 0.01
    decoupled = True
