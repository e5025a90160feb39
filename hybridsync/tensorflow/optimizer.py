"""hybridsync.tensorflow.DistributedOptimizer: a Keras 3 optimizer (SGD, Adam, Adagrad, ...)
whose apply() synchronizes gradients across ranks first, for model.fit and custom loops,
eagerly or inside tf.function.

The optimizer object keeps its identity and state: its class becomes a subclass of its own
class with apply() in front. Routes are planned at the first apply(), when the gradients' kinds
are known (tf.IndexedSlices from Embedding / tf.gather are sparse), or by load_checkpoint before
it, with the kinds the checkpoint's plan recorded (the first apply checks them):

  allreduce, allreduce-as-dense  one fused MPI all-reduce; the Keras optimizer applies the average
  allgather                      every rank's rows gathered; the Keras optimizer applies them
  ps (replicated)                rows pushed to the C++ parameter server, which sums them over
                                 ranks, applies the server rule once per row and returns every
                                 changed row; each rank writes them into its variable
"""
from __future__ import annotations


import keras
import numpy as np
import tensorflow as tf

from .. import planning, runtime
from .. import config as config_mod
from ..adaptive import Adaptive, AdaptiveConfig
from ..adaptive.collect import StepRecorder
from ..planning import Described, Plan, agree, estimate, make_plan, route_resolver
from ..planning.choose import candidates_for
from ..sync.base import SyncContext, Variable, check_options
from ..sync.registry import SyncSet
from ..types import GradKind, Placement, ReduceOp, Route
from . import collectives
from .access import AutoKerasAccess, KerasAccess
from .micro_steps import MicroSteps
from .names import table_variable_name, variable_name
from .server_optimizer import describe, slots
from . import checkpointing


def _kind(grad) -> GradKind:
    return GradKind.SPARSE if isinstance(grad, tf.IndexedSlices) else GradKind.DENSE


def _table_shape(shape) -> tuple[int, int]:
    rows = int(shape[0]) if len(shape) else 1
    return rows, int(np.prod(shape[1:])) if len(shape) > 1 else 1


