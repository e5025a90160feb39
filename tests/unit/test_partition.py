"""The Python partitioner is the twin of the C++ one, and both cover every row exactly once."""
import numpy as np
import pytest

from hybridsync import _ps_testing as native
from hybridsync.ps.partition import Partition


@pytest.mark.parametrize("kind", ["cyclic", "block"])
@pytest.mark.parametrize("rows, shards", [(0, 1), (1, 3), (10, 3), (11, 4), (250, 7), (5, 5), (3, 5)])
def test_python_and_cpp_partitioners_agree(kind, rows, shards):
    py, cpp = Partition(rows, shards, kind), native.Partitioner(rows, shards, kind)
    ids = np.arange(rows)
    for i in ids:
        assert py.shard_of(i) == cpp.shard_of(int(i))
        assert py.local_index(i) == cpp.local_index(int(i))
    for s in range(shards):
        assert py.shard_rows(s) == cpp.shard_rows(s)
        for local in range(py.shard_rows(s)):
            assert py.global_id(s, local) == cpp.global_id(s, local)


@pytest.mark.parametrize("kind", ["cyclic", "block"])
@pytest.mark.parametrize("rows, shards", [(10, 3), (1001, 8), (7, 2)])
def test_every_row_has_exactly_one_home(kind, rows, shards):
    p = Partition(rows, shards, kind)
    homes = np.concatenate([p.rows_of(s) for s in range(shards)])
    np.testing.assert_array_equal(np.sort(homes), np.arange(rows))
    for s in range(shards):
        np.testing.assert_array_equal(p.shard_of(p.rows_of(s)), s)
        np.testing.assert_array_equal(p.local_index(p.rows_of(s)), np.arange(p.shard_rows(s)))


def test_cyclic_spreads_hot_small_ids_over_all_shards():
    p = Partition(250_000, 4, "cyclic")
    assert sorted(set(p.shard_of(np.arange(8)).tolist())) == [0, 1, 2, 3]
    # Workers deduplicate, so a shard's load is the unique rows it serves per batch. With
    # Zipf ids, cyclic keeps those within 15% across shards; row blocks pile them on shard 0.
    rng = np.random.default_rng(0)
    cyclic, block = np.zeros(4), np.zeros(4)
    for _ in range(10):
        unique = np.unique(rng.zipf(1.2, 4096) % 250_000)
        cyclic += np.bincount(p.shard_of(unique), minlength=4)
        block += np.bincount(Partition(250_000, 4, "block").shard_of(unique), minlength=4)
    assert cyclic.max() / cyclic.min() < 1.15
    assert block[0] > 2 * block[1:].sum()


def test_bad_partition_arguments():
    with pytest.raises(ValueError, match="unknown partition 'hash'"):
        Partition(10, 2, "hash")
    with pytest.raises(ValueError, match="unknown partition 'hash'"):
        native.Partitioner(10, 2, "hash")
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        native.Partitioner(10, 0, "cyclic")
