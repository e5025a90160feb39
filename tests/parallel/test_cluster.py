"""Two hosts x two ranks, each host its own network namespace and hostname (launch/cluster.py),
ranks on different hosts talking TCP over a bridge: local/cross ranks per host under
hybridsync-run (-H and --hostfile), mpirun and horovodrun; every route's parity across hosts;
a host whose link goes down ends the job with an error naming it.

Only where namespaces cannot be made (not root, no `ip`) do these tests skip, and say why."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.parallel.harness import ROOT, launch, rank_main, run_ranks, run_scenarios

HOSTS, PER_HOST = 2, 2
PREFIX = "hst"
PEER_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def cluster():
    from launch.cluster import Cluster

    why = Cluster.unavailable()
    if why:
        pytest.skip(f"no namespace cluster on this machine: {why}")
    with Cluster(HOSTS, prefix=PREFIX, subnet="10.231.9") as made:
        yield made


def mpirun_on(cluster, np_=HOSTS * PER_HOST) -> list[str]:
    return ["mpirun", "-np", str(np_), "-H", cluster.hosts_arg(PER_HOST), "--bind-to", "none", "--tag-output",
            "--allow-run-as-root"]


def hybridsync_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.run", *args, "--no-explain"]


def rank_hosts(prefix, per_host, backend, cpu_shares="{}"):
    import json

    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init(backend=backend)
    rank, size = hvd.rank(), hvd.size()
    per_host = int(per_host)
    host = socket.gethostname()
    assert host == f"{prefix}{rank // per_host}", (rank, host)
    assert (hvd.local_rank(), hvd.local_size()) == (rank % per_host, per_host), (rank, host)
    assert (hvd.cross_rank(), hvd.cross_size()) == (rank // per_host, size // per_host), (rank, host)
    assert hybridsync.local_rank() == hvd.local_rank()
    # Each host runs on its own share of the machine's CPUs, as a real host would.
    share = json.loads(cpu_shares).get(host)
    if share is not None:
        assert sorted(os.sched_getaffinity(0)) == share, (rank, host, os.sched_getaffinity(0), share)
    hosts = hvd.allgather_object(host, name="hosts")
    assert hosts == [f"{prefix}{r // per_host}" for r in range(size)], hosts
    total = hvd.allreduce(torch.full((5,), float(rank + 1)), op=hvd.Sum, name="cluster.sum")
    assert torch.equal(total, torch.full((5,), float(sum(range(1, size + 1))))), total
    print(f"rank {rank} on {host}: local {hvd.local_rank()}/{hvd.local_size()}", flush=True)


def rank_train_until_the_link_drops():
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init(backend="mpi")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(1000, 8, sparse=True), "fc": torch.nn.Linear(8, 1)})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    step = 0
    while True:  # runs until the link drops; the peer timeout ends it
        ids = torch.randint(0, 1000, (64,))
        loss = model["fc"](model["emb"](ids)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step == 5 and hybridsync.rank() == 0:
            print("CLUSTER-TRAINING", flush=True)
        time.sleep(0.01)


def test_local_and_cross_ranks_per_host_under_hybridsync_run_with_H(cluster):
    """Both dense backends in one launch (a launch across the hosts costs seconds)."""
    cmd = hybridsync_run("-np", "4", "-H", cluster.hosts_arg(PER_HOST))
    shares = _shares(cluster)
    out = run_scenarios(__file__, 4, ("rank_hosts", PREFIX, PER_HOST, "mpi", shares),
                        ("rank_hosts", PREFIX, PER_HOST, "horovod", shares), launcher=cmd, env=cluster.env(),
                        timeout=180)
    assert out.count(f"rank 3 on {PREFIX}1: local 1/2") == 2, out  # (hybridsync-run does not tag the lines)


def test_local_and_cross_ranks_per_host_under_hybridsync_run_with_a_hostfile(cluster):
    cmd = hybridsync_run("-np", "4", "--hostfile", cluster.hostfile(PER_HOST))
    run_ranks(__file__, "rank_hosts", 4, PREFIX, str(PER_HOST), "mpi", launcher=cmd, env=cluster.env(),
              timeout=120)


def test_horovodrun_spans_the_hosts(cluster):
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    cmd = [horovodrun, "-np", "4", "-H", cluster.hosts_arg(PER_HOST)]
    run_ranks(__file__, "rank_hosts", 4, PREFIX, str(PER_HOST), "horovod", _shares(cluster), launcher=cmd,
              env=cluster.env(), timeout=180)


def _shares(cluster) -> str:
    import json

    shares = cluster.cpu_shares()
    mine = sorted(os.sched_getaffinity(0))
    # The shares cut this machine's CPUs between the hosts: disjoint when there are enough.
    assert sorted(c for share in shares.values() for c in share) == mine or len(mine) < HOSTS, shares
    return json.dumps(shares)


# Every route, dense and sparse, under both dense backends: the single-host parity scenarios,
# now with ranks on two hosts (both backends in one launch: a launch across the hosts costs seconds).
@pytest.mark.parametrize("scenario", ["test_routes.py:rank_routes", "test_sparse_parity.py:rank_parity",
                                      "test_dense_parity.py:rank_parity"])
def test_parity_of_every_route_across_hosts_under_mpi_and_horovod(cluster, scenario):
    script, _, fn = scenario.partition(":")
    run_scenarios(str(Path(__file__).with_name(script)), 4, (fn, "mpi"), (fn, "horovod"),
                  launcher=mpirun_on(cluster), env=cluster.env(), timeout=420)


# With keepalives off, only hybridsync-run's own watch can end mpirun once the ranks aborted: mpirun's
# kill message to the lost daemon stays unacknowledged, and TCP retransmits for about 15 minutes.
@pytest.mark.parametrize("keepalive", ["on", "off"])
def test_a_host_whose_link_goes_down_ends_the_job_naming_it(cluster, keepalive):
    """The job ends, naming the lost host, instead of waiting on it: mpirun's keepalives notice it
    (within 0.8 x the peer timeout, so mpirun may name it before the ranks do), or, keepalives off,
    the ranks name it and hybridsync-run ends mpirun once they have aborted."""
    lost = f"{PREFIX}1"
    env = cluster.env({**os.environ, "HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)})
    if keepalive == "off":
        env["OMPI_MCA_oob_tcp_keepalive_time"] = "0"  # a value the user set wins over hybridsync-run's
    # hybridsync-run, as users launch across hosts: it also has mpirun watch its remote daemons.
    cmd = hybridsync_run("-np", "4", "-H", cluster.hosts_arg(PER_HOST)) + [
        sys.executable, "-u", __file__, "rank_train_until_the_link_drops"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**env, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    lines: list[str] = []
    dropped = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "CLUSTER-TRAINING" in line:
                cluster.set_link(lost, up=False)
                dropped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert dropped.wait(120), "training never started:\n" + "".join(lines)
        start = time.monotonic()
        try:
            proc.wait(timeout=PEER_TIMEOUT_S + 40)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job outlived its lost host by {time.monotonic() - start:.0f} s:\n" + "".join(lines))
    finally:
        cluster.set_link(lost, up=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
    out = "".join(lines)
    assert proc.returncode != 0, out
    if keepalive == "off":
        assert f"on host {lost} has not been heard from" in out, out
        assert "hybridsync-run: the job was aborted" in out, out
    else:  # the keepalives fire within 0.8 x the peer timeout: mpirun may name the host first
        assert f"on host {lost} has not been heard from" in out or f"on node {lost}" in out, out


if __name__ == "__main__":
    rank_main(globals())
