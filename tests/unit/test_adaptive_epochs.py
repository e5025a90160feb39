"""An epoch's remainder is one more, smaller step (drop_last=False, the default) or dropped, and an
epoch with no step is an error naming both sizes (issue 35, item 6): the batches, the batch
chosen kept through the partial step (checkpoints keep it, the throughput model does not time
the remainder). Under real ranks: tests/parallel/test_adaptive_epochs.py."""
import pytest

from hybridsync.adaptive import Adaptive, AdaptiveConfig
from hybridsync.adaptive.batches import AdaptiveBatches
from hybridsync.adaptive.collect import StepRecorder


def _epoch(batches, adaptive, during=None):
    sizes = []
    for idx in batches.epoch_batches(adaptive, adaptive.set_batch, lambda table, name: table):
        sizes.append((len(idx), adaptive.sizes()))
        if during:
            during()
        adaptive.step_done()
    return sizes


def test_the_remainder_is_one_smaller_step_and_the_chosen_batch_comes_back():
    a = Adaptive(AdaptiveConfig(), "SGD", world_size=2)
    batches = AdaptiveBatches(46, 12, 0, 2)  # 23 per rank: 3 steps of 6, then 5
    batches.start(a, a.set_batch)
    a.set_batch(3, 2)  # a choice of 2 micro-steps of 3
    saved = []
    sizes = _epoch(batches, a, during=lambda: saved.append(a.state_dict()))
    assert sizes == [(3, (3, 2))] * 6 + [(5, (5, 1))]  # one backward pass over the 5 left
    assert a.sizes() == (3, 2) and a.partial_step_of is None
    assert (saved[-1]["local_batch"], saved[-1]["accumulation"]) == (3, 2)  # a checkpoint keeps the choice
    assert batches.steps(3, 2) == (3, 5)


def test_a_dataset_smaller_than_a_global_batch_is_one_step_per_epoch():
    a = Adaptive(AdaptiveConfig(), "SGD", world_size=3)
    batches = AdaptiveBatches(7, 12, 1, 3)
    batches.start(a, a.set_batch)
    for _ in range(2):
        assert _epoch(batches, a) == [(2, (2, 1))]
        assert a.sizes() == (4, 1)
    assert a.steps == 2 and a.progress == pytest.approx(2 * 6 / 12)  # a partial step is worth what it holds


def test_drop_last_drops_the_remainder_and_refuses_an_empty_epoch():
    a = Adaptive(AdaptiveConfig(), "SGD", world_size=2)
    batches = AdaptiveBatches(46, 12, 0, 2, drop_last=True)
    batches.start(a, a.set_batch)
    assert _epoch(batches, a) == [(6, (6, 1))] * 3
    with pytest.raises(ValueError, match=r"drop_last=True and the dataset's 7 samples \(3 per rank over 2 ranks\) "
                                         r"are fewer than one global batch of 12 \(6 per rank\)"):
        AdaptiveBatches(7, 12, 0, 2, drop_last=True)
    a.set_batch(12, 2)  # a batch chosen beyond the data (max_batch_size above the dataset)
    with pytest.raises(ValueError, match=r"global batch of 48 \(12 per rank x 2 micro-steps\)"):
        _epoch(batches, a)


def test_a_loop_that_leaves_at_the_partial_step_gets_the_chosen_batch_back():
    a = Adaptive(AdaptiveConfig(), "SGD", world_size=1)
    batches = AdaptiveBatches(7, 4, 0, 1)
    batches.start(a, a.set_batch)
    for idx in batches.epoch_batches(a, a.set_batch, lambda table, name: table):
        if len(idx) == 3:
            break  # the partial step, and no resumption
    assert a.partial_step_of == (4, 1)
    batches.start(a, a.set_batch)
    assert a.sizes() == (4, 1) and a.partial_step_of is None


def test_the_partial_step_is_not_timed():
    a = Adaptive(AdaptiveConfig(local_batch_size=4), "SGD", world_size=2)
    recorder = StepRecorder(a, 2)
    a.partial_step_of = (4, 1)
    a.set_batch(3, 1)
    recorder.step_times(0.01)
    assert recorder.last_times[2] == 0  # measured at no batch size: end_step records nothing
    a.partial_step_of = None
    a.set_batch(4, 1)
    recorder.step_times(0.01)
    assert recorder.last_times[2] == 4
