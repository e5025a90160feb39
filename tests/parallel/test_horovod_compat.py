"""What Horovod's own torch test suite (scripts/horovod_suite.py) needs of hybridsync.torch, checked
on real ranks under both dense backends: pre/post scaling of every reduction against a NumPy
reference of Horovod's arithmetic (and scales that differ between ranks raising on every rank),
DistributedOptimizer over a process set, SparseAdam with sparse_as_dense, Horovod's
`_parameter_names`, broadcast_optimizer_state for every torch.optim optimizer, and a rank that
shuts down while its peers wait in a collective. One job per world size runs every check under
each backend in turn (jobs are what costs time on 2 cores)."""
import copy
import functools

import numpy as np
import pytest

from tests.parallel.harness import rank_main, run_ranks

BACKENDS = ("mpi", "horovod")


# -- pre/post scaling -------------------------------------------------------------------------
def _scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's scaling on the CPU: integers in float64, truncated toward zero; float16 in
    float32; other floats in their own type."""
    if np.issubdtype(x.dtype, np.integer):
        return np.trunc(x.astype(np.float64) * factor).astype(x.dtype)
    if x.dtype == np.float16:
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return x * x.dtype.type(factor)


def _reduced(per_rank, op: str, pre: float, post: float) -> np.ndarray:
    total = functools.reduce(np.add, [_scaled(x, pre) for x in per_rank])
    return _scaled(total, post / len(per_rank) if op == "average" else post)


def _rows_of(rank: int, size: int, rows: int) -> slice:
    """The rows reducescatter gives `rank`: the first rows % size ranks get one more."""
    counts = [rows // size + (r < rows % size) for r in range(size)]
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def _assert_matches(got, want: np.ndarray, size: int, what: str) -> None:
    got = got.numpy()
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    if size == 2 or np.issubdtype(want.dtype, np.integer):  # a + b: no summation order to differ in
        assert np.array_equal(got, want), f"{what}: {got} != {want}"
    else:
        tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-13}[want.dtype.type]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 100, err_msg=what)


def check_scaling(hvd, rank, size):
    import torch

    dtypes = (np.int32, np.int64, np.float16, np.float32, np.float64)
    scales = ((0.37, 1.0), (1.0, 1.7), (0.61, 2.3))
    for dtype in dtypes:
        # Data every rank can rebuild for every other rank (the reference needs all of them).
        data = [np.random.default_rng(100 + r).integers(-100, 100, (2 * size + 1, 3, 2)).astype(dtype)
                for r in range(size)]
        second = [np.random.default_rng(200 + r).integers(-100, 100, (size + 2, 5)).astype(dtype)
                  for r in range(size)]
        mine, mine2 = torch.from_numpy(data[rank]), torch.from_numpy(second[rank])
        for op, (pre, post) in ((op, s) for op in (hvd.Sum, hvd.Average) for s in scales):
            name = "average" if op is hvd.Average else "sum"
            what = f"{np.dtype(dtype).name} {name} pre={pre} post={post}"
            want, want2 = _reduced(data, name, pre, post), _reduced(second, name, pre, post)
            kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
            _assert_matches(hvd.allreduce(mine, **kw), want, size, f"allreduce {what}")
            inplace = mine.clone()
            hvd.allreduce_(inplace, **kw)
            _assert_matches(inplace, want, size, f"allreduce_ {what}")
            got = hvd.grouped_allreduce([mine, mine2], **kw)
            _assert_matches(got[0], want, size, f"grouped_allreduce[0] {what}")
            _assert_matches(got[1], want2, size, f"grouped_allreduce[1] {what}")
            mine_rows, mine_rows2 = _rows_of(rank, size, want.shape[0]), _rows_of(rank, size, want2.shape[0])
            _assert_matches(hvd.reducescatter(mine, **kw), want[mine_rows], size, f"reducescatter {what}")
            got = hvd.grouped_reducescatter([mine, mine2], **kw)
            _assert_matches(got[0], want[mine_rows], size, f"grouped_reducescatter[0] {what}")
            _assert_matches(got[1], want2[mine_rows2], size, f"grouped_reducescatter[1] {what}")


def check_disagreeing_scales_raise(hvd, rank, size):
    """Scales that differ between ranks: an error on every rank, naming the collective, and the
    job goes on (Horovod would reduce with each rank's own factor)."""
    import torch

    t = torch.ones(2 * size, 3)
    calls = {
        "reducescatter 'rs.scales'": lambda: hvd.reducescatter(t, name="rs.scales", prescale_factor=1.0 + rank),
        "reducescatter 'grs.scales.0'": lambda: hvd.grouped_reducescatter([t, t], name="grs.scales",
                                                                         postscale_factor=1.0 + rank),
        "allreduce 'ar.scales'": lambda: hvd.allreduce(t, name="ar.scales", prescale_factor=1.0 + rank),
    }
    for label, call in calls.items():
        with pytest.raises(Exception, match=r"ranks disagree on \(prescale, postscale\)") as raised:
            call()
        assert str(raised.value).startswith(label), raised.value
    assert hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5).tolist() == [[0.5 * size] * 3] * 2


