"""PyTorch glue of hybridsync.adaptive: the optimizer's per-step part (learning-rate factor,
accumulation micro-steps, step times) and AdaptiveDataLoader, whose batch size follows the
goodput-maximising choice. The decisions themselves are in hybridsync/adaptive."""
from __future__ import annotations

import math
import weakref

import torch

from .. import comm, runtime, timeline
from ..adaptive import Adaptive, AdaptiveConfig
from ..adaptive.batches import AdaptiveBatches
from ..adaptive.collect import StepRecorder
from .micro_stats import MicroStepStats

_current = None  # weakref to the newest adaptive optimizer's AdaptiveStep (a loader finds it)
_every: list = []  # weakrefs to every adaptive optimizer's AdaptiveStep, oldest first (the same on every rank)


def current():
    """The AdaptiveStep of the newest DistributedOptimizer(adaptive=...), or None."""
    step = _current() if _current is not None else None
    return step


def after_join(last: int) -> None:
    """Collective, when hvd.join() returns on every rank: the ranks that joined early skipped the
    others' last steps, so their adaptive state (step count, statistics, batch) lags; every rank
    takes that of the rank that joined last. (Left as it was, the loaders re-chose the batch at
    different steps: a rank waited in that exchange while another pulled a table.)"""
    steps = [s for s in (ref() for ref in _every) if s is not None]
    if not steps or runtime.world().size == 1:
        return
    rank = runtime.world().rank
    states = comm.objects().broadcast_object([s.controller.state_dict() for s in steps] if rank == last else None,
                                             last, name="hybridsync.adaptive.join")
    for step, state in zip(steps, states):
        if rank != last:
            step.load_state_dict(state)


