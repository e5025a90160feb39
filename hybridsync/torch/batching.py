"""Batched lookups: one PS pull per forward for all sharded tables, instead of one per table.

Every pull is collective, and on busy or oversubscribed hosts each collective costs a round of
scheduling; DLRM-style models call 8-26 embeddings per forward. At the model's first forward
after wrapping, this learns which model input each PS embedding reads -- the input itself, one
column or row of a 2-D input, or an entry of a dict/list input -- and if every PS embedding is
called exactly once on such an input (the same on every rank), later forwards pull all tables
in one round from a forward pre-hook on the model. Each module then checks that its input is
exactly the view that was predicted and that no one wrote to it since; a mismatch is an error
naming the module, never a stale row. Models that do not fit keep one pull per call.
HYBRIDSYNC_BATCH_LOOKUPS=0 turns this off.
"""
from __future__ import annotations

import time

import torch

from .. import comm, runtime, timeline
from ..sync.table import pull


def _inputs(args, kwargs):
    """(path, tensor) for the model's tensor inputs, one level into dicts, lists and tuples."""
    out = []
    items = [(("arg", i), a) for i, a in enumerate(args)] + [(("kw", k), v) for k, v in kwargs.items()]
    for path, value in items:
        if isinstance(value, torch.Tensor):
            out.append((path, value))
        elif isinstance(value, dict):
            out += [(path + ("key", k), v) for k, v in value.items() if isinstance(v, torch.Tensor)]
        elif isinstance(value, (list, tuple)):
            out += [(path + ("item", i), v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return out


def _same_view(a, b) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _locate(x, inputs):
    """How x derives from a model input: (path, 'whole'|'column'|'row', index), or None."""
    for path, t in inputs:
        if x is t or _same_view(x, t):
            return path, "whole", 0
        if t.dim() != 2 or x.dim() != 1 or x.dtype != t.dtype:
            continue
        if x.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            continue
        offset = x.storage_offset() - t.storage_offset()
        if x.shape[0] == t.shape[0] and x.stride() == (t.stride(0),) and t.stride(1) and offset % t.stride(1) == 0:
            k = offset // t.stride(1)
            if 0 <= k < t.shape[1]:
                return path, "column", k
        if x.shape[0] == t.shape[1] and x.stride() == (t.stride(1),) and t.stride(0) and offset % t.stride(0) == 0:
            k = offset // t.stride(0)
            if 0 <= k < t.shape[0]:
                return path, "row", k
    return None


class BatchedLookups:
    def __init__(self, model: torch.nn.Module, modules: list):
        self.modules = list(modules)
        self.pattern = None  # None: learning at the next forward; [] : off; else [(module, where)]
        self._seen: list = []
        self._cache: dict = {}
        self._inputs = None
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after, with_kwargs=True, always_call=True)
        for m in self.modules:
            m._batcher = self

    # -- model hooks ------------------------------------------------------------------------------
    def _before(self, model, args, kwargs):
        self._inputs = _inputs(args, kwargs)
        self._cache.clear()
        if not self.pattern:
            return
        by_path = dict(self._inputs)
        ids, predicted = [], []
        for module, (path, kind, k) in self.pattern:
            t = by_path.get(path)
            if t is None or (kind != "whole" and t.dim() != 2):
                raise RuntimeError(f"hybridsync batched lookups: the model input {path} that PS embedding "
                                   f"'{module.table_name}' reads is missing or changed shape; set "
                                   "HYBRIDSYNC_BATCH_LOOKUPS=0 for models whose inputs vary in structure")
            x = t if kind == "whole" else (t[:, k] if kind == "column" else t[k])
            predicted.append((module, x, t._version))
            host = x.detach() if x.device.type == "cpu" else x.detach().cpu()
            ids.append(host.contiguous().numpy())
        tl = timeline.get()
        start = time.perf_counter_ns() if tl else 0
        results = pull([m.table for m, _ in self.pattern], ids)
        if tl:
            tl.complete(f"pull ({len(ids)} tables)", start, time.perf_counter_ns(), "ps", rows=sum(len(r[0]) for r in results))
            tl.engine_events()
        for (module, x, version), flat, result in zip(predicted, ids, results):
            self._cache[module] = (x, version, flat, result)

    def _after(self, model, args, kwargs, output):
        if self.pattern is None:
            self.pattern = self._learn()
        self._cache.clear()
        self._seen = []
        self._inputs = None

    # -- module side ------------------------------------------------------------------------------
    def take(self, module, x):
        """The prefetched (ids, unique, inverse, rows) of `module` for input x, or None."""
        if self.pattern is None:
            if self._inputs is not None:
                self._seen.append((module, x))
            return None
        entry = self._cache.pop(module, None)
        if entry is None:
            return None
        predicted, version, flat, result = entry
        if not _same_view(x, predicted) or x._version != version:
            raise RuntimeError(
                f"hybridsync batched lookups: PS embedding '{module.table_name}' was called with an input other "
                "than the model input it read at the first step (or one modified in place since the forward "
                "began); set HYBRIDSYNC_BATCH_LOOKUPS=0 for this model")
        return (flat,) + tuple(result)

    def _learn(self):
        seen = {}
        for module, x in self._seen:
            seen.setdefault(id(module), []).append((module, x))
        pattern = []
        for module in self.modules:
            calls = seen.get(id(module), [])
            where = _locate(calls[0][1], self._inputs or []) if len(calls) == 1 else None
            if where is None:
                pattern = []
                break
            pattern.append((module, where))
        # Every rank must batch the same way: agree, or all fall back to one pull per call.
        mine = [(m.table.handle, w) for m, w in pattern]
        if runtime.world().size > 1:
            everyone = comm.objects().allgather_object(mine)
            if any(e != mine for e in everyone):
                pattern = []
        return pattern
