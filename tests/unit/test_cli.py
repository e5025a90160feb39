"""`python -m hybridsync explain` and `hybridsync-run`, as a user runs them."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = """
import torch

def make():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(100, 8, sparse=True),
        "mlp": torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1)),
    })
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05)
"""


def _run(args, cwd, env=None):
    full_env = dict(os.environ, PYTHONPATH=str(ROOT))
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "hybridsync", *args], cwd=cwd, capture_output=True, text=True,
                          env=full_env, timeout=120)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "mymodel.py").write_text(MODEL)
    (tmp_path / "hs.yaml").write_text(textwrap.dedent("""
        variables:
          - match: emb.weight
            sync: ps
            partitions: 2
          - match: mlp.0.*
            compression: fp16
    """))
    return tmp_path


def test_explain_prints_the_plan_and_writes_json_that_loads_back(project):
    out = _run(["explain", "hs.yaml", "--model", "mymodel:make", "--world-size", "4", "--json", "plan.json"], project)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[3:] if line.strip() and not line.startswith("wrote")}
    assert "4 ranks" in out.stdout.splitlines()[0]
    assert " ps " in rows["emb.weight"] and " 2 " in rows["emb.weight"] and "adagrad(lr=0.05" in rows["emb.weight"]
    assert "rule 'emb.weight'" in rows["emb.weight"] and "fp16" in rows["mlp.0.weight"]
    plan = json.loads((project / "plan.json").read_text())
    assert {v["name"] for v in plan["variables"]} == {"emb.weight", "mlp.0.weight", "mlp.0.bias", "mlp.1.weight", "mlp.1.bias"}
    again = _run(["explain", "plan.json", "--model", "mymodel:make", "--world-size", "4"], project)
    assert again.returncode == 0, again.stderr
    routes = lambda text: [line.split()[:6] for line in text.splitlines()[3:] if line.strip() and not line.startswith("wrote")]
    assert routes(again.stdout) == routes(out.stdout)


def test_explain_reports_config_errors_with_file_and_line(project):
    (project / "bad.yaml").write_text("variables:\n  - match: emb.weight\n    sink: ps\n")
    out = _run(["explain", "bad.yaml", "--model", "mymodel:make"], project)
    assert out.returncode == 2
    assert "bad.yaml:3: variables[0].sink: unknown key" in out.stderr


def _launcher():
    return str(Path(sys.executable).with_name("hybridsync-run"))


def test_launcher_adds_the_flags_a_run_needs(project):
    cmd = [_launcher(), "--dry-run", "-np", "64", "--config", "hs.yaml", "python", "train.py", "--epochs", "3"]
    out = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("mpirun -np 64 --bind-to none") and line.endswith("python train.py --epochs 3")
    assert "--oversubscribe" in line and "-x HYBRIDSYNC_CONFIG" in line and "-x HYBRIDSYNC_EXPLAIN" in line
    assert ("--allow-run-as-root" in line) == (os.geteuid() == 0)
    hosts = subprocess.run([_launcher(), "--dry-run", "-np", "4", "-H", "a:2,b:2", "python", "t.py"], cwd=project,
                           capture_output=True, text=True, timeout=60)
    assert "-H a:2,b:2" in hosts.stdout and "--oversubscribe" not in hosts.stdout
    assert "--mca oob_tcp_keepalive_time" not in line  # one host: no remote daemons to watch
    # Across hosts: every HYBRIDSYNC_* setting is forwarded, and mpirun watches its remote daemons
    # (keepalives that notice a lost daemon within 0.8 x the peer timeout: 2 + 2 x 7 = 16 s of 20).
    timed = subprocess.run([_launcher(), "--dry-run", "-np", "4", "--hostfile", "hosts", "python", "t.py"],
                           cwd=project, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, HYBRIDSYNC_PEER_TIMEOUT_S="20", HYBRIDSYNC_FUSION_MB="8"))
    assert "-x HYBRIDSYNC_PEER_TIMEOUT_S" in timed.stdout and "-x HYBRIDSYNC_FUSION_MB" in timed.stdout
    assert ("--mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 7"
            in timed.stdout), timed.stdout
    horovod = subprocess.run([_launcher(), "--dry-run", "--launcher", "horovodrun", "-np", "2", "python", "t.py"],
                             cwd=project, capture_output=True, text=True, timeout=60)
    assert "horovodrun -np 2 -H localhost:2 python t.py" in horovod.stdout


def test_launcher_checks_the_config_before_launching(project):
    (project / "bad.yaml").write_text("strict: sometimes\n")
    out = subprocess.run([_launcher(), "-np", "2", "--config", "bad.yaml", "python", "-c", "print('ran')"], cwd=project,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bad.yaml:1: strict: expected true or false" in out.stderr
    assert "ran" not in out.stdout


def test_launcher_runs_the_job_and_rank_0_prints_the_plan_once(project):
    cmd = [_launcher(), "-np", "2", "--config", "hs.yaml", sys.executable, str(ROOT / "examples" / "torch_dlrm.py"),
           "--rows", "2000", "--steps", "10", "--log-every", "10", "--tables", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    (project / "hs.yaml").write_text("variables:\n  - match: embeddings.0.weight\n    sync: ps\n    partitions: 1\n")
    out = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    plans = [line for line in out.stdout.splitlines() if "hybridsync plan (torch, 2 ranks" in line]
    assert len(plans) == 2  # the launcher's plan (at wrap) and the example's explain() after step 1, both rank 0
    row = next(line for line in out.stdout.splitlines() if "embeddings.0.weight" in line)
    assert "rule 'embeddings.0.weight'" in row and " 1 " in row


DYNAMIC_MODEL = """
import torch