class AdaptiveStep:
    """One optimizer's adaptive part; every method is a no-op when adaptation is off, so the
    optimizer behaves (and computes) exactly as without it."""

    def __init__(self, optimizer, config, world_size: int, ctx):
        global _current
        cfg = AdaptiveConfig.of(config)
        self.enabled = cfg is not None
        self.opt, self.ctx = optimizer, ctx
        self.controller = Adaptive(cfg, type(optimizer).__name__, world_size) if self.enabled else None
        self._micro = 0
        self._saved_lrs = None
        if self.enabled:
            self.recorder = ctx.stats = StepRecorder(self.controller, world_size, runtime.world().rank)
            # a world of one has no all-reduce: its statistics come from accumulation micro-steps
            self.micro_stats = MicroStepStats(optimizer) if world_size == 1 else None
            _current = weakref.ref(self)
            _every[:] = [ref for ref in _every if ref() is not None] + [_current]
            if self.controller.local_batch:
                self.set_batch(self.controller.local_batch, 1)

    # -- Adagrad's accumulators across batch changes (hybridsync.adaptive.accumulators) ---------------
    def _dense_accumulators(self) -> list:
        """(sum tensor, its initial value) of every parameter the wrapped torch.optim.Adagrad
        updates here (PS tables keep theirs on the shards)."""
        if not isinstance(self.opt, torch.optim.Adagrad):
            return []
        mine = {id(p) for p in self.opt._hs_param_of.values()}
        return [(self.opt.state[p]["sum"], float(group["initial_accumulator_value"]))
                for group in self.opt.param_groups for p in group["params"]
                if id(p) in mine and "sum" in self.opt.state.get(p, {})]

    def check_accumulators(self, table_rules) -> None:
        """At wrapping: whether there is accumulating state anywhere (the wrapped optimizer is
        torch.optim.Adagrad, or a PS table's server rule is 'adagrad'); forced on with none raises."""
        if self.enabled:
            found = isinstance(self.opt, torch.optim.Adagrad) or "adagrad" in table_rules
            self.controller.accumulators.require_state(found, type(self.opt).__name__)

    def rescale_accumulators(self) -> None:
        """At the start of the step a batch change takes effect, before its pushes: the dense
        sums and every PS table's (one collective) times the factor every rank computed alike."""
        if not self.enabled:
            return
        factor = self.controller.accumulators.take(self.controller.steps)
        if factor is None:
            return
        with timeline.span("rescale accumulators", "adaptive"), torch.no_grad():
            for acc, base in self._dense_accumulators():
                if base == 0.0:
                    acc.mul_(factor)
                else:  # (what was accumulated above the initial value; as the shards do)
                    acc.copy_(torch.where(acc == base, acc, (acc - base).mul_(factor).add_(base)))
            self.opt._hs_sync.rescale_accumulators(factor)
        tl = timeline.get()
        if tl is not None:
            tl.counter("adaptive rescale", {"factor": factor})

    def require(self, what: str) -> Adaptive:
        if not self.enabled:
            raise RuntimeError(f"optimizer.{what} needs hybridsync.torch.DistributedOptimizer(..., adaptive=True)")
        return self.controller

    # -- batch -------------------------------------------------------------------------------------
    def set_batch(self, local_batch: int, accumulation: int = 1) -> None:
        """From now on each step is `accumulation` backward passes of `local_batch` samples."""
        self.controller.set_batch(local_batch, accumulation)
        self.opt.set_backward_passes_per_step(accumulation)
        self.ctx.grad_scale = 1.0 / accumulation  # the micro-steps' sum becomes their mean
        self._micro = 0

    def accumulating(self) -> bool:
        """step() of a micro-step that is not the last of its step: nothing to do yet."""
        if not self.enabled or self.controller.accumulation == 1:
            return False
        if self.micro_stats is not None:
            self.micro_stats.micro_step_done()
        self._micro += 1
        if self._micro < self.controller.accumulation:
            return True
        self._micro = 0
        if self.micro_stats is not None:
            self.micro_stats.observe(self.controller)
        return False

    def last_micro_step(self) -> bool:
        """Whether the backward pass just done completes its step (the next step() steps)."""
        return not self.enabled or self._micro + 1 >= self.controller.accumulation

    def mid_accumulation(self) -> bool:
        return self.enabled and self._micro > 0

    # -- each step -----------------------------------------------------------------------------------
    def scale_lr(self) -> None:
        """Before the exchange: the rule's factor applied to every group's learning rate (the
        server rules read it from there, or from ctx.lr_factor when the config fixed theirs)."""
        if not self.enabled:
            return
        k = self.controller.accumulation
        if k > 1 and self.ctx.world_size == 1:  # no all-reduce to take the mean of the micro-steps
            for p in self.opt._hs_param_of.values():
                if p.grad is not None:
                    p.grad.mul_(1.0 / k)
        factor = self.controller.lr_factor()
        self.controller.last_factor = factor
        self.ctx.lr_factor = factor
        self.ctx.table_lr_factors = self.controller.table_lr_factors()
        if factor != 1.0 and self._saved_lrs is None:
            self._saved_lrs = [group["lr"] for group in self.opt.param_groups]
            for group in self.opt.param_groups:
                group["lr"] = group["lr"] * factor

    def step_skipped(self) -> None:
        """synchronize() was followed by zero_grad(), not step(): the learning rate goes back, and
        the next backward pass starts a step afresh (its first micro-step)."""
        if not self.enabled:
            return
        self._restore_lrs()
        if self.micro_stats is not None and self._micro:  # one rank: its micro-steps' statistics
            self.micro_stats.micro_step_done()  # (the step's last one; a non-finite step is counted)
            self.micro_stats.observe(self.controller)
        self._micro = 0

    def _restore_lrs(self) -> None:
        if self._saved_lrs is not None:  # the schedule keeps seeing the base learning rate
            for group, lr in zip(self.opt.param_groups, self._saved_lrs):
                group["lr"] = lr
            self._saved_lrs = None

    def step_done(self) -> None:
        if not self.enabled:
            return
        self._restore_lrs()
        self.controller.step_done()
        self.recorder.step_ended()
        tl = timeline.get()
        if tl is not None:
            s = self.controller.summary()
            tl.counter("adaptive", {"noise_scale": _finite(s["noise_scale"]), "global_batch": s["global_batch"],
                                    "gain": s["gain"], "lr_factor": s["lr_factor"]})

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state)
        if self.controller.local_batch:
            self.set_batch(self.controller.local_batch, self.controller.accumulation)
        self.recorder.reset_clock()


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


