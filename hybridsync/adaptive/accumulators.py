"""When an accumulate-forever optimizer's state is rescaled for a new global batch, and the log
of each rescale (docs/adaptive.md, "Adagrad's accumulators across a batch change").

Adagrad divides by the sum of every past squared gradient. Steps at a small batch add larger,
noisier squared gradients per sample than a big batch's would have, so after the batch grows
every step moves with a smaller effective learning rate for the rest of the run. At each durable
change of the global batch from b to B the sums are multiplied by
scaling.accumulator_factor(b, B, phi): what a run at B would have accumulated over the same
samples. "Durable": a decided change, or a restart or checkpoint that continues at another
global batch than the state was built at -- not an epoch's partial last step (one short step
whose few squared gradients change the sum as any step does; the batch chosen is back at the
next step, so there is no history to correct).

The bookkeeping is one number, `built_at`: the global batch the accumulated state belongs to.
It travels in checkpoints with the state it describes, so a checkpoint saved after a rescale
loads without another, one saved before it loads and rescales once, and an elastic restart that
rolls both back together applies it exactly once. The frontends apply the factor at the step the
change takes effect, before that step's pushes (hybridsync.torch / hybridsync.tensorflow), so on
every PS shard it falls after the last push at b and before the first at B.
"""
from __future__ import annotations

import math

from . import scaling
from .decision import MAX_LOG


class AccumulatorRescale:
    def __init__(self, setting, enabled: bool):
        self.forced = setting is True  # rescale_accumulators=True: there must be state to rescale
        self.enabled = bool(enabled)
        self.built_at = 0  # global batch the accumulated state was built at (0: nothing built yet)
        self.pending: dict | None = None  # a rescale planned between steps, applied at the next one
        self.log: list[dict] = []

    def require_state(self, found: bool, optimizer_name: str) -> None:
        """The frontend says whether it found any accumulating state (its optimizer is Adagrad, or
        a PS table's server rule is). Forced on with none: an error naming the key."""
        if self.forced and not found:
            raise ValueError(f"adaptive: rescale_accumulators=True, but neither the optimizer ({optimizer_name}) nor "
                             "any PS table's server rule accumulates squared gradients (Adagrad): there is nothing "
                             "to rescale ('auto' or False)")
        if not found:
            self.enabled = False  # ('auto' on an Adagrad-named optimizer with no such state: nothing to do)

    def plan(self, step: int, batch: int, agreed_noise_scale) -> None:
        """Between steps, on every rank alike, with the global batch the next step runs at (the one
        chosen, not a partial step's). agreed_noise_scale(): the noise scale every rank takes
        (called only when a rescale is due: it is a collective). A rescale already planned for
        `batch` stays; one planned for another batch is replaced (the factor always goes from
        the batch the state was built at)."""
        if not self.enabled:
            return
        if not self.built_at:
            self.built_at = int(batch)  # the first steps build it
            return
        if self.built_at == batch:
            self.pending = None
            return
        if self.pending is not None and self.pending["to"] == batch:
            return
        phi = float(agreed_noise_scale())
        factor = scaling.accumulator_factor(self.built_at, batch, phi)
        self.pending = {"step": int(step), "from": self.built_at, "to": int(batch), "noise_scale": phi,
                        "factor": factor}

    def take(self, step: int) -> float | None:
        """At the start of a step's exchange, before its pushes: the factor to multiply the
        accumulators by (None: nothing to do). A planned rescale with no statistics to compute
        it (NaN noise scale) is recorded as skipped: the state is left as it is and counts as
        built at the new batch from then on."""
        entry, self.pending = self.pending, None
        if entry is None:
            return None
        self.built_at = entry["to"]
        applied = math.isfinite(entry["factor"])
        self.log.append({**entry, "step": int(step), "applied": applied,
                         **({} if applied else {"reason": "no gradient statistics yet: state left as it is"})})
        del self.log[:-MAX_LOG]
        return entry["factor"] if applied else None

    def last(self) -> dict | None:
        return self.log[-1] if self.log else None

    def state_dict(self) -> dict:
        return {"built_at": self.built_at, "log": self.log}

    def load_state_dict(self, state: dict, default_built_at: int) -> None:
        """default_built_at: for a checkpoint from before this existed, the global batch it saved."""
        self.built_at = int(state.get("built_at", default_built_at) or 0)
        self.log = [dict(e) for e in state.get("log", [])]
        self.pending = None
