"""hybridsync.torch.DistributedOptimizer: a drop-in for hvd.DistributedOptimizer.

The returned object is an instance of a class derived from the wrapped optimizer's own class
and shares its state (param_groups, state), so isinstance checks, LR schedulers and
state_dict() work as on the original. Each parameter gets a route from the plan; gradient
hooks hand finished gradients to the route's synchronizer, and step() synchronizes every
route before the wrapped optimizer's update.
"""
from __future__ import annotations

import contextlib
import time
import warnings

import numpy as np
import torch

from .. import comm, planning, runtime, timeline
from .. import config as config_mod
from ..planning import agree
from ..planning.choose import candidates_for
from . import checkpointing
from ..ps.table import TableView
from ..settings import settings
from ..sync.base import SyncContext, Variable, check_options
from ..sync.registry import SyncSet
from ..types import GradKind, Placement, ReduceOp
from .access import ParamAccess, StagedRowsAccess, sparse_update_checks
from .adasum_optimizer import adasum_optimizer
from .adaptive import AdaptiveStep
from .batching import BatchedLookups
from .horovod.compression import Compression, NoneCompressor
from .embedding import Embedding, EmbeddingBag
from .optimizer_args import check_groups, check_op, parameter_names, sparse_as_dense_config
from .dynamic_embedding import DynamicEmbedding
from .variables import apply_table_rules, plan_for, ps_modules, route_for_observed
from .process_set_optimizer import check_routes, outside_set_optimizer, scope_for, set_config
from .server_optimizer import describe, group_of
from .table_tensor import ShardedTableTensor


