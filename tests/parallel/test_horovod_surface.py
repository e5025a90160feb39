"""horovod.torch's surface under both dense backends, on real ranks: reduction ops with
pre/post scaling, async and grouped forms, alltoall, reducescatter, sparse all-reduce, process
sets, gradients of the differentiable collectives, join with uneven batches, the optimizer's
Horovod keywords (sparse_as_dense, groups, process_set), broadcast_optimizer_state's state
initialisation, SyncBatchNorm and the top-level hybridsync broadcasts. One -np 3 job runs every
check under each backend in turn (jobs are what costs time on 2 cores)."""
import pytest

from tests.parallel.harness import rank_main, run_ranks


def _close(a, b, tol=1e-5):
    import torch

    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def check_reductions(hvd, rank, size):
    import torch

    x = torch.tensor([1.0, -2.0, 3.0 + rank, 0.5 * (rank + 1)])
    per_rank = torch.stack([torch.tensor([1.0, -2.0, 3.0 + r, 0.5 * (r + 1)]) for r in range(size)])
    pre, post = 2.0, 3.0
    expect = {hvd.Sum: per_rank.mul(pre).sum(0) * post, hvd.Average: per_rank.mul(pre).mean(0) * post,
              hvd.Min: per_rank.mul(pre).min(0).values * post, hvd.Max: per_rank.mul(pre).max(0).values * post,
              hvd.Product: per_rank.mul(pre).prod(0) * post}
    for op, want in expect.items():
        _close(hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post, name=f"r.{op}"), want)
        y = x.clone()
        hvd.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post)
        _close(y, want)
    # Integers scale per rank and after the sum, truncating toward zero (Horovod's rules).
    i = torch.tensor([1, 2, 3 + rank, -5, -4 + rank], dtype=torch.int32)
    ints = torch.stack([torch.tensor([1, 2, 3 + r, -5, -4 + r]) for r in range(size)]).double()
    assert hvd.allreduce(i, op=hvd.Sum, prescale_factor=0.5).tolist() == (ints * 0.5).trunc().sum(0).int().tolist()
    assert hvd.allreduce(i, op=hvd.Average).tolist() == (ints.sum(0) / size).trunc().int().tolist()
    got = hvd.allreduce(i.long(), op=hvd.Sum, postscale_factor=1.5)
    assert got.tolist() == (ints.sum(0) * 1.5).trunc().long().tolist()
    half = hvd.allreduce(x.half(), op=hvd.Max)
    assert half.dtype == torch.float16 and half.tolist() == per_rank.max(0).values.half().tolist()
    assert hvd.allreduce(x, average=False).tolist() == per_rank.sum(0).tolist()  # the deprecated flag
    with pytest.raises(ValueError):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    nc = torch.arange(12.0).view(3, 4).t()  # non-contiguous in place
    hvd.allreduce_(nc, op=hvd.Sum)
    _close(nc, torch.arange(12.0).view(3, 4).t() * size)