class _DistributedKerasOptimizer:
    """Put in front of the wrapped optimizer's class. Attributes are prefixed `_hs_`."""

    def _hs_setup(self, config, op, compression, gradient_predivide_factor, adaptive=None):
        runtime.init()
        cfg = AdaptiveConfig.of(adaptive)
        self._hs_adaptive = Adaptive(cfg, type(self).__name__, runtime.world().size) if cfg else None
        self._hs_lr_factor = tf.Variable(1.0, trainable=False, dtype=tf.float32, name="hybridsync_lr_factor")
        self._hs_micro = MicroSteps() if cfg else None
        self._hs_predivide = gradient_predivide_factor
        self._hs_config = config_mod.load(config if config is not None else runtime.default_config())
        self._hs_op = op
        self._hs_compression = compression
        self._hs_plan = None
        self._hs_unconfirmed = False  # a plan made before the first step, not yet checked by it
        planning.register(self)

    # -- adaptive batch size and learning rate (hybridsync.adaptive) -----------------------------
    @property
    def adaptive(self):
        """The adaptive controller (hybridsync.adaptive.Adaptive), or None when not enabled."""
        return self._hs_adaptive

    def gradient_stats(self) -> dict:
        """{"sqr", "var", "noise_scale", "by_variable"}: see hybridsync.torch's optimizer."""
        if self._hs_adaptive is None:
            raise RuntimeError("optimizer.gradient_stats() needs hybridsync.tensorflow.DistributedOptimizer(..., "
                               "adaptive=True)")
        return self._hs_adaptive.gradient_stats()

    @property
    def progress(self) -> float:
        """Scale-invariant steps (base-batch steps' worth of progress)."""
        if self._hs_adaptive is None:
            raise RuntimeError("optimizer.progress needs DistributedOptimizer(..., adaptive=True)")
        return self._hs_adaptive.progress

    def _get_current_learning_rate(self):
        base = super()._get_current_learning_rate()
        if self._hs_adaptive is None or self._hs_adaptive.rule is None:
            return base
        return base * tf.cast(self._hs_lr_factor, tf.as_dtype(getattr(base, "dtype", tf.float32)))

    def _hs_base_lr(self):
        return super()._get_current_learning_rate()

    def _hs_begin_adaptive(self) -> float:
        """In the exchange, before the pushes: the rule's factor this step."""
        ad = self._hs_adaptive
        if ad is None:
            return 1.0
        factor = ad.lr_factor()
        ad.last_factor = factor
        self._hs_sync.ctx.lr_factor = factor
        return factor

    def _hs_end_adaptive(self) -> None:
        ad = self._hs_adaptive
        if ad is None:
            return
        ad.step_done()
        self._hs_sync.ctx.stats.step_ended()

    def _hs_step_started(self) -> None:
        """The adaptive dataset was asked for a batch (the step clock: collect.StepRecorder)."""
        sync = getattr(self, "_hs_sync", None)  # None until the first apply plans the exchange
        if sync is not None and sync.ctx.stats is not None:
            sync.ctx.stats.step_started()

    @property
    def plan(self) -> Plan:
        if self._hs_plan is not None and self._hs_adaptive is not None:
            self._hs_plan.adaptive = self._hs_adaptive.summary()
        return self._hs_plan if self._hs_plan is not None else Plan([], framework="tensorflow", backend="mpi",
                                                                     world_size=runtime.world().size)

    # -- planning (at the first apply, when the gradients' kinds are known) ----------------------
    def _hs_plan_ahead(self, variables, kinds) -> None:
        """Collective: the plan before the first step (load_checkpoint right after compile()),
        with the gradients' kinds given (a checkpoint's plan records them); the variables the
        Keras optimizer applies get their slots now, so its state can be loaded. The first
        apply() checks the kinds and the variables."""
        self._hs_make_plan(kinds, variables)
        applied = [v for var, v in zip(self._hs_vars, variables)
                   if var in self._hs_auto or var.plan.route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE, Route.ALLGATHER)]
        if applied and not self.built:
            self.build(applied)  # (what the first apply would build it with: the same variables, in order)
        self._hs_unconfirmed = True

    def _hs_confirm_plan(self, grads, variables) -> None:
        """The first apply() after _hs_plan_ahead: its variables and gradient kinds are those planned."""
        planned = [var.access.variable for var in self._hs_vars]
        if [id(v) for v in variables] != [id(v) for v in planned]:
            raise ValueError(f"the optimizer's plan was made at load_checkpoint for the model's trainable variables "
                             f"({', '.join(var.name for var in self._hs_vars)}); apply() got "
                             f"{', '.join(variable_name(v) for v in variables)}")
        for g, var in zip(grads, self._hs_vars):
            if var.table is None and g is not None and _kind(g) is not var.plan.kind:
                raise ValueError(f"variable '{var.name}': its gradient is {_kind(g).value}, but the checkpoint's plan "
                                 f"(used by load_checkpoint before the first step) has it {var.plan.kind.value}")
        self._hs_unconfirmed = False

    def _hs_make_plan(self, kinds, variables):
        """Collective: the plan of `variables`, whose gradients are of `kinds` (GradKind; None
        where unknown, for a PS table's anchor)."""
        world = runtime.world()
        resolver = route_resolver(self._hs_config, lambda param: describe(self), has_model=False,
                                  world_size=world.size, compression=self._hs_compression,
                                  optimizer_name=type(self).__name__)
        described = []
        for kind, v in zip(kinds, variables):
            layer = getattr(v, "_hybridsync_table", None)  # a hybridsync.tensorflow.Embedding's anchor
            if layer is not None:
                described.append(Described(table_variable_name(v), (layer.table.num_rows, layer.table.dim), "float32",
                                           GradKind.SPARSE, table=layer.table))
            else:  # (Keras variables give a dtype string, tf.Variables a DType)
                described.append(Described(variable_name(v), tuple(v.shape), tf.as_dtype(v.dtype).name, kind, param=v))
        plan = make_plan(described, resolver, framework="tensorflow", backend="mpi", label="hybridsync.tensorflow",
                         backend_reason="TensorFlow: MPI via mpi4py (Horovod here is built for PyTorch only)")
        rows = plan.variables
        for vp in rows:
            if vp.auto and candidates_for(describe(self), vp.optimizer_source) == (estimate.PS,):
                # Nothing to choose, and a Keras optimizer applying no rows would still move
                # Adam's moments: the variable stays on the PS without being measured.
                vp.auto = None
                vp.reason = vp.reason.split("; auto:")[0] + f"; auto: only ps applies {type(self).__name__} exactly"
            if vp.route is Route.PS and vp.dtype != "float32":
                raise ValueError(
                    f"variable '{vp.name}' is {vp.dtype} (Keras mixed-precision policy "
                    f"'{keras.mixed_precision.global_policy().name}'): the parameter server holds float32 rows; use "
                    "policy 'mixed_float16' / 'mixed_bfloat16' (float32 variables) or route it with sync: allreduce")
        for vp in rows:  # (a Keras layer's table exists, and its graph holds it, before the plan)
            rule = self._hs_config.rule_for(vp.name) if self._hs_config is not None else None
            if rule is not None and rule.dynamic:
                raise config_mod.ConfigError(f"{rule.where}: dynamic: variable '{vp.name}': dynamic options apply to "
                                             "PyTorch DynamicEmbedding tables; pass a Keras DynamicEmbedding its "
                                             "options as arguments")
        backend = collectives.mpi()
        self._hs_plan = agree(plan, backend)
        self._hs_vars = []
        self._hs_auto = set()  # sync: auto variables keep one graph layout whatever their route
        applied = [v for vp, v in zip(self._hs_plan.variables, variables)
                   if vp.auto or vp.route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE, Route.ALLGATHER)]
        if any(vp.auto for vp in self._hs_plan.variables) and not self.built:
            self.build(applied)  # the slots an auto variable may hand its server state to must exist
        self._hs_slots = {}
        for i, (vp, v) in enumerate(zip(self._hs_plan.variables, variables)):
            layer = getattr(v, "_hybridsync_table", None)
            if vp.auto:
                self._hs_slots[i] = slots(self, v)
                access = AutoKerasAccess(v, vp.dtype, *_table_shape(vp.shape), slots=len(self._hs_slots[i]))
            else:
                access = KerasAccess(v, vp.dtype, *_table_shape(vp.shape))
            self._hs_vars.append(Variable(vp.name, vp, access, index=i, table=layer.table if layer else None))
            if vp.auto:
                self._hs_auto.add(self._hs_vars[-1])
        self._hs_sync = SyncSet(SyncContext(backend, self._hs_op, world.size, self._hs_predivide,
                                            loss_scale=float(self.loss_scale_factor or 1.0)))
        if self._hs_adaptive is not None:
            recorder = self._hs_sync.ctx.stats = StepRecorder(self._hs_adaptive, world.size, world.rank)
            recorder.loss_scale = float(self.loss_scale_factor or 1.0)
        for var in self._hs_vars:
            self._hs_sync.assign(var)
        with tf.init_scope():  # eager, also while tf.function traces: replicated tables start from rank 0
            self._hs_sync.prepare()
        self._hs_sync.mark_verified()
        planning.start_auto(self._hs_sync, _KerasAuto(self), resolver)
        planning.announce(self._hs_plan)

    # -- every step --------------------------------------------------------------------------------
    @property
    def hybridsync_frontend(self) -> "KerasFrontend":
        """What checkpoint, elastic and explain ask of this optimizer (hybridsync.frontend)."""
        return KerasFrontend(self)

    def _hs_adopt_auto(self, saved: dict) -> None:
        """Collective (load_checkpoint, once the plan exists): `sync: auto` takes the saved
        run's decisions."""
        if getattr(self, "_hs_sync", None) is not None:
            planning.adopt_auto(self._hs_sync, _KerasAuto(self), saved)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        if self._hs_plan is None:
            self._hs_make_plan([_kind(g) for g in grads], variables)
        elif self._hs_unconfirmed:
            self._hs_confirm_plan(grads, variables)
        grads, variables, apply_now = self._hs_synchronize(grads, variables)
        if apply_now is None:
            if not variables:
                self._iterations.assign_add(1)
                return None
            return super().apply(grads, variables)
        # Adaptive: an accumulation micro-step other than the step's last applies nothing.
        if variables and not self.built:
            self.build(variables)  # (not inside the condition: tf.function creates variables once)
        base_apply = super().apply

        def update():
            if variables:
                base_apply(grads, variables)
            else:
                self._iterations.assign_add(1)
            return tf.constant(True)

        tf.cond(apply_now, update, lambda: tf.constant(False))
        return None

    def _hs_synchronize(self, grads, variables):
        """Exchanges every gradient in one op running the sync core; returns what the Keras
        optimizer should still apply."""
        routes = [var.plan.route for var in self._hs_vars]
        if runtime.world().size == 1 and all(r is Route.ALLREDUCE for r in routes) and self._hs_adaptive is None:
            return grads, variables, None
        collectives.check_not_xla("gradient exchange")
        inputs, layout = [tf.cast(self._hs_base_lr(), tf.float64)], []
        for g, v, var in zip(grads, variables, self._hs_vars):
            if var in self._hs_auto:
                kind, parts = "sparse", self._hs_rows(g, v, var)
            elif var.plan.route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE):
                kind, parts = "dense", [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)]
            else:
                kind, parts = "sparse", self._hs_rows(g, v, var)
            layout.append((kind, len(inputs), len(parts)))
            inputs += parts
        out_types = [self._hs_output_types(var, var in self._hs_auto) for var in self._hs_vars]

        def exchange(lr, *arrays):
            per_variable = [(kind, arrays[at - 1:at - 1 + n]) for kind, at, n in layout]
            if self._hs_adaptive is not None:
                k = self._hs_adaptive.accumulation
                self._hs_sync.ctx.grad_scale = 1.0 / k  # the core turns the micro-steps' sum into their mean
                if k > 1:
                    self._hs_micro.add(per_variable)
                    if len(self._hs_micro) < k:
                        return [np.float32(self._hs_adaptive.last_factor), np.bool_(False), *self._hs_idle(out_types)]
                    per_variable = self._hs_accumulated(k)
            factor = self._hs_begin_adaptive()
            for var, (kind, parts) in zip(self._hs_vars, per_variable):
                var.access.begin(kind, parts, float(lr) * factor)
            self._hs_sync.synchronize()
            self._hs_end_adaptive()
            return [np.float32(factor), np.bool_(True)] + [a for var, types in zip(self._hs_vars, out_types)
                                                           for a in var.access.out[:len(types)]]

        results = tf.numpy_function(exchange, inputs,
                                    Tout=[tf.float32, tf.bool] + [t for types in out_types for t in types],
                                    stateful=True, name="hybridsync_exchange")
        factor, apply_now, results = results[0], results[1], iter(results[2:])
        apply_now.set_shape([])
        keep_g, keep_v, updates = [], [], [self._hs_lr_factor.assign(factor)]  # the Keras update's LR follows
        for i, (v, var) in enumerate(zip(variables, self._hs_vars)):
            route, placement = var.plan.route, var.plan.placement
            if var in self._hs_auto:
                changed, rows, ids, values = (next(results) for _ in range(4))
                updates.append(_variable(v).scatter_update(_rows(rows, changed, v)))
                for slot in self._hs_slots[i].values():
                    slot_ids, slot_values = next(results), next(results)
                    updates.append(_variable(slot).scatter_update(_rows(slot_values, slot_ids, v)))
                keep_g.append(_rows(values, ids, v, dense_shape=True))
                keep_v.append(v)
            elif route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE):
                reduced = next(results)
                reduced.set_shape(v.shape)
                keep_g.append(reduced)
                keep_v.append(v)
            elif route is Route.ALLGATHER:
                ids, values = next(results), next(results)
                ids.set_shape([None])
                values.set_shape([None] + list(v.shape[1:]))
                keep_g.append(tf.IndexedSlices(values, ids, tf.shape(v, out_type=tf.int64)))
                keep_v.append(v)
            elif placement is Placement.REPLICATED:
                changed, rows = next(results), next(results)
                target = v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v
                updates.append(target.scatter_update(tf.IndexedSlices(tf.reshape(rows, [-1] + list(v.shape[1:])),
                                                                      changed)))
        with tf.control_dependencies(updates):
            keep_g = [tf.identity(g) if not isinstance(g, tf.IndexedSlices) else
                      tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape) for g in keep_g]
        return keep_g, keep_v, (apply_now if self._hs_adaptive is not None else None)

    def _hs_accumulated(self, k: int) -> list:
        """The step's last micro-step: the held gradients' sum per variable. A world of one
        exchanges nothing, so the core cannot scale its all-reduced and all-gathered gradients:
        they get the mean here (its PS rows still get the sum: the server scales them; `sync:
        auto` plans the PS on one rank); its statistics come from the micro-steps."""
        summed = self._hs_micro.take()
        if runtime.world().size > 1:
            return summed
        self._hs_micro.observe(self._hs_adaptive, [var.name for var in self._hs_vars], self._hs_sync.ctx.loss_scale)
        out = []
        for var, (kind, parts) in zip(self._hs_vars, summed):
            if var.plan.route is not Route.PS:
                parts = (parts[0] / parts[0].dtype.type(k),) if kind == "dense" else \
                    (parts[0], parts[1] / parts[1].dtype.type(k))
            out.append((kind, parts))
        return out

    def _hs_idle(self, out_types) -> list:
        """The exchange's outputs on a micro-step that applies nothing: zeros of a dense
        variable's shape, no rows."""
        out = []
        for var, types in zip(self._hs_vars, out_types):
            dense = var.plan.route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE) and var not in self._hs_auto
            for t in types:
                if dense:
                    out.append(np.zeros(var.plan.shape, t.as_numpy_dtype))
                elif t == tf.int64:
                    out.append(np.zeros(0, np.int64))
                else:
                    out.append(np.zeros((0, var.access.dim), t.as_numpy_dtype))
        return out

    @staticmethod
    def _hs_rows(g, v, var):
        """A gradient as (ids, rows) tensors: IndexedSlices as they are, a dense one every row."""
        dim = var.access.dim
        if g is None:
            return [tf.zeros([0], tf.int64), tf.zeros([0] + list(v.shape[1:]), v.dtype)]
        if isinstance(g, tf.IndexedSlices):
            return [tf.cast(g.indices, tf.int64), g.values]
        return [tf.range(tf.shape(g, out_type=tf.int64)[0]), tf.reshape(g, [-1, dim])]

    def _hs_output_types(self, var, auto=False):
        route = var.plan.route
        dtype = tf.as_dtype(var.plan.dtype)
        if auto:  # (changed ids, rows), (gradient ids, values), (ids, values) per optimizer slot
            return [tf.int64, tf.float32, tf.int64, dtype] + [tf.int64, tf.float32] * var.access.slots
        if route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE):
            return [dtype]
        if route is Route.ALLGATHER:
            return [tf.int64, dtype]
        if var.plan.placement is Placement.REPLICATED:
            return [tf.int64, tf.float32]
        return []


