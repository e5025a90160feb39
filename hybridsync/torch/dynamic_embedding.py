"""hybridsync.torch.DynamicEmbedding: an embedding over raw int64 ids whose rows live in a
dynamic table on the parameter server (see docs/dynamic-tables.md). Trained like the other PS
embeddings: its backward stages per-id gradient rows, the DistributedOptimizer pushes them and
the shards apply the server rule (SGD, Adagrad, Adam)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..ps import dynamic_options as dyn
from .. import timeline
from ..ps.dynamic import STATE_KEYS, DynamicSnapshot, DynamicTable
from ..ps.storage import has_disk_tier
from ..ps.table import shared_seed
from .embedding import _grad_rows, _PSTableModule, _server_events, _unnamed
from .table_tensor import ShardedTableTensor

MODES = (None, "sum", "mean")


class _DynamicLookup(torch.autograd.Function):
    """Rows of every id in input order; backward hands the per-position gradient rows to the
    owning optimizer. `error` (this rank's bad input) raises on every rank inside the pull."""

    @staticmethod
    def forward(ctx, anchor, module, flat, shape, device, error):
        with timeline.span(f"pull {module.table_name}", "ps"):
            _, rows = module.table.lookup(flat, error)
        _server_events()
        ctx.module, ctx.ids = module, flat
        out = torch.from_numpy(rows).view(*shape, module.embedding_dim)
        return out if device.type == "cpu" else out.to(device)

    @staticmethod
    def backward(ctx, grad):
        _grad_rows(ctx.module, ctx.ids, grad)
        return None, None, None, None, None, None


class DynamicEmbedding(_PSTableModule):
    """Embedding of any int64 id (uint64 hashes too); rows are created on a shard the first time
    an id's gradient arrives (after admit_after touches), start from `initializer` seeded by
    (table seed, id), and are evicted (evict='lru' | 'lfu') when a shard holds its share of
    `capacity`, or expire after ttl_steps steps without a touch.

    mode None: out[..., :] = row of ids[...]; 'sum' / 'mean': bags as nn.EmbeddingBag does (2-D
    ids, one bag per row, or 1-D ids with offsets). storage: how the shards store the rows, e.g.
    {'dtype': 'bfloat16'} (docs/storage.md).
    """

    def __init__(self, embedding_dim, *, capacity=None, admit_after=1, evict=None, ttl_steps=None,
                 initializer=("normal", 0.0, 1.0), mode=None, name=None, partitions=None, seed=None, storage=None):
        super().__init__()
        name = name or f"dynamic_embedding_{next(_unnamed)}"
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"dynamic table '{name}': embedding_dim must be an integer >= 1, got {embedding_dim!r}")
        if mode not in MODES:
            raise ValueError(f"dynamic table '{name}': mode must be None, 'sum' or 'mean', got {mode!r}")
        self.embedding_dim, self.mode = embedding_dim, mode
        self.padding_idx, self.scale_grad_by_freq = None, False
        self.num_embeddings = capacity or 0  # (plans show it: the table's bound, 0 = unbounded)
        self._check_args = (capacity, admit_after, evict, ttl_steps, initializer)
        disk_tier = has_disk_tier(storage)
        dyn.options(name, *self._check_args, disk_tier=disk_tier)  # bad arguments raise here, before any collective
        seed = shared_seed(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)
        self.seed = seed
        self.table = DynamicTable(name, embedding_dim, dyn.options(name, *self._check_args, seed=seed, disk_tier=disk_tier),
                                  partitions or 0, storage=storage)
        self._sink = None
        self._warned_no_sink = False
        self._anchor = torch.empty(0, requires_grad=True)
        self._batcher = None

    def reconfigure(self, storage=None, **changes) -> None:
        """Collective: new dynamic options (a config rule's `dynamic:`) and storage (its
        `storage:`; None: the table's own); the table is made anew, empty, so call it before
        training."""
        capacity, admit_after, evict, ttl_steps, initializer = self._check_args
        merged = {"capacity": capacity, "admit_after": admit_after, "evict": evict, "ttl_steps": ttl_steps, **changes}
        storage = self.table.storage if storage is None else storage
        options = dyn.options(self.table.name, merged["capacity"], merged["admit_after"], merged["evict"],
                              merged["ttl_steps"], initializer, seed=self.seed, disk_tier=has_disk_tier(storage))
        shards, _ = self.table.layout
        name = self.table.name
        self.table.drop()
        self.table = DynamicTable(name, self.embedding_dim, options, shards, storage=storage)
        self._check_args = (merged["capacity"], merged["admit_after"], merged["evict"], merged["ttl_steps"],
                            initializer)
        self.num_embeddings = merged["capacity"] or 0

    def _ids(self, input):
        """(flat int64 ids on the host, error text for every rank to raise)."""
        if not isinstance(input, torch.Tensor):
            return np.zeros(0, np.int64), f"dynamic table '{self.table_name}': ids must be a tensor, got {type(input).__name__}"
        host = input.detach()
        host = host if host.device.type == "cpu" else host.cpu()
        if host.dtype.is_floating_point or host.dtype.is_complex or host.dtype == torch.bool:
            return np.zeros(0, np.int64), (f"dynamic table '{self.table_name}': ids must be integers "
                                           f"(int64, or uint64 hashes), got {host.dtype}")
        return np.ascontiguousarray(host.numpy().reshape(-1)).astype(np.int64, copy=False), ""

    def forward(self, input, offsets=None, per_sample_weights=None):
        flat, error = self._ids(input)
        if self.mode is None:
            if not error and offsets is not None:
                error = f"dynamic table '{self.table_name}': offsets apply to mode 'sum' / 'mean' only"
            shape = tuple(input.shape) if not error else (0,)
            device = input.device if isinstance(input, torch.Tensor) else torch.device("cpu")
            return _DynamicLookup.apply(self._anchor, self, flat, shape, device, error)
        if not error:
            error = self._bag_error(input, offsets)
        unique = np.unique(flat) if not error else flat
        with timeline.span(f"pull {self.table_name}", "ps"):
            _, rows = self.table.lookup(unique, error)  # rows of the sorted unique ids
        return self._bags(input, offsets, per_sample_weights, flat, unique, rows)

    def _bag_error(self, input, offsets) -> str:
        if input.dim() == 2 and offsets is None:
            return ""
        if input.dim() == 1 and offsets is not None and offsets.dim() == 1:
            return ""
        return (f"dynamic table '{self.table_name}': mode {self.mode!r} takes 2-D ids (one bag per row) or 1-D ids "
                f"with 1-D offsets, got ids of shape {tuple(input.shape)}"
                + ("" if offsets is None else f" and offsets of shape {tuple(offsets.shape)}"))

    def _bags(self, input, offsets, per_sample_weights, flat, unique, rows):
        """nn.EmbeddingBag over the batch's unique rows (a small local weight whose gradient
        becomes the rows' gradients)."""
        weight = torch.from_numpy(rows)
        index = torch.from_numpy(np.searchsorted(unique, flat)).view(input.shape).to(input.device)
        weight = weight.to(input.device)
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_hook(lambda grad, unique=unique: self._on_grad(unique, grad.cpu()))
        return F.embedding_bag(index, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    @property
    def shape(self):
        return (self.num_embeddings, self.embedding_dim)

    def stats(self) -> dict:
        """This rank's shard's counters (see DynamicTable.stats)."""
        return self.table.stats()

    def export(self, path) -> int:
        """Collective: every stored (id, row) pair into one file, each rank writing its own shard
        (hybridsync.ps.dynamic.read_export reads it back)."""
        return self.table.export(path)

    # -- state: '<prefix>ids', 'rows', 'counts', 'last_touch', 'pending_ids', 'pending_counts',
    # 'pending_last', 'step' as tensors that read the shards when used (the optimizer's state_dict
    # carries the server optimizer's slots the same way) ---------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        snapshot = DynamicSnapshot(self.table, rows=True)  # (one small one-sided request per shard)
        for key in STATE_KEYS:
            destination[prefix + key] = ShardedTableTensor(snapshot.view(key))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        given = {key: state_dict[prefix + key] for key in STATE_KEYS if prefix + key in state_dict}
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in STATE_KEYS)
        if not given:  # (an elastic commit of the dense state leaves the shards' state out)
            if strict:
                missing_keys.extend(prefix + key for key in STATE_KEYS)
            return
        if all(isinstance(v, ShardedTableTensor) and v.view.is_view_of(self.table) for v in given.values()):
            return  # this table's own state
        absent = [prefix + key for key in STATE_KEYS if key not in given]
        if absent:
            error_msgs.append(f"dynamic table '{self.table_name}': the state has no {', '.join(absent)}")
            return
        arrays = {key: value.detach().cpu().numpy() for key, value in given.items()}
        n, rows = len(arrays["ids"]), arrays["rows"]
        if rows.ndim != 2 or rows.shape != (n, self.embedding_dim):
            error_msgs.append(f"size mismatch for {prefix}rows: copying rows of shape {tuple(rows.shape)} for {n} ids, "
                              f"the dynamic table's rows are {self.embedding_dim} wide")
            return
        # One-sided: this rank empties every shard and writes each its entries, in chunks; a
        # state only rank 0 holds loads without any other rank taking part (at any world size).
        self.table.write_state(arrays, int(arrays["step"]))

    def weight_numpy(self):
        self.table.read()  # raises: no whole table

    def extra_repr(self):
        capacity, admit_after, evict, ttl_steps, _ = self._check_args
        return (f"{self.embedding_dim}, table='{self.table_name}', capacity={capacity}, admit_after={admit_after}, "
                f"evict={evict!r}, ttl_steps={ttl_steps}, mode={self.mode!r}")
