"""The per-row statistical efficiency of PS tables under row-adaptive rules (hybridsync/adaptive/rows.py):
Pollux's formula when the rows are equally frequent, the rows' own noise scales when they are not."""
import numpy as np
import pytest

from hybridsync.adaptive import Adaptive, AdaptiveConfig, ThroughputModel, efficiency
from hybridsync.adaptive.rows import RowProfile, efficiency_model


def _zipf_ids(rng, rows, samples, a=1.1):
    p = 1.0 / np.arange(1, rows + 1) ** a
    return rng.choice(rows, size=samples, p=p / p.sum()), p / p.sum()


def test_equally_frequent_rows_give_pollux_efficiency():
    profile = RowProfile(smoothing=0.0)
    profile.observe(np.arange(512), 512)  # every row once: no frequency information
    model = efficiency_model({"t": {"sqr": 2.0, "var": 2000.0}}, {"t": profile})
    for batch in (512, 2048, 16384):
        assert model(batch, 512) == pytest.approx(efficiency(batch, 512, 1000.0), rel=1e-9)


def test_skewed_rows_match_the_sum_of_the_rows_own_efficiencies():
    """A table whose rows occur with Zipf frequencies p_r, each occurrence's gradient a common mean
    plus noise: the rows' true |G_r|^2 and tr(Sigma_r) are known, so is the exact progress
    sum_r |G_r|^2 / (phi_r + M). The profile, from the ids of sampled batches and the table's
    measured (pooled) noise scale only, gives the same efficiencies; the pooled formula does not."""
    rng = np.random.default_rng(0)
    rows, mu2, noise2 = 20_000, 1.0, 800.0  # |mean occurrence gradient|^2, its noise variance
    profile = RowProfile(smoothing=0.9)
    for _ in range(60):
        ids, p = _zipf_ids(rng, rows, 4096)
        profile.observe(ids, 4096)
    sqr_r = p ** 2 * mu2  # E[g] = p mu per sample
    var_r = p * (mu2 + noise2) - p ** 2 * mu2  # per-sample variance of the sparse gradient
    sqr, var = sqr_r.sum(), var_r.sum()
    truth = lambda m: np.sum(sqr_r / (var_r / sqr_r + m))
    model = efficiency_model({"t": {"sqr": sqr, "var": var}}, {"t": profile})
    for batch, base in ((1024, 256), (8192, 1024), (4096, 512)):
        exact = truth(batch) / truth(base)
        assert model(batch, base) == pytest.approx(exact, rel=0.1)
        # the pooled noise scale sees less than half the efficiency a bigger batch loses
        assert 1 - efficiency(batch, base, var / sqr) < 0.5 * (1 - exact)


def test_dense_and_profiled_terms_are_weighted_by_their_gradient():
    profile = RowProfile(smoothing=0.0)
    profile.observe(np.arange(100), 100)
    stats = {"dense": {"sqr": 3.0, "var": 300.0}, "table": {"sqr": 1.0, "var": 5000.0}}
    model = efficiency_model(stats, {"table": profile})
    progress = lambda m: 3.0 / (100.0 + m) + 1.0 / (5000.0 + m)
    assert model(800, 100) == pytest.approx(progress(800) / progress(100))
    assert efficiency_model({"t": {"sqr": -1.0, "var": 5.0}}, {}) is None  # no signal yet


def test_word2vec_like_table_keeps_the_small_base_batch():
    """Throughput that grows ~12% from a 256 to a 2048 batch: the pooled noise scale (30k) says
    grow; with the rows' frequencies the efficiency lost outweighs it, and the base is kept."""
    rng = np.random.default_rng(1)
    throughput = ThroughputModel()
    for b in (128, 256, 512):
        throughput.record(2, b, 1.5e-5 * b, 2.6e-4)
    stats = {"w": {"sqr": 1.0, "var": 30_000.0}}
    chosen = {}
    for name, profiled in (("pooled", False), ("rows", True)):
        a = Adaptive(AdaptiveConfig(local_batch_size=128, min_gain=1.05), "Adagrad", world_size=2)
        a.throughput = throughput
        a.stats.observe("w", stats["w"]["sqr"] + stats["w"]["var"] / 128, 128,
                        stats["w"]["sqr"] + stats["w"]["var"] / 256, 256)
        if profiled:
            for _ in range(20):
                a.observe_rows("w", _zipf_ids(rng, 20_000, 128)[0], 128)
        choice = a.choose(16384, (64, 8192), 1)
        chosen[name] = choice.global_batch if choice is not None else a.global_batch()
    assert chosen["pooled"] > 256
    assert chosen["rows"] == 256


def test_profiles_survive_the_state_dict():
    a = Adaptive(AdaptiveConfig(local_batch_size=8), "Adagrad", world_size=2)
    a.stats.observe("w", 1.0 + 500.0 / 8, 8, 1.0 + 500.0 / 16, 16)
    a.observe_rows("w", np.array([0, 0, 0, 1, 2, 3, 3, 4]), 8)
    b = Adaptive(AdaptiveConfig(local_batch_size=8), "Adagrad", world_size=3)
    b.load_state_dict(a.state_dict())
    assert b.efficiency_model()(64, 16) == pytest.approx(a.efficiency_model()(64, 16))


def test_growth_is_bounded_by_what_was_measured():
    """With one batch size measured, the step-time lines are a guess: a choice goes at most
    `explore` times beyond the largest local batch measured, then further once that is measured."""
    a = Adaptive(AdaptiveConfig(local_batch_size=16, explore=2.0), "SGD", world_size=2)
    a.throughput.record(2, 16, 0.0001 * 16, 0.05)  # a large sync per step: the biggest batch looks best
    a.stats.observe("w", 1.0 + 1e6 / 16, 16, 1.0 + 1e6 / 32, 32)  # all noise: no statistical cost
    first = a.choose(4096, (8, 2048), 1)
    assert first.local_batch == 32
    a.set_batch(first.local_batch)
    a.throughput.record(2, 32, 0.0001 * 32, 0.05)
    assert a.choose(4096, (8, 2048), 1).local_batch == 64
