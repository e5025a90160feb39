"""hvd.elastic for scripts written for Horovod's elastic mode: `@hvd.elastic.run`, TorchState
(commit / restore / sync of model, optimizer, sampler and plain attributes) and ElasticSampler.

The state machinery is hybridsync.elastic's (framework-neutral); this module adds the handlers
of torch's objects. Tables on the parameter server are committed per shard, by each rank
locally (hybridsync.elastic.TableShardsHandler): a model's state dict is copied without them.
"""
from __future__ import annotations

import copy
import math
import random

import torch

from ... import runtime
from ...elastic import FrameworkState, StateHandler, run
from .functions import _is_ps_backed, broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState", "ElasticSampler", "run"]


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


class ModelStateHandler(StateHandler):
    """A torch module: its state dict copied, less the tables on the parameter server."""

    def save(self) -> None:
        self._saved = {k: copy.deepcopy(v) for k, v in self.value.state_dict().items() if not _is_ps_backed(v)}

    def restore(self) -> None:
        result = self.value.load_state_dict(copy.deepcopy(self._saved), strict=False)
        now = self.value.state_dict()
        missing = [k for k in result.missing_keys if not _is_ps_backed(now[k])]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"elastic state: model '{self.name}' no longer matches its commit "
                               f"(missing {missing}, unexpected {result.unexpected_keys})")

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)  # tables on the PS are skipped


class OptimizerStateHandler(StateHandler):
    """A torch optimizer: its state dict copied, less the server-side state of PS tables."""

    def save(self) -> None:
        state = self.value.state_dict()
        state.pop("hybridsync", None)  # server optimizer slots: TableShardsHandler keeps them per shard
        self._saved = copy.deepcopy(state)

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """An ElasticSampler: its position in the epoch."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0, name=f"elastic.{self.name}"))


class TorchState(FrameworkState):
    """Horovod's TorchState: model, optimizer, ElasticSampler and plain attributes, committed
    (kept in memory), restored and synced from rank 0. The rows and server-optimizer state of
    the tables that the model and optimizer put on the parameter server are committed per shard:
    a commit costs each rank a copy of its own shard."""

    HANDLERS = ((torch.nn.Module, ModelStateHandler), (torch.optim.Optimizer, OptimizerStateHandler),
                (ElasticSampler, SamplerStateHandler))

    def parts(self, value) -> list:
        return list(value.modules()) if isinstance(value, torch.nn.Module) else [value]
