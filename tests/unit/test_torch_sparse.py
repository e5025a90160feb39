"""The sparse path in one process (a world of size 1): PS-backed modules behave as the torch
modules they replace, unsupported optimizers are clear errors, and explain() shows the plan."""
import io

import pytest
import torch
import torch.nn.functional as F

import hybridsync
import hybridsync.torch as hvd


class Net(torch.nn.Module):
    def __init__(self, bag_mode="sum", padding_idx=None):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(30, 4, padding_idx=padding_idx, sparse=True)
        self.bag = torch.nn.EmbeddingBag(20, 4, mode=bag_mode, sparse=True)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, ids, bag_ids, offsets=None, weights=None):
        return self.out(torch.cat([self.emb(ids).sum(1), self.bag(bag_ids, offsets, weights)], 1))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 30, (6, 3), generator=g)
    ids[0, 0] = 0  # the padding row, when there is one
    return ids, torch.randint(0, 20, (12,), generator=g), torch.tensor([0, 2, 5, 5, 9, 10]), torch.rand(12, generator=g)


@pytest.mark.parametrize("bag_mode", ["sum", "mean"])
@pytest.mark.parametrize("placement", ["sharded", "replicated"])
def test_ps_modules_train_like_torch(bag_mode, placement):
    plain, dist = Net(bag_mode, padding_idx=0), Net(bag_mode, padding_idx=0)
    plain_opt = torch.optim.Adagrad(plain.parameters(), lr=0.1)
    kwargs = {"model": dist} if placement == "sharded" else {"named_parameters": dist.named_parameters()}
    dist_opt = hvd.DistributedOptimizer(torch.optim.Adagrad(dist.parameters(), lr=0.1), **kwargs)
    if placement == "sharded":
        assert isinstance(dist.emb, hvd.Embedding) and isinstance(dist.bag, hvd.EmbeddingBag)
    for step in range(4):
        ids, bag_ids, offsets, weights = _batch(step)
        weights = weights if bag_mode == "sum" else None  # per_sample_weights need mode='sum'
        for model, opt in ((plain, plain_opt), (dist, dist_opt)):
            opt.zero_grad()
            F.mse_loss(model(ids, bag_ids, offsets, weights), torch.ones(6, 1)).backward()
            opt.step()
    got, want = dist.state_dict(), plain.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    assert (got["emb.weight"][0] == 0).all()  # padding row untouched


def test_directly_built_ps_embedding_is_planned_and_trained():
    model = torch.nn.Sequential(hvd.Embedding(100, 3, name="users"), torch.nn.Flatten(), torch.nn.Linear(6, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model=model)
    before = model.state_dict()["0.weight"].clone()
    ids = torch.tensor([[1, 2], [2, 7]])
    model(ids).sum().backward()
    opt.step()
    after = model.state_dict()["0.weight"]
    changed = (after != before).any(1).nonzero().flatten().tolist()
    assert changed == [1, 2, 7]
    row = {v.name: v for v in opt.plan.variables}["0.weight"]
    assert (row.route.value, row.placement.value, row.optimizer["name"]) == ("ps", "sharded", "sgd")


@pytest.mark.parametrize("make, message", [
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "variable 'emb.weight': RMSprop is not supported"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "variable 'emb.weight': SGD with momentum=0.9"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01), "variable 'emb.weight': Adam with weight_decay=0.01"),
    (lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.1), "variable 'emb.weight': Adagrad with weight_decay"),
])
def test_optimizer_without_a_server_rule_is_an_error_naming_it_and_the_variable(make, message):
    model = Net()
    with pytest.raises(ValueError, match=message):
        hvd.DistributedOptimizer(make(model.parameters()), model=model)


def test_unsupported_optimizer_without_model_fails_at_first_backward():
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.RMSprop(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ids, bag_ids, offsets, _ = _batch(0)
    with pytest.raises(ValueError, match=r"variable '(emb|bag)\.weight': RMSprop is not supported"):
        model(ids, bag_ids, offsets).sum().backward()
    del opt


def test_explain_prints_one_row_per_variable_with_bytes_after_a_step():
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model)
    ids, bag_ids, offsets, _ = _batch(0)
    model(ids, bag_ids, offsets).sum().backward()
    opt.step()
    out = io.StringIO()
    text = hybridsync.explain(file=out)
    rows = {line.split()[0]: line for line in text.splitlines()[3:] if line.strip()}
    for name in ("emb.weight", "bag.weight", "out.weight", "out.bias"):
        assert name in rows, text
    assert "ps" in rows["emb.weight"] and "sharded" in rows["emb.weight"] and "adagrad(lr=0.1" in rows["emb.weight"]
    assert "allreduce" in rows["out.weight"] and " 1 " in rows["emb.weight"]  # one shard in a world of one
    assert "(after step 1)" not in rows["emb.weight"] and " B " in rows["emb.weight"]
    assert " 0 B " in rows["out.weight"]  # nothing to all-reduce in a world of one


def test_max_norm_cannot_be_sharded():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 2, max_norm=1.0, sparse=True))
    with pytest.raises(ValueError, match="embedding '0.weight': max_norm"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
