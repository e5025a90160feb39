"""Side-by-side benchmark: hybridsync vs Horovod vs torch DDP vs TorchRec on the Criteo-shaped workload.

    python benchmarks/bench.py              # `make bench`: 1, 2, 4 ranks, 3 repeats each
    python benchmarks/bench.py --quick      # a smoke run: fewer steps, 1 repeat
    python benchmarks/bench.py --compare ../old-checkout   # also runs that checkout's hybridsync
                                            # ("<system>@before"), interleaved in the same rounds

Each configuration runs under its own `mpirun` (benchmarks/run_one.py; TorchRec under torchrun,
benchmarks/torchrec_dlrm.py, in its own venv: scripts/torchrec-venv.sh), repeated in interleaved
rounds (the load average is printed and kept beside each round); medians are reported. Writes
benchmarks/results/latest.{json,md,png} (and a timestamped JSON copy), prints the tables and the
targets, and updates the tables in docs/performance.md (between its <!-- bench:start --> and
<!-- bench:end --> markers).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

try:
    from benchmarks import torchrec_launch  # imported as benchmarks.bench (network.py, auto.py, tests)
except ImportError:
    import torchrec_launch  # run as a script: its directory is first on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SYSTEMS = ["hybridsync-default", "hybridsync-ps", "hybridsync-sharded", "hybridsync-replicated", "horovod-allgather",
           "horovod-allgather-yield", "ddp-gloo", "torchrec-cpu"]
BASELINE = "horovod-allgather"  # Horovod as users run it: the baseline the targets are set against
TUNED = "horovod-allgather-yield"  # Horovod with OMPI_MCA_mpi_yield_when_idle=1, its best setting here
TORCHREC = torchrec_launch.SYSTEM  # TorchRec's DistributedModelParallel on CPU (benchmarks/torchrec_dlrm.py)
# The side-by-side table: what a team would pick today, next to hybridsync as it comes.
SIDE_BY_SIDE = [("hybridsync-default", "hybridsync default"), ("hybridsync-ps", "hybridsync PS (auto off)"),
                (TUNED, "Horovod at its best"), (TORCHREC, "TorchRec CPU")]
TORCHREC_PYTHON = None  # the TorchRec venv's python, checked before the first run (torchrec_launch.python)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpirun(ranks: int) -> list[str]:
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none"]
    return cmd + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


COMPARE_TREE = None  # --compare: another checkout whose hybridsync runs as "<system>@before"


def use_torchrec(explicit: str | None) -> None:
    """Finds and checks the TorchRec venv before the first run (not an hour in): exits with how
    to build it when it is missing or broken."""
    global TORCHREC_PYTHON
    try:
        TORCHREC_PYTHON = torchrec_launch.python(explicit)
    except torchrec_launch.TorchRecMissing as e:
        sys.exit(f"{Path(sys.argv[0]).name}: {e}")


def load_average() -> list[float]:
    """This machine's 1, 5 and 15 minute load averages (printed beside every round)."""
    return [round(x, 2) for x in os.getloadavg()]


def run(system, ranks, steps, warmup, global_ranks=0, timeout=900, cluster=None, per_host=1, extra=()):
    """One configuration under its own mpirun (TorchRec: torchrun); on `cluster`
    (launch/cluster.py), `per_host` ranks on each of its hosts, the bytes on each host's link counted."""
    if system == TORCHREC:
        if global_ranks:
            raise ValueError(f"{TORCHREC} has no single-process reference run")
        if cluster is not None:
            return torchrec_launch.run_cluster(TORCHREC_PYTHON, cluster, per_host, steps, warmup, timeout, extra)
        return torchrec_launch.run_local(TORCHREC_PYTHON, ranks, steps, warmup, timeout, extra)
    label, system, tree = system, system.split("@")[0], ROOT
    env = dict(os.environ)
    if label.endswith("@before"):  # the other checkout's package and run_one.py
        tree = COMPARE_TREE
        env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    launcher = mpirun(ranks)
    if cluster is not None:
        env = cluster.env(env)
        launcher += ["-H", cluster.hosts_arg(per_host)]
        extra = (*extra, "--wire-iface", "eth0")
    cmd = launcher + [sys.executable, str(tree / "benchmarks" / "run_one.py"), "--system", system,
                      "--steps", str(steps), "--warmup", str(warmup), "--port", str(free_port()), *extra]
    if global_ranks:
        cmd += ["--global-ranks", str(global_ranks)]
    scratch = None
    if system in ("hybridsync-sharded", "hybridsync-replicated") and tree == ROOT and not global_ranks and cluster is None:
        scratch = tempfile.mkdtemp(prefix="hybridsync-bench-ckpt-")  # checkpoint save/load, timed
        cmd += ["--checkpoint-dir", scratch]
    # '-yield': Horovod with waiting MPI calls yielding the core (its MPI controller thread
    # busy-waits otherwise). hybridsync sets this for itself; plain Horovod does not.
    env.pop("OMPI_MCA_mpi_yield_when_idle", None)
    if system.endswith("-yield"):
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"system": label, "ranks": ranks, "error": f"timed out after {timeout} s"}
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    found = re.search(r"BENCH-RESULT (\{.*\})", out.stdout)
    if out.returncode != 0 or not found:
        return {"system": label, "ranks": ranks, "error": (out.stdout + out.stderr)[-2000:]}
    return {**json.loads(found.group(1)), "system": label}


