"""Gradient compression for the all-reduce routes, by name, for every frontend.

A codec says which dtype a gradient travels in; the frontends do the cast when they turn a
tensor into a buffer (and back), so the same name means the same bytes on the wire in PyTorch
and TensorFlow.
"""
from __future__ import annotations

import dataclasses

NAMES = ("none", "fp16")


@dataclasses.dataclass(frozen=True)
class Codec:
    name: str

    @property
    def custom(self) -> bool:
        """A frontend's own compressor (a Horovod-style compress/decompress object in torch)."""
        return self.name not in NAMES

    def wire_dtype(self, dtype: str) -> str | None:
        """The dtype a gradient of `dtype` ('float32', ...) is sent in; None: as it is."""
        if self.name == "fp16" and dtype in ("float32", "float64", "bfloat16"):
            return "float16"
        return None


NONE = Codec("none")
FP16 = Codec("fp16")


def by_name(name: str) -> Codec:
    if name not in NAMES:
        raise ValueError(f"unknown compression {name!r} (known: {', '.join(NAMES)})")
    return Codec(name)


class Compressor:
    """Horovod's compressor interface, for every frontend: `compress(tensor) -> (tensor, ctx)`
    before sending, `decompress(tensor, ctx)` after; subclasses override both."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (the default), in any framework."""

    name = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
