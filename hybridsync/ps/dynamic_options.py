"""Dynamic tables, framework-neutral: their options, and the Python twins of the C++ rules that
decide where a raw id lives and what its first row is (csrc/ps/partitioner.cc hash_shard,
csrc/ps/seeded.h; tested against each other). See docs/dynamic-tables.md.

A dynamic table takes any int64 id (unsigned 64-bit hashes cast to int64 included): a shard
creates the row on the id's first push (after `admit_after` pushes), evicts rows when it
holds its share of `capacity` (LRU or LFU) and expires rows untouched for `ttl_steps` rounds.
"""
from __future__ import annotations

import numbers

import numpy as np

EVICTIONS = (None, "lru", "lfu")
OPTION_KEYS = ("capacity", "admit_after", "evict", "ttl_steps")
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def check_option(key: str, value, where: str):
    """One option's value (a key of OPTION_KEYS), checked: the one place each option is validated
    (a constructor's arguments and a YAML `dynamic:` rule alike); ValueError naming `where`."""
    if key == "evict":
        if value not in EVICTIONS:
            raise ValueError(f"{where}: evict must be None, 'lru' or 'lfu', got {value!r}")
        return value
    allow_none = key != "admit_after"  # capacity, ttl_steps: None is unbounded, no expiry
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{where}: {key} must be an integer >= 1{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def check_eviction(capacity, evict, where: str, disk_tier: bool = False) -> None:
    """An eviction order needs a bound: a capacity, or with a disk tier (docs/storage.md) the
    tiers' own (memory_rows spills in that order; disk_rows evicts in it)."""
    if evict is not None and capacity is None and not disk_tier:
        raise ValueError(f"{where}: evict={evict!r} needs a capacity (or a disk tier: storage memory_rows and path)")


def options(name: str, capacity=None, admit_after=1, evict=None, ttl_steps=None, initializer=("normal", 0.0, 1.0),
            seed: int = 0, disk_tier: bool = False) -> dict:
    """The engine's option dict for dynamic table `name`; ValueError naming a bad argument.
    disk_tier: the table has one (storage path), which bounds it in place of a capacity."""
    where = f"dynamic table '{name}'"
    capacity, admit_after, evict, ttl_steps = (check_option(k, v, where) for k, v in (
        ("capacity", capacity), ("admit_after", admit_after), ("evict", evict), ("ttl_steps", ttl_steps)))
    check_eviction(capacity, evict, where, disk_tier)
    kind, a, b = _initializer(name, initializer)
    return {"capacity": capacity, "admit_after": admit_after, "evict": evict, "ttl_steps": ttl_steps,
            "seed": int(seed) & ((1 << 63) - 1), "init": kind, "init_a": a, "init_b": b}


def _initializer(name, initializer):
    ok = (isinstance(initializer, (tuple, list)) and len(initializer) == 3 and initializer[0] in ("normal", "uniform")
          and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in initializer[1:]))
    if not ok:
        raise ValueError(f"dynamic table '{name}': initializer must be ('normal', mean, std) or "
                         f"('uniform', low, high), got {initializer!r}")
    return initializer[0], float(initializer[1]), float(initializer[2])


def check_ids(name: str, ids) -> np.ndarray:
    """ids as a flat int64 array; TypeError naming the table for non-integer ids."""
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise TypeError(f"dynamic table '{name}': ids must be integers (int64, or uint64 hashes), got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


# -- twins of the C++ rules ---------------------------------------------------------------------
def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def hash_shard(ids, shards: int) -> np.ndarray:
    """The shard of each raw id of a dynamic table over `shards` shards."""
    u = np.asarray(ids, dtype=np.int64).view(np.uint64)
    return (mix64(u ^ np.uint64(0xD6E8FEB86659FD93)) % np.uint64(shards)).astype(np.int64)


def capacity_share(capacity, shards: int, shard: int) -> int:
    """Rows shard `shard` holds at most (0: unbounded): capacity / shards, the first
    capacity % shards one more."""
    if not capacity:
        return 0
    return capacity // shards + (1 if shard < capacity % shards else 0)


def initial_rows(seed: int, ids, dim: int, initializer=("normal", 0.0, 1.0)) -> np.ndarray:
    """Rows (len(ids), dim) a dynamic table starts `ids` from, a pure function of (seed, id):
    uniform: element j from the key of (seed, id, j), as fixed tables seed theirs; normal:
    columns 2k and 2k+1 are the cosine and sine of one float32 Box-Muller pair from key k (the
    engine's polynomial log / sin / cos agree with NumPy's within 1e-6)."""
    kind, a, b = initializer
    u = np.asarray(ids, dtype=np.int64).reshape(-1).view(np.uint64)
    cols = dim if kind == "uniform" else (dim + 1) // 2
    with np.errstate(over="ignore"):
        counter = u[:, None] * np.uint64(dim) + np.arange(cols, dtype=np.uint64)[None, :]
        key = mix64(np.uint64(seed) ^ mix64(counter))
    a32, b32 = np.float32(a), np.float32(b)
    if kind == "uniform":
        u1 = ((key >> np.uint64(11)).astype(np.float64) + 0.5) / 9007199254740992.0
        return (a32 + (b32 - a32) * u1.astype(np.float32)).astype(np.float32)
    u1 = ((key >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
    u2 = ((key >> np.uint64(16)) & np.uint64(0xFFFFFF)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    r = np.sqrt(np.float32(-2.0) * np.log(u1))
    angle = np.float32(6.2831853) * u2
    out = np.empty((len(u), 2 * cols), np.float32)
    out[:, 0::2] = a32 + b32 * (r * np.cos(angle))
    out[:, 1::2] = a32 + b32 * (r * np.sin(angle))
    return out[:, :dim]
