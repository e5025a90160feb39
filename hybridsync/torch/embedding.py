"""Embedding modules whose rows live on the parameter server (sharded placement).

forward() pulls the batch's unique rows from their shards into a small local weight and
looks up into it; backward turns that weight's gradient into per-row gradients, which the
DistributedOptimizer pushes to the shards at step(). The whole table never exists on one rank
(except when state_dict() gathers it on request).

Every rank must call forward on a PS-backed module the same number of times per step, since
a pull is collective.
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from .. import runtime, timeline
from ..ps.table import PSTable, TableView, pull, shared_seed
from .table_tensor import ShardedTableTensor

_unnamed = itertools.count()


class _Lookup(torch.autograd.Function):
    """Embedding forward in one C++ call (rows written in input order); backward hands the
    per-position gradient rows to the owning optimizer, whose push sums duplicate ids in C++.
    `anchor` is a tensor that requires grad, so autograd calls backward at all."""

    @staticmethod
    def forward(ctx, anchor, module, ids):
        host = ids if ids.device.type == "cpu" else ids.cpu()
        flat = host.contiguous().numpy()
        with timeline.span(f"pull {module.table_name}", "ps"):
            unique, rows = module.table.lookup(flat)
        _server_events()
        ctx.module, ctx.ids = module, flat.reshape(-1)
        out = torch.from_numpy(rows)
        return out if ids.device.type == "cpu" else out.to(ids.device)

    @staticmethod
    def backward(ctx, grad):
        _grad_rows(ctx.module, ctx.ids, grad)
        return None, None, None


class _Prefetched(torch.autograd.Function):
    """The outputs of every PS Embedding whose rows the model's batched pull brought (rows in
    input order, NumPy arrays the engine wrote): one autograd node for all of them, so a step
    runs one Python forward and one backward here instead of one per table. An output no loss
    reached gets no gradient (not even zeros: a zero push would still move stateful rules)."""

    @staticmethod
    def forward(ctx, anchor, modules, ids, devices, *rows):
        ctx.set_materialize_grads(False)
        ctx.modules, ctx.ids = modules, ids
        out = [torch.from_numpy(r) for r in rows]
        return tuple(o if d.type == "cpu" else o.to(d) for o, d in zip(out, devices))

    @staticmethod
    def backward(ctx, *grads):
        for module, ids, grad in zip(ctx.modules, ctx.ids, grads):
            if grad is not None:
                _grad_rows(module, ids, grad)
        return (None,) * (4 + len(grads))


def _grad_rows(module, ids, grad) -> None:
    """Backward of an Embedding's lookup: per-position gradient rows of the flat `ids`."""
    rows = grad.detach().reshape(-1, module.embedding_dim)
    if module.padding_idx is not None or module.scale_grad_by_freq:
        rows = rows.clone()
        if module.padding_idx is not None:
            rows[torch.from_numpy(ids == module.padding_idx)] = 0
        if module.scale_grad_by_freq:
            _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
            rows /= torch.from_numpy(counts[inverse].astype(np.float32)).to(rows.device)[:, None]
    module._on_grad(ids, rows)


def _weights_of(module):
    """The rows a PS copy of `module` starts from: its weights, or none for a module built on the
    `meta` device (TorchRec's convention), whose table is created on the shards directly --
    seeded N(0, 1) as nn.Embedding initialises -- so no rank ever holds it whole."""
    return None if module.weight.is_meta else module.weight


def _rows_to_load(weight, give_up: bool):
    """(rank 0's rows of `weight` as a float32 C-contiguous array, whether loading may consume
    them): a copy made here always may; the weight's own memory only when the caller gives the
    weight up (a wrapped model's table, emptied right after) and nothing else shares it."""
    own = give_up and _sole_owner(weight)
    rows = weight.detach().to("cpu", torch.float32).contiguous()
    copied = rows.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    return rows.numpy(), copied or own


def _sole_owner(weight) -> bool:
    """Whether `weight` is the only tensor on its memory (no view, state_dict or .data kept)."""
    try:  # 2: weight's own reference, and the temporary storage object asked
        storage = weight.untyped_storage()
        return (torch._C._storage_Use_Count(storage._cdata) == 2 and weight.storage_offset() == 0
                and storage.nbytes() == weight.numel() * weight.element_size())
    except (AttributeError, RuntimeError):
        return False


def _check_shardable(module, name: str) -> None:
    if module.max_norm is not None:
        raise ValueError(f"embedding '{name}': max_norm renormalises rows in place during forward, which "
                         "a sharded table cannot do; use the replicated placement for it")