def run_separately(commands: list[list[str]], timeout: float = 900) -> list[dict] | str:
    """Starts every command at once, each a run_one.py job of its own (no MPI job joins them; give
    them run_one's --start-together so their timed steps overlap): their BENCH-RESULT dicts, in
    order, or what went wrong with the first that failed."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for cmd in commands]
    results = []
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                return f"timed out after {timeout} s"
            found = re.search(r"BENCH-RESULT (\{.*\})", out)
            if proc.returncode != 0 or not found:
                return out[-2000:]
            results.append(json.loads(found.group(1)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def plan_runs(args):
    """(kind, system, ranks, steps, warmup, global_ranks, round) of every run, in order; round is
    the interleaved round (None: the single-process references after them)."""
    # Repeats run in rounds of every configuration, so a slow spell of this noisy machine
    # lands on all systems alike instead of on every repeat of one.
    runs = []
    for round_ in range(args.repeats):
        # Each round starts with another system: whatever the run after a rank-count switch
        # pays (the previous job's teardown, a cold page cache) falls on each in turn.
        k = round_ % len(args.systems)
        systems = args.systems[k:] + args.systems[:k]
        for ranks in args.ranks:
            for system in systems:
                runs.append(("main", system, ranks, args.steps, args.warmup, 0, round_))
        if 2 in args.ranks and "horovod-sparse-as-dense" not in args.skip:
            runs.append(("main", "horovod-sparse-as-dense", 2, args.dense_steps, 3, 0, round_))
    for ranks in args.ranks:  # single-process references on the same global batches
        if ranks > 1:
            for system in (s for s in args.systems if not s.endswith("@before") and s != TORCHREC):
                runs.append(("reference", system, 1, args.steps, args.warmup, ranks, None))
    return runs


def compared(summary) -> list[str]:
    """'after vs before' lines: each hybridsync system against the --compare checkout's."""
    by = {(s["system"], s["ranks"]): s for s in summary}
    lines = []
    for (system, ranks), s in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        before = by.get((f"{system}@before", ranks))
        if before and s["samples_per_s"] and before["samples_per_s"]:
            lines.append(f"- {system} x{ranks}: {s['ms_per_step']:.2f} ms/step now vs {before['ms_per_step']:.2f} before "
                         f"= {s['samples_per_s'] / before['samples_per_s']:.3f}x the samples/s")
    return lines


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(raw):
    main = [r for r in raw if r.get("kind") == "main" and "error" not in r]
    refs = {(r["system"], r["global_ranks"]): r for r in raw if r.get("kind") == "reference" and "error" not in r}
    rows = {}
    for r in main:
        rows.setdefault((r["system"], r["ranks"]), []).append(r)
    summary = []
    for (system, ranks), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = {
            "system": system, "ranks": ranks, "repeats": len(rs),
            "samples_per_s": median([r["samples_per_s"] for r in rs]),
            "ms_per_step": median([r["ms_per_step"] for r in rs]),
            "peak_rss_per_rank": median([max(r["rss_per_rank"]) for r in rs]),
            "wrap_peak_rss_per_rank": median([max(r["wrap_peak_rss_per_rank"]) for r in rs
                                              if r.get("wrap_peak_rss_per_rank")]),
            "loss": median([r["loss"] for r in rs]),
            "ps_bytes_sent": median([r["ps_bytes_sent_per_rank_step"] for r in rs]),
            "ps_bytes_received": median([r["ps_bytes_received_per_rank_step"] for r in rs]),
            "unique_row_min": median([r["unique_row_min_bytes_per_rank_step"] for r in rs]),
            "table_bytes": rs[0]["table_bytes"],
        }
        if rs[-1].get("plan"):  # TorchRec: the sharding plan its planner chose
            s["plan"] = rs[-1]["plan"]
        checkpoints = [r["checkpoint"] for r in rs if r.get("checkpoint")]
        if checkpoints:
            s["checkpoint"] = {
                "save_s": median([c["save_s"] for c in checkpoints]),
                "load_s": median([c["load_s"] for c in checkpoints]),
                "bytes": median([c["bytes"] for c in checkpoints]),
                "peak_rss_growth_during_save": median([max(p - b for p, b in zip(c["rss_peak_save_per_rank"],
                                                                                 c["rss_before_save_per_rank"]))
                                                       for c in checkpoints]),
            }
        ref = refs.get((system, ranks))
        s["reference_loss"] = ref["loss"] if ref else None
        summary.append(s)
    by = {(s["system"], s["ranks"]): s for s in summary}
    for s in summary:
        one = by.get((s["system"], 1))
        s["scaling"] = s["samples_per_s"] / one["samples_per_s"] if one else None
        base = by.get((BASELINE, s["ranks"]))
        s["vs_horovod"] = s["samples_per_s"] / base["samples_per_s"] if base else None
        tuned = by.get((TUNED, s["ranks"]))
        s["vs_horovod_tuned"] = s["samples_per_s"] / tuned["samples_per_s"] if tuned else None
        s["rss_saved_vs_horovod"] = ((base["peak_rss_per_rank"] - s["peak_rss_per_rank"]) / s["table_bytes"]
                                     if base else None)
        s["bytes_over_min"] = (s["ps_bytes_sent"] / s["unique_row_min"]
                               if s["ps_bytes_sent"] and s["unique_row_min"] else None)
        s["loss_vs_reference"] = (s["loss"] / s["reference_loss"] - 1 if s["reference_loss"] else None)
    return summary


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(summary, meta) -> str:
    lines = [
        f"Measured {meta['date']} on {meta['machine']}; medians of {meta['repeats']} runs, {meta['steps']} timed steps each "
        f"(DLRM: 8 tables x 250k x 32, batch 512/rank, SGD). Scaling is vs the same system at 1 rank; "
        "'vs Horovod' is vs Horovod allgather as users run it, 'yield' vs Horovod with "
        "OMPI_MCA_mpi_yield_when_idle=1 (its best setting on this machine); RSS saved is vs Horovod "
        "allgather, in table sizes; 'at wrap' is the peak RSS once the model is built and wrapped, before training; "
        "PS bytes are sent per rank per step."
        + (f" SMOKE RUN: tables of {meta['rows']:,} rows, not the workload's." if meta.get("rows") else ""),
        "",
        "| system | ranks | samples/s | ms/step | scaling | vs Horovod | vs Horovod (yield) | peak RSS/rank | at wrap | RSS saved | PS bytes | / unique-row min | loss | vs 1-process |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        lines.append(
            f"| {s['system']} | {s['ranks']} | {fmt(s['samples_per_s'], ',.0f')} | {fmt(s['ms_per_step'], '.1f')} | "
            f"{fmt(s['scaling'], '.2f')}x | {fmt(s['vs_horovod'], '.2f')}x | {fmt(s['vs_horovod_tuned'], '.2f')}x | "
            f"{fmt(s['peak_rss_per_rank'] / 2**20, '.0f')} MiB | "
            f"{fmt(s['wrap_peak_rss_per_rank'] and s['wrap_peak_rss_per_rank'] / 2**20, '.0f')} MiB | "
            f"{fmt(s['rss_saved_vs_horovod'], '.2f')} | {fmt(s['ps_bytes_sent'] and s['ps_bytes_sent'] / 1024, '.1f')} KiB | "
            f"{fmt(s['bytes_over_min'], '.2f')} | {fmt(s['loss'], '.4f')} | "
            f"{fmt(s['loss_vs_reference'] and 100 * s['loss_vs_reference'], '+.2f')}% |")
    return "\n".join(lines)


