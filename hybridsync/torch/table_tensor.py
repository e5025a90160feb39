"""A parameter-server table in a PyTorch state dict, without the table.

`model.state_dict()` and `optimizer.state_dict()` hold a ShardedTableTensor for every table (and
server-optimizer slot) on the parameter server: a tensor with the table's shape and dtype that
holds no rows. The rows are read from the shards -- by this rank alone, in chunks, while the
shards' owners go on training -- the first time anything needs them: `torch.save`, `.numpy()`,
arithmetic, `copy.deepcopy`. So Horovod's idiom

    if hvd.rank() == 0:
        torch.save(model.state_dict(), path)

works on rank 0 alone, rank 0 holds the table once while saving, and the other ranks hold
nothing. `torch.load` gives plain tensors back. A DynamicEmbedding's state (ids, rows, counters,
pending ids, step) is several of them over one DynamicSnapshot, read once (int64 ones too).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from ..ps.table import TableView


class ShardedTableTensor(torch.Tensor):
    """A table (or one of its server-optimizer slots, or an array of a dynamic table's state) on
    the parameter server, read on first use."""

    _hybridsync_ps_table = True  # broadcast_parameters skips it: the shards are the truth

    @staticmethod
    def __new__(cls, view: TableView):
        return torch.Tensor._make_wrapper_subclass(cls, view.shape, dtype=getattr(torch, view.dtype), device="cpu",
                                                   requires_grad=False)

    def __init__(self, view: TableView):
        self.view = view
        self._rows = None

    def materialize(self) -> torch.Tensor:
        """The rows, read from the shards once (one-sided: only this rank takes part)."""
        if self._rows is None:
            self._rows = torch.from_numpy(self.view.read())
        return self._rows

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(x):
            return x.materialize() if isinstance(x, ShardedTableTensor) else x

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))

    # What torch.save, copy and NumPy reach without dispatching an operator.
    def __reduce_ex__(self, protocol):
        return self.materialize().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.materialize().clone()

    def numpy(self, *, force: bool = False):
        return self.materialize().numpy()

    def tolist(self):
        return self.materialize().tolist()

    def untyped_storage(self):
        return self.materialize().untyped_storage()

    def storage(self):
        return self.materialize().storage()

    def data_ptr(self):
        return self.materialize().data_ptr()

    def __repr__(self, *, tensor_contents=None):
        return f"ShardedTableTensor({self.view}, shape={tuple(self.shape)})"