def _server_events() -> None:
    tl = timeline.get()
    if tl is not None:
        tl.engine_events()


class _PSTableModule(torch.nn.Module):
    """What PS-backed Embedding and EmbeddingBag share: the table handle, pulls, state."""

    def _setup(self, num_embeddings, embedding_dim, padding_idx, name, partitions, partition,
               initial_weight, seed, initializer, table=None, give_up_weight=False, storage=None):
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"PS embedding needs num_embeddings >= 1 and embedding_dim >= 1, got "
                             f"({num_embeddings}, {embedding_dim})")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} is out of range for {num_embeddings} embeddings")
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        if table is not None:  # another module's table, rows and all: modules that shared one weight (tied)
            if (table.num_rows, table.dim) != (num_embeddings, embedding_dim):
                raise ValueError(f"PS embedding of shape ({num_embeddings}, {embedding_dim}) cannot share table "
                                 f"'{table.name}' of shape ({table.num_rows}, {table.dim})")
            self.table = table
        else:
            # The rule is a placeholder until a DistributedOptimizer sets the real one.
            self.table = PSTable(name or f"ps_embedding_{next(_unnamed)}", num_embeddings, embedding_dim,
                                 partitions or 0, partition, storage=storage)
            self._fill(initial_weight, seed, initializer, give_up_weight)
        self._sink = None  # set by the DistributedOptimizer that owns the table
        self._warned_no_sink = False
        self._anchor = torch.empty(0, requires_grad=True)  # lets autograd reach _Lookup.backward
        self._batcher = None  # set when the owning optimizer batches this model's lookups

    def _fill(self, initial_weight, seed, initializer, give_up_weight=False) -> None:
        """The new table's first rows. give_up_weight: the caller drops initial_weight right
        after (wrapping a model), so rank 0 may hand its memory back while the rows move."""
        if initial_weight is not None:
            # Rank 0's weights become the shards' rows (pretrained / custom-initialised tables).
            values, consume = None, False
            if runtime.world().rank == 0:
                values, consume = _rows_to_load(initial_weight, give_up_weight)
            self.table.load_from_root(values, 0, consume=consume)
        else:
            # A seed from rank 0's torch RNG: reproducible under torch.manual_seed.
            seed = shared_seed(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)
            self.table.initialize(initializer, seed)
            if self.padding_idx is not None:
                self.table.write_rows(np.array([self.padding_idx]), np.zeros((1, self.embedding_dim), np.float32))

    @property
    def table_name(self) -> str:
        return self.table.name

    def __getattr__(self, name):
        if name == "weight":  # code that reads the table itself, e.g. F.embedding(ids, emb.weight)
            table = self.__dict__.get("table")
            raise AttributeError(
                f"PS embedding '{table.name if table is not None else '?'}' has no local weight: its rows live "
                "on the parameter server's shards. Read rows by calling the module (module(ids)); for code "
                "that needs the weight tensor, keep this table replicated (DistributedOptimizer without "
                "model=, or a config rule with placement: replicated)")
        return super().__getattr__(name)

    @property
    def shape(self):
        return (self.num_embeddings, self.embedding_dim)

    def _lookup(self, input):
        """(compact weight of the batch's unique rows, input mapped into it, compact padding idx)."""
        ids = input.detach()
        prefetched = self._batcher.take(self, input) if self._batcher is not None else None
        if prefetched is not None:
            unique, inverse, rows = prefetched
        else:
            host = ids if ids.device.type == "cpu" else ids.cpu()
            with timeline.span(f"pull {self.table_name}", "ps"):
                (unique, inverse, rows), = pull([self.table], [host.contiguous().numpy()])
            _server_events()
        weight = torch.from_numpy(rows)
        index = torch.from_numpy(inverse).view(ids.shape)
        if ids.device.type != "cpu":
            weight, index = weight.to(ids.device), index.to(ids.device)
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_hook(lambda grad, unique=unique: self._on_grad(unique, grad))
        padding = None
        if self.padding_idx is not None:
            where = np.flatnonzero(unique == self.padding_idx)
            padding = int(where[0]) if len(where) else None
        return weight, index, padding

    def _on_grad(self, ids, grad):
        """Gradient rows for `ids` (duplicates allowed) reached this table in backward."""
        if self._sink is not None:
            self._sink.stage(ids, grad)
        elif not self._warned_no_sink:
            self._warned_no_sink = True
            warnings.warn(f"PS embedding '{self.table_name}' received gradients, but no DistributedOptimizer "
                          "owns it (pass model=... to hybridsync.DistributedOptimizer): they are dropped")

    # -- state: the table under '<prefix>weight', as a tensor that reads its rows when used -------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = ShardedTableTensor(TableView(self.table))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        if tuple(value.shape) != self.shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                              f"the PS table has shape {self.shape}")
            return
        if isinstance(value, ShardedTableTensor) and value.view.is_view_of(self.table):
            return  # this table's own rows
        # One-sided: this rank writes every shard, in chunks, so a state only rank 0 holds loads
        # without any other rank holding the table.
        self.table.write(value.detach().to("cpu", torch.float32).contiguous().numpy())

    def weight_numpy(self) -> np.ndarray:
        """The whole table, read from the shards by this rank alone."""
        return self.table.read()

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}, table='{self.table_name}'"
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")


