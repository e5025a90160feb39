"""hybridsync.adaptive without MPI: the estimator, the smoothing, each scaling rule's formula,
the throughput model and the batch choice."""
import math

import numpy as np
import pytest

from hybridsync.adaptive import Adaptive, AdaptiveConfig, GradientStats, ThroughputModel, choose_batch, estimate
from hybridsync.adaptive import efficiency, rule_for, scaling


def _times(a, world, local_batch, micro_s, sync_s, steps=5):
    """`steps` identical step times at one size: a median with no spread (decided at min_gain)."""
    for _ in range(steps):
        a.throughput.record(world, local_batch, micro_s, sync_s)


def _observe(a, noise_scale, small, big, steps=5, sqr=1.0):
    """`steps` identical steps' statistics: a noise scale with no spread."""
    for _ in range(steps):
        a.stats.observe("w", sqr + sqr * noise_scale / small, small, sqr + sqr * noise_scale / big, big)


def test_estimate_solves_the_two_batch_equations_exactly():
    sqr, var = 2.0, 30.0  # |G|^2 and tr(Sigma) per sample
    small = sqr + var / 8
    big = sqr + var / 32
    assert estimate(small, 8, big, 32) == pytest.approx((sqr, var))
    with pytest.raises(ValueError, match="big_batch > small_batch"):
        estimate(small, 8, big, 8)


def test_smoothed_estimates_converge_on_noisy_gradients():
    rng = np.random.default_rng(0)
    dim, b, n = 50, 4, 3
    G = rng.normal(size=dim) * 0.3
    stats = GradientStats(smoothing=0.99)
    for _ in range(2000):  # per-sample gradients G + unit noise: tr(Sigma) = dim
        local = [G + rng.normal(size=(b, dim)).mean(0) for _ in range(n)]
        mean_local_sq = np.mean([g @ g for g in local])
        big = np.mean(local, axis=0)
        stats.observe("w", mean_local_sq, b, big @ big, b * n)
    s = stats.summary()
    assert s["sqr"] == pytest.approx(G @ G, rel=0.2)
    assert s["var"] == pytest.approx(dim, rel=0.1)
    assert s["noise_scale"] == pytest.approx(dim / (G @ G), rel=0.25)


def test_bias_correction_gives_the_first_value_unshrunk():
    stats = GradientStats(smoothing=0.9)
    stats.observe("w", 3.0, 1, 2.0, 2)  # sqr = 1, var = 2
    s = stats.summary()
    assert s["sqr"] == pytest.approx(1.0) and s["var"] == pytest.approx(2.0)
    assert s["by_variable"]["w"] == {"sqr": pytest.approx(1.0), "var": pytest.approx(2.0)}
    restored = GradientStats(smoothing=0.9)
    restored.load_state_dict(stats.state_dict())
    assert restored.summary() == s


def test_the_smoothing_remembers_samples_not_steps():
    """A step of 4 base batches decays the average as 4 base steps do: after a change of the
    truth, a big batch's estimate has moved as far per sample as a small one's (per step it
    would lag 4x behind in samples -- the DLRM large batch's stale noise scale)."""
    small, big = GradientStats(smoothing=0.9), GradientStats(smoothing=0.9)
    for sqr in (1.0, 3.0):  # the truth changes after 40 base batches' worth of samples
        for _ in range(40):
            small.observe("w", sqr + 5.0 / 8, 8, sqr + 5.0 / 16, 16, weight=1.0)
        for _ in range(10):
            big.observe("w", sqr + 5.0 / 32, 32, sqr + 5.0 / 64, 64, weight=4.0)
    assert big.summary()["sqr"] == pytest.approx(small.summary()["sqr"], rel=1e-9)
    assert small.summary()["sqr"] == pytest.approx(3.0 - 2.0 * 0.9 ** 40 / (1 + 0.9 ** 40), rel=1e-9)
    with pytest.raises(ValueError, match="weight must be > 0"):
        big.observe("w", 1.0, 1, 1.0, 2, weight=0.0)


