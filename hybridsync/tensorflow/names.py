"""The plan's names of Keras and TensorFlow variables."""
from __future__ import annotations


def variable_name(v) -> str:
    """Keras 3 variables have a path ('dense/kernel'); tf.Variables a name ('dense/kernel:0')."""
    name = getattr(v, "path", None) or v.name
    return name[:-2] if name.endswith(":0") else name


def table_variable_name(anchor) -> str:
    """The plan's name of a hybridsync.tensorflow Embedding's table, from its anchor variable (a
    keras.layers.Embedding moved to the shards keeps its variable's name)."""
    moved = getattr(getattr(anchor, "_hybridsync_table", None), "_hs_table_name", None)
    if moved is not None:
        return moved
    return variable_name(anchor).rsplit("/", 1)[0] + "/embeddings"
