"""What the sync core records for the gradient statistics each step -- no extra pass over the
model: the squared norms of the dense all-reduce's input and output, and each PS table's two
scalars of a push round, computed by its shards where the rows are.

Every rank needs the same statistics (the learning rate and the batch size follow them), so the
dense inputs' norms (each rank has only its own) travel in one small collective per step, with
the step times the throughput model fits; everything else is the same on every rank already.
That collective is a sum all-reduce (exchange.gather_rows) that a rank which called hvd.join()
takes part in with zeros: the statistics then come from the ranks that stepped only, and the
all-reduced gradient -- which a joined rank's zeros diluted, the average still dividing by the
world size as Horovod's join does -- is scaled back to those ranks' mean.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .exchange import gather_rows
from .gns import all_finite


def squared_norm(buffer) -> float:
    """|buffer|^2 in double, for NumPy arrays and tensors (torch/TF) alike. float32 on the CPU --
    every dense gradient, twice a step -- goes through the engine's kernel, which reads the
    buffer in place: converting a copy to float64 first cost ~9 ms per 10 MB of gradients, and a
    model whose tables are all-reduced densely spent a third of its step there."""
    if hasattr(buffer, "detach"):  # a torch tensor
        tensor = buffer.detach()
        if tensor.device.type != "cpu" or not tensor.is_floating_point() or tensor.element_size() != 4:
            return float(tensor.double().square().sum())
        buffer = tensor.numpy()
    values = np.asarray(buffer)
    if values.dtype == np.float32:
        return _float32_squared_norm(np.ascontiguousarray(values).reshape(-1))
    flat = values.reshape(-1).astype(np.float64, copy=False)
    return float(np.dot(flat, flat))


def _float32_squared_norm(values: np.ndarray) -> float:
    from .. import _ps  # (the engine's extension: imported on first use, with MPI already up)

    return _ps.squared_norm(values)


def rows_squared_norm(parts) -> float:
    """|g|^2 of a gradient given as (ids, rows) parts, rows of the same id summed first."""
    if not parts:
        return 0.0
    ids = np.concatenate([np.asarray(i).reshape(-1) for i, _ in parts])
    rows = np.concatenate([np.asarray(g, dtype=np.float64).reshape(len(np.asarray(i).reshape(-1)), -1)
                           for i, g in parts])
    unique, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((len(unique), rows.shape[1]))
    np.add.at(summed, inverse, rows)
    return float(np.sum(summed * summed))


class StepRecorder:
    """Fed by the synchronizers during synchronize(); end_step() turns the step into statistics."""

    def __init__(self, adaptive, world_size: int, rank: int = 0):
        self.adaptive = adaptive
        self.world, self.rank = world_size, rank
        self._dense_in: dict[str, float] = {}
        self._dense_out: dict[str, float] = {}
        # (name, local_sq, combined_sq, sizes, ranks that pushed, late, distinct rows, rows pushed) of rounds completed
        self._ps: list = []
        self._tables: set[str] = set()  # every PS table that reported (the gather lists them by name)
        self._skipped_last = False  # the previous step was left out of the statistics (non-finite)
        self._rounds: dict[str, int] = {}  # table -> newest round seen
        self._sizes_pushed = None  # (samples per rank, accumulation) of the previous push
        self._sync_start = None
        self.loss_scale = 1.0  # gradients arrive multiplied by this (Keras loss scaling)
        self.last_times = (0.0, 0.0, 0, 1)  # the previous step here: (s per micro-step, sync s, local batch, micro-steps)
        self._step_start = None  # when the adaptive loader was asked for this step's first batch
        self._last_end = None  # when the previous step ended
        self._settled_steps = 1  # consecutive steps on the routes in force (see _routes)

    # -- the step clock ---------------------------------------------------------------------------
    # A step is timed from the moment the adaptive loader is asked for its first batch (data
    # loading counts) to the end of the optimizer step. Whatever the training loop does between a
    # step's end and its next request -- an evaluation, logging, a checkpoint -- is not the
    # batch's cost: timed from the previous step's end, an evaluation every 8,192 samples landed in
    # every other step at a batch of 4,096, in every step at 8,192, and no median could remove it.
    # Without the loader (a hand-written loop) the clock runs from the previous step's end.
    def step_started(self) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def step_ended(self) -> None:
        now = time.perf_counter()
        start = self._step_start if self._step_start is not None else self._last_end
        if start is not None:
            self.step_times(now - start)
        self._step_start, self._last_end = None, now

    def reset_clock(self) -> None:
        """After a checkpoint is loaded: the next step is timed afresh."""
        self._step_start = self._last_end = None

    # -- fed by the synchronizers ---------------------------------------------------------------
    def begin_sync(self) -> None:
        self._sync_start = time.perf_counter()

    def dense_in(self, name: str, buffer) -> None:
        self._dense_in[name] = squared_norm(buffer)

    def dense_out(self, name: str, buffer, summed: bool) -> None:
        sq = squared_norm(buffer)
        self._dense_out[name] = sq / self.world ** 2 if summed else sq  # the mean over ranks

    def ps_round(self, name: str, stats: dict, current: bool) -> None:
        """A table's newest round statistics (engine.round_stats): `current` when they are of
        this step's push (replicated placement), else of the previous one (sharded: they come
        back with the next pull)."""
        self._tables.add(name)  # (every step asks every table, so every rank knows the same ones)
        if stats["round"] < 0 or stats["round"] == self._rounds.get(name):
            return
        self._rounds[name] = stats["round"]
        sizes = self.adaptive.sizes() if current else self._sizes_pushed
        if sizes is not None:  # (a rank that joined pushed nothing: the round counts the others)
            self._ps.append((name, stats["local_sq"], stats["combined_sq"], sizes,
                             int(stats.get("ranks") or self.world), not current,
                             int(stats.get("rows", 0)), int(stats.get("pushed", 0))))

    # -- once per step ----------------------------------------------------------------------------
    def end_step(self, allreduce_sum, routes_settled: bool = True) -> None:
        """Collective (every rank that steps, every step; a rank that called join() stands in):
        combines this step's numbers into the statistics and the throughput model, identically on
        every rank that stepped. allreduce_sum(array, name): the dense backend's sum all-reduce.
        routes_settled: False while `sync: auto` still measures and tries routes (the same on
        every rank) -- see _routes()."""
        sync_s = time.perf_counter() - self._sync_start if self._sync_start is not None else 0.0
        names = sorted(self._dense_in)
        adaptive = self.adaptive
        per_rank, accum = adaptive.local_batch, adaptive.accumulation
        unscale = self.loss_scale ** 2
        now_ps, late_ps = self._ps_observations(unscale)
        outputs = [self._dense_out[n] for n in names if n in self._dense_out]
        # Whether this rank's own numbers are finite travels with its dense inputs, so that every
        # rank leaves out the same steps even where their numbers differ.
        finite = (all(map(math.isfinite, outputs)) and all_finite(now_ps), all_finite(late_ps))
        # (ranks with other dense variables this step: the all-reduce's shapes differ, and it raises)
        # Each table's row counts of its round travel too, so that every rank models the same
        # counts (the lowest stepping rank's), whatever round each rank's shards last reported.
        mine = [*(self._dense_in[n] for n in names), *self.last_times, float(finite[0]), float(finite[1]),
                *self._row_counts()]
        rows = gather_rows(allreduce_sum, self.rank, self.world, mine, "hybridsync.adaptive")
        n = len(names)
        gathered = [(row[:n], tuple(row[n:n + 4]), (bool(row[n + 4]), bool(row[n + 5])))
                    for _, row in sorted(rows.items())]
        if per_rank:
            self._take_row_counts([row[n + 6:] for _, row in sorted(rows.items())])
        stepped = len(gathered)
        if per_rank:
            now = list(now_ps)
            if stepped > 1:  # (one rank alone: its gradient is the combined one, nothing to learn)
                mean_local = np.mean([g[0] for g in gathered], axis=0) / accum ** 2 / unscale
                small, big = per_rank * accum, per_rank * accum * stepped
                base = adaptive.base_batch or per_rank * accum * self.world
                # The all-reduce divided the stepping ranks' sum by the world size (a joined rank
                # adds zeros, as in Horovod): their mean gradient is world / stepped times the result.
                undilute = (self.world / stepped) ** 2
                now = [(name, float(local), small, self._dense_out[name] * undilute / unscale, big, big / base)
                       for name, local in zip(names, mean_local) if name in self._dense_out] + now
            self._take(now, all_finite(now) and all(g[2][0] for g in gathered),
                       late_ps, all(g[2][1] for g in gathered))
        # A step lasts as long as its slowest rank's: its compute is the slowest rank's, and its
        # sync the rest of the longest step. (The largest sync is mostly a fast rank waiting for
        # the slow one's compute: adding the two maxima counted that wait twice.)
        times = [g[1] for g in gathered]
        micro_s = max(t[0] for t in times)
        measured_k = max(1, int(times[0][3]))
        sync_s_all = max(0.0, max(t[0] * measured_k + t[1] for t in times) - micro_s * measured_k)
        measured_at = int(times[0][2])
        if micro_s > 0 and measured_at and self._routes(routes_settled):
            adaptive.throughput.record(self.world, measured_at, micro_s, sync_s_all)
        self._dense_in.clear()
        self._dense_out.clear()
        self._ps.clear()
        self._sizes_pushed = adaptive.sizes() if per_rank else None
        self._pending_sync_s = sync_s

    def _routes(self, settled: bool) -> bool:
        """Whether the step times gathered this step (the previous step's) count. While `sync:
        auto` measures and tries routes, a step's time is that of a route on trial plus auto's
        own recording, not of the plan training will run on: such steps are not timed, the batch
        is not decided (a batch changed during auto's trials would also make its comparison of
        routes one of batch sizes), and the step times measured before the routes settled are
        forgotten once they do. The gathered times are the previous step's, so the first step on
        the final routes is not timed either."""
        adaptive = self.adaptive
        adaptive.routes_settled = settled
        if not settled:
            self._settled_steps = 0
            return False
        self._settled_steps += 1
        if self._settled_steps == 1:
            adaptive.throughput.forget(self.world)
        return self._settled_steps >= 2

    def _ps_observations(self, unscale: float) -> tuple[list, list]:
        """The PS rounds recorded this step as observations: those of this step's push, and those
        of the previous step's (a sharded table's round comes back with the next pull). A round
        counts the ranks that pushed in it (one that joined pushed nothing); with one, there is
        nothing to compare."""
        now, late = [], []
        for name, local_sq, combined_sq, (b, k), n, was_late, _, _ in self._ps:
            if n < 2:
                continue
            base = self.adaptive.base_batch or b * k * n
            (late if was_late else now).append((name, local_sq / n / k ** 2 / unscale, b * k,
                                                combined_sq / (n * k) ** 2 / unscale, b * k * n, b * k * n / base))
        return now, late

    _ROW_FIELDS = 6  # per table: present, samples per rank, distinct rows per rank, samples, distinct rows, ranks

    def _row_counts(self) -> list[float]:
        """Each table's newest round recorded this step, as the statistics gather carries it:
        (1, samples per rank, mean distinct rows per rank, global samples, distinct rows, ranks),
        zeros for a table with no new round."""
        newest = {}
        for name, _, _, (b, k), n, _, distinct, pushed in self._ps:
            if n >= 2 and distinct > 0:
                newest[name] = [1.0, b * k, pushed / n, b * k * n, distinct, n]
        return [x for name in sorted(self._tables) for x in newest.get(name, [0.0] * self._ROW_FIELDS)]

    def _take_row_counts(self, blocks: list) -> None:
        """Into the row model: each table's counts of the lowest rank that had a round of it
        (blocks: each stepping rank's _row_counts, by rank)."""
        for i, name in enumerate(sorted(self._tables)):
            for block in blocks:
                fields = block[i * self._ROW_FIELDS:(i + 1) * self._ROW_FIELDS]
                if len(fields) == self._ROW_FIELDS and fields[0] == 1.0:
                    _, small, per_rank_rows, big, distinct, ranks = fields
                    self.adaptive.rows.observe(name, small, per_rank_rows, big, distinct, int(ranks))
                    break

    def _take(self, now: list, now_ok: bool, late: list, late_ok: bool) -> None:
        """Into the statistics, a step's observations all or none (ok: finite on every rank). A
        late round belongs to the previous step: left out with it if that step was non-finite
        (counted once), else taken or left out on its own. (So a sharded table's non-finite
        round cannot take back its step's dense observations: they were taken a step before.)"""
        stats = self.adaptive.stats
        if late and not self._skipped_last:
            if late_ok:
                stats.observe_step(late)
            else:
                stats.skip_step()
        if now_ok:
            stats.observe_step(now)
        else:
            stats.skip_step()
        self._skipped_last = not now_ok

    def step_times(self, step_s: float) -> None:
        """This rank's wall time of the whole step just finished (see the step clock above):
        the part outside synchronize, per micro-step, and synchronize's."""
        sync_s = getattr(self, "_pending_sync_s", 0.0)
        accum = max(1, self.adaptive.accumulation)
        # An epoch's partial last step is no batch size to fit the throughput lines with: not timed.
        measured_at = 0 if self.adaptive.partial_step_of is not None else self.adaptive.local_batch
        self.last_times = (max(step_s - sync_s, 0.0) / accum, sync_s, measured_at, accum)
