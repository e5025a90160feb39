"""hybridsync.tensorflow.DistributedOptimizer: a Keras 3 optimizer (SGD, Adam, Adagrad, ...)
whose apply() synchronizes gradients across ranks first, for model.fit and custom loops,
eagerly or inside tf.function.

The optimizer object keeps its identity and state: its class becomes a subclass of its own
class with apply() in front. Routes are planned at the first apply(), when the gradients' kinds
are known (tf.IndexedSlices from Embedding / tf.gather are sparse):

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

from .. import comm, plan as plan_mod, runtime
from .. import config as config_mod
from ..plan import Plan, VariablePlan
from ..routing import RouteResolver
from ..types import GradKind, Placement, ReduceOp, Route, as_reduce_op
from . import collectives
from .server_optimizer import applies_sparse, server_rule


def variable_name(v) -> str:
    """Keras 3 variables have a path ('dense/kernel'); tf.Variables a name ('dense/kernel:0')."""
    name = getattr(v, "path", None) or v.name
    return name[:-2] if name.endswith(":0") else name


class _DistributedKerasOptimizer:
    """Put in front of the wrapped optimizer's class. Attributes are prefixed `_hs_`."""

    def _hs_setup(self, config, op, compression):
        runtime.init()
        self._hs_config = config_mod.load(config if config is not None else runtime.default_config())
        self._hs_op = op
        self._hs_compression = compression
        self._hs_plan = None
        self._hs_tables = {}  # variable name -> PS table
        plan_mod.register(self)

    @property
    def plan(self) -> Plan:
        return self._hs_plan if self._hs_plan is not None else Plan([], framework="tensorflow", backend="mpi",
                                                                     world_size=runtime.world().size)

    # -- planning (at the first apply, when the gradients' kinds are known) ----------------------
    def _hs_make_plan(self, grads, variables):
        world = runtime.world()
        resolver = RouteResolver(self._hs_config, has_model=False, world_size=world.size,
                                 compression=self._hs_compression,
                                 server_rule=lambda name, param: server_rule(self, name),
                                 applies_sparse=applies_sparse(self), optimizer_name=type(self).__name__)
        rows = []
        for g, v in zip(grads, variables):
            layer = getattr(v, "_hybridsync_table", None)  # a hybridsync.tensorflow.Embedding's anchor
            if layer is not None:
                vp = VariablePlan(name=variable_name(v).rsplit("/", 1)[0] + "/embeddings",
                                  shape=(layer.input_dim, layer.output_dim), dtype="float32", kind=GradKind.SPARSE,
                                  route=None)
                resolver.decide(vp, None, ps_module=True)
                if not vp.reason.startswith(("rule", "config")):
                    vp.reason = "hybridsync.tensorflow PS embedding: rows live on the shards"
                rows.append(vp)
                continue
            kind = GradKind.SPARSE if isinstance(g, tf.IndexedSlices) else GradKind.DENSE
            dtype = tf.as_dtype(v.dtype)  # Keras variables give a string, tf.Variables a DType
            vp = VariablePlan(name=variable_name(v), shape=tuple(v.shape), dtype=dtype.name, kind=kind, route=None)
            resolver.decide(vp, v)
            if vp.route is Route.PS and dtype != tf.float32:
                raise ValueError(
                    f"variable '{vp.name}' is {dtype.name} (Keras mixed-precision policy "
                    f"'{keras.mixed_precision.global_policy().name}'): the parameter server holds float32 rows; use "
                    "policy 'mixed_float16' / 'mixed_bfloat16' (float32 variables) or route it with sync: allreduce")
            rows.append(vp)
        resolver.check_strict(rows)
        plan = Plan(rows, framework="tensorflow", backend="mpi", world_size=world.size,
                    backend_reason="TensorFlow: MPI via mpi4py (Horovod here is built for PyTorch only)")
        if world.size > 1:  # every rank must have the same variables and routes as rank 0
            mine = [(r.name, r.shape, r.route.value, r.placement.value) for r in rows]
            everyone = runtime.allgather_object(mine)
            for rank, theirs in enumerate(everyone):
                if theirs != everyone[0]:
                    diff = next((i for i, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b), len(theirs))
                    raise RuntimeError(f"rank {rank} differs from rank 0 at variable #{diff} "
                                       f"({everyone[0][diff] if diff < len(everyone[0]) else '-'} vs "
                                       f"{theirs[diff] if diff < len(theirs) else '-'}): every rank must build the same model")
        self._hs_plan = plan
        self._hs_register_tables(variables)
        plan_mod.announce(plan)

    def _hs_register_tables(self, variables):
        from .. import ps

        for vp, v in zip(self._hs_plan.variables, variables):
            if vp.route is not Route.PS:
                continue
            layer = getattr(v, "_hybridsync_table", None)
            if layer is not None:  # rows already on the shards: name the table, set its rule
                layer._engine.rename_table(layer.table, vp.name)
                layer._engine.set_rule(layer.table, vp.optimizer["name"],
                                       {k: float(x) for k, x in vp.optimizer.items() if k != "name"})
                self._hs_tables[vp.name] = (layer._engine, layer.table, layer.output_dim)
                continue
            engine = ps.engine()
            rows = int(v.shape[0])
            dim = int(np.prod(v.shape[1:])) if len(v.shape) > 1 else 1
            hparams = {k: float(x) for k, x in vp.optimizer.items() if k != "name"}
            table = engine.add_table(vp.name, rows, dim, vp.shards, vp.partition, vp.optimizer["name"], hparams)
            with tf.init_scope():  # eager, also while tf.function traces: rank 0's rows everywhere
                value = collectives.mpi().broadcast_object(v.numpy() if runtime.world().rank == 0 else None, 0)
                v.assign(value)
                engine.load_from_root(table, value.reshape(rows, dim) if runtime.world().rank == 0 else None, 0)
            self._hs_tables[vp.name] = (engine, table, dim)

    # -- every step --------------------------------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        if self._hs_plan is None:
            self._hs_make_plan(grads, variables)
        grads, variables = self._hs_synchronize(grads, variables)
        if not variables:
            self._iterations.assign_add(1)
            return None
        return super().apply(grads, variables)

    def _hs_synchronize(self, grads, variables):
        """Exchanges every gradient; returns what the Keras optimizer should still apply."""
        world = runtime.world()
        routes = self._hs_plan.variables
        scale = 1.0 / world.size if self._hs_op is ReduceOp.AVERAGE else 1.0
        if self.loss_scale_factor:
            scale /= self.loss_scale_factor  # Keras unscales what it applies; the server must too
        # 1. PS: sharded tables push (applied before the next pull); replicated ones push and
        # write back the changed rows (replicas stay identical). First on every rank.
        updates = []
        sharded = [(g, vp) for g, vp in zip(grads, routes)
                   if vp.route is Route.PS and vp.placement is Placement.SHARDED]
        if sharded:
            engine = self._hs_tables[sharded[0][1].name][0]
            tables = [self._hs_tables[vp.name][1] for _, vp in sharded]
            ids = [tf.zeros([0], tf.int64) if g is None else g.indices for g, _ in sharded]
            vals = [tf.zeros([0, self._hs_tables[vp.name][2]]) if g is None else g.values for g, vp in sharded]
            lrs = [self.learning_rate if vp.optimizer_source == "wrapped" else vp.optimizer["lr"] for _, vp in sharded]
            def record_sharded(j, nbytes, routes=[vp for _, vp in sharded]):
                routes[j].bytes_per_step = nbytes

            updates.append(collectives.ps_push_deferred(engine, tables, ids, vals, scale, lrs, on_bytes=record_sharded))
        ps_items = [(g, v, vp) for g, v, vp in zip(grads, variables, routes)
                    if vp.route is Route.PS and vp.placement is Placement.REPLICATED]
        if ps_items:
            engine = self._hs_tables[ps_items[0][2].name][0]
            tables, ids, vals, lrs = [], [], [], []
            for g, v, vp in ps_items:
                _, table, dim = self._hs_tables[vp.name]
                tables.append(table)
                if g is None:
                    i, x = tf.zeros([0], tf.int64), tf.zeros([0, dim], tf.float32)
                elif isinstance(g, tf.IndexedSlices):
                    i, x = g.indices, tf.reshape(g.values, [-1, dim])
                else:  # a dense variable on the PS: every row
                    i, x = tf.range(tf.shape(g)[0], dtype=tf.int64), tf.reshape(g, [-1, dim])
                ids.append(i)
                vals.append(x)
                lrs.append(self.learning_rate if vp.optimizer_source == "wrapped" else vp.optimizer["lr"])
            def record(j, nbytes, routes=[vp for _, _, vp in ps_items]):
                routes[j].bytes_per_step = nbytes

            with tf.control_dependencies(updates):
                pushed = collectives.ps_push(engine, tables, ids, vals, scale, lrs, on_bytes=record)
            for (g, v, vp), (changed, rows) in zip(ps_items, pushed):
                target = v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v
                updates.append(target.scatter_update(tf.IndexedSlices(tf.reshape(rows, [-1] + list(v.shape[1:])), changed)))
        # 2. Dense all-reduce (and sparse as dense), one fused collective, after the push.
        keep_g, keep_v = [], []
        dense = [(i, g, v, vp) for i, (g, v, vp) in enumerate(zip(grads, variables, routes))
                 if vp.route in (Route.ALLREDUCE, Route.SPARSE_AS_DENSE)]
        with tf.control_dependencies(updates):
            tensors = [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g) for _, g, v, _ in dense]
            tensors = [tf.cast(t, tf.float16) if vp.compression == "fp16" and t.dtype.is_floating else t
                       for t, (_, _, _, vp) in zip(tensors, dense)]
            reduced = collectives.allreduce(tensors, self._hs_op, verified_layout=True) if world.size > 1 else tensors
        for (_, g, v, vp), r in zip(dense, reduced):
            keep_g.append(tf.cast(r, v.dtype))
            keep_v.append(v)
            vp.bytes_per_step = int(r.shape.num_elements() or 0) * r.dtype.size if world.size > 1 else 0
        # 3. Allgather: every rank's rows, applied by the Keras optimizer (Horovod's way).
        for g, v, vp in zip(grads, variables, routes):
            if vp.route is not Route.ALLGATHER:
                continue
            if g is None:
                g = tf.IndexedSlices(tf.zeros([0] + list(v.shape[1:]), v.dtype), tf.zeros([0], tf.int64), v.shape)
            with tf.control_dependencies(reduced + updates):
                indices = collectives.allgather(tf.cast(g.indices, tf.int64))
                values = collectives.allgather(g.values)
            if self._hs_op is ReduceOp.AVERAGE:
                values = values / world.size
            keep_g.append(tf.IndexedSlices(values, indices, tf.shape(v, out_type=tf.int64)))
            keep_v.append(v)
        return keep_g, keep_v


