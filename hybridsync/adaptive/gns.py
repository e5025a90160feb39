"""Gradient statistics: the squared norm of the true gradient |G|^2 and the per-sample gradient
variance tr(Sigma), from two gradients of the same step at two batch sizes.

A gradient averaged over b samples has E|g_b|^2 = |G|^2 + tr(Sigma)/b. Each rank's local gradient
(batch b) and the all-reduced one (batch N*b) give two such equations, solved for both unknowns
(Pollux, OSDI'21, appendix). One step's solution is very noisy, so each is smoothed by an
exponential moving average, bias-corrected like Adam's moments (the average starts at zero).
The average's memory is counted in samples, not steps: a step of `weight` base batches decays it
by smoothing ** weight (as AdaptDL does), so a big batch's statistics follow training as closely,
per sample seen, as a small one's. (Per step, a 4096 batch on a 512 base would keep ~20 steps'
memory -- 160 base steps of training, across which DLRM's noise scale grows ~100x -- and lag far
behind the state it is choosing for.)
"""
from __future__ import annotations

import math


def estimate(small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) from the mean |g|^2 of gradients over `small_batch` samples and |g|^2 of
    one over `big_batch` samples (unbiased; either may come out negative on a noisy step)."""
    if not big_batch > small_batch > 0:
        raise ValueError(f"need big_batch > small_batch > 0, got small_batch={small_batch}, big_batch={big_batch}")
    sqr = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    var = (small_sq - big_sq) * small_batch * big_batch / (big_batch - small_batch)
    return sqr, var


def all_finite(observations) -> bool:
    """Whether every squared norm of (name, small_sq, small_batch, big_sq, big_batch, weight)
    observations is finite."""
    return all(math.isfinite(o[1]) and math.isfinite(o[3]) for o in observations)


class _Smoothed:
    """A bias-corrected exponential moving average."""

    __slots__ = ("biased", "weight")

    def __init__(self):
        self.biased, self.weight = 0.0, 0.0

    def add(self, x: float, theta: float) -> None:
        self.biased = theta * self.biased + (1.0 - theta) * x
        self.weight = theta * self.weight + (1.0 - theta)

    def value(self) -> float:
        return self.biased / self.weight if self.weight > 0 else math.nan

    def state(self) -> list:
        return [self.biased, self.weight]

    def load(self, state) -> None:
        self.biased, self.weight = float(state[0]), float(state[1])


class GradientStats:
    """Smoothed |G|^2 and tr(Sigma) per variable; the model's are the sums over variables (the
    gradient is the concatenation of theirs)."""

    def __init__(self, smoothing: float = 0.8):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self._by_variable: dict[str, tuple[_Smoothed, _Smoothed]] = {}
        self.observations = 0
        self.nonfinite_steps = 0  # steps left out because a gradient norm was inf or NaN

    def observe(self, name: str, small_sq: float, small_batch: float, big_sq: float, big_batch: float,
                weight: float = 1.0) -> bool:
        """One step of variable `name`: mean |g|^2 at small_batch and |g|^2 at big_batch; the step
        counts as `weight` base-batch steps (its global batch / the base batch). A step of one
        variable only; see observe_step for the rest."""
        return self.observe_step([(name, small_sq, small_batch, big_sq, big_batch, weight)])

    def observe_step(self, observations) -> bool:
        """One step's observations, (name, small_sq, small_batch, big_sq, big_batch, weight) each,
        taken all or none: a step with an inf or NaN norm among them (a loss-scaled step that
        overflowed, which a GradScaler skips) is counted in nonfinite_steps and leaves the
        statistics as they were -- one such step would otherwise hold every average at NaN for
        good. Returns whether the step was taken."""
        observations = list(observations)
        for _, small_sq, small_batch, big_sq, big_batch, weight in observations:
            if not weight > 0:
                raise ValueError(f"weight must be > 0, got {weight}")
            if not big_batch > small_batch > 0:
                raise ValueError(f"need big_batch > small_batch > 0, got small_batch={small_batch}, "
                                 f"big_batch={big_batch}")
        if not all_finite(observations):
            self.skip_step()
            return False
        for name, small_sq, small_batch, big_sq, big_batch, weight in observations:
            sqr, var = estimate(small_sq, small_batch, big_sq, big_batch)
            pair = self._by_variable.get(name)
            if pair is None:
                pair = self._by_variable[name] = (_Smoothed(), _Smoothed())
            theta = self.smoothing ** weight
            pair[0].add(sqr, theta)
            pair[1].add(var, theta)
            self.observations += 1
        return True

    def skip_step(self) -> None:
        """A step left out (non-finite here or on another rank): counted, nothing else."""
        self.nonfinite_steps += 1

    def by_variable(self) -> dict:
        return {name: {"sqr": s.value(), "var": v.value()} for name, (s, v) in sorted(self._by_variable.items())}

    def summary(self) -> dict:
        """{"sqr", "var", "noise_scale", "by_variable", "nonfinite_steps"}; NaN before the first
        observation. A smoothed
        estimate can dip below zero early on: tr(Sigma) counts as 0 then, and |G|^2 <= 0 gives an
        infinite noise scale (all noise, as far as can be told)."""
        per = self.by_variable()
        if not per:
            return {"sqr": math.nan, "var": math.nan, "noise_scale": math.nan, "by_variable": {},
                    "nonfinite_steps": self.nonfinite_steps}
        sqr = sum(v["sqr"] for v in per.values())
        var = sum(v["var"] for v in per.values())
        var_pos = max(var, 0.0)
        noise = var_pos / sqr if sqr > 0 else (math.inf if var_pos > 0 else math.nan)
        return {"sqr": sqr, "var": var, "noise_scale": noise, "by_variable": per,
                "nonfinite_steps": self.nonfinite_steps}

    def ready(self) -> bool:
        return bool(self._by_variable)

    def state_dict(self) -> dict:
        return {"smoothing": self.smoothing, "observations": self.observations,
                "nonfinite_steps": self.nonfinite_steps,
                "by_variable": {n: [s.state(), v.state()] for n, (s, v) in self._by_variable.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.observations = int(state.get("observations", 0))
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self._by_variable = {}
        for name, (s, v) in state.get("by_variable", {}).items():
            pair = (_Smoothed(), _Smoothed())
            pair[0].load(s)
            pair[1].load(v)
            self._by_variable[name] = pair
