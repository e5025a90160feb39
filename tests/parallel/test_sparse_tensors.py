"""The sparse tensors hybridsync hands torch give torch nothing to warn about.

torch warns once per process, "Sparse invariant checks are implicitly disabled ... Memory errors
(e.g. SEGFAULT) will occur", whenever a sparse tensor is built while the invariant checks were
never chosen. Every rank of `make demo` printed it when a table's gradient reached the wrapped
torch Adagrad as a sparse tensor (the all-gather route; sparse_as_dense gives it back sparse
too), and Horovod's sparse allreduce built one from other ranks' indices. Here those paths run
with that warning turned into an error, under both dense backends; the results must also be
right (every rank the same parameters, the sparse allreduce the dense sum).
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

ROWS, DIM = 30, 4


def rank_sparse_paths_build_checked_tensors():
    import warnings

    warnings.filterwarnings("error", message="Sparse invariant checks", category=UserWarning)
    import torch

    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"gathered": torch.nn.Embedding(ROWS, DIM, sparse=True),
                                 "densified": torch.nn.Embedding(ROWS, DIM, sparse=True),
                                 "out": torch.nn.Linear(DIM, 1)})
    config = {"variables": [{"match": "gathered.weight", "sync": "allgather"},
                            {"match": "densified.weight", "sync": "allreduce"}]}  # (as dense)
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), config=config)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        ids = torch.randint(0, ROWS, (5,), generator=g)
        opt.zero_grad()
        model["out"](model["gathered"](ids) * model["densified"](ids)).pow(2).mean().backward()
        opt.step()
    everyone = hvd.allgather_object([p.detach().tolist() for p in model.parameters()])
    assert all(e == everyone[0] for e in everyone), "ranks disagree on the parameters"
    # Horovod's sparse allreduce (all-gathered indices and values, built back into a tensor).
    grad = torch.sparse_coo_tensor(torch.tensor([[rank % ROWS, 1]]), torch.ones(2, DIM), (ROWS, DIM),
                                   check_invariants=True)
    summed = hvd.sparse_allreduce_async(grad, name="sparse.sum", op=hvd.Sum)()
    want = sum(torch.sparse_coo_tensor(torch.tensor([[r % ROWS, 1]]), torch.ones(2, DIM), (ROWS, DIM),
                                       check_invariants=True).to_dense() for r in range(size))
    assert torch.equal(summed.to_dense(), want)
    print(f"rank {rank}: sparse paths ran without torch's invariant warning", flush=True)


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
@pytest.mark.parametrize("np_", [2, 3])
def test_the_sparse_tensors_handed_to_torch_leave_it_nothing_to_warn_about(np_, backend):
    out = run_ranks(__file__, "rank_sparse_paths_build_checked_tensors", np_, timeout=120,
                    env={"HYBRIDSYNC_BACKEND": backend})
    assert out.count("without torch's invariant warning") == np_, out


if __name__ == "__main__":
    rank_main(globals())
