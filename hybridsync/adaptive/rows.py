"""How a parameter-server table's rows are hit as the batch grows: the batch each of its row
updates averages, which sets the table's learning-rate factor (Adaptive.table_lr_factors).

A dense variable's step averages every sample of the batch M. A table's step updates each row
the batch hits once, with the sum of that row's hits: a row update averages its hits,
d(M) = hits(M) / U(M) with U(M) the distinct rows the batch updates. Hits grow with M; U(M)
grows as M itself where ids are rare (each new sample brings new rows: d stays ~1, and a bigger
batch averages nothing more into any row, it updates more rows) and not at all where every
batch hits every row (d grows as M, as a dense layer's average does). Against the base batch M0,
a row update at M averages

    d(M) / d(M0) = (M / M0) * U(M0) / U(M)        (between 1 and M / M0)

times as many hits: the row scale a normalising server rule's LR factor is taken at (CowClip's
rule; docs/adaptive.md, "Embedding tables", also on why the statistical efficiency does not use
it: the row-update frequency is already in the table's noise scale).

U(M) is measured, not assumed: each push round's shards report the distinct rows they updated
(U at the round's global batch n b) and the rows they received, each rank's distinct rows summed
(n times the mean U at the per-rank batch b). So every round gives U at two batch sizes; each size
keeps the mean of its newest rounds, and U between sizes is read off the line through them in
log-log (beyond them, the nearest segment's slope, kept in [0, 1]: U never falls as M grows, nor
grows faster than M). The counts depend on the id distribution only, not on the model's state,
so they need no forgetting beyond the newest rounds' window, and hold at any world size.
"""
from __future__ import annotations

import math

PER_SIZE = 32  # newest rounds kept per batch size


class RowCounts:
    """Per table: batch size (samples) -> distinct rows a batch of that size updated, newest
    PER_SIZE rounds; and each table's newest round's rows pushed per distinct row."""

    def __init__(self):
        self._counts: dict[str, dict[int, list[float]]] = {}
        self._duplicates: dict[str, float] = {}

    def observe(self, name: str, per_rank_batch: float, per_rank_rows: float, batch: float, rows: float,
                ranks: int) -> None:
        """One push round of table `name`: `ranks` ranks each pushed the distinct rows of
        `per_rank_batch` samples (`per_rank_rows` of them on average), `rows` distinct over all
        (a batch of `batch` samples). A round that updated nothing says nothing."""
        # (plain floats: the counts come out of the statistics gather's NumPy array, and a state
        # holding NumPy scalars would not load from a checkpoint that unpickles nothing else)
        per_rank_batch, per_rank_rows, batch, rows = map(float, (per_rank_batch, per_rank_rows, batch, rows))
        ranks = int(ranks)
        if not (ranks >= 2 and rows > 0 and per_rank_rows > 0 and batch > per_rank_batch > 0):
            return
        if not (rows <= per_rank_rows * ranks * (1 + 1e-9) and per_rank_rows <= rows * (1 + 1e-9)):
            raise ValueError(f"table {name!r}: a round's row counts are inconsistent: {rows} distinct rows of "
                             f"{batch} samples, {per_rank_rows} per rank of {per_rank_batch} samples over {ranks} ranks")
        sizes = self._counts.setdefault(name, {})
        for samples, count in ((per_rank_batch, per_rank_rows), (batch, rows)):
            kept = sizes.setdefault(int(round(samples)), [])
            kept.append(float(count))
            del kept[:-PER_SIZE]
        self._duplicates[name] = per_rank_rows * ranks / rows

    def tables(self) -> list[str]:
        return sorted(self._counts)

    def duplicates(self, name: str) -> float:
        """The newest round's rows received per distinct row updated: how many ranks' batches
        hit an updated row, on average (1: none shared; the number of ranks: every one)."""
        return self._duplicates.get(name, math.nan)

    def distinct(self, name: str, batch: float) -> float:
        """U(batch): distinct rows a batch of `batch` samples updates (NaN: nothing measured)."""
        points = self._points(name)
        if not points:
            return math.nan
        x = math.log(batch)
        if len(points) == 1:
            return math.exp(points[0][1] + (x - points[0][0]))  # one size: as if every id were rare
        below = [p for p in points if p[0] <= x]
        above = [p for p in points if p[0] > x]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
        elif above:  # below the smallest size measured: the first segment's slope
            (x0, y0), (x1, y1) = points[0], points[1]
        else:  # beyond the largest: the last segment's
            (x0, y0), (x1, y1) = points[-2], points[-1]
        slope = min(max((y1 - y0) / (x1 - x0), 0.0), 1.0)
        return math.exp(y0 + slope * (x - x0))

    def growth(self, name: str, batch: float) -> float:
        """The exponent alpha of U ~ M^alpha around `batch`: 1 where every sample brings new rows
        (rare ids), 0 where the batch hits no row it would not hit anyway (NaN: not measured)."""
        if not self._points(name):
            return math.nan
        return math.log(self.distinct(name, batch * 1.01) / self.distinct(name, batch)) / math.log(1.01)

    def effective_batch(self, name: str, batch: float, base_batch: float) -> float:
        """M_t(batch) = batch * U(base) / U(batch), between the base and the batch: the batch a
        dense variable would average over to average what each of the table's row updates does,
        relative to the base batch. `batch` itself while nothing is measured (as a dense one)."""
        if not self._points(name) or batch == base_batch:
            return float(batch)
        m = batch * self.distinct(name, base_batch) / self.distinct(name, batch)
        lo, hi = min(batch, base_batch), max(batch, base_batch)
        return min(max(m, lo), hi)

    def _points(self, name: str) -> list[tuple[float, float]]:
        """(log batch, log mean distinct rows) of every size measured, by batch."""
        return [(math.log(b), math.log(sum(v) / len(v))) for b, v in sorted(self._counts.get(name, {}).items())]

    def state_dict(self) -> dict:
        return {"counts": {name: {str(b): list(v) for b, v in sizes.items()} for name, sizes in self._counts.items()},
                "duplicates": dict(self._duplicates)}

    def load_state_dict(self, state: dict) -> None:
        self._counts = {name: {int(b): [float(x) for x in v] for b, v in sizes.items()}
                        for name, sizes in state.get("counts", {}).items()}
        self._duplicates = {name: float(d) for name, d in state.get("duplicates", {}).items()}

