"""Adagrad's accumulators across a batch change (hybridsync.adaptive.accumulators): the factor,
the option's resolution and errors, and when a rescale is planned and taken (once per change,
not again after a checkpoint saved after it, again after one saved before it)."""
import math

import pytest

from hybridsync.adaptive import Adaptive, AdaptiveConfig, scaling
from hybridsync.adaptive.accumulators import AccumulatorRescale


def test_the_factor_and_its_limits():
    f = scaling.accumulator_factor
    assert f(512, 4096, 0.0) == pytest.approx(512 / 4096)
    assert f(512, 4096, math.inf) == (512 / 4096) ** 2
    assert f(512, 4096, 1e300) == pytest.approx((512 / 4096) ** 2)
    assert f(512, 4096, 1000.0) == pytest.approx(((4096 + 1000) / 4096 ** 2) / ((512 + 1000) / 512 ** 2))
    assert f(1024, 1024, 123.0) == 1.0 and f(1024, 1024, math.nan) == 1.0  # no change: exactly 1
    assert math.isnan(f(512, 1024, math.nan))  # no statistics: nothing to rescale with
    assert f(4096, 512, 1000.0) == pytest.approx(1 / f(512, 4096, 1000.0))  # shrinking grows the sums back
    assert f(512, 4096, -5.0) == f(512, 4096, 0.0)
    with pytest.raises(ValueError, match="batches must be > 0"):
        f(0, 512, 1.0)


def test_auto_is_on_for_adagrad_at_an_unscaled_lr_only():
    r = scaling.rescales_accumulators
    assert r("auto", "Adagrad", "none") and r("auto", "Adagrad", None)
    assert not r("auto", "Adagrad", "adagrad") and not r("auto", "Adagrad", "sqrt")
    assert not r("auto", "SGD", "adascale") and not r("auto", "Adam", "none")
    assert r(True, "SGD", "adascale") and not r(False, "Adagrad", "none")
    assert Adaptive(AdaptiveConfig(rescale_accumulators="auto"), "Adagrad", 2).accumulators.enabled  # 'auto' picks rule none for Adagrad
    assert not Adaptive(AdaptiveConfig(), "Adagrad", 2).accumulators.enabled  # opt-in: off unless asked for
    assert not Adaptive(AdaptiveConfig(rescale_accumulators="auto"), "SGD", 2).accumulators.enabled


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "Auto"])
def test_bad_values_name_the_key(bad):
    with pytest.raises(ValueError, match="adaptive: rescale_accumulators"):
        AdaptiveConfig.of({"rescale_accumulators": bad})


def test_forced_on_with_no_adagrad_state_is_an_error_naming_the_key():
    acc = Adaptive(AdaptiveConfig(rescale_accumulators=True), "SGD", 2).accumulators
    with pytest.raises(ValueError, match="adaptive: rescale_accumulators=True.*SGD"):
        acc.require_state(False, "SGD")
    auto = Adaptive(AdaptiveConfig(rescale_accumulators="auto"), "MyAdagradLike", 2).accumulators
    auto.require_state(False, "MyAdagradLike")  # 'auto' with nothing to rescale: simply off
    assert not auto.enabled


def test_a_change_is_planned_between_steps_and_taken_once():
    acc = AccumulatorRescale("auto", True)
    asked = []

    def phi():
        asked.append(1)
        return 1000.0

    acc.plan(0, 512, phi)
    assert acc.built_at == 512 and acc.pending is None and not asked  # the first steps build it
    acc.plan(5, 512, phi)
    assert acc.take(5) is None
    acc.plan(10, 2048, phi)
    acc.plan(10, 2048, phi)  # planned already: no second exchange
    assert len(asked) == 1
    f = acc.take(10)
    assert f == scaling.accumulator_factor(512, 2048, 1000.0)
    assert acc.take(11) is None and acc.built_at == 2048
    assert acc.log[-1] == {"step": 10, "from": 512, "to": 2048, "noise_scale": 1000.0, "factor": f, "applied": True}


def test_no_statistics_means_no_rescale_and_the_log_says_so():
    acc = AccumulatorRescale("auto", True)
    acc.plan(0, 512, lambda: math.nan)
    acc.plan(3, 1024, lambda: math.nan)
    assert acc.take(3) is None and acc.built_at == 1024
    assert not acc.log[-1]["applied"] and "no gradient statistics" in acc.log[-1]["reason"]


def test_checkpoints_carry_the_batch_the_state_was_built_at():
    a = Adaptive(AdaptiveConfig(local_batch_size=256, rescale_accumulators="auto"), "Adagrad", 2)
    a.accumulators.plan(0, a.global_batch(), lambda: 1.0)
    a.set_batch(1024)
    a.accumulators.plan(7, a.global_batch(), lambda: 100.0)
    before = a.state_dict()  # saved before the step that applies it: loads and rescales once
    assert a.accumulators.take(7) is not None
    after = a.state_dict()  # saved after it: loads without another
    for state, due in ((before, True), (after, False)):
        b = Adaptive(AdaptiveConfig(rescale_accumulators="auto"), "Adagrad", 2)
        b.load_state_dict(state)
        b.accumulators.plan(8, b.global_batch(), lambda: 100.0)
        assert (b.accumulators.take(8) is not None) == due
    # Another world size (2 -> 3 ranks): built at 2048, continues at the nearest global batch.
    c = Adaptive(AdaptiveConfig(rescale_accumulators="auto"), "Adagrad", 3)
    c.load_state_dict(after)
    c.accumulators.plan(8, c.global_batch(), lambda: 100.0)
    assert c.global_batch() != 2048
    assert c.accumulators.take(8) == scaling.accumulator_factor(2048, c.global_batch(), 100.0)
    # A checkpoint from before the rescale existed: built at the batch it saved.
    old = dict(after)
    del old["accumulators"]
    d = Adaptive(AdaptiveConfig(rescale_accumulators="auto"), "Adagrad", 2)
    d.load_state_dict(old)
    assert d.accumulators.built_at == 2048


def test_explain_lists_each_rescale():
    from hybridsync.adaptive.report import describe
    a = Adaptive(AdaptiveConfig(local_batch_size=256, rescale_accumulators="auto"), "Adagrad", 2)
    a.accumulators.plan(0, 512, lambda: 1.0)
    a.set_batch(1024)
    a.accumulators.plan(4, 2048, lambda: 300.0)
    a.accumulators.take(4)
    text = "\n".join(describe(a.summary()))
    assert "Adagrad accumulators rescaled at step 4: batch 512 -> 2048, noise scale 300, factor 0.1" in text
