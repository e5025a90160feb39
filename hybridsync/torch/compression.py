"""Gradient compression for the dense all-reduce, with Horovod's interface:
`compress(tensor) -> (tensor, ctx)` before sending, `decompress(tensor, ctx)` after."""
from __future__ import annotations

import torch


class Compressor:
    """Interface: subclasses override both static methods."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point gradients as float16 (half the bytes; ~3 significant digits)."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
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
        table = {"none": NoneCompressor, "fp16": FP16Compressor}
        if name not in table:
            raise ValueError(f"unknown compression {name!r} (known: {', '.join(table)})")
        return table[name]
