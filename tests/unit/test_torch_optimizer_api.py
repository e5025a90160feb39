"""DistributedOptimizer behaves as the wrapped torch optimizer, and bad use is a clear error.
(One process: a world of size 1.)"""
import pytest
import torch

import hybridsync
import hybridsync.torch as hvd


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _backward(model, seed=0):
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()


@pytest.fixture(params=["horovod", "mpi"])
def backend(request):
    return request.param


def test_wrapped_optimizer_is_still_the_torch_optimizer(backend):
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), backend=backend)
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups is base.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for seed in range(3):
        opt.zero_grad()
        _backward(model, seed)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    state = opt.state_dict()
    assert len(state["state"]) == 4 and "momentum_buffer" in state["state"][0]
    # Round trip through a fresh wrapped optimizer.
    other = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9),
                                     named_parameters=model.named_parameters(), backend=backend)
    other.load_state_dict(state)
    assert other.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    torch.testing.assert_close(other.state[model[0].weight]["momentum_buffer"], opt.state[model[0].weight]["momentum_buffer"])


def test_same_result_as_plain_optimizer_on_one_rank(backend):
    plain_model, dist_model = _model(), _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    dist = hvd.DistributedOptimizer(torch.optim.Adam(dist_model.parameters(), lr=0.01), model=dist_model, backend=backend)
    for seed in range(4):
        for model, opt in ((plain_model, plain), (dist_model, dist)):
            opt.zero_grad()
            _backward(model, seed)
            opt.step()
    for a, b in zip(plain_model.parameters(), dist_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_duplicate_names_are_an_error():
    model = _model()
    named = [("w", model[0].weight), ("w", model[0].bias), ("x", model[2].weight), ("y", model[2].bias)]
    with pytest.raises(ValueError, match="must be unique; duplicates: w"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)


def test_parameter_missing_from_named_parameters_is_an_error():
    model = _model()
    named = list(model.named_parameters())[:-1]
    with pytest.raises(ValueError, match=r"parameter #3 of param_groups\[0\] \(shape \(1,\)\) is not in it"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)


def test_named_parameters_must_be_pairs():
    model = _model()
    with pytest.raises(ValueError, match=r"\(name, parameter\) tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=list(model.parameters()))


def test_step_with_gradients_never_synchronised_is_an_error(backend):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   backend=backend)
    _backward(model)
    with pytest.raises(RuntimeError, match=r"never synchronised \(e\.g\. '0\.weight'\)"):
        with opt.skip_synchronize():
            opt.step()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()  # the supported pattern


def test_too_many_backward_passes_is_an_error():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    _backward(model)
    _backward(model)
    with pytest.raises(RuntimeError, match="computed 3 times before step"):
        _backward(model)


def test_bad_arguments():
    model = _model()
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        hvd.DistributedOptimizer(sgd(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="only supported with op=Average"):
        hvd.DistributedOptimizer(sgd(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        hvd.DistributedOptimizer(sgd(), compression="zip")
    with pytest.raises(ValueError, match="unknown dense backend 'nccl'"):
        hvd.DistributedOptimizer(sgd(), backend="nccl")
    with pytest.raises(ValueError, match="already a hybridsync DistributedOptimizer"):
        hvd.DistributedOptimizer(hvd.DistributedOptimizer(sgd()))


def test_framework_is_detected_from_the_optimizer():
    model = _model()
    opt = hybridsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert isinstance(opt, torch.optim.SGD)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer or a Keras optimizer.*got builtins.object"):
        hybridsync.DistributedOptimizer(object())


def test_backend_forced_by_environment(monkeypatch):
    from hybridsync import settings

    settings.settings.cache_clear()
    monkeypatch.setenv("HYBRIDSYNC_BACKEND", "mpi")
    try:
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        assert opt.plan.backend == "mpi"
        monkeypatch.setenv("HYBRIDSYNC_BACKEND", "gloo")
        settings.settings.cache_clear()
        with pytest.raises(ValueError, match="HYBRIDSYNC_BACKEND='gloo'"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    finally:
        settings.settings.cache_clear()


def test_zero_grad_clears_gradients():
    # (zero_grad while an exchange is in flight is tested at -np 2 in tests/parallel/test_torch_api.py)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    _backward(model)
    opt.synchronize()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