def side_by_side(summary) -> str:
    """ms/step of what a team would pick today next to hybridsync as it comes, per rank count
    (scaling: samples/s over the same system's at 1 rank)."""
    by = {(s["system"], s["ranks"]): s for s in summary}
    columns = [(system, name) for system, name in SIDE_BY_SIDE if any(k[0] == system for k in by)]
    if not columns:
        return ""
    lines = ["", "", "Side by side, ms/step (medians of the interleaved rounds; scaling vs the same system at 1 rank):",
             "", "| ranks | " + " | ".join(name for _, name in columns) + " |",
             "| ---: | " + " | ".join("---:" for _ in columns) + " |"]
    for ranks in sorted({k[1] for k in by}):
        cells = []
        for system, _ in columns:
            s = by.get((system, ranks))
            if not s or s["ms_per_step"] is None:
                cells.append("-")
                continue
            scaling = f" ({s['scaling']:.2f}x)" if s["scaling"] and ranks > 1 else ""
            cells.append(f"{s['ms_per_step']:.2f} ms{scaling}")
        lines.append(f"| {ranks}{' (2 per core)' if ranks > (os.cpu_count() or ranks) else ''} | " + " | ".join(cells) + " |")
    plans = [(s["ranks"], s["plan"]) for s in summary if s.get("plan")]
    for ranks, plan in plans:
        kinds = sorted(set(re.findall(r"\|\s*(\w+_wise|data_parallel)\s*\|", plan)))
        lines.append(f"\nTorchRec's default planner at {ranks} rank(s): {', '.join(kinds) or 'see the JSON'}"
                     + (" sharding." if kinds else "."))
    return "\n".join(lines)


