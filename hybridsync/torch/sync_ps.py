"""Route.PS: sparse gradients go to the C++ parameter server, which sums them over ranks and
applies the optimizer once per row on the shard that owns it.

ShardedPS   rows live only on the shards: the model's sparse embeddings are swapped for
            PS-backed modules, whose backward stages (unique ids, row gradients) here; step()
            pushes everything in one message per shard (applied before the next pull).
ReplicatedPS every rank keeps its replica (Horovod-style, no model needed); each shard aliases
            its rows inside the local replica, and step() pushes the sparse gradient and writes
            back every row any shard changed, so all replicas stay identical.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import ps, timeline
from ..settings import settings
from ..types import ReduceOp
from .batching import BatchedLookups
from .embedding import Embedding, EmbeddingBag
from .server_optimizer import group_of, server_rule
from .sync_base import Synchronizer, Variable


def _scale(settings) -> float:
    return 1.0 / settings.world_size if settings.op is ReduceOp.AVERAGE else 1.0


def _table_shape(p) -> tuple[int, int]:
    """A parameter as a table: rows = first dimension, dim = the rest flattened (1 for vectors)."""
    rows = p.shape[0]
    return rows, (p.numel() // rows if rows else 1)


def _rule_args(rule: dict) -> tuple[str, dict]:
    return rule["name"], {k: float(v) for k, v in rule.items() if k != "name"}


class _PSBase(Synchronizer):
    def __init__(self, settings, variables, model=None):
        super().__init__(settings, variables, model)
        self.engine = ps.engine()
        self.table_of: dict[Variable, int] = {}

    def _lr(self, var: Variable) -> float:
        """The learning rate this step: the param group's (LR schedules reach the server),
        unless the config fixed the server optimizer."""
        if var.plan.optimizer_source == "config":
            return float(var.plan.optimizer["lr"])
        return float(group_of(self.settings.wrapped, var.param)["lr"])

    def _ordered(self):
        return sorted(self.variables, key=lambda v: v.index)

    def state_dict(self) -> dict:
        """Server optimizer state of every table, gathered whole (collective)."""
        out = {}
        for var in self._ordered():
            table = self.table_of.get(var)
            if table is None:
                continue
            slots = {name: torch.from_numpy(self.engine.gather(table, k))
                     for k, name in enumerate(self.engine.slot_names(table))}
            step = self.settings.backend.broadcast_object(self.engine.step(table), 0)  # rank 0 holds shard 0
            out[var.name] = {"optimizer": self.engine.spec(table)["optimizer"], "step": int(step), "slots": slots}
        return out

    def load_state_dict(self, state: dict) -> None:
        for var in self._ordered():
            if var.name not in state or var not in self.table_of:
                continue
            table, saved = self.table_of[var], state[var.name]
            if saved["optimizer"] != self.engine.spec(table)["optimizer"]:
                raise ValueError(f"variable '{var.name}': checkpoint has server optimizer '{saved['optimizer']}', "
                                 f"this run uses '{self.engine.spec(table)['optimizer']}'")
            for k, name in enumerate(self.engine.slot_names(table)):
                value = saved["slots"][name]
                self.engine.load_local(table, k, value.detach().to("cpu", torch.float32).contiguous().numpy())
            self.engine.set_step(table, int(saved["step"]))


class ShardedPS(_PSBase):
    waits = False  # the push is applied at the next PS operation

    def __init__(self, settings, variables, model=None):
        super().__init__(settings, variables, model)
        self.module_of: dict[Variable, torch.nn.Module] = {}
        self._var_of_module: dict[int, Variable] = {}
        self._staged: dict[Variable, list] = {}

    def on_wrap(self) -> None:
        swaps = {}
        for var in self._ordered():
            if var.module is not None:  # a hybridsync.torch.Embedding the user built
                module = var.module
                self.engine.rename_table(module.table, var.name)
                module.table_name = var.name
            else:  # an nn.Embedding(sparse=True): replace it everywhere in the model
                module = self._swap(var, swaps)
            self.module_of[var] = module
            self._var_of_module[id(module)] = var
            self.table_of[var] = module.table
            self.engine.set_rule(module.table, *_rule_args(var.plan.optimizer))
            module._sink = self
        if self.model is not None and self.module_of and settings().batch_lookups and self.settings.world_size > 1:
            BatchedLookups(self.model, [self.module_of[v] for v in self._ordered()], self.engine)

    def _swap(self, var: Variable, swaps: dict):
        old = next(m for m in self.model.modules()
                   if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.weight is var.param)
        cls = Embedding if isinstance(old, torch.nn.Embedding) else EmbeddingBag
        new = cls.from_module(old, var.name, partitions=var.plan.shards or None, partition=var.plan.partition)
        for parent in self.model.modules():
            for key, child in list(parent._modules.items()):
                if child is old:
                    parent._modules[key] = new
        # Free this rank's full copy: from now on the rows live on the shards only.
        var.param.data = torch.empty(0, dtype=var.param.dtype)
        var.param.grad = None
        swaps[id(old)] = new
        return new

    def stage(self, module, ids, grad) -> None:
        """Gradient rows for `ids` (duplicates allowed; summed by the push, in C++)."""
        g = grad.detach()
        if g.device.type != "cpu":
            g = g.cpu()
        if g.dtype != torch.float32:
            g = g.float()
        self._staged.setdefault(self._var_of_module[id(module)], []).append((ids, g.contiguous().numpy()))

    def synchronize(self) -> None:
        tables, ids, grads, lrs = [], [], [], []
        for var in self._ordered():
            parts = self._staged.get(var)
            if not parts:
                continue
            tables.append(self.table_of[var])
            ids.append(parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts]))
            grads.append(parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts]))
            lrs.append(self._lr(var))
            module = self.module_of[var]
            row_bytes = 8 + 4 * module.embedding_dim
            # Unique rows pulled, and about as many pushed (the push sums duplicate ids).
            var.plan.bytes_per_step = 2 * module._pulled[0] * row_bytes
            module._pulled[0] = 0
        self._staged.clear()
        # Collective even when nothing was staged, so every rank runs the same operations.
        with timeline.span(f"push ({len(tables)} tables)", "ps"):
            self.engine.push(tables, ids, grads, _scale(self.settings), False, lrs)

    def in_flight(self) -> bool:
        return bool(self._staged)


def _aliasable(p: torch.Tensor) -> bool:
    """A shard can use the replica's memory as its rows only when it is plain CPU float32."""
    return p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()


