"""When the batch changes, given the goodput model's best size: only for a gain the model can
tell from its own noise, never back and forth.

The best size is an argmax over a flat curve: near the optimum, goodput varies by a few percent
over a factor of two in batch, while a shared machine's step times and a few steps' gradient
statistics vary by more. Taking every argmax made the batch thrash (word2vec 1024 -> 2048 ->
1040 -> 2080 -> 1056, DLRM 4096 -> 2518 -> 4218 within 50 steps). So:

- The margin. A change needs a predicted gain above min_gain and above `confidence` standard
  errors of the prediction: the relative standard errors of the two sizes' step times (each
  size's median over its newest steps, goodput.ThroughputModel.uncertainty) and the change in
  the efficiency ratio when the noise scale moves by its own standard error
  (gns.GradientStats.noise_scale_error).
- Probes. A size beyond those measured is an extrapolation with no error to speak of: moving
  there is a probe, judged at the next decision (after measure_steps steps), once measured. A
  probe measured worse is left -- a 'return', the exploration's outcome, not a decision in the
  other direction -- and the sizes from it onwards are barred until the noise scale has grown
  `revisit` times (a bigger batch's efficiency rises with it). A probe that holds is kept, and
  from then on it is the direction the batch went.
- Hysteresis. A move bars the sizes it left (the floor, when it grew; the ceiling, when it
  shrank) until the noise scale moves `revisit` times in their favour, and a move against the
  direction of the last one needs `hysteresis` times the margin.

Every rank proposes from the same statistics and step times; the exchange makes it the lowest
stepping rank's proposal everywhere, and adopt() then updates the state identically on every
rank, from the agreed decision and the noise scale it carries.
"""
from __future__ import annotations

import math

from .goodput import BatchChoice, ThroughputModel

MAX_LOG = 200  # decisions kept for explain() and the benchmark's trace


