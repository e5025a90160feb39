"""How a PS table stores its rows (docs/storage.md), framework-neutral: the `storage` options a
constructor or a YAML rule gives, checked in one place, and the NumPy twin of the shards'
rounding into 16-bit rows (csrc/ps/half.h; tested against each other).

    storage: {dtype: float32 | float16 | bfloat16,    # rows on the shards and on the wire
              rounding: nearest | stochastic,         # into 16 bits (stochastic: seeded by (seed, id, step))
              seed: <int>,                            # stochastic rounding's seed
              memory_rows: N, path: DIR,              # a disk tier: rows beyond N (all shards) in DIR
              disk_rows: M}                           # a dynamic table's bound on its disk tier

Optimizer slots stay float32 whatever the dtype; the rule runs in float32 and its result is
rounded back into the row type.
"""
from __future__ import annotations

import numbers
import os

import numpy as np

from .dynamic_options import mix64  # (the same splitmix64 finaliser as csrc/ps/seeded.h)

DTYPES = ("float32", "float16", "bfloat16")
ROUNDINGS = ("nearest", "stochastic")
OPTION_KEYS = ("dtype", "rounding", "seed", "memory_rows", "disk_rows", "path")
_M64 = 0xFFFFFFFFFFFFFFFF


def check_option(key: str, value, where: str):
    """One storage option, checked (constructors and YAML rules alike): the value to use, or
    ValueError naming `where` and the key."""
    if key not in OPTION_KEYS:
        raise ValueError(f"{where}: storage: unknown key {key!r} (known: {', '.join(OPTION_KEYS)})")
    if key == "dtype":
        if value not in DTYPES:
            raise ValueError(f"{where}: storage.dtype must be one of {', '.join(DTYPES)}, got {value!r}")
        return value
    if key == "rounding":
        if value not in ROUNDINGS:
            raise ValueError(f"{where}: storage.rounding must be one of {', '.join(ROUNDINGS)}, got {value!r}")
        return value
    if key == "path":
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise ValueError(f"{where}: storage.path must be a directory (a non-empty string), got {value!r}")
        return os.fspath(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: storage.{key} must be an integer, got {value!r}")
    if key == "seed":
        return int(value) & ((1 << 63) - 1)
    if value < 1:
        raise ValueError(f"{where}: storage.{key} must be >= 1, got {value!r}")
    return int(value)


def options(where: str, storage) -> dict | None:
    """The engine's storage dict from a constructor's or a rule's `storage` (None or a dict);
    ValueError naming `where` (e.g. "table 'emb'") for anything wrong."""
    if storage is None:
        return None
    if not isinstance(storage, dict):
        raise ValueError(f"{where}: storage must be a dict like {{'dtype': 'float16'}}, got {storage!r}")
    out = {key: check_option(key, value, where) for key, value in storage.items()}
    if ("memory_rows" in out or "disk_rows" in out) and "path" not in out:
        raise ValueError(f"{where}: storage.memory_rows and disk_rows need storage.path (the disk tier's directory)")
    if "path" in out and "memory_rows" not in out:
        raise ValueError(f"{where}: storage.path needs storage.memory_rows (the rows kept in memory, all shards)")
    return out


def has_disk_tier(storage) -> bool:
    """Whether (unchecked) storage options ask for a disk tier."""
    return isinstance(storage, dict) and bool(storage.get("path"))


def dtype_of(storage: dict | None) -> str:
    return (storage or {}).get("dtype", "float32")


def describe(storage: dict | None) -> str:
    """One short text of a storage dict for plans and explain() ("float32" when plain)."""
    s = storage or {}
    text = dtype_of(s)
    if s.get("rounding") == "stochastic":
        text += f" (stochastic rounding, seed {s.get('seed', 0)})"
    if s.get("path"):
        text += f", memory_rows {s['memory_rows']} + disk tier in {s['path']}"
        if s.get("disk_rows"):
            text += f" (at most {s['disk_rows']} rows)"
    return text


# -- the NumPy twin of csrc/ps/half.h ----------------------------------------------------------------


def rounding_bits(seed: int, step: int, ids, dim: int) -> np.ndarray:
    """The 32 random bits element (i, j) of row ids[i] rounds with at server step `step`: a pure
    function of (seed, id, step, column), so results do not depend on the sharding."""
    with np.errstate(over="ignore"):
        key = mix64(np.uint64(seed & _M64) ^ mix64(np.array([step & _M64], np.uint64)))[0]
        u = np.asarray(ids, dtype=np.int64).reshape(-1).view(np.uint64)
        counter = u[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
        return (mix64(key ^ counter) >> np.uint64(32)).astype(np.uint32)


def round_rows(values, dtype: str, random_bits=None) -> np.ndarray:
    """float32 `values` rounded to `dtype` and back to float32, as a shard stores them:
    round-to-nearest-even, or stochastically with `random_bits` (uint32, values' shape; see
    rounding_bits)."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        if random_bits is None:
            with np.errstate(over="ignore"):  # (beyond 65504: inf, as the shards store it)
                return x.astype(np.float16).astype(np.float32)  # IEEE conversion: nearest, ties to even
        return _half_stochastic(x, np.asarray(random_bits, np.uint32))
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    bits = x.view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if random_bits is None:
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    else:
        finite = (bits & 0x7FFFFFFF) < 0x7F800000
        rounded = np.where(finite, (bits + (np.asarray(random_bits, np.uint64) & 0xFFFF)) >> 16, bits >> 16)
    rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return ((rounded & 0xFFFF) << 16).astype(np.uint32).view(np.float32)


def _half_stochastic(x: np.ndarray, random: np.ndarray) -> np.ndarray:
    """float32 -> float16 rounding away from zero with probability equal to the dropped fraction."""
    bits = x.view(np.uint32).astype(np.uint64)
    sign = (bits >> 16) & 0x8000
    a = bits & 0x7FFFFFFF
    r = random.astype(np.uint64)
    normal = np.clip((a + (r & 0x1FFF)).astype(np.int64) - (112 << 23), 0, None).astype(np.uint64) >> 13
    normal = np.minimum(normal, 0x7C00)
    units = (a.astype(np.uint32).view(np.float32) * np.float32(16777216.0)).astype(np.float32)
    q = np.floor(units).astype(np.uint64)
    frac = units - q.astype(np.float32)
    q = q + ((r >> 8).astype(np.float32) * np.float32(1.0 / 16777216.0) < frac)
    h = np.where(a < 0x38800000, q, normal)
    h = np.where(a >= 0x47800000, 0x7C00, h)
    h = np.where(a > 0x7F800000, 0x7E00, h)
    return (sign | h).astype(np.uint16).view(np.float16).astype(np.float32)