# -- the optimizer ----------------------------------------------------------------------------
class _Net:
    """An embedding (sparse or not) and a linear layer, in float64."""

    @staticmethod
    def make(sparse: bool):
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(12, 4, sparse=sparse)
                self.out = torch.nn.Linear(4, 1)

            def forward(self, ids):
                return self.out(self.emb(ids).mean(1)).squeeze(1)

        torch.manual_seed(0)
        return Net().double()

    @staticmethod
    def loss(net, rank: int, step: int):
        import torch

        rng = np.random.default_rng(1000 * step + rank)
        ids = torch.from_numpy(rng.integers(0, 12, (6, 3)))
        y = torch.from_numpy(rng.standard_normal(6))
        return torch.nn.functional.mse_loss(net(ids), y)


def _close(a, b, tol=1e-10):
    import torch

    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def check_process_set_optimizer(hvd, rank, size):
    """Members average their gradients only (the dense layer all-reduced, the sparse embedding
    all-gathered, over the set's communicator); a rank outside the set trains on its own."""
    import torch

    members = [0, size - 1] if size > 2 else [0]
    pset = hvd.add_process_set(members)
    net, ref = _Net.make(sparse=True), _Net.make(sparse=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2), named_parameters=net.named_parameters(),
                                   process_set=pset)
    assert set(opt._parameter_names.values()) == {"emb.weight", "out.weight", "out.bias"}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for step in range(3):
        opt.zero_grad()
        _Net.loss(net, rank, step).backward()
        opt.step()
        ref_opt.zero_grad()
        contributors = members if rank in members else [rank]
        (sum(_Net.loss(ref, r, step) for r in contributors) / len(contributors)).backward()
        ref_opt.step()
    for (name, a), b in zip(net.named_parameters(), ref.parameters()):
        _close(a, b)
    if rank in members:
        routes = {v.name: v.route.value for v in opt.plan.variables}
        assert routes == {"emb.weight": "allgather", "out.weight": "allreduce", "out.bias": "allreduce"}, routes
        # The parameter server spans every rank: a config that puts a table there is refused,
        # at wrap time with the model, at the first backward without it.
        ps_rule = {"variables": [{"match": "emb.weight", "sync": "ps"}]}
        with pytest.raises(ValueError, match="'emb.weight' is on the parameter server"):
            hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), process_set=pset, model=net,
                                     config=ps_rule)
        fresh = _Net.make(sparse=True)  # (net's parameters still carry opt's gradient hooks)
        late = hvd.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1),
                                        named_parameters=fresh.named_parameters(), process_set=pset, config=ps_rule)
        with pytest.raises(Exception, match="'emb.weight' is on the parameter server"):
            _Net.loss(fresh, rank, 0).backward()
        del late
    hvd.remove_process_set(pset)


