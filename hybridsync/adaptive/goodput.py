"""Goodput = throughput x statistical efficiency (Pollux), and the batch size that maximises it.

Throughput comes from a model fitted online to measured step times: a step of local batch b
with k accumulation micro-steps on N ranks takes

    k * t_micro(b) + t_sync(b)      t_micro(b) = a_c + b_c * b   (forward, backward, PS pulls)
                                    t_sync(b)  = a_s + b_s * b   (dense all-reduce: constant in b;
                                                                  PS push: grows with the rows)

each line fitted to this world size's measurements -- not to every step, but to each batch
size's robust median: a shared machine's steps scatter (another job's burst, an evaluation or a
checkpoint in the same step), so each size keeps its newest steps, drops those far outside their
median (beyond OUTLIER median absolute deviations), and contributes the median of the rest with
its standard error. The model says how sure it is of a prediction (uncertainty()): the size's
own standard error, or between measured sizes the larger of its neighbours', plus how far the
medians lie off the lines; beyond the measured sizes it cannot say (None: an extrapolation).

With one batch size seen so far, the lines cannot be told apart from a constant: the whole step
is taken as fixed cost, the guess most favourable to a bigger batch (optimism where nothing is
known), so the choice tries one -- at most AdaptiveConfig.explore times the largest measured --
whenever the statistical efficiency lost there could be paid for, and the next fit, from two
sizes, corrects the guess and extrapolates further (reach()). (Taking compute as proportional to
the batch instead would never explore: a job whose steps are mostly per-step overhead would stay
at its first batch.)

Statistical efficiency of a global batch M against the base M0 is the AdaScale gain per unit of
scale, (phi + M0) / (phi + M) with phi = tr(Sigma)/|G|^2 the noise scale (the 'goodput' model) --
for embedding tables too: a table's row-update frequency is in its noise scale (docs/adaptive.md,
"Embedding tables"). Under Adagrad at an unscaled learning rate that undervalues big batches, and
its square root, sqrt((phi + M0) / (phi + M)) (the 'sqrt' model), is used instead: an empirical
fit, measured on DLRM and word2vec only (docs/adaptive.md, "Statistical efficiency under
Adagrad"). efficiency_model_for() decides which, once per optimizer.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import scaling

OUTLIER = 4.0  # a step further than this many (scaled) median absolute deviations from its size's median is dropped
MIN_SAMPLES = 3  # steps of a batch size before its median counts as measured
PER_SIZE = 32  # newest steps kept per batch size


EFFICIENCY_MODELS = ("goodput", "sqrt")


def efficiency(batch: float, base_batch: float, noise_scale: float, model: str = "goodput") -> float:
    """Progress per sample at global batch `batch` relative to `base_batch` (<= 1 above it), under
    the efficiency model `model` (EFFICIENCY_MODELS; see the module doc)."""
    if model not in EFFICIENCY_MODELS:
        raise ValueError(f"efficiency model '{model}' is not one of {', '.join(EFFICIENCY_MODELS)}")
    if not math.isfinite(noise_scale):
        return 1.0
    phi = max(noise_scale, 0.0)
    ratio = (phi + base_batch) / (phi + batch)
    return math.sqrt(ratio) if model == "sqrt" else ratio


def efficiency_model_for(optimizer_class_name: str, rule: str | None) -> tuple[str, str]:
    """(model, why) for an optimizer under a resolved scaling rule (None: statistics only, the LR
    left alone). 'sqrt' exactly where it was measured to fit: an accumulate-forever preconditioner
    (Adagrad) at an unscaled LR, whose steps already grow with a less noisy gradient; 'goodput'
    for everything else (SGD, Adam, ..., and Adagrad under a rule that scales its LR)."""
    named = f"rule {rule}" if rule else "no rule: statistics only"
    formula = "(phi + M0) / (phi + M)"
    if not scaling.accumulates_forever(optimizer_class_name):
        return "goodput", f"{formula}, for {optimizer_class_name} ({named})"
    if scaling.leaves_lr_unscaled(rule):
        return "sqrt", (f"sqrt({formula}), for {optimizer_class_name} at an unscaled LR ({named}): "
                        "the form measured to fit Adagrad there (docs/adaptive.md)")
    return "goodput", (f"{formula}, for {optimizer_class_name} with its LR scaled ({named}): "
                       "the square root was measured at an unscaled LR only")


def robust_median(values) -> tuple[float, float, int]:
    """(median, its standard error, count) of `values` after dropping outliers: those further
    than OUTLIER scaled median absolute deviations (MAD x 1.4826, a standard deviation for normal
    data; at least 1% of the median, so identical steps do not make every other one an outlier).
    The standard error is that of a median, 1.2533 sd / sqrt(n); inf for a single value."""
    x = np.asarray(values, float)
    med = float(np.median(x))
    spread = max(1.4826 * float(np.median(np.abs(x - med))), 0.01 * abs(med))
    kept = x[np.abs(x - med) <= OUTLIER * spread]
    med = float(np.median(kept))
    sd = 1.4826 * float(np.median(np.abs(kept - med)))
    se = 1.2533 * sd / math.sqrt(len(kept)) if len(kept) > 1 else math.inf
    return med, se, int(len(kept))


def _line(xs, ys, constant_if_unknown: bool = False) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y against x; when x never varied, through the origin (or, with
    constant_if_unknown, flat)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(set(xs.tolist())) < 2:
        if constant_if_unknown:
            return float(np.median(ys)), 0.0
        return 0.0, float(np.median(ys / np.maximum(xs, 1e-9)))
    slope, intercept = np.polyfit(xs, ys, 1)
    if slope < 0:  # noise: time cannot fall as the batch grows
        return float(np.median(ys)), 0.0
    if intercept < 0:
        return 0.0, float(np.median(ys / xs))
    return float(intercept), float(slope)


class ThroughputModel:
    """Step times per world size: for each local batch size, its newest PER_SIZE steps'
    (seconds per micro-step, sync seconds, micro-steps)."""

    def __init__(self):
        self._samples: dict[int, dict[int, list]] = {}
        self._cache: dict[int, tuple] = {}  # world -> (per-size summary, params), until the next record

    def record(self, world: int, local_batch: int, micro_s: float, sync_s: float, accumulation: int = 1) -> None:
        rows = self._samples.setdefault(int(world), {}).setdefault(int(local_batch), [])
        rows.append((float(micro_s), float(sync_s), max(1, int(accumulation))))
        del rows[:-PER_SIZE]
        self._cache.pop(int(world), None)

    def forget(self, world: int) -> None:
        """Drops every step time measured at this world size (they were of other routes)."""
        self._samples.pop(int(world), None)
        self._cache.pop(int(world), None)

    def reach(self, world: int, explore: float) -> tuple[float, float]:
        """(lowest, highest) local batch a choice may go to at this world size: how far the
        lines can be trusted outside the sizes measured. Downwards `explore` times below the
        smallest. Upwards `explore` times beyond the largest, and as far again as the sizes with a
        median span (largest / smallest of them), up to `explore` times more: one size says
        nothing of the slope, so the first probe is a doubling (explore 2) on the optimistic guess;
        a line through two or more sizes extrapolates, its error growing with the distance from
        them relative to their spread, so from then on a probe may go up to explore^2 = 4 times the
        largest, to the optimum the line predicts (512 and 1024 measured: up to 4096), not one
        doubling per decision. (A line through sizes whose medians are still noisy can come out
        flat and make every bigger batch look free: the cap keeps such a probe's overshoot, and
        its cost until it is measured and left, to explore^2.) (0, 0) when nothing is measured."""
        by_size = self._samples.get(int(world), {})
        if not by_size:
            return 0.0, 0.0
        with_median = [b for b, rows in by_size.items() if len(rows) >= MIN_SAMPLES]
        span = max(with_median) / min(with_median) if with_median else 1.0
        return min(by_size) / explore, max(by_size) * explore * min(span, explore)

    def fitted(self, world: int) -> bool:
        return bool(self._samples.get(int(world)))

    def measured(self, world: int, local_batch: int) -> bool:
        """Whether this local batch has enough steps (MIN_SAMPLES) for its median to count."""
        return len(self._samples.get(int(world), {}).get(int(local_batch), ())) >= MIN_SAMPLES

    def sizes(self, world: int) -> dict:
        """local batch -> (median s per micro-step, median sync s, relative standard error of
        the median step, steps kept) of every size measured here."""
        return self._model(world)[0]

    def _model(self, world: int) -> tuple:
        cached = self._cache.get(int(world))
        if cached is not None:
            return cached
        by_size = self._samples.get(int(world))
        if not by_size:
            raise ValueError(f"no step times measured at world size {world} yet")
        # Each batch size's robust median step, then lines through those: a step that also ran an
        # evaluation, a checkpoint or another job's burst is an outlier, and it comes every so many
        # samples (an evaluation: more often per step at a bigger batch) -- a least-squares fit
        # through the raw steps took it as a cost of the batch and led the choice away from big
        # batches. Sizes with too few steps for a median join the fit only when nothing else can.
        summary = {}
        for b, rows in sorted(by_size.items()):
            micro = robust_median([m for m, _, _ in rows])[0]
            sync = robust_median([s_ for _, s_, _ in rows])[0]
            total, se, n = robust_median([k * m + s_ for m, s_, k in rows])
            summary[b] = (micro, sync, se / total if total > 0 else math.inf, n)
        fit_sizes = [b for b, v in summary.items() if len(by_size[b]) >= MIN_SAMPLES] or list(summary)
        xs = fit_sizes
        params = (*_line(xs, [summary[b][0] for b in xs], constant_if_unknown=True),
                  *_line(xs, [summary[b][1] for b in xs], constant_if_unknown=True))
        measured = {b: summary[b] for b in fit_sizes if len(by_size[b]) >= MIN_SAMPLES}
        # How far the measured medians lie off the lines beyond what their own standard errors
        # explain (relative, root mean square): a model error (the step time is not a line in
        # the batch) that no median's error shows.
        residual = 0.0
        if len(measured) >= 3:
            ac, bc, as_, bs = params
            rel = [((ac + bc * b) + (as_ + bs * b)) / (m + s_) - 1.0 for b, (m, s_, _, _) in measured.items()]
            errors = [e for _, _, e, _ in measured.values()]
            residual = math.sqrt(max(float(np.mean(np.square(rel)) - np.mean(np.square(errors))), 0.0))
        cached = self._cache[int(world)] = (measured, params, residual)
        return cached

    def params(self, world: int) -> tuple[float, float, float, float]:
        return self._model(world)[1]

    def step_time(self, world: int, local_batch: float, accumulation: int = 1) -> float:
        ac, bc, as_, bs = self.params(world)
        return accumulation * (ac + bc * local_batch) + as_ + bs * local_batch

    def throughput(self, world: int, local_batch: float, accumulation: int = 1) -> float:
        return world * local_batch * accumulation / self.step_time(world, local_batch, accumulation)

    def uncertainty(self, world: int, local_batch: float) -> float | None:
        """The relative standard error of the predicted step time at this local batch: a
        measured size's own (its median's), between measured sizes the larger of its two
        neighbours', each with the lines' misfit added; None outside the measured sizes (an
        extrapolation: nothing measured says how wrong it may be)."""
        measured, _, residual = self._model(world)
        if not measured:
            return None
        b = float(local_batch)
        if b in measured:
            err = measured[b][2]
        else:
            below = [s for s in measured if s < b]
            above = [s for s in measured if s > b]
            if not below or not above:
                return None
            err = max(measured[max(below)][2], measured[min(above)][2])
        return math.sqrt(err * err + residual * residual)

    def state_dict(self) -> dict:
        return {"samples": {str(w): [[b, *r] for b, rows in sizes.items() for r in rows]
                            for w, sizes in self._samples.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._samples, self._cache = {}, {}
        for w, rows in state.get("samples", {}).items():
            for row in rows:  # (local batch, micro s, sync s[, micro-steps]: older checkpoints have none)
                self.record(int(w), int(row[0]), row[1], row[2], int(row[3]) if len(row) > 3 else 1)


# What a decision was, in the order the exchange encodes them (exchange.py).
KINDS = ("keep", "probe", "move", "return", "limits", "restored")


@dataclasses.dataclass(frozen=True)
class BatchChoice:
    """A batch size, with what was predicted of it. As a decision (Adaptive.choose): `kind` is
    'probe' (beyond the sizes measured: a trial, judged once measured), 'move' (within them),
    'return' (back from a probe measured worse), 'limits' (the batch in force broke the loader's
    limits) or 'restored' (a restored batch made allowed, no statistics of this run yet); `gain`
    the predicted goodput against the batch in force, `threshold` the gain it had to beat."""

    local_batch: int
    accumulation: int
    world: int
    goodput: float  # predicted samples/s of base-batch-equivalent progress
    efficiency: float
    kind: str = "keep"
    gain: float = 1.0
    threshold: float = 1.0
    noise_scale: float = dataclasses.field(default=math.nan, compare=False)  # the one decided with (NaN != NaN)

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.accumulation * self.world


def _grid(lo: int, hi: int, points: int = 48) -> list[int]:
    if hi <= lo:
        return [lo]
    values = np.unique(np.round(np.geomspace(lo, hi, points)).astype(int))
    return sorted(set(values.tolist()) | {lo, hi})


def goodput(model: ThroughputModel, world: int, local_batch: int, accumulation: int, base_batch: float,
            noise_scale: float, efficiency_of=None) -> float:
    """Predicted goodput; efficiency_of(global batch) replaces the noise-scale formula when given."""
    batch = world * local_batch * accumulation
    eff = efficiency_of(batch) if efficiency_of is not None else efficiency(batch, base_batch, noise_scale)
    return model.throughput(world, local_batch, accumulation) * eff


def allowed(world: int, local_batch: int, accumulation: int, max_batch: int, local_bounds: tuple[int, int],
            max_accumulation: int) -> bool:
    """Whether (local batch, accumulation) keeps within the loader's limits at this world size."""
    lo, hi = int(local_bounds[0]), int(local_bounds[1])
    return (lo <= local_batch <= hi and 1 <= accumulation <= max(1, int(max_accumulation))
            and world * local_batch * accumulation <= max_batch)