class BatchDecider:
    def __init__(self, config):
        self.config = config
        self.floor: tuple[int, float] | None = None  # (global batch left when growing, noise scale then)
        self.ceiling: tuple[int, float] | None = None  # (global batch left when shrinking or returning, noise scale)
        self.direction = 0  # +1 / -1: the way the last kept change went
        self.probe: tuple[int, int, int] | None = None  # a probe's origin: (local batch, micro-steps, direction before)
        self.last_change_step = 0
        self.pending = False  # decide at the next chance (restored at another world size)
        self.log: list[dict] = []
        self.judgements: list[dict] = []  # every judgement, taken or not (the newest MAX_LOG)

    # -- when ------------------------------------------------------------------------------------
    def due(self, steps: int, warmup: int, interval: int) -> bool:
        """Whether the batch is decided on at this step: every `interval` steps after `warmup`,
        and measure_steps after a change (a probe is judged as soon as it has a median); at once
        after a restart at another world size."""
        if steps < warmup:
            return False
        if self.pending:
            return True
        since = steps - self.last_change_step
        return since > 0 and (since == int(self.config.measure_steps) or since % int(interval) == 0)

    # -- which sizes may be chosen ---------------------------------------------------------------------
    def bounds(self, noise_scale: float) -> tuple[float, float]:
        """(lowest, highest) global batch allowed, both exclusive: the sizes hysteresis bars,
        unless the noise scale has since moved `revisit` times in their favour (a smaller batch
        gains efficiency as it falls, a bigger one as it grows)."""
        lo, hi = 0.0, math.inf
        revisit = self.config.revisit
        if self.floor is not None and not noise_scale < self.floor[1] / revisit:
            lo = self.floor[0]
        if self.ceiling is not None and not noise_scale > self.ceiling[1] * revisit:
            hi = self.ceiling[0]
        return lo, hi

    # -- whether to change ------------------------------------------------------------------------
    def judge(self, best: BatchChoice, current: BatchChoice, throughput: ThroughputModel, efficiency_ratio,
              noise_scale: float, noise_bounds: tuple[float, float], step: int = 0,
              tables: dict | None = None) -> BatchChoice | None:
        """The change to `best` as a decision (kind, gain, threshold), or None to keep `current`.
        efficiency_ratio(phi): best's efficiency over current's were the noise scale phi;
        noise_bounds: the noise scale one standard error below and above; tables: each PS
        table's row counts and efficiency at both sizes, kept with the judgement."""
        if (best.local_batch, best.accumulation) == (current.local_batch, current.accumulation):
            return None
        world = current.world
        err_current = throughput.uncertainty(world, current.local_batch)
        if err_current is None:  # the batch in force is not measured yet: nothing to compare with
            return None
        err_best = throughput.uncertainty(world, best.local_batch)
        probe = err_best is None  # an extrapolation: its error is what the probe will measure
        # How much the efficiency ratio moves with the noise scale one standard error either way
        # (none where the noise scale reads inf and may not be below its bound: all noise).
        ratio = efficiency_ratio(noise_scale)
        err_stats = max(abs(math.log(efficiency_ratio(phi) / ratio)) for phi in noise_bounds)
        sigma = math.sqrt(err_current ** 2 + (err_best or 0.0) ** 2 + err_stats ** 2)
        margin = max(math.log(self.config.min_gain), self.config.confidence * sigma)
        going = 1 if best.global_batch > current.global_batch else -1
        kind = "probe" if probe else "move"
        if self.probe is not None and going != self._probe_direction(current):
            kind = "return"  # the probe measured worse: the exploration's outcome, at the usual margin
        elif self.direction and going != self.direction:
            margin *= self.config.hysteresis  # a reversal
        gain = best.goodput / current.goodput if current.goodput > 0 else math.inf
        taken = math.log(gain) > margin
        self.judgements.append({"step": step, "current": current.global_batch, "best": best.global_batch,
                                "kind": kind, "gain": gain, "threshold": math.exp(margin), "taken": taken,
                                "noise_scale": noise_scale, "error_current": err_current, "error_best": err_best,
                                "error_statistics": err_stats, **({"tables": tables} if tables else {})})
        del self.judgements[:-MAX_LOG]
        if not taken:
            return None
        return BatchChoice(best.local_batch, best.accumulation, world, best.goodput, best.efficiency, kind, gain,
                           math.exp(margin), noise_scale)

    def _probe_direction(self, current: BatchChoice) -> int:
        local, accumulation, _ = self.probe
        return 1 if current.global_batch > local * accumulation * current.world else -1

    # -- what a decision changes ------------------------------------------------------------------------
    def adopt(self, decision: BatchChoice | None, current: BatchChoice, step: int, noise_scale: float,
              tables: dict | None = None) -> None:
        """After the exchange, on every rank alike: the agreed decision (None: the batch stays);
        tables: each PS table's row counts and efficiency at the new size, for the log."""
        self.pending = False
        if self.probe is not None and (decision is None or decision.kind != "return"):
            self._keep_probe(current)  # the probe held (or was outgrown): it is where the batch went
        if decision is None:
            return
        phi = decision.noise_scale if math.isfinite(decision.noise_scale) else noise_scale
        was = current.global_batch
        going = 1 if decision.global_batch > was else -1
        if decision.kind == "return":
            # (the probe's size and beyond it are barred until the noise scale grows revisit times)
            self.ceiling = (was, phi) if going < 0 else self.ceiling
            self.floor = (was, phi) if going > 0 else self.floor
            self.direction = self.probe[2]
            self.probe = None
        elif decision.kind == "probe":
            self.probe = (current.local_batch, current.accumulation, self.direction)
        elif decision.kind == "move":
            self._leave(was, going, phi)
        self.last_change_step = step
        self.log.append({"step": step, "kind": decision.kind, "from": was, "to": decision.global_batch,
                         "gain": decision.gain, "threshold": decision.threshold, "noise_scale": phi,
                         **({"tables": tables} if tables else {})})
        del self.log[:-MAX_LOG]

    def _keep_probe(self, current: BatchChoice) -> None:
        local, accumulation, _ = self.probe
        origin = local * accumulation * current.world
        self.probe = None
        if origin != current.global_batch:
            self._leave(origin, 1 if current.global_batch > origin else -1, self._last_noise_scale())

    def _leave(self, was: int, going: int, phi: float) -> None:
        if going > 0:
            self.floor = (was, phi)
        else:
            self.ceiling = (was, phi)
        self.direction = going

    def _last_noise_scale(self) -> float:
        return self.log[-1]["noise_scale"] if self.log else math.nan

    def reset(self) -> None:
        """Another world size: other step times, another landscape; explored afresh."""
        self.floor = self.ceiling = self.probe = None
        self.direction = 0
        self.pending = True

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"floor": self.floor, "ceiling": self.ceiling, "direction": self.direction, "probe": self.probe,
                "pending": self.pending, "last_change_step": self.last_change_step, "log": self.log, "judgements": self.judgements}

    def load_state_dict(self, state: dict) -> None:
        tup = lambda v: tuple(v) if v is not None else None  # noqa: E731  (JSON makes tuples lists)
        self.floor, self.ceiling, self.probe = tup(state.get("floor")), tup(state.get("ceiling")), tup(state.get("probe"))
        self.direction = int(state.get("direction", 0))
        self.pending = bool(state.get("pending", False))
        self.last_change_step = int(state.get("last_change_step", 0))
        self.log = [dict(entry) for entry in state.get("log", [])]
        self.judgements = [dict(entry) for entry in state.get("judgements", [])]
