"""Storage options (docs/storage.md) in one process: the YAML rule key's errors name file:line
and key, a plan keeps a table's storage through JSON, and the NumPy rounding twin rounds to
nearest even (ties included) and stochastically from (seed, id, step) alone."""
import json
import re
import textwrap

import numpy as np
import pytest

from hybridsync import config as config_mod
from hybridsync.config import ConfigError
from hybridsync.ps import storage


def _load(tmp_path, rule):
    path = tmp_path / "hs.yaml"
    path.write_text(textwrap.dedent(f"""
        variables:
          - match: "emb.*"
            sync: ps
            storage: {rule}
        """).lstrip())
    return config_mod.load(str(path))


def test_rule_storage_is_checked_with_file_line_and_key(tmp_path):
    assert _load(tmp_path, "{dtype: bfloat16, rounding: stochastic, seed: 4}").rules[0].storage == {
        "dtype": "bfloat16", "rounding": "stochastic", "seed": 4}
    for rule, key in [("{dtype: fp8}", "variables[0].storage.dtype"),
                      ("{rounding: up}", "variables[0].storage.rounding"),
                      ("{memory_rows: 0, path: /tmp}", "variables[0].storage.memory_rows"),
                      ("{size: 3}", "variables[0].storage.size"),
                      ("{path: /tmp}", "variables[0].storage"),
                      ("float16", "variables[0].storage")]:
        with pytest.raises(ConfigError, match=rf"hs.yaml:4: {re.escape(key)}: "):
            _load(tmp_path, rule)


def test_a_plan_keeps_storage_through_json():
    from hybridsync.planning.plan import Plan, VariablePlan
    from hybridsync.types import GradKind, Placement, Route

    v = VariablePlan("emb.weight", (10, 4), "float32", GradKind.SPARSE, Route.PS, Placement.SHARDED, shards=2,
                     storage={"dtype": "float16"})
    back = Plan.from_json(json.loads(Plan([v]).dumps()))
    assert back.variables[0].storage == {"dtype": "float16"}
    cfg = config_mod.load(json.loads(Plan([v]).dumps()))
    assert cfg.rules[0].storage == {"dtype": "float16"}


def test_nearest_even_rounding_of_ties():
    one = np.float32(1.0)
    # bfloat16 keeps 8 bits of mantissa: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> even (1)
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)], np.float32)
    np.testing.assert_array_equal(storage.round_rows(ties, "bfloat16"), [one, 1 + 2.0 ** -6, -one])
    # float16: 10 bits; and overflow to inf, subnormals kept
    half = np.array([1 + 2.0 ** -11, 65520.0, 65519.0, 2.0 ** -24 * 1.5], np.float32)
    np.testing.assert_array_equal(storage.round_rows(half, "float16"), [1.0, np.inf, 65504.0, 2.0 ** -23])


def test_stochastic_rounding_depends_on_seed_id_step_only():
    rows = np.full((4, 3), 1 + 2.0 ** -9, np.float32)  # a quarter of the way from 1 to the next bfloat16
    ids = np.array([5, 6, 7, 8])
    a = storage.round_rows(rows, "bfloat16", storage.rounding_bits(1, 3, ids, 3))
    b = storage.round_rows(rows[::-1], "bfloat16", storage.rounding_bits(1, 3, ids[::-1], 3))[::-1]
    np.testing.assert_array_equal(a, b)  # the order (so the sharding) changes nothing
    assert set(a.ravel()) <= {1.0, 1 + 2.0 ** -7}
    many = storage.round_rows(np.full((4000, 1), 1 + 2.0 ** -9, np.float32), "bfloat16",
                              storage.rounding_bits(2, 1, np.arange(4000), 1))
    assert abs((many == 1 + 2.0 ** -7).mean() - 0.25) < 0.03  # unbiased: up with probability 1/4
    c = storage.round_rows(rows, "bfloat16", storage.rounding_bits(1, 4, ids, 3))
    assert not np.array_equal(a, c) or not np.array_equal(a, storage.round_rows(rows, "bfloat16",
                                                                                storage.rounding_bits(9, 3, ids, 3)))


