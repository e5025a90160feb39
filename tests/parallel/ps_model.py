"""A small torch model with one PS embedding table, and one training step of it: what the
whole-table and elastic-state tests train between the operations they measure."""


def ps_model(rows: int, dim: int):
    import torch

    import hybridsync.torch as hvd

    torch.manual_seed(0)
    return torch.nn.ModuleDict({"emb": hvd.Embedding(rows, dim), "out": torch.nn.Linear(dim, 1)})


def ps_step(model, opt, step: int) -> None:
    """One step on ids drawn per (step, rank)."""
    import torch

    import hybridsync.torch as hvd

    g = torch.Generator().manual_seed(step * 101 + hvd.rank())
    ids = torch.randint(0, model["emb"].num_embeddings, (64,), generator=g)
    opt.zero_grad()
    model["out"](model["emb"](ids)).pow(2).mean().backward()
    opt.step()