class Embedding(_PSTableModule):
    """nn.Embedding with its rows on the parameter server. Rows start from `initializer`
    (('normal', mean, std), default N(0, 1) like nn.Embedding, or ('uniform', low, high)) with
    a seed that rank 0's torch RNG draws: reproducible, and independent of the number of shards.

    partitions: shards holding the table (default: every rank); partition: 'cyclic' | 'block'.
    storage: how the shards store the rows, e.g. {'dtype': 'float16'} (docs/storage.md).
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, scale_grad_by_freq=False, *,
                 name=None, partitions=None, partition="cyclic", seed=None, initializer=("normal", 0.0, 1.0),
                 storage=None, _initial_weight=None, _table=None, _give_up_weight=False):
        super().__init__()
        self.scale_grad_by_freq = scale_grad_by_freq
        self._setup(num_embeddings, embedding_dim, padding_idx, name, partitions, partition, _initial_weight, seed,
                    initializer, _table, _give_up_weight, storage)

    @classmethod
    def from_module(cls, module: torch.nn.Embedding, name: str, partitions=None, partition="cyclic", table=None,
                    give_up_weight=False, storage=None):
        """A PS-backed copy of `module` whose shards start from rank 0's weights; or, given
        `table` (that of another module sharing module's weight), one reading that table.
        give_up_weight: the caller empties module.weight right after, so rank 0 may return its
        memory while the rows move (it is then unreadable: zeros)."""
        _check_shardable(module, name)
        return cls(module.num_embeddings, module.embedding_dim, module.padding_idx, module.scale_grad_by_freq,
                   name=name, partitions=partitions, partition=partition, storage=storage,
                   _initial_weight=None if table is not None else _weights_of(module), _table=table,
                   _give_up_weight=give_up_weight)

    def forward(self, input):
        if self._batcher is not None:  # this forward's rows may have come with every other table's
            out = self._batcher.take(self, input)
            if out is not None:
                return out
        return _Lookup.apply(self._anchor, self, input)


class EmbeddingBag(_PSTableModule):
    """nn.EmbeddingBag with its rows on the parameter server (see Embedding)."""

    def __init__(self, num_embeddings, embedding_dim, mode="mean", scale_grad_by_freq=False,
                 include_last_offset=False, padding_idx=None, *, name=None, partitions=None,
                 partition="cyclic", seed=None, initializer=("normal", 0.0, 1.0), storage=None,
                 _initial_weight=None, _table=None, _give_up_weight=False):
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        self.mode, self.scale_grad_by_freq, self.include_last_offset = mode, scale_grad_by_freq, include_last_offset
        self._setup(num_embeddings, embedding_dim, padding_idx, name, partitions, partition, _initial_weight, seed,
                    initializer, _table, _give_up_weight, storage)

    @classmethod
    def from_module(cls, module: torch.nn.EmbeddingBag, name: str, partitions=None, partition="cyclic", table=None,
                    give_up_weight=False, storage=None):
        _check_shardable(module, name)
        return cls(module.num_embeddings, module.embedding_dim, module.mode, module.scale_grad_by_freq,
                   module.include_last_offset, module.padding_idx, name=name, partitions=partitions,
                   partition=partition, storage=storage, _initial_weight=None if table is not None else _weights_of(module),
                   _table=table, _give_up_weight=give_up_weight)

    def forward(self, input, offsets=None, per_sample_weights=None):
        weight, index, padding = self._lookup(input)
        return F.embedding_bag(index, weight, offsets, None, 2.0, self.scale_grad_by_freq, self.mode, False,
                               per_sample_weights, self.include_last_offset, padding)


PS_MODULES = (Embedding, EmbeddingBag)
