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

Horovod's options live here too (optimizer_api.Settings): local variables keep their own
gradient (scaled), held with the rest when apply() accumulates micro-steps (Horovod's
backward_passes_per_step, or the adaptive batch's) inside the exchange; a process set's members
exchange over its communicator, and a rank outside it exchanges nothing.
"""
from __future__ import annotations

import re

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
from ..sync.process_set_scope import check_routes
from ..sync.registry import SyncSet
from ..types import GradKind, Placement, ReduceOp, Route
from . import adaptive, collectives, keras_embeddings
from .access import AutoKerasAccess, KerasAccess
from .micro_steps import MicroSteps
from .names import table_variable_name, variable_name
from .optimizer_methods import HorovodMethods
from .server_optimizer import describe, slots
from . import checkpointing


def _kind(grad) -> GradKind:
    return GradKind.SPARSE if isinstance(grad, tf.IndexedSlices) else GradKind.DENSE


def _table_shape(shape) -> tuple[int, int]:
    rows = int(shape[0]) if len(shape) else 1
    return rows, int(np.prod(shape[1:])) if len(shape) > 1 else 1


class _DistributedKerasOptimizer(HorovodMethods):
    """Put in front of the wrapped optimizer's class. Attributes are prefixed `_hs_`."""

    def _hs_setup(self, settings):
        """settings: hybridsync.tensorflow.optimizer_api.Settings (Horovod's arguments and
        hybridsync's, checked)."""
        runtime.init()
        cfg = AdaptiveConfig.of(settings.adaptive)
        self._hs_settings = settings
        self._hs_adaptive = Adaptive(cfg, type(self).__name__, runtime.world().size) if cfg else None
        if cfg:
            adaptive.track(self)
        self._hs_lr_factor = tf.Variable(1.0, trainable=False, dtype=tf.float32, name="hybridsync_lr_factor")
        self._hs_passes = settings.backward_passes_per_step
        # Accumulation micro-steps (adaptive, or Horovod's backward_passes_per_step) wait here.
        self._hs_micro = MicroSteps() if cfg or self._hs_passes > 1 else None
        self._hs_predivide = settings.gradient_predivide_factor
        self._hs_config = settings.config
        self._hs_op = settings.op
        self._hs_compression = settings.compression
        self._hs_scope = settings.scope  # None: every rank; a SetScope; False: outside the process set
        self._hs_local = {}  # ref -> variable: registered local variables (register_local_var)
        self._hs_reduced = None  # gradients _compute_gradients returned reduced (apply() takes them as they are)
        self._hs_plan = None
        self._hs_unconfirmed = False  # a plan made before the first step, not yet checked by it
        self._hs_model = settings.model
        planning.register(self)
        if settings.model is not None:  # (a model built later gets its tables moved when the optimizer builds)
            self._hs_move_embeddings(keras_embeddings.plain_embeddings(settings.model))

    def _hs_backend(self):
        """The dense collectives of this optimizer's ranks (a process set's, or the job's)."""
        return self._hs_scope.engine if self._hs_scope else collectives.mpi()

    def _hs_size(self) -> int:
        """Ranks that average a gradient (the process set's; 1 outside it: nothing to average)."""
        if self._hs_scope is False:
            return 1
        return self._hs_scope.size if self._hs_scope else runtime.world().size

    def _hs_accumulation(self) -> int:
        """Micro-steps per applied step: the adaptive batch's, or backward_passes_per_step."""
        return self._hs_adaptive.accumulation if self._hs_adaptive is not None else self._hs_passes

    def _hs_sum_scale(self, k: int) -> float:
        """What the micro-steps' summed gradient is multiplied by: their mean (adaptive, and
        Horovod's average_aggregated_gradients=True), else their sum as it is."""
        return 1.0 / k if self._hs_adaptive is not None or self._hs_settings.average_aggregated_gradients else 1.0

    def _hs_local_scale(self) -> float:
        """A local variable's gradient factor: 1/size with Horovod's scale_local_gradients."""
        return 1.0 / self._hs_size() if self._hs_settings.scale_local_gradients and self._hs_scope is not False else 1.0

    def _hs_is_local(self, v) -> bool:
        return self._hs_scope is False or _ref(v) in self._hs_local

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
        self._hs_sync.ctx.table_lr_factors = ad.table_lr_factors()
        return factor

    def _hs_end_adaptive(self) -> None:
        ad = self._hs_adaptive
        if ad is None:
            return
        ad.step_done()
        self._hs_sync.ctx.stats.step_ended()

    # -- Adagrad's accumulators across batch changes (hybridsync.adaptive.accumulators) --------------
    def _hs_check_accumulators(self) -> None:
        """With the plan: whether there is accumulating state anywhere (this is a Keras Adagrad,
        or a PS table's server rule is 'adagrad'); forced on with none raises."""
        if self._hs_adaptive is not None:
            found = isinstance(self, keras.optimizers.Adagrad) or any(
                (vp.optimizer or {}).get("name") == "adagrad" for vp in self._hs_plan.variables)
            self._hs_adaptive.accumulators.require_state(found, type(self).__name__)

    def _hs_rescale_accumulators(self) -> float:
        """In the exchange, at the start of the step a batch change takes effect: every PS table's
        Adagrad sums rescaled now (one collective, before this step's push); the factor for the
        dense accumulators, which the graph rescales before the Keras update (1: none)."""
        ad = self._hs_adaptive
        factor = ad.accumulators.take(ad.steps) if ad is not None else None
        if factor is None:
            return 1.0
        if self._hs_sync is not None:
            self._hs_sync.rescale_accumulators(factor)
        return factor

    def _hs_rescale_dense(self, factor, variables) -> list:
        """Ops rescaling this Keras Adagrad's accumulators by `factor` (a scalar tensor) where it
        is not 1, before the update that reads them: what was accumulated above the initial value,
        as the PS shards do (their float32 arithmetic, so a replica and a shard agree)."""
        if self._hs_adaptive is None or not self._hs_adaptive.accumulators.enabled or \
                not isinstance(self, keras.optimizers.Adagrad):
            return []
        if variables and not self.built:
            self.build(variables)  # (the accumulators the update will use, made where apply() would)
        accumulators = list(getattr(self, "_accumulators", []))
        base = float(self.initial_accumulator_value)

        def rescale():
            for acc in accumulators:
                value = tf.convert_to_tensor(acc)
                scaled = value * tf.cast(factor, value.dtype) if base == 0.0 else \
                    (value - tf.cast(base, value.dtype)) * tf.cast(factor, value.dtype) + tf.cast(base, value.dtype)
                acc.assign(tf.where(tf.equal(value, tf.cast(base, value.dtype)), value, scaled))
            return tf.constant(True)

        return [tf.cond(tf.not_equal(factor, 1.0), rescale, lambda: tf.constant(False))] if accumulators else []

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

    # -- plain Keras embeddings onto the PS shards (hybridsync.tensorflow.keras_embeddings) ---------
    def build(self, variables):
        """Keras's build (fit calls it with the model's trainable variables before tracing the
        step): plain Keras Embeddings among `variables`, or in the model= given, move to the
        shards first, and their anchors take their variables' places."""
        variables = list(variables)
        if self._hs_plan is None and not self.built and tf.executing_eagerly():
            layers = keras_embeddings.plain_embeddings(self._hs_model) if self._hs_model is not None else []
            for v in variables:
                layer = keras_embeddings.layer_of(v)
                if layer is not None and layer not in layers:
                    layers.append(layer)
            moved = self._hs_move_embeddings(layers)
            variables = [moved.get(id(v), v) for v in variables]
        return super().build(variables)

    def _hs_adopt_model(self, model) -> None:
        """Collective: `model` is the one this optimizer trains (Horovod's
        BroadcastGlobalVariablesCallback hands it over at train begin, before Keras traces the
        step): its plain Keras Embeddings move to the shards, as with model=."""
        if self._hs_model is None:
            self._hs_model = model
        if self._hs_plan is None and not self.built:
            self._hs_move_embeddings(keras_embeddings.plain_embeddings(model))

    def _hs_move_embeddings(self, layers) -> dict:
        """Collective: keras_embeddings.move_layers with this optimizer's config and server rule
        (a process set's tables stay replicated). Returns {id(old variable): its anchor}."""
        if self._hs_scope is not None or not layers:
            return {}
        resolver = route_resolver(self._hs_config, lambda param: describe(self), has_model=True,
                                  world_size=self._hs_size(), compression=self._hs_compression,
                                  optimizer_name=type(self).__name__)
        return keras_embeddings.move_layers(layers, resolver, optimizer_built=self.built)

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
        if self._hs_scope is False:  # outside the process set: nothing is exchanged
            self._hs_plan, self._hs_vars, self._hs_auto, self._hs_sync = (
                Plan([], framework="tensorflow", backend="mpi", world_size=world.size), [], set(), None)
            return
        size = self._hs_size()
        resolver = route_resolver(self._hs_config, lambda param: describe(self), has_model=False,
                                  world_size=size, compression=self._hs_compression,
                                  optimizer_name=type(self).__name__)
        described = []
        for kind, v in zip(kinds, variables):
            layer = getattr(v, "_hybridsync_table", None)  # a hybridsync.tensorflow.Embedding's anchor
            if layer is not None:
                moved = isinstance(layer, keras_embeddings.ShardedKerasEmbedding)
                described.append(Described(table_variable_name(v), (layer.table.num_rows, layer.table.dim), "float32",
                                           GradKind.SPARSE, table=layer.table,
                                           note="keras.layers.Embedding moved to the shards" if moved else ""))
            else:  # (Keras variables give a dtype string, tf.Variables a DType)
                described.append(Described(variable_name(v), tuple(v.shape), tf.as_dtype(v.dtype).name, kind, param=v))
        plan = make_plan(described, resolver, framework="tensorflow", backend="mpi", label="hybridsync.tensorflow",
                         backend_reason="TensorFlow: MPI via mpi4py (Horovod here is built for PyTorch only)")
        rows = plan.variables
        for vp, v in zip(rows, variables):
            layer = keras_embeddings.layer_of(v)  # a plain Keras Embedding the optimizer did not see in time
            if layer is not None and vp.route is Route.PS and not self._hs_scope \
                    and not keras_embeddings.config_keeps(resolver, vp):
                keras_embeddings.warn_kept(layer, keras_embeddings.why_not_movable(layer) or (
                    "hybridsync first saw it inside the traced step; build the model (call it on a batch) before "
                    "training and give DistributedOptimizer model=model, or in model.fit pass "
                    "hvd.callbacks.BroadcastGlobalVariablesCallback(0)"))
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
                    "policy 'mixed_float16' / 'mixed_bfloat16' (float32 variables; to store the rows in 16 bits give "
                    "the table storage: {dtype: float16} or bfloat16) or route it with sync: allreduce")
        for vp, d in zip(rows, described):  # (a Keras layer's table exists, and its graph holds it, before the plan)
            rule = self._hs_config.rule_for(vp.name) if self._hs_config is not None else None
            if rule is not None and rule.dynamic:
                raise config_mod.ConfigError(f"{rule.where}: dynamic: variable '{vp.name}': dynamic options apply to "
                                             "PyTorch DynamicEmbedding tables; pass a Keras DynamicEmbedding its "
                                             "options as arguments")
            # (compared with the layer's table: the plan says what the config asks for)
            storage, where = self._hs_config.storage_for(vp.name) if self._hs_config is not None else (None, "")
            if d.table is not None and storage is not None and storage != d.table.storage:
                raise config_mod.ConfigError(f"{where}: storage: variable '{vp.name}': a Keras PS layer's table "
                                             "exists before the plan; pass the layer storage= as an argument")
        if self._hs_scope:
            plan.backend_reason = self._hs_scope.reason()
            check_routes(rows, self._hs_scope)
        backend = self._hs_backend()
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
        self._hs_sync = SyncSet(SyncContext(backend, self._hs_op, size, self._hs_predivide,
                                            loss_scale=float(self.loss_scale_factor or 1.0)))
        if self._hs_adaptive is not None:
            recorder = self._hs_sync.ctx.stats = StepRecorder(self._hs_adaptive, world.size, world.rank)
            recorder.loss_scale = float(self.loss_scale_factor or 1.0)
        for var in self._hs_vars:
            self._hs_sync.assign(var)
        with tf.init_scope():  # eager, also while tf.function traces: replicated tables start from rank 0
            self._hs_sync.prepare()
        self._hs_sync.mark_verified()
        self._hs_check_accumulators()
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
        if self._hs_take_reduced(grads):  # _compute_gradients() reduced them already
            return super().apply(grads, variables)
        shared = [i for i, v in enumerate(variables) if not self._hs_is_local(v)]
        local = [i for i, v in enumerate(variables) if self._hs_is_local(v)]
        if self._hs_plan is None:
            self._hs_make_plan([_kind(grads[i]) for i in shared], [variables[i] for i in shared])
        elif self._hs_unconfirmed:
            self._hs_confirm_plan([grads[i] for i in shared], [variables[i] for i in shared])
        elif len(shared) != len(self._hs_vars):
            raise ValueError(f"{type(self).__name__}.apply() got {len(shared)} variables to synchronize, its plan has "
                             f"{len(self._hs_vars)}: pass the same variables every step, and register local "
                             "variables (register_local_var) before the first one")
        grads, variables, apply_now = self._hs_synchronize(grads, variables, shared, local)
        if apply_now is None:
            if not variables:
                self._iterations.assign_add(1)
                return None
            return super().apply(grads, variables)
        # Accumulation: a micro-step other than the step's last applies nothing.
        if variables and not self.built:
            self.build(variables)  # (not inside the condition: tf.function creates variables once)
        base_apply = super().apply

        def update():
            if variables:
                base_apply(grads, variables)
            else:
                self._iterations.assign_add(1)
            return tf.constant(True)

        def hold():
            if self._hs_adaptive is None:  # Horovod's backward_passes_per_step counts every pass
                self._iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(apply_now, update, hold)
        return None

    def _hs_synchronize(self, grads, variables, shared, local):
        """Exchanges every gradient of the `shared` variables in one op running the sync core
        (and holds accumulation micro-steps, local variables' too); returns what the Keras
        optimizer should still apply, and whether it applies at all this call (None: always)."""
        sg, sv = [grads[i] for i in shared], [variables[i] for i in shared]
        lg, lv = [grads[i] for i in local], [variables[i] for i in local]
        routes = [var.plan.route for var in self._hs_vars]
        if self._hs_micro is None and (self._hs_sync is None or (
                self._hs_size() == 1 and all(r is Route.ALLREDUCE for r in routes))):
            scale, local_at = self._hs_local_scale(), set(local)
            return [_scaled(g, scale) if i in local_at else g for i, g in enumerate(grads)], variables, None
        collectives.check_not_xla("gradient exchange")
        inputs, layout = [tf.cast(self._hs_base_lr(), tf.float64)], []
        for g, v, var in zip(sg, sv, self._hs_vars):
            if var in self._hs_auto:
                kind, parts = "sparse", self._hs_rows(g, v, var)
            elif var.plan.route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE):
                kind, parts = "dense", [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)]
            else:
                kind, parts = "sparse", self._hs_rows(g, v, var)
            layout.append((kind, len(inputs), len(parts)))
            inputs += parts
        held = self._hs_micro is not None  # local variables' micro-steps are held with the rest
        local_layout = []
        for g, v in zip(lg if held else [], lv):
            if isinstance(g, tf.IndexedSlices):
                kind, parts = "sparse", [tf.cast(g.indices, tf.int64), g.values]
            else:
                kind, parts = "dense", [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)]
            local_layout.append((kind, len(inputs), len(parts), tf.as_dtype(v.dtype), tuple(v.shape)))
            inputs += parts
        out_types = [self._hs_output_types(var, var in self._hs_auto) for var in self._hs_vars]
        local_types = [[dtype] if kind == "dense" else [tf.int64, dtype] for kind, _, _, dtype, _ in local_layout]

        def exchange(lr, *arrays):
            per_variable = [(kind, arrays[at - 1:at - 1 + n]) for kind, at, n, *_ in layout + local_layout]
            k = self._hs_accumulation() if held else 1
            if self._hs_sync is not None:
                self._hs_sync.ctx.grad_scale = self._hs_sum_scale(k)  # the core scales the micro-steps' sum
            if k > 1:
                self._hs_micro.add(per_variable)
                if len(self._hs_micro) < k:
                    factor = self._hs_adaptive.last_factor if self._hs_adaptive is not None else 1.0
                    return [np.float32(factor), np.bool_(False), np.float32(1.0),
                            *self._hs_idle(out_types, local_layout)]
                per_variable = self._hs_accumulated(k)
            rescale = self._hs_rescale_accumulators()  # a batch change takes effect: before the pushes
            factor = self._hs_begin_adaptive()
            if self._hs_sync is not None:
                for var, (kind, parts) in zip(self._hs_vars, per_variable):
                    var.access.begin(kind, parts, float(lr) * factor)
                self._hs_sync.synchronize()
            self._hs_end_adaptive()
            scale = self._hs_local_scale() * (self._hs_sum_scale(k) if k > 1 else 1.0)
            local_out = []
            for kind, parts in per_variable[len(layout):]:
                values = parts[-1] * parts[-1].dtype.type(scale) if scale != 1.0 else parts[-1]
                local_out += [values] if kind == "dense" else [np.asarray(parts[0], np.int64), values]
            return [np.float32(factor), np.bool_(True), np.float32(rescale)] + [
                a for var, types in zip(self._hs_vars, out_types)
                                                           for a in var.access.out[:len(types)]] + local_out

        results = tf.numpy_function(exchange, inputs,
                                    Tout=[tf.float32, tf.bool, tf.float32] + [t for types in out_types + local_types
                                                                              for t in types],
                                    stateful=True, name=_op_name(self._hs_settings.name))
        factor, apply_now, rescale, results = results[0], results[1], results[2], iter(results[3:])
        apply_now.set_shape([])
        rescale.set_shape([])
        kept, updates = {}, [self._hs_lr_factor.assign(factor)]  # position -> gradient the Keras optimizer applies
        for i, (at, v, var) in enumerate(zip(shared, sv, self._hs_vars)):
            route, placement = var.plan.route, var.plan.placement
            if var in self._hs_auto:
                changed, rows, ids, values = (next(results) for _ in range(4))
                updates.append(_variable(v).scatter_update(_rows(rows, changed, v)))
                for slot in self._hs_slots[i].values():
                    slot_ids, slot_values = next(results), next(results)
                    updates.append(_variable(slot).scatter_update(_rows(slot_values, slot_ids, v)))
                kept[at] = _rows(values, ids, v, dense_shape=True)
            elif route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE):
                reduced = next(results)
                reduced.set_shape(v.shape)
                kept[at] = reduced
            elif route is Route.ALLGATHER:
                ids, values = next(results), next(results)
                ids.set_shape([None])
                values.set_shape([None] + list(v.shape[1:]))
                kept[at] = tf.IndexedSlices(values, ids, tf.shape(v, out_type=tf.int64))
            elif placement is Placement.REPLICATED:
                changed, rows = next(results), next(results)
                target = v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v
                updates.append(target.scatter_update(tf.IndexedSlices(tf.reshape(rows, [-1] + list(v.shape[1:])),
                                                                      changed)))
        for (kind, *_), at, v in zip(local_layout, local, lv):
            if kind == "dense":
                kept[at] = next(results)
                kept[at].set_shape(v.shape)
            else:
                kept[at] = _rows(next(results), next(results), v, dense_shape=True, ids_first=True)
        if not held:  # local variables that took no part in the exchange
            kept.update((at, _scaled(g, self._hs_local_scale())) for at, g in zip(local, lg))
        updates += self._hs_rescale_dense(rescale, [variables[at] for at in sorted(kept)])
        with tf.control_dependencies(updates):
            keep_g = [g if g is None else tf.identity(g) if not isinstance(g, tf.IndexedSlices) else
                      tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape) for _, g in sorted(kept.items())]
        # In the order given: Keras builds (and saves) the optimizer's slots in this order.
        return keep_g, [variables[at] for at in sorted(kept)], (apply_now if held else None)

    def _hs_accumulated(self, k: int) -> list:
        """The step's last micro-step: the held gradients' sum per variable (the shared ones
        first, then the local ones). A world of one exchanges nothing, so the core cannot scale
        its all-reduced and all-gathered gradients: they get the sum's scale here (its PS rows are
        scaled by the server; `sync: auto` plans the PS on one rank); the adaptive statistics come
        from the micro-steps."""
        summed = self._hs_micro.take()
        if self._hs_size() > 1 or self._hs_sync is None:
            return summed
        if self._hs_adaptive is not None:
            self._hs_micro.observe(self._hs_adaptive, [var.name for var in self._hs_vars],
                                   self._hs_sync.ctx.loss_scale)
        scale = self._hs_sum_scale(k)
        out = []
        for i, (kind, parts) in enumerate(summed):
            if i < len(self._hs_vars) and self._hs_vars[i].plan.route is not Route.PS and scale != 1.0:
                parts = (parts[0] * parts[0].dtype.type(scale),) if kind == "dense" else \
                    (parts[0], parts[1] * parts[1].dtype.type(scale))
            out.append((kind, parts))
        return out

    def _hs_idle(self, out_types, local_layout) -> list:
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
        for kind, _, _, dtype, shape in local_layout:
            if kind == "dense":
                out.append(np.zeros(shape, dtype.as_numpy_dtype))
            else:
                out += [np.zeros(0, np.int64), np.zeros((0,) + shape[1:], dtype.as_numpy_dtype)]
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


def _rows(values, ids, v, dense_shape=False, ids_first=False):
    """(ids, values) from the exchange as IndexedSlices of v's shape."""
    if ids_first:
        ids, values = values, ids
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


def _op_name(name) -> str:
    """The exchange op's name: Horovod's `name` (made a valid op name), or hybridsync's."""
    name = re.sub("[^a-zA-Z0-9_]", "_", name or "hybridsync_exchange")
    return name if name[:1].isalpha() else f"hs_{name}"


def _scaled(grad, factor: float):
    """A gradient (dense, IndexedSlices or None) times factor."""
    if grad is None or factor == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, tf.as_dtype(grad.dtype))


def _ref(v):
    """A hashable reference to the tf.Variable behind a (Keras) variable."""
    return _variable(v).ref()


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
