"""hybridsync.torch.DistributedOptimizer: a drop-in for hvd.DistributedOptimizer.

The returned object is an instance of a class derived from the wrapped optimizer's own class
and shares its state (param_groups, state), so isinstance checks, LR schedulers and
state_dict() work as on the original. Each parameter gets a route from the plan; gradient
hooks hand finished gradients to the route's synchronizer, and step() synchronizes every
route before the wrapped optimizer's update.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

import time

from .. import comm
from .. import config as config_mod
from .. import plan as plan_mod
from .. import runtime, timeline
from ..types import GradKind, Placement, ReduceOp, Route, as_reduce_op
from . import ops, sync_ps
from .compression import Compression, NoneCompressor
from .planner import plan_for, ps_modules, route_for_observed
from .sync_base import SyncSettings, Variable
from .sync_dense import DenseAllreduce, SparseAllgather, SparseAsDense

# (route, placement) -> synchronizer class: one registry, no if/elif on routes.
SYNCHRONIZERS: dict = {
    (Route.ALLREDUCE, Placement.NONE): DenseAllreduce,
    (Route.SPARSE_AS_DENSE, Placement.NONE): SparseAsDense,
    (Route.ALLGATHER, Placement.NONE): SparseAllgather,
}
sync_ps.register(SYNCHRONIZERS)


def _compression_name(compression) -> str:
    return {NoneCompressor: "none", Compression.fp16: "fp16"}.get(compression, getattr(compression, "__name__", "custom"))


def _named_parameters(optimizer, named_parameters, model):
    """(name, parameter) for every parameter of the optimizer, validated as Horovod does."""
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                             "usually model.named_parameters()")
    elif model is not None:
        named = list(model.named_parameters())
    else:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                 for j, p in enumerate(group["params"])]
    seen, dups = set(), []
    for name, _ in named:
        if name in seen:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique; duplicates: {', '.join(sorted(set(dups)))}")
    name_of = {id(p): name for name, p in named}
    result = []
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in name_of:
                raise ValueError(
                    f"{'named_parameters' if named_parameters is not None else 'model'} was given, but parameter #{j} "
                    f"of param_groups[{i}] (shape {tuple(p.shape)}) is not in it: every parameter the optimizer "
                    "updates needs a name")
            result.append((name_of[id(p)], p))
    return result


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class. Attributes are prefixed `_hs_`."""

    def _hs_setup(self, named, model, config, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, backend):
        world = runtime.init()
        # Config and plan first: they need no communication, so a bad config raises the same
        # ConfigError on every rank before any collective could leave one waiting.
        cfg = config_mod.load(config if config is not None else runtime.default_config())
        backend_name = comm.choose(backend or (cfg.backend if cfg else None))
        self._hs_plan, self._hs_planner = plan_for(self, named, model, cfg, _compression_name(compression),
                                                   backend_name, world.size, comm.why(backend_name))
        self._hs_compression = compression
        self._hs_backend = ops.backend(backend_name)
        self._hs_agree_on_plan()
        self._hs_bpps = backward_passes_per_step
        settings = SyncSettings(self._hs_backend, op, compression, gradient_predivide_factor,
                                self._hs_backend.size, self)
        by_name = self._hs_plan.by_name()
        self._hs_vars = [Variable(name, p, by_name[name], index=i) for i, (name, p) in enumerate(named)]
        for name, module in ps_modules(model):
            self._hs_vars.append(Variable(name, None, by_name[name], index=len(self._hs_vars), module=module))
        self._hs_settings = settings
        self._hs_syncs: dict = {}
        self._hs_route_of: dict = {}
        self._hs_model = model
        self._hs_plan_confirmed = False
        self._hs_pending_state: dict = {}  # server state loaded before its route existed
        for var in self._hs_vars:
            if var.plan.route is not None:
                self._hs_assign(var)
        plan_mod.announce(self._hs_plan)
        self._hs_synchronized = False
        self._hs_unsynced_grads = False
        self._hs_should_sync = True
        self._hs_hooks = [var.param.register_post_accumulate_grad_hook(self._hs_make_hook(var))
                          for var in self._hs_vars if var.param is not None and var.param.requires_grad]
        for sync in self._hs_syncs.values():
            sync.on_wrap()
        self._hs_forward_end = None
        if model is not None and timeline.get() is not None:
            self._hs_trace_forward(model)
        plan_mod.register(self)

    def _hs_trace_forward(self, model):
        """Timeline spans for the model's forward, and for backward (forward end -> sync)."""
        def before(module, args):
            self._hs_forward_start = time.perf_counter_ns()

        def after(module, args, output):
            self._hs_forward_end = time.perf_counter_ns()
            timeline.get().complete("forward", self._hs_forward_start, self._hs_forward_end)

        model.register_forward_pre_hook(before, prepend=True)  # before the batched pull
        model.register_forward_hook(after)

    # -- routing ------------------------------------------------------------------------------
    def _hs_agree_on_plan(self):
        """Every rank's variables and routes must equal rank 0's; all ranks raise together,
        naming the first difference, instead of one deadlocking in a later collective."""
        mine = [(v.name, tuple(v.shape), v.route and v.route.value, v.placement.value) for v in self._hs_plan.variables]
        if self._hs_backend.size == 1:
            return
        everyone = runtime.allgather_object(mine)
        for rank, theirs in enumerate(everyone):
            if theirs == everyone[0]:
                continue
            for i, (a, b) in enumerate(zip(everyone[0], theirs)):
                if a != b:
                    raise RuntimeError(
                        f"rank {rank} differs from rank 0 at variable #{i}: rank 0 has {a[0]} {a[1]} "
                        f"({a[2]}/{a[3]}), rank {rank} has {b[0]} {b[1]} ({b[2]}/{b[3]}); every rank must "
                        "build the same model and use the same config")
            raise RuntimeError(f"rank {rank} has {len(theirs)} variables, rank 0 has {len(everyone[0])}; "
                               "every rank must build the same model")

    def _hs_assign(self, var):
        plan = var.plan
        var.compressor = (Compression.by_name(plan.compression) if plan.compression in ("none", "fp16")
                          else self._hs_compression)
        key = (var.plan.route, var.plan.placement)
        if key not in SYNCHRONIZERS:
            raise NotImplementedError(f"variable '{var.name}': route {key[0].value} with placement "
                                      f"{key[1].value} is not available")
        if key not in self._hs_syncs:
            self._hs_syncs[key] = SYNCHRONIZERS[key](self._hs_settings, [], model=self._hs_model)
        self._hs_syncs[key].add(var)
        self._hs_route_of[var] = key

    def _hs_make_hook(self, var):
        def hook(param):
            if param.grad is not None and param.grad.requires_grad:
                raise RuntimeError(f"gradient of '{var.name}' requires grad: double backward is not supported")
            var.passes += 1
            self._hs_unsynced_grads = True
            if var.passes > self._hs_bpps:
                raise RuntimeError(
                    f"the gradient of '{var.name}' was computed {var.passes} times before step() "
                    f"(backward_passes_per_step={self._hs_bpps}); increase backward_passes_per_step "
                    "to accumulate gradients locally")
            if var not in self._hs_route_of:
                self._hs_decide(var)
            elif var.plan.kind is GradKind.DENSE and param.grad.is_sparse:
                raise RuntimeError(
                    f"variable '{var.name}' was planned dense but produced a sparse gradient; give the "
                    "model (DistributedOptimizer(..., model=model)) or a config rule for it")
            if var.passes == self._hs_bpps:
                self._hs_syncs[self._hs_route_of[var]].grad_ready(var)
        return hook

    def _hs_decide(self, var):
        """First backward of a variable planned without its module: its gradient decides."""
        kind = GradKind.SPARSE if var.param.grad is not None and var.param.grad.is_sparse else GradKind.DENSE
        route_for_observed(var.plan, kind, self._hs_planner, var.param)
        self._hs_assign(var)

    def _hs_confirm_plan(self):
        """Once, at the first synchronize: every rank must have decided the same routes."""
        for var in self._hs_vars:
            if var not in self._hs_route_of:
                self._hs_decide(var)
        mine = [(v.name, tuple(v.plan.shape), v.plan.route.value, v.plan.placement.value) for v in self._hs_vars]
        if self._hs_settings.world_size > 1:
            reference = self._hs_backend.broadcast_object(mine, 0)
            for a, b in zip(mine, reference):
                if a != b:
                    raise RuntimeError(
                        f"rank {self._hs_backend.rank} disagrees with rank 0 on variable '{a[0]}': "
                        f"{a[1]} via {a[2]}/{a[3]} here, {b[0]} {b[1]} via {b[2]}/{b[3]} on rank 0 "
                        "(every rank must build the same model)")
            if len(mine) != len(reference):
                raise RuntimeError(f"rank {self._hs_backend.rank} has {len(mine)} variables, rank 0 has {len(reference)}")
        self._hs_plan_confirmed = True
        for sync in self._hs_syncs.values():
            sync.plan_verified = True
        self._hs_load_route_state(self._hs_pending_state)

    # -- Horovod's optimizer API --------------------------------------------------------------
    @property
    def plan(self):
        return self._hs_plan

    @property
    def backward_passes_per_step(self):
        return self._hs_bpps

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._hs_bpps = passes

    def synchronize(self):
        """Completes gradient exchange for every variable (called by step())."""
        tl = timeline.get()
        if tl is not None and self._hs_forward_end is not None:
            tl.complete("backward", self._hs_forward_end, time.perf_counter_ns())
            self._hs_forward_end = None
        with timeline.span("synchronize"):
            self._hs_synchronize()

    def _hs_synchronize(self):
        if not self._hs_plan_confirmed:
            self._hs_confirm_plan()
        # Routes that send without waiting (PS pushes) first: their messages travel while the
        # routes that wait (all-reduce) complete.
        for sync in sorted(self._hs_syncs.values(), key=lambda s: s.waits):
            sync.synchronize()
        for var in self._hs_vars:
            var.passes = 0
        self._hs_unsynced_grads = False
        self._hs_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """`optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()`"""
        self._hs_should_sync = False
        try:
            yield
        finally:
            self._hs_should_sync = True

    def step(self, closure=None):
        if self._hs_should_sync:
            if self._hs_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(): gradients are synchronized twice")
            self.synchronize()
        elif self._hs_unsynced_grads:
            pending = next((v.name for v in self._hs_vars if v.passes), "?")
            raise RuntimeError(
                f"step() inside skip_synchronize() with gradients that were never synchronised (e.g. '{pending}'): "
                "call optimizer.synchronize() before the skip_synchronize() block")
        self._hs_synchronized = False
        with timeline.span("optimizer update (dense)"):
            return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if any(sync.in_flight() for sync in self._hs_syncs.values()):
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                               "or optimizer.synchronize(): gradients are still being exchanged")
        return super().zero_grad(set_to_none=set_to_none)

    @staticmethod
    def _hs_key(route, placement) -> str:
        return f"{route.value}/{placement.value}"

    def state_dict(self):
        """The wrapped optimizer's state, plus (key 'hybridsync') the server-side state of
        PS tables, gathered whole from the shards (collective: call it on every rank)."""
        state = super().state_dict()
        extra = {self._hs_key(*key): sync.state_dict() for key, sync in self._hs_syncs.items()}
        extra = {k: v for k, v in extra.items() if v}
        if extra or self._hs_pending_state:
            state["hybridsync"] = {**self._hs_pending_state, **extra}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("hybridsync", {})
        super().load_state_dict(state_dict)
        self._hs_synchronized = False
        if self._hs_plan_confirmed:
            self._hs_load_route_state(extra)
        else:  # routes of variables recognised at the first backward do not exist yet
            self._hs_pending_state = dict(extra)

    def _hs_load_route_state(self, extra: dict) -> None:
        for key, sync in self._hs_syncs.items():
            if self._hs_key(*key) in extra:
                sync.load_state_dict(extra[self._hs_key(*key)])
        self._hs_pending_state = {}