def check_async_grouped_and_the_rest(hvd, rank, size):
    import torch

    t = torch.full((3,), float(rank))
    handles = [hvd.allreduce_async(t, name="a.mean"), hvd.allgather_async(t[: rank + 1], name="a.gather"),
               hvd.broadcast_async(t, root_rank=size - 1, name="a.bcast")]
    h_inplace = hvd.allreduce_async_(t.clone(), op=hvd.Sum, name="a.sum")
    while not hvd.poll(handles[0]):
        pass
    mean, gathered, bcast = (hvd.synchronize(h) for h in handles)
    _close(mean, torch.full((3,), (size - 1) / 2))
    _close(gathered, torch.cat([torch.full((r + 1,), float(r)) for r in range(size)]))
    _close(bcast, torch.full((3,), float(size - 1)))
    _close(hvd.synchronize(h_inplace), torch.full((3,), float(sum(range(size)))))
    b = t.clone()
    hvd.synchronize(hvd.broadcast_async_(b, root_rank=0))
    assert (b == 0).all() and t[0] == rank
    outs = hvd.grouped_allreduce([t, t * 2], op=hvd.Sum, name="g")
    _close(outs[1], torch.full((3,), 2.0 * sum(range(size))))
    ts = [t.clone(), t.clone() * 3]
    hvd.grouped_allreduce_(ts, op=hvd.Average)
    _close(ts[1], torch.full((3,), 3 * (size - 1) / 2))
    handle = hvd.grouped_allreduce_async([t], op=hvd.Max)
    _close(hvd.synchronize(handle)[0], torch.full((3,), float(size - 1)))
    gathered = hvd.grouped_allgather([t[: rank + 1], t.view(3, 1)])
    assert gathered[0].shape == (sum(range(1, size + 1)),) and gathered[1].shape == (3 * size, 1)
    # alltoall: rank r sends r+1 rows to every rank (splits), then equal parts (no splits).
    rows = torch.arange(size * (rank + 1), dtype=torch.float32) + 100 * rank
    got, received = hvd.alltoall(rows, splits=[rank + 1] * size)
    assert received.tolist() == [r + 1 for r in range(size)]
    expect = torch.cat([torch.arange(rank * (r + 1), (rank + 1) * (r + 1), dtype=torch.float32) + 100 * r
                        for r in range(size)])
    _close(got, expect)
    _close(hvd.alltoall(torch.arange(size, dtype=torch.float32) + 10 * rank),
           torch.tensor([rank + 10.0 * r for r in range(size)]))
    # reducescatter: rows split as evenly as possible, the first ranks one more.
    m = torch.ones(2 * size + 1, 2) * (rank + 1)
    mine = 2 + (rank < 1)
    _close(hvd.reducescatter(m, op=hvd.Sum), torch.full((mine, 2), float(sum(range(1, size + 1)))))
    _close(hvd.grouped_reducescatter([m], op=hvd.Average)[0], torch.full((mine, 2), (size + 1) / 2))
    # Sparse gradients: all-gathered indices and values, averaged.
    sparse = torch.sparse_coo_tensor([[rank]], [[float(rank + 1)]], (size, 1))
    dense = hvd.synchronize(hvd.sparse_allreduce_async(sparse, name="sp", op=hvd.Average)).to_dense()
    _close(dense, torch.tensor([[(r + 1) / size] for r in range(size)]))
    hvd.barrier()
    assert hvd.broadcast_object({"r": rank} if rank == 0 else None, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(rank) == list(range(size))
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert isinstance(hvd.nccl_built(), int) and hvd.cross_size() == 1 and hvd.cross_rank() == 0


def check_process_sets(hvd, rank, size):
    import torch

    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = hvd.add_process_set(hvd.ProcessSet([1]))
    assert evens.size() == len(evens.ranks) and hvd.global_process_set.size() == size
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    if evens.included():
        t = torch.full((2,), float(rank))
        _close(hvd.allreduce(t, op=hvd.Sum, process_set=evens), torch.full((2,), float(sum(evens.ranks))))
        gathered = hvd.allgather(t[:1], process_set=evens)
        assert gathered.tolist() == [float(r) for r in evens.ranks] and evens.rank() == evens.ranks.index(rank)
        # Root ranks are global ranks, as in Horovod.
        assert hvd.broadcast(t, root_rank=evens.ranks[-1], process_set=evens).tolist() == [float(evens.ranks[-1])] * 2
        assert hvd.broadcast_object(rank, root_rank=evens.ranks[-1], process_set=evens) == evens.ranks[-1]
        hvd.barrier(process_set=evens)
    else:
        with pytest.raises(ValueError, match="not part of"):
            hvd.allreduce(torch.ones(1), process_set=evens)
        assert odd.rank() == 0 and hvd.allreduce(torch.ones(1), process_set=odd).item() == 1
    assert hvd.remove_process_set(odd) and not hvd.remove_process_set(odd)
    assert not hvd.remove_process_set(hvd.global_process_set)
    hvd.remove_process_set(evens)


def check_gradients(hvd, rank, size):
    """Backward of each differentiable collective: exact (finite differences of the sum of every
    rank's loss) where Horovod's is exact, Horovod's formulas elsewhere."""
    import torch

    torch.manual_seed(rank)
    w = torch.randn(4, dtype=torch.float64)

    def global_loss(f, x):
        return hvd.allreduce(f(x).detach(), op=hvd.Sum).item()

    def check_exact(f, x):
        x = x.clone().requires_grad_(True)
        f(x).backward()
        eps, numeric = 1e-6, torch.zeros_like(x)
        for who in range(size):  # rank `who` perturbs one coordinate; every rank evaluates
            for i in range(x.numel()):
                d = torch.zeros_like(x).view(-1)
                d[i] = eps if rank == who else 0.0
                diff = (global_loss(f, x.detach() + d.view_as(x)) - global_loss(f, x.detach() - d.view_as(x)))
                if rank == who:
                    numeric.view(-1)[i] = diff / (2 * eps)
        _close(x.grad, numeric, 1e-5)

    x = torch.randn(4, dtype=torch.float64) + rank
    for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
        check_exact(lambda v, op=op: (hvd.allreduce(v, op=op, prescale_factor=1.5, postscale_factor=0.5) * w).sum(), x)
    weights = torch.arange(2.0 * size, dtype=torch.float64) * (rank + 1)
    check_exact(lambda v: (hvd.alltoall(v) * weights).sum(), torch.randn(2 * size, dtype=torch.float64))
    check_exact(lambda v: (hvd.grouped_allreduce([v, 2 * v], op=hvd.Sum)[1] * w).sum(), x)
    # Horovod's conventions: allgather/broadcast average the incoming gradient over ranks.
    g = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    (hvd.allgather(g) * (rank + 1)).sum().backward()
    _close(g.grad, torch.full((3, 2), (size + 1) / 2, dtype=torch.float64))
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    (hvd.broadcast(b, root_rank=1) * (rank + 1)).sum().backward()
    _close(b.grad, torch.full((3,), (size + 1) / 2 if rank == 1 else 0.0, dtype=torch.float64))
    r = torch.randn(size, 2, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(r, op=hvd.Sum) * (rank + 1)).sum().backward()
    _close(r.grad, torch.cat([torch.full((1, 2), float(size * (k + 1)), dtype=torch.float64) for k in range(size)]))


def check_sync_batch_norm(hvd, rank, size):
    import torch

    torch.manual_seed(0)
    full = torch.randn(4 * size, 3, 5, dtype=torch.float64)
    mine = full[4 * rank:4 * rank + 4].clone().requires_grad_(True)
    sync, ref = hvd.SyncBatchNorm(3).double(), torch.nn.BatchNorm1d(3).double()
    out = sync(mine)
    (out * out).sum().backward()
    whole = full.clone().requires_grad_(True)
    ref_out = ref(whole)
    (ref_out * ref_out).sum().backward()
    _close(out, ref_out[4 * rank:4 * rank + 4])
    _close(mine.grad, whole.grad[4 * rank:4 * rank + 4])
    _close(sync.running_var, ref.running_var)
    _close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad)


