"""A step with inf / NaN gradient norms is left out of the gradient statistics, whole and counted
(issue 35, item 2): GradientStats, the StepRecorder's grouping of a step's observations (the
sharded tables' rounds come back a step late), a world of one's micro-step statistics, and
explain(). The same under real MPI ranks: tests/parallel/test_adaptive_nonfinite.py."""
import math

import pytest

from hybridsync.adaptive import Adaptive, AdaptiveConfig, GradientStats
from hybridsync.adaptive.collect import StepRecorder
from hybridsync.adaptive.report import describe


def _clean(stats, name="w", steps=1):
    for _ in range(steps):
        stats.observe(name, 1.0 + 100.0 / 8, 8, 1.0 + 100.0 / 16, 16)  # |G|^2 1, tr(Sigma) 100


@pytest.mark.parametrize("bad", [math.inf, math.nan, -math.inf])
def test_a_non_finite_step_leaves_the_statistics_as_they_were_and_is_counted(bad):
    stats = GradientStats(0.8)
    _clean(stats, steps=5)
    before = stats.summary()
    taken = stats.observe_step([("w", 1.0, 8, 1.0, 16, 1.0), ("v", bad, 8, 1.0, 16, 1.0)])
    assert not taken
    after = stats.summary()
    assert after["nonfinite_steps"] == 1 and after["noise_scale"] == before["noise_scale"]
    assert set(after["by_variable"]) == {"w"}  # the step is left out whole: not even 'v' exists
    _clean(stats, steps=1000)  # clean steps after it: finite, as if the bad one never came
    assert stats.summary()["noise_scale"] == pytest.approx(100.0)
    restored = GradientStats(0.8)
    restored.load_state_dict(stats.state_dict())
    assert restored.summary()["nonfinite_steps"] == 1


def test_bad_sizes_still_raise_and_are_not_counted_as_non_finite():
    stats = GradientStats()
    with pytest.raises(ValueError, match="big_batch > small_batch"):
        stats.observe("w", math.nan, 8, 1.0, 8)
    with pytest.raises(ValueError, match="weight must be > 0"):
        stats.observe("w", 1.0, 8, 1.0, 16, weight=0.0)
    assert stats.nonfinite_steps == 0


class _Ranks:
    """The statistics all-reduce of a world of two, seen from rank 0: rank 1 takes part with
    `other` = (dense inputs, step times, (this step finite, the previous push finite)), or with a
    copy of rank 0's row."""

    def __init__(self):
        self.other = None

    def __call__(self, table, name):
        table[1, 0] = 1.0
        if self.other is None:
            table[1, 1:] = table[0, 1:]
        else:
            dense, times, (now, late) = self.other
            table[1, 1:] = [*dense, *times, float(now), float(late)]
        return table


def _recorder():
    adaptive = Adaptive(AdaptiveConfig(local_batch_size=4), "SGD", world_size=2)
    return adaptive, StepRecorder(adaptive, 2)


def _step(recorder, dense_in=1.0, dense_out=0.6, round_=None, late=None):
    """One step's numbers: a dense variable's all-reduce, and optionally a table's push round
    (`late`: the round of the previous step's push, as a sharded table's comes back)."""
    recorder.begin_sync()
    recorder.dense_in("d", [dense_in ** 0.5])
    recorder.dense_out("d", [dense_out ** 0.5], summed=False)
    if round_ is not None:
        stats = {"round": round_[0], "local_sq": round_[1], "combined_sq": round_[2]}
        recorder.ps_round("t", stats, current=not late)


def test_a_rank_whose_own_numbers_are_finite_leaves_out_the_step_another_rank_found_non_finite():
    adaptive, recorder = _recorder()
    ranks = _Ranks()
    _step(recorder)
    recorder.end_step(ranks)
    assert adaptive.stats.observations == 1
    # The other rank's all-reduce output read inf (its dense inputs are identical here): this
    # rank's numbers are all finite, and it still leaves the step out, as the other does.
    _step(recorder)
    ranks.other = ([1.0], recorder.last_times, (False, True))
    recorder.end_step(ranks)
    assert adaptive.stats.observations == 1 and adaptive.stats.nonfinite_steps == 1


def test_a_late_round_goes_with_its_own_step():
    adaptive, recorder = _recorder()
    ranks = _Ranks()
    _step(recorder, round_=(0, 2.0, 3.0))
    recorder.end_step(ranks)  # step 0: dense; the table's round 0 comes back with step 1
    _step(recorder, dense_in=math.inf, round_=(1, 2.0, 3.0), late=True)
    recorder.end_step(ranks)  # step 1 non-finite (dense): the late round 1 of step 0 is still taken
    assert adaptive.stats.nonfinite_steps == 1 and "t" in adaptive.stats.by_variable()
    taken = adaptive.stats.observations
    _step(recorder, round_=(2, math.inf, math.inf), late=True)
    recorder.end_step(ranks)  # step 2: round 2 is step 1's push -- left out with it, not counted again
    assert adaptive.stats.nonfinite_steps == 1 and adaptive.stats.observations == taken + 1
    _step(recorder, round_=(3, math.nan, 1.0), late=True)
    recorder.end_step(ranks)  # step 3: step 2's round is non-finite, step 2's dense was taken: one more
    assert adaptive.stats.nonfinite_steps == 2 and adaptive.stats.observations == taken + 2
    assert math.isfinite(adaptive.stats.summary()["noise_scale"])


def test_explain_shows_the_count():
    adaptive = Adaptive(AdaptiveConfig(local_batch_size=4), "SGD", world_size=2)
    adaptive.stats.skip_step()
    adaptive.stats.skip_step()
    text = "\n".join(describe(adaptive.summary()))
    assert "non-finite steps left out of the statistics: 2 " in text


def test_a_world_of_one_leaves_out_an_accumulated_step_with_a_non_finite_micro_step():
    import torch

    import hybridsync.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), adaptive={"local_batch_size": 4})
    opt._hs_adaptive.set_batch(4, 2)  # two micro-steps per step (an AdaptiveDataLoader's choice)
    inject = {"on": False}
    model[2].weight.register_hook(lambda g: torch.full_like(g, math.inf) if inject["on"] else g)
    g = torch.Generator().manual_seed(1)
    for micro in range(2 * 12):
        inject["on"] = micro == 5  # the second micro-step of step 2
        if micro % 2 == 0:
            kept = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        x = torch.randn(4, 3, generator=g)
        (model(x) - 3.0 * torch.randn(4, 1, generator=g)).pow(2).mean().backward()
        opt.step()
        if inject["on"]:  # the loop undoes the overflowed step (the statistics had it already)
            model.load_state_dict(kept)
    stats = opt.gradient_stats()
    assert stats["nonfinite_steps"] == 1, stats
    assert set(stats["by_variable"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}, stats
    assert all(math.isfinite(v["sqr"]) and math.isfinite(v["var"]) for v in stats["by_variable"].values()), stats