import hybridsync.torch as hvd


def make():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(100, 8, sparse=True),
        "user": hvd.DynamicEmbedding(8, name="user", seed=3),
        "stale": torch.nn.Embedding(50, 8, sparse=True),
        "mlp": torch.nn.Linear(8, 1),
    })
    return model, torch.optim.SGD(model.parameters(), lr=0.05)
"""


def test_the_plan_of_a_dynamic_table_round_trips_and_plans_the_world_size_asked_for(tmp_path):
    """explain --world-size 2 plans the dynamic table on 2 shards (its table was made in a world
    of one), chooses the backend as 2 ranks on this host would, prints the staleness bound (no
    lag: nothing ran); its JSON loads back as a config with the dynamic options, and gives the
    same plan. (Under real ranks: tests/parallel/test_plan_round_trip.py.)"""
    (tmp_path / "dynmodel.py").write_text(DYNAMIC_MODEL)
    (tmp_path / "cfg.yaml").write_text(textwrap.dedent("""
        variables:
          - match: user.*
            dynamic: {capacity: 1000, evict: lru, ttl_steps: 50, admit_after: 2}
          - match: stale.*
            staleness: 2
    """))
    out = _run(["explain", "cfg.yaml", "--model", "dynmodel:make", "--world-size", "2", "--json", "plan.json"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "one rank: no all-reduce" not in out.stdout and "no pull yet" not in out.stdout, out.stdout
    assert "stale.weight: staleness 2" in out.stdout, out.stdout
    assert "user.weight: capacity 1000, admit after 2 touches, evict lru, ttl 50 steps" in out.stdout, out.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    user = next(v for v in plan["variables"] if v["name"] == "user.weight")
    assert user["shards"] == 2 and user["dynamic"] == {"capacity": 1000, "evict": "lru", "ttl_steps": 50,
                                                       "admit_after": 2}, user
    again = _run(["explain", "plan.json", "--model", "dynmodel:make", "--world-size", "2", "--json", "again.json"],
                 tmp_path)
    assert again.returncode == 0, again.stderr
    same = lambda p: [{k: x for k, x in v.items() if k != "reason"} for v in p["variables"]]  # noqa: E731
    assert same(json.loads((tmp_path / "again.json").read_text())) == same(plan)