def DistributedOptimizer(optimizer, named_parameters=None, model=None, config=None, compression=None,
                         backward_passes_per_step=1, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                         backend=None):
    """Wraps a Keras 3 optimizer (the same object is returned, now synchronizing gradients).

    config: YAML path or dict (or hybridsync.init(config=...) / HYBRIDSYNC_CONFIG), the same file
    as for PyTorch. compression: 'none' | 'fp16' for the dense all-reduce. op: Average or Sum.
    Arguments that only the PyTorch frontend has must keep their defaults.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer, got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if isinstance(optimizer, _DistributedKerasOptimizer):
        raise ValueError("this optimizer is already a hybridsync DistributedOptimizer")
    if named_parameters is not None or model is not None:
        raise ValueError("named_parameters and model are PyTorch arguments: a Keras optimizer knows its variables")
    if backward_passes_per_step != 1 or gradient_predivide_factor != 1.0:
        raise ValueError("backward_passes_per_step and gradient_predivide_factor are PyTorch arguments "
                         "(for accumulation, use the Keras optimizer's gradient_accumulation_steps)")
    if backend not in (None, "mpi"):
        raise ValueError(f"the TensorFlow frontend all-reduces over MPI (backend='mpi'); got backend={backend!r}")
    op = as_reduce_op(op)
    name = compression if isinstance(compression, str) or compression is None else getattr(compression, "name", None)
    name = {None: "none", "none": "none", "fp16": "fp16"}.get(name)
    if name is None:
        raise ValueError(f"compression must be 'none' or 'fp16' for the TensorFlow frontend, got {compression!r}")
    base = type(optimizer)
    optimizer.__class__ = type(base.__name__, (_DistributedKerasOptimizer, base), {"__module__": __name__})
    optimizer._hs_setup(config, op, name)
    return optimizer
