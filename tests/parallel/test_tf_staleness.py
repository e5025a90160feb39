"""Bounded staleness through Keras (hybridsync.tensorflow's DistributedOptimizer, PS-backed
hvd.Embedding tables) under real mpirun: `staleness: 0` trains bit for bit as the synchronous
default; with the last rank stalled the others run exactly k steps ahead of it and then wait,
and the lag their pulls saw never exceeds k. The torch side: test_staleness.py."""
import os

import pytest

from tests.parallel.harness import rank_main, run_scenarios, subcase_output
from tests.parallel.test_staleness import _entering, _progress, _stall_until_the_others_wait_at

VOCAB, DIM, BATCH = 40, 4, 8


def _skipgram(k):
    """An all-PS Keras model (two PS-backed tables, nothing dense) and its optimizer at staleness
    k (None: no config at all)."""
    import keras

    import hybridsync.tensorflow as hvd

    keras.utils.set_random_seed(5)
    centre = hvd.Embedding(VOCAB, DIM, name="centre")
    context = hvd.Embedding(VOCAB, DIM, name="context")
    config = {"defaults": {"sparse": {"sync": "ps", "staleness": k}}} if k is not None else None
    return (centre, context), hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), config=config)


def _step(layers, opt, step, rank):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(1000 * step + rank)
    words, others = rng.integers(0, VOCAB, (2, BATCH))
    with tf.GradientTape() as tape:
        u, v = layers[0](words), layers[1](others)
        loss = -tf.reduce_mean(tf.math.log_sigmoid(tf.reduce_sum(u * v, axis=1)))
    variables = layers[0].trainable_variables + layers[1].trainable_variables
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))


def rank_keras_k0_is_the_synchronous_default():
    import numpy as np

    import hybridsync

    rank = hybridsync.rank()
    finals = []
    for k in (None, 0):
        layers, opt = _skipgram(k)
        for step in range(5):
            _step(layers, opt, step, rank)
        for layer in layers:
            assert layer.table.staleness()["pulls"] == 0, layer.name  # every pull was a round
        finals.append([layer.get_table() for layer in layers])
    for before, now in zip(*finals):
        assert np.array_equal(before, now)
    print(f"KERAS-K0 rank={rank} bit-identical", flush=True)


def rank_keras_fast_ranks_run_k_steps_ahead_then_wait(k, directory):
    """As test_staleness.py's torch scenario: the last rank stalls after 2 steps, outside any PS
    call; every other rank completes exactly k + 1 more steps and then waits at the bound."""
    import hybridsync

    k = int(k)
    rank, size = hybridsync.rank(), hybridsync.size()
    layers, opt = _skipgram(k)
    warm, steps = 2, 8
    for step in range(steps):
        if rank == size - 1 and step == warm:
            _stall_until_the_others_wait_at(directory, size, warm + k + 1)
        elif rank < size - 1:
            _entering(directory, rank, step)
        _step(layers, opt, step, rank)
        _progress(directory, rank, step + 1)
    for layer in layers:
        seen = layer.table.staleness()
        # (Keras makes the plan, and so the bound, at the first apply: the first step's pull was a round)
        assert seen["staleness"] == k and seen["pulls"] == steps - 1 and seen["clock"] == steps, (layer.name, seen)
        assert seen["max_lag"] <= k, (layer.name, seen)
        if rank == 0:
            assert seen["max_lag"] == k, (layer.name, seen)
    if rank == 0:  # each layer pulls on its own: the first one's pull waits at the bound, the other's need not
        assert sum(layer.table.staleness()["held"] for layer in layers) >= 1
    text = hybridsync.explain(file=open(os.devnull, "w"))
    assert f"staleness {k}; lag last" in text, text
    print(f"KERAS-BOUND rank={rank} lag max {max(l.table.staleness()['max_lag'] for l in layers)}", flush=True)


# The 2-rank checks share one launch (starting ranks that import TensorFlow costs seconds each);
# each counts its marks in its own sub-case's output, and a failure names its sub-case.
@pytest.mark.parametrize("np_,k", [(2, 2), (3, 1)])
def test_keras_fast_ranks_run_exactly_k_steps_ahead_of_a_stalled_rank_and_staleness_zero_is_synchronous(
        np_, k, tmp_path):
    """At 2 ranks also: staleness 0 is bit-identical to the synchronous default."""
    first = ("rank_keras_k0_is_the_synchronous_default",) if np_ == 2 else ()
    out = run_scenarios(__file__, np_, *first, ("rank_keras_fast_ranks_run_k_steps_ahead_then_wait", k, tmp_path),
                        timeout=360)
    if first:
        assert subcase_output(out, 1).count("KERAS-K0") == 2, out
    assert subcase_output(out, len(first) + 1).count("KERAS-BOUND") == np_, out


if __name__ == "__main__":
    rank_main(globals())
