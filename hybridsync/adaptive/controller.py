"""One distributed optimizer's adaptive state: its gradient statistics, scaling rule, throughput
model, batch size and scale-invariant progress. Framework-neutral; the frontends call it."""
from __future__ import annotations

import dataclasses
import math

from . import scaling
from .accumulators import AccumulatorRescale
from .decision import BatchDecider
from .gns import GradientStats
from .goodput import BatchChoice, ThroughputModel, allowed, choose_batch, efficiency, efficiency_model_for, nearest_allowed
from .rows import RowCounts


@dataclasses.dataclass
class AdaptiveConfig:
    """DistributedOptimizer(..., adaptive=AdaptiveConfig(...)) (or True for the defaults).

    scaling_rule: 'auto' (adascale for SGD-like optimizers, none for Adagrad, sqrt for the
        other adaptive ones), 'adascale', 'sqrt', 'none' (factor 1), 'adagrad' (opt-in; see
        scaling.py), 'linear', or None (statistics only: the learning rate is left alone).
    local_batch_size: samples per rank per backward pass (an AdaptiveDataLoader sets it).
    base_batch_size: the global batch the learning rate (and its schedule) was written for
        (default: the first global batch seen).
    smoothing: the statistics' moving-average factor (closer to 1: smoother, slower).
    min_gain: a new batch size is taken only if its predicted goodput beats the current one's
        by at least this factor ...
    confidence: ... and by this many standard errors of the prediction (from the spread of the
        step times measured at both sizes and of the gradient statistics): a gain the model
        cannot tell from its own noise changes nothing.
    hysteresis: a change against the direction of the last one (a reversal) needs this many
        times the usual margin (in log gain); and a size left behind is not gone back to until
        the noise scale has moved `revisit` times in its favour since.
    revisit: see hysteresis.
    explore: how far outside the local batch sizes measured so far (at this world size) a
        choice may go: the step-time lines are extrapolations there, so the batch shrinks by at
        most this factor per decision, and grows by at most this factor while one size is
        measured, then by as much as the measured sizes span, up to explore^2
        (ThroughputModel.reach) -- each time as a probe: measured, then kept, or left (a
        return, which bars the size until the noise scale grows `revisit` times).
    measure_steps: after a change, the batch is decided on again after this many steps (its
        step times' median), not after a whole loader interval.
    rescale_accumulators: at each durable change of the global batch (a decision, a restart at
        another one), multiply the optimizer's accumulated squared gradients -- the wrapped
        optimizer's and the Adagrad server rule's on every PS table -- by
        scaling.accumulator_factor, so that the new batch's steps do not inherit the smaller
        batch's larger sum. False (default: opt-in, the rescaled sums' transient made the batch
        turn back in 6 of 20 benchmark runs; docs/adaptive.md); 'auto': on for an optimizer that
        accumulates forever (Adagrad) at a rule that leaves its learning rate unscaled ('none',
        what 'auto' picks for it); True: on (needs Adagrad state somewhere).
    """

    scaling_rule: str | None = "auto"
    local_batch_size: int | None = None
    base_batch_size: int | None = None
    smoothing: float = 0.8  # per base batch: ~5 base batches of memory (see docs/adaptive.md)
    min_gain: float = 1.05
    confidence: float = 2.0
    hysteresis: float = 2.0
    revisit: float = 2.0
    explore: float = 2.0
    measure_steps: int = 5
    rescale_accumulators: str | bool = False

    def __post_init__(self):
        if not any(self.rescale_accumulators is v or (isinstance(v, str) and self.rescale_accumulators == v)
                   for v in scaling.RESCALE_SETTINGS):
            raise ValueError(f"adaptive: rescale_accumulators={self.rescale_accumulators!r} must be 'auto', True or "
                             "False")
        checks = {"min_gain": self.min_gain >= 1.0, "confidence": self.confidence >= 0.0,
                  "hysteresis": self.hysteresis >= 1.0, "revisit": self.revisit >= 1.0, "explore": self.explore > 1.0,
                  "measure_steps": int(self.measure_steps) >= 1}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            limits = {"min_gain": ">= 1", "confidence": ">= 0", "hysteresis": ">= 1", "revisit": ">= 1",
                      "explore": "> 1", "measure_steps": ">= 1"}
            raise ValueError("adaptive: " + "; ".join(f"{n}={getattr(self, n)!r} must be {limits[n]}" for n in bad))

    @classmethod
    def of(cls, value) -> "AdaptiveConfig | None":
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"adaptive: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            return cls(**value)
        raise TypeError(f"adaptive must be True, a dict or hybridsync.adaptive.AdaptiveConfig, got {type(value).__name__}")


