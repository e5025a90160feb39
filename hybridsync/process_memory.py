"""Giving this process's freed heap memory back to the system.

glibc raises its thresholds when a large block it had mapped is freed: once hybridsync moved a
model's tables onto the shards (freeing table-sized tensors), blocks up to a table's size come
from the heap and up to twice that stays resident after it is freed. A switch that then grows
replicas would stack them on top of that kept memory (measured: ~14 MiB per rank on the flagship
model, 2% of the process). malloc_trim hands the free pages back; elsewhere than glibc it does
not exist and nothing is done.
"""
from __future__ import annotations

import ctypes

try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):
    _malloc_trim = None


def give_back_free_heap() -> None:
    """Local: the heap's free pages go back to the system (a few milliseconds; call it where a
    large allocation is about to follow a large release, not every step)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
