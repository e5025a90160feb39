"""Tensor <-> buffer conversion for the sync core in TensorFlow: each step's gradients reach the
core as NumPy arrays inside one tf.numpy_function, and what the core returns (reduced
gradients, gathered rows, rows the server changed) leaves it as that op's outputs."""
from __future__ import annotations

import numpy as np
import tensorflow as tf


class KerasAccess:
    """One Keras variable as the sync core sees it (GradAccess). begin() hands it a step's
    gradient arrays; the results wait in `out` for the op's outputs. The replica methods run
    eagerly, at plan time."""

    def __init__(self, variable, dtype: str, rows: int, dim: int):
        self.variable, self.dtype, self.rows_, self.dim = variable, np.dtype(dtype), rows, dim
        self._kind = self._dense = self._rows = None
        self._lr = 0.0
        self.out: tuple = ()

    def begin(self, kind, arrays: tuple, lr: float) -> None:
        """A step's gradient: kind 'dense' with (array,), 'sparse' with (ids, values), or None."""
        self._kind, self._lr = kind, lr
        self._dense = arrays[0] if kind == "dense" else None
        self._rows = arrays if kind == "sparse" else None
        self.out = arrays  # unchanged unless the core says otherwise (a world of one)

    def kind(self):
        return self._kind

    def dense(self, codec):
        # numpy_function's inputs may be read-only views of tensors: reduce a copy.
        a = np.array(self._dense, copy=True, order="C")
        wire = codec.wire_dtype(a.dtype.name)
        if wire is None and a.dtype.name == "bfloat16":  # MPI cannot carry ml_dtypes' bfloat16: widened
            wire = "float32"  # (as the PyTorch frontend stages it; set_dense rounds it back)
        return a.astype(wire) if wire is not None else a

    def set_dense(self, buffer) -> None:
        self.out = (buffer.astype(self.dtype, copy=False),)

    def rows(self):
        return self._rows

    def set_rows(self, ids, values) -> None:
        self.out = (ids, values.astype(self.dtype, copy=False))

    def applied(self) -> None:
        pass

    def lr(self) -> float:
        return self._lr

    def replica(self):
        return None  # a TF variable's memory cannot be aliased: the shard keeps a copy

    def replica_copy(self):
        with tf.init_scope():
            return np.array(self.variable.numpy(), dtype=np.float32).reshape(self.rows_, self.dim)

    def set_replica(self, values) -> None:
        with tf.init_scope():
            self.variable.assign(values.reshape(self.variable.shape))

    def write_rows(self, ids, rows) -> None:
        self.out = (ids, rows)


class AutoKerasAccess(KerasAccess):
    """A `sync: auto` variable (hybridsync.planning.measure): whatever its route -- the PS while it is
    measured, then the one chosen -- its gradient enters the exchange as rows and leaves it as
    the same outputs, so a traced step never needs tracing again: (changed ids, rows) written
    into the variable (PS), (ids, values) the Keras optimizer applies (all-reduced as dense:
    every row; all-gathered: the gathered rows), and per optimizer slot (ids, values) written
    into it once, at the switch. Whatever a route leaves alone is empty."""

    def __init__(self, variable, dtype: str, rows: int, dim: int, slots: int):
        super().__init__(variable, dtype, rows, dim)
        self.slots = slots
        self._all_ids = np.arange(rows, dtype=np.int64)
        self._empty_ids = np.zeros(0, np.int64)
        self._changed = self._grad = None
        self._slot_values: list = []

    def begin(self, kind, arrays: tuple, lr: float) -> None:
        self._kind, self._lr = ("sparse" if len(arrays[0]) else None), lr
        self._rows, self._dense = arrays, None
        self._changed = (self._empty_ids, np.zeros((0, self.dim), np.float32))
        self._grad = (self._empty_ids, np.zeros((0, self.dim), self.dtype))

    def kind(self):
        return self._kind

    def dense(self, codec):
        ids, values = self._rows
        a = np.zeros((self.rows_, self.dim), self.dtype)
        np.add.at(a, np.asarray(ids, np.int64), np.asarray(values, self.dtype).reshape(-1, self.dim))
        wire = codec.wire_dtype(a.dtype.name)
        return a.astype(wire) if wire is not None else a

    def set_dense(self, buffer) -> None:
        self._grad = (self._all_ids, np.asarray(buffer).astype(self.dtype, copy=False).reshape(self.rows_, self.dim))

    def set_rows(self, ids, values) -> None:
        self._grad = (np.asarray(ids, np.int64), np.asarray(values).astype(self.dtype, copy=False).reshape(-1, self.dim))

    def write_rows(self, ids, rows) -> None:
        self._changed = (ids, rows)

    def set_slots(self, values: list) -> None:
        """The optimizer's slots take these whole (num_rows x dim) values at this step."""
        self._slot_values = list(values)

    @property
    def out(self) -> tuple:
        slots = []
        for k in range(self.slots):
            if self._slot_values:
                slots += [self._all_ids, np.asarray(self._slot_values[k], np.float32).reshape(self.rows_, self.dim)]
            else:
                slots += [self._empty_ids, np.zeros((0, self.dim), np.float32)]
        self._slot_values = []
        return (*self._changed, *self._grad, *slots)

    @out.setter
    def out(self, value) -> None:
        pass  # KerasAccess.__init__ sets it; this access builds its outputs itself