class Adaptive:
    def __init__(self, config: AdaptiveConfig, optimizer_class_name: str, world_size: int):
        self.config = config
        self.rule = None if config.scaling_rule is None else scaling.rule_for(config.scaling_rule, optimizer_class_name)
        # Which statistical-efficiency formula goodput uses: fixed here, from what every rank
        # wraps alike (the optimizer's class and the rule), so every rank decides with the same.
        self.efficiency_model, self.efficiency_reason = efficiency_model_for(optimizer_class_name, self.rule)
        self.stats = GradientStats(config.smoothing)
        self.throughput = ThroughputModel()
        self.rows = RowCounts()  # how the PS tables' rows are hit as the batch grows (rows.py)
        self.world = world_size
        self.local_batch = int(config.local_batch_size) if config.local_batch_size else 0
        self.accumulation = 1
        self.base_batch = int(config.base_batch_size) if config.base_batch_size else 0
        self.progress = 0.0  # scale-invariant steps: base-batch steps' worth of progress
        self.steps = 0
        self.last_gain = 1.0
        self.last_factor = 1.0
        self.choice: BatchChoice | None = None
        self.routes_settled = True  # False while `sync: auto` measures routes: no batch decision then
        self.decider = BatchDecider(config)  # when the batch changes (margins, probes, hysteresis)
        # The batch chosen, while an epoch's partial last step runs at what was left (batches.py).
        self.partial_step_of: tuple[int, int] | None = None
        self._loaded_observations = None  # stats.observations right after a checkpoint's were loaded
        # Adagrad's sums of squared gradients across batch changes (accumulators.py)
        self.accumulators = AccumulatorRescale(
            config.rescale_accumulators,
            scaling.rescales_accumulators(config.rescale_accumulators, optimizer_class_name, self.rule))
        self._fix_base()

    def _fix_base(self) -> None:
        if not self.base_batch and self.local_batch:
            self.base_batch = self.global_batch()

    def sizes(self) -> tuple[int, int]:
        return self.local_batch, self.accumulation

    def global_batch(self) -> int:
        return self.local_batch * self.accumulation * self.world

    def set_batch(self, local_batch: int, accumulation: int = 1) -> None:
        if local_batch < 1 or accumulation < 1:
            raise ValueError(f"local batch and accumulation must be >= 1, got {local_batch}, {accumulation}")
        self.local_batch, self.accumulation = int(local_batch), int(accumulation)
        self._fix_base()

    def scale(self) -> float:
        return self.global_batch() / self.base_batch if self.base_batch and self.local_batch else 1.0

    def gain(self, scale: float | None = None) -> float:
        s = self.scale() if scale is None else scale
        summary = self.stats.summary()
        return scaling.gain(s, summary["sqr"], summary["var"], self.base_batch or 1)

    def lr_factor(self) -> float:
        """What the base learning rate is multiplied by this step (1 with no rule)."""
        if self.rule is None:
            return 1.0
        s = self.scale()
        if s == 1.0:
            return 1.0
        summary = self.stats.summary()
        return scaling.RULES[self.rule](s, summary["sqr"], summary["var"], self.base_batch)

    def step_done(self) -> None:
        """After each optimizer step: progress advances by the step's gain."""
        self.last_gain = self.gain()
        self.progress += self.last_gain
        self.steps += 1

    def gradient_stats(self) -> dict:
        """The smoothed statistics (GradientStats.summary); they need the local batch size."""
        if not self.local_batch:
            raise RuntimeError("gradient statistics need the local batch size: iterate an AdaptiveDataLoader / "
                               "AdaptiveDataset, or give adaptive={'local_batch_size': samples per rank}")
        return self.stats.summary()

    def noise_scale(self) -> float:
        return self.stats.summary()["noise_scale"]

    def measured_here(self) -> bool:
        """Whether the statistics include a step of this run, not only a checkpoint's (measured
        by the run that saved it, perhaps at another world size)."""
        return self.stats.ready() and (self._loaded_observations is None
                                       or self.stats.observations > self._loaded_observations)

    def efficiency_of(self, noise_scale: float, base_batch: int | None = None):
        """efficiency(global batch): the statistical efficiency against the base batch (or
        `base_batch`) at this noise scale, under this optimizer's efficiency model -- the one
        place the controller computes it."""
        base, model = base_batch or self.base_batch, self.efficiency_model
        return lambda batch: efficiency(batch, base, noise_scale, model)

    def tables(self, batch: int, statistics: dict) -> dict:
        """Per PS table whose rows were counted, at global batch `batch`: rows pushed per distinct
        row in its newest round ("duplicates", d), how its distinct rows grow with the batch
        ("growth", alpha of U ~ M^alpha), how many times the base batch's hits each of its row
        updates averages ("row_scale", rows.RowCounts.effective_batch / base), its own noise scale
        and efficiency (the noise-scale formula on its own statistics: the row-update frequency is
        in them, docs/adaptive.md "Embedding tables"), and its learning-rate factor."""
        base = self.base_batch or batch
        out = {}
        for name in self.rows.tables():
            v = statistics["by_variable"].get(name, {"sqr": math.nan, "var": math.nan})
            phi = max(v["var"], 0.0) / v["sqr"] if v["sqr"] > 0 else math.inf
            row_scale = self.rows.effective_batch(name, batch, base) / base
            out[name] = {"duplicates": self.rows.duplicates(name), "growth": self.rows.growth(name, batch),
                         "row_scale": row_scale, "noise_scale": phi, "efficiency": self.efficiency_of(phi, base)(batch),
                         "lr_factor": self._table_factor(batch / base, row_scale)}
        return out

    def table_lr_factors(self) -> dict:
        """{table: the factor its learning rate is multiplied by this step} for the tables whose
        rows were counted, where their server rule normalises its update (Adagrad, Adam): the
        rule applied at the scale of what the table's row updates average, not of the batch
        (docs/adaptive.md, "Embedding tables": a row hit once per batch at any batch averages
        nothing more, and a factor above 1 would only lengthen its steps -- CowClip's rule)."""
        if self.rule is None or not self.base_batch or not self.local_batch:
            return {}
        batch, base = self.global_batch(), self.base_batch
        return {name: self._table_factor(batch / base, self.rows.effective_batch(name, batch, base) / base)
                for name in self.rows.tables()}

    def _table_factor(self, scale: float, row_scale: float) -> float:
        if self.rule is None or scale == 1.0:
            return 1.0
        summary = self.stats.summary()
        return scaling.RULES[self.rule](row_scale, summary["sqr"], summary["var"], self.base_batch or 1)

    def decision_due(self, warmup: int, interval: int) -> bool:
        return self.decider.due(self.steps, warmup, interval)

    def choose(self, max_batch: int, local_bounds: tuple[int, int], max_accumulation: int) -> BatchChoice | None:
        """The batch to use from now on, or None to keep the current one: the goodput-maximising
        size (within what was measured, see `explore`, and what hysteresis allows) when its
        predicted gain clears the decision's margin (decision.py), or at once when the batch in
        force breaks the limits (e.g. one restored at another world size). Deterministic in the
        shared statistics and step times, so every rank proposes the same; nothing changes
        until adopt() takes the agreed decision."""
        if not self.base_batch:
            return None
        if not self.measured_here():  # (needs no step times: at once after a restart)
            return self._choose_unmeasured(max_batch, local_bounds, max_accumulation)
        if not self.throughput.fitted(self.world):
            return None
        steady = self.stats.steady()  # (averaged over at least a few steps: see GradientStats)
        phi = steady["noise_scale"]
        if math.isnan(phi):  # no statistics yet (inf is fine: all noise)
            return None
        lo, hi = local_bounds
        # Only as far outside the sizes measured here as the lines can be trusted (reach): beyond
        # them the lines are guesses. (Downwards too: a line through the origin fitted at big
        # batches -- no per-step cost seen -- made the smallest batch look free, and word2vec
        # jumped from 2979 to 534.)
        below, beyond = self.throughput.reach(self.world, self.config.explore)
        explored = max(int(lo), min(int(hi), int(beyond)))
        lowest = max(int(lo), min(explored, math.ceil(below)))
        # A world of one measures the noise only across micro-steps: it keeps at least two.
        min_accumulation = 2 if self.world == 1 and max_accumulation >= 2 else 1
        eff = self.efficiency_of(phi)
        in_limits = allowed(self.world, self.local_batch, self.accumulation, max_batch, local_bounds, max_accumulation)
        bars = self.decider.bounds(phi) if in_limits else (0, math.inf)
        best = choose_batch(self.throughput, self.world, self.base_batch, phi, max_batch, (lowest, explored),
                            max_accumulation, min_accumulation, efficiency_of=eff, global_bounds=bars)
        now = self.global_batch()
        current = BatchChoice(self.local_batch, self.accumulation, self.world,
                              self.throughput.throughput(self.world, self.local_batch, self.accumulation) * eff(now),
                              eff(now), noise_scale=phi)
        if not in_limits:
            self.choice = dataclasses.replace(best, kind="limits", noise_scale=phi)
            return self.choice
        def efficiency_ratio(noise_scale: float) -> float:  # best's over the current's, at that noise scale
            eff_there = self.efficiency_of(noise_scale)
            return eff_there(best.global_batch) / eff_there(now)

        at_best = self.tables(best.global_batch, steady)
        tables = {name: {"duplicates": t["duplicates"], "efficiency_current": t["efficiency"],
                         "efficiency_best": at_best[name]["efficiency"]} for name, t in self.tables(now, steady).items()}
        decision = self.decider.judge(best, current, self.throughput, efficiency_ratio, phi,
                                      steady["noise_scale_bounds"], self.steps, tables)
        self.choice = decision or current
        return decision

    def adopt(self, decision: BatchChoice | None) -> None:
        """The agreed decision (the same on every rank), before the batch changes to it."""
        current = BatchChoice(self.local_batch, self.accumulation, self.world, math.nan, math.nan)
        steady = self.stats.steady()
        tables = None
        if decision is not None and self.rows.tables():
            tables = {name: {"duplicates": t["duplicates"], "efficiency": t["efficiency"]}
                      for name, t in self.tables(decision.global_batch, steady).items()}
        self.decider.adopt(decision, current, self.steps, steady["noise_scale"], tables)

    def _choose_unmeasured(self, max_batch: int, local_bounds: tuple[int, int], max_accumulation: int):
        """choose() with no statistics of this run: only what needs none. Statistics a
        checkpoint brought are frozen where nothing measures new ones (a world of one without
        micro-steps), and a batch chosen from them would grow on a stale noise scale. So the
        batch is kept; one breaking the limits becomes the nearest allowed; and a world of one
        that may accumulate takes its batch in two micro-steps, whose gradients measure."""
        sizes = None
        if not allowed(self.world, self.local_batch, self.accumulation, max_batch, local_bounds, max_accumulation):
            sizes = nearest_allowed(self.world, self.global_batch(), max_batch, local_bounds, max_accumulation)
        elif self.world == 1 and self.accumulation == 1 and max_accumulation >= 2 and self.local_batch % 2 == 0 \
                and self.local_batch // 2 >= local_bounds[0]:
            sizes = (self.local_batch // 2, 2)
        if sizes is None or sizes == self.sizes():
            return None
        self.choice = BatchChoice(*sizes, self.world, math.nan, math.nan, kind="restored")
        return self.choice

    def summary(self) -> dict:
        """What explain() and the timeline show."""
        s = self.stats.summary()
        batch, base = self.global_batch(), self.base_batch or 1
        return {"noise_scale": s["noise_scale"], "sqr": s["sqr"], "var": s["var"], "local_batch": self.local_batch,
                "accumulation": self.accumulation, "global_batch": self.global_batch(), "base_batch": self.base_batch,
                "scale": self.scale(), "gain": self.last_gain, "lr_factor": self.last_factor, "rule": self.rule,
                "progress": self.progress, "steps": self.steps, "nonfinite_steps": s["nonfinite_steps"],
                "efficiency": self.efficiency_of(s["noise_scale"], base)(batch),
                "efficiency_model": self.efficiency_model, "efficiency_reason": self.efficiency_reason,
                "tables": self.tables(batch, s), "rescale_accumulators": self.accumulators.enabled,
                "rescales": list(self.accumulators.log)}

    def state_dict(self) -> dict:
        local_batch, accumulation = self.partial_step_of or self.sizes()  # the batch chosen, not a remainder
        return {"stats": self.stats.state_dict(), "throughput": self.throughput.state_dict(),
                "local_batch": local_batch, "accumulation": accumulation, "base_batch": self.base_batch,
                "progress": self.progress, "steps": self.steps, "world": self.world,
                "decider": self.decider.state_dict(), "rows": self.rows.state_dict(),
                "accumulators": self.accumulators.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state.get("stats", {}))
        self._loaded_observations = self.stats.observations
        self.throughput.load_state_dict(state.get("throughput", {}))
        self.rows.load_state_dict(state.get("rows", {}))  # (the id distribution's: valid at any world size)
        self.base_batch = int(state.get("base_batch") or self.base_batch)
        self.progress = float(state.get("progress", 0.0))
        self.steps = int(state.get("steps", 0))
        saved_world = int(state.get("world", self.world))
        saved_batch = int(state.get("local_batch") or 0) * int(state.get("accumulation", 1)) * saved_world
        self.accumulators.load_state_dict(state.get("accumulators", {}), saved_batch)
        self.decider.load_state_dict(state.get("decider", {}))
        if saved_world != self.world:
            self.decider.reset()
        if saved_world == self.world and state.get("local_batch"):
            self.set_batch(int(state["local_batch"]), int(state.get("accumulation", 1)))
        elif state.get("local_batch"):  # another world size: the nearest global batch until re-chosen
            k = int(state.get("accumulation", 1))
            per_rank = int(state["local_batch"]) * k * saved_world / self.world
            self.set_batch(max(1, round(per_rank / k)), k)
