"""Fused all-reduce: many small gradients become a few large buffers, one per dtype (and
whatever else the caller keys on), each at most HYBRIDSYNC_FUSION_MB, reduced in place and
copied back. One collective per bucket instead of one per tensor is what makes a small
model's all-reduce cheap (as Horovod's tensor fusion)."""
from __future__ import annotations

import numpy as np


class Bucket:
    """Arrays of one dtype fused into one flat buffer (a view when there is only one)."""

    __slots__ = ("key", "arrays", "flat")

    def __init__(self, key, arrays: list):
        self.key, self.arrays = key, arrays
        if len(arrays) == 1:
            self.flat = arrays[0].reshape(-1)  # contiguous: a view, nothing to copy back
        else:
            self.flat = np.concatenate([a.reshape(-1) for a in arrays])

    def scatter_back(self) -> None:
        """Copies the reduced flat buffer back into the arrays it was made of."""
        if len(self.arrays) == 1:
            return
        offset = 0
        for a in self.arrays:
            n = a.size
            a.reshape(-1)[...] = self.flat[offset:offset + n]
            offset += n


def check_buffer(array, what: str) -> np.ndarray:
    """The array to reduce in place: it must be writable, C-contiguous CPU memory."""
    array = np.asarray(array)
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError(f"all-reduce of {what}: needs a writable C-contiguous CPU buffer")
    return array


# An array this large is reduced where it is, in a bucket of its own: fusing saves a
# collective's latency, which is nothing next to moving megabytes, while a fused copy of large
# gradients holds them twice (8 densified embedding gradients of 32 MB: 256 MB of copies).
ALONE_BYTES = 4 << 20


def make_buckets(arrays: list, keys: list, limit_bytes: int) -> list[Bucket]:
    """Groups arrays by (key, dtype) in first-seen order, starting a new bucket of a group when
    the next array would take it past limit_bytes; an array of ALONE_BYTES or more (or of the
    limit) is a bucket of its own, reduced in place."""
    groups: dict = {}
    large = []
    alone = min(ALONE_BYTES, limit_bytes)
    for array, key in zip(arrays, keys):
        if array.nbytes >= alone:
            large.append(Bucket((key, array.dtype.str), [array]))
            continue
        chains = groups.setdefault((key, array.dtype.str), [[]])
        chain = chains[-1]
        if chain and sum(a.nbytes for a in chain) + array.nbytes > limit_bytes:
            chains.append([])
        chains[-1].append(array)
    return [Bucket(key, chain) for key, chains in groups.items() for chain in chains if chain] + large
