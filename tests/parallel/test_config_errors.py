"""A bad config raises on every rank before any communication, and a rank whose model differs
makes every rank raise, naming the variable, instead of leaving the others in a collective."""
from tests.parallel.harness import rank_main, run_ranks


def rank_bad_config():
    import pytest
    import torch

    import hybridsync.torch as hvd
    from hybridsync import ConfigError

    model = torch.nn.Sequential(torch.nn.Embedding(10, 2, sparse=True), torch.nn.Flatten(), torch.nn.Linear(4, 1))
    for bad, message in (({"variables": [{"match": "0.weight", "sync": "ps", "partitions": 99}]}, "more than the world size"),
                         ({"strict": True, "variables": [{"match": "typo", "sync": "ps"}]}, "matches no variable"),
                         ({"variables": [{"match": "0.weight", "sync": "teleport"}]}, "'teleport' is not one of")):
        with pytest.raises(ConfigError, match=message):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, config=bad)
    # Nobody was left behind in a collective: a good wrap and a step still work on every rank.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()


def rank_model_differs():
    import pytest
    import torch

    import hybridsync.torch as hvd

    width = 3 if hvd.rank() == 1 else 2
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, width))
    with pytest.raises(RuntimeError, match=r"rank 1 differs from rank 0 at variable #2: rank 0 has 1.weight \(2, 5\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)


def rank_unmatched_rule(path):
    """A rule that matches nothing (no strict): the plan is made on every rank; rank 0 warns,
    once, though two optimizers plan with the config; the other ranks say nothing."""
    import warnings

    import torch

    import hybridsync.torch as hvd

    warnings.simplefilter("always")  # hybridsync's own "once", not Python's registry, is under test
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 2, sparse=True), "mlp": torch.nn.Linear(2, 1)})
    for _ in range(2):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, config=path)
    model["mlp"](model["emb"](torch.tensor([1, 2]))).sum().backward()
    opt.step()


def test_a_rule_matching_nothing_warns_on_rank_0_only_once(tmp_path):
    import re

    path = tmp_path / "hs.yaml"
    path.write_text("variables:\n  - match: mpl.*\n    compression: fp16\n")
    out = run_ranks(__file__, "rank_unmatched_rule", 2, str(path))
    lines = [line for line in out.splitlines() if "matches no variable" in line]
    assert len(lines) == 1 and re.match(r"\[1,0\]<stderr>:", lines[0]), out
    assert f"{path}:2: match: rule 'mpl.*' matches no variable; closest: mlp.weight, mlp.bias" in lines[0], lines


def test_bad_config_raises_on_every_rank_before_communication():
    run_ranks(__file__, "rank_bad_config", 2)


def test_a_rank_whose_model_differs_is_named_on_every_rank():
    run_ranks(__file__, "rank_model_differs", 3)


if __name__ == "__main__":
    rank_main(globals())
