"""Goodput = throughput x statistical efficiency (Pollux), and the batch size that maximises it.

Throughput comes from a model fitted online to measured step times: a step of local batch b
with k accumulation micro-steps on N ranks takes

    k * t_micro(b) + t_sync(b)      t_micro(b) = a_c + b_c * b   (forward, backward, PS pulls)
                                    t_sync(b)  = a_s + b_s * b   (dense all-reduce: constant in b;
                                                                  PS push: grows with the rows)

each line fitted by least squares to this world size's measurements. With one batch size seen so
far, the lines cannot be told apart from a constant: the whole step is taken as fixed cost, the
guess most favourable to a bigger batch (optimism where nothing is known), so the choice tries
one -- at most AdaptiveConfig.explore times the largest measured -- whenever the statistical
efficiency lost there could be paid for, and the next fit, from two sizes, corrects the guess.
(Taking compute as proportional to the batch instead would never explore: a job whose steps are
mostly per-step overhead would stay at its first batch.)

Statistical efficiency of a global batch M against the base M0 is the AdaScale gain per unit of
scale, (phi + M0) / (phi + M) with phi = tr(Sigma)/|G|^2 the noise scale.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


def efficiency(batch: float, base_batch: float, noise_scale: float) -> float:
    """Progress per sample at global batch `batch` relative to `base_batch` (<= 1 above it)."""
    if not math.isfinite(noise_scale):
        return 1.0
    phi = max(noise_scale, 0.0)
    return (phi + base_batch) / (phi + batch)


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
    """Step times per world size: (local batch, micro-step seconds, sync seconds) samples."""

    def __init__(self, window: int = 200):
        self.window = window
        self._samples: dict[int, list] = {}
        self._fits: dict[int, tuple] = {}  # world -> params(), until the next record (a choice evaluates hundreds)

    def record(self, world: int, local_batch: int, micro_s: float, sync_s: float) -> None:
        rows = self._samples.setdefault(int(world), [])
        rows.append((float(local_batch), float(micro_s), float(sync_s)))
        del rows[:-self.window]
        self._fits.pop(int(world), None)

    def largest_measured(self, world: int) -> int:
        """The largest local batch whose step times were measured at this world size (0: none)."""
        return int(max((r[0] for r in self._samples.get(int(world), [])), default=0))

    def smallest_measured(self, world: int) -> int:
        """The smallest local batch whose step times were measured at this world size (0: none)."""
        return int(min((r[0] for r in self._samples.get(int(world), [])), default=0))

    def fitted(self, world: int) -> bool:
        return bool(self._samples.get(int(world)))

    def params(self, world: int) -> tuple[float, float, float, float]:
        fit = self._fits.get(int(world))
        if fit is not None:
            return fit
        rows = self._samples.get(int(world))
        if not rows:
            raise ValueError(f"no step times measured at world size {world} yet")
        # Each batch size's median step, then lines through those: a step that also ran an
        # evaluation, a checkpoint or a collection is an outlier, and it comes every so many
        # samples, so more often per step at a bigger batch -- a least-squares fit through the
        # raw steps took it as a cost of the batch and led the choice away from big batches.
        by_size: dict[float, list] = {}
        for b, micro, sync in rows:
            by_size.setdefault(b, []).append((micro, sync))
        sizes = sorted(by_size)
        micro = [float(np.median([m for m, _ in by_size[b]])) for b in sizes]
        sync = [float(np.median([s_ for _, s_ in by_size[b]])) for b in sizes]
        fit = self._fits[int(world)] = (*_line(sizes, micro, constant_if_unknown=True),
                                        *_line(sizes, sync, constant_if_unknown=True))
        return fit

    def step_time(self, world: int, local_batch: float, accumulation: int = 1) -> float:
        ac, bc, as_, bs = self.params(world)
        return accumulation * (ac + bc * local_batch) + as_ + bs * local_batch

    def throughput(self, world: int, local_batch: float, accumulation: int = 1) -> float:
        return world * local_batch * accumulation / self.step_time(world, local_batch, accumulation)

    def state_dict(self) -> dict:
        return {"window": self.window, "samples": {str(k): [list(r) for r in v] for k, v in self._samples.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state.get("window", self.window))
        self._samples = {int(k): [tuple(r) for r in v] for k, v in state.get("samples", {}).items()}
        self._fits = {}


@dataclasses.dataclass(frozen=True)
class BatchChoice:
    local_batch: int
    accumulation: int
    world: int
    goodput: float  # predicted samples/s of base-batch-equivalent progress
    efficiency: float

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.accumulation * self.world


def _grid(lo: int, hi: int, points: int = 48) -> list[int]:
    if hi <= lo:
        return [lo]
    values = np.unique(np.round(np.geomspace(lo, hi, points)).astype(int))
    return sorted(set(values.tolist()) | {lo, hi})


def goodput(model: ThroughputModel, world: int, local_batch: int, accumulation: int, base_batch: float,
            noise_scale: float) -> float:
    batch = world * local_batch * accumulation
    return model.throughput(world, local_batch, accumulation) * efficiency(batch, base_batch, noise_scale)


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
                 local_bounds: tuple[int, int], max_accumulation: int = 1, min_accumulation: int = 1) -> BatchChoice:
    """The (local batch, accumulation) maximising predicted goodput with the global batch in
    [base_batch, max_batch] (never below the base: the LR rules assume scale >= 1) and the local
    batch within local_bounds, and min_accumulation..max_accumulation micro-steps. Deterministic:
    the same inputs give the same choice on every rank."""
    lo, hi = int(local_bounds[0]), int(local_bounds[1])
    if not 1 <= lo <= hi:
        raise ValueError(f"local_bsz_bounds must be 1 <= lo <= hi, got {local_bounds}")
    best = None
    for k in range(max(1, int(min_accumulation)), max(1, int(max_accumulation)) + 1):
        for b in _grid(lo, hi):
            batch = world * b * k
            if batch > max_batch or batch < base_batch:
                continue
            g = goodput(model, world, b, k, base_batch, noise_scale)
            if best is None or g > best.goodput * (1 + 1e-12):
                best = BatchChoice(b, k, world, g, efficiency(batch, base_batch, noise_scale))
    if best is None:  # no allowed size reaches the base batch: the largest one allowed
        k = max(1, min(int(min_accumulation), int(max_accumulation)))
        b = max(lo, min(hi, max_batch // (world * k)))
        best = BatchChoice(b, k, world, goodput(model, world, b, k, base_batch, noise_scale),
                           efficiency(world * b * k, base_batch, noise_scale))
    return best
