"""The cost model of `sync: auto` (hybridsync/sync/cost_model.py), the candidate routes per
optimizer, the probe cache's name, and the config / environment switches of auto."""
import json

import pytest

from hybridsync.comm.probe import Links, cache_path
from hybridsync.planning import estimate as cost_model, report
from hybridsync.planning.choose import candidates_for
from hybridsync.planning.estimate import ALLGATHER, DENSE, PS, TableStats, decide
from hybridsync.ps.rules import OptimizerSpec

NET = Links(p2p_latency_s=20e-6, p2p_bandwidth=1.25e9, allreduce_latency_s=40e-6, allreduce_bandwidth=0.6e9,
            memory_bandwidth=5e9)


def _stats(rows=100_000, dim=32, p=4, per_rank=100.0, union=None, placement="sharded", **kw):
    return TableStats(name="t", num_rows=rows, dim=dim, world_size=p, placement=placement, rows_per_rank=per_rank,
                      union_rows=per_rank * p if union is None else union, **kw)


def test_a_densely_touched_table_goes_to_allreduce():
    s = _stats(rows=1000, dim=16, per_rank=950, union=1000)
    d = decide(s, NET, current_shards=4)
    assert d.route == DENSE and d.shards == 0, d
    assert d.predicted_s[DENSE] < d.predicted_s[PS] and d.predicted_s[DENSE] < d.predicted_s[ALLGATHER]
    assert d.margin > cost_model.SWITCH_THRESHOLD


def test_a_sparsely_touched_table_stays_on_the_ps():
    d = decide(_stats(rows=1_000_000, dim=64, per_rank=2000), NET, current_shards=4)
    assert d.route == PS and d.shards >= 1, d
    assert d.predicted_s[DENSE] > 10 * d.predicted_s[PS]
    assert 0 < d.margin < 1


def test_allgather_wins_over_ps_only_when_latency_rules_and_ranks_are_few():
    # Gathered bytes grow with the world size; at 64 ranks the PS is far ahead.
    big = decide(_stats(rows=10_000_000, dim=64, p=64, per_rank=20_000), NET, current_shards=64)
    assert big.predicted_s[ALLGATHER] > 3 * big.predicted_s[PS], big


def test_density_and_bytes():
    s = _stats(rows=1000, dim=8, p=2, per_rank=10, union=15)
    assert s.density == pytest.approx(0.015)
    assert s.bytes_per_step == pytest.approx(10 * (32 + 8))


def test_predictions_grow_with_the_work():
    small, large = _stats(per_rank=100), _stats(per_rank=10_000)
    assert cost_model.ps(large, NET, 4) > cost_model.ps(small, NET, 4)
    assert cost_model.allgather(large, NET) > cost_model.allgather(small, NET)
    assert cost_model.allreduce_as_dense(_stats(rows=10**6), NET) > cost_model.allreduce_as_dense(_stats(rows=10**4), NET)
    slow = Links(**{**NET.to_json(), "p2p_bandwidth": NET.p2p_bandwidth / 10})
    assert cost_model.ps(large, slow, 4) > cost_model.ps(large, NET, 4)


def test_a_table_all_reduced_as_dense_pays_a_collective_of_its_own():
    # Its gradient is final last in backward: it cannot ride on the dense layers' all-reduce.
    s = _stats(rows=10)
    unmeasured = cost_model.allreduce_as_dense(s, NET)
    measured = cost_model.allreduce_as_dense(s, Links(**{**NET.to_json(), "collective_s": 1e-3}))
    assert measured - unmeasured == pytest.approx(1e-3 - NET.allreduce_latency_s)


def test_partition_count_few_rows_prefer_fewer_shards_many_rows_more():
    few = decide(_stats(rows=100_000, dim=8, p=4, per_rank=5, candidates=(PS,)), NET, current_shards=4)
    assert few.route == PS and few.shards == 1, few.ps_by_shards
    many = decide(_stats(rows=10_000_000, dim=128, p=4, per_rank=200_000, candidates=(PS,)), NET, current_shards=4)
    assert many.shards == 4, many.ps_by_shards
    assert set(many.ps_by_shards) == {1, 2, 3, 4}


