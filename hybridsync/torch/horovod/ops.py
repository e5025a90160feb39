"""Collectives on torch tensors, for both dense backends: Horovod's own ops where Horovod is the
backend (global process set), the MPI collectives (hybridsync.comm.mpi) otherwise and for every
other process set. The MPI side works on NumPy views of CPU tensors; tensors it cannot view
(CUDA, non-contiguous, bfloat16) are staged through a contiguous CPU copy and copied back.

Every *_async function here returns a Handle, whatever the backend, for synchronize()/poll().
"""
from __future__ import annotations

import torch

from ... import comm, runtime
from ...comm import horovod as hvd_backend
from ...comm.negotiation import op_name
from ...comm.negotiation import Desc
from ...comm.mpi_kernels import check_adasum
from . import process_sets
from ..access import host_array, viewable


class Handle:
    """An asynchronous collective; synchronize() gives its result (once: later calls repeat it)."""

    __slots__ = ("_wait", "_poll", "_done", "_result", "__weakref__")

    def __init__(self, wait, poll):
        self._wait, self._poll, self._done, self._result = wait, poll, False, None

    def poll(self) -> bool:
        return self._done or self._poll()

    def wait(self):
        if not self._done:
            try:
                self._result = self._wait()
            finally:
                self._done = True
        return self._result


def group(handles, finish=list) -> Handle:
    """One handle for several (grouped collectives): done when all are."""
    return Handle(lambda: finish([h.wait() for h in handles]), lambda: all(h.poll() for h in handles))


