"""hybridsync-run: launch a training script on N ranks with mpirun (default) or horovodrun.

    hybridsync-run -np 4 -H a:2,b:2 --config hybridsync.yaml python train.py --epochs 3
    hybridsync-run -np 2 --launcher horovodrun python train.py

It adds what a run needs and people forget: --allow-run-as-root when run as root,
--oversubscribe when a host gets more ranks than it has cores, --bind-to none (one torch
thread per rank), TCP keepalives on mpirun's links to other hosts (a host that drops off the
network ends the job within about HYBRIDSYNC_PEER_TIMEOUT_S, not after TCP's 15 minutes), and
it ends mpirun itself if mpirun is still waiting on a lost host's daemon 10 s (or the peer
timeout) after a rank aborted the job; it checks the config before launching (errors name file:line), hands its
absolute path to every rank (HYBRIDSYNC_CONFIG), and has rank 0 print the plan once, when the
DistributedOptimizer is created, before training starts. --dry-run prints the command.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# What mpirun (and hybridsync's ranks) print on stderr once a rank has aborted the job.
_ABORT_MARKERS = (b"MPI_ABORT was invoked", b"aborting the job")


def _parse(argv):
    p = argparse.ArgumentParser(prog="hybridsync-run", description=__doc__.split("\n")[0],
                                usage="hybridsync-run -np N [-H host:slots,...] [--config FILE] command ...")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("-H", "--hosts", default=None, help="host:slots,host:slots (default: this host)")
    p.add_argument("--hostfile", default=None)
    p.add_argument("--config", default=None, help="hybridsync YAML config for every rank")
    p.add_argument("--launcher", choices=["mpirun", "horovodrun"], default="mpirun")
    p.add_argument("--no-explain", action="store_true", help="do not print the plan")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    args = p.parse_args(argv)
    if not args.command:
        p.error("give the command to run, e.g.: hybridsync-run -np 2 python train.py")
    if args.np < 1:
        p.error("-np must be >= 1")
    return args


def _slots(hosts: str | None) -> int | None:
    """Total slots in -H host:slots,...; None for 'this host, as many cores as it has'."""
    if not hosts:
        return None
    total = 0
    for entry in hosts.split(","):
        _, _, slots = entry.partition(":")
        total += int(slots) if slots else 1
    return total


def _daemon_keepalive(env) -> dict:
    """OpenMPI variables that make mpirun notice a host that dropped off the network.

    Ranks name a silent peer within HYBRIDSYNC_PEER_TIMEOUT_S and abort, but mpirun then waits
    on the lost host's daemon for as long as TCP retransmits (about 15 minutes). TCP keepalives
    that fire before the peer timeout end the job within it instead (hybridsync/lost_hosts.py).
    A value the user set wins."""
    from hybridsync.lost_hosts import keepalive_mca
    from hybridsync.settings import settings

    wanted = keepalive_mca(settings().peer_timeout_s)
    return {k: str(v) for k, v in wanted.items() if f"OMPI_MCA_{k}" not in env}


def build_command(args) -> tuple[list[str], dict]:
    env = dict(os.environ)
    exported = []
    if args.config:
        from hybridsync import config as config_mod

        config_mod.load(args.config)  # fail here, with file:line, not on N ranks
        env["HYBRIDSYNC_CONFIG"] = os.path.abspath(args.config)
        exported.append("HYBRIDSYNC_CONFIG")
    if not args.no_explain:
        env["HYBRIDSYNC_EXPLAIN"] = "1"
        exported.append("HYBRIDSYNC_EXPLAIN")
    keepalive = _daemon_keepalive(env) if args.hosts or args.hostfile else {}
    slots = _slots(args.hosts)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    oversubscribed = args.np > (slots if slots is not None else cores) if not args.hostfile else False
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if args.launcher == "horovodrun":
        cmd = [shutil.which("horovodrun") or "horovodrun", "-np", str(args.np)]
        if args.hosts:
            cmd += ["-H", args.hosts]
        elif not args.hostfile:
            cmd += ["-H", f"localhost:{max(args.np, 1)}"]
        if args.hostfile:
            cmd += ["--hostfile", args.hostfile]
        if root:  # horovodrun passes --allow-run-as-root itself; mpirun also reads these
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        env.update({f"OMPI_MCA_{k}": v for k, v in keepalive.items()})  # horovodrun's mpirun reads them
        return cmd + args.command, env
    cmd = ["mpirun", "-np", str(args.np), "--bind-to", "none"]
    if args.hosts:
        cmd += ["-H", args.hosts]
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
    if root:
        cmd.append("--allow-run-as-root")
    if oversubscribed:
        cmd.append("--oversubscribe")
    for key, value in keepalive.items():
        cmd += ["--mca", key, value]
    # Every HYBRIDSYNC_* setting reaches the ranks on other hosts too (mpirun forwards only -x).
    settings_vars = sorted(n for n in env if n.startswith("HYBRIDSYNC_") and n not in exported)
    for name in exported + settings_vars + ["PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV"]:
        if name in env:
            cmd += ["-x", name]
    return cmd + args.command, env


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from hybridsync.config import ConfigError

    try:
        cmd, env = build_command(args)
    except ConfigError as exc:
        print(f"hybridsync-run: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(shlex.quote(c) for c in cmd))
        return 0
    return run_watching_aborts(cmd, env, grace_s=_abort_grace_s())


def _abort_grace_s() -> float:
    from hybridsync.settings import settings

    return max(10.0, settings().peer_timeout_s)


def run_watching_aborts(cmd: list[str], env: dict, grace_s: float) -> int:
    """Run the launcher; once a rank has aborted the job, give it grace_s to end, then end it.

    After MPI_Abort, mpirun waits for every daemon to confirm its ranks are gone. A daemon on a
    host that dropped off the network never answers, and with the kill message unacknowledged TCP
    keepalives no longer apply: mpirun would wait out TCP's retransmits (about 15 minutes). The
    launcher's stderr passes through unchanged, line by line; stdout is not touched."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    aborted_at: list[float] = []

    def relay():
        out = sys.stderr.buffer
        for line in iter(proc.stderr.readline, b""):
            out.write(line)
            out.flush()
            if not aborted_at and any(m in line for m in _ABORT_MARKERS):
                aborted_at.append(time.monotonic())

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    forward = lambda signum, _frame: proc.send_signal(signum)  # noqa: E731 - a scheduler's SIGTERM reaches mpirun
    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:  # the terminal sent SIGINT to mpirun too; let it end the job
                continue
            if aborted_at and time.monotonic() - aborted_at[0] > grace_s:
                sys.stderr.write(f"hybridsync-run: the job was aborted {grace_s:.0f} s ago and {Path(cmd[0]).name} "
                                 "has not ended (a host is unreachable?); killing it\n")
                sys.stderr.flush()
                proc.terminate()
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rc = 1
                break
    finally:
        signal.signal(signal.SIGTERM, previous)
    relay_thread.join(2)
    return rc


if __name__ == "__main__":
    sys.exit(main())
