"""The adaptive batch and embedding tables, without MPI: what a table's row-update frequency
does to a bigger batch's statistical efficiency and to its learning rate, on synthetic tables
whose answer is known in closed form.

A table of R rows hit uniformly (each sample hits one row, probability p = 1/R each; a hit's
gradient is the row's mean mu plus noise of variance beta |mu|^2) has, per sample,
|G|^2 = p |mu|^2 and tr(Sigma) = |mu|^2 (1 + beta - p), so its noise scale is B = R (1 + beta) - 1:
rarely hit rows make a large noise scale, and the noise-scale efficiency (B + M0) / (B + M) is
already theirs. What the row counts add is the learning rate: a row hit once per batch at any
batch averages nothing more at a bigger one, and under a normalising optimizer (Adam, Adagrad)
a factor above 1 only lengthens its steps (CowClip's rule)."""
import math

import numpy as np
import pytest

from hybridsync.adaptive import Adaptive, AdaptiveConfig
from hybridsync.adaptive.batches import AdaptiveBatches
from hybridsync.adaptive.collect import StepRecorder
from hybridsync.adaptive.report import describe
from hybridsync.adaptive.rows import RowCounts


def distinct(batch: float, rows: int) -> float:
    """Expected distinct rows a batch of uniform hits over `rows` rows updates."""
    return rows * (1.0 - math.exp(-batch / rows))


def count_rounds(counts: RowCounts, name: str, rows: int, per_rank: int, ranks: int) -> None:
    counts.observe(name, per_rank, distinct(per_rank, rows), per_rank * ranks, distinct(per_rank * ranks, rows), ranks)


def test_row_counts_give_the_distinct_rows_between_and_beyond_the_sizes_seen():
    counts = RowCounts()
    for per_rank in (32, 128):
        count_rounds(counts, "t", 1000, per_rank, 2)
    for batch in (32, 48, 64, 128, 256):  # measured, or between measured sizes (log-log lines)
        assert counts.distinct("t", batch) == pytest.approx(distinct(batch, 1000), rel=0.03)
    assert counts.distinct("t", 512) == pytest.approx(distinct(512, 1000), rel=0.15)  # one explore step beyond
    # The batch each row update averages against the base's: ~the base where ids are rare, ~the
    # batch where every row is hit by every batch.
    rare, hot = RowCounts(), RowCounts()
    count_rounds(rare, "t", 10 ** 7, 32, 2)
    count_rounds(hot, "t", 4, 32, 2)
    assert rare.effective_batch("t", 512, 64) == pytest.approx(64, rel=0.01)
    assert hot.effective_batch("t", 512, 64) == pytest.approx(512, rel=0.01)
    assert rare.growth("t", 64) == pytest.approx(1.0, abs=0.01) and hot.growth("t", 64) == pytest.approx(0.0, abs=0.01)
    assert rare.duplicates("t") == pytest.approx(1.0, abs=1e-3) and hot.duplicates("t") == pytest.approx(2.0, rel=1e-3)
    assert math.isnan(rare.distinct("other", 64)) and rare.effective_batch("other", 512, 64) == 512  # unmeasured
    with pytest.raises(ValueError, match="table 'bad': a round's row counts are inconsistent"):
        rare.observe("bad", 32, 10.0, 64, 30.0, 2)  # more distinct rows than the ranks pushed


def _table_step(rng, rows, per_rank, ranks, dim, beta):
    """(mean over ranks of |g_r|^2, |mean of g_r|^2) of a uniform table's gradient: each rank's
    per_rank samples each hit one row with gradient mu + noise, averaged over the rank's batch."""
    mu = np.ones(dim)
    g = np.zeros((ranks, rows, dim))
    for r in range(ranks):
        n = np.bincount(rng.integers(0, rows, per_rank), minlength=rows).astype(float)
        g[r] = (n[:, None] * mu + rng.normal(size=(rows, dim)) * np.sqrt(n * beta)[:, None]) / per_rank
    combined = g.mean(axis=0)
    return float(np.mean(np.sum(g * g, axis=(1, 2)))), float(np.sum(combined * combined))


