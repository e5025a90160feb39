"""The batches an adaptive loader hands out, whatever the framework: each rank's share of a
permutation every rank draws the same, cut at the batch size in force, and the periodic
re-choice of that size (the lowest stepping rank's choice, agreed by an exchange a joined rank
takes part in, so every rank that steps switches at the same step)."""
from __future__ import annotations

import numpy as np

from .exchange import agree_on_decision
from .goodput import allowed, nearest_allowed


class AdaptiveBatches:
    def __init__(self, num_samples: int, batch_size: int, rank: int, world: int, shuffle: bool = True,
                 seed: int = 0, interval: int = 20, warmup: int = 10):
        if batch_size < world:
            raise ValueError(f"batch_size={batch_size} is smaller than the number of ranks ({world})")
        if num_samples < world:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than the {world} ranks")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, int(seed)
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
        hvd.join() stands in): the lowest such rank's choice (or none) everywhere.
        allreduce_sum(array, name): the optimizer's dense backend's sum all-reduce."""
        if self.autoscale is None or controller.steps < self.warmup or controller.steps % self.interval:
            return
        change = controller.choose(*self.autoscale)
        if self.world > 1:
            change, controller.choice = agree_on_decision(allreduce_sum, self.rank, self.world, change,
                                                          controller.choice)
        if change is not None and (change.local_batch, change.accumulation) != controller.sizes():
            set_batch(change.local_batch, change.accumulation)
            self.changes.append((controller.steps, change.local_batch, change.accumulation))

    def my_indices(self) -> np.ndarray:
        """This rank's samples of this epoch, in order (every rank the same count)."""
        order = (np.random.default_rng(self.seed + self.epoch).permutation(self.num_samples) if self.shuffle
                 else np.arange(self.num_samples))
        usable = (self.num_samples // self.world) * self.world
        return order[self.rank:usable:self.world]

    def epoch_batches(self, controller, set_batch, allreduce_sum):
        """Index arrays of one epoch's micro-batches; the size may change between steps."""
        mine, pos = self.my_indices(), 0
        while True:
            self.rechoose(controller, set_batch, allreduce_sum)
            b, k = controller.sizes()
            if pos + b * k > len(mine):
                break
            for _ in range(k):
                yield mine[pos:pos + b]
                pos += b
        self.epoch += 1
