"""A cluster of N "hosts" on this machine: network namespaces joined by one Linux bridge.

Each host is an `ip netns` namespace with its own hostname (set by `unshare --uts` in every
process started on it), one veth link to a bridge in the root namespace, and an optional rate
limit per link (a `tc` token bucket on both ends). mpirun, horovodrun and hybridsync-run span
the hosts unchanged: the cluster puts an `ssh` on PATH that "logs in" to a host by entering its
namespace, and sets the OMPI_MCA_* variables that make OpenMPI talk TCP on the bridge subnet.
By default each host also gets its own share of this machine's CPUs (`cpus="split"`: with 2
cores and 2 hosts, one core each), as real hosts have: every process started on a host runs on
its share. Left to the scheduler (`cpus="shared"`), ranks of different hosts take turns on one
core, and which ranks end up sharing a core changes from run to run -- and with it the speed of
a 2-host x 2-rank run on 2 cores, by up to 40%.

    python -m launch.cluster up --hosts 2 [--rate 1gbit] [--cpus shared]   # prints the environment
    python -m launch.cluster run --hosts 2 [--rate 1gbit] -- mpirun -np 4 -H hs0:2,hs1:2 python train.py
    python -m launch.cluster down

In Python (the tests and the network benchmark use this):

    with Cluster(2, rate="1gbit") as cluster:
        subprocess.run(["mpirun", "-np", "4", "-H", cluster.hosts_arg(2), ...], env=cluster.env())
        cluster.set_link("hs1", up=False)    # the host drops off the network
        cluster.counters()                   # bytes each host sent/received on its link

Needs root (namespaces, bridges and qdiscs are privileged); `Cluster.unavailable()` says why not.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

STATE_DIR = Path(os.environ.get("HYBRIDSYNC_CLUSTER_DIR", "/run/hybridsync-cluster"))

# The fake ssh: `ssh [options] HOST command...` runs the command, through a shell as ssh's
# remote side does, inside HOST's namespace with HOST as its hostname. Options ssh would take
# (horovodrun and mpirun pass a few) are skipped.
SSH_SHIM = """#!/bin/sh
skip_options() {
  n=0
  while [ $# -gt 0 ]; do
    case "$1" in
      -o|-p|-i|-l|-F|-E|-c|-m|-b|-e|-J|-L|-R|-D|-S|-W|-w) shift 2; n=$((n + 2)) ;;
      -*) shift; n=$((n + 1)) ;;
      *) break ;;
    esac
  done
  echo $n
}
shift "$(skip_options "$@")"
host="${1##*@}"; shift
shift "$(skip_options "$@")"  # as OpenSSH, options may also follow the host
[ -e "/run/netns/$host" ] || { echo "ssh (hybridsync cluster): no host $host" >&2; exit 255; }
# The host's own CPUs, when the cluster gave it some (a file beside this script).
pin=""
[ -r "$(dirname "$0")/$host.cpus" ] && pin="taskset -c $(cat "$(dirname "$0")/$host.cpus")"
exec $pin ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""