def _variable(v):
    """The tf.Variable behind a Keras variable (scatter_update lives there)."""
    return v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v


def _rows(values, ids, v, dense_shape=False):
    """(ids, values) from the exchange as IndexedSlices of v's shape."""
    ids.set_shape([None])
    values = tf.reshape(values, [-1] + list(v.shape[1:]))
    return tf.IndexedSlices(values, ids, tf.shape(v, out_type=tf.int64) if dense_shape else None)


class KerasFrontend:
    """hybridsync.frontend.Frontend for a wrapped Keras optimizer."""

    framework = "tensorflow"

    def __init__(self, optimizer):
        self._optimizer = optimizer

    checkpointing = checkpointing

    def variables(self) -> list | None:
        return getattr(self._optimizer, "_hs_vars", None) if self._optimizer._hs_plan is not None else None

    def adopt_auto(self, saved: dict) -> None:
        self._optimizer._hs_adopt_auto(saved)


class _KerasAuto:
    """`sync: auto` in Keras (hybridsync.planning.switch.AutoFrontend). Tables here are replicated
    (the variable holds every row), so leaving the PS moves no rows; the server's slots reach the
    Keras optimizer's through the exchange's slot outputs (AutoKerasAccess). A table does not
    come back to the PS: Keras takes the model's choice, untried."""

    returns_to_ps = False
    moves_after_step = False  # (a move off the parameter server is exact at the synchronize)

    def __init__(self, optimizer):
        self.opt = optimizer

    def candidates(self, var):
        return candidates_for(describe(self.opt), var.plan.optimizer_source)

    def to_replica(self, var, rows) -> None:
        if rows is not None:
            raise NotImplementedError(f"variable '{var.name}': a sharded Keras table cannot leave the PS")

    def set_optimizer_state(self, var, slot_values: dict, step: int) -> None:
        names = list(self.opt._hs_slots[var.index])
        var.access.set_slots([slot_values[name] for name in names])

    def set_table(self, var, table) -> None:
        raise NotImplementedError(f"variable '{var.name}': a sharded Keras table is not re-sharded")