def _label(tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def _like(array, tensor):
    return torch.from_numpy(array).to(device=tensor.device, dtype=tensor.dtype)


def _contiguous_out(tensor):
    """A fresh contiguous copy for out-of-place collectives (the input is left untouched)."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


class _MPITorch:
    """The MPI collectives (of the job, or of one process set) on torch tensors."""

    def __init__(self, engine):
        self.engine = engine

    def _handle(self, inner, finish) -> Handle:
        return Handle(lambda: finish(self.engine.synchronize(inner)), lambda: self.engine.poll(inner))

    def _in_place(self, tensor, submit) -> Handle:
        array = host_array(tensor)
        staged = not viewable(tensor)

        def finish(result):
            if staged:
                tensor.detach().copy_(torch.from_numpy(result))
            return tensor
        return self._handle(submit(array), finish)

    def allreduce_async_(self, tensor, name, op, pre, post):
        label = _label(tensor)
        return self._in_place(tensor, lambda a: self.engine.allreduce_async_(a, name, op, pre, post, dtype=label))

    def broadcast_async_(self, tensor, root, name):
        return self._in_place(tensor, lambda a: self.engine.broadcast_async_(a, root, name, dtype=_label(tensor)))

    def allgather_async(self, tensor, name):
        inner = self.engine.allgather_async(host_array(tensor), name, dtype=_label(tensor))
        return self._handle(inner, lambda out: _like(out, tensor))

    def alltoall_async(self, tensor, splits, name):
        inner = self.engine.alltoall_async(host_array(tensor), splits, name, dtype=_label(tensor))
        return self._handle(inner, lambda r: (_like(r[0], tensor), torch.from_numpy(r[1]).to(torch.int32)))

    def reducescatter_async(self, tensor, name, op, pre, post):
        inner = self.engine.reducescatter_async(host_array(tensor), name, op, pre, post, dtype=_label(tensor))
        return self._handle(inner, lambda out: _like(out, tensor))

    def barrier(self):
        self.engine.barrier()

    def join(self) -> int:
        return self.engine.join()


class _HorovodTorch:
    """Horovod's ops, behind the gate (hybridsync.comm.horovod_gate): the ranks agree on each
    collective over MPI before Horovod runs it, so a mismatch Horovod would wait on forever
    (names, duplicates) raises on every rank like the others. Mismatch errors name the tensor
    and the ranks. Under `horovodrun --gloo` (no MPI) Horovod negotiates alone."""

    def __init__(self):
        self.hvd = hvd_backend.module()

    @property
    def engine(self):
        """The gate, which also moves pickled objects (None: Horovod's own object functions)."""
        return hvd_backend.gate()

    def _handle(self, inner, desc: Desc, finish=lambda out: out) -> Handle:
        hvd = self.hvd

        def wait():
            try:
                out = hvd.synchronize(inner)
            except Exception as exc:
                failure = hvd_backend.failure(exc, desc)
                if failure is exc:
                    raise
                raise failure from None
            return finish(out)
        return Handle(wait, lambda: hvd.poll(inner))

    def _gated(self, desc: Desc, start, finish=lambda out: out) -> Handle:
        """Submits `desc` to the gate; once the ranks agree, start(name) runs it in Horovod."""
        gate = hvd_backend.gate()
        if gate is None:
            return self._handle(start(None if desc.name == "(unnamed)" else desc.name), desc, finish)
        submitted = gate.submit(desc.kind, None if desc.name == "(unnamed)" else desc.name, start, dtype=desc.dtype,
                                shape=desc.shape, root=desc.root, op=desc.op, scales=desc.scales)
        hvd = self.hvd

        def wait():
            started = gate.synchronize(submitted)
            try:
                out = hvd.synchronize(started)
            except Exception as exc:
                failure = hvd_backend.failure(exc, submitted.desc)
                if failure is exc:
                    raise
                raise failure from None
            finally:
                gate.finished(submitted.desc.name, started)
            return finish(out)

        def poll():
            if not gate.poll(submitted):
                return False
            return submitted.error is not None or hvd.poll(submitted.result)
        return Handle(wait, poll)

    @staticmethod
    def _desc(kind, tensor, name, **kw):
        return Desc(kind, name or "(unnamed)", _label(tensor), tuple(tensor.shape), **kw)

    def _in_place(self, tensor, submit, desc):
        # Horovod needs contiguous memory: work on a contiguous copy and copy back.
        work = tensor if tensor.is_contiguous() else tensor.contiguous()

        def finish(out):
            if work is not tensor:
                tensor.detach().copy_(work)
            return tensor
        return self._gated(desc, lambda name: submit(work, name), finish)

    def allreduce_async_(self, tensor, name, op, pre, post):
        desc = self._desc("allreduce", tensor, name, op=op_name(op), scales=(float(pre), float(post)))
        if desc.op == "adasum":  # Horovod would find out only once the data is moving
            check_adasum(desc.name, desc.dtype, runtime.world().size)
        return self._in_place(tensor, lambda t, n: self.hvd.allreduce_async_(
            t, name=n, op=hvd_backend.reduce_op(op), prescale_factor=pre, postscale_factor=post), desc)

    def broadcast_async_(self, tensor, root, name):
        desc = self._desc("broadcast", tensor, name, root=root)
        return self._in_place(tensor, lambda t, n: self.hvd.broadcast_async_(t, root, name=n), desc)

    def allgather_async(self, tensor, name):
        if tensor.dim() == 0:
            raise ValueError(f"allgather '{name}': needs a tensor with at least one dimension (it concatenates dim 0)")
        work = tensor.contiguous()
        return self._gated(self._desc("allgather", tensor, name), lambda n: self.hvd.allgather_async(work, name=n))

    def alltoall_async(self, tensor, splits, name):
        work = tensor.contiguous()
        return self._gated(self._desc("alltoall", tensor, name),
                           lambda n: self.hvd.alltoall_async(work, splits=splits, name=n))

    def reducescatter_async(self, tensor, name, op, pre, post):
        work = tensor.contiguous()
        return self._gated(self._desc("reducescatter", tensor, name, op=op_name(op), scales=(float(pre), float(post))),
                           lambda n: self.hvd.reducescatter_async(work, name=n, op=hvd_backend.reduce_op(op),
                                                                  prescale_factor=pre, postscale_factor=post))

    def barrier(self):
        gate = hvd_backend.gate()
        if gate is None:
            self.hvd.barrier()
        else:
            gate.barrier()  # every rank submitted it: agreed is done

    def join(self) -> int:
        gate = hvd_backend.gate()
        return self.hvd.join() if gate is None else gate.join()


_horovod = None


def route(process_set=None):
    """The collectives for `process_set` (None: the global one) on this rank."""
    global _horovod
    if process_sets.is_global(process_set):
        if comm.choose() == "horovod":
            if _horovod is None or not _horovod.hvd.is_initialized():  # (again, after a shutdown)
                _horovod = _HorovodTorch()
            return _horovod
        return _MPITorch(comm.backend("mpi"))
    return _MPITorch(process_sets.engine_of(process_set))


def set_size(process_set=None) -> int:
    """Number of ranks in `process_set` (None: the job)."""
    return runtime.world().size if process_sets.is_global(process_set) else len(process_set.ranks)


def global_rank() -> int:
    return runtime.world().rank