def check_sparse_adam_sparse_as_dense(hvd, rank, size):
    """SparseAdam takes only sparse gradients: the averaged one comes back sparse, and the
    result is that of one process training on every rank's batch."""
    import torch

    torch.manual_seed(1)
    emb = torch.nn.Embedding(20, 3, sparse=True).double()
    ref = torch.nn.Embedding(20, 3, sparse=True).double()
    ref.load_state_dict(emb.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True)
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)

    def loss(module, r, step):
        rng = np.random.default_rng(50 * step + r)
        ids = torch.from_numpy(rng.integers(0, 20, 5))
        return (module(ids) * torch.from_numpy(rng.standard_normal((5, 3)))).sum()
    for step in range(3):
        opt.zero_grad()
        loss(emb, rank, step).backward()
        opt.step()
        assert emb.weight.grad.is_sparse
        ref_opt.zero_grad()
        (sum(loss(ref, r, step) for r in range(size)) / size).backward()
        ref_opt.step()
    assert opt.plan.variables[0].route.value == "allreduce-as-dense"
    _close(emb.weight, ref.weight, 1e-9)


def check_parameter_names(hvd, rank, size):
    """Horovod's optimizer._parameter_names: parameter -> name, 'allreduce.noname.<group>.<i>'
    without named_parameters, the same on every rank."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    want = {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(opt.param_groups) for j, p in enumerate(g["params"])}
    assert opt._parameter_names == want
    everyone = hvd.allgather_object(sorted(opt._parameter_names.values()))
    assert everyone == [sorted(want.values())] * size
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}


# -- broadcast_optimizer_state ----------------------------------------------------------------
def _optimizer_cases():
    """(class, kwargs) for every optimizer class torch.optim exports: its defaults, a tensor lr,
    and more variants where a class has state-changing options. differentiable=True is left
    out (its step needs parameters that are not leaves) and capturable=True too (CUDA only)."""
    import inspect

    import torch

    T = torch.tensor
    classes = sorted((c for c in vars(torch.optim).values()
                      if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer),
                     key=lambda c: c.__name__)
    extra = {"Adam": [dict(lr=T(0.01), betas=(T(0.8), T(0.95)), amsgrad=True, foreach=False), dict(fused=True)],
             "SGD": [dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), dict(momentum=0.5, fused=True)],
             "RMSprop": [dict(centered=True, momentum=0.5)], "Adagrad": [dict(lr_decay=0.1, fused=True)],
             "NAdam": [dict(decoupled_weight_decay=True)], "Muon": [dict(nesterov=False, weight_decay=0.1)],
             "LBFGS": [dict(history_size=3, line_search_fn="strong_wolfe")]}
    for cls in classes:
        tensor_lr = dict(lr=T(0.01))
        if "foreach" in inspect.signature(cls.__init__).parameters:
            tensor_lr["foreach"] = False  # torch refuses a tensor lr with foreach
        for kwargs in [{}, tensor_lr, *extra.get(cls.__name__, [])]:
            yield cls, kwargs


def _params_for(cls):
    """Trainable parameters the class accepts (Muon: 2-D only; SparseAdam: an embedding table
    with sparse gradients), and one that does not train (it never gets a gradient or state)."""
    import torch

    torch.manual_seed(3)
    frozen = torch.nn.Parameter(torch.randn(2, 2), requires_grad=False)
    if cls is torch.optim.SparseAdam:
        return [torch.nn.Parameter(torch.randn(6, 3)), frozen]
    second = torch.randn(3, 3) if cls is torch.optim.Muon else torch.randn(3)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(second), frozen]


def _train(opt, params, rank, steps):
    import torch

    for step in range(steps):
        gen = torch.Generator().manual_seed(10 * rank + step)
        trainable = [p for p in params if p.requires_grad]

        def closure():
            opt.zero_grad()
            loss = sum(((p - torch.randn(p.shape, generator=gen)) ** 2).sum() for p in trainable)
            loss.backward()
            if isinstance(opt, torch.optim.SparseAdam):
                for p in trainable:
                    p.grad = p.grad.to_sparse()
            return loss
        if isinstance(opt, torch.optim.LBFGS):
            opt.step(closure)
        else:
            closure()
            opt.step()


def _same(a, b, where="state_dict"):
    import torch

    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_broadcast_optimizer_state(hvd, rank, size):
    """Every torch.optim optimizer: rank 0's state and hyper-parameters (tensors too, copied into
    the tensors the other ranks hold) reach every rank, whose own state differed (more steps,
    other lr), or did not exist; state of a parameter the root has none for goes."""
    import torch

    for cls, kwargs in _optimizer_cases():
        label = f"{cls.__name__}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
        for root_fresh in (False, True):
            params = _params_for(cls)
            opt = cls(params, **kwargs)
            if not (root_fresh and rank == 0):
                _train(opt, params, rank, steps=rank + 1)
            if rank != 0:  # other hyper-parameters than the root's, state the root has not got
                opt.state[params[-1]]["not.on.root"] = torch.ones(2)
                lr = opt.param_groups[0]["lr"]
                if torch.is_tensor(lr):
                    lr.fill_(0.5)
                else:
                    opt.param_groups[0]["lr"] = 0.5
            lr_before = opt.param_groups[0]["lr"]
            root_before = copy.deepcopy(opt.state_dict()) if rank == 0 and not root_fresh else None
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            if root_before is not None:
                _same(opt.state_dict(), root_before, f"{label} on the root")
            if torch.is_tensor(lr_before):
                assert opt.param_groups[0]["lr"] is lr_before, label  # updated in place
            everyone = hvd.allgather_object(opt.state_dict())
            for other in everyone[1:]:
                _same(other, everyone[0], f"{label} root_fresh={root_fresh}")
            # Stateless: plain SGD; LBFGS on a fresh root (its state needs a closure to make).
            stateless = (cls is torch.optim.SGD and not kwargs.get("momentum")) or (
                root_fresh and cls is torch.optim.LBFGS)
            assert bool(everyone[0]["state"]) != stateless, label  # the root's state, made if it had none


def rank_compat():
    import torch

    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    for backend in BACKENDS:
        hvd.init(backend=backend)
        check_scaling(hvd, rank, size)
        check_disagreeing_scales_raise(hvd, rank, size)
        check_process_set_optimizer(hvd, rank, size)
        check_sparse_adam_sparse_as_dense(hvd, rank, size)
        check_parameter_names(hvd, rank, size)
        check_broadcast_optimizer_state(hvd, rank, size)
        print(f"rank {rank}: Horovod compatibility checks passed ({backend})", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_compatibility_under_both_backends(np_):
    out = run_ranks(__file__, "rank_compat", np_, timeout=300)
    assert out.count("Horovod compatibility checks passed") == 2 * np_, out


# -- a rank that leaves while the others wait -------------------------------------------------
def rank_peer_leaves(backend):
    """Rank 0 ends its script while the others wait for it in a reducescatter: they raise
    (as Horovod's waits do once a peer has shut down) instead of waiting forever."""
    import torch

    import hybridsync.torch as hvd
    from hybridsync.comm.mpi_kernels import PeerLostError

    hvd.init(backend=backend)
    rank, size = hvd.rank(), hvd.size()
    t = torch.ones(2 * size, 2)
    assert hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5).tolist() == [[0.5 * size] * 2] * 2
    if rank == 0:
        return  # shuts down at exit
    with pytest.raises(PeerLostError, match="rank 0 .*has shut down"):
        hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5, name="after.rank0.left")
    print(f"rank {rank}: raised after rank 0 left ({backend})", flush=True)


@pytest.mark.parametrize("np_,backend", [(2, "mpi"), (3, "mpi"), (2, "horovod"), (3, "horovod")])
def test_a_rank_that_shuts_down_ends_its_peers_waits(np_, backend):
    out = run_ranks(__file__, "rank_peer_leaves", np_, backend, timeout=90)
    assert out.count("raised after rank 0 left") == np_ - 1, out


if __name__ == "__main__":
    rank_main(globals())