def DistributedOptimizer(optimizer, named_parameters=None, model=None, config=None, compression=None,
                         backward_passes_per_step=1, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                         backend=None, adaptive=None):
    """Wraps a Keras 3 optimizer (the same object is returned, now synchronizing gradients).

    config: YAML path or dict (or hybridsync.init(config=...) / HYBRIDSYNC_CONFIG), the same file
    as for PyTorch. compression: 'none' | 'fp16' for the dense all-reduce. op: Average or Sum;
    gradient_predivide_factor as in PyTorch. named_parameters, model and backward_passes_per_step
    are PyTorch's and must keep their defaults. adaptive: gradient statistics and LR scaling
    (hybridsync.adaptive; docs/adaptive.md), as in PyTorch.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer, got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if isinstance(optimizer, _DistributedKerasOptimizer):
        raise ValueError("this optimizer is already a hybridsync DistributedOptimizer")
    if named_parameters is not None or model is not None:
        raise ValueError("named_parameters and model are PyTorch arguments: a Keras optimizer knows its variables")
    if backward_passes_per_step != 1:
        raise ValueError("backward_passes_per_step is a PyTorch argument: Keras applies once per batch (for "
                         "accumulation of dense variables, use the Keras optimizer's gradient_accumulation_steps)")
    if backend not in (None, "mpi"):
        raise ValueError(f"the TensorFlow frontend all-reduces over MPI (backend='mpi'); got backend={backend!r}")
    op = check_options(op, gradient_predivide_factor, backward_passes_per_step)
    name = compression if isinstance(compression, str) or compression is None else getattr(compression, "name", None)
    name = {None: "none", "none": "none", "fp16": "fp16"}.get(name)
    if name is None:
        raise ValueError(f"compression must be 'none' or 'fp16' for the TensorFlow frontend, got {compression!r}")
    base = type(optimizer)
    optimizer.__class__ = type(base.__name__, (_DistributedKerasOptimizer, base), {"__module__": __name__})
    optimizer._hs_setup(config, op, name, gradient_predivide_factor, adaptive)
    return optimizer