@pytest.mark.parametrize("scale", [1.0, 2.0, 3.5, 8.0])
def test_each_rule_gives_its_formula(scale):
    sqr, var, m0 = 0.5, 40.0, 16
    expected_gain = (var / m0 + sqr) / (var / (scale * m0) + sqr)
    assert scaling.adascale(scale, sqr, var, m0) == pytest.approx(expected_gain, rel=1e-12)
    assert scaling.sqrt(scale, sqr, var, m0) == math.sqrt(scale)
    assert scaling.linear(scale, sqr, var, m0) == scale
    phi = var / sqr
    assert scaling.adagrad(scale, sqr, var, m0) == pytest.approx(math.sqrt((scale * m0 + phi) / (m0 + phi)), rel=1e-12)
    assert scaling.adagrad(scale, sqr, var, m0) == pytest.approx(math.sqrt(scale / expected_gain), rel=1e-12)
    assert 1.0 <= scaling.gain(scale, sqr, var, m0) <= scale


def test_gain_limits_and_rule_choice():
    assert scaling.gain(4.0, 1.0, 0.0, 8) == 1.0  # no noise: a bigger batch is worth one step
    assert scaling.gain(4.0, 0.0, 1.0, 8) == 4.0  # all noise: worth `scale` steps
    assert scaling.gain(4.0, math.nan, math.nan, 8) == 1.0  # no statistics yet
    assert rule_for("auto", "SGD") == "adascale"
    assert rule_for(None, "Adam") == "sqrt" and rule_for("auto", "Adagrad") == "none"
    assert scaling.none(8.0, 1.0, 1.0, 16) == 1.0
    assert rule_for("linear", "Adam") == "linear"
    with pytest.raises(ValueError, match="scaling_rule: unknown rule 'cubic'"):
        rule_for("cubic", "SGD")


