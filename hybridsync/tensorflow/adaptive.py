"""Keras counterpart of hybridsync.torch.AdaptiveDataLoader: batches of NumPy arrays at the
batch size the adaptive optimizer chose (hybridsync.adaptive.batches does the work), for a custom
loop or model.fit (a Python generator; give steps_per_epoch)."""
from __future__ import annotations

import weakref

from .. import comm, runtime
from ..adaptive.batches import AdaptiveBatches

_every: list = []  # weakrefs to every adaptive Keras DistributedOptimizer, oldest first (the same on every rank)


def track(optimizer) -> None:
    """Called by a DistributedOptimizer(..., adaptive=...) when it is made (after_join finds it)."""
    _every[:] = [ref for ref in _every if ref() is not None] + [weakref.ref(optimizer)]


def load_state(optimizer, state: dict) -> None:
    """The adaptive controller's state (a checkpoint's, or the last joined rank's); the next step
    is timed afresh."""
    optimizer._hs_adaptive.load_state_dict(state)
    sync = getattr(optimizer, "_hs_sync", None)
    if sync is not None and sync.ctx.stats is not None:
        sync.ctx.stats.reset_clock()


def after_join(last: int) -> None:
    """Collective, when hvd.join() returns on every rank: the ranks that joined early skipped the
    others' last steps, so their adaptive state (step count, statistics, batch) lags; every rank
    takes that of the rank that joined last, as hybridsync.torch's join does. (Left as it was,
    the datasets re-chose the batch at different steps on different ranks.)"""
    optimizers = [o for o in (ref() for ref in _every) if o is not None]
    if not optimizers or runtime.world().size == 1:
        return
    rank = runtime.world().rank
    states = comm.objects().broadcast_object([o._hs_adaptive.state_dict() for o in optimizers] if rank == last
                                             else None, last, name="hybridsync.tensorflow.adaptive.join")
    for optimizer, state in zip(optimizers, states):
        if rank != last:
            load_state(optimizer, state)


class AdaptiveDataset:
    """arrays: a NumPy array or a tuple of them (same first dimension), e.g. (x, y).
    batch_size: the global batch the learning rate was written for. optimizer: a
    hybridsync.tensorflow.DistributedOptimizer(..., adaptive=...). drop_last: as
    hybridsync.torch.AdaptiveDataLoader's (False: an epoch's remainder is one more, smaller step;
    True: dropped, and an epoch with no step at all raises ValueError naming both sizes)."""

    def __init__(self, arrays, batch_size: int, optimizer, shuffle: bool = True, seed: int = 0,
                 interval: int = 20, warmup: int = 10, drop_last: bool = False):
        self.arrays = arrays if isinstance(arrays, tuple) else (arrays,)
        n = len(self.arrays[0])
        for i, a in enumerate(self.arrays):
            if len(a) != n:
                raise ValueError(f"arrays[{i}] has {len(a)} samples, arrays[0] has {n}")
        if getattr(optimizer, "adaptive", None) is None:
            raise ValueError("AdaptiveDataset needs hybridsync.tensorflow.DistributedOptimizer(..., adaptive=True)")
        self.optimizer = optimizer
        world = runtime.world()
        self.batches = AdaptiveBatches(n, batch_size, world.rank, world.size, shuffle, seed, interval, warmup,
                                       drop_last)

    def autoscale_batch_size(self, max_batch_size: int, local_bsz_bounds=None, gradient_accumulation: bool = False,
                             max_accumulation: int = 8):
        """As AdaptiveDataLoader's. With gradient_accumulation a step may be several batches
        (micro-steps): the optimizer's apply() exchanges and applies only at a step's last one."""
        self.batches.set_autoscale(max_batch_size, local_bsz_bounds, max_accumulation if gradient_accumulation else 1)

    @property
    def changes(self) -> list:
        return self.batches.changes

    # The batch in force, as hybridsync.torch.AdaptiveDataLoader's properties name it.
    @property
    def current_local_bsz(self) -> int:
        return self.optimizer.adaptive.local_batch

    @property
    def accumulation_steps(self) -> int:
        return self.optimizer.adaptive.accumulation

    @property
    def current_batch_size(self) -> int:
        return self.optimizer.adaptive.global_batch()

    def _set_batch(self, local_batch: int, accumulation: int = 1) -> None:
        self.optimizer.adaptive.set_batch(local_batch, accumulation)

    def __iter__(self):
        controller = self.optimizer.adaptive
        self.batches.start(controller, self._set_batch)
        # (the optimizer plans its exchange at its first apply, before any re-choice)
        allreduce_sum = lambda array, name: self.optimizer._hs_sync.ctx.allreduce_sum(array, name)
        batches = self.batches.epoch_batches(controller, self._set_batch, allreduce_sum)
        while True:
            self.optimizer._hs_step_started()  # runs when the loop asks for the next batch (no-op mid-step)
            idx = next(batches, None)
            if idx is None:
                return
            batch = tuple(a[idx] for a in self.arrays)
            yield batch if len(batch) > 1 else batch[0]

    def repeat(self):
        """Epoch after epoch, endlessly (model.fit(..., steps_per_epoch=...))."""
        while True:
            yield from iter(self)
