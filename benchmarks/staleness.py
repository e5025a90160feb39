"""Bounded staleness: throughput at `staleness: k` = 0, 1, 4 on DLRM and word2vec (examples/),
2 ranks, with no straggler and with the last rank slowed by 30%, next to Horovod (horovod.torch
as users run it, and with OMPI_MCA_mpi_yield_when_idle=1) and to another checkout's engine at
k = 0 (--main; "k = 0 no slower than today's engine"); plus the idle serving thread's CPU.

    python benchmarks/staleness.py [--repeats 3] [--main /work/main]
    python benchmarks/staleness.py --hosts 2x2 --rate 1gbit     # needs root: emulated hosts

--hosts HxR: H hosts (network namespaces joined by a bridge, launch/cluster.py, each host its
own share of this machine's CPUs) with R ranks each, their links limited to --rate each way;
ranks on different hosts talk TCP. Writes benchmarks/results/staleness-HxR-RATE.{md,json,png}.

"Slowed by 30%": the last rank sleeps, every step, 30% of the step time hybridsync k = 0 measured
without a straggler (the same absolute sleep for every system). Every system trains the same
script, data and sizes; systems take turns within each repeat, and the table gives medians.
Writes benchmarks/results/staleness.{md,json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

MODELS = {  # model -> (script, its arguments, batch per rank)
    "dlrm": ("torch_dlrm.py", ["--rows", "100000", "--steps", "80", "--log-every", "1000"], 512),
    "word2vec": ("torch_word2vec.py", ["--vocab", "50000", "--tokens", "500000", "--steps", "120",
                                       "--log-every", "1000"], 1024),
}
KS = (0, 1, 4)
RATE = re.compile(r"steps on \d+ rank\(s\): ([\d,]+) (?:samples|pairs)/s")
MAX_LAG = re.compile(r"staleness: .*?max (\d+)")


class Setting:
    """Where the ranks run: `ranks` on this host, or `hosts` x `per_host` on emulated hosts
    (launch/cluster.py) whose links are limited to `rate`."""

    def __init__(self, hosts: int = 1, per_host: int = 2, rate: str | None = None):
        self.hosts, self.per_host, self.rate = hosts, per_host, rate
        self.ranks = hosts * per_host
        self.cluster = None

    @property
    def emulated(self) -> bool:
        return self.hosts > 1

    @property
    def label(self) -> str:  # file names: staleness-2x2-1gbit
        return f"{self.hosts}x{self.per_host}-{self.rate or 'unlimited'}" if self.emulated else ""

    def describe(self, cores: int) -> str:
        if not self.emulated:
            return f"{self.ranks} ranks on one host ({cores} cores)"
        return (f"{self.hosts} hosts x {self.per_host} ranks, links {self.rate or 'unlimited'} each way (network "
                f"namespaces on one {cores}-core machine, each host {cores // self.hosts or 1} core(s): "
                f"{self.ranks} ranks on {cores} cores, oversubscribed -- compare ratios, not absolute rates)")

    def __enter__(self):
        if self.emulated:
            sys.path.insert(0, str(ROOT))
            from launch.cluster import Cluster

            why = Cluster.unavailable()
            if why:
                sys.exit(f"staleness benchmark: cannot emulate hosts here: {why}")
            # Its own names and subnet: other users of launch/cluster.py may have theirs up.
            self.cluster = Cluster(self.hosts, rate=self.rate, prefix="st26", subnet="10.231.26").up()
        return self

    def __exit__(self, *exc):
        if self.cluster is not None:
            self.cluster.down()

    def mpirun(self, env_names) -> list[str]:
        cmd = ["mpirun", "-np", str(self.ranks), "--bind-to", "none"]
        cmd += ["-H", self.cluster.hosts_arg(self.per_host)] if self.cluster else ["--oversubscribe"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        for name in env_names:
            cmd += ["-x", name]
        return cmd

    def env(self, env: dict) -> dict:
        return self.cluster.env(env) if self.cluster else env


def run(model: str, system: str, slow_ms: float, workdir: Path, main: Path | None, setting: Setting,
        timeout=600) -> dict:
    """One training run; {"rate": samples/s, "max_lag": the largest lag rank 0's pulls saw}."""
    script, args, _ = MODELS[model]
    checkout = main if system == "main k=0" else ROOT
    env = setting.env(dict(os.environ, PYTHONPATH=str(checkout)))
    argv = [sys.executable, "-u", str(ROOT / "examples" / script), *args]
    if slow_ms:
        argv += ["--slow-ms", f"{slow_ms:.2f}"]
    if system.startswith("horovod"):
        argv.append("--horovod")
        env["OMPI_MCA_mpi_yield_when_idle"] = "1" if "yield" in system else "0"
    elif system.startswith("k="):
        config = workdir / f"{system.replace('=', '')}.yaml"
        config.write_text(f"defaults:\n  sparse: {{sync: ps, staleness: {int(system[2:])}}}\n")
        argv += ["--config", str(config)]
    else:  # main k=0: that checkout's engine, synchronous PS tables
        config = workdir / "main.yaml"
        config.write_text("defaults:\n  sparse: {sync: ps}\n")
        argv += ["--config", str(config)]
    names = ["PYTHONPATH"] + (["OMPI_MCA_mpi_yield_when_idle"] if "OMPI_MCA_mpi_yield_when_idle" in env else [])
    started = time.monotonic()
    done = subprocess.run(setting.mpirun(names) + argv, capture_output=True, text=True, env=env, cwd=checkout,
                          timeout=timeout)
    out = done.stdout + done.stderr
    found = RATE.search(out)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{model} / {system} failed (exit {done.returncode}):\n{out[-3000:]}")
    lags = [int(x) for x in MAX_LAG.findall(out)]
    return {"rate": float(found.group(1).replace(",", "")), "max_lag": max(lags) if lags else None,
            "wall_s": round(time.monotonic() - started, 1)}


def idle_cpu(seconds: float) -> list[float]:
    """The serving thread's CPU seconds per rank over `seconds` of a rank idle in Python."""
    cmd = Setting().mpirun(["PYTHONPATH"]) + [sys.executable, "-u", str(ROOT / "tests" / "parallel" / "test_staleness.py"),
                                    "rank_idle_serving_thread_cpu", str(seconds)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return [float(x) for x in re.findall(r"IDLE-CPU rank=\d+ serving thread ([0-9.]+) s", done.stdout)]


def systems(with_main: bool, straggler: bool, emulated: bool = False) -> list[str]:
    # On emulated hosts a run costs ~30-60 s: Horovod as shipped (its MPI threads busy-wait) runs
    # without a straggler only; with one, Horovod at its best (yield) stands for it.
    names = [f"k={k}" for k in KS] + ([] if emulated and straggler else ["horovod"]) + ["horovod yield"]
    return names + (["main k=0"] if with_main and not straggler else [])


def summarise(raw: list) -> list:
    groups = {}
    for r in raw:
        groups.setdefault((r["model"], r["straggler"], r["system"]), []).append(r)
    out = []
    for (model, straggler, system), runs in groups.items():
        lags = [r["max_lag"] for r in runs if r["max_lag"] is not None]
        out.append({"model": model, "straggler": straggler, "system": system, "runs": len(runs),
                    "samples_per_s": statistics.median(r["rate"] for r in runs),
                    "max_lag": max(lags) if lags else None, "slow_ms": runs[0]["slow_ms"]})
    for s in out:  # ratios within each (model, straggler) group
        peers = {p["system"]: p for p in out if (p["model"], p["straggler"]) == (s["model"], s["straggler"])}
        s["vs_k0"] = s["samples_per_s"] / peers["k=0"]["samples_per_s"] if "k=0" in peers else None
        s["vs_horovod_yield"] = (s["samples_per_s"] / peers["horovod yield"]["samples_per_s"]
                                 if "horovod yield" in peers else None)
    return out


def markdown(summary: list, meta: dict) -> str:
    setting = meta.get("setting", f"2 ranks on one host ({meta['host_cores']} cores)")  # (older JSON: one host)
    lines = [f"Bounded staleness, {setting}, medians of {meta['repeats']} "
             f"runs ({meta['date']}). Straggler: the last rank sleeps {meta['slow_fraction']:.0%} of hybridsync "
             "k=0's step time every step. max lag: the most steps of another rank that rank 0's pulls missed.", "",
             "| model | straggler | system | samples/s | vs k=0 | vs Horovod (yield) | max lag |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    order = {name: i for i, name in enumerate(systems(True, False))}
    for s in sorted(summary, key=lambda s: (s["model"], s["straggler"], order[s["system"]])):
        slow = f"{s['slow_ms']:.1f} ms/step" if s["straggler"] else "none"
        lag = "-" if s["max_lag"] is None else str(s["max_lag"])
        ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(f"| {s['model']} | {slow} | {s['system']} | {s['samples_per_s']:,.0f} | {ratio(s['vs_k0'])} | "
                     f"{ratio(s['vs_horovod_yield'])} | {lag} |")
    cpu = meta.get("idle_cpu_s")
    if cpu:
        lines += ["", f"Idle serving thread: {', '.join(f'{c:.3f}' for c in cpu)} s of CPU per rank over "
                      f"{meta['idle_s']:.0f} s of a rank sleeping in Python ({max(cpu) / meta['idle_s']:.1%} of a "
                      "core at most)."]
    return "\n".join(lines)


def plot(summary: list, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["model"], s["straggler"]) for s in summary})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.2), squeeze=False)
    order = systems(True, False)
    for ax, (model, straggler) in zip(axes[0], panels):
        rows = sorted((s for s in summary if (s["model"], s["straggler"]) == (model, straggler)),
                      key=lambda s: order.index(s["system"]))
        ax.bar([s["system"] for s in rows], [s["samples_per_s"] for s in rows],
               color=["tab:blue" if s["system"].startswith("k=") else "tab:gray" if "main" in s["system"]
                      else "tab:orange" for s in rows])
        ax.set_title(f"{model}, {'one rank slowed 30%' if straggler else 'no straggler'}", fontsize=10)
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="dlrm,word2vec")
    p.add_argument("--slow-fraction", type=float, default=0.3)
    p.add_argument("--main", type=Path, default=None, help="another checkout (e.g. /work/main): its engine at k=0")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of the idle-CPU measurement (0: skip)")
    p.add_argument("--hosts", default=None, metavar="HxR",
                   help="emulated hosts x ranks per host (e.g. 2x2; needs root); default: 2 ranks on this host")
    p.add_argument("--rate", default=None, help="with --hosts: each host link's rate, as tc spells it (1gbit)")
    p.add_argument("--steps-scale", type=float, default=1.0, help="multiplies every model's --steps")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/staleness[-HxR-RATE]")
    p.add_argument("--append", action="store_true",
                   help="add this invocation's repeats to OUT.json's runs (the straggler's sleep from there too): "
                        "the medians then span several invocations, each short")
    p.add_argument("--rerender", action="store_true", help="no runs: summarise OUT.json's runs again")
    args = p.parse_args()
    if args.hosts:
        hosts, per_host = (int(x) for x in args.hosts.lower().split("x"))
        setting = Setting(hosts, per_host, args.rate)
    else:
        setting = Setting()
    args.out = args.out or RESULTS / ("staleness" + (f"-{setting.label}" if setting.emulated else ""))
    if setting.emulated:
        args.idle_s = 0.0  # (measured on one host)
    if args.steps_scale != 1.0:
        for model, (script, margs, batch) in MODELS.items():
            at = margs.index("--steps") + 1
            margs[at] = str(max(10, int(int(margs[at]) * args.steps_scale)))
    models = args.models.split(",")
    raw, slow_ms, first = [], {}, 0
    previous = Path(f"{args.out}.json")
    if (args.append or args.rerender) and previous.exists():
        raw = json.loads(previous.read_text())["raw"]
        slow_ms = {r["model"]: r["slow_ms"] for r in raw if r["straggler"]}
        first = 1 + max(r["repeat"] for r in raw)
    if args.rerender:
        report(raw, json.loads(previous.read_text())["meta"], args.out, setting)
        return
    with tempfile.TemporaryDirectory() as tmp, setting:
        workdir = Path(tmp)
        for straggler in (False, True):
            for rep in range(first, first + args.repeats):
                for model in models:
                    for system in systems(args.main is not None, straggler, setting.emulated):
                        sleep = slow_ms[model] if straggler else 0.0
                        record = {"model": model, "system": system, "straggler": straggler, "repeat": rep,
                                  "slow_ms": sleep}
                        try:
                            got = run(model, system, sleep, workdir, args.main, setting)
                        except (RuntimeError, subprocess.TimeoutExpired) as e:  # recorded, not fatal
                            raw.append({**record, "error": str(e)[-1500:]})
                            print(f"{model:9s} {'straggler' if straggler else 'even':9s} {system:14s} FAILED: "
                                  f"{str(e)[-300:]}", flush=True)
                            continue
                        raw.append({**record, **got})
                        print(f"{model:9s} {'straggler' if straggler else 'even':9s} {system:14s} "
                              f"{got['rate']:>10,.0f} samples/s  max lag {got['max_lag']}", flush=True)
            if not straggler:  # the straggler's sleep: a fraction of hybridsync k=0's step time
                for model in (m for m in models if m not in slow_ms):
                    rate = statistics.median(r["rate"] for r in raw if r["model"] == model and r["system"] == "k=0"
                                             and "error" not in r)
                    slow_ms[model] = args.slow_fraction * 1000 * MODELS[model][2] * setting.ranks / rate
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": first + args.repeats,
            "host_cores": os.cpu_count(), "slow_fraction": args.slow_fraction, "main": str(args.main or ""),
            "sizes": {m: MODELS[m][1] for m in models}, "idle_s": args.idle_s,
            "setting": setting.describe(os.cpu_count()), "ranks": setting.ranks, "hosts": setting.hosts,
            "per_host": setting.per_host, "rate": setting.rate}
    if args.idle_s > 0:
        meta["idle_cpu_s"] = idle_cpu(args.idle_s)
    report(raw, meta, args.out, setting)


def report(raw: list, meta: dict, out: Path, setting: Setting) -> None:
    """Medians, table, plot: OUT.{md,json,png}; docs/staleness.md's section when OUT is in results/."""
    summary = summarise([r for r in raw if "error" not in r])
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(summary, meta)
    failed = [f"{r['model']} {r['system']}{' (straggler)' if r['straggler'] else ''}" for r in raw if "error" in r]
    if failed:
        text += "\n\nFailed runs (left out of the medians): " + ", ".join(failed)
    Path(f"{out}.md").write_text(text + "\n")
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "summary": summary, "raw": raw}, indent=1))
    plot(summary, Path(f"{out}.png"), title=meta["setting"] if setting.emulated else "")
    image = f"![staleness benchmark](../benchmarks/results/{out.name}.png)"
    if out.parent == RESULTS:
        update_docs(text + f"\n\n{image}", "staleness-" + setting.label if setting.emulated else "staleness")
    print(text)


def update_docs(text: str, marker: str) -> None:
    """Puts the table between docs/staleness.md's `<!-- MARKER:start/end -->` markers."""
    page = ROOT / "docs" / "staleness.md"
    body = page.read_text()
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if start in body and end in body:
        head, rest = body.split(start, 1)
        page.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()
