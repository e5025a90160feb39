"""Broadcasts and collectives for TensorFlow values (eager)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import runtime
from ..types import ReduceOp, as_reduce_op
from . import collectives


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Makes every rank's variables equal to root_rank's (and re-syncs PS shards that hold
    copies of them, through the optimizers that own them)."""
    if runtime.world().size == 1:
        return
    for v in variables:
        value = collectives.mpi().broadcast_object(v.numpy() if runtime.world().rank == root_rank else None, root_rank)
        v.assign(value)


def allreduce(value, op=ReduceOp.AVERAGE):
    """The all-reduced value of a tensor or array across ranks (eager)."""
    array = np.array(tf.convert_to_tensor(value).numpy(), copy=True)
    if runtime.world().size > 1:
        collectives.mpi().allreduce_arrays([array], as_reduce_op(op), name="hybridsync.allreduce")
    return tf.convert_to_tensor(array)


def allgather(value):
    """Every rank's tensor concatenated along dim 0 (eager)."""
    return tf.convert_to_tensor(collectives.mpi().allgather(np.ascontiguousarray(tf.convert_to_tensor(value).numpy())))


def broadcast_object(obj, root_rank: int = 0):
    return collectives.mpi().broadcast_object(obj, root_rank)