def DistributedOptimizer(optimizer, named_parameters=None, model=None, config=None, compression=None,
                         backward_passes_per_step: int = 1, op=ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0, backend: str | None = None):
    """Wraps a torch optimizer so that step() applies gradients synchronized across ranks.

    named_parameters: (name, param) pairs, as model.named_parameters(); names the variables.
    model: the model; lets sparse embeddings be planned up front and, by default, sharded on
        the parameter server (rows live only on the shards). Without it, sparse tables keep a
        replica on every rank (Horovod-style) and are recognised at the first backward pass.
    config: YAML path, dict, or None (hybridsync.init(config=...), else HYBRIDSYNC_CONFIG): per-variable
        routes, placements, partitions, compression and server optimizers (see hybridsync.config).
    compression: hybridsync.torch.Compression.none | .fp16 for the dense all-reduce.
    backward_passes_per_step: backward passes accumulated locally (summed) before exchange.
    op: Average (default) or Sum across ranks. gradient_predivide_factor: with Average,
        divide by this before the sum and by size/factor after.
    backend: 'horovod' | 'mpi' for dense all-reduce (default: env, config, then Horovod).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a hybridsync DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op = as_reduce_op(op)
    if gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if compression is None:
        compression = NoneCompressor
    elif isinstance(compression, str):
        compression = Compression.by_name(compression)
    elif not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError("compression must be hybridsync.torch.Compression.none / .fp16 (or have compress/decompress)")
    named = _named_parameters(optimizer, named_parameters, model)

    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
    dist = cls.__new__(cls)
    # Share the wrapped optimizer's state; an LR scheduler's per-instance step wrapper on the
    # original must not be copied (it would call the unsynchronized step).
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    dist._hs_setup(named, model, config, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, backend)
    return dist
