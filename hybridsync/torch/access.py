"""Tensor <-> buffer conversion for the sync core: how a torch parameter, its .grad, and a
PS-backed module's gradient rows look to hybridsync.sync (GradAccess)."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..sync.compression import NONE
from .server_optimizer import group_of

_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def viewable(tensor: torch.Tensor) -> bool:
    """NumPy can see this tensor's memory as it is (cheapest checks first: every gradient, every step)."""
    return tensor.is_cpu and tensor.dtype is not torch.bfloat16 and tensor.is_contiguous()


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor, else a contiguous CPU copy (bfloat16 widened: NumPy has none)."""
    if viewable(tensor):
        return (tensor.detach() if tensor.requires_grad else tensor).numpy()
    t = tensor.detach().to("cpu", copy=True).contiguous()
    return (t.float() if t.dtype is torch.bfloat16 else t).numpy()


def as_tensor(buffer) -> torch.Tensor:
    return torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer


def sparse_update_checks(optimizer):
    """The scope of the wrapped optimizer's step: where a gradient it updates from is sparse
    (the all-gather route's rows, a sparse_as_dense gradient given back sparse), torch's own
    update builds sparse tensors from it (Adagrad's, SparseAdam's) with no check_invariants
    argument -- torch then warns that checks are implicitly off and memory errors may follow.
    They are built with the checks on (O(nnz) each: indices in range), so torch checks instead of
    warning; the process's setting is put back afterwards (as the value it had)."""
    if any(p.grad is not None and p.grad.is_sparse for group in optimizer.param_groups for p in group["params"]):
        return torch.sparse.check_sparse_tensor_invariants(enable=True)
    return contextlib.nullcontext()


def _takes_only_sparse(optimizer) -> bool:
    """Whether the wrapped optimizer rejects dense gradients (torch.optim.SparseAdam): a sparse
    gradient densified for the all-reduce must go back to it sparse. Every other torch optimizer
    takes the dense average (and Adam, say, would refuse a sparse one)."""
    return isinstance(optimizer, torch.optim.SparseAdam)


class ParamAccess:
    """A parameter the wrapped optimizer updates; its gradient is p.grad.

    tensor_buffers: the dense backend takes torch tensors (Horovod: CUDA ones too), so dense()
    hands out the gradient tensor itself; otherwise a NumPy view (CPU) or a staged copy.
    compressor: a user's Horovod-style compressor (compress/decompress on tensors), if any."""

    __slots__ = ("param", "optimizer", "tensor_buffers", "compressor", "_decode", "_in_place", "_resparsify")

    def __init__(self, param, optimizer, tensor_buffers: bool, compressor=None):
        self.param, self.optimizer = param, optimizer
        self.tensor_buffers, self.compressor, self._decode, self._in_place = tensor_buffers, compressor, None, False
        self._resparsify = None  # sparse_dim of a sparse gradient densified for the all-reduce

    def kind(self):
        g = self.param.grad
        return None if g is None else ("sparse" if g.is_sparse else "dense")

    def _table_view(self, t: torch.Tensor) -> torch.Tensor:
        rows = t.shape[0]
        return t.reshape(rows, t.numel() // rows if rows else 1)

    # -- dense ------------------------------------------------------------------------------
    def dense(self, codec):
        p = self.param
        self._resparsify = None
        if p.grad is None:  # another rank may have a gradient (data-dependent graphs)
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            if _takes_only_sparse(self.optimizer):
                self._resparsify = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()
        t, self._decode = p.grad, None
        if codec.custom:  # the user's own compressor, on tensors
            t, ctx = self.compressor.compress(t)
            self._decode = lambda reduced: self.compressor.decompress(reduced, ctx)
        elif codec is not NONE:
            wire = codec.wire_dtype(str(t.dtype).replace("torch.", ""))
            if wire is not None:
                t = t.to(_TORCH_DTYPES[wire])
        # When the buffer is the gradient's own memory, the reduced values land in place.
        self._in_place = self._decode is None and t is p.grad and (self.tensor_buffers or viewable(t))
        return t if self.tensor_buffers else host_array(t)

    def set_dense(self, buffer) -> None:
        if not self._in_place:
            t = as_tensor(buffer)
            if self._decode is not None:
                t = self._decode(t)
            self.param.grad.copy_(t.view_as(self.param.grad))  # casts back from the wire dtype
        if self._resparsify is not None:  # back in the layout the optimizer takes, as Horovod does
            self.param.grad = self.param.grad.to_sparse(sparse_dim=self._resparsify)

    # -- rows -------------------------------------------------------------------------------
    def rows(self):
        g = self.param.grad
        if g is None:
            return None
        if g.is_sparse:
            if g.device.type != "cpu":
                g = g.coalesce()
            return host_array(g._indices()[0]), host_array(g._values())
        return np.arange(g.shape[0], dtype=np.int64), host_array(g)

    def set_rows(self, ids, values) -> None:
        p = self.param
        self.param.grad = torch.sparse_coo_tensor(as_tensor(ids)[None].to(p.device), as_tensor(values).to(p.device),
                                                  p.shape, check_invariants=False)

    def applied(self) -> None:
        self.param.grad = None  # the wrapped optimizer must not apply it again

    def lr(self) -> float:
        return float(group_of(self.optimizer, self.param)["lr"])

    # -- replica (replicated PS) -----------------------------------------------------------------
    def replica(self):
        p = self.param
        if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
            return self._table_view(p.data).numpy()
        return None

    def replica_copy(self):
        return np.array(host_array(self._table_view(self.param.detach()).float()), copy=True)

    def set_replica(self, values) -> None:
        with torch.no_grad():
            self.param.copy_(torch.from_numpy(values).view(self.param.shape))

    def write_rows(self, ids, rows) -> None:
        p = self.param
        with torch.no_grad():
            self._table_view(p).index_copy_(0, torch.from_numpy(ids).to(p.device),
                                            torch.from_numpy(rows).to(p.device, p.dtype))


class StagedRowsAccess:
    """A PS-backed module (sharded placement): its backward stages (ids, gradient rows) here,
    and the push takes them at step()."""

    __slots__ = ("optimizer", "_parts")

    def __init__(self, optimizer):
        self.optimizer, self._parts = optimizer, []

    def stage(self, ids, grad: torch.Tensor) -> None:
        """Gradient rows for `ids` (duplicates allowed; the push sums them, in C++)."""
        self._parts.append((ids, host_array(grad)))

    def kind(self):
        return "sparse" if self._parts else None

    def rows(self):
        parts, self._parts = self._parts, []
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([ids for ids, _ in parts]), np.concatenate([g for _, g in parts])

    def lr(self) -> float:
        return float(group_of(self.optimizer, None)["lr"])
