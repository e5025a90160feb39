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

The engine writes each Embedding's rows in input order straight into its output's memory, and
all those outputs come from one autograd node: even in a world of one, where a pull is a local
copy, a forward then costs one engine call, one Python forward and one backward, not one per table.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import comm, runtime, timeline
from ..ps.table import pull
from .embedding import Embedding, _Prefetched


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
        self._anchor = torch.empty(0, requires_grad=True)  # lets autograd reach _Prefetched.backward
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after, with_kwargs=True, always_call=True)
        for m in self.modules:
            m._batcher = self

    @property
    def pattern(self):
        return self._pattern

    @pattern.setter
    def pattern(self, pattern):
        """Also works out, once, what every forward needs of it."""
        self._pattern = pattern
        modules = self._modules_pulled = [m for m, _ in pattern or ()]
        self._in_order = [isinstance(m, Embedding) for m in modules]  # EmbeddingBags: unique rows
        self._ordered = [i for i, flag in enumerate(self._in_order) if flag]
        self._ordered_modules = [modules[i] for i in self._ordered]

    # -- model hooks ------------------------------------------------------------------------------
    def _before(self, model, args, kwargs):
        self._inputs = _inputs(args, kwargs)
        self._cache.clear()
        if not self._pattern:
            return
        by_path = dict(self._inputs)
        # Per model input, once: a NumPy view (one device copy, not one per table) and what
        # take() compares a module's input with (the expected view's address, shape, strides).
        inputs = {}
        ids, expected = [], []
        for module, (path, kind, k) in self._pattern:
            got = inputs.get(path)
            if got is None:
                t = by_path.get(path)
                if t is not None:
                    host = (t.detach() if t.device.type == "cpu" else t.detach().cpu()).numpy()
                    got = inputs[path] = (host, t.data_ptr(), tuple(t.shape), t.stride(), t.element_size(),
                                          t.dtype, t._version, t.device)
            if got is None or (kind != "whole" and got[0].ndim != 2):
                raise RuntimeError(f"hybridsync batched lookups: the model input {path} that PS embedding "
                                   f"'{module.table_name}' reads is missing or changed shape; set "
                                   "HYBRIDSYNC_BATCH_LOOKUPS=0 for models whose inputs vary in structure")
            host, ptr, shape, stride, size, dtype, version, _ = got
            if kind == "whole":
                ids.append(np.ascontiguousarray(host))
                expected.append(((ptr, shape, stride, dtype), version))
            elif kind == "column":
                ids.append(np.ascontiguousarray(host[:, k]))
                expected.append(((ptr + k * stride[1] * size, shape[:1], stride[:1], dtype), version))
            else:
                ids.append(np.ascontiguousarray(host[k]))
                expected.append(((ptr + k * stride[0] * size, shape[1:], stride[1:], dtype), version))
        tl = timeline.get()
        start = time.perf_counter_ns() if tl else 0
        # Tables looked up each time: `sync: auto` may re-shard one into a new table.
        results = pull([m.table for m in self._modules_pulled], ids, self._in_order)
        if tl:
            tl.complete(f"pull ({len(ids)} tables)", start, time.perf_counter_ns(), "ps", rows=sum(len(r[0]) for r in results))
            tl.engine_events()
        payloads = list(results)
        if self._ordered:  # every Embedding's output, from one autograd node
            devices = [inputs[self._pattern[i][1][0]][7] for i in self._ordered]
            made = _Prefetched.apply(self._anchor, self._ordered_modules, [ids[i].reshape(-1) for i in self._ordered],
                                     devices, *[results[i][2] for i in self._ordered])
            for i, out in zip(self._ordered, made):
                payloads[i] = out
        for (module, _), (view, version), payload in zip(self._pattern, expected, payloads):
            self._cache[module] = (view, version, payload)

    def _after(self, model, args, kwargs, output):
        if self.pattern is None:
            self.pattern = self._learn()
        self._cache.clear()
        self._seen = []
        self._inputs = None

    # -- module side ------------------------------------------------------------------------------
    def take(self, module, x):
        """What the batched pull brought `module` for input x, or None: an Embedding's output
        tensor, an EmbeddingBag's (unique, inverse, unique rows)."""
        if self.pattern is None:
            if self._inputs is not None:
                self._seen.append((module, x))
            return None
        entry = self._cache.pop(module, None)
        if entry is None:
            return None
        (ptr, shape, stride, dtype), version, got = entry
        if (x.data_ptr() != ptr or x.stride() != stride or x.shape != shape or x.dtype != dtype
                or x._version != version):
            raise RuntimeError(
                f"hybridsync batched lookups: PS embedding '{module.table_name}' was called with an input other "
                "than the model input it read at the first step (or one modified in place since the forward "
                "began); set HYBRIDSYNC_BATCH_LOOKUPS=0 for this model")
        if isinstance(got, torch.Tensor) and not torch.is_grad_enabled():
            return got.detach()  # called under no_grad inside a forward that records
        return got

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
