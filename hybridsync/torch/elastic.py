"""hvd.elastic for scripts written for Horovod's elastic mode: `@hvd.elastic.run`, TorchState
(commit / restore / sync of model, optimizer, sampler and plain attributes) and ElasticSampler.

hybridsync jobs have a fixed set of ranks (mpirun, or horovodrun without --min-np), so no host
ever joins or leaves: run() syncs the state from rank 0 and calls the function once; a failed
collective restores the last commit and is re-raised, since a fixed job cannot reset itself.
"""
from __future__ import annotations

import copy
import functools
import math
import random

import torch

from .. import runtime
from .basics import HorovodInternalError
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState", "ElasticSampler", "run"]


def run(func):
    """Decorator: `func(state, ...)` runs after `state.sync()` (every rank starts from rank 0's
    state); on HorovodInternalError the last committed state is restored and the error raised."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except HorovodInternalError:
            state.restore()
            raise
    return wrapper


class ElasticSampler(torch.utils.data.Sampler):
    """Like DistributedSampler (each rank takes every size-th index of one shuffled order,
    padded to divide evenly) and records progress, so a restored state resumes mid-epoch."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed_num = 0, 0
        self.reset()

    def set_epoch(self, epoch):
        """Call at the end of an epoch: the next one reshuffles and starts from its beginning."""
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch, self.processed_num = state_dict["epoch"], state_dict["processed_num"]
        self.reset()

    def reset(self):
        world = runtime.world()
        self.num_replicas, self.rank = world.size, world.rank
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices + self.remaining_indices[:self.total_size - len(self.remaining_indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples


class TorchState:
    """Training state that can be committed (kept in memory), restored and synced from rank 0.
    model, optimizer and any ElasticSampler are handled by their state_dict(); other keyword
    arguments become plain attributes."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self._reset_callbacks = []
        self._special = {k: v for k, v in dict(model=model, optimizer=optimizer, **kwargs).items()
                         if isinstance(v, (torch.nn.Module, torch.optim.Optimizer, ElasticSampler))}
        self._plain = [k for k in kwargs if k not in self._special]
        for key, value in dict(model=model, optimizer=optimizer, **kwargs).items():
            object.__setattr__(self, key, value)
        self._saved = None
        self.save()

    def __setattr__(self, name, value):
        special = self.__dict__.get("_special")
        if special is not None and name in special:  # a new model/optimizer/sampler object
            special[name] = value
        object.__setattr__(self, name, value)

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Keeps the current state (what restore() returns to); call it every few batches."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """No host ever changes in a fixed job: nothing to do."""

    def save(self):
        self._saved = ({k: copy.deepcopy(v.state_dict()) for k, v in self._special.items()},
                       {k: copy.deepcopy(getattr(self, k)) for k in self._plain})

    def restore(self):
        special, plain = self._saved
        for key, state in special.items():
            self._special[key].load_state_dict(copy.deepcopy(state))
        for key, value in plain.items():
            object.__setattr__(self, key, copy.deepcopy(value))

    def sync(self):
        """Every rank takes rank 0's state."""
        for key, value in self._special.items():
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=0)
            elif isinstance(value, torch.optim.Optimizer):
                broadcast_optimizer_state(value, root_rank=0)
            else:
                value.load_state_dict(broadcast_object(value.state_dict(), 0, name=f"elastic.{key}"))
        plain = broadcast_object({k: getattr(self, k) for k in self._plain}, 0, name="elastic.attributes")
        for key, value in plain.items():
            object.__setattr__(self, key, value)
        self.save()
