"""The YAML config: every validation error names file, line and key; rules apply first-match;
every route a config can ask for is planned; a plan written as JSON loads back as a config."""
import json
import textwrap

import pytest
import torch

import hybridsync
import hybridsync.torch as hvd
from hybridsync import config as config_mod
from hybridsync.config import ConfigError

from hybridsync.planning import render

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 4, sparse=True)
        self.bag = torch.nn.EmbeddingBag(30, 4, mode="sum", sparse=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))


def write(tmp_path, text, name="hs.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return str(path)


def plan_rows(tmp_path, text, world=None, model=True, optimizer=torch.optim.Adagrad):
    net = Net()
    opt = optimizer(net.parameters(), lr=0.1)
    kwargs = {"model": net} if model else {"named_parameters": net.named_parameters()}
    dist = hvd.DistributedOptimizer(opt, config=write(tmp_path, text), **kwargs)
    return {v.name: v for v in dist.plan.variables}, dist


# -- validation: each error names file, line and key -------------------------------------------------

@pytest.mark.parametrize("text, line, key, problem", [
    ("defaults:\n  dense: {sync: allreduce}\n  weird: 1\n", 3, "defaults.weird", "unknown key"),
    ("variables:\n  - match: emb*\n    sink: ps\n", 3, "variables[0].sink", "unknown key"),
    ("variables:\n  - match: emb*\n    sync: carrier-pigeon\n", 3, "variables[0].sync", "'carrier-pigeon' is not one of"),
    ("variables:\n  - match: emb*\n    partitions: two\n", 3, "variables[0].partitions", "expected an integer"),
    ("variables:\n  - match: emb*\n    partitions: 0\n", 3, "variables[0].partitions", "must be >= 1"),
    ("variables:\n  - match: emb*\n    optimizer: {name: rmsprop}\n", 3, "variables[0].optimizer.name",
     "'rmsprop' is not one of sgd, adagrad, adam"),
    ("variables:\n  - match: emb*\n    optimizer: {name: adagrad, momentum: 0.9}\n", 3, "variables[0].optimizer",
     "unknown hyper-parameter 'momentum'"),
    ("variables:\n  - match: emb*\n    optimizer: {name: sgd, lr: fast}\n", 3, "variables[0].optimizer.lr", "expected a number"),
    ("strict: maybe\n", 1, "strict", "expected true or false"),
    ("backend: nccl\n", 1, "backend", "'nccl' is not one of horovod, mpi"),
    ("variables:\n  - sync: ps\n", 2, "variables[0]", "needs 'match'"),
    ("variables: emb\n", 1, "variables", "expected a list"),
    ("defaults:\n  sparse: {placement: everywhere}\n", 2, "defaults.sparse.placement", "is not one of sharded, replicated"),
    ("variables:\n  - match: emb*\n    staleness: -1\n", 3, "variables[0].staleness", "expected an integer >= 0"),
    ("variables:\n  - match: emb*\n    staleness: soon\n", 3, "variables[0].staleness", "expected an integer >= 0"),
    ("defaults:\n  dense: {staleness: 2}\n", 2, "defaults.dense.staleness", "dense variables stay synchronous"),
    ("defaults:\n  dense: {storage: {dtype: float16}}\n", 2, "defaults.dense.storage",
     "storage applies to sparse tables"),
    ("defaults:\n  sparse:\n    storage: {dtype: fp8}\n", 3, "defaults.sparse.storage.dtype", "must be one of"),
    ("defaults:\n  sparse:\n    storage: {path: /tmp}\n", 3, "defaults.sparse.storage", "needs storage.memory_rows"),
])
def test_each_validation_error_names_file_line_and_key(tmp_path, text, line, key, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        config_mod.load(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: {key}: "), message
    assert problem in message, message


def test_invalid_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "variables:\n  - match: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: not valid YAML"):
        config_mod.load(path)


def test_partitions_above_world_size_is_an_error_at_the_rule(tmp_path):
    with pytest.raises(ConfigError, match=r"rule 'emb\*' \(.*hs.yaml:2\): partitions: variable 'emb.weight': 2 is more "
                                          r"than the world size \(1\)"):
        plan_rows(tmp_path, "variables:\n  - match: emb*\n    sync: ps\n    partitions: 2\n")


def test_strict_rule_matching_nothing_is_an_error_naming_the_closest_variables(tmp_path):
    with pytest.raises(ConfigError, match=r"hs.yaml:3: match: rule 'emd\.\*' matches no variable; closest: emb.weight "
                                          r"\(strict: true\)"):
        plan_rows(tmp_path, "strict: true\nvariables:\n  - match: emd.*\n    sync: ps\n")
    with pytest.raises(ConfigError, match=r"hs.yaml:3: match: rule 'typo\.\*' matches no variable; variables are: "
                                          r"emb.weight, bag.weight, mlp.0.weight, mlp.0.bias, mlp.2.weight, mlp.2.bias "
                                          r"\(strict: true\)"):
        plan_rows(tmp_path, "strict: true\nvariables:\n  - match: typo.*\n    sync: ps\n")
    # A rule whose every variable an earlier rule takes first does nothing either: said so.
    with pytest.raises(ConfigError, match=r"hs.yaml:5: match: rule 'mlp.0.weight' takes no variable: an earlier rule "
                                          r"comes first for each it matches \('mlp.\*' \(.*hs.yaml:3\) takes "
                                          r"mlp.0.weight\) \(strict: true\)"):
        plan_rows(tmp_path, "strict: true\nvariables:\n  - match: mlp.*\n    compression: fp16\n"
                            "  - match: mlp.0.weight\n    compression: none\n")


def test_a_rule_matching_nothing_warns_once_by_default_naming_file_line_and_the_closest_names(tmp_path):
    import warnings

    text = "variables:\n  - match: mpl.*\n    compression: fp16\n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, _ = plan_rows(tmp_path, text)
        plan_rows(tmp_path, text)  # the same rule again (another optimizer): no second warning
    mine = [w for w in caught if issubclass(w.category, hybridsync.ConfigWarning)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert str(mine[0].message) == (f"{tmp_path / 'hs.yaml'}:2: match: rule 'mpl.*' matches no variable; closest: "
                                    "mlp.0.weight, mlp.0.bias, mlp.2.weight (strict: true makes this an error)")
    assert rows["mlp.0.weight"].compression == "none"  # the plan is made, without the rule


@pytest.mark.parametrize("text, key, problem", [
    ("variables:\n  - match: mlp.0.weight\n    sync: allgather\n", "sync", "applies to sparse variables"),
    ("variables:\n  - match: mlp.0.weight\n    sync: ps\n    placement: sharded\n", "placement", "use placement: replicated"),
    ("variables:\n  - match: emb.weight\n    compression: fp16\n", "compression", "not to the parameter server"),
    ("variables:\n  - match: mlp.*\n    optimizer: sgd\n", "optimizer", "applies to variables on the parameter server"),
    ("variables:\n  - match: mlp.0.weight\n    staleness: 2\n", "staleness", "dense variables and other routes stay"),
    ("variables:\n  - match: emb.weight\n    sync: allgather\n    staleness: 2\n", "staleness", "other routes stay"),
    ("variables:\n  - match: emb.weight\n    placement: replicated\n    staleness: 2\n", "staleness",
     r"it needs a sharded table \(give DistributedOptimizer\(\.\.\., model=model\)"),
])
def test_impossible_combinations_name_rule_and_key(tmp_path, text, key, problem):
    with pytest.raises(ConfigError, match=rf"rule '.*' \(.*hs.yaml:2\): {key}: variable '.*': .*{problem}"):
        plan_rows(tmp_path, text)


def test_allgather_needs_an_optimizer_that_applies_sparse_gradients(tmp_path):
    with pytest.raises(ConfigError, match="Adam cannot"):
        plan_rows(tmp_path, "variables:\n  - match: emb*\n    sync: allgather\n", optimizer=torch.optim.Adam)


def test_sharded_needs_the_model(tmp_path):
    net = Net()
    with pytest.raises(ConfigError, match=r"'sharded' needs the model \(DistributedOptimizer"):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                       config=write(tmp_path, "defaults:\n  sparse: {placement: sharded}\n"))
        net.emb(torch.tensor([1])).sum().backward()  # sparse kinds are seen at the first backward without a model
        del opt


# -- precedence and routes ----------------------------------------------------------------------------

def test_first_matching_rule_wins_over_later_rules_and_defaults(tmp_path):
    rows, _ = plan_rows(tmp_path, """
        defaults:
          sparse: {sync: ps, placement: replicated}
          dense: {compression: fp16}
        variables:
          - match: "emb.*"
            sync: ps
            placement: sharded
            partitions: 1
            optimizer: {name: adam, lr: 0.02}
          - match: "emb.*"
            sync: allgather
          - match: "*"
            compression: none
    """)
    emb, bag, mlp = rows["emb.weight"], rows["bag.weight"], rows["mlp.0.weight"]
    assert (emb.route.value, emb.placement.value, emb.shards, emb.optimizer) == ("ps", "sharded", 1, {"name": "adam", "lr": 0.02})
    assert emb.optimizer_source == "config" and "hs.yaml:5" in emb.reason
    # bag.weight matches only the catch-all rule, which sets nothing a PS route would change:
    # its route and placement come from defaults.sparse.
    assert (bag.route.value, bag.placement.value) == ("ps", "replicated")
    assert mlp.compression == "none" and "hs.yaml:12" in mlp.reason


def test_every_route_is_planned(tmp_path):
    rows, _ = plan_rows(tmp_path, """
        variables:
          - match: emb.weight
            sync: allreduce
          - match: bag.weight
            sync: allgather
          - match: mlp.0.weight
            sync: ps
          - match: mlp.2.*
            compression: fp16
    """, optimizer=torch.optim.SGD)
    assert rows["emb.weight"].route.value == "allreduce-as-dense"
    assert rows["bag.weight"].route.value == "allgather"
    assert (rows["mlp.0.weight"].route.value, rows["mlp.0.weight"].placement.value) == ("ps", "replicated")
    assert rows["mlp.0.weight"].optimizer == {"name": "sgd", "lr": 0.1}
    assert rows["mlp.2.weight"].compression == "fp16" and rows["mlp.2.bias"].compression == "fp16"
    assert rows["mlp.0.bias"].route.value == "allreduce"


def test_dict_config_and_init_config(tmp_path):
    net = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net,
                                   config={"variables": [{"match": "bag.*", "sync": "allreduce"}]})
    assert {v.name: v.route.value for v in opt.plan.variables}["bag.weight"] == "allreduce-as-dense"
    with pytest.raises(ConfigError, match=r"<dict>: variables\[0\]\.sink: unknown key"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), config={"variables": [{"match": "x", "sink": 1}]})