def test_the_memory_check_counts_half_rows_and_only_the_cached_rows_of_a_disk_tier():
    """A table larger than memory_per_rank fits once its rows are 16-bit or mostly on disk."""
    from hybridsync.planning import estimate

    whole = estimate.memory_per_rank(estimate.PS, 10**9, 64, 2, slots=1)
    half = estimate.memory_per_rank(estimate.PS, 10**9, 64, 2, slots=1, storage={"dtype": "bfloat16"})
    tiered = estimate.memory_per_rank(estimate.PS, 10**9, 64, 2, slots=1,
                                      storage={"dtype": "float16", "memory_rows": 10**6, "path": "/x"})
    assert whole == 10**9 / 2 * (4 + 4) * 64 and half == 10**9 / 2 * (2 + 4) * 64
    assert tiered == 10**6 / 2 * (2 + 4) * 64


def test_a_plan_lets_a_disk_tier_table_exceed_memory_per_rank():
    import torch

    import hybridsync.torch as hvd
    from hybridsync.torch.variables import plan_for

    class Net(torch.nn.Module):
        def __init__(self, storage):
            super().__init__()
            self.emb = hvd.Embedding(10**6, 64, name="emb", storage=storage)
            self.out = torch.nn.Linear(64, 1)

    budget = {"memory_per_rank": "64MiB"}  # the table: 256 MiB of rows, 256 MiB of Adagrad state
    for storage, fits in ((None, False), ({"memory_rows": 1000, "path": "/tmp/hs-plan-test"}, True)):
        model = Net(storage)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
        cfg = config_mod.load({**budget, "variables": [{"match": "emb.*", "sync": "ps"}]})
        try:
            plan, _ = plan_for(opt, list(model.named_parameters()), model, cfg, "none", "mpi", 1)
        except ConfigError as exc:
            assert not fits and "memory_per_rank" in str(exc), str(exc)
        else:
            assert fits and plan.by_name()["emb.weight"].memory_bytes < 2**20, plan.by_name()["emb.weight"]
        model.emb.table.drop()


def test_defaults_sparse_storage_applies_to_every_table_sharded_on_the_ps(tmp_path):
    """`storage:` under defaults.sparse, as the other per-table keys: every sparse table sharded
    on the PS -- a wrapped nn.Embedding and a PS module, whose table moves -- stores its rows so,
    a rule's storage wins, and `sync: auto` keeps such tables on the PS (only it stores them so)."""
    import torch

    import hybridsync.torch as hvd

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wrapped = torch.nn.Embedding(20, 4, sparse=True)
            self.module = hvd.Embedding(20, 4, name="module", seed=1)
            self.ruled = hvd.Embedding(20, 4, name="ruled", seed=2)
            self.out = torch.nn.Linear(12, 1)

    path = tmp_path / "hs.yaml"
    path.write_text(textwrap.dedent("""
        defaults:
          sparse: {storage: {dtype: bfloat16}}
        variables:
          - match: "ruled.*"
            storage: {dtype: float16}
        """).lstrip())
    net = Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(net.parameters(), lr=0.1), model=net, config=str(path))
    plan = opt.plan.by_name()
    assert plan["wrapped.weight"].storage == {"dtype": "bfloat16"}, plan["wrapped.weight"]
    assert plan["module.weight"].storage == {"dtype": "bfloat16"} and plan["ruled.weight"].storage == {"dtype": "float16"}
    assert plan["out.weight"].storage is None
    for table, dtype in ((net.module.table, "bfloat16"), (net.ruled.table, "float16")):
        assert table.engine.spec(table.handle)["storage"]["dtype"] == dtype, table.name
    cfg = config_mod.load(str(path))
    assert cfg.storage_for("wrapped.weight") == ({"dtype": "bfloat16"}, f"defaults.sparse ({path}:2)")


def test_a_table_with_storage_is_not_measured_by_sync_auto():
    """Only the PS stores 16-bit rows or a disk tier: `sync: auto` must not move such a table to a
    replica (its storage would be gone), so the plan keeps it on the PS without measuring."""
    import torch

    from hybridsync.torch.variables import plan_for

    net = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for storage, measured in ((None, True), ({"dtype": "bfloat16"}, False)):
        rule = {"match": "0.weight", "sync": "auto", **({"storage": storage} if storage else {})}
        plan, _ = plan_for(opt, list(net.named_parameters()), net, config_mod.load({"variables": [rule]}),
                           "none", "mpi", 2)  # (planned for 2 ranks: auto has something to choose)
        v = plan.by_name()["0.weight"]
        assert bool(v.auto) == measured and v.storage == storage, (v.auto, v.reason)
        if not measured:
            assert "auto: its storage exists only on the PS" in v.reason, v.reason