def _compression_name(compression) -> str:
    """The codec name the plan shows: 'none', 'fp16', or a custom compressor's class name."""
    if compression in (NoneCompressor, Compression.fp16):
        return compression.name
    return getattr(compression, "__name__", type(compression).__name__)


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
                  gradient_predivide_factor, backend, scope=None, adaptive=None):
        """scope: a process set's SetScope (hybridsync.torch.process_set_optimizer), or None."""
        world = runtime.init()
        self._parameter_names = parameter_names(named)
        # Config and plan first: they need no communication, so a bad config raises the same
        # ConfigError on every rank before any collective could leave one waiting.
        cfg = config_mod.load(config if config is not None else runtime.default_config())
        if scope is None:
            backend_name = comm.choose(backend or (cfg.backend if cfg else None))
            size, reason = world.size, comm.why(backend_name)
        else:  # the set's own MPI communicator, whatever the job's dense backend
            backend_name, size, reason = "mpi", scope.size, scope.reason()
        apply_table_rules(cfg, named, model)
        plan, self._hs_planner = plan_for(self, named, model, cfg, _compression_name(compression),
                                          backend_name, size, reason)
        self._hs_scope = scope
        if scope is not None:
            check_routes(plan.variables, scope)
        dense_backend = comm.backend(backend_name) if scope is None else scope.engine
        self._hs_plan = agree(plan, dense_backend)
        self._hs_bpps = backward_passes_per_step
        tensor_buffers = backend_name == "horovod"
        custom = None if compression in (NoneCompressor, Compression.fp16) else compression
        by_name = self._hs_plan.by_name()
        self._hs_vars = [Variable(name, by_name[name], ParamAccess(p, self, tensor_buffers, custom), index=i)
                         for i, (name, p) in enumerate(named)]
        self._hs_param_of = {var: p for var, (_, p) in zip(self._hs_vars, named)}
        for name, module in ps_modules(model):
            self._hs_vars.append(self._hs_table_variable(name, module, by_name[name]))
        self._hs_sync = SyncSet(SyncContext(dense_backend, op, size, gradient_predivide_factor,
                                            tensor_buffers=tensor_buffers))
        self._hs_adaptive = AdaptiveStep(self, adaptive, size, self._hs_sync.ctx)
        self._hs_adaptive.check_accumulators({(v.plan.optimizer or {}).get("name") for v in self._hs_vars})
        self._hs_model = model
        self._hs_swapped: dict = {}  # Variable -> ([(PS module, the nn module it replaced)], its parameter)
        self._hs_left_ps: dict = {}  # Variable -> (those pairs, their batcher) while sync: auto tries a replica
        self._hs_replica_hooks: dict = {}  # Variable -> its parameter's gradient hook while it is a replica
        self._hs_custom_compression = custom
        self._hs_plan_confirmed = False
        self._hs_pending_state: dict = {}  # server state loaded before its route existed
        swaps = [var for var in self._hs_vars if var.plan.route is not None and var.table is None
                 and var.plan.placement is Placement.SHARDED]
        for var in swaps:  # nn.Embedding(sparse=True) -> PS-backed module, everywhere in the model
            self._hs_swap(var)
        for var in self._hs_vars:
            if var.plan.route is not None:
                self._hs_sync.assign(var)
        planning.announce(self._hs_plan)
        self._hs_synchronized = False
        self._hs_unsynced_grads = False
        self._hs_should_sync = True
        self._hs_hooks = [p.register_post_accumulate_grad_hook(self._hs_make_hook(var))
                          for var, p in self._hs_param_of.items() if p.requires_grad]
        self._hs_sync.prepare()
        modules = [var.access.module for var in self._hs_vars  # (a dynamic table pulls on its own)
                   if isinstance(var.access, _ModuleRows) and not isinstance(var.access.module, DynamicEmbedding)]
        if model is not None and modules and settings().batch_lookups:
            BatchedLookups(model, modules)
        self._hs_forward_end = None
        if model is not None and timeline.get() is not None:
            self._hs_trace_forward(model)
        planning.register(self)

    def _hs_table_variable(self, name, module, plan):
        """A PS-backed module's table as a variable: its backward stages rows for the push."""
        access = _ModuleRows(self, module)
        module._sink = access
        return Variable(name, plan, access, index=len(self._hs_vars), table=module.table)

    def _hs_swap(self, var):
        """Replaces var's nn.Embedding(sparse=True) by a PS-backed copy whose shards start from
        rank 0's weights, then frees this rank's whole table. Other sparse embedding modules that
        share the weight (tied) become PS modules reading the same table: their gradients add up
        in one push, as autograd adds them into one .grad."""
        p = self._hs_param_of.pop(var)
        old, *tied = [m for m in self._hs_model.modules()
                      if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.weight is p]
        cls = Embedding if isinstance(old, torch.nn.Embedding) else EmbeddingBag
        if runtime.world().rank != 0:  # the shards take rank 0's rows: ours can go before they are made
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        new = cls.from_module(old, var.name, partitions=var.plan.shards or None, partition=var.plan.partition,
                              give_up_weight=True, storage=var.plan.storage)  # rank 0's table shrinks as its shards fill
        new_of = {id(old): new}
        for other in tied:
            new_of[id(other)] = (Embedding if isinstance(other, torch.nn.Embedding) else EmbeddingBag).from_module(
                other, var.name, table=new.table)
        for parent in self._hs_model.modules():
            for key, child in list(parent._modules.items()):
                if child is not None and id(child) in new_of:
                    parent._modules[key] = new_of[id(child)]
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # from now on the rows live on the shards only
        p.grad = None
        originals = {id(m): m for m in [old, *tied]}
        self._hs_swapped[var] = ([(m, originals[k]) for k, m in new_of.items()], p)  # sync: auto may swap back
        var.access = _ModuleRows(self, new)  # `new` alone may have its lookups batched
        for module in new_of.values():
            module._sink = var.access
        var.table = new.table

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
            if var not in self._hs_sync.route_of:
                self._hs_decide(var)
            elif var.plan.kind is GradKind.DENSE and param.grad.is_sparse:
                raise RuntimeError(
                    f"variable '{var.name}' was planned dense but produced a sparse gradient; give the "
                    "model (DistributedOptimizer(..., model=model)) or a config rule for it")
            if var.passes == self._hs_bpps:
                self._hs_sync.grad_ready(var)
        return hook

    def _hs_decide(self, var):
        """First backward of a variable planned without its module: its gradient decides."""
        p = self._hs_param_of[var]
        kind = GradKind.SPARSE if p.grad is not None and p.grad.is_sparse else GradKind.DENSE
        route_for_observed(var.plan, kind, self._hs_planner, p)
        if self._hs_scope is not None:
            check_routes([var.plan], self._hs_scope)
        self._hs_sync.assign(var)

    def _hs_confirm_plan(self):
        """Once, at the first synchronize: every rank must have decided the same routes."""
        for var in self._hs_vars:
            if var not in self._hs_sync.route_of:
                self._hs_decide(var)
        agree(self._hs_plan, self._hs_sync.ctx.backend)
        self._hs_plan_confirmed = True
        self._hs_sync.mark_verified()
        self._hs_load_route_state(self._hs_pending_state)
        planning.start_auto(self._hs_sync, TorchAuto(self), self._hs_planner)

    @property
    def hybridsync_frontend(self) -> "TorchFrontend":
        """What checkpoint, elastic and explain ask of this optimizer (hybridsync.frontend)."""
        return TorchFrontend(self)

    def _hs_adopt_auto(self, saved: dict) -> None:
        """Collective (load_checkpoint): `sync: auto` takes the saved run's decisions."""
        planning.adopt_auto(self._hs_sync, TorchAuto(self), saved)

    # -- Horovod's optimizer API --------------------------------------------------------------
    @property
    def plan(self):
        if self._hs_adaptive.enabled:  # explain() shows the adaptive state as of now
            self._hs_plan.adaptive = self._hs_adaptive.controller.summary()
        return self._hs_plan

    @property
    def backward_passes_per_step(self):
        return self._hs_bpps

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._hs_bpps = passes

    # -- adaptive batch size and learning rate (hybridsync.adaptive) ----------------------------
    @property
    def adaptive(self):
        """The adaptive controller (hybridsync.adaptive.Adaptive), or None when not enabled."""
        return self._hs_adaptive.controller

    @property
    def last_micro_step(self) -> bool:
        """Whether the backward pass just done is the last of its step: the adaptive batch may make
        a step several micro-steps, whose step() calls only add up gradients. A loop that calls
        synchronize() itself (to skip a step, unscale, clip) calls it on this one. Always True
        without adaptive=."""
        return self._hs_adaptive.last_micro_step()

    def gradient_stats(self) -> dict:
        """{"sqr": |G|^2, "var": tr(Sigma) per sample, "noise_scale": var/sqr, "by_variable": {name:
        {"sqr", "var"}}}, smoothed over the steps so far (needs DistributedOptimizer(adaptive=...))."""
        return self._hs_adaptive.require("gradient_stats()").gradient_stats()

    @property
    def progress(self) -> float:
        """Scale-invariant steps: optimizer steps weighted by their gain (base-batch steps' worth)."""
        return self._hs_adaptive.require("progress").progress

    def synchronize(self):
        """Completes gradient exchange for every variable (called by step()). Called on its own
        (Horovod's `synchronize(); with skip_synchronize(): step()`), the dense gradients are
        all-reduced and the tables' pushes wait for that step(): the step may still be skipped
        (a GradScaler's inf, a NaN loss) by calling zero_grad() instead, and no table changes."""
        self._hs_synchronize(hold_updates=True)

    def _hs_synchronize(self, hold_updates=False):
        tl = timeline.get()
        if tl is not None and self._hs_forward_end is not None:
            tl.complete("backward", self._hs_forward_end, time.perf_counter_ns())
            self._hs_forward_end = None
        with timeline.span("synchronize"):
            self._hs_adaptive.rescale_accumulators()  # a batch change takes effect: before its pushes
            self._hs_adaptive.scale_lr()  # before the pushes: the server rules take the scaled LR too
            if not self._hs_plan_confirmed:
                self._hs_confirm_plan()
            self._hs_sync.synchronize(hold_updates)
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
        if self._hs_adaptive.accumulating():  # a micro-step of the adaptive batch: gradients add up
            return None
        result = self._hs_step(closure)
        self._hs_adaptive.step_done()
        return result

    def _hs_step(self, closure):
        self._hs_sync.apply_held()  # the tables' pushes of an explicit synchronize()
        if self._hs_should_sync:
            if self._hs_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(): gradients are synchronized twice")
            self._hs_synchronize()
        elif self._hs_unsynced_grads:
            pending = next((v.name for v in self._hs_vars if v.passes), "?")
            raise RuntimeError(
                f"step() inside skip_synchronize() with gradients that were never synchronised (e.g. '{pending}'): "
                "call optimizer.synchronize() before the skip_synchronize() block")
        self._hs_synchronized = False
        with timeline.span("optimizer update (dense)"), sparse_update_checks(self):
            result = super().step(closure)
        self._hs_sync.step_taken()
        return result

    def zero_grad(self, set_to_none: bool = True):
        if self._hs_synchronized:  # synchronize() and no step(): the step is skipped, tables untouched
            self._hs_sync.discard_held()
            self._hs_sync.step_taken()
            self._hs_adaptive.step_skipped()
            self._hs_synchronized = False
        elif self._hs_adaptive.mid_accumulation():
            return None  # the adaptive batch's micro-steps keep adding into .grad
        if self._hs_sync.in_flight():
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                               "or optimizer.synchronize(): gradients are still being exchanged")
        return super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state, plus (key 'hybridsync') the server-side state of PS
        tables as ShardedTableTensors: no collective and no copy -- rank 0 alone may save it, and
        only a rank that reads a slot (torch.save does) holds it."""
        state = super().state_dict()
        extra = _map_arrays(self._hs_sync.state_dict(), ShardedTableTensor, TableView)
        pending = self._hs_pending_state
        if extra or pending:
            state["hybridsync"] = {route: {**pending.get(route, {}), **extra.get(route, {})}
                                   for route in {**pending, **extra}}
        if self._hs_adaptive.enabled:
            state["hybridsync_adaptive"] = self._hs_adaptive.controller.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("hybridsync", {})
        adaptive = state_dict.pop("hybridsync_adaptive", None)
        super().load_state_dict(state_dict)
        if adaptive is not None and self._hs_adaptive.enabled:
            self._hs_adaptive.load_state_dict(adaptive)
        self._hs_synchronized = False
        self._hs_load_route_state(extra)

    def _hs_load_route_state(self, extra: dict) -> None:
        """Server state goes to the tables that exist now (state_dict() reads it back at once); the
        state of variables whose route the first backward decides waits for it."""
        def plain(t):  # a table's own view is recognised (nothing to write); other tensors are rows (or ids)
            if isinstance(t, ShardedTableTensor):
                return t.view
            t = t.detach().cpu()
            return (t.to(torch.float32) if t.is_floating_point() else t).numpy()

        self._hs_pending_state = self._hs_sync.load_state_dict(_map_arrays(extra, plain, torch.Tensor))


def _map_arrays(state, convert, kind=np.ndarray):
    """state with every `kind` inside its dicts converted (server state: NumPy <-> torch)."""
    if isinstance(state, dict):
        return {k: _map_arrays(v, convert, kind) for k, v in state.items()}
    return convert(state) if isinstance(state, kind) else state


class TorchAuto:
    """`sync: auto` in PyTorch (hybridsync.planning.switch.AutoFrontend): a table leaving the PS
    gets its nn.Embedding / nn.EmbeddingBag and parameter back, and the server's slots become the
    wrapped optimizer's state for that parameter; coming back (a trial that lost), the other way."""

    returns_to_ps = True
    moves_after_step = True  # step() calls SyncSet.step_taken() after the update

    def __init__(self, optimizer):
        self.opt = optimizer

    def _param(self, var):
        return self.opt._hs_param_of[var] if var in self.opt._hs_param_of else self.opt._hs_swapped[var][1]

    def candidates(self, var):
        return candidates_for(describe(self.opt, group_of(self.opt, self._param(var))), var.plan.optimizer_source)

    def to_replica(self, var, rows) -> None:
        opt = self.opt
        if rows is None:  # replicated: the parameter held the rows all along
            return
        pairs, p = opt._hs_swapped.pop(var)  # [(PS module, the nn module it replaced)], tied ones too
        opt._hs_left_ps[var] = (pairs, pairs[0][0]._batcher)  # (the way back: to_table)
        device = torch.device("cpu") if p.is_meta else p.device  # a meta table becomes a real one
        with torch.no_grad():
            p.data = torch.from_numpy(np.ascontiguousarray(rows)).reshape(var.plan.shape).to(device, p.dtype)
        back = {id(new): old for new, old in pairs}
        for parent in opt._hs_model.modules():
            for key, child in list(parent._modules.items()):
                if child is not None and id(child) in back:
                    parent._modules[key] = back[id(child)]
        for new, _ in pairs:
            batcher, new._batcher, new._sink = new._batcher, None, None
            if batcher is not None:  # its batched pull leaves this table out from now on
                batcher.modules = [m for m in batcher.modules if m is not new]
                if batcher.pattern:
                    batcher.pattern = [(m, w) for m, w in batcher.pattern if m is not new]
        var.access = ParamAccess(p, opt, opt._hs_sync.ctx.tensor_buffers, opt._hs_custom_compression)
        opt._hs_param_of[var] = p
        if p.requires_grad:
            opt._hs_replica_hooks[var] = p.register_post_accumulate_grad_hook(opt._hs_make_hook(var))

    def replica_state(self, var, slot_names) -> tuple:
        p = self._param(var)
        state = self.opt.state.get(p, {})
        host = lambda t: t.detach().to("cpu", torch.float32).reshape(var.plan.shape).numpy()  # noqa: E731
        slots = {name: host(state[name]) if name in state else np.zeros(var.plan.shape, np.float32)
                 for name in slot_names}
        step = state.get("step", 0)
        return host(p), slots, int(step.item() if isinstance(step, torch.Tensor) else step)

    def to_table(self, var, table) -> None:
        opt = self.opt
        left = opt._hs_left_ps.pop(var, None)
        if left is None:  # replicated: the parameter keeps its rows, which the shards alias
            return
        pairs, batcher = left
        p = opt._hs_param_of.pop(var)
        hook = opt._hs_replica_hooks.pop(var, None)
        if hook is not None:
            hook.remove()
        opt.state.pop(p, None)  # the server holds the optimizer's state from now on
        back = {id(old): new for new, old in pairs}
        for parent in opt._hs_model.modules():
            for key, child in list(parent._modules.items()):
                if child is not None and id(child) in back:
                    parent._modules[key] = back[id(child)]
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # the rows live on the shards again
        p.grad = None
        opt._hs_swapped[var] = (pairs, p)
        var.access = _ModuleRows(opt, pairs[0][0])
        for module, _ in pairs:
            module.table, module._sink = table, var.access
        if batcher is not None:  # its lookups join the batched pull again (learnt at the next forward)
            batcher.modules.append(pairs[0][0])
            pairs[0][0]._batcher, batcher.pattern = batcher, None

    def set_optimizer_state(self, var, slots: dict, step: int) -> None:
        p = self._param(var)
        state = self.opt.state[p]
        for name, values in slots.items():  # Adagrad: sum; SparseAdam: exp_avg, exp_avg_sq
            state[name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(p.shape).to(p.device, p.dtype)
        if slots or "step" in state:
            old = state.get("step")
            state["step"] = (torch.tensor(float(step), dtype=old.dtype, device=old.device)
                             if isinstance(old, torch.Tensor) else
                             int(step) if isinstance(self.opt, torch.optim.SparseAdam) else
                             torch.tensor(float(step)))

    def set_table(self, var, table) -> None:
        for module, _ in self.opt._hs_swapped[var][0]:
            module.table = table


class TorchFrontend:
    """hybridsync.frontend.Frontend for a wrapped torch optimizer."""

    framework = "torch"

    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def checkpointing(self):
        return checkpointing

    def variables(self) -> list:
        return self._optimizer._hs_vars

    def adopt_auto(self, saved: dict) -> None:
        self._optimizer._hs_adopt_auto(saved)


class _ModuleRows(StagedRowsAccess):
    """StagedRowsAccess that remembers its module (batched lookups need it)."""

    __slots__ = ("module",)

    def __init__(self, optimizer, module):
        super().__init__(optimizer)
        self.module = module


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step: int = 1,
                         op=ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, *, model=None, config=None,
                         backend: str | None = None, adaptive=None):
    """Wraps a torch optimizer so that step() applies gradients synchronized across ranks.

    Horovod's arguments, in Horovod's order:
    named_parameters: (name, param) pairs, as model.named_parameters(); names the variables.
    compression: hybridsync.torch.Compression.none | .fp16 for the dense all-reduce.
    backward_passes_per_step: backward passes accumulated locally (summed) before exchange.
    op: Average (default) or Sum across ranks, or Adasum: Horovod's Adasum optimizer (each rank
        applies its own update; the changes are combined with the Adasum all-reduce; see
        hybridsync.torch.adasum_optimizer). gradient_predivide_factor: with Average,
        divide by this before the sum and by size/factor after.
    num_groups / groups: Horovod's explicit grouping of gradient all-reduces; validated, and a
        scheduling hint only (see optimizer_args.check_groups).
    sparse_as_dense: sparse gradients are densified and all-reduced (config rules still win); a
        SparseAdam gets the average back sparse, every other optimizer dense.
    process_set: a registered hvd.ProcessSet: gradients are averaged over its members only (sparse
        ones all-gathered, or densified with sparse_as_dense); on a rank outside it, step()
        applies that rank's own gradients, as in Horovod (hybridsync.torch.process_set_optimizer).

    hybridsync's own, by keyword:
    model: the model; lets sparse embeddings be planned up front and, by default, sharded on
        the parameter server (rows live only on the shards). Without it, sparse tables keep a
        replica on every rank (Horovod-style) and are recognised at the first backward pass.
    config: YAML path, dict, or None (hybridsync.init(config=...), else HYBRIDSYNC_CONFIG): per-variable
        routes, placements, partitions, compression and server optimizers (see hybridsync.config).
    backend: 'horovod' | 'mpi' for dense all-reduce (default: the config's `backend`, then
        hybridsync.init(backend=...), HYBRIDSYNC_BACKEND, then chosen by resources: comm.choose).
    adaptive: True, a dict or hybridsync.adaptive.AdaptiveConfig: gradient statistics every step
        (gradient_stats()), the learning rate scaled with the batch size, and the batch chosen by
        an AdaptiveDataLoader (docs/adaptive.md). None (default): none of it, not one extra op.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a hybridsync DistributedOptimizer")
    scope = scope_for(process_set)
    op = check_op(op)
    adasum = op == "adasum"
    op = check_options(ReduceOp.AVERAGE if adasum else op, gradient_predivide_factor, backward_passes_per_step)
    if adasum and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if compression is None:
        compression = NoneCompressor
    elif isinstance(compression, str):
        compression = Compression.by_name(compression)
    elif not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError("compression must be hybridsync.torch.Compression.none / .fp16 (or have compress/decompress)")
    if adaptive not in (None, False) and (adasum or scope is not None):
        raise NotImplementedError("DistributedOptimizer(adaptive=...) with op=Adasum or a process_set: the adaptive "
                                  "batch size works with Average/Sum over the whole job only")
    named = _named_parameters(optimizer, named_parameters, model)
    check_groups(num_groups, groups, named)
    if scope is False:  # this rank is outside the process set
        return outside_set_optimizer(optimizer, named, backward_passes_per_step)
    if adasum:  # Horovod's Adasum optimizer: each rank's update, combined (sparse_as_dense is implied)
        if scope is not None:
            raise NotImplementedError("DistributedOptimizer(op=Adasum, process_set=...): Adasum combines updates "
                                      "over the whole job only")
        return adasum_optimizer(optimizer, named, compression, backward_passes_per_step, model, config, backend)
    if scope is not None:
        config = set_config(config, sparse_as_dense)
    elif sparse_as_dense:
        config = sparse_as_dense_config(config)

    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
    dist = cls.__new__(cls)
    # Share the wrapped optimizer's state; an LR scheduler's per-instance step wrapper on the
    # original must not be copied (it would call the unsynchronized step).
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    dist._hs_setup(named, model, config, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, backend, scope, adaptive)
    return dist
