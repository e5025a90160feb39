"""Starting every rank from one rank's variables, and Python objects across ranks (the
functions of horovod.tensorflow.functions, and its broadcast_global_variables /
BroadcastGlobalVariablesHook for TF1 graphs)."""
from __future__ import annotations

import tensorflow as tf

from .. import objects
from ..process_sets import global_process_set
from . import mpi_ops, ops


def broadcast_variables(variables, root_rank: int = 0, process_set=global_process_set, inplace: bool = False):
    """Makes every rank's variables equal to root_rank's, in one collective (eagerly, in
    tf.function, or as the op returned in a TF1 graph). Parameter-server tables are no
    variables: they are the same on every rank already. inplace is accepted for Horovod's
    signature (values are copied into the variables either way)."""
    variables = list(variables)
    if not variables or ops.set_size(process_set) == 1:
        return None if tf.executing_eagerly() else tf.group()
    mpi_ops.broadcast_([_variable(v) for v in variables], root_rank, process_set=process_set)
    if not tf.executing_eagerly():
        return tf.group(*[_variable(v).read_value() for v in variables])
    return None


def _variable(v):
    """The tf.Variable behind a Keras variable (assign and read_value live there)."""
    inner = getattr(v, "value", None)
    return inner if isinstance(inner, tf.Variable) else v


def broadcast_global_variables(root_rank):
    """TF1 graphs: broadcasts tf.compat.v1.global_variables() from root_rank (an op). Eagerly
    there are no global variables: broadcast_variables(model.variables) instead."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 MonitoredSession hook: broadcasts the global variables from root_rank once the
    session is created. `device` is accepted for Horovod's signature."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank, self.device, self.bcast_op = root_rank, device, None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """root_rank's `obj` (pickled with cloudpickle; any picklable object) on every rank of the
    process set. `session` is accepted for Horovod's TF1 signature (no op is built)."""
    name = objects.auto_name("broadcast_object", name, process_set)
    return objects.broadcast(ops.engine(process_set), obj, int(root_rank), mpi_ops.rank(), name)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts an object from root_rank each time it is called (Horovod's
    TF1 helper; here the same as calling broadcast_object)."""
    def broadcast(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)

    return broadcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's `obj`, as a list in rank order."""
    name = objects.auto_name("allgather_object", name, process_set)
    return objects.allgather(ops.engine(process_set), obj, name)
