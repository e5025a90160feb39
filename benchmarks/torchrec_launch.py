"""Finds the TorchRec venv and launches benchmarks/torchrec_dlrm.py under torchrun, on this machine
or on the emulated hosts of a launch/cluster.py Cluster; used by bench.py and network.py.

TorchRec is not one of hybridsync's dependencies and needs a torch build of its own, so it lives
in a venv of its own: `bash scripts/torchrec-venv.sh` builds one (default
~/.cache/hybridsync/torchrec-venv); HYBRIDSYNC_TORCHREC_PYTHON or --torchrec-python names another.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "torchrec_dlrm.py"
SYSTEM = "torchrec-cpu"
DEFAULT_PYTHON = Path.home() / ".cache" / "hybridsync" / "torchrec-venv" / "bin" / "python"


class TorchRecMissing(RuntimeError):
    """The TorchRec venv is absent or broken: the message says how to build it."""


def python(explicit: str | None = None) -> str:
    """The TorchRec venv's python, checked to import torch, fbgemm_gpu and torchrec."""
    path = explicit or os.environ.get("HYBRIDSYNC_TORCHREC_PYTHON") or str(DEFAULT_PYTHON)
    how = ("build the venv with `bash scripts/torchrec-venv.sh` (it prints its python), or name one with "
           "--torchrec-python / HYBRIDSYNC_TORCHREC_PYTHON, or leave the system out (--systems ...)")
    if not Path(path).is_file():
        raise TorchRecMissing(f"system {SYSTEM!r}: no TorchRec python at {path}: {how}")
    probe = subprocess.run([path, "-c", "import torch, fbgemm_gpu, torchrec; print(torch.__version__, torchrec.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        raise TorchRecMissing(f"system {SYSTEM!r}: {path} cannot import TorchRec:\n{probe.stderr.strip()[-1500:]}\n{how}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(base: dict) -> dict:
    env = dict(base)
    env["OMP_NUM_THREADS"] = "1"  # torchrun sets it too; one thread per rank, as every system here
    env.pop("PYTHONPATH", None)  # the venv's own torch, never the main venv's packages
    return env


def _args(steps: int, warmup: int, extra) -> list[str]:
    return [str(SCRIPT), "--steps", str(steps), "--warmup", str(warmup), *extra]


def _result(returncode: int, output: str, ranks: int) -> dict:
    found = re.search(r"BENCH-RESULT (\{.*\})", output)
    if returncode != 0 or not found:
        return {"system": SYSTEM, "ranks": ranks, "error": output[-2000:]}
    return json.loads(found.group(1))


def run_local(py: str, ranks: int, steps: int, warmup: int, timeout: float, extra=()) -> dict:
    """`ranks` ranks on this machine: torchrun --standalone."""
    cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           *_args(steps, warmup, extra)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env(os.environ))
    except subprocess.TimeoutExpired:
        return {"system": SYSTEM, "ranks": ranks, "error": f"timed out after {timeout} s"}
    return _result(out.returncode, out.stdout + out.stderr, ranks)


def run_cluster(py: str, cluster, per_host: int, steps: int, warmup: int, timeout: float, extra=()) -> dict:
    """`per_host` ranks on each of the cluster's hosts: one torchrun per host (as on real hosts),
    meeting at a c10d rendezvous on host 0's address; Gloo talks over each host's eth0."""
    hosts = cluster.names
    endpoint = f"{cluster.address(hosts[0])}:{_free_port()}"
    env = _env(cluster.env(os.environ))
    env["GLOO_SOCKET_IFNAME"] = "eth0"  # a host's name does not resolve to its address
    procs = []
    for host in hosts:
        # is_host: host 0 serves the rendezvous store. Said outright, since torchrun would find it
        # out by resolving the host's name, which no resolver on these hosts knows.
        cmd = [py, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc_per_node", str(per_host),
               "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", f"bench-{endpoint}",
               "--rdzv_conf", f"is_host={int(host == hosts[0])}", "--local-addr", cluster.address(host),
               *_args(steps, warmup, [*extra, "--wire-iface", "eth0"])]
        procs.append(subprocess.Popen(cluster.command_on(host, cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=ROOT, env=env, start_new_session=True))
    outputs, codes = [], []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
            codes.append(proc.returncode)
    except subprocess.TimeoutExpired:
        return {"system": SYSTEM, "ranks": per_host * len(hosts), "error": f"timed out after {timeout} s"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        for host in hosts:  # a failed rendezvous can leave workers behind in a host's namespace
            cluster.kill_processes(host)
    return _result(max(codes, key=abs), "\n".join(outputs), per_host * len(hosts))