class AdaptiveDataLoader:
    """Batches of `dataset` for this rank, at the batch size the adaptive optimizer chose.

    batch_size: the global batch the learning rate was written for (each rank takes
    batch_size // world size per step until autoscale_batch_size() lets it change). Each rank
    reads its own share of a permutation that every rank draws the same (seed + epoch).
    drop_last: as torch's DataLoader's. False (default): the samples left after an epoch's last
    full step are one more, smaller step, the same size on every rank (a dataset smaller than one
    global batch is one such step per epoch); True: they are dropped, and an epoch that would
    have no step raises ValueError naming both sizes.
    """

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0, collate_fn=None,
                 optimizer=None, interval: int = 20, warmup: int = 10, drop_last: bool = False):
        world = runtime.world()
        self.dataset = dataset
        self.batches = AdaptiveBatches(len(dataset), batch_size, world.rank, world.size, shuffle, seed, interval,
                                       warmup, drop_last)
        self.batch_size = int(batch_size)
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self._optimizer = optimizer

    def autoscale_batch_size(self, max_batch_size: int, local_bsz_bounds=None, gradient_accumulation: bool = False,
                             max_accumulation: int = 8) -> None:
        """Lets the batch size change, within max_batch_size (global) and local_bsz_bounds (per
        rank), to whatever maximises predicted goodput; with gradient_accumulation, a step may
        also be several backward passes (up to max_accumulation)."""
        self.batches.set_autoscale(max_batch_size, local_bsz_bounds, max_accumulation if gradient_accumulation else 1)

    @property
    def changes(self) -> list:
        """(step, local batch, accumulation) each time the batch size changed."""
        return self.batches.changes

    @property
    def epoch(self) -> int:
        return self.batches.epoch

    def _step(self) -> AdaptiveStep:
        step = self._optimizer._hs_adaptive if self._optimizer is not None else current()
        if step is None or not step.enabled:
            raise RuntimeError("AdaptiveDataLoader needs a hybridsync.torch.DistributedOptimizer(..., adaptive=True) "
                               "(create it before iterating, or pass optimizer=)")
        return step

    @property
    def current_local_bsz(self) -> int:
        return self._step().controller.local_batch

    @property
    def accumulation_steps(self) -> int:
        return self._step().controller.accumulation

    @property
    def current_batch_size(self) -> int:
        return self._step().controller.global_batch()

    def _batch(self, idx):
        tensors = getattr(self.dataset, "tensors", None)
        if isinstance(self.dataset, torch.utils.data.TensorDataset) and tensors is not None:
            index = torch.from_numpy(idx)
            return tuple(t[index] for t in tensors)
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def __iter__(self):
        step = self._step()
        self.batches.start(step.controller, step.set_batch)
        batches = self.batches.epoch_batches(step.controller, step.set_batch, step.ctx.allreduce_sum)
        while True:
            step.recorder.step_started()  # runs when the loop asks for the next batch (no-op mid-step)
            idx = next(batches, None)
            if idx is None:
                return
            yield self._batch(idx)

    def __len__(self) -> int:
        """Batches (micro-batches) in an epoch at the batch size in force, the partial last step
        included (drop_last=False)."""
        step = self._optimizer._hs_adaptive if self._optimizer is not None else current()
        controller = step.controller if step is not None and step.enabled else None
        b, k = (controller.partial_step_of or controller.sizes()) if controller and controller.local_batch else \
            (self.batch_size // self.batches.world, 1)
        full, left = self.batches.steps(b, k)
        return full * k + (1 if left else 0)
