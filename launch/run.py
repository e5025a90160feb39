"""hybridsync-run: launch a training script on N ranks with mpirun (default) or horovodrun.

    hybridsync-run -np 4 -H a:2,b:2 --config hybridsync.yaml python train.py --epochs 3
    hybridsync-run -np 2 --launcher horovodrun python train.py

It adds what a run needs and people forget: --allow-run-as-root when run as root,
--oversubscribe when a host gets more ranks than it has cores, --bind-to none (one torch
thread per rank), TCP keepalives on mpirun's links to other hosts (a host that drops off the
network ends the job within about HYBRIDSYNC_PEER_TIMEOUT_S, not after TCP's 15 minutes); it checks the config before launching (errors name file:line), hands its
absolute path to every rank (HYBRIDSYNC_CONFIG), and has rank 0 print the plan once, when the
DistributedOptimizer is created, before training starts. --dry-run prints the command.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys


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
    on the daemons' connections end the job within about the peer timeout instead. A value the
    user set wins."""
    from hybridsync.settings import settings

    timeout = settings().peer_timeout_s
    wanted = {"oob_tcp_keepalive_time": max(1, int(timeout / 2)),
              "oob_tcp_keepalive_intvl": max(1, int(timeout / 10)),
              "oob_tcp_keepalive_probes": 3}
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
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