def _adagrad_progress(rng, rows, batch, steps, dim, beta, lr=0.01):
    """Adagrad on the uniform table's constant-slope loss: how far the rows moved along their
    mean gradient after `steps` steps of `batch` samples."""
    x, acc = np.zeros((rows, dim)), np.zeros((rows, dim))
    for _ in range(steps):
        n = np.bincount(rng.integers(0, rows, batch), minlength=rows).astype(float)
        g = (n[:, None] + rng.normal(size=(rows, dim)) * np.sqrt(n * beta)[:, None]) / batch
        acc += g * g
        hit = acc > 0
        x[hit] -= lr * g[hit] / np.sqrt(acc[hit])
    return -float(x.mean())


@pytest.mark.parametrize("rows, beta", [(1000, 0.0), (1000, 1.0), (300, 3.0)])
def test_a_tables_efficiency_is_the_noise_scale_formula_on_its_own_statistics(rows, beta):
    """A uniform table, base batch 64, 8x bigger: the noise scale the controller estimates from
    the table's two squared norms per step is R (1 + beta) - 1 (within 20%), and the gain it
    predicts is what Adagrad (at its unscaled LR, what 'auto' gives it) makes of the bigger
    batch: T steps move the rows as far as gain x T base steps do (within 6%; measured 0-3%). Counting the
    table's batch in hits per updated row instead (the batch x U(M0) / U(M) its row updates
    average) predicts a gain the simulation does not make (8-15% short of it)."""
    rng = np.random.default_rng(7)
    dim, base, scale, steps = 4, 64, 8, 100
    a = Adaptive(AdaptiveConfig(local_batch_size=base // 2, smoothing=0.99), "Adagrad", world_size=2)
    for _ in range(300):
        local_sq, combined_sq = _table_step(rng, rows, base // 2, 2, dim, beta)
        a.stats.observe_step([("t", local_sq, base // 2, combined_sq, base, 1.0)])
    truth = rows * (1.0 + beta) - 1.0
    assert a.noise_scale() == pytest.approx(truth, rel=0.2)
    gain = a.gain(scale)
    big = np.mean([_adagrad_progress(rng, rows, base * scale, steps, dim, beta) for _ in range(3)])
    small = np.mean([_adagrad_progress(rng, rows, base, round(gain * steps), dim, beta) for _ in range(3)])
    assert big / small == pytest.approx(1.0, abs=0.06), (gain, big / small)
    per_row_hits = base * scale * distinct(base, rows) / distinct(base * scale, rows)
    hits_gain = scale * (truth + base) / (truth + per_row_hits)
    wrong = np.mean([_adagrad_progress(rng, rows, base, round(hits_gain * steps), dim, beta) for _ in range(3)])
    assert big / wrong < 0.94, (hits_gain, big / wrong)


def _train_table_only(rows: int, beta: float, fixed_s: float, per_sample_s: float, steps: int, seed: int) -> list:
    """The global batch after each step, from a base of 256 at 2 ranks, of a model whose only
    parameters are a uniform table; each step's time a + c M (2% jitter)."""
    rng = np.random.default_rng(seed)
    a = Adaptive(AdaptiveConfig(local_batch_size=128, min_gain=1.01), "Adagrad", world_size=2)
    loader = AdaptiveBatches(1 << 30, 256, 0, 1, interval=20, warmup=10)  # (one process drives the decision)
    loader.set_autoscale(1 << 15, (8, 1 << 14), 1)
    trace = []
    for _ in range(steps):
        b = a.local_batch
        local_sq, combined_sq = _table_step(rng, rows, b, 2, 4, beta)
        a.stats.observe_step([("t", local_sq, b, combined_sq, 2 * b, a.global_batch() / 256)])
        count_rounds(a.rows, "t", rows, b, 2)
        t = (fixed_s + per_sample_s * a.global_batch()) * (1.0 + 0.02 * rng.standard_normal())
        a.throughput.record(2, b, 0.7 * t, 0.3 * t, 1)
        a.step_done()
        loader.rechoose(a, a.set_batch, None)
        trace.append(a.global_batch())
    return trace


def test_a_table_only_model_goes_where_its_noise_scale_says_and_no_further():
    """A model whose only parameters are a uniform table of 2,000 rows (beta 1: noise scale
    3,999), trained with Adagrad at its unscaled LR (the PS's adagrad rule; the 'sqrt'
    efficiency model): with step time a + c M the batch climbs to that model's closed-form
    goodput optimum (15,243; test_adaptive_decision.goodput_optimum) within 25%, never turning
    back; where a bigger batch buys no throughput (no per-step cost) it gains nothing, and the
    batch ends where it started (after one probe)."""
    from tests.unit.test_adaptive_decision import goodput_optimum

    trace = _train_table_only(2000, 1.0, 0.02, 2e-6, 300, seed=0)
    changes = [m for i, m in enumerate(trace) if i == 0 or m != trace[i - 1]]
    assert changes == sorted(changes), changes
    assert trace[-1] == pytest.approx(goodput_optimum(0.02, 2e-6, 3999, "sqrt"), rel=0.25), changes
    flat = _train_table_only(2000, 1.0, 0.0, 2e-6, 120, seed=1)
    # (one probe, measured worse, and back to the base -- give or take the size grid's step)
    assert flat[-1] < 1.05 * 256 and max(flat) <= 2 * 256, [m for i, m in enumerate(flat) if i == 0 or m != flat[i - 1]]


def _adam_loss(rng, rows, batch, samples, factor, lr=0.05, dim=4, noise=1.0, b1=0.5, b2=0.9):
    """Lazy Adam (only rows hit move, as the server's rule) on a uniform table whose hits pull
    each row to 1 through noise: the mean squared distance left after `samples` samples."""
    x, m, v = np.zeros((rows, dim)), np.zeros((rows, dim)), np.zeros((rows, dim))
    for step in range(1, samples // batch + 1):
        n = np.bincount(rng.integers(0, rows, batch), minlength=rows).astype(float)
        hit = n > 0
        g = (n[:, None] * (x - 1.0) + rng.normal(size=(rows, dim)) * np.sqrt(n)[:, None] * noise)[hit] / batch
        m[hit] = b1 * m[hit] + (1 - b1) * g
        v[hit] = b2 * v[hit] + (1 - b2) * g * g
        x[hit] -= lr * factor * (m[hit] / (1 - b1 ** step)) / (np.sqrt(v[hit] / (1 - b2 ** step)) + 1e-8)
    return float(np.mean((x - 1.0) ** 2))


def _with_rows(rule_class: str, rows: int, base: int = 32, scale: int = 8) -> Adaptive:
    """A controller at `scale` times its base batch (2 ranks), whose table 't' was counted at
    the base batch and at the current one."""
    a = Adaptive(AdaptiveConfig(local_batch_size=base // 2), rule_class, world_size=2)
    a.stats.observe("t", 2.0, base // 2, 1.5, base)
    for per_rank in (base // 2, base * scale // 2):
        count_rounds(a.rows, "t", rows, per_rank, 2)
    a.set_batch(base * scale // 2)
    return a


def test_a_rarely_hit_tables_learning_rate_is_not_scaled_with_the_batch():
    """Adam's square-root rule at 8x the base batch: the dense layers' LR x sqrt(8), but a table
    whose rows are hit about once per batch at either size keeps its LR (its row updates average
    nothing more), and one whose rows every batch hits gets the dense factor. On the rare table,
    lazy Adam with the table's factor ends where the base batch does after the same samples
    (within 10%); with sqrt(8) it overshoots into the noise (the loss left 1.5x the base's)."""
    rare, hot = _with_rows("Adam", 2000), _with_rows("Adam", 8)
    assert rare.lr_factor() == pytest.approx(math.sqrt(8))
    assert rare.table_lr_factors()["t"] == pytest.approx(1.0, abs=0.05)
    assert hot.table_lr_factors()["t"] == pytest.approx(math.sqrt(8), rel=0.02)
    assert _with_rows("Adagrad", 2000).table_lr_factors()["t"] == 1.0  # rule 'none': 1 for everything
    rng = np.random.default_rng(3)
    samples = 32 * 3000
    base = np.mean([_adam_loss(rng, 2000, 32, samples, 1.0) for _ in range(2)])
    own = np.mean([_adam_loss(rng, 2000, 256, samples, rare.table_lr_factors()["t"]) for _ in range(2)])
    batch_factor = np.mean([_adam_loss(rng, 2000, 256, samples, math.sqrt(8)) for _ in range(2)])
    assert own == pytest.approx(base, rel=0.1), (base, own)
    assert batch_factor > 1.5 * base, (base, batch_factor)


def test_row_counts_change_no_batch_decision():
    """The batch decision is the noise-scale goodput's alone: the same trace whether a table's
    rows were counted or not (dense-only models decide as before)."""
    from tests.unit.test_adaptive_decision import BASE, WORLD, KnownNoiseProblem

    def trace(counted: bool) -> list:
        problem = KnownNoiseProblem(4000.0, 0.02, 2e-6, 0)
        a = Adaptive(AdaptiveConfig(local_batch_size=BASE // WORLD, min_gain=1.01), "Adagrad", world_size=WORLD)
        loader = AdaptiveBatches(1 << 30, BASE, 0, 1, interval=20, warmup=10)
        loader.set_autoscale(1 << 16, (8, 1 << 15), 1)
        out = [a.global_batch()]
        for _ in range(200):
            b, k = a.sizes()
            local_sq, combined_sq = problem.gradients(b, WORLD)
            a.stats.observe_step([("w", local_sq, b, combined_sq, b * WORLD, a.global_batch() / BASE)])
            if counted:
                count_rounds(a.rows, "w", 500, b, WORLD)
            t = problem.step_time(a.global_batch())
            a.throughput.record(WORLD, b, 0.7 * t, 0.3 * t, k)
            a.step_done()
            loader.rechoose(a, a.set_batch, None)
            out.append(a.global_batch())
        return out

    assert trace(True) == trace(False) and len(set(trace(False))) > 1


def _peers(rows: dict):
    """The statistics gather of a world of ranks as one rank sees it: rank r took part with rows[r]."""
    def allreduce_sum(table, name):
        for r, row in rows.items():
            table[r, 0], table[r, 1:] = 1.0, row
        return table
    return allreduce_sum


def test_every_rank_takes_the_lowest_ranks_row_counts():
    """A table's row counts travel with the per-step gather: each rank models the counts of the
    lowest rank that had a round of the table this step, its own or not."""
    def rank_step(rank: int, own_round: bool, others: dict) -> Adaptive:
        a = Adaptive(AdaptiveConfig(local_batch_size=8), "Adam", world_size=3)
        recorder = StepRecorder(a, 3, rank)
        stats = {"round": 0 if own_round else -1, "local_sq": 3.0, "combined_sq": 1.5, "ranks": 3,
                 "rows": 20, "pushed": 3 * 8}
        recorder.ps_round("t", stats, current=True)
        recorder.last_times = (0.01, 0.002, 8, 1)
        recorder.end_step(_peers(others))
        return a

    times = [0.01, 0.002, 8, 1, 1.0, 1.0]
    rank1 = [*times, 1.0, 8, 7.0, 24, 18.0, 3]  # rank 1's counts differ from rank 0's (7 per rank, 18 in all)
    nothing = [*times, *[0.0] * 6]
    seen_by_2 = rank_step(2, False, {0: nothing, 1: rank1})  # rank 0 had no round: rank 1's counts
    assert seen_by_2.rows.state_dict()["counts"] == {"t": {"8": [7.0], "24": [18.0]}}
    seen_by_1 = rank_step(1, True, {0: nothing, 2: nothing})  # only its own
    assert seen_by_1.rows.state_dict()["counts"] == {"t": {"8": [8.0], "24": [20.0]}}
    own = [*times, 1.0, 8, 8.0, 24, 20.0, 3]
    seen_by_0 = rank_step(0, True, {1: rank1, 2: rank1})  # its own, the lowest
    seen_by_2 = rank_step(2, True, {0: own, 1: rank1})
    assert seen_by_0.rows.state_dict() == seen_by_2.rows.state_dict()
    # The counts came out of the gather's NumPy array; the state (in the optimizer's state_dict)
    # still loads where a checkpoint unpickles nothing but plain types.
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(seen_by_2.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["rows"] == seen_by_2.rows.state_dict()


def test_explain_shows_each_tables_row_counts_and_efficiency():
    import re

    a = _with_rows("Adam", 2000)
    text = "\n".join(describe(a.summary()))
    line = re.search(r"table t: d ([\d.]+) rows pushed per row updated, .* efficiency ([\d.]+)%; LR x ([\d.]+)", text)
    assert line, text
    d, efficiency, factor = map(float, line.groups())
    assert d == pytest.approx(1.03, abs=0.01) and efficiency == pytest.approx(100 * (16 + 32) / (16 + 256), abs=0.1)
    assert factor == pytest.approx(a.table_lr_factors()["t"], abs=1e-3) and factor < 1.05
