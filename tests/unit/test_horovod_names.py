"""hybridsync.torch is a drop-in for horovod.torch: the same public names, callables taking
Horovod's arguments in Horovod's order; and the negotiation that makes mismatched collectives
errors (pure functions, checked here without MPI)."""
import inspect

import pytest

from hybridsync.comm.negotiation import DUPLICATE, Desc, analyze, digest

# Horovod's build internals, not an API: the compiled extension and the helper that checks it.
NOT_API = {"mpi_lib_v2", "check_extension"}


def _public(module):
    return {n for n in dir(module) if not n.startswith("_")}


def test_every_public_name_of_horovod_torch_is_exported():
    horovod = pytest.importorskip("horovod.torch")
    import hybridsync.torch as hvd

    assert _public(horovod) - _public(hvd) == NOT_API
    assert {"TorchState", "ElasticSampler", "run"} <= _public(hvd.elastic)
    assert {"none", "fp16"} <= _public(hvd.Compression)


def _positional(fn):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None  # Horovod's init(*args, **kwargs)
    return [(p.name, p.default) for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_callables_take_horovods_arguments_in_horovods_order():
    horovod = pytest.importorskip("horovod.torch")
    import hybridsync.torch as hvd

    checked = 0
    for name in sorted(_public(horovod) - NOT_API):
        theirs, ours = getattr(horovod, name), getattr(hvd, name)
        if inspect.ismodule(theirs) or not callable(theirs):
            continue
        want, got = _positional(theirs), _positional(ours)
        if want is None:
            continue
        names = [n for n, _ in want]
        assert [n for n, _ in got][:len(names)] == names, f"{name}: Horovod {names}, hybridsync {got}"
        for (n, default), (_, ours_default) in zip(want, got):
            if default is not inspect.Parameter.empty and not callable(default) and n not in ("op", "process_set"):
                assert ours_default == default, f"{name}({n}=...): Horovod {default!r}, hybridsync {ours_default!r}"
        checked += 1
    assert checked >= 50


def test_collectives_at_size_one_keep_horovods_arithmetic():
    import torch

    import hybridsync.torch as hvd
    from hybridsync import runtime

    hvd.init(backend="mpi")
    try:
        _size_one_checks(hvd, torch)
    finally:
        runtime.set_default_backend(None)  # later tests in this process choose their own


def _size_one_checks(hvd, torch):
    x = torch.tensor([1.0, -2.0, 4.0])
    assert hvd.allreduce(x, op=hvd.Product, prescale_factor=2.0, postscale_factor=3.0).tolist() == [6.0, -12.0, 24.0]
    assert hvd.allreduce(torch.tensor([-7, 7]), op=hvd.Sum, prescale_factor=0.5).tolist() == [-3, 3]
    assert hvd.join() == 0 and hvd.alltoall(x).tolist() == x.tolist()
    with pytest.raises(ValueError, match="still in flight"):
        hvd.allreduce_async(x, name="twice"), hvd.allreduce_async(x, name="twice")
    # Adasum of one rank's tensor is the tensor, scaled as Horovod scales it.
    assert hvd.allreduce(x, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5).tolist() == x.tolist()
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        hvd.allreduce(torch.tensor([1, 2]), op=hvd.Adasum)


# -- negotiation ---------------------------------------------------------------------------
def _d(kind="allreduce", name="t", shape=(3,), dtype="float32", **kw):
    return Desc(kind, name, dtype, shape, **kw)


def test_same_submissions_everywhere_run_and_share_a_fingerprint():
    lists = [[_d(name="a"), _d("allgather", "b", (r + 1, 2))] for r in range(3)]
    assert len({digest(x) for x in lists}) == 1  # dim 0 of a gather may differ
    verdict = analyze(lists, [False] * 3, ["a"] * 3)
    assert verdict.runnable == ["a", "b"] and not verdict.failed


@pytest.mark.parametrize("odd, field", [
    (_d(shape=(4,)), "shape"), (_d(dtype="float64"), "dtype"), (_d(op="sum"), "reduction op"),
    (_d(scales=(2.0, 1.0)), "(prescale, postscale)"), (_d("broadcast", root=1), "kind")])
def test_a_differing_descriptor_names_the_collective_the_field_and_the_ranks(odd, field):
    lists = [[_d()], [_d()], [odd]]
    verdict = analyze(lists, [False] * 3, ["t"] * 3)
    message = verdict.failed["t"]
    assert message.startswith("allreduce 't'") and field in message and "rank 2" in message and "[0, 1]" in message


def test_gathers_check_every_dimension_but_the_first():
    verdict = analyze([[_d("allgather", shape=(2, 3))], [_d("allgather", shape=(2, 4))]], [False] * 2, ["t"] * 2)
    assert "shape beyond dim 0" in verdict.failed["t"]


def test_different_names_with_every_rank_blocked_is_a_deadlock_error_not_a_hang():
    verdict = analyze([[_d(name="a")], [_d(name="b")]], [False, False], ["allreduce 'a'", "allreduce 'b'"])
    assert set(verdict.failed) == {"a", "b"}
    assert "submitted by rank 0 but not by rank 1" in verdict.failed["a"]
    # A rank that only polls may still submit the other name: wait instead.
    assert not analyze([[_d(name="a")], [_d(name="b")]], [False, False], [None, "b"]).failed


def test_a_rank_waiting_for_an_op_it_has_not_offered_yet_is_not_blocked():
    # Rank 0 started 'a' async, then waits for 'b', which its round (posted before) lacks: the
    # next round offers 'b', as Horovod would run it. Not a deadlock.
    waits = ["allreduce 'b'", "allreduce 'b'"]
    assert not analyze([[_d(name="a")], [_d(name="b")]], [False, False], waits).failed
    assert not analyze([[_d(name="a")], [_d(name="b")], [_d(name="b")]], [False] * 3, waits + waits[:1]).failed
    # Blocked on its own entry while another rank waits on its own: nothing can ever run.
    verdict = analyze([[_d(name="a"), _d(name="c")], [_d(name="b")]], [False, False], ["allreduce 'c'", waits[1]])
    assert set(verdict.failed) == {"a", "b", "c"} and "rank 0 waits for allreduce 'c'" in verdict.failed["a"]


def test_a_name_submitted_twice_on_one_rank_fails_everywhere():
    verdict = analyze([[_d()], [_d(), Desc(DUPLICATE, "t", "allreduce")]], [False] * 2, ["t"] * 2)
    assert "submitted again on rank 1" in verdict.failed["t"]


def test_joined_ranks_take_part_in_allreduces_only():
    lists = [[_d(name="a"), _d("allgather", "b", (1, 2))], []]
    verdict = analyze(lists, [False, True], ["a", "join"])
    assert verdict.runnable == ["a"] and "join" in verdict.failed["b"]
    assert analyze([[], []], [True, True], ["join"] * 2).all_joined


# -- the optimizer's Horovod keywords ------------------------------------------------------
def test_horovod_keywords_of_distributed_optimizer():
    import torch

    from hybridsync.torch.optimizer_args import check_groups, check_op, sparse_as_dense_config

    cfg = sparse_as_dense_config({"defaults": {"sparse": {"sync": "ps", "partitions": 1}},
                                  "variables": [{"match": "emb2", "sync": "ps"}]})
    assert cfg.sparse.sync == "allreduce-as-dense" and cfg.sparse.partitions is None and cfg.rules[0].sync == "ps"
    assert "sparse_as_dense=True" in cfg.where["defaults.sparse"]
    assert check_op(0) == "average" and check_op(1) == "sum" and check_op(2) == "adasum"
    with pytest.raises(NotImplementedError, match="Average, Sum or Adasum"):
        check_op(3)  # horovod.torch.Min
    p = torch.nn.Parameter(torch.zeros(1))
    with pytest.warns(DeprecationWarning):
        assert check_groups(2, None, [("p", p)]) == 2
    with pytest.raises(ValueError, match="torch.Tensor"):
        check_groups(0, [[1]], [("p", p)])
