"""hybridsync.tensorflow.Embedding: a Keras embedding layer whose rows live on the parameter
server (sharded placement: each rank holds 1/N of the table).

Forward pulls the rows of the batch's ids from their shards. The layer's only TF variable is a
one-element "anchor"; its gradient is the batch's (ids, gradient rows) as tf.IndexedSlices,
which the DistributedOptimizer pushes to the shards (applied before the next pull). Every rank
must call the layer the same number of times per step, since a pull is collective.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from ..ps.table import PSTable, shared_seed
from .table_weight import TableWeight


@keras.saving.register_keras_serializable(package="hybridsync")
class Embedding(keras.layers.Layer):
    """Embedding(input_dim, output_dim) with rows on the PS. Rows start from `initializer`
    (('uniform', low, high), default Keras's U(-0.05, 0.05), or ('normal', mean, std)), seeded
    from rank 0 and identical whatever the number of shards. partitions: shards holding the
    table (default: every rank); partition: 'cyclic' | 'block'. storage: how the shards store the
    rows, e.g. {'dtype': 'float16'} (docs/storage.md)."""

    def __init__(self, input_dim, output_dim, *, partitions=None, partition="cyclic", seed=None,
                 initializer=("uniform", -0.05, 0.05), storage=None, **kwargs):
        super().__init__(**kwargs)
        if input_dim < 1 or output_dim < 1:
            raise ValueError(f"PS embedding needs input_dim >= 1 and output_dim >= 1, got ({input_dim}, {output_dim})")
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.partitions, self.partition, self.initializer = partitions, partition, tuple(initializer)
        # The rule is a placeholder until the DistributedOptimizer sets the real one.
        self.table = PSTable(self.name, self.input_dim, self.output_dim, partitions or 0, partition, storage=storage)
        # A seed from rank 0's NumPy RNG (seeded by keras.utils.set_random_seed).
        self.seed = shared_seed(np.random.randint(0, 2**62)) if seed is None else int(seed)
        self.table.initialize(self.initializer, self.seed)

    def build(self, input_shape=None):
        self.ps_anchor = self.add_weight(shape=(1,), initializer="zeros", trainable=True, name="ps_anchor")
        self.ps_anchor._hybridsync_table = self  # the optimizer routes this variable's gradient to the PS
        self._table_weight = TableWeight(self)

    @property
    def weights(self):
        """The anchor, then the table (a TableWeight: get_weights() and set_weights() read and
        write the shards, one-sided)."""
        return [self.ps_anchor, self._table_weight] if self.built else []

    def call(self, ids):
        ids = tf.cast(ids, tf.int64)
        table, num, dim = self.table, self.input_dim, self.output_dim

        @tf.custom_gradient
        def lookup(anchor):
            rows = tf.numpy_function(lambda x: table.lookup(np.ascontiguousarray(x))[1], [ids], tf.float32,
                                     stateful=True, name="hybridsync_ps_pull")
            rows = tf.reshape(rows, tf.concat([tf.shape(ids, out_type=tf.int32), [dim]], 0))

            def grad(dy):
                return tf.IndexedSlices(tf.reshape(dy, [-1, dim]), tf.reshape(ids, [-1]),
                                        tf.constant([num, dim], tf.int64))

            return rows, grad

        return lookup(tf.convert_to_tensor(self.ps_anchor))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    # -- the whole table, streamed from / to the shards by this rank alone (no collective) --------
    def get_table(self) -> np.ndarray:
        return self.table.read()

    def set_table(self, values) -> None:
        self.table.write(values)

    # Weight files (model.save_weights / load_weights) hold the whole table: read on save by the
    # rank that saves (rank 0 alone may), written to every shard on load by each rank that loads.
    def save_own_variables(self, store):
        store["0"] = self.ps_anchor.numpy()
        # Keras's store converts with np.array(): a TableWeight hands it the rows it reads, uncopied.
        store["table"] = self._table_weight

    def load_own_variables(self, store):
        self.ps_anchor.assign(np.asarray(store["0"]))
        self.set_table(np.asarray(store["table"]))

    def get_config(self):
        """Every argument (Keras saves it with the model; keras.models.load_model registers the
        table again, collectively, and load_own_variables writes its saved rows to the shards)."""
        return {**super().get_config(), "input_dim": self.input_dim, "output_dim": self.output_dim,
                "partitions": self.partitions, "partition": self.partition, "seed": self.seed,
                "initializer": list(self.initializer), "storage": self.table.storage}
