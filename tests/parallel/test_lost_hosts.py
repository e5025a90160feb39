"""A host lost mid-run under plain mpirun and horovodrun (hybridsync-run's own: test_cluster.py).

Two namespace hosts x 2 ranks train until the link of the second host goes down. The job must
end, non-zero, within the peer timeout + 15 s, and leave nothing running on the host still up:
- mpirun given the keepalive flags hybridsync's docs name (lost_hosts.mpirun_flags) ends it itself;
- horovodrun with the OMPI_MCA_* exports does the same (it hands them to its mpirun);
- plain mpirun without them would wait ~15 minutes on the lost daemon: the ranks say what to pass
  it, and where mpirun runs on a host with ranks (as usual), their backstop ends it.
The first two turn the backstop off (HYBRIDSYNC_LOST_HOST_BACKSTOP=0): the flags alone must end
the job. Each test fails if mpirun's wait is left as it was (measured: 945 s).

Only where namespaces cannot be made (not root, no `ip`) do these tests skip, and say why."""
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from hybridsync import lost_hosts
from tests.parallel.harness import ROOT, rank_main

PREFIX, SUBNET = "hlost", "10.231.14"
PER_HOST = 2
PEER_TIMEOUT_S = 10
BOUND_S = PEER_TIMEOUT_S + 15  # the goal: the job ends this long after its host was lost
SCENARIO = [sys.executable, "-u", __file__, "rank_pull_until_the_link_drops"]


def rank_pull_until_the_link_drops():
    """Parameter-server pulls (every rank takes part) until a host is lost: no torch to import,
    so 4 ranks start in seconds; training under hybridsync-run: test_cluster.py."""
    import numpy as np

    import hybridsync
    from hybridsync import ps

    engine = ps.engine()
    table = engine.add_table("t", 1000, 8, 0, "cyclic", "sgd", {"lr": 0.1})
    step = 0
    while True:  # the peer timeout ends it
        engine.pull([table], [np.arange(64)])
        step += 1
        if step == 5 and hybridsync.rank() == 0:
            print("CLUSTER-TRAINING", flush=True)
        time.sleep(0.01)


