"""The README's headline table, from the side-by-side benchmarks' results (no measuring of its own).

    python benchmarks/headline.py                # README.md between <!-- headline:start/end -->
    python benchmarks/headline.py --print        # the table only
    python benchmarks/headline.py --hybridsync hybridsync-sharded   # another hybridsync column
    python benchmarks/headline.py --bench torchrec-side-by-side.json --network network-torchrec.json  # other runs

Reads benchmarks/results/latest.json (benchmarks/bench.py: 2 and 4 ranks on one host, memory) and
network.json (benchmarks/network.py: 2 hosts x 2 ranks at 1 Gbit). A system a results file does
not have (TorchRec before a run that included it) shows as "not yet measured"; a Horovod column
that neither file has is left out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench import BASELINE, RESULTS, ROOT, TORCHREC, TUNED, update_docs  # noqa: E402

MISSING = "not yet measured"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def table(hybridsync: str, bench: dict | None, network: dict | None) -> str:
    one_host = {(s["system"], s["ranks"]): s for s in (bench or {}).get("summary", [])}
    links = {(s["rate"], s["per_host"], s["system"]): s for s in (network or {}).get("summary", [])}
    measured = {system for system, _ in one_host} | {system for _, _, system in links}
    # A baseline neither run measured is left out rather than shown as a column of gaps.
    columns = [hybridsync] + [s for s in (BASELINE, TUNED, TORCHREC) if s in measured or s == TORCHREC]
    titles = {BASELINE: "Horovod allgather", TUNED: "Horovod at its best", TORCHREC: "TorchRec CPU"}

    def rate(s):
        return f"{s['samples_per_s']:,.0f}" if s and s.get("samples_per_s") else MISSING

    def versus(mine, others):
        """hybridsync over the fastest measured baseline of the row."""
        best = max((o["samples_per_s"] for o in others if o and o.get("samples_per_s")), default=None)
        return f"{mine['samples_per_s'] / best:.2f}x" if mine and mine.get("samples_per_s") and best else "-"

    rows = []
    for label, pick in (("2 ranks, one host", lambda system: one_host.get((system, 2))),
                        ("4 ranks, one host (2 per core)", lambda system: one_host.get((system, 4))),
                        ("2 hosts x 2 ranks, 1 Gbit links", lambda system: links.get(("1gbit", 2, system)))):
        found = [pick(system) for system in columns]
        best = [s for system, s in zip(columns, found) if system in (TUNED, TORCHREC)]
        rows.append(f"| {label} | " + " | ".join(rate(s) for s in found) + f" | {versus(found[0], best)} |")
    memory = [one_host.get((system, 4)) for system in columns]
    mib = [f"{s['peak_rss_per_rank'] / 2**20:,.0f} MiB" if s else MISSING for s in memory]
    saved = memory[0]["rss_saved_vs_horovod"] if memory[0] and memory[0].get("rss_saved_vs_horovod") is not None else None
    rows.append("| peak memory per rank, 4 ranks | " + " | ".join(mib)
                + f" | {f'{saved:.2f} tables less' if saved is not None else '-'} |")
    repeats = (bench or {}).get("meta", {}).get("repeats", "?")
    rounds = (network or {}).get("meta", {}).get("repeats", "?")
    head = (f"Criteo-shaped DLRM (8 tables x 250,000 x 32, batch 512 per rank, SGD) on one 2-core machine;\n"
            f"samples/s, medians of {repeats} runs (network mode: {rounds} rounds). \"Horovod at its best\" is Horovod "
            "allgather\nwith `OMPI_MCA_mpi_yield_when_idle=1`; TorchRec is its DistributedModelParallel on CPU "
            "(benchmarks/torchrec_dlrm.py).\n\"vs best\" is hybridsync over the faster of Horovod at its best and "
            "TorchRec; memory: tables' worth less than Horovod.")
    header = " | ".join([f"hybridsync ({hybridsync.removeprefix('hybridsync-')})"] + [titles[s] for s in columns[1:]])
    return "\n".join([head, "", f"| setting | {header} | vs best |", "| --- |" + " ---: |" * (len(columns) + 1), *rows])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hybridsync", default="hybridsync-default",
                   help="the hybridsync system of the first column (default: what a script gets as written)")
    p.add_argument("--print", action="store_true", help="print the table; leave README.md as it is")
    p.add_argument("--bench", default="latest.json", help="benchmarks/results/ file of the one-host rows (bench.py)")
    p.add_argument("--network", default="network.json", help="benchmarks/results/ file of the 2-host row (network.py)")
    args = p.parse_args()
    text = table(args.hybridsync, load(args.bench), load(args.network))
    if args.print:
        print(text)
        return
    update_docs("headline", text, page=ROOT / "README.md")


if __name__ == "__main__":
    main()