class ReplicatedPS(_PSBase):
    def __init__(self, settings, variables, model=None):
        super().__init__(settings, variables, model)
        self._aliased: dict[Variable, torch.Tensor] = {}  # kept alive while a shard aliases it

    def _register(self) -> None:
        """Creates the tables (collective) the first time: after the first backward, when
        variables planned without their module have been recognised as sparse."""
        for var in self._ordered():
            if var in self.table_of:
                continue
            p = var.param
            # Every replica, and so every shard, starts from rank 0's weights.
            self.settings.backend.broadcast_(p.data, 0, name=f"hybridsync.replica.{var.name}")
            name, hparams = _rule_args(var.plan.optimizer)
            rows, dim = _table_shape(p)
            table = self.engine.add_table(var.name, rows, dim, var.plan.shards, var.plan.partition, name, hparams)
            self.table_of[var] = table
            self._attach(var)

    def _attach(self, var: Variable) -> None:
        """Lets the shard's rows alias the replica when it is plain CPU float32 memory;
        otherwise the shard owns a copy of its rows."""
        p, table = var.param, self.table_of[var]
        rows, dim = _table_shape(p)
        if _aliasable(p):
            self.engine.attach_replica(table, p.data.view(rows, dim).numpy())
            self._aliased[var] = p.data
        else:
            self.engine.attach_replica(table, None)
            self.engine.load_local(table, -1, p.detach().to("cpu", torch.float32).reshape(rows, dim).contiguous().numpy())
            self._aliased.pop(var, None)

    def _follow_replicas(self) -> None:
        """Re-attaches where a replica's memory moved (p.data = ..., model.to(...))."""
        for var in self._ordered():
            p, alias = var.param, self._aliased.get(var)
            if alias is not None:
                if alias.data_ptr() != p.data_ptr() or alias.shape != p.shape:
                    self._attach(var)
            elif _aliasable(p):  # was a copy (e.g. on a GPU), now plain CPU memory
                self._attach(var)

    def synchronize(self) -> None:
        self._register()
        self._follow_replicas()
        tables, ids, grads, lrs, order = [], [], [], [], []
        for var in self._ordered():
            p = var.param
            g = p.grad
            rows, dim = _table_shape(p)
            if g is None:
                i, v = np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
            elif g.is_sparse:
                g = g.coalesce() if g.device.type != "cpu" else g
                i = g._indices()[0].cpu().numpy()
                v = g._values().detach().to("cpu", torch.float32).reshape(-1, dim).contiguous().numpy()
            else:  # a dense gradient routed to the PS (row-sharded): every row
                i = np.arange(rows, dtype=np.int64)
                v = g.detach().to("cpu", torch.float32).reshape(rows, dim).contiguous().numpy()
            tables.append(self.table_of[var])
            ids.append(i)
            grads.append(v)
            lrs.append(self._lr(var))
            order.append(var)
        with timeline.span(f"push + replica update ({len(tables)} tables)", "ps"):
            updates = self.engine.push(tables, ids, grads, _scale(self.settings), True, lrs)
        tl = timeline.get()
        if tl is not None:
            tl.engine_events(self.engine)
        for var, i, (changed, rows) in zip(order, ids, updates):
            p = var.param
            dim = _table_shape(p)[1]
            with torch.no_grad():
                if len(changed):
                    target = p.view(p.shape[0], dim)
                    target.index_copy_(0, torch.from_numpy(changed).to(p.device),
                                       torch.from_numpy(rows).to(p.device, p.dtype))
            var.plan.bytes_per_step = (len(i) + len(changed)) * (8 + 4 * dim)
            p.grad = None  # applied server-side: the wrapped optimizer must not apply it again

    def state_dict(self) -> dict:
        self._follow_replicas()
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._register()
        for var in self._ordered():
            if var not in self._aliased:  # the shard owns a copy: refresh it from the replica
                self._attach(var)
        self._follow_replicas()
        super().load_state_dict(state)


def register(synchronizers: dict) -> None:
    from ..types import Placement, Route

    synchronizers[(Route.PS, Placement.SHARDED)] = ShardedPS
    synchronizers[(Route.PS, Placement.REPLICATED)] = ReplicatedPS
