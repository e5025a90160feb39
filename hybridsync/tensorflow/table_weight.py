"""A parameter-server table among a Keras layer's weights, without the table.

hybridsync.tensorflow.Embedding's `weights` are its one-element anchor (the variable its gradient
reaches the optimizer on) and a TableWeight, so `model.get_weights()` / `set_weights()` and
weight counts see the table as they would a Keras embedding's. It holds no rows: numpy() reads
them from the shards -- by this rank alone, in chunks, while the shards' owners go on training -- and assign()
writes them to the shards the same way. So rank 0 alone may call model.get_weights() (it holds
the table once; the other ranks hold nothing). It is not a variable: the optimizer,
`model.variables` and broadcast_variables never see it.
"""
from __future__ import annotations

import numpy as np


class TableWeight:
    """The rows of a PS table as a weight of `layer` (read and written one-sided)."""

    # Keras's fit() takes gradients of the trainable weights: the anchor is the one that trains.
    trainable = False
    dtype = "float32"

    def __init__(self, layer):
        self.layer = layer
        self.name = "embeddings"

    @property
    def path(self) -> str:
        return f"{self.layer.name}/{self.name}"

    @property
    def table(self):
        return self.layer.table

    @property
    def shape(self) -> tuple:
        return (self.table.num_rows, self.table.dim)

    def numpy(self) -> np.ndarray:
        return self.table.read()

    def __array__(self, dtype=None, copy=None):
        """The rows, read now: always a fresh array, so np.array() need not copy it again."""
        rows = self.numpy()
        return rows if dtype is None or np.dtype(dtype) == rows.dtype else rows.astype(dtype)

    def assign(self, value) -> None:
        value = np.asarray(value, dtype=np.float32)
        if value.shape != self.shape:
            raise ValueError(f"weight '{self.path}': expected shape {self.shape}, got {value.shape}")
        self.table.write(value)

    def __repr__(self):
        return f"<TableWeight path={self.path} shape={self.shape} (rows on the parameter server)>"