def test_environment_variable_names_the_config(tmp_path, monkeypatch):
    from hybridsync import settings

    monkeypatch.setenv("HYBRIDSYNC_CONFIG", write(tmp_path, "variables:\n  - match: emb.weight\n    sync: allreduce\n"))
    settings.settings.cache_clear()
    try:
        net = Net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net)
        assert {v.name: v.route.value for v in opt.plan.variables}["emb.weight"] == "allreduce-as-dense"
    finally:
        settings.settings.cache_clear()


def test_plan_json_loads_back_as_a_config(tmp_path):
    rows, dist = plan_rows(tmp_path, """
        variables:
          - match: emb.weight
            sync: ps
            partitions: 1
            partition: block
            optimizer: {name: sgd, lr: 0.3}
          - match: bag.weight
            sync: allreduce
          - match: mlp.0.weight
            compression: fp16
    """, optimizer=torch.optim.SGD)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(dist.plan.dumps())
    net = Net()
    again = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, config=str(plan_file))
    for v in again.plan.variables:
        before = rows[v.name]
        assert (v.route, v.placement, v.shards, v.partition, v.compression, v.optimizer) == \
               (before.route, before.placement, before.shards, before.partition, before.compression, before.optimizer), v.name
    # A plan is strict: a variable missing from the model is an error.
    data = json.loads(plan_file.read_text())
    data["variables"].append(dict(data["variables"][0], name="gone.weight"))
    plan_file.write_text(json.dumps(data))
    net = Net()
    with pytest.raises(ConfigError, match="rule 'gone.weight' matches no variable"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, config=str(plan_file))


def test_staleness_puts_a_table_on_the_ps_and_travels_with_the_plan(tmp_path):
    rows, dist = plan_rows(tmp_path, "variables:\n  - match: emb.weight\n    staleness: 3\n", optimizer=torch.optim.SGD)
    assert rows["emb.weight"].route.value == "ps" and rows["emb.weight"].staleness == 3
    assert rows["bag.weight"].staleness == 0 and rows["mlp.0.weight"].staleness == 0
    assert "emb.weight: staleness 3; no pull yet" in render(dist.plan)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(dist.plan.dumps())
    net = Net()
    again = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, config=str(plan_file))
    assert {v.name: v.staleness for v in again.plan.variables}["emb.weight"] == 3


def test_init_validates_the_config_before_anything_else(tmp_path):
    with pytest.raises(ConfigError, match="hs.yaml:1: backend"):
        hybridsync.init(config=write(tmp_path, "backend: nccl\n"))