def rounds_table(raw) -> str:
    """The load average at the start of every interleaved round: a round run on a busy machine
    shows as such beside the medians."""
    rounds = {}
    for r in raw:
        if r.get("round") is not None and r.get("loadavg"):
            rounds.setdefault(r["round"], r["loadavg"])
    if not rounds:
        return ""
    listed = "; ".join(f"round {k + 1}: {' / '.join(f'{x:.2f}' for x in v)}" for k, v in sorted(rounds.items()))
    return f"\n\nLoad average (1 / 5 / 15 min) at the start of each round: {listed}."


def checkpoint_table(summary) -> str:
    rows = [s for s in summary if s.get("checkpoint")]
    if not rows:
        return ""
    lines = ["", "", "Checkpoints (hybridsync.save_checkpoint / load_checkpoint of the trained model, after the timed "
             "steps; medians; RSS growth is the largest of any rank's peak during the save over its RSS before it):", "",
             "| system | ranks | save s | load s | size | RSS growth during save |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in rows:
        c = s["checkpoint"]
        lines.append(f"| {s['system']} | {s['ranks']} | {c['save_s']:.2f} | {c['load_s']:.2f} | "
                     f"{c['bytes'] / 2**20:.0f} MiB | {c['peak_rss_growth_during_save'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def failures(raw) -> str:
    """A line naming every run that crashed, so a retried configuration stays visible."""
    counts = {}
    for r in raw:
        if r.get("kind", "").startswith("failed"):
            key = f"{r['system']} x{r['ranks']}" + (" (1-process reference)" if "reference" in r["kind"] else "")
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return "\n\nNo run crashed."
    listed = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
    return f"\n\nCrashed runs (retried; errors in the JSON): {listed}."


def targets(summary) -> list[tuple[str, bool | None, str]]:
    by = {(s["system"], s["ranks"]): s for s in summary}
    hs, hvd = "hybridsync-sharded", BASELINE
    out = []

    def check(name, ok, detail):
        out.append((name, ok, detail))

    # Against Horovod at its best setting here (yield_when_idle): 1 rank >= 0.95x, 2 ranks >= 1.35x.
    for n, need in ((1, 0.95), (2, 1.35)):
        s = by.get((hs, n))
        if s and s["vs_horovod_tuned"]:
            check(f"{n} rank(s) >= {need}x Horovod at its best (yield_when_idle)", s["vs_horovod_tuned"] >= need,
                  f"{s['vs_horovod_tuned']:.2f}x")
    s = by.get((hs, 4))
    if s and s["vs_horovod_tuned"]:
        check("4 ranks vs Horovod at its best (yield_when_idle)", None, f"{s['vs_horovod_tuned']:.2f}x")
    two = by.get((hs, 2))
    if two and two["scaling"]:
        check("2 ranks >= 1.6x own 1 rank", two["scaling"] >= 1.6, f"{two['scaling']:.2f}x")
    if two and two["vs_horovod"]:
        check("2 ranks >= 1.5x Horovod allgather", two["vs_horovod"] >= 1.5, f"{two['vs_horovod']:.2f}x")
    four = by.get((hs, 4))
    if four and four["vs_horovod"]:
        check("4 ranks >= 1.5x Horovod allgather", four["vs_horovod"] >= 1.5, f"{four['vs_horovod']:.2f}x")
    for n, need in ((2, 0.45), (4, 0.7)):
        s = by.get((hs, n))
        if s and s["rss_saved_vs_horovod"] is not None:
            check(f"RSS {n} ranks below Horovod by >= {need} tables", s["rss_saved_vs_horovod"] >= need,
                  f"{s['rss_saved_vs_horovod']:.2f} tables")
    for n in (2, 4):
        s = by.get((hs, n))
        if s and s["bytes_over_min"]:
            check(f"PS bytes {n} ranks <= 1.2x unique-row minimum", s["bytes_over_min"] <= 1.2, f"{s['bytes_over_min']:.3f}x")
        if s and s["loss_vs_reference"] is not None:
            check(f"loss {n} ranks within 1% of single process", abs(s["loss_vs_reference"]) <= 0.01,
                  f"{100 * s['loss_vs_reference']:+.3f}%")
    # Issue 39: the default path at 2 ranks within 0.9 of what 2 cores allow (2x one rank's samples/s).
    default_two = by.get(("hybridsync-default", 2))
    if default_two and default_two["scaling"]:
        check("hybridsync default, 2 ranks >= 1.8x own 1 rank (0.9 of the 2-core limit)",
              default_two["scaling"] >= 1.8, f"{default_two['scaling']:.2f}x")
    for n in sorted({k[1] for k in by}):
        mine, theirs = by.get(("hybridsync-default", n)), by.get((TORCHREC, n))
        if mine and theirs and mine["samples_per_s"] and theirs["samples_per_s"]:
            check(f"hybridsync default vs TorchRec CPU at {n} rank(s)", None,
                  f"{mine['samples_per_s'] / theirs['samples_per_s']:.2f}x the samples/s")
    return out


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    systems = sorted({s["system"] for s in summary})
    for system in systems:
        rows = sorted((s for s in summary if s["system"] == system), key=lambda s: s["ranks"])
        ranks = [s["ranks"] for s in rows]
        ax1.plot(ranks, [s["samples_per_s"] for s in rows], marker="o", label=system)
        ax2.plot(ranks, [s["peak_rss_per_rank"] / 2**20 for s in rows], marker="o", label=system)
    ax1.set(title="Throughput (higher is better)", xlabel="ranks", ylabel="samples/s")
    ax2.set(title="Peak RSS per rank (lower is better)", xlabel="ranks", ylabel="MiB")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({s["ranks"] for s in summary}))
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PERFORMANCE_PAGE = ROOT / "docs" / "performance.md"


def update_docs(section: str, text: str, page: Path = PERFORMANCE_PAGE) -> None:
    """Replaces what `page` (docs/performance.md) holds between `<!-- section:start -->` and
    `<!-- section:end -->` (bench, bench-network, bench-auto, ...) with `text`."""
    body = page.read_text()
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    if start not in body or end not in body:
        print(f"{page.relative_to(ROOT)} has no {start} ... {end} markers: not updated", file=sys.stderr)
        return
    head, rest = body.split(start, 1)
    page.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")
    print(f"updated {page.relative_to(ROOT)} ({section})")


def results_image(alt: str, name: str) -> str:
    """A markdown image of benchmarks/results/<name>, as docs/performance.md links it."""
    return f"![{alt}](../benchmarks/results/{name})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--dense-steps", type=int, default=15, help="steps of horovod-sparse-as-dense (slow)")
    p.add_argument("--skip", default="", help="comma-separated extra systems to skip")
    p.add_argument("--quick", action="store_true",
                   help="1 repeat, 60 steps: a smoke run (writes results/quick.*, never latest.*)")
    p.add_argument("--rows", type=int, default=None,
                   help="rows per table (default: the workload's 250,000); smaller for smoke tests")
    p.add_argument("--name", default=None, help="results/<name>.{json,md,png} (default: latest; --quick: quick)")
    p.add_argument("--torchrec-python", default=None,
                   help=f"the TorchRec venv's python for system {TORCHREC!r} (default: $HYBRIDSYNC_TORCHREC_PYTHON, "
                        "else ~/.cache/hybridsync/torchrec-venv/bin/python; scripts/torchrec-venv.sh builds it)")
    p.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true",
                   help="leave docs/performance.md as it is")
    p.add_argument("--retries", type=int, default=2, help="re-runs of a run that crashed (each failure is reported)")
    p.add_argument("--rerender", action="store_true",
                   help="no runs: summarise benchmarks/results/<name>.json's runs again (tables, targets, docs page)")
    p.add_argument("--compare", metavar="CHECKOUT", help="also run this checkout's hybridsync systems as "
                   "'<system>@before' (its C++ extension built in place), in the same interleaved rounds")
    args = p.parse_args()
    args.ranks = [int(x) for x in args.ranks.split(",")]
    args.systems = args.systems.split(",")
    args.skip = args.skip.split(",")
    if args.quick:
        args.repeats, args.steps, args.warmup, args.dense_steps = 1, 60, 10, 5
    args.name = args.name or ("quick" if args.quick else "latest")
    extra = ("--rows", str(args.rows)) if args.rows else ()
    if TORCHREC in args.systems and not args.rerender:
        use_torchrec(args.torchrec_python)
    if args.compare:
        global COMPARE_TREE
        COMPARE_TREE = Path(args.compare).resolve()
        args.systems += [f"{s}@before" for s in args.systems if s.startswith("hybridsync")]

    runs = [] if args.rerender else plan_runs(args)
    raw = []
    if args.rerender:
        previous = json.loads((RESULTS / f"{args.name}.json").read_text())
        raw, args.compare = previous["runs"], previous.get("compared_with")
        args.repeats, args.steps = previous["meta"]["repeats"], previous["meta"]["steps"]
    current_round = -1
    for kind, system, ranks, steps, warmup, global_ranks, round_ in tqdm(runs, desc="benchmark runs", unit="run"):
        if round_ is not None and round_ != current_round:
            current_round = round_
            tqdm.write(f"round {round_ + 1}/{args.repeats}: load average {' / '.join(map(str, load_average()))}")
        # A crashed run is retried, and kept in the results as a failure so it is never hidden
        # (torch's own DDP over Gloo intermittently corrupts its heap at 1 rank with sparse grads).
        for attempt in range(1 + args.retries):
            loadavg = load_average()
            result = run(system, ranks, steps, warmup, global_ranks, extra=extra)
            result.update(kind=kind if "error" not in result else f"failed-{kind}", round=round_, loadavg=loadavg)
            raw.append(result)
            if "error" not in result:
                break
            tqdm.write(f"FAILED {system} x{ranks} (attempt {attempt + 1}): {result['error'][-500:]}")
    summary = summarise(raw)
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores",
            "repeats": args.repeats, "steps": args.steps}
    if args.rerender:
        meta["date"] = previous["meta"]["date"]
    if args.rows:
        meta["rows"] = args.rows
    table = (markdown(summary, meta) + side_by_side(summary) + rounds_table(raw) + checkpoint_table(summary)
             + failures(raw))
    checks = targets(summary)
    RESULTS.mkdir(parents=True, exist_ok=True)
    before_lines = compared(summary)
    payload = {"meta": meta, "summary": summary, "targets": [{"target": n, "met": ok, "measured": d} for n, ok, d in checks],
               "compared_with": args.compare, "after_vs_before": before_lines, "runs": raw}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stamped = [] if args.rerender or args.name != "latest" else [f"bench-{stamp}.json"]
    for name in stamped + [f"{args.name}.json"]:
        (RESULTS / name).write_text(json.dumps(payload, indent=2))
    target_lines = "\n".join(f"- {'met' if ok else ('MISSED' if ok is False else 'info')}: {n} ({d})"
                             for n, ok, d in checks)
    (RESULTS / f"{args.name}.md").write_text(table + "\n\nTargets:\n\n" + target_lines + "\n")
    plot(summary, RESULTS / f"{args.name}.png")
    print(table)
    print("\nTargets:\n" + target_lines)
    if before_lines:
        print(f"\nThis checkout vs {args.compare} (same run, interleaved):\n" + "\n".join(before_lines))
    print(f"\nwrote {RESULTS / args.name}.json, .md, .png")
    if not args.no_docs and not args.quick and args.name == "latest" and not args.rows:
        update_docs("bench", table + "\n\n" + target_lines + "\n\n" + results_image("throughput and memory", "latest.png"))


if __name__ == "__main__":
    main()
