"""Statistical efficiency of a PS table trained by a row-adaptive server rule (Adagrad, Adam...),
from how often its rows occur.

Pollux's efficiency (phi + M0) / (phi + M) takes one noise scale phi for the whole gradient, which
is right when one learning rate moves every coordinate (SGD). An adaptive rule steps each row by
its own statistics, so each row makes progress on its own, at its own noise scale. In a sparse
table the rows differ enormously: a row that a fraction p of the samples touch has a noise scale
of about c / p (c: the noise-to-signal ratio of one occurrence's gradient), so a frequent row is
already averaged well at a small batch and a big batch only wastes its samples, while a rare row
gets one update per occurrence whatever the batch. The table's measured noise scale
tr(Sigma) / |G|^2 is the |G|^2-weighted mean of the rows' c / p and is dominated by the many rare
rows: as one number it says a big batch costs nothing, which word2vec's tables contradict.

So each row counts on its own: with |G_r|^2 proportional to p^2 (one occurrence's mean gradient
the same for every row) and phi_r = c / p, c set so that the rows' weighted mean is the measured
phi, progress per sample at batch M is proportional to

    sum_r |G_r|^2 / (phi_r + M) = |G|^2 / sum(p^2) * sum_r p^3 / (c + M p),   c = phi * sum(p^2) / sum(p)

which is |G|^2 / (phi + M) -- Pollux's -- when every row is as frequent as the others. The p of
each row comes from the ids a rank pushes (one per occurrence, as a sparse embedding gradient
has them), kept as a log-binned histogram smoothed over steps: a few dozen numbers per table.
"""
from __future__ import annotations

import math

import numpy as np

_BINS_PER_DECADE = 4
_DECADES = 10  # p from 1e-10 to 1
_BINS = _BINS_PER_DECADE * _DECADES + 1


class RowProfile:
    """A table's row frequencies: smoothed sums of p, p^2 and, per log-bin of p, p^3 and p^4."""

    def __init__(self, smoothing: float = 0.95):
        self.smoothing = smoothing
        self._sums = np.zeros(2 + 2 * _BINS)  # sum p, sum p^2, p^3 by bin, p^4 by bin
        self._weight = 0.0

    def observe(self, ids, samples: int) -> None:
        """One step's pushed ids (a row once per sample that touched it) over `samples` samples."""
        ids = np.asarray(ids).reshape(-1)
        if samples <= 0 or ids.size == 0:
            return
        counts = np.unique(ids, return_counts=True)[1]
        p = counts / float(samples)
        bins = np.clip(np.floor(np.log10(p) * _BINS_PER_DECADE).astype(int) + _BINS - 1, 0, _BINS - 1)
        step = np.concatenate([[p.sum(), np.dot(p, p)], np.bincount(bins, p ** 3, _BINS),
                               np.bincount(bins, p ** 4, _BINS)])
        theta = self.smoothing
        self._sums = theta * self._sums + (1.0 - theta) * step
        self._weight = theta * self._weight + (1.0 - theta)

    def ready(self) -> bool:
        return self._weight > 0 and self._sums[1] > 0

    def progress(self, batch: float, noise_scale: float) -> float:
        """sum_r |G_r|^2 / (phi_r + batch), per unit of the table's |G|^2 (see the module doc)."""
        s1, s2 = self._sums[0], self._sums[1]
        cubes, fourths = self._sums[2:2 + _BINS], self._sums[2 + _BINS:]
        used = cubes > 0
        p_mean = fourths[used] / cubes[used]  # each bin's p, weighted as its rows count
        c = max(noise_scale, 0.0) * s2 / s1
        return float(np.sum(cubes[used] / (c + batch * p_mean)) / s2)

    def state(self) -> list:
        return [self._weight, self._sums.tolist()]

    def load(self, state) -> None:
        self._weight, self._sums = float(state[0]), np.asarray(state[1], dtype=float)


class Efficiency:
    """Progress per sample at a global batch relative to the base batch, over all variables:
    one Pollux term for the dense variables and the tables without a profile (pooled, as one
    learning rate moves them), one row-wise term per profiled table, each weighted by its |G|^2."""

    def __init__(self, pooled: tuple[float, float] | None, tables: list[tuple[float, float, RowProfile]]):
        self.pooled = pooled  # (|G|^2, noise scale)
        self.tables = tables  # (|G|^2, noise scale, profile)

    def _progress(self, batch: float) -> float:
        total = 0.0
        if self.pooled is not None:
            sqr, phi = self.pooled
            total += sqr / (phi + batch)
        for sqr, phi, profile in self.tables:
            total += sqr * profile.progress(batch, phi)
        return total

    def __call__(self, batch: float, base_batch: float) -> float:
        base = self._progress(base_batch)
        return self._progress(batch) / base if base > 0 else 1.0


def _usable(sqr: float, var: float) -> bool:
    return math.isfinite(sqr) and math.isfinite(var) and sqr > 0


def efficiency_model(by_variable: dict, profiles: dict) -> Efficiency | None:
    """The Efficiency of the statistics' variables ({name: {"sqr", "var"}}), with the row
    profiles given ({name: RowProfile}); None when no variable has a positive |G|^2 yet (all
    noise as far as can be told: every batch is as efficient)."""
    pooled_sqr = pooled_var = 0.0
    tables = []
    for name, v in by_variable.items():
        if not math.isfinite(v["sqr"]) or not math.isfinite(v["var"]):
            continue
        profile = profiles.get(name)
        if profile is not None and profile.ready():
            if _usable(v["sqr"], v["var"]):
                tables.append((v["sqr"], max(v["var"], 0.0) / v["sqr"], profile))
            continue
        pooled_sqr += v["sqr"]
        pooled_var += v["var"]
    pooled = (pooled_sqr, max(pooled_var, 0.0) / pooled_sqr) if pooled_sqr > 0 else None
    if pooled is None and not tables:
        return None
    return Efficiency(pooled, tables)
