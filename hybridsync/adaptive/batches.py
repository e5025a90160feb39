"""The batches an adaptive loader hands out, whatever the framework: each rank's share of a
permutation every rank draws the same, cut at the batch size in force, and the periodic
re-choice of that size (the lowest stepping rank's choice, agreed by an exchange a joined rank
takes part in, so every rank that steps switches at the same step).

An epoch's samples seldom fill a whole number of steps. As PyTorch's DataLoader does with
drop_last=False (the default), what is left after the last full step is one more, smaller step:
every rank holds the same number of samples, so every rank has that step, of the same size; it
is one backward pass (no accumulation: the remainder may be smaller than the micro-steps), at
which the statistics, the learning-rate rule and progress see the batch it really is, while the
batch chosen stays in force (it is what checkpoints keep) and the step is not timed (a remainder
is no batch size the throughput model should fit). drop_last=True drops the remainder, and an
epoch that would have no step at all is an error naming both sizes (never a silent empty epoch)."""
from __future__ import annotations

import numpy as np

from .exchange import agree_on_decision, gather_rows
from .goodput import allowed, nearest_allowed


class AdaptiveBatches:
    def __init__(self, num_samples: int, batch_size: int, rank: int, world: int, shuffle: bool = True,
                 seed: int = 0, interval: int = 20, warmup: int = 10, drop_last: bool = False):
        if batch_size < world:
            raise ValueError(f"batch_size={batch_size} is smaller than the number of ranks ({world})")
        if num_samples < world:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than the {world} ranks")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, int(seed)
        self.drop_last = bool(drop_last)
        if self.drop_last and self.per_rank() < self.batch_size // world:
            self._no_step(self.batch_size // world, 1)
        self.interval, self.warmup = int(interval), int(warmup)
        self.epoch = 0
        self.autoscale = None  # (max_batch, (lo, hi), max accumulation)
        self.changes: list = []  # (step, local batch, accumulation) each time the batch changed

    def set_autoscale(self, max_batch_size: int, local_bsz_bounds=None, max_accumulation: int = 1) -> None:
        if max_batch_size < self.batch_size:
            raise ValueError(f"max_batch_size={max_batch_size} is below batch_size={self.batch_size}")
        base_local = self.batch_size // self.world
        lo, hi = local_bsz_bounds if local_bsz_bounds is not None else (1, max(base_local, max_batch_size // self.world))
        if not 1 <= int(lo) <= int(hi):
            raise ValueError(f"local_bsz_bounds must be (lo, hi) with 1 <= lo <= hi, got {local_bsz_bounds}")
        self.autoscale = (int(max_batch_size), (int(lo), int(hi)), max(1, int(max_accumulation)))

    def start(self, controller, set_batch) -> None:
        """Before the first batch: the base batch size, unless a checkpoint restored one (then
        the allowed batch nearest the restored global batch, which at another world size may
        not divide evenly or may leave local_bsz_bounds)."""
        self._end_partial(controller, set_batch)  # (a loop that left an epoch at its partial step)
        if not controller.local_batch:
            set_batch(*self._first_batch())
        elif self.autoscale is not None and not allowed(self.world, *controller.sizes(), *self.autoscale):
            set_batch(*nearest_allowed(self.world, controller.global_batch(), *self.autoscale))
        if not controller.base_batch:
            controller.base_batch = self.batch_size

    def _first_batch(self) -> tuple[int, int]:
        """The base batch. A world of one has no all-reduce to measure the gradient noise with:
        when accumulation is allowed it takes the base batch in two micro-steps, whose gradients
        give the statistics (without them no choice is ever made)."""
        local = max(1, self.batch_size // self.world)
        if self.world == 1 and self.autoscale is not None and self.autoscale[2] >= 2 and local % 2 == 0 \
                and local // 2 >= self.autoscale[1][0]:
            return local // 2, 2
        return local, 1

    def rechoose(self, controller, set_batch, allreduce_sum) -> None:
        """Collective, at the same step on every rank that still steps (a rank that called
        hvd.join() stands in): the lowest such rank's decision (or none) everywhere, adopted by
        every rank's controller before the batch changes. Due every `interval` steps after
        `warmup`, and measure_steps after a change (controller.decision_due).
        allreduce_sum(array, name): the optimizer's dense backend's sum all-reduce."""
        if self.autoscale is None or not controller.routes_settled \
                or not controller.decision_due(self.warmup, self.interval):
            return
        change = controller.choose(*self.autoscale)
        if self.world > 1:
            change, controller.choice = agree_on_decision(allreduce_sum, self.rank, self.world, change,
                                                          controller.choice)
        if change is not None and (change.local_batch, change.accumulation) == controller.sizes():
            change = None
        controller.adopt(change)
        if change is not None:
            set_batch(change.local_batch, change.accumulation)
            self.changes.append((controller.steps, change.local_batch, change.accumulation))

    def plan_rescale(self, controller, allreduce_sum) -> None:
        """Between steps, at the batch chosen (never a partial step's): where the global batch
        differs from the one the optimizer's accumulated squared gradients were built at (a
        decision just adopted, or a checkpoint from another batch or world size), the rescale the
        next step applies (accumulators.py), with the lowest stepping rank's noise scale -- one
        small exchange per change, so the factor is the same bits on every rank."""
        def agreed_noise_scale() -> float:
            phi = controller.stats.steady()["noise_scale"]
            if self.world == 1:
                return phi
            rows = gather_rows(allreduce_sum, self.rank, self.world, [phi], "hybridsync.adaptive.rescale")
            return float(rows[min(rows)][0])

        controller.accumulators.plan(controller.steps, controller.global_batch(), agreed_noise_scale)

    def per_rank(self) -> int:
        """Samples each rank reads per epoch (the same on every rank: the last num_samples % world
        of the permutation are left out)."""
        return self.num_samples // self.world

    def steps(self, local_batch: int, accumulation: int) -> tuple[int, int]:
        """(full steps, samples per rank in the partial last step: 0 if none) of an epoch at
        this batch size."""
        full, left = divmod(self.per_rank(), local_batch * accumulation)
        return full, 0 if self.drop_last else left

    def _no_step(self, local_batch: int, accumulation: int):
        raise ValueError(
            f"drop_last=True and the dataset's {self.num_samples} samples ({self.per_rank()} per rank over "
            f"{self.world} rank{'s' if self.world > 1 else ''}) are fewer than one global batch of "
            f"{local_batch * accumulation * self.world} ({local_batch} per rank"
            f"{f' x {accumulation} micro-steps' if accumulation > 1 else ''}): the epoch would have no step "
            "(drop_last=False makes the whole dataset one smaller step)")

    def my_indices(self) -> np.ndarray:
        """This rank's samples of this epoch, in order (every rank the same count)."""
        order = (np.random.default_rng(self.seed + self.epoch).permutation(self.num_samples) if self.shuffle
                 else np.arange(self.num_samples))
        usable = (self.num_samples // self.world) * self.world
        return order[self.rank:usable:self.world]

    def epoch_batches(self, controller, set_batch, allreduce_sum):
        """Index arrays of one epoch's micro-batches; the size may change between steps. The
        remainder is one more, smaller step (see the top of this file)."""
        self._end_partial(controller, set_batch)  # (a loop that left an epoch at its partial step)
        mine, pos = self.my_indices(), 0
        while True:
            self.rechoose(controller, set_batch, allreduce_sum)
            self.plan_rescale(controller, allreduce_sum)
            b, k = controller.sizes()
            left = len(mine) - pos
            if left >= b * k:
                for _ in range(k):
                    yield mine[pos:pos + b]
                    pos += b
                continue
            if pos == 0 and self.drop_last:
                self._no_step(b, k)
            if left and not self.drop_last:
                controller.partial_step_of = (b, k)
                set_batch(left, 1)
                yield mine[pos:]
                self._end_partial(controller, set_batch)
            break
        self.epoch += 1

    @staticmethod
    def _end_partial(controller, set_batch) -> None:
        """After an epoch's partial step: the batch chosen is in force again."""
        if controller.partial_step_of is not None:
            sizes, controller.partial_step_of = controller.partial_step_of, None
            set_batch(*sizes)
