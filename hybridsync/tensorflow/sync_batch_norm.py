"""Horovod's SyncBatchNormalization for Keras 3: batch statistics over every rank's batch
while training (count-weighted, so ranks may hold batches of different sizes), Keras's own
BatchNormalization otherwise. The statistics are reduced by a differentiable all-reduce, so the
gradient reaches every rank's inputs."""
from __future__ import annotations

import keras
import tensorflow as tf

from . import mpi_ops, ops


class SyncBatchNormalization(keras.layers.BatchNormalization):
    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)  # (Keras names it sync_batch_normalization, _1, ...)

    def _moments(self, inputs, mask):
        if ops.set_size(None) == 1:
            return super()._moments(inputs, mask)
        x = tf.convert_to_tensor(inputs)
        dtype = tf.float32 if x.dtype in (tf.float16, tf.bfloat16) else x.dtype
        x = tf.cast(x, dtype)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), dtype)
        count = tf.reduce_sum(weights, axes)
        total = tf.reduce_sum(x * weights, axes)
        squares = tf.reduce_sum(tf.square(x) * weights, axes)
        summed = mpi_ops._allreduce(tf.stack([total, squares, count]), op=mpi_ops.Sum)
        count = tf.maximum(summed[2], tf.ones_like(summed[2]))
        mean = summed[0] / count
        variance = tf.maximum(summed[1] / count - tf.square(mean), tf.zeros_like(mean))
        return mean, variance