def check_optimizer_keywords(hvd, rank, size, backend):
    import torch

    import hybridsync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))
    ref = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                                   hvd.Compression.none, 1, hvd.Average, 1.0, 0, [[model[1].weight]],
                                   True, hvd.global_process_set, backend=backend)
    ids = torch.tensor([[r, r + 1] for r in range(size)])
    for _ in range(2):
        opt.zero_grad()
        model(ids[rank:rank + 1]).sum().backward()
        opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        ref_opt.zero_grad()
        (ref(ids).sum() / size).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        _close(a, b)
    assert {v.name: v.route.value for v in opt.plan.variables}["0.weight"] == "allreduce-as-dense"
    with pytest.raises(ValueError, match="not registered"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(NotImplementedError, match="Average, Sum or Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Max)
    with pytest.raises(ValueError, match="only appear once"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=[[model[1].bias]] * 2)
    # broadcast_optimizer_state creates state for parameters without gradients, as Horovod does.
    lin = torch.nn.Linear(2, 2)
    adam = torch.optim.Adam(lin.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:
        lin(torch.ones(1, 2)).sum().backward()
        adam.step()
        adam.state[lin.bias]["exp_avg"] += 7
    before = lin.weight.detach().clone()
    hybridsync.broadcast_optimizer_state(adam, root_rank=0)
    assert all(set(adam.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in lin.parameters())
    assert adam.param_groups[0]["lr"] == pytest.approx(0.01)
    states = hvd.allgather_object([adam.state[p]["exp_avg"].tolist() for p in lin.parameters()])
    assert all(s == states[0] for s in states)
    assert rank == 0 or torch.equal(lin.weight, before)  # the initialising step leaves weights alone
    fresh = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    hvd.broadcast_optimizer_state(fresh, root_rank=1)  # every rank initialises, then rank 1's state
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in fresh.state.values())
    hybridsync.broadcast_parameters(lin, root_rank=1)
    w = hvd.allgather_object(lin.weight.tolist())
    assert all(v == w[0] for v in w)
    assert hybridsync.broadcast_object("x" if rank == 1 else None, 1) == "x"
    assert hybridsync.allgather_object(rank) == list(range(size))


def check_elastic(hvd, rank, size):
    """hvd.elastic in a fixed job: run() starts every rank from rank 0's state; commit/restore."""
    import torch

    model = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(model.weight, float(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=rank)

    @hvd.elastic.run
    def train(state):
        assert state.epoch == 0 and model.weight.detach().eq(0).all()
        state.epoch = 5
        state.commit()
        state.epoch = 6
        state.restore()
        return state.epoch, list(iter(state.sampler))

    epoch, indices = train(state)
    total = -(-10 // size) * size  # padded so every rank gets as many samples
    assert epoch == 5 and indices == (list(range(10)) * 2)[:total][rank::size]


def check_join(hvd, rank, size):
    """Uneven batches: rank r trains r+1 steps then joins; the others' all-reduces count it as
    zeros (the average still divides by the world size), as Horovod's join does. Two
    optimizers (as a GAN has) step each time: a joined rank stands in for both."""
    import torch

    models = [torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(3, 2, bias=False)]
    opts = []
    for model in models:
        torch.nn.init.zeros_(model.weight)
        opts.append(hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                             named_parameters=model.named_parameters()))
    for step in range(rank + 1):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(torch.ones(1, model.in_features)).sum().backward()  # gradient 1 on every active rank
            opt.step()
        if step == 0:  # a user collective while nobody has joined yet
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="before.join").item() == size
    assert hvd.join() == size - 1
    # Step s has size - s active ranks; rank r applied steps 0..r.
    for model in models:
        _close(model.weight.detach(), torch.full_like(model.weight, -sum((size - s) / size for s in range(rank + 1))))
    # While a rank has joined, others' all-reduces see its zeros; other collectives are errors.
    if rank == 0:
        assert hvd.join() != 0
    else:
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="during.join").item() == size - 1
        with pytest.raises(RuntimeError, match="(?i)join"):
            hvd.allgather(torch.ones(1), name="gather.during.join")
        assert hvd.join() != 0
    # Horovod's test_horovod_join_broadcast pattern: a collective refused because a rank joined,
    # then join at once; every rank must name a later joiner (the Horovod backend used to answer
    # with Horovod's coordinator's order, which could name the first joiner).
    for first in range(size):
        if rank == first:
            assert hvd.join() != first
        else:
            with pytest.raises(RuntimeError):
                hvd.broadcast(torch.ones(17, 17), rank, name=f"refused.{first}")
            assert hvd.join() != first


def rank_surface():
    import torch

    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    for backend in ("mpi", "horovod"):  # one job, both backends: starting jobs is what costs
        hvd.init(backend=backend)  # the default of the collectives and optimizers below
        check_reductions(hvd, rank, size)
        check_async_grouped_and_the_rest(hvd, rank, size)
        check_process_sets(hvd, rank, size)
        check_gradients(hvd, rank, size)
        check_sync_batch_norm(hvd, rank, size)
        check_optimizer_keywords(hvd, rank, size, backend)
        check_elastic(hvd, rank, size)
        check_join(hvd, rank, size)
        print(f"rank {rank}: Horovod surface checks passed ({backend})", flush=True)


def test_horovod_surface_under_both_backends():
    out = run_ranks(__file__, "rank_surface", 3, timeout=240)
    assert out.count("Horovod surface checks passed") == 6, out


if __name__ == "__main__":
    rank_main(globals())
