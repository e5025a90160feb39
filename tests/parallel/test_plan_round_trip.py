"""The plan round trip with a dynamic table (issue 35, item 9), under real MPI ranks.

A model with a fixed PS table (sync: auto), a dynamic table whose options come from the YAML, a
table at staleness 2 and dense layers. `python -m hybridsync explain cfg.yaml --world-size N
--json plan.json`, offline, must give the plan the live job makes at -np N (the dynamic table on
N shards, not the one of the offline process; the dense backend that job chooses), and that JSON
must load back as a config -- in the CLI and in the live job -- giving the same plan again, the
dynamic options included. (It was rejected: `partition: 'hash' is not one of cyclic, block`.)
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.parallel.harness import ROOT, rank_main, run_scenarios

MODEL = """
import torch

import hybridsync.torch as hvd


def make():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(100, 8, sparse=True),
        "user": hvd.DynamicEmbedding(8, name="user", seed=3, mode="sum"),
        "stale": torch.nn.Embedding(50, 8, sparse=True),
        "mlp": torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1)),
    })
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05)
"""
CONFIG = """
variables:
  - match: user.*
    dynamic: {capacity: 1000, evict: lru, ttl_steps: 50, admit_after: 2}
  - match: stale.*
    sync: ps
    staleness: 2
  - match: mlp.0.*
    compression: fp16
"""
MEASURED = ("reason", "bytes_per_step", "lag")  # what a plan made offline cannot know, or words


def _comparable(plan: dict) -> dict:
    return {"world_size": plan["world_size"], "backend": plan["backend"],
            "variables": sorted(({k: x for k, x in v.items() if k not in MEASURED} for v in plan["variables"]),
                                key=lambda v: v["name"])}


def rank_live(directory, config, out):
    """The live job's plan (rank 0 writes it)."""
    import io

    import hybridsync
    import hybridsync.torch as hvd

    sys.path.insert(0, directory)
    from mymodel import make

    model, opt = make()
    wrapped = hvd.DistributedOptimizer(opt, model=model, config=os.path.join(directory, config))
    plans = json.loads(hybridsync.explain(as_json=True, file=io.StringIO()))
    # (an earlier sub-case's optimizer in this process may still be listed: this one's is last)
    assert plans[-1] == json.loads(json.dumps(wrapped.plan.to_json())), plans
    if hvd.rank() == 0:
        with open(out, "w") as fh:
            json.dump(plans[-1:], fh)


def _offline(directory, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "hybridsync", "explain", *args, "--model", "mymodel:make"],
                          cwd=directory, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("np_", [2, 3])
def test_the_offline_plan_is_the_live_plan_and_its_json_loads_back(tmp_path, np_):
    (tmp_path / "mymodel.py").write_text(MODEL)
    (tmp_path / "cfg.yaml").write_text(textwrap.dedent(CONFIG))
    text = _offline(tmp_path, "cfg.yaml", "--world-size", str(np_), "--json", "plan.json")
    assert "no pull yet" not in text and "one rank" not in text, text
    offline = json.loads((tmp_path / "plan.json").read_text())
    user = next(v for v in offline["variables"] if v["name"] == "user.weight")
    assert user["shards"] == np_, user
    assert user["dynamic"] == {"capacity": 1000, "evict": "lru", "ttl_steps": 50, "admit_after": 2}, user
    # One launch: the live plan from the YAML, then (in the same job, after that optimizer is gone)
    # from the offline plan's JSON: it loads back as a config, the same plan again (offline: test_cli.py).
    run_scenarios(__file__, np_, ("rank_live", tmp_path, "cfg.yaml", tmp_path / "live.json"),
                  ("rank_live", tmp_path, "plan.json", tmp_path / "live_again.json"), timeout=240)
    live = json.loads((tmp_path / "live.json").read_text())[0]
    assert _comparable(offline) == _comparable(live)
    assert _comparable(json.loads((tmp_path / "live_again.json").read_text())[0]) == _comparable(offline)


if __name__ == "__main__":
    rank_main(globals())
