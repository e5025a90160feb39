"""Learning-rate scaling rules: the factor the base learning rate (the one written for the base
batch size M0) is multiplied by when the batch is M = scale * M0.

adascale  AdaScale's gain (Johnson et al. 2020), for SGD: r = (tr(Sigma)/M0 + |G|^2) / (tr(Sigma)/M + |G|^2),
          between 1 (no noise: a bigger batch buys nothing) and scale (all noise: linear scaling)
sqrt      sqrt(scale), for adaptive optimizers with a moving-average denominator (Adam, RMSprop)
none      1, for Adagrad (what 'auto' picks for it): its denominator is the *sum* of past squared
          gradients, and a bigger batch's gradients are less noisy, so its steps already grow with
          the batch. With gradients g_t = G + noise of variance sigma^2 / M, T = N / M steps of
          lr g_t / sqrt(sum of g^2) move the parameters along G by about
          2 lr G sqrt(N) / sqrt(M |G|^2 + sigma^2): the same per sample whatever M while the noise
          dominates (one step is worth `scale` base steps, AdaScale's gain there), and one base
          step per step when it does not (gain 1) -- the gain's two limits, with the LR unchanged.
adagrad   sqrt((M + phi) / (M0 + phi)) = sqrt(scale / gain), phi the noise scale: keeps Adagrad's
          displacement per sample equal to the base batch's in the formula above, also where the
          noise does not dominate. Opt-in only: the factor *rises* as the noise scale falls, and a
          loss spike raises |G|^2 and lowers the measured noise scale, so the LR climbs while the
          loss does (measured on DLRM at batch 7496: factor 1.3 -> 3.8 in four steps, held-out loss
          0.26 -> 0.82; docs/adaptive.md).
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


def adagrad(scale: float, sqr: float, var: float, base_batch: float) -> float:
    """sqrt((M + phi) / (M0 + phi)); 1 until the statistics exist (see the module doc)."""
    if not (math.isfinite(sqr) and math.isfinite(var)) or scale <= 0:
        return 1.0
    var = max(var, 0.0)
    if sqr <= 0.0:  # all noise as far as can be told
        return 1.0
    phi = var / sqr
    return math.sqrt((scale * base_batch + phi) / (base_batch + phi))


def none(scale: float, sqr: float, var: float, base_batch: float) -> float:
    return 1.0


def linear(scale: float, sqr: float, var: float, base_batch: float) -> float:
    return float(scale)


RULES = {"adascale": adascale, "sqrt": sqrt, "adagrad": adagrad, "none": none, "linear": linear}

# Optimizers whose step size does not scale with the gradient (a square root suits them).
_ADAPTIVE_OPTIMIZERS = ("adam", "adagrad", "rmsprop", "adadelta", "adamax", "nadam", "lamb", "adafactor")


def accumulates_forever(optimizer_class_name: str) -> bool:
    """Whether the optimizer divides by the sum of *all* past squared gradients (Adagrad: torch's,
    Keras's, the PS's 'adagrad' server rule that a wrapped Adagrad gives its tables), rather than
    by a moving average (Adam, RMSprop) or not at all (SGD)."""
    return "adagrad" in optimizer_class_name.lower()


def leaves_lr_unscaled(rule: str | None) -> bool:
    """Whether the rule (a resolved name, or None: statistics only) keeps the base learning rate."""
    return rule in (None, "none")


RESCALE_SETTINGS = ("auto", True, False)


def rescales_accumulators(setting, optimizer_class_name: str, rule: str | None) -> bool:
    """Whether a batch change rescales the accumulated squared gradients (AdaptiveConfig's
    rescale_accumulators, already validated): 'auto' turns it on where the optimizer accumulates
    forever (Adagrad) and its rule leaves the learning rate unscaled -- there the history of the
    smaller batch's steps is what the bigger batch's steps inherit (docs/adaptive.md, "Adagrad's
    accumulators across a batch change"); a rule that scales the LR already compensates."""
    if setting == "auto":
        return accumulates_forever(optimizer_class_name) and leaves_lr_unscaled(rule)
    return bool(setting)


def accumulator_factor(old_batch: float, new_batch: float, noise_scale: float) -> float:
    """What an accumulate-forever optimizer's sum of squared gradients is multiplied by when the
    global batch goes from b = old_batch to B = new_batch, so that it holds what a run at B would
    have accumulated over the same samples: a sample adds E g^2 / M ~ |G|^2 (M + phi) / M^2 at
    batch M (phi the gradient noise scale), so

        f = ((B + phi) / B^2) / ((b + phi) / b^2),

    b / B where the gradient dominates (phi = 0) and (b / B)^2 where the noise does (phi = inf:
    the "all noise" reading the statistics give where |G|^2 is not above zero). Exactly 1 when
    b == B. NaN when phi is NaN (no statistics yet): there is nothing to rescale with, and the
    caller leaves the state as it is. A negative phi (not produced by the statistics) counts as 0."""
    b, big = float(old_batch), float(new_batch)
    if not (b > 0 and big > 0):
        raise ValueError(f"accumulator_factor: batches must be > 0, got {old_batch} -> {new_batch}")
    if b == big:
        return 1.0
    if math.isnan(noise_scale):
        return math.nan
    if noise_scale == math.inf:
        return (b / big) ** 2
    phi = max(float(noise_scale), 0.0)
    # (b^2 (B + phi)) / (B^2 (b + phi)), as two ratios of like magnitude: no overflow at a huge phi
    return (b / big) ** 2 * ((big + phi) / (b + phi))


def rule_for(name: str | None, optimizer_class_name: str) -> str:
    """The rule's name: `name` when given ('auto' or None: adascale for SGD-like optimizers,
    none for Adagrad, sqrt for the other adaptive ones)."""
    if name in (None, "auto"):
        lowered = optimizer_class_name.lower()
        if accumulates_forever(optimizer_class_name):
            return "none"
        return "sqrt" if any(k in lowered for k in _ADAPTIVE_OPTIMIZERS) else "adascale"
    if name not in RULES:
        raise ValueError(f"AdaptiveConfig.scaling_rule: unknown rule '{name}'; choose one of "
                         f"{', '.join(sorted(RULES))} or 'auto'")
    return name