def nearest_allowed(world: int, global_batch: int, max_batch: int, local_bounds: tuple[int, int],
                    max_accumulation: int) -> tuple[int, int]:
    """The allowed (local batch, accumulation) whose global batch is nearest `global_batch`
    (ties: fewer micro-steps, then the smaller batch) -- a batch restored at another world size."""
    lo, hi = int(local_bounds[0]), int(local_bounds[1])
    best = None
    for k in range(1, max(1, int(max_accumulation)) + 1):
        for b in range(lo, hi + 1):
            batch = world * b * k
            if batch > max_batch:
                break
            key = (abs(batch - global_batch), k, batch)
            if best is None or key < best[0]:
                best = (key, (b, k))
    return best[1] if best is not None else (lo, 1)


def choose_batch(model: ThroughputModel, world: int, base_batch: int, noise_scale: float, max_batch: int,
                 local_bounds: tuple[int, int], max_accumulation: int = 1, min_accumulation: int = 1,
                 efficiency_of=None, global_bounds: tuple[float, float] = (0, math.inf)) -> BatchChoice:
    """The (local batch, accumulation) maximising predicted goodput with the global batch in
    [base_batch, max_batch] (never below the base: the LR rules assume scale >= 1) and within
    global_bounds (exclusive: the sizes hysteresis bars), the local batch within local_bounds,
    and min_accumulation..max_accumulation micro-steps. Deterministic: the same inputs give the
    same choice on every rank."""
    lo, hi = int(local_bounds[0]), int(local_bounds[1])
    if not 1 <= lo <= hi:
        raise ValueError(f"local_bsz_bounds must be 1 <= lo <= hi, got {local_bounds}")
    eff = efficiency_of or (lambda batch: efficiency(batch, base_batch, noise_scale))
    best = None
    for k in range(max(1, int(min_accumulation)), max(1, int(max_accumulation)) + 1):
        for b in _grid(lo, hi):
            batch = world * b * k
            if batch > max_batch or batch < base_batch or not global_bounds[0] < batch < global_bounds[1]:
                continue
            g = model.throughput(world, b, k) * eff(batch)
            if best is None or g > best.goodput * (1 + 1e-12):
                best = BatchChoice(b, k, world, g, eff(batch))
    if best is None:  # no allowed size reaches the base batch: the largest one allowed
        k = max(1, min(int(min_accumulation), int(max_accumulation)))
        b = max(lo, min(hi, max_batch // (world * k)))
        best = BatchChoice(b, k, world, model.throughput(world, b, k) * eff(world * b * k), eff(world * b * k))
    return best
