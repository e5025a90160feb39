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
    """A bias-corrected exponential moving average, with what its uncertainty needs: the sum of
    the squared weights (how many observations it effectively holds)."""

    __slots__ = ("biased", "weight", "weight_sq")

    def __init__(self):
        self.biased, self.weight, self.weight_sq = 0.0, 0.0, 0.0

    def add(self, x: float, theta: float) -> None:
        self.biased = theta * self.biased + (1.0 - theta) * x
        self.weight = theta * self.weight + (1.0 - theta)
        self.weight_sq = theta * theta * self.weight_sq + (1.0 - theta) ** 2

    def value(self) -> float:
        return self.biased / self.weight if self.weight > 0 else math.nan

    def effective_count(self) -> float:
        """Observations the average effectively holds, (sum w)^2 / sum w^2 (1 for one)."""
        return self.weight ** 2 / self.weight_sq if self.weight_sq > 0 else 0.0

    def state(self) -> list:
        return [self.biased, self.weight, self.weight_sq]

    def load(self, state) -> None:
        self.biased, self.weight = float(state[0]), float(state[1])
        # (a checkpoint from before the uncertainty: as if the average held one observation)
        self.weight_sq = float(state[2]) if len(state) > 2 else self.weight ** 2


class _Moments:
    """One variable's smoothed |G|^2 and tr(Sigma) estimates, and the smoothed second moments
    of the per-step estimates, which give the averages' standard errors: a step's estimate
    spreads around the truth (the norms of a few gradients), and the average holds only so many
    steps -- at a big batch, counted in samples, few."""

    __slots__ = ("sqr", "var", "sqr2", "var2", "cross")

    def __init__(self):
        self.sqr, self.var, self.sqr2, self.var2, self.cross = (_Smoothed() for _ in range(5))

    def add(self, sqr: float, var: float, theta: float) -> None:
        self.sqr.add(sqr, theta)
        self.var.add(var, theta)
        self.sqr2.add(sqr * sqr, theta)
        self.var2.add(var * var, theta)
        self.cross.add(sqr * var, theta)

    def errors(self) -> tuple[float, float, float]:
        """(Var of the smoothed |G|^2, Var of the smoothed tr(Sigma), their covariance): the
        weighted spread of the steps' estimates (Bessel-corrected for the effective count)
        times the average's sum of squared weights. inf while the average holds about one
        observation (nothing to tell the spread from)."""
        n = self.sqr.effective_count()
        if n <= 1.0 + 1e-9:
            return math.inf, math.inf, 0.0
        s, v = self.sqr.value(), self.var.value()
        bessel = n / (n - 1.0)
        spread_s = max(self.sqr2.value() - s * s, 0.0) * bessel
        spread_v = max(self.var2.value() - v * v, 0.0) * bessel
        spread_sv = (self.cross.value() - s * v) * bessel
        return spread_s / n, spread_v / n, spread_sv / n

    def state(self) -> list:
        return [m.state() for m in (self.sqr, self.var, self.sqr2, self.var2, self.cross)]

    def load(self, state) -> None:
        self.sqr.load(state[0])
        self.var.load(state[1])
        if len(state) > 2:
            for m, st in zip((self.sqr2, self.var2, self.cross), state[2:]):
                m.load(st)
        else:  # a checkpoint from before the uncertainty: no spread known, one observation
            s, v = self.sqr.value(), self.var.value()
            for m, x in ((self.sqr2, s * s), (self.var2, v * v), (self.cross, s * v)):
                m.biased, m.weight, m.weight_sq = x * self.sqr.weight, self.sqr.weight, self.sqr.weight ** 2
            for m in (self.sqr, self.var):
                m.weight_sq = m.weight ** 2


