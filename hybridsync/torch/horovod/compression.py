"""Gradient compression for the dense all-reduce, with Horovod's interface:
`compress(tensor) -> (tensor, ctx)` before sending, `decompress(tensor, ctx)` after. The
built-in ones are hybridsync.sync.compression's codecs by name (what a DistributedOptimizer
uses); these classes are the same codecs for hvd.allreduce(..., compression=...)."""
from __future__ import annotations

import torch

from ...sync import compression as codecs
from ...sync.compression import Compressor, NoneCompressor  # noqa: F401  (Horovod's names, here too)


class FP16Compressor(Compressor):
    """Sends floating-point gradients as float16 (half the bytes; ~3 significant digits)."""

    name = "fp16"

    @staticmethod
    def compress(tensor):
        if codecs.FP16.wire_dtype(str(tensor.dtype).replace("torch.", "")) == "float16":
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    """`Compression.none` and `Compression.fp16`, as in horovod.torch."""

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def by_name(name: str):
        return {"none": NoneCompressor, "fp16": FP16Compressor}[codecs.by_name(name).name]