def _sh(*cmd: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    out = subprocess.run(full, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _rate_bits(rate: str) -> float:
    """'1gbit' / '10gbit' / '500mbit' -> bits per second (tc's spelling)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    low = rate.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return float(low[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: give it as tc does, e.g. 1gbit, 10gbit, 500mbit")


@dataclasses.dataclass
class LostHostRun:
    """A job that lost a host (Cluster.lose_host_during): its exit status and how long after the
    link went down it ended (None for both: it was still running at the limit, and was killed)."""
    returncode: int | None
    seconds: float | None
    dropped: bool  # the link went down (the job got as far as the marker line)
    output: str


class Cluster:
    """N hosts named <prefix>0 ... <prefix>N-1 on subnet <subnet>.0/24 (.254 is this machine)."""

    def __init__(self, hosts: int, rate: str | None = None, prefix: str = "hs", subnet: str = "10.231.7",
                 cpus: str = "split"):
        if hosts < 1:
            raise ValueError("a cluster needs at least one host")
        if cpus not in ("split", "shared"):
            raise ValueError(f"cpus {cpus!r}: 'split' (each host its own share) or 'shared'")
        if len(prefix) > 6 or not prefix.isalnum():
            raise ValueError(f"prefix {prefix!r}: up to 6 letters/digits (interface names are short)")
        self.n, self.rate, self.prefix, self.subnet, self.cpus = hosts, rate, prefix, subnet, cpus
        self.names = [f"{prefix}{i}" for i in range(hosts)]
        self.bridge = f"{prefix}br"
        self.bin_dir = STATE_DIR / prefix / "bin"

    # -- lifecycle -------------------------------------------------------------------------
    @staticmethod
    def unavailable() -> str | None:
        """Why a cluster cannot be made here (None when it can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc", "unshare"):
            if not shutil.which(tool):
                return f"`{tool}` is not installed"
        probe = f"hsprobe{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def up(self) -> "Cluster":
        self.down()  # a previous run killed before its cleanup leaves its namespaces behind
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for name in self.names:
            _sh("ip", "netns", "add", name)
            _sh("ip", "link", "add", self._veth(name), "type", "veth", "peer", "name", "eth0", "netns", name)
            _sh("ip", "link", "set", self._veth(name), "master", self.bridge)
            _sh("ip", "link", "set", self._veth(name), "up")
            _sh("ip", "addr", "add", f"{self.address(name)}/24", "dev", "eth0", ns=name)
            _sh("ip", "link", "set", "eth0", "up", ns=name)
            _sh("ip", "link", "set", "lo", "up", ns=name)
        if self.rate:
            for name in self.names:
                self.set_rate(name, self.rate)
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        ssh = self.bin_dir / "ssh"
        ssh.write_text(SSH_SHIM)
        ssh.chmod(0o755)
        for name, share in self.cpu_shares().items():
            (self.bin_dir / f"{name}.cpus").write_text(",".join(map(str, share)))
        (STATE_DIR / self.prefix / "state.json").write_text(json.dumps(
            {"hosts": self.n, "rate": self.rate, "subnet": self.subnet}))
        return self

    def down(self) -> None:
        for name in self._existing_hosts():
            self.kill_processes(name)  # they would keep the namespace alive
            subprocess.run(["ip", "link", "del", self._veth(name)], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(STATE_DIR / self.prefix, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def cpu_shares(self) -> dict[str, list[int]]:
        """The CPUs each host runs on ({} when shared): this process's CPUs cut into equal,
        contiguous shares, or -- more hosts than CPUs -- one CPU each, round robin."""
        if self.cpus == "shared":
            return {}
        mine = sorted(os.sched_getaffinity(0))
        if len(mine) >= self.n:
            return {name: mine[i * len(mine) // self.n:(i + 1) * len(mine) // self.n]
                    for i, name in enumerate(self.names)}
        return {name: [mine[i % len(mine)]] for i, name in enumerate(self.names)}

    # -- what a launcher needs -------------------------------------------------------------
    def env(self, base: dict | None = None) -> dict:
        """The environment under which mpirun / horovodrun / hybridsync-run span the hosts."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        subnet = f"{self.subnet}.0/24"
        env.update(OMPI_MCA_plm_rsh_agent=str(self.bin_dir / "ssh"), OMPI_MCA_btl="tcp,self,vader",
                   OMPI_MCA_btl_tcp_if_include=subnet, OMPI_MCA_oob_tcp_if_include=subnet,
                   # Horovod's Gloo/NIC discovery, when horovodrun is used, stays on the bridge too.
                   HOROVOD_GLOO_IFACE="eth0")
        return env

    def command_on(self, host: str, cmd: list[str]) -> list[str]:
        """`cmd` run on `host` (as `ssh host cmd` would): e.g. mpirun started on the first host,
        as on a real cluster, rather than on this machine, outside every host."""
        return [str(self.bin_dir / "ssh"), host, shlex.join(cmd)]

    def address(self, host: str) -> str:
        """The host's address on the bridge subnet (what a launcher's rendezvous endpoint names)."""
        return f"{self.subnet}.{self.names.index(host) + 1}"

    def hosts_arg(self, slots: int) -> str:
        """-H value with `slots` ranks on each host: 'hs0:2,hs1:2'."""
        return ",".join(f"{name}:{slots}" for name in self.names)

    def hostfile(self, slots: int) -> str:
        path = STATE_DIR / self.prefix / f"hostfile-{slots}"
        path.write_text("".join(f"{name} slots={slots}\n" for name in self.names))
        return str(path)

    # -- the network -----------------------------------------------------------------------
    def set_rate(self, host: str, rate: str | None) -> None:
        """Limits the host's link to `rate` each way (None: unlimited)."""
        for dev, ns in ((self._veth(host), None), ("eth0", host)):
            _sh("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            if rate:
                # The bucket must hold a whole offloaded (GSO) segment plus a timer tick of traffic.
                burst = max(int(_rate_bits(rate) / 8 / 250), 256 * 1024)
                _sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                    "latency", "100ms", ns=ns)

    def set_link(self, host: str, up: bool) -> None:
        """Takes the host's link down (it drops off the network) or back up."""
        _sh("ip", "link", "set", self._veth(host), "up" if up else "down")
        if up:
            # While the link was down the hosts' ARP lookups of each other failed, and the kernel
            # keeps those answers: a new connection (the next job's daemon calling mpirun) would
            # fail at once with "no route to host" until they expire. Forget them.
            for name in self.names:
                _sh("ip", "neigh", "flush", "all", ns=name)

    def lose_host_during(self, cmd: list[str], host: str, when: str, limit_s: float, env: dict | None = None,
                         cwd: str | None = None) -> "LostHostRun":
        """Runs a launcher command; the first time its output has a line containing `when`, takes
        `host`'s link down. Waits up to limit_s for the job to end after that (then kills its
        process group), brings the link back up and says how long the job outlived its host."""
        import threading
        import time

        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                env=self.env() if env is None else env, start_new_session=True)
        lines: list[str] = []
        dropped_at: list[float] = []

        def read():
            for line in proc.stdout:
                lines.append(line)
                if not dropped_at and when in line:
                    self.set_link(host, up=False)
                    dropped_at.append(time.monotonic())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + limit_s + 300  # the time to start training, at most 5 minutes
            while proc.poll() is None and not dropped_at and time.monotonic() < deadline:
                time.sleep(0.05)
            if dropped_at:
                try:
                    proc.wait(timeout=max(0.0, dropped_at[0] + limit_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            ended = proc.poll() is not None
            seconds = time.monotonic() - dropped_at[0] if dropped_at else None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            self.set_link(host, up=True)
            reader.join(5)
        return LostHostRun(returncode=proc.returncode if ended else None, seconds=seconds if ended else None,
                           dropped=bool(dropped_at), output="".join(lines))

    def pids(self, host: str) -> list[int]:
        """The processes running on the host (in its namespace)."""
        return [int(p) for p in _sh("ip", "netns", "pids", host, check=False).stdout.split()]

    def kill_processes(self, host: str) -> None:
        """Kills whatever still runs on the host (a killed job's ranks, a lost host's daemon)."""
        for pid in self.pids(host):
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each host sent (tx) and received (rx) on its link so far."""
        out = {}
        for name in self.names:
            stats = Path("/sys/class/net") / self._veth(name) / "statistics"
            # The bridge side's rx is what the host sent.
            out[name] = {"tx_bytes": int((stats / "rx_bytes").read_text()),
                         "rx_bytes": int((stats / "tx_bytes").read_text())}
        return out

    # -- internals -------------------------------------------------------------------------
    def _veth(self, host: str) -> str:
        return f"{host}v"

    def _existing_hosts(self) -> list[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
        names = [line.split()[0] for line in listed if line.strip()]
        return [n for n in names if n.startswith(self.prefix) and n[len(self.prefix):].isdigit()]


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m launch.cluster", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    for action in ("up", "run"):
        s = sub.add_parser(action)
        s.add_argument("--hosts", type=int, default=2)
        s.add_argument("--rate", default=None, help="per-link rate each way, tc spelling (1gbit, 10gbit)")
        s.add_argument("--prefix", default="hs")
        s.add_argument("--subnet", default="10.231.7")
        s.add_argument("--cpus", choices=["split", "shared"], default="split",
                       help="split: each host runs on its own share of this machine's CPUs (default); "
                            "shared: the scheduler places every rank anywhere")
        if action == "run":
            s.add_argument("command", nargs=argparse.REMAINDER, help="-- mpirun ... (HOSTS in it: the -H list)")
    down = sub.add_parser("down")
    down.add_argument("--prefix", default="hs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    why = Cluster.unavailable()
    if why:
        print(f"launch.cluster: cannot make a cluster here: {why}", file=sys.stderr)
        return 2
    if args.action == "down":
        state = STATE_DIR / args.prefix / "state.json"
        hosts = json.loads(state.read_text())["hosts"] if state.exists() else 1
        Cluster(hosts, prefix=args.prefix).down()
        return 0
    cluster = Cluster(args.hosts, rate=args.rate, prefix=args.prefix, subnet=args.subnet, cpus=args.cpus)
    if args.action == "up":
        cluster.up()
        env = cluster.env({})
        print(f"hosts: {' '.join(cluster.names)}   (-H {cluster.hosts_arg(1)})")
        for name, share in cluster.cpu_shares().items():
            print(f"# {name} runs on CPU {','.join(map(str, share))}")
        for key in sorted(env):
            value = f"{cluster.bin_dir}:$PATH" if key == "PATH" else shlex.quote(env[key])
            print(f"export {key}={value}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("launch.cluster run: give the command after --", file=sys.stderr)
        return 2
    with cluster:
        return subprocess.call(command, env=cluster.env())


if __name__ == "__main__":
    sys.exit(main())
