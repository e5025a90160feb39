"""Which statistical-efficiency model the controller uses (goodput.efficiency_model_for), and that
the batch it picks follows that model's closed-form goodput optimum, without MPI.

Under Adagrad at an unscaled learning rate the efficiency is sqrt((B + M0) / (B + M)) (measured:
docs/adaptive.md, "Statistical efficiency under Adagrad"); elsewhere (B + M0) / (B + M)."""
import math

import pytest

from hybridsync.adaptive import Adaptive, AdaptiveConfig
from hybridsync.adaptive.report import describe

WORLD = 2
BASE = 256


@pytest.mark.parametrize("optimizer,rule,model", [
    ("Adagrad", "auto", "sqrt"),      # auto resolves to 'none' for Adagrad: the LR unscaled
    ("Adagrad", "none", "sqrt"),
    ("Adagrad", None, "sqrt"),        # statistics only: the LR is left alone too
    ("SparseAdagrad", "auto", "sqrt"),
    ("Adagrad", "sqrt", "goodput"),   # a scaled LR: not what was measured
    ("Adagrad", "adagrad", "goodput"),
    ("Adagrad", "linear", "goodput"),
    ("SGD", "auto", "goodput"),
    ("SGD", "none", "goodput"),
    ("Adam", "auto", "goodput"),
    ("Adam", "none", "goodput"),
    ("RMSprop", "none", "goodput"),
])
def test_the_efficiency_model_follows_the_optimizer_and_its_rule(optimizer, rule, model):
    a = Adaptive(AdaptiveConfig(scaling_rule=rule, local_batch_size=8), optimizer, world_size=WORLD)
    assert a.efficiency_model == model
    summary = a.summary()
    assert summary["efficiency_model"] == model and optimizer in summary["efficiency_reason"]
    assert any(line.startswith(f"  efficiency model {model}:") for line in describe(summary))


def test_the_square_root_model_is_the_square_root_of_the_goodput_one_everywhere_the_controller_reads_it():
    sgd = Adaptive(AdaptiveConfig(local_batch_size=8), "SGD", world_size=WORLD)
    adagrad = Adaptive(AdaptiveConfig(local_batch_size=8), "Adagrad", world_size=WORLD)
    for batch in (16, 64, 1024):
        assert adagrad.efficiency_of(100.0)(batch) == pytest.approx(math.sqrt(sgd.efficiency_of(100.0)(batch)))


def _steps(a: Adaptive, fixed_s: float, per_sample_s: float, noise_scale: float, local_batches, steps=8):
    """Exact step times a + c M at each local batch (no spread) and exact statistics at `noise_scale`."""
    for b in local_batches:
        t = fixed_s + per_sample_s * WORLD * b
        for _ in range(steps):
            a.throughput.record(WORLD, b, 0.7 * t, 0.3 * t)
    for _ in range(steps):
        small, big = BASE // WORLD, BASE
        a.stats.observe("w", 1.0 + noise_scale / small, small, 1.0 + noise_scale / big, big)
        a.step_done()


@pytest.mark.parametrize("noise_scale,fixed_s,per_sample_s", [(4000.0, 0.02, 2e-6), (20000.0, 0.01, 1e-6)])
def test_adagrad_at_an_unscaled_lr_picks_the_square_root_models_larger_optimum(noise_scale, fixed_s, per_sample_s):
    """Step time a + c M: goodput M / (a + c M) * eff(M). With eff = (B + M0) / (B + M) it is
    largest at M* = sqrt(a B / c); with its square root, where c M^2 - a M - 2 a B = 0, i.e.
    M = (a + sqrt(a^2 + 8 a c B)) / (2 c) -- a larger batch, on the same statistics and times."""
    a_, c, B = fixed_s, per_sample_s, noise_scale
    goodput_optimum = math.sqrt(a_ * B / c)
    sqrt_optimum = (a_ + math.sqrt(a_ * a_ + 8 * a_ * c * B)) / (2 * c)
    assert sqrt_optimum > 1.5 * goodput_optimum
    chosen = {}
    for optimizer in ("SGD", "Adagrad"):
        a = Adaptive(AdaptiveConfig(local_batch_size=BASE // WORLD, min_gain=1.0, confidence=0.0, explore=64.0,
                                    smoothing=0.0), optimizer, world_size=WORLD)
        _steps(a, fixed_s, per_sample_s, noise_scale, (BASE // WORLD, 1024, 4096))
        decision = a.choose(1 << 17, (8, 1 << 16), 1)
        assert decision is not None, optimizer
        chosen[optimizer] = decision.global_batch
    # the grid of candidate sizes is geometric, about 25% apart at these bounds
    assert chosen["SGD"] == pytest.approx(goodput_optimum, rel=0.15)
    assert chosen["Adagrad"] == pytest.approx(sqrt_optimum, rel=0.15)
    assert chosen["Adagrad"] > 1.5 * chosen["SGD"]