class GradientStats:
    """Smoothed |G|^2 and tr(Sigma) per variable; the model's are the sums over variables (the
    gradient is the concatenation of theirs).

    Two sets of averages of the same steps. The statistics (summary(): what the learning-rate
    rules and the reports use) remember in samples, `smoothing` per base batch, to follow the
    model's state as closely at any batch size. The steady ones (steady(): what the batch
    decisions use) remember at least as many steps as the base batch's average does: at a big
    batch the first hold about one step (at 16 base batches per step, 0.8^16 = 0.03 of the past
    is kept), a single draw whose noise scale jumps from step to step, while the batch is decided
    on only every few steps anyway."""

    def __init__(self, smoothing: float = 0.8):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"adaptive: smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self._by_variable: dict[str, _Moments] = {}
        self._steady: dict[str, _Moments] = {}
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
            theta = self.smoothing ** weight
            self._by_variable.setdefault(name, _Moments()).add(sqr, var, theta)
            self._steady.setdefault(name, _Moments()).add(sqr, var, max(theta, self.smoothing))
            self.observations += 1
        return True

    def skip_step(self) -> None:
        """A step left out (non-finite here or on another rank): counted, nothing else."""
        self.nonfinite_steps += 1

    def by_variable(self) -> dict:
        return _per_variable(self._by_variable)

    def summary(self) -> dict:
        """{"sqr", "var", "noise_scale", "by_variable", "nonfinite_steps"}; NaN before the first
        observation. A smoothed
        estimate can dip below zero early on: tr(Sigma) counts as 0 then, and |G|^2 <= 0 gives an
        infinite noise scale (all noise, as far as can be told)."""
        return {**_totals(self._by_variable), "nonfinite_steps": self.nonfinite_steps}

    def steady(self) -> dict:
        """The steady averages (see the class): {"sqr", "var", "noise_scale", "by_variable",
        "noise_scale_error", "noise_scale_bounds"}: the noise scale's relative standard error
        (delta method, from each variable's averages' errors, the variables taken as
        independent; inf while it cannot be told: too few steps held, or |G|^2 not above zero),
        and the noise scale one standard error below and above. With |G|^2 not above zero the
        noise scale reads inf (all noise), and the lower bound is tr(Sigma) over |G|^2 one
        standard error up: how small it may yet be."""
        totals = _totals(self._steady)
        error = _relative_error(self._steady, totals)
        phi = totals["noise_scale"]
        if math.isfinite(error):
            bounds = (phi / (1.0 + error), phi * (1.0 + error))
        elif phi == math.inf:
            se_sqr = math.sqrt(sum(m.errors()[0] for m in self._steady.values()))
            upper = totals["sqr"] + se_sqr
            bounds = (max(totals["var"], 0.0) / upper if upper > 0 else math.inf, math.inf)
        else:
            bounds = (0.0, math.inf)
        return {**totals, "noise_scale_error": error, "noise_scale_bounds": bounds}

    def ready(self) -> bool:
        return bool(self._by_variable)

    def state_dict(self) -> dict:
        return {"smoothing": self.smoothing, "observations": self.observations,
                "nonfinite_steps": self.nonfinite_steps,
                "by_variable": {n: m.state() for n, m in self._by_variable.items()},
                "steady": {n: m.state() for n, m in self._steady.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.observations = int(state.get("observations", 0))
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self._by_variable = _load(state.get("by_variable", {}))
        # (a checkpoint from before the steady averages: they start from the statistics)
        self._steady = _load(state.get("steady", state.get("by_variable", {})))


def _load(saved: dict) -> dict:
    out = {}
    for name, state in saved.items():
        out[name] = _Moments()
        out[name].load(state)
    return out


def _per_variable(moments: dict) -> dict:
    return {name: {"sqr": m.sqr.value(), "var": m.var.value()} for name, m in sorted(moments.items())}


def _totals(moments: dict) -> dict:
    per = _per_variable(moments)
    if not per:
        return {"sqr": math.nan, "var": math.nan, "noise_scale": math.nan, "by_variable": {}}
    sqr = sum(v["sqr"] for v in per.values())
    var = sum(v["var"] for v in per.values())
    var_pos = max(var, 0.0)
    noise = var_pos / sqr if sqr > 0 else (math.inf if var_pos > 0 else math.nan)
    return {"sqr": sqr, "var": var, "noise_scale": noise, "by_variable": per}


def _relative_error(moments: dict, totals: dict) -> float:
    sqr, var = totals["sqr"], totals["var"]
    if not moments or not (sqr > 0 and var > 0):
        return math.inf
    var_s = var_v = cov = 0.0
    for m in moments.values():
        es, ev, esv = m.errors()
        var_s, var_v, cov = var_s + es, var_v + ev, cov + esv
    if math.isinf(var_s) or math.isinf(var_v):
        return math.inf
    rel = var_v / var ** 2 + var_s / sqr ** 2 - 2.0 * cov / (var * sqr)
    return math.sqrt(max(rel, 0.0))
