"""Collectives of hybridsync's MPI backend (hybridsync.comm.mpi) as TensorFlow ops: what
Horovod's C++ TensorFlow ops are, for hybridsync.tensorflow.mpi_ops.

Each collective is one stateful tf.numpy_function: it hands its input to the backend of its
process set (negotiated by name, so a mismatch between ranks raises on every rank instead of
hanging) and waits for the result. It runs eagerly, inside tf.function (which runs stateful ops
in program order, so every rank issues them in the same order) and in TF1 graphs. In graphs,
ops are named after their input tensor, as Horovod names its ops (the same on every rank that
built the same graph); eager ops are numbered in program order by the backend.

A TF1 session runs independent ops in any order on a few threads: ranks whose threads all wait
in different collectives would deadlock (the backend then reports that no collective can run).
So in a TF1 graph each collective op runs after the previous one built in that graph (a control
dependency), in build order on every rank -- Horovod's C++ ops need no such order, as they wait
without holding a thread. Fetching a collective therefore runs the ones built before it in its
graph again (as a train op that holds every collective of a step does anyway).

A mismatch becomes tf.errors.FailedPreconditionError and a bad argument (a ValueError of the
backend) tf.errors.InvalidArgumentError, Horovod's errors, where TensorFlow lets a Python op
raise its own error: eagerly. A graph (tf.function, Session.run) reports the failure of
any Python op as tf.errors.UnknownError, whose message carries the same text.
"""
from __future__ import annotations

import contextlib
import re
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph

from .. import comm, process_sets, runtime
from ..comm.negotiation import CollectiveMismatchError
from .collectives import check_not_xla


def engine(process_set):
    """The MPI collectives of `process_set` on this rank (the job's for the global set)."""
    if process_sets.is_global(process_set):
        return comm.backend("mpi")
    return process_sets.engine_of(process_set)


def set_size(process_set) -> int:
    """Number of ranks in `process_set` (the job's for the global set)."""
    return runtime.world().size if process_sets.is_global(process_set) else len(process_set.ranks)


def set_rank(process_set) -> int:
    """This rank's position in `process_set` (its rank for the global set)."""
    me = runtime.world().rank
    return me if process_sets.is_global(process_set) else process_set.ranks.index(me)


def _normalize(name: str) -> str:
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def collective_name(prefix: str, tensors, name):
    """The name ranks match a collective by: the caller's, else in a graph Horovod's
    '<prefix>_<input tensor name>' (the same on every rank that built the same graph), else
    (eagerly) None: the backend numbers unnamed collectives in the order they are submitted."""
    if name is not None:
        return str(name)
    if tf.executing_eagerly():
        return None
    tensors = list(tensors)
    first, last = tensors[0].name, tensors[-1].name
    return _normalize(f"{prefix}_{first}" if len(tensors) == 1 else f"{prefix}_{first}_{last}")


def _op_name(label: str) -> str:
    """A valid TensorFlow op name for the numpy_function (the graph makes it unique)."""
    name = _normalize(label or "hybridsync_collective")
    return name if name[:1].isalpha() else f"hs_{name}"


_newest: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # TF1 graph -> its newest collective op


def _in_build_order():
    """In a TF1 graph: a control dependency on the graph's newest collective op (see above)."""
    if tf.executing_eagerly():
        return contextlib.nullcontext()
    graph = tf.compat.v1.get_default_graph()
    previous = None if isinstance(graph, FuncGraph) else _newest.get(graph)
    if previous is None or previous._control_flow_context is not graph._get_control_flow_context():
        return contextlib.nullcontext()
    return tf.control_dependencies([previous])


def host_op(fn, inputs, out_types, label: str):
    """Runs fn(*input arrays) -> output arrays as one stateful TensorFlow op."""
    check_not_xla(label or "collective")
    eager = tf.executing_eagerly()

    def run(*arrays):
        try:
            return fn(*arrays)
        except CollectiveMismatchError as exc:  # Horovod raises FailedPreconditionError
            raise tf.errors.FailedPreconditionError(None, None, str(exc)) from exc
        except ValueError as exc:  # bad arguments (alltoall's splits ...): InvalidArgumentError, as
            if not eager:          # a graph makes of a ValueError itself (of an OpError: UnknownError)
                raise
            raise tf.errors.InvalidArgumentError(None, None, str(exc)) from exc

    with _in_build_order():
        outs = tf.numpy_function(run, list(inputs), list(out_types), stateful=True, name=_op_name(label))
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]  # (eagerly, one output comes alone)
    if not tf.executing_eagerly():
        graph = outs[0].graph
        if not isinstance(graph, FuncGraph):
            _newest[graph] = outs[0].op
    return outs


def np_label(dtype) -> str:
    """The dtype name the backend negotiates (what Horovod calls the tensor's type)."""
    return tf.as_dtype(dtype).name


def writable(array) -> np.ndarray:
    """A writable C-contiguous copy (numpy_function's inputs may be read-only views)."""
    return np.array(array, copy=True, order="C")
