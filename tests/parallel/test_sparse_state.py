"""Checkpoints of PS tables: model.state_dict() gathers each sharded table whole under its
original key on every rank, the optimizer's state_dict() carries the server optimizer state,
and a torch.save / torch.load(weights_only=True) round trip continues training exactly."""
import pytest

from tests.parallel.harness import rank_main, run_ranks

ROWS, DIM = 40, 3


def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(ROWS, DIM, sparse=True), "out": torch.nn.Linear(DIM, 1)})


def _wrap(model, placement):
    import torch

    import hybridsync.torch as hvd

    opt = torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=0.05)
    if placement == "sharded":
        return hvd.DistributedOptimizer(opt, model=model)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())


def _steps(model, opt, first, count):
    import torch

    import hybridsync.torch as hvd

    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step * 10 + hvd.rank())
        ids = torch.randint(0, ROWS, (8, 2), generator=g)
        opt.zero_grad()
        model["out"](model["emb"](ids).sum(1)).pow(2).mean().backward()
        opt.step()


def rank_checkpoint(placement, directory):
    import os

    import torch

    import hybridsync.torch as hvd

    rank = hvd.rank()
    model = _model(seed=1)
    opt = _wrap(model, placement)
    _steps(model, opt, 0, 4)
    state = model.state_dict()
    assert tuple(state["emb.weight"].shape) == (ROWS, DIM), state["emb.weight"].shape
    tables = hvd.allgather_object(state["emb.weight"].tolist())
    assert all(t == tables[0] for t in tables), "every rank sees the same whole table"
    path = os.path.join(directory, f"{placement}-rank{rank}.pt")
    torch.save({"model": state, "optimizer": opt.state_dict()}, path)
    _steps(model, opt, 4, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    restored = _model(seed=2)  # different weights until the checkpoint is loaded
    restored_opt = _wrap(restored, placement)
    checkpoint = torch.load(path, weights_only=True)  # loading never runs code from the file
    restored.load_state_dict(checkpoint["model"])
    restored_opt.load_state_dict(checkpoint["optimizer"])
    _steps(restored, restored_opt, 4, 3)
    for key, value in restored.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{placement} {key}: {m}")
    print(f"rank {rank}: {placement} checkpoint round trip continues exactly", flush=True)


@pytest.mark.parametrize("placement", ["sharded", "replicated"])
def test_checkpoint_round_trip(placement, tmp_path):
    run_ranks(__file__, "rank_checkpoint", 3, placement, str(tmp_path))


if __name__ == "__main__":
    rank_main(globals())
