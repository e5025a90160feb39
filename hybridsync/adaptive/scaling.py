"""Learning-rate scaling rules: the factor the base learning rate (the one written for the base
batch size M0) is multiplied by when the batch is M = scale * M0.

adascale  AdaScale's gain (Johnson et al. 2020), for SGD: r = (tr(Sigma)/M0 + |G|^2) / (tr(Sigma)/M + |G|^2),
          between 1 (no noise: a bigger batch buys nothing) and scale (all noise: linear scaling)
sqrt      sqrt(scale), for adaptive optimizers (Adam, Adagrad), whose steps do not grow linearly
linear    scale (Goyal et al.)

Whatever the rule, progress is counted in scale-invariant steps: a step at batch M advances it by
the gain, the number of base-batch steps it is worth, so a schedule written for M0 still applies.
"""
from __future__ import annotations

import math


def gain(scale: float, sqr: float, var: float, base_batch: float) -> float:
    """AdaScale's gain at `scale` = M/M0, from |G|^2 and the per-sample tr(Sigma). 1 until the
    statistics exist; clipped to [1, scale] (a noisy estimate may fall outside)."""
    if scale <= 1.0 or not (math.isfinite(sqr) and math.isfinite(var)):
        return min(scale, 1.0) if scale > 0 else 1.0
    var, sqr = max(var, 0.0), max(sqr, 0.0)
    if var == 0.0 and sqr == 0.0:
        return 1.0
    batch = scale * base_batch
    r = (var / base_batch + sqr) / (var / batch + sqr)
    return min(max(r, 1.0), scale)


def adascale(scale: float, sqr: float, var: float, base_batch: float) -> float:
    return gain(scale, sqr, var, base_batch)


def sqrt(scale: float, sqr: float, var: float, base_batch: float) -> float:
    return math.sqrt(scale)


def linear(scale: float, sqr: float, var: float, base_batch: float) -> float:
    return float(scale)


RULES = {"adascale": adascale, "sqrt": sqrt, "linear": linear}

# Optimizers whose step size does not scale with the gradient (a square root suits them).
_ADAPTIVE_OPTIMIZERS = ("adam", "adagrad", "rmsprop", "adadelta", "adamax", "nadam", "lamb", "adafactor")


def adapts_per_coordinate(optimizer_name: str) -> bool:
    """Whether the optimizer (a class or server-rule name) steps each coordinate by its own
    statistics (Adagrad, Adam...): its tables' efficiency is counted row by row (rows.py)."""
    lowered = str(optimizer_name).lower()
    return any(k in lowered for k in _ADAPTIVE_OPTIMIZERS)


def rule_for(name: str | None, optimizer_class_name: str) -> str:
    """The rule's name: `name` when given ('auto' or None: adascale for SGD-like optimizers,
    sqrt for adaptive ones)."""
    if name in (None, "auto"):
        return "sqrt" if adapts_per_coordinate(optimizer_class_name) else "adascale"
    if name not in RULES:
        raise ValueError(f"AdaptiveConfig.scaling_rule: unknown rule '{name}'; choose one of "
                         f"{', '.join(sorted(RULES))} or 'auto'")
    return name
