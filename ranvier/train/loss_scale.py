"""Loss scaling for low-precision gradients: static, or dynamic (grow after N good steps,
back off and skip the update when a gradient is not finite)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..flow.builder import Builder, Tensor


@dataclass(frozen=True)
class DynamicLossScale:
    initial: float = 2.0**15
    growth_interval: int = 2000
    factor: float = 2.0
    minimum: float = 1.0


def scale_tensor(b: Builder, loss_scale, prefix: str) -> Tensor | None:
    """The loss scale as a graph scalar: a constant when static, the resident global
    `<prefix>/loss_scale` when dynamic."""
    if loss_scale is None:
        return None
    if isinstance(loss_scale, DynamicLossScale):
        return _global(b, f"{prefix}/loss_scale", loss_scale.initial)
    return b.const(float(loss_scale))


def _global(b: Builder, name: str, value: float) -> Tensor:
    if name in b.flow.vars:
        return b.wrap(b.flow.vars[name])
    var = b.flow.add_var(name, "float32", [])
    var.set_data(np.float32(value))
    var.nogradient = True
    return b.wrap(var)


def dynamic_updates(b: Builder, policy: DynamicLossScale, scale: Tensor, finite: Tensor):
    """New values of the scale and the good-step counter after one step."""
    good = _global(b, f"{scale.name}_good_steps", 0.0)
    grown = good + 1.0
    grow = grown >= float(policy.growth_interval)
    on_success_scale = b.cond(grow, scale * policy.factor, scale)
    on_success_good = b.cond(grow, b.const(0.0), grown)
    backed_off = b.maximum(scale * (1.0 / policy.factor), b.const(float(policy.minimum)))
    return [
        (scale.var, b.cond(finite, on_success_scale, backed_off)),
        (good.var, b.cond(finite, on_success_good, b.const(0.0))),
    ]