def test_the_current_route_is_kept_within_the_switch_threshold(monkeypatch):
    s = _stats(rows=1000, dim=16, p=2, per_rank=950, union=1000, candidates=(PS, DENSE))
    ps_time = min(cost_model.ps(s, NET, k) for k in (1, 2))
    monkeypatch.setattr(cost_model, "allreduce_as_dense", lambda stats, links: 0.95 * ps_time)
    kept = decide(s, NET, current_shards=2)
    assert kept.route == PS and kept.margin < 0 and "kept on ps" in kept.why, kept
    monkeypatch.setattr(cost_model, "allreduce_as_dense", lambda stats, links: 0.5 * ps_time)
    moved = decide(s, NET, current_shards=2)
    assert moved.route == DENSE and moved.margin == pytest.approx(0.5), moved
    # Re-sharding moves every row: the current shard count stays unless another is clearly faster.
    only_ps = _stats(rows=1000, dim=16, p=2, per_rank=950, union=1000, candidates=(PS,))
    monkeypatch.setattr(cost_model, "ps", lambda stats, links, k: {1: 1.0, 2: 1.05}[k])
    assert decide(only_ps, NET, current_shards=2).shards == 2
    monkeypatch.setattr(cost_model, "ps", lambda stats, links, k: {1: 1.0, 2: 1.5}[k])
    assert decide(only_ps, NET, current_shards=2).shards == 1


def test_only_ps_when_no_other_route_applies_the_same_update():
    d = decide(_stats(rows=1000, dim=16, per_rank=950, union=1000, candidates=(PS,)), NET, current_shards=4)
    assert d.route == PS and set(d.predicted_s) == {PS} and "only ps" in d.why


@pytest.mark.parametrize("family,applies,exact,source,want", [
    ("sgd", True, True, "wrapped", (PS, ALLGATHER, DENSE)),
    ("adagrad", True, True, "wrapped", (PS, ALLGATHER, DENSE)),
    ("adagrad", True, False, "wrapped", (PS, DENSE)),  # Keras: duplicate rows square separately
    ("adam", False, False, "wrapped", (PS,)),  # torch Adam: dense moments decay every row
    ("adam", True, True, "wrapped", (PS, ALLGATHER)),  # SparseAdam: lazy, like the server
    ("sgd", True, True, "config", (PS,)),  # a server optimizer from the config is not the wrapped one
])
def test_candidates(family, applies, exact, source, want):
    spec = OptimizerSpec("X", family, {}, applies_sparse=applies, sparse_exact=exact)
    assert candidates_for(spec, source) == want


def test_decision_json_round_trips():
    d = decide(_stats(rows=1000, dim=16, per_rank=950, union=1000), NET, current_shards=4)
    j = json.loads(json.dumps(d.to_json()))
    assert j["choice"] == DENSE and set(j["predicted_ms"]) == {PS, ALLGATHER, DENSE} and j["margin"] > 0
    line = report.describe_auto("emb", {"status": "decided", **j, "measured": {"density": 0.95}}, (1000, 16))
    assert "density 95.00%" in line and "choice: allreduce-as-dense" in line and "margin +" in line


def test_probe_cache_is_per_sorted_host_set(tmp_path):
    a = cache_path(["b", "a", "a"], str(tmp_path))
    assert a == cache_path(["a", "b", "a"], str(tmp_path)) and a.startswith(str(tmp_path))
    assert a != cache_path(["a", "b"], str(tmp_path)) and a.split("/")[-1].startswith("links-")


def test_auto_settings_from_the_environment(monkeypatch):
    from hybridsync import settings as settings_mod

    for raw, want in (("off", False), ("0", False), ("on", True), ("", True)):
        monkeypatch.setenv("HYBRIDSYNC_AUTO", raw)
        settings_mod.settings.cache_clear()
        assert settings_mod.settings().auto is want
    monkeypatch.setenv("HYBRIDSYNC_AUTO", "sometimes")
    settings_mod.settings.cache_clear()
    with pytest.raises(settings_mod.SettingsError, match="HYBRIDSYNC_AUTO"):
        settings_mod.settings()
    monkeypatch.setenv("HYBRIDSYNC_AUTO", "on")
    monkeypatch.setenv("HYBRIDSYNC_AUTO_STEPS", "0")
    settings_mod.settings.cache_clear()
    with pytest.raises(settings_mod.SettingsError, match="HYBRIDSYNC_AUTO_STEPS"):
        settings_mod.settings()
    monkeypatch.setenv("HYBRIDSYNC_AUTO_STEPS", "7")
    settings_mod.settings.cache_clear()
    assert settings_mod.settings().auto_steps == 7
    monkeypatch.delenv("HYBRIDSYNC_AUTO")
    monkeypatch.delenv("HYBRIDSYNC_AUTO_STEPS")
    settings_mod.settings.cache_clear()


