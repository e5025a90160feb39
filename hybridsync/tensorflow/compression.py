"""Gradient compression for TensorFlow collectives, with Horovod's interface:
`compress(tensor) -> (tensor, ctx)` before sending, `decompress(tensor, ctx)` after.
A DistributedOptimizer given one of these uses hybridsync's codec of the same name."""
from __future__ import annotations

import tensorflow as tf

from ..sync.compression import Compressor, NoneCompressor  # noqa: F401  (Horovod's names, here too)


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes of float32; ~3 significant
    digits); other dtypes unchanged."""

    name = "fp16"

    @staticmethod
    def compress(tensor):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx) if ctx is not None and ctx.is_floating else tensor


class Compression:
    """`Compression.none` and `Compression.fp16`, as in horovod.tensorflow."""

    none = NoneCompressor
    fp16 = FP16Compressor


def codec_name(compression) -> str:
    """The sync core's codec for a compression argument: a Compressor class (Horovod's or these),
    or a name ('none', 'fp16'); None means 'none'."""
    if compression is None:
        return "none"
    name = compression if isinstance(compression, str) else getattr(compression, "name", None)
    if name is None:  # Horovod's own classes carry no name
        name = {"NoneCompressor": "none", "FP16Compressor": "fp16"}.get(getattr(compression, "__name__", ""))
    if name not in ("none", "fp16"):
        raise ValueError(f"compression must be Compression.none, Compression.fp16 or 'none' / 'fp16', "
                         f"got {compression!r}")
    return name
