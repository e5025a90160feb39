"""hybridsync.tensorflow.DynamicEmbedding: a Keras 3 layer over raw int64 ids whose rows live
in a dynamic table on the parameter server (see docs/dynamic-tables.md). Like
hybridsync.tensorflow.Embedding, its only TF variable is an anchor whose gradient is the
batch's (ids, gradient rows), which the DistributedOptimizer pushes to the shards."""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from ..ps import dynamic_options as dyn
from ..ps.dynamic import DynamicTable
from ..ps.storage import has_disk_tier
from ..ps.table import shared_seed

MODES = (None, "sum", "mean")


@keras.saving.register_keras_serializable(package="hybridsync")
class DynamicEmbedding(keras.layers.Layer):
    """The Keras twin of hybridsync.torch.DynamicEmbedding, with the same arguments. mode 'sum' /
    'mean' reduce over the last axis of 2-D ids (one bag per row)."""

    def __init__(self, embedding_dim, *, capacity=None, admit_after=1, evict=None, ttl_steps=None,
                 initializer=("normal", 0.0, 1.0), mode=None, partitions=None, seed=None, storage=None, **kwargs):
        super().__init__(**kwargs)
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"dynamic table '{self.name}': embedding_dim must be an integer >= 1, got {embedding_dim!r}")
        if mode not in MODES:
            raise ValueError(f"dynamic table '{self.name}': mode must be None, 'sum' or 'mean', got {mode!r}")
        args = (capacity, admit_after, evict, ttl_steps, initializer)
        disk_tier = has_disk_tier(storage)
        dyn.options(self.name, *args, disk_tier=disk_tier)  # bad arguments raise here, before any collective
        seed = shared_seed(np.random.randint(0, 2**62)) if seed is None else int(seed)
        self.output_dim, self.mode, self.seed, self._args = embedding_dim, mode, seed, args
        self.partitions = partitions
        self.input_dim = capacity or 0  # (what the plan shows: the table's bound, 0 = unbounded)
        self.table = DynamicTable(self.name, embedding_dim, dyn.options(self.name, *args, seed=seed, disk_tier=disk_tier),
                                  partitions or 0, storage=storage)

    def build(self, input_shape=None):
        self.ps_anchor = self.add_weight(shape=(1,), initializer="zeros", trainable=True, name="ps_anchor")
        self.ps_anchor._hybridsync_table = self  # the optimizer routes this variable's gradient to the PS

    def _error(self, ids) -> str:
        """This rank's bad input, raised on every rank inside the pull."""
        if not ids.dtype.is_integer:
            return f"dynamic table '{self.name}': ids must be integers (int64, or uint64 hashes), got {ids.dtype.name}"
        if self.mode is not None and ids.shape.rank != 2:
            return (f"dynamic table '{self.name}': mode {self.mode!r} takes 2-D ids (one bag per row), got ids of "
                    f"shape {tuple(ids.shape)}")
        return ""

    def call(self, ids):
        ids = tf.convert_to_tensor(ids)
        error = self._error(ids)
        if error:
            ids = tf.zeros([0], tf.int64)
        elif ids.dtype != tf.int64:
            ids = tf.bitcast(ids, tf.int64) if ids.dtype == tf.uint64 else tf.cast(ids, tf.int64)
        table, dim, bound = self.table, self.output_dim, max(self.input_dim, 1)

        @tf.custom_gradient
        def lookup(anchor):
            rows = tf.numpy_function(lambda x: table.lookup(np.ascontiguousarray(x), error)[1], [ids], tf.float32,
                                     stateful=True, name="hybridsync_dynamic_pull")
            rows = tf.reshape(rows, tf.concat([tf.shape(ids, out_type=tf.int32), [dim]], 0))

            def grad(dy):
                return tf.IndexedSlices(tf.reshape(dy, [-1, dim]), tf.reshape(ids, [-1]),
                                        tf.constant([bound, dim], tf.int64))

            return rows, grad

        rows = lookup(tf.convert_to_tensor(self.ps_anchor))
        if self.mode == "sum":
            return tf.reduce_sum(rows, axis=-2)
        return tf.reduce_mean(rows, axis=-2) if self.mode == "mean" else rows

    def compute_output_shape(self, input_shape):
        shape = tuple(input_shape)
        return (shape[:-1] if self.mode else shape) + (self.output_dim,)

    def stats(self) -> dict:
        return self.table.stats()

    def export(self, path) -> int:
        return self.table.export(path)

    # Weight files (model.save, save_weights) hold the rows the table stores, read one-sided by the
    # rank that saves (rank 0 alone may); a rank that loads writes them to their shards, one-sided.
    # The server optimizer's state and the rows' counters go with hybridsync.save_checkpoint.
    def save_own_variables(self, store):
        store["0"] = self.ps_anchor.numpy()
        store["ids"], store["rows"] = self.table.read_all()

    def load_own_variables(self, store):
        self.ps_anchor.assign(np.asarray(store["0"]))
        try:
            ids, rows = np.asarray(store["ids"]), np.asarray(store["rows"])
        except KeyError:  # saved before the rows were saved with the anchor
            return
        self.table.write_all(ids, rows)

    def get_config(self):
        capacity, admit_after, evict, ttl_steps, initializer = self._args
        return {**super().get_config(), "embedding_dim": self.output_dim, "capacity": capacity,
                "admit_after": admit_after, "evict": evict, "ttl_steps": ttl_steps, "initializer": initializer,
                "mode": self.mode, "seed": self.seed, "partitions": self.partitions, "storage": self.table.storage}