def test_config_auto_keys(tmp_path):
    from hybridsync import config

    path = tmp_path / "hs.yaml"
    path.write_text("defaults:\n  sparse: {sync: auto}\nauto_steps: 5\n")
    cfg = config.load(str(path))
    assert cfg.sparse.sync == "auto" and cfg.auto_steps == 5
    path.write_text("auto_steps: 0\n")
    with pytest.raises(config.ConfigError, match=r"hs.yaml:1: auto_steps: expected an integer >= 1"):
        config.load(str(path))


def _hosts(hosts, ranks_per_host, cpus_per_host=0, **kw):
    return Links(**{**NET.to_json(), "hosts": hosts, "ranks_per_host": ranks_per_host,
                    "cpus_per_host": cpus_per_host, **kw})


def test_across_hosts_the_ranks_of_a_host_share_its_link():
    s = _stats(rows=1_000_000, dim=32, p=4, per_rank=1000, candidates=(PS, ALLGATHER))
    row = 4 * 32 + cost_model.ID_BYTES
    one, two = _hosts(2, 1), _hosts(2, 2)  # 4 hosts x 1 rank would be hosts=4; here the link load only
    shared = cost_model.allgather(s, two) - cost_model.allgather(s, one)
    # 2 ranks per host: each host link carries 2 x 2 ranks' rows instead of 1 x 3.
    assert shared == pytest.approx((2 * 2 - 1 * 3) * 1000 * row / NET.p2p_bandwidth)
    # The PS sends only the rows of other hosts' shards: fewer bytes than allgather on the link.
    pull, total = cost_model._ps_bytes(s, two, 4)
    assert pull < total < 2 * 2 * 1000 * row
    # One shard: the host without it sends all its ranks' rows; spread shards split the load.
    assert cost_model._ps_bytes(s, two, 1)[1] > total


def test_a_sharded_table_waits_for_its_pull_and_its_push():
    links = _hosts(2, 2)
    s = _stats(rows=1_000_000, dim=32, p=4, per_rank=1000)
    pull, total = cost_model._ps_bytes(s, links, 4)
    # The push leaves at the end of the step and the next pull follows it on the same link.
    assert 1.5 * pull < total
    assert cost_model.ps(s, links, 4) > total / NET.p2p_bandwidth


def test_more_ranks_than_cpus_stretch_the_cpu_terms_only():
    s = _stats(rows=100_000, dim=32, p=4, per_rank=500)
    alone, crowded = _hosts(2, 2, cpus_per_host=2), _hosts(2, 2, cpus_per_host=1)
    dense = cost_model.allreduce_as_dense(s, crowded) - cost_model.allreduce_as_dense(s, alone)
    assert dense == pytest.approx(cost_model.DENSE_PASSES * 100_000 * 128 / NET.memory_bandwidth)
    assert cost_model.ps(s, crowded, 4) > cost_model.ps(s, alone, 4)
    assert cost_model.allgather(s, _hosts(2, 2, cpus_per_host=0)) == cost_model.allgather(s, alone)  # unknown: 1x


def test_allgather_pays_two_collectives_of_the_dense_backend_when_measured():
    s = _stats(per_rank=10)
    base = cost_model.allgather(s, NET)
    slow = cost_model.allgather(s, Links(**{**NET.to_json(), "collective_s": 1e-3}))
    assert slow - base == pytest.approx(2e-3 - 4 * NET.allreduce_latency_s)


def test_probe_cache_of_an_older_format_is_probed_again(tmp_path):
    from hybridsync.comm import probe

    path = tmp_path / "links-x.json"
    old = {k: v for k, v in NET.to_json().items() if k != "format"}
    path.write_text(json.dumps(old))
    assert probe._read(str(path)) is None
    path.write_text(json.dumps(NET.to_json()))
    assert probe._read(str(path))["format"] == probe.FORMAT