def rank_horovod_steps_until_the_link_drops():
    """Dense steps through Horovod's own collectives, where no error can be raised: the
    heartbeat's C++ watchdog aborts the job, and the lost-host watch arms the backstop."""
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init(backend="horovod")
    model = torch.nn.Linear(16, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    step = 0
    while True:  # the watchdog ends it
        opt.zero_grad()
        model(torch.ones(4, 16)).sum().backward()
        opt.step()
        step += 1
        if step == 5 and hybridsync.rank() == 0:
            print("CLUSTER-TRAINING", flush=True)
        time.sleep(0.01)


@pytest.fixture(scope="module")
def cluster():
    from launch.cluster import Cluster

    why = Cluster.unavailable()
    if why:
        pytest.skip(f"no namespace cluster on this machine: {why}")
    with Cluster(2, prefix=PREFIX, subnet=SUBNET) as made:
        yield made


@pytest.fixture
def hosts(cluster):
    yield cluster
    for host in cluster.names:  # a lost host's daemon and ranks may still wait on their dead link
        cluster.kill_processes(host)


def _env(cluster, **extra):
    return cluster.env({**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
                        **extra})


def _mpirun(cluster) -> list[str]:
    return ["mpirun", "-np", str(2 * PER_HOST), "-H", cluster.hosts_arg(PER_HOST), "--bind-to", "none",
            "--allow-run-as-root", "-x", "HYBRIDSYNC_PEER_TIMEOUT_S", "-x", "HYBRIDSYNC_LOST_HOST_BACKSTOP", "-x",
            "PYTHONPATH"]


def _lose_the_second_host(cluster, cmd, env):
    lost, live = cluster.names[1], cluster.names[0]
    run = cluster.lose_host_during(cmd, lost, "CLUSTER-TRAINING", BOUND_S, env=env, cwd=str(ROOT))
    assert run.dropped, "training never started:\n" + run.output
    assert run.seconds is not None, f"the job still ran {BOUND_S} s after its host was lost:\n{run.output}"
    assert run.returncode != 0, run.output
    # Nothing left behind on the host still up (its daemon and ranks are gone).
    for _ in range(50):
        if not cluster.pids(live):
            break
        time.sleep(0.1)
    assert not cluster.pids(live), f"left running on {live}: {cluster.pids(live)}\n{run.output}"
    print(f"{Path(cmd[0]).name}: the job ended {run.seconds:.1f} s after {lost} was lost (exit {run.returncode})")
    return run


def _names_the_lost_host(run, host):
    # The ranks name it (hybridsync's peer timeout), or mpirun does (it noticed its daemon first).
    assert f"on host {host} has not been heard from" in run.output or f"on node {host}" in run.output, run.output


def test_mpirun_with_the_keepalive_flags_ends_the_job_when_a_host_is_lost(hosts):
    cmd = _mpirun(hosts) + shlex.split(lost_hosts.mpirun_flags(PEER_TIMEOUT_S)) + SCENARIO
    run = _lose_the_second_host(hosts, cmd, _env(hosts, HYBRIDSYNC_LOST_HOST_BACKSTOP="0"))
    _names_the_lost_host(run, hosts.names[1])


def test_horovodrun_with_the_keepalive_exports_ends_the_job_when_a_host_is_lost(hosts):
    exported = dict(item.split("=") for item in lost_hosts.exports(PEER_TIMEOUT_S).split()[1:])
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    cmd = [horovodrun, "-np", str(2 * PER_HOST), "-H", hosts.hosts_arg(PER_HOST)] + SCENARIO
    run = _lose_the_second_host(hosts, cmd, _env(hosts, HYBRIDSYNC_LOST_HOST_BACKSTOP="0", **exported))
    _names_the_lost_host(run, hosts.names[1])


# The ranks abort from Python (a PS wait raises) or from the heartbeat's C++ watchdog (blocked in
# Horovod, at the peer timeout plus 5 s): either way they advise and arm the backstop.
@pytest.mark.parametrize("scenario", ["rank_pull_until_the_link_drops", "rank_horovod_steps_until_the_link_drops"])
def test_plain_mpirun_is_told_what_to_pass_and_the_ranks_backstop_ends_it(hosts, scenario):
    # mpirun started on the first host, as users do: the ranks there are its children, and their
    # backstop can end it. (Started outside the hosts, a login node, only the flags help.)
    lost = hosts.names[1]
    cmd = hosts.command_on(hosts.names[0], _mpirun(hosts) + SCENARIO[:-1] + [scenario])
    run = _lose_the_second_host(hosts, cmd, _env(hosts, HYBRIDSYNC_LOST_HOST_BACKSTOP="1"))
    # Without the flags, mpirun is not the one that notices: the ranks name the host ...
    assert f"on host {lost} has not been heard from" in run.output, run.output
    # ... say exactly what mpirun and horovodrun need next time (one rank of the host up does,
    # whichever aborts first) ...
    assert f"pass mpirun `{lost_hosts.mpirun_flags(PEER_TIMEOUT_S)}`" in run.output, run.output
    assert run.output.count("pass mpirun `") == 1, run.output
    assert f"before horovodrun `{lost_hosts.exports(PEER_TIMEOUT_S)}`" in run.output, run.output
    # ... and their backstop ends the launcher process on their host: mpirun itself, killed
    # (137; without the backstop this mpirun waits out TCP's ~15 minutes).
    assert "launcher process (mpirun, pid" in run.output, run.output
    assert run.returncode == 137, run.output
    if "horovod" in scenario:  # it was the watchdog that aborted, past every Python hook
        assert "is blocked where no error can be raised" in run.output, run.output


if __name__ == "__main__":
    rank_main(globals())
