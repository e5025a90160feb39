"""Dynamic tables without MPI: the Python twins of the C++ hash partition and initial values,
option and YAML validation (the C++ rules themselves: tests/cpp/test_dynamic.cc; training at
1-3 ranks: tests/parallel/test_dynamic_tables.py)."""
import re

import numpy as np
import pytest

from hybridsync import _ps_testing, config
from hybridsync.ps import dynamic_options as dyn


def _ids():
    rng = np.random.default_rng(5)
    edges = [np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0, 1]
    return np.concatenate([edges, rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 500, np.int64)])


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_hash_shard_twin_matches_the_engine_and_spreads_sequential_ids(shards):
    ids = _ids()
    assert dyn.hash_shard(ids, shards).tolist() == _ps_testing.hash_shard(ids.tolist(), shards)
    counts = np.bincount(dyn.hash_shard(np.arange(30000), shards), minlength=shards)
    assert counts.min() > 0.9 * 30000 / shards  # no id-mod-shards striping


@pytest.mark.parametrize("dim", [5, 16])
@pytest.mark.parametrize("init", [("normal", 0.5, 2.0), ("uniform", -0.1, 0.3)])
def test_initial_rows_twin_matches_the_engine(init, dim):
    """The engine's polynomial log / sin / cos against NumPy's float32 functions, over many ids
    (so the tails of the normal, where r is largest, are in)."""
    ids = np.concatenate([_ids(), np.random.default_rng(6).integers(-2**63, 2**63 - 1, 20000, np.int64)])
    want = np.array(_ps_testing.dynamic_initial_rows(42, ids.tolist(), dim, *init), np.float32).reshape(-1, dim)
    np.testing.assert_allclose(dyn.initial_rows(42, ids, dim, init), want, rtol=1e-6, atol=1e-6)


def test_capacity_share_splits_the_remainder_over_the_first_shards():
    assert [dyn.capacity_share(10, 3, s) for s in range(3)] == [4, 3, 3]
    assert dyn.capacity_share(None, 3, 0) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(capacity=0), "capacity must be an integer >= 1 or None"),
    (dict(admit_after=0), "admit_after must be an integer >= 1"),
    (dict(ttl_steps=2.5), "ttl_steps must be an integer >= 1 or None"),
    (dict(evict="mru", capacity=5), "evict must be None, 'lru' or 'lfu'"),
    (dict(evict="lru"), "evict='lru' needs a capacity"),
    (dict(initializer=("zeros",)), "initializer must be"),
])
def test_bad_options_name_the_table_and_argument(kwargs, message):
    with pytest.raises(ValueError, match=f"dynamic table 'users': {message}"):
        dyn.options("users", **kwargs)


def test_non_integer_ids_are_a_type_error_naming_the_table():
    with pytest.raises(TypeError, match="dynamic table 'users': ids must be integers"):
        dyn.check_ids("users", np.array([1.5]))
    assert dyn.check_ids("users", np.array([2**64 - 1], np.uint64)).tolist() == [-1]  # unsigned hashes cast


def test_yaml_dynamic_rule_is_parsed_and_checked():
    cfg = config.load({"variables": [{"match": "users.*", "dynamic": {"capacity": 100, "evict": "lfu",
                                                                        "ttl_steps": None, "admit_after": 3}}]})
    assert cfg.rule_for("users.weight").dynamic == {"capacity": 100, "evict": "lfu", "ttl_steps": None,
                                                    "admit_after": 3}
    for bad, message in [({"capacity": 0}, "variables[0].dynamic.capacity: capacity must be an integer >= 1 or null"),
                         ({"evict": "fifo"}, "variables[0].dynamic.evict: evict must be null, 'lru' or 'lfu', got 'fifo'"),
                         ({"size": 3}, "variables[0].dynamic.size: unknown key"),
                         ({"capacity": None, "evict": "lru"}, "evict='lru' needs a capacity")]:
        with pytest.raises(config.ConfigError, match=re.escape(message)):
            config.load({"variables": [{"match": "users.*", "dynamic": bad}]})
    with pytest.raises(config.ConfigError, match="unknown key"):
        config.load({"defaults": {"sparse": {"dynamic": {"capacity": 3}}}})
