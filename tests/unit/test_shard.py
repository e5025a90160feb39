"""The C++ table shard on its own: pull/push against NumPy and torch references, and errors."""
import numpy as np
import pytest
import torch

from hybridsync import _ps_testing as native


def make_shard(rows=50, dim=8, optimizer="sgd", seed=0, **hparams):
    shard = native.Shard("emb", rows, dim, optimizer, {k: float(v) for k, v in hparams.items()})
    values = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    shard.set_values(-1, values)
    return shard, values


def test_pull_returns_rows_of_ids_with_duplicates():
    shard, values = make_shard()
    ids = np.array([3, 7, 3, 0, 49, 7])
    np.testing.assert_array_equal(shard.pull(ids), values[ids])


def test_pull_of_empty_batch_is_empty():
    shard, _ = make_shard(dim=5)
    assert shard.pull(np.array([], dtype=np.int64)).shape == (0, 5)


def test_sgd_push_sums_duplicates_like_numpy():
    rng = np.random.default_rng(1)
    shard, values = make_shard(lr=0.1)
    for _ in range(20):
        n = int(rng.integers(0, 40))
        ids = rng.integers(0, 10, size=n)  # heavy duplication
        grads = rng.standard_normal((n, 8)).astype(np.float32)
        shard.push(ids, grads)
        np.add.at(values, ids, -0.1 * grads)
    np.testing.assert_allclose(shard.values(), values, rtol=1e-5, atol=1e-6)
    assert shard.step == 20


def test_empty_push_changes_nothing():
    shard, values = make_shard()
    shard.push(np.array([], dtype=np.int64), np.zeros((0, 8), np.float32))
    np.testing.assert_array_equal(shard.values(), values)


def _torch_reference(optimizer_cls, values, batches, **kwargs):
    weight = torch.nn.Parameter(torch.from_numpy(values.copy()))
    opt = optimizer_cls([weight], **kwargs)
    for ids, grads in batches:
        opt.zero_grad()
        weight.grad = torch.sparse_coo_tensor(torch.from_numpy(ids)[None], torch.from_numpy(grads), weight.shape,
                                              check_invariants=True)
        opt.step()
    return weight.detach().numpy()


def _random_batches(rng, steps, rows, dim):
    out = []
    for _ in range(steps):
        n = int(rng.integers(1, 30))
        out.append((rng.integers(0, rows, size=n), rng.standard_normal((n, dim)).astype(np.float32)))
    return out


@pytest.mark.parametrize("torch_cls, rule, kwargs, ours", [
    (torch.optim.SGD, "sgd", {"lr": 0.05}, {"lr": 0.05}),
    (torch.optim.Adagrad, "adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1, "lr_decay": 0.01, "eps": 1e-10},
     {"lr": 0.1, "initial_accumulator_value": 0.1, "lr_decay": 0.01, "eps": 1e-10}),
    (torch.optim.SparseAdam, "adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-8},
     {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8}),
])
def test_update_rules_match_torch_sparse_optimizers(torch_cls, rule, kwargs, ours):
    rng = np.random.default_rng(2)
    shard, values = make_shard(rows=20, dim=4, optimizer=rule, seed=3, **ours)
    batches = _random_batches(rng, 15, 20, 4)
    for ids, grads in batches:
        shard.push(ids, grads)
    expected = _torch_reference(torch_cls, values, batches, **kwargs)
    np.testing.assert_allclose(shard.values(), expected, rtol=1e-5, atol=1e-6)


def test_adagrad_accumulator_starts_at_initial_value():
    shard, _ = make_shard(optimizer="adagrad", initial_accumulator_value=0.25)
    assert shard.slot_names == ["sum"]
    np.testing.assert_array_equal(shard.values(0), np.full((50, 8), 0.25, np.float32))


@pytest.mark.parametrize("bad_id", [50, 1000, -1])
def test_out_of_range_id_names_table_and_id(bad_id):
    shard, values = make_shard()
    with pytest.raises(IndexError, match=rf"table 'emb': id {bad_id} is out of range \[0, 50\)"):
        shard.pull(np.array([1, bad_id]))
    with pytest.raises(IndexError, match=rf"id {bad_id}"):
        shard.push(np.array([bad_id]), np.zeros((1, 8), np.float32))
    np.testing.assert_array_equal(shard.values(), values)  # nothing applied


def test_float64_gradients_are_rejected_not_cast():
    shard, _ = make_shard()
    with pytest.raises(ValueError, match="table 'emb': gradients must be float32, got dtype float64"):
        shard.push(np.array([1]), np.zeros((1, 8)))


def test_gradient_shape_must_match_table():
    shard, _ = make_shard()
    with pytest.raises(ValueError, match=r"gradients shape \(2, 7\) does not match \(2, 8\)"):
        shard.push(np.array([1, 2]), np.zeros((2, 7), np.float32))


def test_float_ids_are_rejected():
    shard, _ = make_shard()
    with pytest.raises(ValueError, match="ids must be integers"):
        shard.pull(np.array([1.0]))


@pytest.mark.parametrize("rule, hparams, message", [
    ("rmsprop", {}, "unknown server optimizer 'rmsprop'"),
    ("sgd", {"momentum": 0.9}, "unknown hyper-parameter 'momentum' for server optimizer 'sgd'"),
    ("adagrad", {"lr": -1.0}, "lr must be >= 0"),
    ("adam", {"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
])
def test_bad_optimizer_settings_are_clear_errors(rule, hparams, message):
    with pytest.raises(ValueError, match=message):
        native.Shard("emb", 4, 2, rule, hparams)


@pytest.mark.parametrize("in_sqrt", [0.0, 1.0])
def test_adagrad_epsilon_inside_or_outside_the_square_root(in_sqrt):
    # torch: g / (sqrt(acc) + eps); Keras: g / sqrt(acc + eps). A large eps tells them apart.
    shard, values = make_shard(rows=6, dim=3, optimizer="adagrad", lr=0.5, eps=0.3, eps_in_sqrt=in_sqrt,
                               initial_accumulator_value=0.2)
    ids, grads = np.array([1, 4, 1]), np.random.default_rng(5).standard_normal((3, 3)).astype(np.float32)
    shard.push(ids, grads)
    acc = np.full((6, 3), 0.2, np.float32)
    g = np.zeros((6, 3), np.float32)
    np.add.at(g, ids, grads)
    acc += g * g
    step = g / np.sqrt(acc + 0.3) if in_sqrt else g / (np.sqrt(acc) + 0.3)
    np.testing.assert_allclose(shard.values(), values - 0.5 * step, rtol=1e-5, atol=1e-6)
