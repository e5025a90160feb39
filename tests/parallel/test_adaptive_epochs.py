"""An adaptive loader's epoch never comes out empty (issue 35, item 6), under real MPI ranks.

A dataset smaller than one global batch used to yield no batch at all, on every rank, silently.
Now, as torch's DataLoader with drop_last=False (the default): the samples left after an epoch's
last full step are one more, smaller step, of the same size on every rank -- for the small
dataset the whole epoch is that one step, and it trains exactly as one process on the same
samples. drop_last=True drops the remainder, and an epoch with no step raises, naming both sizes.
torch's AdaptiveDataLoader and Keras's AdaptiveDataset, at -np 1, 2 and 3.
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

# BATCH divides over 1, 2 and 3 ranks; BIG leaves a remainder at each
SMALL, BIG, BATCH, FEATURES, EPOCHS = 7, 46, 12, 3, 3


def _arrays(n):
    import numpy as np

    rng = np.random.default_rng(n)
    return rng.standard_normal((n, FEATURES)).astype(np.float32), rng.standard_normal((n, 1)).astype(np.float32)


def _torch_run(hvd, n, drop_last, accumulation):
    """EPOCHS epochs of a linear model; returns the global batches (every rank's sample indices
    per step) and the model, checked against one process stepping on the same samples."""
    import numpy as np
    import torch

    x, y = (torch.from_numpy(a) for a in _arrays(n))
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    reference = torch.nn.Linear(FEATURES, 1)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), adaptive={"scaling_rule": None})
    data = torch.utils.data.TensorDataset(torch.arange(n), x, y)
    # (drop_last=False is the default: named only when True, as a user would)
    loader = hvd.AdaptiveDataLoader(data, batch_size=BATCH, **({"drop_last": True} if drop_last else {}))
    if accumulation:
        loader.autoscale_batch_size(BATCH, gradient_accumulation=True)  # one rank: the base batch in 2 micro-steps
    chosen = None
    steps = []
    for epoch in range(EPOCHS):
        expected = len(loader)
        batches = 0
        micro = []
        for idx, xb, yb in loader:
            chosen = chosen or (opt.adaptive.partial_step_of or opt.adaptive.sizes())
            batches += 1
            micro.append(idx)
            opt.zero_grad()
            ((model(xb) - yb) ** 2).mean().backward()
            before = opt.adaptive.steps
            opt.step()
            if opt.adaptive.steps == before:
                continue  # an accumulation micro-step
            mine = torch.cat(micro)
            micro = []
            everyone = hvd.allgather_object(mine.tolist())
            assert all(len(e) == len(everyone[0]) for e in everyone), everyone  # one size on every rank
            steps.append(everyone)
            # One process, the same step: the mean over the ranks' means of equal-size parts.
            ref_opt.zero_grad()
            sum(((reference(x[e]) - y[e]) ** 2).mean() for e in everyone).div(len(everyone)).backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), reference.parameters()):
                np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert batches == expected and batches > 0, (f"epoch {epoch}: {batches} batches, len(loader) {expected}", n)
        assert opt.adaptive.partial_step_of is None and opt.adaptive.sizes() == chosen, opt.adaptive.sizes()
    return steps


def _covers_the_epoch(steps_of_epoch, n, size):
    seen = sorted(i for step in steps_of_epoch for part in step for i in part)
    assert len(seen) == len(set(seen)) == n // size * size, seen  # each sample once; n % size left out


def rank_torch():
    import hybridsync.torch as hvd

    size = hvd.size()
    per_rank = BATCH // size
    # Smaller than one global batch: each epoch is one step of every sample (7 // size per rank).
    for accumulation in (False, True):
        steps = _torch_run(hvd, SMALL, False, accumulation)
        assert len(steps) == EPOCHS and all(len(step[0]) == SMALL // size for step in steps), steps
        for epoch in range(EPOCHS):
            _covers_the_epoch(steps[epoch:epoch + 1], SMALL, size)
    with pytest.raises(ValueError, match=rf"drop_last=True and the dataset's {SMALL} samples \({SMALL // size} per "
                                         rf"rank.*fewer than one global batch of {BATCH} \({per_rank} per rank"):
        hvd.AdaptiveDataLoader(list(range(SMALL)), batch_size=BATCH, drop_last=True)
    # A remainder after full steps: one more, smaller step (default), or dropped.
    full, left = divmod(BIG // size, per_rank)
    steps = _torch_run(hvd, BIG, False, False)
    assert len(steps) == EPOCHS * (full + 1) and len(steps[full][0]) == left, [len(s[0]) for s in steps]
    _covers_the_epoch(steps[:full + 1], BIG, size)
    steps = _torch_run(hvd, BIG, True, False)
    assert len(steps) == EPOCHS * full and all(len(s[0]) == per_rank for s in steps)


def rank_keras():
    import keras
    import numpy as np
    import tensorflow as tf

    import hybridsync
    import hybridsync.tensorflow as hvd

    size = hvd.size()
    x, y = _arrays(SMALL)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), adaptive={"scaling_rule": None})
    data = hvd.AdaptiveDataset((np.arange(SMALL), x, y), batch_size=BATCH, optimizer=opt)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    seen = []
    for epoch in range(EPOCHS):
        for idx, xb, yb in data:
            seen.append(idx.tolist())
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((model(xb) - yb) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        assert len(seen) == epoch + 1, f"epoch {epoch}: no batch"
        assert opt.adaptive.sizes() == (BATCH // size, 1) and opt.adaptive.partial_step_of is None
    assert len(seen) == EPOCHS and all(len(s) == SMALL // size for s in seen), seen
    assert opt.adaptive.steps == EPOCHS
    everyone = hybridsync.allgather_object(seen[0])
    assert len({i for e in everyone for i in e}) == SMALL // size * size, everyone
    with pytest.raises(ValueError, match=rf"the dataset's {SMALL} samples .*global batch of {BATCH}"):
        hvd.AdaptiveDataset((x, y), batch_size=BATCH, optimizer=opt, drop_last=True)


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_torch_loader_epochs_end_in_a_partial_step_never_empty(np_):
    run_ranks(__file__, "rank_torch", np_, timeout=180)


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_keras_dataset_epochs_end_in_a_partial_step_never_empty(np_):
    run_ranks(__file__, "rank_keras", np_, timeout=180)


if __name__ == "__main__":
    rank_main(globals())
