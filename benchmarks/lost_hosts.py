"""A host lost mid-run: how long after its link goes down the job ends, per launcher.

Two namespace hosts x 2 ranks (launch/cluster.py) run parameter-server pulls until the second
host's link is taken down; the time from link-down to the launcher's exit is measured (the job
is killed at the limit, and reported as still running). Per launcher, as docs/lost-hosts.md
says to start it:

    hybridsync-run                     hybridsync-run -np 4 -H ... (it adds the keepalives, and watches)
    mpirun + flags                     mpirun ... --mca oob_tcp_keepalive_* ... (backstop off)
    horovodrun + exports               OMPI_MCA_oob_tcp_keepalive_*=... horovodrun ... (backstop off)
    mpirun on host 0, backstop only    mpirun started on host 0, no flags: the ranks' backstop ends it
    mpirun, no flags, no backstop      the wait left as it was (--plain; runs until --plain-limit)

    python benchmarks/lost_hosts.py [--repeats 3] [--peer-timeout 15] [--launchers 'a;b'] [--plain]

Runs are interleaved (round r runs every launcher once). Writes benchmarks/results/lost_hosts.
{json,md,png}; --launchers adds to the runs already in lost_hosts.json for the same peer
timeout (one call per launcher keeps each call short). Needs root.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridsync import lost_hosts  # noqa: E402
from launch.cluster import Cluster  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SCENARIO = [sys.executable, "-u", str(ROOT / "tests" / "parallel" / "test_lost_hosts.py"),
            "rank_pull_until_the_link_drops"]
LAUNCHERS = ["hybridsync-run", "mpirun + flags", "horovodrun + exports", "mpirun on host 0, backstop only"]
PLAIN = "mpirun, no flags, no backstop"
PREFIX, SUBNET = "hlb", "10.231.15"


def mpirun(cluster) -> list[str]:
    return ["mpirun", "-np", "4", "-H", cluster.hosts_arg(2), "--bind-to", "none", "--allow-run-as-root",
            "-x", "HYBRIDSYNC_PEER_TIMEOUT_S", "-x", "HYBRIDSYNC_LOST_HOST_BACKSTOP", "-x", "PYTHONPATH"]


def command(launcher: str, cluster, timeout: float) -> tuple[list[str], dict]:
    env = cluster.env({**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDSYNC_PEER_TIMEOUT_S": f"{timeout:g}",
                       "HYBRIDSYNC_LOST_HOST_BACKSTOP": "0"})
    if launcher == "hybridsync-run":
        return [sys.executable, "-m", "launch.run", "-np", "4", "-H", cluster.hosts_arg(2), "--no-explain"] + SCENARIO, env
    if launcher == "mpirun + flags":
        return mpirun(cluster) + shlex.split(lost_hosts.mpirun_flags(timeout)) + SCENARIO, env
    if launcher == "horovodrun + exports":
        env.update(item.split("=") for item in lost_hosts.exports(timeout).split()[1:])
        horovodrun = str(Path(sys.executable).with_name("horovodrun"))
        return [horovodrun, "-np", "4", "-H", cluster.hosts_arg(2)] + SCENARIO, env
    if launcher == "mpirun on host 0, backstop only":
        env["HYBRIDSYNC_LOST_HOST_BACKSTOP"] = "1"
        return cluster.command_on(cluster.names[0], mpirun(cluster) + SCENARIO), env
    if launcher == PLAIN:
        return mpirun(cluster) + SCENARIO, env
    raise ValueError(f"launcher {launcher!r}: one of {LAUNCHERS + [PLAIN]}")


def ended_by(output: str, ended: bool = True) -> str:
    """Who ended the job, from what it printed."""
    if not ended:
        return "nobody: killed at the limit"
    if "hybridsync-run: the job was aborted" in output:
        return "hybridsync-run's watch"
    if "lost communication with a remote daemon" in output or "ORTE has lost communication" in output:
        return "mpirun (keepalives)"
    if "launcher process (mpirun" in output:
        return "the ranks' backstop"
    return "mpirun (after the abort)"


def summarise(runs: list[dict], timeout: float) -> dict:
    out = {}
    for launcher in LAUNCHERS + [PLAIN]:
        mine = [r for r in runs if r["launcher"] == launcher and r["peer_timeout_s"] == timeout]
        if not mine:
            continue
        ended = [r["seconds"] for r in mine if r["seconds"] is not None]
        out[launcher] = {"runs": len(mine), "median_s": statistics.median(ended) if len(ended) == len(mine) else None,
                         "seconds": [r["seconds"] for r in mine], "exit": sorted({str(r["returncode"]) for r in mine}),
                         "ended_by": sorted({r["ended_by"] for r in mine}), "limit_s": max(r["limit_s"] for r in mine)}
    return out


def markdown(summary: dict, timeout: float, meta: dict) -> str:
    lines = [f"Link-down to launcher exit, HYBRIDSYNC_PEER_TIMEOUT_S={timeout:g} (goal: within {timeout + 15:g} s); "
             f"2 namespace hosts x 2 ranks, {meta['machine']}, {meta['date']}.", "",
             "| launcher | median (s) | runs (s) | exit status | ended by |", "|---|---:|---|---|---|"]
    for launcher, s in summary.items():
        runs = ", ".join("still running at %.0f" % s["limit_s"] if x is None else f"{x:.1f}" for x in s["seconds"])
        median = f"{s['median_s']:.1f}" if s["median_s"] is not None else f"> {s['limit_s']:.0f}"
        lines.append(f"| {launcher} | {median} | {runs} | {', '.join(s['exit'])} | {', '.join(s['ended_by'])} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, timeout: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    medians = [s["median_s"] if s["median_s"] is not None else s["limit_s"] for s in summary.values()]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(names, medians, color=["#4c72b0" if s["median_s"] is not None and s["median_s"] <= timeout + 15
                                          else "#c44e52" for s in summary.values()])
    ax.axvline(timeout, color="grey", linestyle=":", label=f"peer timeout ({timeout:g} s)")
    ax.axvline(timeout + 15, color="black", linestyle="--", label=f"goal ({timeout + 15:g} s)")
    for bar, s in zip(bars, summary.values()):
        label = f"{s['median_s']:.1f} s" if s["median_s"] is not None else f"still running at {s['limit_s']:.0f} s"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from link-down to the launcher's exit (median; log scale)")
    ax.set_xscale("log")  # seconds next to a quarter of an hour
    ax.set_xlim(1, max(medians) * 4)  # room for the labels
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peer-timeout", type=float, default=15.0)
    p.add_argument("--launchers", default=";".join(LAUNCHERS), help="; between names")
    p.add_argument("--plain", action="store_true", help=f"also '{PLAIN}' once (it runs until --plain-limit)")
    p.add_argument("--plain-limit", type=float, default=120.0)
    p.add_argument("--rerender", action="store_true",
                   help="no runs: the tables, and the plot of --peer-timeout's runs, from lost_hosts.json again")
    args = p.parse_args()
    if args.rerender:
        saved = json.loads((RESULTS / "lost_hosts.json").read_text())
        for row in saved["runs"]:
            row["ended_by"] = ended_by(row["output_tail"], row["seconds"] is not None)
        render(saved["runs"], args.peer_timeout, saved["meta"])
        return 0
    why = Cluster.unavailable()
    if why:
        print(f"lost_hosts benchmark: no namespace cluster here: {why}", file=sys.stderr)
        return 2
    chosen = [name.strip() for name in args.launchers.split(";") if name.strip()]
    path = RESULTS / "lost_hosts.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    replaced = (chosen if args.repeats else []) + ([PLAIN] if args.plain else [])
    runs = [r for r in runs if not (r["launcher"] in replaced and r["peer_timeout_s"] == args.peer_timeout)]
    plan = [name for _ in range(args.repeats) for name in chosen] + ([PLAIN] if args.plain else [])
    with Cluster(2, prefix=PREFIX, subnet=SUBNET) as cluster:
        for launcher in plan:
            cmd, env = command(launcher, cluster, args.peer_timeout)
            limit = args.plain_limit if launcher == PLAIN else args.peer_timeout + 60
            run = cluster.lose_host_during(cmd, cluster.names[1], "CLUSTER-TRAINING", limit, env=env, cwd=str(ROOT))
            for host in cluster.names:
                cluster.kill_processes(host)  # the lost host's daemon may still wait on its dead link
            if not run.dropped:
                print(f"{launcher}: the job never started training:\n{run.output}", file=sys.stderr)
                return 1
            row = {"launcher": launcher, "peer_timeout_s": args.peer_timeout, "seconds": run.seconds,
                   "returncode": run.returncode, "limit_s": limit, "ended_by": ended_by(run.output, run.seconds is not None),
                   "output_tail": run.output[-1500:]}
            runs.append(row)
            took = "still running at %.0f s" % limit if run.seconds is None else f"{run.seconds:.1f} s"
            print(f"{launcher}: {took} (exit {run.returncode}, {row['ended_by']})", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{os.cpu_count()} CPUs"}
    render(runs, 15.0 if any(r["peer_timeout_s"] == 15.0 for r in runs) else args.peer_timeout, meta)
    return 0


def render(runs: list[dict], timeout: float, meta: dict) -> None:
    """lost_hosts.json, a table per peer timeout measured (lost_hosts.md), and the plot of
    `timeout`'s runs (lost_hosts.png)."""
    timeouts = sorted({r["peer_timeout_s"] for r in runs})
    summaries = {f"{t:g}": summarise(runs, t) for t in timeouts}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lost_hosts.json").write_text(json.dumps({"meta": meta, "runs": runs, "summary": summaries}, indent=1))
    table = "\n".join(markdown(summaries[f"{t:g}"], t, meta) for t in timeouts)
    (RESULTS / "lost_hosts.md").write_text(table)
    plot(summaries[f"{timeout:g}"], timeout, RESULTS / "lost_hosts.png")
    print(table)


if __name__ == "__main__":
    sys.exit(main())