def _adagrad_displacement(batch, lr, samples, rng, dim=200, signal=0.1, sigma=1.0):
    """Adagrad on gradients G + per-sample noise (the loss's slope is constant): how far the
    parameters moved along G after `samples` samples at `batch`."""
    x, acc = np.zeros(dim), np.zeros(dim)
    for _ in range(samples // batch):
        g = signal + rng.normal(size=dim) * sigma / math.sqrt(batch)
        acc += g * g
        x -= lr * g / np.sqrt(acc)
    return -x.mean() / 1.0


def test_adagrad_rule_keeps_progress_per_sample():
    """Adagrad's denominator sums past squared gradients, so a bigger batch's smaller noise
    already lengthens its steps: the sqrt rule's LR overshoots (twice the displacement of the
    base batch after the same samples here), the adagrad rule's keeps it within 10%."""
    rng = np.random.default_rng(0)
    dim, signal, sigma, m0, scale, samples = 200, 0.1, 1.0, 16, 8, 128 * 200
    sqr, var = dim * signal ** 2, dim * sigma ** 2  # noise scale 100
    base = np.mean([_adagrad_displacement(m0, 0.01, samples, rng) for _ in range(4)])
    for rule, lo, hi in (("adagrad", 0.9, 1.1), ("sqrt", 1.7, 2.3)):
        lr = 0.01 * scaling.RULES[rule](scale, sqr, var, m0)
        big = np.mean([_adagrad_displacement(m0 * scale, lr, samples, rng) for _ in range(4)])
        assert lo < big / base < hi, (rule, big / base)
    assert scaling.adagrad(scale, 1.0, 0.0, m0) == pytest.approx(math.sqrt(scale))  # no noise: sqrt
    assert scaling.adagrad(scale, 1e-12, 1.0, m0) == pytest.approx(1.0)  # all noise: 1
    assert scaling.adagrad(scale, math.nan, math.nan, m0) == 1.0  # no statistics yet


@pytest.mark.parametrize("signal, sigma", [(0.01, 1.0), (0.1, 1.0), (1.0, 0.01)])  # noise scale 1e4, 100, 1e-4
def test_adagrad_at_an_unscaled_lr_makes_gain_base_steps_per_step(signal, sigma):
    """Why 'auto' leaves Adagrad's LR alone: at factor 1, T steps at 8x the base batch move the
    parameters as far as gain * T base steps do -- AdaScale's notion of progress, which the
    scale-invariant steps count -- whether the noise dominates (gain ~8), does not (gain 1) or
    neither (gain ~4)."""
    rng = np.random.default_rng(1)
    dim, m0, scale, steps = 200, 16, 8, 200
    gain = scaling.gain(scale, dim * signal ** 2, dim * sigma ** 2, m0)
    big = np.mean([_adagrad_displacement(m0 * scale, 0.01, m0 * scale * steps, rng, dim, signal, sigma)
                   for _ in range(8)])
    base = np.mean([_adagrad_displacement(m0, 0.01, m0 * round(gain * steps), rng, dim, signal, sigma)
                    for _ in range(8)])
    assert 0.9 < big / base < 1.1, (gain, big / base)


def test_controller_lr_factor_and_scale_invariant_progress():
    a = Adaptive(AdaptiveConfig(scaling_rule="adascale", local_batch_size=8, smoothing=0.0), "SGD", world_size=2)
    assert a.base_batch == 16 and a.lr_factor() == 1.0
    a.stats.observe("w", 1.0 + 10.0 / 8, 8, 1.0 + 10.0 / 16, 16)  # sqr 1, var 10
    a.set_batch(16, 2)  # global 64 = 4x the base
    want = (10.0 / 16 + 1.0) / (10.0 / 64 + 1.0)
    assert a.lr_factor() == pytest.approx(want, rel=1e-12)
    a.step_done()
    a.step_done()
    assert a.progress == pytest.approx(2 * want)
    off = Adaptive(AdaptiveConfig(scaling_rule=None, local_batch_size=8), "SGD", world_size=2)
    off.set_batch(64)
    assert off.lr_factor() == 1.0


def test_statistics_need_the_local_batch_size():
    with pytest.raises(RuntimeError, match="local_batch_size"):
        Adaptive(AdaptiveConfig(), "SGD", world_size=2).gradient_stats()


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown key.*smoothness"):
        AdaptiveConfig.of({"smoothness": 0.9})
    assert AdaptiveConfig.of(True).scaling_rule == "auto" and AdaptiveConfig.of(None) is None


def test_throughput_model_fits_lines_and_efficiency():
    m = ThroughputModel()
    for b in (8, 16, 32, 64):
        m.record(2, b, 0.001 + 0.0001 * b, 0.004 + 0.00001 * b)
    ac, bc, as_, bs = m.params(2)
    assert (ac, bc, as_, bs) == pytest.approx((0.001, 0.0001, 0.004, 0.00001), rel=1e-6)
    assert m.step_time(2, 10, 3) == pytest.approx(3 * (0.001 + 0.001) + 0.004 + 0.0001)
    assert efficiency(64, 16, 0.0) == pytest.approx(0.25)  # no noise: 4x the samples for one step's worth
    assert efficiency(64, 16, 1e12) == pytest.approx(1.0)


def test_an_evaluation_every_so_many_samples_is_not_a_cost_of_the_batch():
    """Steps take 10 ms + 10 us per sample; every 8192 samples one step also runs a 100 ms
    evaluation -- every 16th step at 512, every 8th at 1024. Per batch size medians see through
    it: the fitted slope stays at 10 us (a least-squares line through the raw steps gave 3.4x)."""
    model = ThroughputModel()
    for b, every in ((256, 16), (512, 8)):
        for step in range(48):
            model.record(2, b, 0.010 + 1e-5 * b + (0.100 if step % every == every - 1 else 0.0), 0.004)
    ac, bc, as_, bs = model.params(2)
    assert (ac, bc, as_, bs) == (pytest.approx(0.010), pytest.approx(1e-5), pytest.approx(0.004), pytest.approx(0.0, abs=1e-12))
    b, micro = zip(*[(b, m) for b, rows in model._samples[2].items() for m, _, _ in rows])
    assert np.polyfit(b, micro, 1)[0] > 3e-5  # what the raw fit made of it


def _peers(rows: dict):
    """A sum all-reduce of exchange.gather_rows' table as this rank sees it when rank r took
    part with rows[r] (the ranks not in rows called join(): their rows stay zero)."""
    def allreduce_sum(table, name):
        for r, row in rows.items():
            table[r, 0], table[r, 1:] = 1.0, row
        return table
    return allreduce_sum


def _dense_step(world, rank, grads, batch, joined=()):
    """One step's statistics on `rank` of `world` ranks whose local dense gradients are grads[r]
    (ranks in `joined` called join(): no gradient, zeros in the all-reduce, as in Horovod)."""
    from hybridsync.adaptive.collect import StepRecorder

    a = Adaptive(AdaptiveConfig(local_batch_size=batch, smoothing=0.5), "SGD", world_size=world)
    recorder = StepRecorder(a, world, rank)
    stepping = [r for r in range(world) if r not in joined]
    recorder.dense_in("w", grads[rank])
    recorder.dense_out("w", sum(grads[r] for r in stepping) / world, summed=False)  # Average over the world
    recorder.end_step(_peers({r: [float(grads[r] @ grads[r]), 0.0, 0.0, batch, 1, 1.0, 1.0]
                              for r in stepping if r != rank}))
    return a.stats.summary()


def test_a_joined_rank_contributes_nothing_to_the_statistics():
    """Rank 2 joined: the statistics of ranks 0 and 1 are those of a world of two (its zeros
    neither count as a rank's gradient nor dilute the combined one), the same on both ranks."""
    rng = np.random.default_rng(0)
    grads = [rng.normal(1.0, 2.0, 5) for _ in range(3)]
    alone = _dense_step(2, 0, grads[:2], 8)
    for rank in (0, 1):
        seen = _dense_step(3, rank, grads, 8, joined=(2,))
        assert seen["sqr"] == pytest.approx(alone["sqr"]) and seen["var"] == pytest.approx(alone["var"])
    # One rank left stepping: its gradient is the combined one, nothing to learn from.
    assert np.isnan(_dense_step(3, 0, grads, 8, joined=(1, 2))["noise_scale"])


def test_the_batch_decision_is_the_lowest_stepping_ranks():
    from hybridsync.adaptive.exchange import _encode_choice, agree_on_decision
    from hybridsync.adaptive.goodput import BatchChoice

    mine, theirs = BatchChoice(8, 2, 3, 123.5, 0.75), BatchChoice(16, 1, 3, 99.0, 0.5)
    # Rank 0 joined; rank 1 decides for ranks 1 and 2 (rank 2 adopts it).
    row = _encode_choice(mine) + _encode_choice(theirs)
    assert agree_on_decision(_peers({1: row}), 2, 3, None, None) == (mine, theirs)
    assert agree_on_decision(_peers({2: _encode_choice(None) * 2}), 1, 3, mine, theirs) == (mine, theirs)


def test_a_fast_ranks_wait_is_not_counted_twice():
    """Rank 0 computes 15 ms and syncs 4; rank 1 computes 4 and waits 15 for rank 0: the step
    took 19 ms, of which 15 compute (adding the two ranks' maxima made it 30)."""
    from hybridsync.adaptive.collect import StepRecorder

    a = Adaptive(AdaptiveConfig(local_batch_size=8), "SGD", world_size=2)
    recorder = StepRecorder(a, 2)
    recorder.last_times = (0.015, 0.004, 8, 1)
    # rank 1's row: its step times, then whether its numbers (this step's, the previous push's) were finite
    recorder.end_step(_peers({1: [0.004, 0.015, 8, 1, 1.0, 1.0]}))
    assert a.throughput._samples[2] == {8: [(0.015, pytest.approx(0.004), 1)]}
    assert a.throughput.step_time(2, 8) == pytest.approx(0.019)


def test_the_step_clock_leaves_out_what_the_loop_does_between_steps(monkeypatch):
    """A step is timed from the loader's request for its first batch to its end: an evaluation
    between one step's end and the next request is not charged to the batch (timed from the
    previous end, the benchmark's evaluation landed in every other step at batch 4096). A
    request in the middle of a step (the next micro-batch) does not restart the clock; without
    the loader's requests the clock runs from the previous step's end."""
    from hybridsync.adaptive import collect

    now = [100.0]
    monkeypatch.setattr(collect.time, "perf_counter", lambda: now[0])
    a = Adaptive(AdaptiveConfig(local_batch_size=8), "SGD", world_size=2)
    a.set_batch(8, 2)
    recorder = collect.StepRecorder(a, 2)

    def step(evaluation_s, compute_s, requests=2):
        now[0] += evaluation_s  # the loop's own work after the previous step
        for _ in range(requests):  # micro-batch requests, compute in between
            recorder.step_started()
            now[0] += compute_s / requests
        now[0] += 0.0 if requests else compute_s
        recorder.step_ended()

    step(0.0, 0.020)
    assert recorder.last_times[0] == pytest.approx(0.010)  # per micro-step
    step(0.500, 0.020)
    assert recorder.last_times[0] == pytest.approx(0.010)
    step(0.030, 0.020, requests=0)  # a hand-written loop: from the previous end
    assert recorder.last_times[0] == pytest.approx(0.025)
    recorder.reset_clock()
    step(0.0, 0.020, requests=0)  # nothing to time from after a reset
    assert recorder.last_times[0] == pytest.approx(0.025)


def test_choice_grows_the_batch_with_the_noise_scale_and_respects_bounds():
    m = ThroughputModel()
    for b in (8, 16, 32):  # a fixed 10 ms sync per step: bigger batches amortise it
        m.record(2, b, 0.0001 * b, 0.01)
    small = choose_batch(m, 2, 16, noise_scale=4.0, max_batch=1024, local_bounds=(8, 512))
    large = choose_batch(m, 2, 16, noise_scale=2000.0, max_batch=1024, local_bounds=(8, 512))
    assert small.global_batch < large.global_batch <= 1024
    bounded = choose_batch(m, 2, 16, noise_scale=2000.0, max_batch=1024, local_bounds=(8, 64), max_accumulation=4)
    assert bounded.local_batch <= 64 and bounded.accumulation > 1
    assert bounded.global_batch <= 1024
    with pytest.raises(ValueError, match="local_bsz_bounds"):
        choose_batch(m, 2, 16, 1.0, 1024, (0, 4))


def test_choose_keeps_the_batch_unless_the_gain_is_worth_it():
    a = Adaptive(AdaptiveConfig(local_batch_size=8, min_gain=1.05), "SGD", world_size=2)
    for b in (8, 16):
        _times(a, 2, b, 0.0001 * b, 0.01)
    _observe(a, 5000.0, 8, 16)  # noise scale 5000: bigger is better
    choice = a.choose(4096, (8, 1024), 1)
    assert choice is not None and choice.global_batch > 16
    a.set_batch(choice.local_batch, choice.accumulation)
    assert a.choose(4096, (8, 1024), 1) is None  # already the best


def test_restart_at_another_world_size_keeps_the_global_batch():
    a = Adaptive(AdaptiveConfig(local_batch_size=32), "SGD", world_size=2)
    a.progress = 12.5
    state = a.state_dict()
    b = Adaptive(AdaptiveConfig(), "SGD", world_size=4)
    b.load_state_dict(state)
    assert b.global_batch() == 64 and b.local_batch == 16 and b.progress == 12.5 and b.base_batch == 64
    a.set_batch(12, 4)  # 96 on 2 ranks -> 8 x 4 on 3
    c = Adaptive(AdaptiveConfig(), "SGD", world_size=3)
    c.load_state_dict(a.state_dict())
    assert c.sizes() == (8, 4) and c.global_batch() == 96


def test_a_restored_batch_is_brought_within_the_loaders_limits():
    """2 x 4 on 2 ranks (16) is 1.3 x 4 per rank on 3, rounded to 1: under local_bsz_bounds
    (2, 12). The loader starts at the allowed batch nearest the restored one, and choose()
    replaces a batch that breaks the limits even when no choice beats it by min_gain (the
    intermittent CI failure of the 2 -> 3 restart test)."""
    from hybridsync.adaptive.batches import AdaptiveBatches
    from hybridsync.adaptive.goodput import allowed, nearest_allowed

    a = Adaptive(AdaptiveConfig(local_batch_size=6), "SGD", world_size=2)
    a.set_batch(2, 4)
    b = Adaptive(AdaptiveConfig(), "SGD", world_size=3)
    b.load_state_dict(a.state_dict())
    assert b.sizes() == (1, 4) and not allowed(3, 1, 4, 96, (2, 12), 8)
    batches = AdaptiveBatches(4096, 12, 0, 3)
    batches.set_autoscale(96, (2, 12), 8)
    batches.start(b, b.set_batch)
    assert b.sizes() == (4, 1)  # 12: nearest the restored 12, with the fewest micro-steps
    assert nearest_allowed(3, 88, 96, (2, 12), 8) == (10, 3)  # 90: 87 and 89 cannot be made
    assert nearest_allowed(3, 500, 96, (2, 12), 8) == (8, 4)  # over max_batch: 96 (fewest micro-steps)
    b.set_batch(1, 4)  # as if restored without the loader's limits
    b.throughput.record(3, 1, 0.0, 1.0)  # all fixed cost: a bigger batch is faster ...
    b.stats.observe("w", 1.0, 1, 1.0, 3)  # ... but with no noise it gains nothing: none beats min_gain
    chosen = b.choose(96, (2, 12), 8)
    assert chosen is not None and allowed(3, chosen.local_batch, chosen.accumulation, 96, (2, 12), 8)


def test_one_rank_measures_across_micro_steps_so_it_keeps_two():
    """A world of one has statistics only from accumulation micro-steps: with accumulation
    allowed it starts at the base batch in two, and no choice drops below two."""
    from hybridsync.adaptive.batches import AdaptiveBatches

    a = Adaptive(AdaptiveConfig(), "SGD", world_size=1)
    batches = AdaptiveBatches(1000, 16, 0, 1)
    batches.set_autoscale(256, (2, 128), 8)
    batches.start(a, a.set_batch)
    assert a.sizes() == (8, 2) and a.global_batch() == 16
    _times(a, 1, 8, 0.0, 1.0)  # all fixed cost per step: one big micro-step would be best
    _observe(a, 1e6, 8, 16)
    chosen = a.choose(256, (2, 128), 8)
    assert chosen is not None and chosen.accumulation >= 2 and chosen.global_batch > 16
    no_accumulation = AdaptiveBatches(1000, 16, 0, 1)
    no_accumulation.set_autoscale(256, (2, 128), 1)
    b = Adaptive(AdaptiveConfig(), "SGD", world_size=1)
    no_accumulation.start(b, b.set_batch)
    assert b.sizes() == (16, 1)


def test_statistics_restored_at_one_rank_choose_nothing_until_it_measures():
    """Resumed at 1 rank from a 2-rank run: the restored statistics (very noisy: a bigger batch
    would pay) are not this run's. Without accumulation nothing will ever measure: the batch is
    kept. With accumulation allowed, the same global batch in two micro-steps, which measure;
    from then on the choice is made again."""
    a = Adaptive(AdaptiveConfig(local_batch_size=16), "SGD", world_size=2)
    a.stats.observe("w", 1.0 + 1e6 / 16, 16, 1.0 + 1e6 / 32, 32)
    b = Adaptive(AdaptiveConfig(), "SGD", world_size=1)
    b.load_state_dict(a.state_dict())
    assert b.sizes() == (32, 1) and b.stats.ready() and not b.measured_here()
    b.throughput.record(1, 32, 0.0, 1.0)  # all fixed cost per step: a bigger batch would be faster
    assert b.choose(512, (2, 256), 1) is None and b.sizes() == (32, 1)
    chosen = b.choose(512, (2, 256), 4)
    assert (chosen.local_batch, chosen.accumulation) == (16, 2)
    b.set_batch(16, 2)
    _times(b, 1, 16, 0.0, 1.0)
    _observe(b, 1e6, 16, 32)  # the micro-steps' own statistics
    assert b.measured_here()
    chosen = b.choose(512, (2, 256), 4)
    assert chosen is not None and chosen.global_batch > 32 and chosen.accumulation >= 2


def test_batches_split_one_permutation_and_follow_the_choice():
    from hybridsync.adaptive.batches import AdaptiveBatches

    shares = [AdaptiveBatches(103, 12, rank, 3, seed=4).my_indices() for rank in range(3)]
    together = np.concatenate(shares)
    assert all(len(s) == 34 for s in shares) and len(set(together.tolist())) == 102  # disjoint, equal
    a = Adaptive(AdaptiveConfig(), "SGD", world_size=3)
    batches = AdaptiveBatches(103, 12, 0, 3, interval=2, warmup=2)
    batches.set_autoscale(48, (2, 16))
    batches.start(a, a.set_batch)
    assert a.sizes() == (4, 1) and a.base_batch == 12
    for b in (4, 8):
        _times(a, 3, b, 0.0001 * b, 0.01)
    _observe(a, 1e6, 4, 12)  # all noise: the biggest batch allowed
    sent = []
    sizes = []
    for idx in batches.epoch_batches(a, a.set_batch, lambda table, name: sent.append(name) or table):
        sizes.append(len(idx))
        a.step_done()
    assert sizes[:2] == [4, 4] and sizes[2] == 16 and batches.changes == [(2, 16, 1)]
    assert sent and a.choice.global_batch == 48
    with pytest.raises(ValueError, match="max_batch_size=8 is below batch_size=12"):
        batches.set_autoscale(8)


def test_growth_is_bounded_by_what_was_measured():
    """With one batch size measured, the step-time lines are a guess: a choice goes at most
    `explore` times beyond the largest local batch measured. Once a second size is measured the
    line extrapolates, as far beyond the largest as the measured sizes span, up to `explore`
    times more (explore^2 in all), and no further while the sizes span that much."""
    a = Adaptive(AdaptiveConfig(local_batch_size=16, explore=2.0), "SGD", world_size=2)
    _times(a, 2, 16, 0.0001 * 16, 0.05)  # a large sync per step: the biggest batch looks best
    _observe(a, 1e6, 16, 32)  # all noise: no statistical cost
    first = a.choose(4096, (8, 2048), 1)
    assert first.local_batch == 32 and first.kind == "probe"
    a.set_batch(first.local_batch)
    _times(a, 2, 32, 0.0001 * 32, 0.05)
    assert a.choose(4096, (8, 2048), 1).local_batch == 128  # 16 and 32 span 2: 2 x 2 beyond 32
    a.set_batch(128)
    _times(a, 2, 128, 0.0001 * 128, 0.05)
    assert a.choose(4096, (8, 2048), 1).local_batch == 512  # 16 to 128 span 8: still 4 x at most


def test_shrinking_is_bounded_by_what_was_measured_too():
    """Step times measured only at big batches and all per-sample (a line through the origin)
    make a small batch look as fast per sample; with much noise it then looks best. The choice
    still goes at most `explore` times below the smallest batch measured (word2vec jumped from
    2979 to 534 on such a fit, then back up on the next)."""
    a = Adaptive(AdaptiveConfig(local_batch_size=8, explore=2.0), "SGD", world_size=2)  # base: 16
    for b in (512, 1024):
        for _ in range(5):
            a.throughput.record(2, b, 2e-6 * b, 0.0)
    _observe(a, 200.0, 512, 1024)  # noise scale 200: small is efficient
    a.set_batch(1024)
    choice = a.choose(1 << 20, (8, 4096), 1)
    assert choice is not None and choice.local_batch == 256  # not 8: half the smallest measured


def test_one_measured_size_explores_a_bigger_one_then_the_fit_decides():
    """From one batch size the step-time lines are unknown: the optimistic guess (all fixed
    cost) tries a batch twice as big; once measured there with no throughput gained, the fit
    takes the batch back to the base (better statistical efficiency at the same throughput)."""
    a = Adaptive(AdaptiveConfig(local_batch_size=16), "SGD", world_size=2)
    _observe(a, 200.0, 16, 32)  # noise scale 200
    _times(a, 2, 16, 0.0001 * 16, 0.0)  # the truth: all per-sample compute
    first = a.choose(4096, (8, 2048), 1)
    assert first is not None and first.local_batch == 32 and first.kind == "probe"
    a.adopt(first)
    a.set_batch(first.local_batch)
    _times(a, 2, 32, 0.0001 * 32, 0.0)
    back = a.choose(4096, (8, 2048), 1)
    assert back is not None and back.local_batch == 16 and back.kind == "return"
    a.adopt(back)
    a.set_batch(back.local_batch)
    assert a.choose(4096, (8, 2048), 1) is None  # the probed size is barred now (until the noise scale doubles)


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 1000, 100_003])
def test_squared_norms_of_gradients_are_exact_in_double_for_every_layout_and_dtype(length):
    """The statistics' |g|^2 of a dense gradient (collect.squared_norm): float32 buffers go
    through the engine's kernel in place, others through float64; each within rounding of the
    float64 sum, for tensors, NumPy arrays, non-contiguous views and lengths around the kernel's
    8 lanes. The same buffer gives the same double every time (ranks compare nothing, but each
    computes the all-reduced gradient's norm on its own)."""
    import torch

    from hybridsync.adaptive.collect import squared_norm

    values = np.random.default_rng(length).normal(size=(length, 3)).astype(np.float32) * 1e3
    exact = float(np.sum(values.astype(np.float64) ** 2))
    tensor = torch.from_numpy(values)
    for buffer in (values, values.T, tensor, tensor.t(), tensor[:, :2], tensor.double(),
                   tensor.half().float(), torch.from_numpy(values).requires_grad_()):
        reference = float(np.sum(np.asarray(buffer.detach() if hasattr(buffer, "detach") else buffer,
                                            dtype=np.float64) ** 2))
        assert squared_norm(buffer) == pytest.approx(reference, rel=1e-12, abs=1e-300)
    assert squared_norm(values) == pytest.approx(exact, rel=1e-12, abs=1e-300)
    assert squared_norm(tensor.half()) == pytest.approx(float(np.sum(values.astype(np.float16).astype(np.float64) ** 2)),
                                                        rel=1e-6, abs=1e-300)
    assert squared_norm(values) == squared_norm(tensor) == squared_norm(values.copy())
